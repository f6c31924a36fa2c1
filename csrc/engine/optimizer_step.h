// One optimizer step over a shard's flat buffers, through the hydra ops so that the same call runs the CPU
// kernel on host buffers and the device kernel on device-resident ones.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "engine/optimizer_spec.h"

namespace hydra::engine {

// `shadow` (undefined when not training in bf16) receives the updated weights in bf16. `step` counts from 1.
void step_flat(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
               const std::vector<at::Tensor>& states, const at::Tensor& shadow, int64_t step, double grad_scale);

}  // namespace hydra::engine
