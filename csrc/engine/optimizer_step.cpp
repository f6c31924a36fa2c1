#include "engine/optimizer_step.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>

#include <algorithm>

namespace hydra::engine {

namespace {

c10::IValue optional_tensor(const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); }

// Boxed calls: the ops' C++ signatures stay private to their registration files.
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

void step_flat(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
               const std::vector<at::Tensor>& states, const at::Tensor& shadow, int64_t step, double grad_scale) {
  if (param.numel() == 0) return;
  torch::jit::Stack stack;
  if (spec.kind == OptimizerSpec::Kind::kAdam) {
    static const c10::OperatorHandle adam = op("hydra::adam_step");
    stack = {param, grad, states.at(0), states.at(1), optional_tensor(shadow), spec.lr, spec.beta1, spec.beta2,
             spec.eps, spec.weight_decay, step, grad_scale, spec.decoupled_weight_decay};
    adam.callBoxed(&stack);
  } else {
    static const c10::OperatorHandle sgd = op("hydra::sgd_step");
    const at::Tensor momentum = states.empty() ? at::Tensor() : states[0];
    stack = {param, grad, optional_tensor(momentum), optional_tensor(shadow), spec.lr, spec.momentum, spec.dampening,
             spec.weight_decay, spec.nesterov, step == 1, grad_scale};
    sgd.callBoxed(&stack);
  }
}

namespace {

// One range, `range_grad` its gradient (narrowed to it already).
void step_range(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& range_grad,
                const std::vector<at::Tensor>& states, const at::Tensor& shadow, const StepRange& r,
                double grad_scale, double lr_scale) {
  OptimizerSpec range_spec = spec;
  range_spec.lr = r.lr * lr_scale;
  range_spec.weight_decay = r.weight_decay;
  auto part = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, r.begin, r.end - r.begin) : t; };
  std::vector<at::Tensor> state_parts;
  for (const at::Tensor& s : states) state_parts.push_back(part(s));
  step_flat(range_spec, part(param), range_grad, state_parts, part(shadow), r.step, grad_scale);
}

}  // namespace

int64_t range_elements(const std::vector<StepRange>& ranges) {
  int64_t elements = 0;
  for (const StepRange& r : ranges) elements += r.end - r.begin;
  return elements;
}

std::vector<std::vector<StepRange>> step_parts(const std::vector<StepRange>& ranges) {
  const int64_t total = range_elements(ranges);
  const int64_t least = kPartElementsPerThread * at::get_num_threads();
  const int64_t part = (std::max(least, (total + 7) / 8) + 63) / 64 * 64;
  std::vector<std::vector<StepRange>> parts;
  int64_t room = 0;  // elements the last part may still take
  for (const StepRange& r : ranges) {
    for (int64_t begin = r.begin; begin < r.end;) {
      if (room == 0) {
        parts.emplace_back();
        room = part;
      }
      const int64_t end = std::min(r.end, begin + room);
      parts.back().push_back(StepRange{begin, end, r.step, r.lr, r.weight_decay});
      room -= end - begin;
      begin = end;
    }
  }
  return parts;
}

void step_ranges(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
                 const std::vector<at::Tensor>& states, const at::Tensor& shadow,
                 const std::vector<StepRange>& ranges, double grad_scale, double lr_scale) {
  for (const StepRange& r : ranges)
    step_range(spec, param, grad.narrow(0, r.begin, r.end - r.begin), states, shadow, r, grad_scale, lr_scale);
}

void step_ranges_summing(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
                         const at::Tensor& first, const std::vector<std::pair<int64_t, int64_t>>& first_spans,
                         const std::vector<at::Tensor>& states, const at::Tensor& shadow,
                         const std::vector<StepRange>& ranges, double grad_scale, double lr_scale) {
  constexpr int64_t kChunk = int64_t{1} << 20;  // 4 MB of fp32: stays in cache between the sum and the step
  at::Tensor sum;
  for (const StepRange& r : ranges) {
    const bool waiting = std::any_of(first_spans.begin(), first_spans.end(),
                                     [&](const auto& span) { return span.first < r.end && span.second > r.begin; });
    if (!waiting) {
      step_range(spec, param, grad.narrow(0, r.begin, r.end - r.begin), states, shadow, r, grad_scale, lr_scale);
      continue;
    }
    for (int64_t begin = r.begin; begin < r.end; begin += kChunk) {
      const int64_t end = std::min(r.end, begin + kChunk);
      if (!sum.defined()) sum = at::empty({std::min(kChunk, r.end - r.begin)}, at::kFloat);
      if (sum.numel() < end - begin) sum = at::empty({end - begin}, at::kFloat);
      // The accumulator's operations in its order: zeroed, the borrower's gradient added, then the owner's.
      const at::Tensor part = sum.narrow(0, 0, end - begin).zero_();
      for (const auto& [span_begin, span_end] : first_spans) {
        const int64_t lo = std::max(span_begin, begin), hi = std::min(span_end, end);
        if (lo < hi) part.narrow(0, lo - begin, hi - lo).add_(first.narrow(0, lo, hi - lo));
      }
      part.add_(grad.narrow(0, begin, end - begin));
      step_range(spec, param, part, states, shadow, StepRange{begin, end, r.step, r.lr, r.weight_decay}, grad_scale,
                 lr_scale);
    }
  }
}

}  // namespace hydra::engine
