// What one task's optimizer is: the kind and its hyperparameters, validated in Python before any state
// exists. The engine steps a shard's flat buffers with the matching hydra op.
#pragma once

#include <cstdint>

namespace hydra::engine {

struct OptimizerSpec {
  enum class Kind { kAdam, kSgd };
  Kind kind = Kind::kAdam;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // AdamW
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;

  // fp32 buffers of optimizer state per parameter element.
  int num_states() const { return kind == Kind::kAdam ? 2 : (momentum != 0.0 ? 1 : 0); }
};

}  // namespace hydra::engine
