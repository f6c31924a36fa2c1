// One optimizer step over a shard's flat buffers, through the hydra ops so that the same call runs the CPU
// kernel on host buffers and the device kernel on device-resident ones.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/optimizer_spec.h"

namespace hydra::engine {

// Elements [begin, end) of a shard's flat buffers that one step updates, all of parameters with the same
// step number (counting from 1: each parameter's own count, as torch.optim's per-parameter state['step'])
// and the same learning rate and weight decay (their parameter group's, as torch.optim's param_groups).
struct StepRange {
  int64_t begin;
  int64_t end;
  int64_t step;
  double lr;
  double weight_decay;
};

// The ranges cut into consecutive parts, for a step taken part by part (a host step that lets a more urgent one of
// its model run between parts): about an eighth of their elements each, and at least kPartElementsPerThread for
// each thread of the caller's team (the CPU op's grain: fewer would leave its threads idle), in multiples of 64
// elements. Each part steps exactly what its elements would in one call: the update is elementwise.
constexpr int64_t kPartElementsPerThread = int64_t{1} << 17;
std::vector<std::vector<StepRange>> step_parts(const std::vector<StepRange>& ranges);
int64_t range_elements(const std::vector<StepRange>& ranges);

// `shadow` (undefined when not training in bf16) receives the updated weights in bf16. `step` counts from 1.
void step_flat(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
               const std::vector<at::Tensor>& states, const at::Tensor& shadow, int64_t step, double grad_scale);

// step_flat over each range of the buffers (whole-shard flat tensors in one layout) with the range's learning
// rate times `lr_scale` (the task's schedule) and its weight decay; elements outside every range, parameters
// that received no gradient, are left as they are.
void step_ranges(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
                 const std::vector<at::Tensor>& states, const at::Tensor& shadow,
                 const std::vector<StepRange>& ranges, double grad_scale, double lr_scale);

// step_ranges where the elements of `first_spans` ([begin, end) of the buffers) have a first gradient waiting
// in `first` (ShardStore::kept): their gradient is summed in fp32 as an accumulator sums it, zero plus `first`
// plus `grad`, one chunk at a time, so no fp32 buffer of the whole shard is made.
void step_ranges_summing(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
                         const at::Tensor& first, const std::vector<std::pair<int64_t, int64_t>>& first_spans,
                         const std::vector<at::Tensor>& states, const at::Tensor& shadow,
                         const std::vector<StepRange>& ranges, double grad_scale, double lr_scale);

}  // namespace hydra::engine
