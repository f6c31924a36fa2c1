// The schema of every op in the torch.ops.hydra namespace. This is the project's one TORCH_LIBRARY block:
// backends register kernels for these names with TORCH_LIBRARY_IMPL in their own files
// (cpu/optimizer_ops_cpu.cpp, cuda/optimizer_ops_cuda.cpp).
#include <torch/library.h>

// Optimizer updates mutate param, state and the optional bf16 shadow copy in place and return nothing;
// the (x!) annotations let functionalization and torch.compile see the mutations.
TORCH_LIBRARY(hydra, m) {
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? shadow, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale, "
      "bool decoupled) -> ()");
  m.def(
      "sgd_step(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, Tensor(c!)? shadow, float lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, bool first_step, float grad_scale) -> ()");
}
