// Per-call constants of the fused optimizer kernels, derived from the hyperparameters once on the host and
// shared by the CPU and CUDA kernels so both round every scalar the same way.
#pragma once

#include <cmath>

#include "ops/kernels/fused_optimizers.h"

namespace hydra::kernels {

// Scalars converted exactly as ATen converts Python floats for float32 tensors: computed in double,
// then rounded once to float.
struct AdamScalars {
  float grad_scale, decay, l2, lerp_coeff, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
  bool use_l2, lerp_weight_small;

  explicit AdamScalars(const AdamHyper& h) {
    grad_scale = static_cast<float>(h.grad_scale);
    const bool has_decay = h.weight_decay != 0.0;
    decay = static_cast<float>(h.decoupled && has_decay ? 1.0 - h.lr * h.weight_decay : 1.0);
    use_l2 = !h.decoupled && has_decay;
    l2 = static_cast<float>(h.weight_decay);
    // exp_avg.lerp_(grad, 1 - beta1): ATen's vectorised lerp is fma(w, end - start, start) for |w| < 0.5
    // and fma(w - 1, end - start, end) otherwise.
    const float weight = static_cast<float>(1.0 - h.beta1);
    lerp_weight_small = std::abs(weight) < 0.5f;
    lerp_coeff = lerp_weight_small ? weight : weight - 1.0f;
    beta2 = static_cast<float>(h.beta2);
    one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    const double step = static_cast<double>(h.step);
    const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
    bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
    eps = static_cast<float>(h.eps);
    neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  }
};

struct SgdScalars {
  float grad_scale, weight_decay, momentum, one_minus_dampening, neg_lr;
  bool use_weight_decay, nesterov;

  explicit SgdScalars(const SgdHyper& h)
      : grad_scale(static_cast<float>(h.grad_scale)),
        weight_decay(static_cast<float>(h.weight_decay)),
        momentum(static_cast<float>(h.momentum)),
        one_minus_dampening(static_cast<float>(1.0 - h.dampening)),
        neg_lr(static_cast<float>(-h.lr)),
        // torch skips the decay term when it is zero; adding 0 * p would turn an infinite p into NaN.
        use_weight_decay(h.weight_decay != 0.0),
        nesterov(h.nesterov) {}
};

}  // namespace hydra::kernels
