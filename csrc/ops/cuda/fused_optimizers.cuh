// Fused Adam/AdamW and SGD updates on the GPU, free of torch like their CPU counterparts: the same
// formulas, the same scalars (ops/kernels/optimizer_scalars.h), one grid-stride pass over the buffers.
// Launches are asynchronous on `stream`; the returned error covers the launch only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/kernels/fused_optimizers.h"

namespace hydra::kernels::cuda {

// grad is float32 or bfloat16 (raw bits); shadow_bf16 may be null.
cudaError_t launch_adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
                             int64_t numel, const AdamHyper& h, cudaStream_t stream);
cudaError_t launch_adam_step(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq,
                             uint16_t* shadow_bf16, int64_t numel, const AdamHyper& h, cudaStream_t stream);

// momentum_buf may be null only when h.momentum == 0.
cudaError_t launch_sgd_step(float* param, const float* grad, float* momentum_buf, uint16_t* shadow_bf16, int64_t numel,
                            const SgdHyper& h, cudaStream_t stream);
cudaError_t launch_sgd_step(float* param, const uint16_t* grad_bf16, float* momentum_buf, uint16_t* shadow_bf16,
                            int64_t numel, const SgdHyper& h, cudaStream_t stream);

}  // namespace hydra::kernels::cuda
