// One pass over memory per update: every element's param/grad/state is loaded once and stored once,
// which is what makes the fused step cheaper than torch.optim's chain of whole-tensor operations.
//
// Exactness: each arithmetic step mirrors the ATen CPU kernel that torch.optim would run (vectorised
// path), including where ATen fuses a multiply-add (Tensor.add with alpha, lerp, addcmul) and where it
// does not (addcdiv, mul). Hence contraction of the remaining a*b+c into FMAs must stay off, and no
// -ffast-math: either would change the last bit and drift from torch over many steps.
// std::sqrt vectorises only under -fno-math-errno (setup.py passes it; GCC ignores it in pragmas).
// Without it the Adam loops stay scalar: slower, same results.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "ops/kernels/fused_optimizers.h"
#include "ops/kernels/multiversion.h"
#include "ops/kernels/optimizer_scalars.h"

#include <cmath>
#include <utility>

namespace hydra::kernels {
namespace {

// Loop-invariant choices are template parameters, one loop per combination: GCC will not vectorise a
// select whose condition is a scalar bool, and an unvectorised loop is several times slower.
namespace adam_variant {
constexpr unsigned kShadow = 1, kL2 = 2, kLerpWeightSmall = 4, kCount = 8;
constexpr auto kAll = std::make_integer_sequence<unsigned, kCount>();
}

template <unsigned kVariant, typename Grad>
HYDRA_ALWAYS_INLINE void adam_loop(float* __restrict param, const Grad* __restrict grad, float* __restrict exp_avg,
                                   float* __restrict exp_avg_sq, uint16_t* __restrict shadow, int64_t begin,
                                   int64_t end, const AdamScalars& s) {
  constexpr bool kShadow = kVariant & adam_variant::kShadow;
  constexpr bool kL2 = kVariant & adam_variant::kL2;
  constexpr bool kLerpWeightSmall = kVariant & adam_variant::kLerpWeightSmall;
  for (int64_t i = begin; i < end; ++i) {
    float g = as_float(grad[i]) * s.grad_scale;
    float p = param[i] * s.decay;
    if constexpr (kL2) g = __builtin_fmaf(p, s.l2, g);
    const float m_old = exp_avg[i];
    const float m = __builtin_fmaf(s.lerp_coeff, g - m_old, kLerpWeightSmall ? m_old : g);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2): ATen's addcmul computes
    // self + (value * t1) * t2, which its compiler contracts to one FMA.
    const float v = __builtin_fmaf(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    p = p + s.neg_step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if constexpr (kShadow) shadow[i] = float_to_bf16_rne(p);
  }
}

template <typename Grad, unsigned... kVariants>
HYDRA_ALWAYS_INLINE void adam_dispatch(std::integer_sequence<unsigned, kVariants...>, float* param, const Grad* grad,
                                       float* exp_avg, float* exp_avg_sq, uint16_t* shadow, int64_t begin,
                                       int64_t end, const AdamHyper& h) {
  const AdamScalars s(h);
  const unsigned variant = (shadow != nullptr ? adam_variant::kShadow : 0u) | (s.use_l2 ? adam_variant::kL2 : 0u) |
                           (s.lerp_weight_small ? adam_variant::kLerpWeightSmall : 0u);
  ((variant == kVariants && (adam_loop<kVariants>(param, grad, exp_avg, exp_avg_sq, shadow, begin, end, s), true)) ||
   ...);
}

namespace sgd_variant {
constexpr unsigned kShadow = 1, kWeightDecay = 2, kNesterov = 4;
// Two bits: no momentum, first step (buffer := gradient), running buffer.
constexpr unsigned kMomentumShift = 3, kNoMomentum = 0, kFirstStep = 1, kRunning = 2, kCount = 3 << kMomentumShift;
constexpr auto kAll = std::make_integer_sequence<unsigned, kCount>();
}

template <unsigned kVariant, typename Grad>
HYDRA_ALWAYS_INLINE void sgd_loop(float* __restrict param, const Grad* __restrict grad, float* __restrict buf,
                                  uint16_t* __restrict shadow, int64_t begin, int64_t end, const SgdScalars& s) {
  constexpr bool kShadow = kVariant & sgd_variant::kShadow;
  constexpr bool kWeightDecay = kVariant & sgd_variant::kWeightDecay;
  constexpr bool kNesterov = kVariant & sgd_variant::kNesterov;
  constexpr unsigned kMomentum = kVariant >> sgd_variant::kMomentumShift;
  for (int64_t i = begin; i < end; ++i) {
    const float g = as_float(grad[i]) * s.grad_scale;
    float p = param[i];
    // torch skips a zero decay term: adding 0 * p would turn an infinite p into NaN.
    float d = kWeightDecay ? __builtin_fmaf(p, s.weight_decay, g) : g;
    if constexpr (kMomentum != sgd_variant::kNoMomentum) {
      float b = d;
      if constexpr (kMomentum == sgd_variant::kRunning) b = __builtin_fmaf(d, s.one_minus_dampening, buf[i] * s.momentum);
      buf[i] = b;
      d = kNesterov ? __builtin_fmaf(b, s.momentum, d) : b;
    }
    p = __builtin_fmaf(d, s.neg_lr, p);
    param[i] = p;
    if constexpr (kShadow) shadow[i] = float_to_bf16_rne(p);
  }
}

template <typename Grad, unsigned... kVariants>
HYDRA_ALWAYS_INLINE void sgd_dispatch(std::integer_sequence<unsigned, kVariants...>, float* param, const Grad* grad,
                                      float* buf, uint16_t* shadow, int64_t begin, int64_t end, const SgdHyper& h) {
  const SgdScalars s(h);
  const unsigned momentum = h.momentum == 0.0 ? sgd_variant::kNoMomentum
                            : h.first_step    ? sgd_variant::kFirstStep
                                              : sgd_variant::kRunning;
  const unsigned variant = (shadow != nullptr ? sgd_variant::kShadow : 0u) |
                           (s.use_weight_decay ? sgd_variant::kWeightDecay : 0u) |
                           (s.nesterov && momentum != sgd_variant::kNoMomentum ? sgd_variant::kNesterov : 0u) |
                           (momentum << sgd_variant::kMomentumShift);
  ((variant == kVariants && (sgd_loop<kVariants>(param, grad, buf, shadow, begin, end, s), true)) || ...);
}

}  // namespace

HYDRA_MULTIVERSION
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
               int64_t begin, int64_t end, const AdamHyper& h) {
  adam_dispatch(adam_variant::kAll, param, grad, exp_avg, exp_avg_sq, shadow_bf16, begin, end, h);
}

HYDRA_MULTIVERSION
void adam_step(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
               int64_t begin, int64_t end, const AdamHyper& h) {
  adam_dispatch(adam_variant::kAll, param, grad_bf16, exp_avg, exp_avg_sq, shadow_bf16, begin, end, h);
}

HYDRA_MULTIVERSION
void sgd_step(float* param, const float* grad, float* momentum_buf, uint16_t* shadow_bf16, int64_t begin,
              int64_t end, const SgdHyper& h) {
  sgd_dispatch(sgd_variant::kAll, param, grad, momentum_buf, shadow_bf16, begin, end, h);
}

HYDRA_MULTIVERSION
void sgd_step(float* param, const uint16_t* grad_bf16, float* momentum_buf, uint16_t* shadow_bf16, int64_t begin,
              int64_t end, const SgdHyper& h) {
  sgd_dispatch(sgd_variant::kAll, param, grad_bf16, momentum_buf, shadow_bf16, begin, end, h);
}

}  // namespace hydra::kernels
