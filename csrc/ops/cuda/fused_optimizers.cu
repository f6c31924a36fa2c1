// Explicitly rounded intrinsics (__fmul_rn, __fadd_rn, __fmaf_rn, ...) pin down the operation order: nvcc
// would otherwise contract a*b+c freely, and the results should match the CPU kernels, not drift from them.
#include "ops/cuda/fused_optimizers.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/kernels/optimizer_scalars.h"

namespace hydra::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Enough resident blocks to saturate any current GPU; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = 8192;

int blocks_for(int64_t numel) { return static_cast<int>(std::min((numel + kThreads - 1) / kThreads, kMaxBlocks)); }

__device__ __forceinline__ float load_grad(const float* grad, int64_t i) { return grad[i]; }
__device__ __forceinline__ float load_grad(const uint16_t* grad, int64_t i) {
  return __bfloat162float(__ushort_as_bfloat16(grad[i]));
}

__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

template <typename Grad>
__global__ void adam_kernel(float* __restrict__ param, const Grad* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, uint16_t* __restrict__ shadow, int64_t numel,
                            AdamScalars s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    float g = __fmul_rn(load_grad(grad, i), s.grad_scale);
    float p = __fmul_rn(param[i], s.decay);
    if (s.use_l2) g = __fmaf_rn(p, s.l2, g);
    const float m_old = exp_avg[i];
    const float m = __fmaf_rn(s.lerp_coeff, __fsub_rn(g, m_old), s.lerp_weight_small ? m_old : g);
    const float v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if (shadow != nullptr) shadow[i] = to_bf16_bits(p);
  }
}

template <typename Grad>
__global__ void sgd_kernel(float* __restrict__ param, const Grad* __restrict__ grad, float* __restrict__ buf,
                           uint16_t* __restrict__ shadow, int64_t numel, SgdScalars s, bool first_step) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    const float g = __fmul_rn(load_grad(grad, i), s.grad_scale);
    float p = param[i];
    float d = s.use_weight_decay ? __fmaf_rn(p, s.weight_decay, g) : g;
    if (buf != nullptr) {
      const float b = first_step ? d : __fmaf_rn(d, s.one_minus_dampening, __fmul_rn(buf[i], s.momentum));
      buf[i] = b;
      d = s.nesterov ? __fmaf_rn(b, s.momentum, d) : b;
    }
    p = __fmaf_rn(d, s.neg_lr, p);
    param[i] = p;
    if (shadow != nullptr) shadow[i] = to_bf16_bits(p);
  }
}

template <typename Grad>
cudaError_t launch_adam(float* param, const Grad* grad, float* exp_avg, float* exp_avg_sq, uint16_t* shadow,
                        int64_t numel, const AdamHyper& h, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  adam_kernel<<<blocks_for(numel), kThreads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, shadow, numel,
                                                         AdamScalars(h));
  return cudaGetLastError();
}

template <typename Grad>
cudaError_t launch_sgd(float* param, const Grad* grad, float* buf, uint16_t* shadow, int64_t numel, const SgdHyper& h,
                       cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  float* used_buf = h.momentum != 0.0 ? buf : nullptr;
  sgd_kernel<<<blocks_for(numel), kThreads, 0, stream>>>(param, grad, used_buf, shadow, numel, SgdScalars(h),
                                                        h.first_step);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* shadow_bf16,
                             int64_t numel, const AdamHyper& h, cudaStream_t stream) {
  return launch_adam(param, grad, exp_avg, exp_avg_sq, shadow_bf16, numel, h, stream);
}

cudaError_t launch_adam_step(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq,
                             uint16_t* shadow_bf16, int64_t numel, const AdamHyper& h, cudaStream_t stream) {
  return launch_adam(param, grad_bf16, exp_avg, exp_avg_sq, shadow_bf16, numel, h, stream);
}

cudaError_t launch_sgd_step(float* param, const float* grad, float* momentum_buf, uint16_t* shadow_bf16, int64_t numel,
                            const SgdHyper& h, cudaStream_t stream) {
  return launch_sgd(param, grad, momentum_buf, shadow_bf16, numel, h, stream);
}

cudaError_t launch_sgd_step(float* param, const uint16_t* grad_bf16, float* momentum_buf, uint16_t* shadow_bf16,
                            int64_t numel, const SgdHyper& h, cudaStream_t stream) {
  return launch_sgd(param, grad_bf16, momentum_buf, shadow_bf16, numel, h, stream);
}

}  // namespace hydra::kernels::cuda
