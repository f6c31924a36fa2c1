#include "engine/optimizer_step.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

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

void step_ranges(const OptimizerSpec& spec, const at::Tensor& param, const at::Tensor& grad,
                 const std::vector<at::Tensor>& states, const at::Tensor& shadow,
                 const std::vector<StepRange>& ranges, double grad_scale, double lr_scale) {
  OptimizerSpec range_spec = spec;
  for (const StepRange& r : ranges) {
    range_spec.lr = r.lr * lr_scale;
    range_spec.weight_decay = r.weight_decay;
    auto part = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, r.begin, r.end - r.begin) : t; };
    std::vector<at::Tensor> state_parts;
    for (const at::Tensor& s : states) state_parts.push_back(part(s));
    step_flat(range_spec, part(param), part(grad), state_parts, part(shadow), r.step, grad_scale);
  }
}

}  // namespace hydra::engine
