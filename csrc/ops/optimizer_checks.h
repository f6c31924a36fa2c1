// Argument validation shared by the CPU and CUDA optimizer kernels. Everything is checked before any
// tensor is written, so a rejected call leaves parameters and optimizer state exactly as they were.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <initializer_list>
#include <optional>

namespace hydra::ops {

inline void check_buffer(const at::Tensor& t, const char* name, const at::Tensor& param, at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == param.device(), name, " is on ", t.device(), " but param is on ", param.device());
  TORCH_CHECK(t.numel() == param.numel(), name, " has ", t.numel(), " elements but param has ", param.numel());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_param_and_grad(const at::Tensor& param, const at::Tensor& grad) {
  TORCH_CHECK(param.defined() && param.scalar_type() == at::kFloat, "param must be a float32 tensor");
  TORCH_CHECK(param.is_contiguous(), "param must be contiguous");
  TORCH_CHECK(grad.defined() && (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "grad must be float32 or bfloat16, got ", grad.defined() ? c10::toString(grad.scalar_type()) : "None");
  check_buffer(grad, "grad", param, grad.scalar_type());
}

inline void check_shadow(const std::optional<at::Tensor>& shadow, const at::Tensor& param) {
  if (shadow.has_value()) check_buffer(*shadow, "shadow", param, at::kBFloat16);
}

// The kernels promise the compiler that no two buffers overlap (that is what lets them vectorise), and a
// buffer written through one argument and read through another would see half-updated values. Views of
// one storage are fine (e.g. exp_avg and exp_avg_sq carved from one flat state buffer) as long as their
// bytes are disjoint.
inline void check_no_overlap(std::initializer_list<const at::Tensor*> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = std::next(a); b != tensors.end(); ++b) {
      if (!(*a)->defined() || !(*b)->defined()) continue;
      const at::MemOverlapStatus status = at::get_overlap_status(**a, **b);
      TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
                  "optimizer buffers must not overlap in memory");
    }
  }
}

inline void check_adam_args(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& shadow, double lr,
                            double beta1, double beta2, double eps, double weight_decay, int64_t step,
                            double grad_scale) {
  check_param_and_grad(param, grad);
  check_buffer(exp_avg, "exp_avg", param, at::kFloat);
  check_buffer(exp_avg_sq, "exp_avg_sq", param, at::kFloat);
  check_shadow(shadow, param);
  const at::Tensor none;
  check_no_overlap({&param, &grad, &exp_avg, &exp_avg_sq, shadow ? &*shadow : &none});
  TORCH_CHECK(step >= 1, "step must be >= 1 (the count including this update), got ", step);
  TORCH_CHECK(lr >= 0.0, "lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale >= 0.0, "grad_scale must be finite and >= 0, got ", grad_scale);
}

inline void check_sgd_args(const at::Tensor& param, const at::Tensor& grad,
                           const std::optional<at::Tensor>& momentum_buffer, const std::optional<at::Tensor>& shadow,
                           double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                           double grad_scale) {
  check_param_and_grad(param, grad);
  TORCH_CHECK(momentum == 0.0 || momentum_buffer.has_value(), "momentum != 0 needs a momentum_buffer");
  if (momentum != 0.0) check_buffer(*momentum_buffer, "momentum_buffer", param, at::kFloat);
  check_shadow(shadow, param);
  const at::Tensor none;
  check_no_overlap({&param, &grad, momentum != 0.0 ? &*momentum_buffer : &none, shadow ? &*shadow : &none});
  TORCH_CHECK(lr >= 0.0, "lr must be >= 0, got ", lr);
  TORCH_CHECK(momentum >= 0.0, "momentum must be >= 0, got ", momentum);
  TORCH_CHECK(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), "nesterov needs momentum > 0 and dampening == 0");
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale >= 0.0, "grad_scale must be finite and >= 0, got ", grad_scale);
}

// The shadow's bits for the kernels, which see bfloat16 as raw uint16_t; null when there is no shadow.
inline uint16_t* shadow_bits(const std::optional<at::Tensor>& shadow) {
  return shadow ? reinterpret_cast<uint16_t*>(shadow->data_ptr()) : nullptr;
}

}  // namespace hydra::ops
