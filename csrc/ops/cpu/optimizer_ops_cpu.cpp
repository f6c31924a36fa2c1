// CPU implementations of hydra::adam_step and hydra::sgd_step: validate, then split the flat buffers
// across threads and run the torch-free fused kernels on each slice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/kernels/fused_optimizers.h"
#include "ops/optimizer_checks.h"

namespace hydra::ops {
namespace {

// Large enough that a slice (~3.5 MB of traffic for AdamW) amortises waking a thread, small enough that
// mid-sized tensors still use every core. Slices are multiples of 64 floats so vector loops start aligned.
constexpr int64_t kGrainElements = 1 << 17;
constexpr int64_t kSliceAlignment = 64;

template <typename Fn>
void for_each_slice(int64_t numel, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t per_thread = (numel + threads - 1) / threads;
  const int64_t slice = std::max(kGrainElements, (per_thread + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment);
  const int64_t slices = (numel + slice - 1) / slice;
  at::parallel_for(0, slices, 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) fn(s * slice, std::min(numel, (s + 1) * slice));
  });
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& shadow, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t step, double grad_scale, bool decoupled) {
  check_adam_args(param, grad, exp_avg, exp_avg_sq, shadow, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const kernels::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled};
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* s = shadow_bits(shadow);
  if (grad.scalar_type() == at::kBFloat16) {
    const auto* g = reinterpret_cast<const uint16_t*>(grad.data_ptr());
    for_each_slice(param.numel(), [&](int64_t b, int64_t e) { kernels::adam_step(p, g, m, v, s, b, e, hyper); });
  } else {
    const float* g = grad.data_ptr<float>();
    for_each_slice(param.numel(), [&](int64_t b, int64_t e) { kernels::adam_step(p, g, m, v, s, b, e, hyper); });
  }
}

void sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& momentum_buffer,
                  const std::optional<at::Tensor>& shadow, double lr, double momentum, double dampening,
                  double weight_decay, bool nesterov, bool first_step, double grad_scale) {
  check_sgd_args(param, grad, momentum_buffer, shadow, lr, momentum, dampening, weight_decay, nesterov, grad_scale);
  const kernels::SgdHyper hyper{lr, momentum, dampening, weight_decay, nesterov, first_step, grad_scale};
  float* p = param.data_ptr<float>();
  float* buf = momentum != 0.0 ? momentum_buffer->data_ptr<float>() : nullptr;
  uint16_t* s = shadow_bits(shadow);
  if (grad.scalar_type() == at::kBFloat16) {
    const auto* g = reinterpret_cast<const uint16_t*>(grad.data_ptr());
    for_each_slice(param.numel(), [&](int64_t b, int64_t e) { kernels::sgd_step(p, g, buf, s, b, e, hyper); });
  } else {
    const float* g = grad.data_ptr<float>();
    for_each_slice(param.numel(), [&](int64_t b, int64_t e) { kernels::sgd_step(p, g, buf, s, b, e, hyper); });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hydra, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
  m.impl("sgd_step", &sgd_step_cpu);
}

}  // namespace hydra::ops
