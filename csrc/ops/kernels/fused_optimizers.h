// Fused single-pass Adam/AdamW and SGD updates over flat float32 buffers, free of torch so the core
// library and its tests build without LibTorch. Each call handles the element range [begin, end); the
// caller splits the buffer across threads. Results agree with torch.optim's single-tensor CPU path:
// the same float32 operations in the same order, with the same fused multiply-adds where ATen uses them.
// SGD is bit-identical. Adam differs only through sqrt: ours is IEEE (correctly rounded), ATen's
// vectorised sqrt in MKL builds is off by one ulp for some inputs, so results agree to a few ulps.
#pragma once

#include <cstdint>

#include "ops/kernels/bfloat16.h"

namespace hydra::kernels {

struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;       // 1-based count of this update, as torch.optim's state["step"] after its increment
  double grad_scale;  // multiplies the gradient before anything else; 1.0 leaves it unchanged
  bool decoupled;     // true: AdamW (decay the parameter); false: Adam (L2 term added to the gradient)
};

struct SgdHyper {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool first_step;  // the momentum buffer is uninitialised and is set to the gradient, as torch does
  double grad_scale;
};

// grad is float32 or bfloat16 (raw bits). shadow, when not null, receives bf16(param) after the update.
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
               int64_t begin, int64_t end, const AdamHyper& h);
void adam_step(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
               int64_t begin, int64_t end, const AdamHyper& h);

// momentum_buf may be null only when h.momentum == 0.
void sgd_step(float* param, const float* grad, float* momentum_buf, uint16_t* shadow_bf16, int64_t begin,
              int64_t end, const SgdHyper& h);
void sgd_step(float* param, const uint16_t* grad_bf16, float* momentum_buf, uint16_t* shadow_bf16, int64_t begin,
              int64_t end, const SgdHyper& h);

}  // namespace hydra::kernels
