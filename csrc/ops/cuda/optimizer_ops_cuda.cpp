// CUDA implementations of hydra::adam_step and hydra::sgd_step: the same checks as on CPU, then one
// kernel launch on the caller's current stream.
// CPU-only torch wheels ship the c10/cuda headers but not CMake's generated cuda_cmake_macros.h, whose
// only definition (C10_CUDA_BUILD_SHARED_LIBS) matters for Windows DLL exports; without it this file
// still compiles, identically, against such a wheel.
#if !__has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define C10_CUDA_NO_CMAKE_CONFIGURE_FILE
#endif

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda/fused_optimizers.cuh"
#include "ops/optimizer_checks.h"

namespace hydra::ops {
namespace {

void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& shadow, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step, double grad_scale, bool decoupled) {
  check_adam_args(param, grad, exp_avg, exp_avg_sq, shadow, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const kernels::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled};
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const cudaError_t error =
      grad.scalar_type() == at::kBFloat16
          ? kernels::cuda::launch_adam_step(p, reinterpret_cast<const uint16_t*>(grad.data_ptr()), m, v,
                                            shadow_bits(shadow), param.numel(), hyper, stream)
          : kernels::cuda::launch_adam_step(p, grad.data_ptr<float>(), m, v, shadow_bits(shadow), param.numel(), hyper,
                                            stream);
  C10_CUDA_CHECK(error);
}

void sgd_step_cuda(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& momentum_buffer,
                   const std::optional<at::Tensor>& shadow, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool first_step, double grad_scale) {
  check_sgd_args(param, grad, momentum_buffer, shadow, lr, momentum, dampening, weight_decay, nesterov, grad_scale);
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const kernels::SgdHyper hyper{lr, momentum, dampening, weight_decay, nesterov, first_step, grad_scale};
  float* p = param.data_ptr<float>();
  float* buf = momentum != 0.0 ? momentum_buffer->data_ptr<float>() : nullptr;
  const cudaError_t error =
      grad.scalar_type() == at::kBFloat16
          ? kernels::cuda::launch_sgd_step(p, reinterpret_cast<const uint16_t*>(grad.data_ptr()), buf,
                                           shadow_bits(shadow), param.numel(), hyper, stream)
          : kernels::cuda::launch_sgd_step(p, grad.data_ptr<float>(), buf, shadow_bits(shadow), param.numel(), hyper,
                                           stream);
  C10_CUDA_CHECK(error);
}

}  // namespace

TORCH_LIBRARY_IMPL(hydra, CUDA, m) {
  m.impl("adam_step", &adam_step_cuda);
  m.impl("sgd_step", &sgd_step_cuda);
}

}  // namespace hydra::ops
