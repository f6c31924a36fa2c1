// The unit of scheduled work: one shard's forward, backward, or the last shard's forward+loss+backward.
//
// A task (one model being trained) is a strict chain of units. Per micro-batch, a task with n shards runs
// F(0)..F(n-2), then FB(n-1), then B(n-2)..B(0): 2n-1 units. The last shard's forward and backward are one
// unit because nothing else can usefully run between them (the loss gradient is needed at once, and
// splitting them would only add a second fetch of the same shard). Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hydra::core {

enum class Phase : uint8_t { kForward, kForwardBackward, kBackward };

struct Unit {
  int task;
  int64_t index;  // position in the task's chain, 0 .. total_units(spec) - 1
  int shard;
  Phase phase;
  int64_t micro_batch;

  friend bool operator==(const Unit&, const Unit&) = default;
};

struct TaskSpec {
  int num_shards;
  int64_t micro_batches;      // steps x gradient-accumulation micro-batches, over the whole run
  std::optional<int> device;  // set when the task's state lives on one device; unset: any device
  // Relative cost of each shard's compute (e.g. its parameter count), comparable across tasks: what the
  // scheduler assumes about a unit before it has timed it. Empty: every shard of every such task alike.
  std::vector<double> shard_costs = {};
};

inline constexpr int64_t units_per_micro_batch(int num_shards) { return 2 * int64_t{num_shards} - 1; }

inline constexpr int64_t total_units(const TaskSpec& spec) {
  return spec.micro_batches * units_per_micro_batch(spec.num_shards);
}

// Chain position of (shard, phase) inside one micro-batch; the inverse of unit_at's position mapping.
inline constexpr int64_t position_in_micro_batch(int num_shards, int shard, Phase phase) {
  switch (phase) {
    case Phase::kForward: return shard;
    case Phase::kForwardBackward: return num_shards - 1;
    case Phase::kBackward: return 2 * int64_t{num_shards} - 2 - shard;
  }
  return -1;
}

inline Unit unit_at(int task, int num_shards, int64_t index) {
  if (num_shards < 1) throw std::invalid_argument("unit_at: num_shards must be >= 1, got " + std::to_string(num_shards));
  if (index < 0) throw std::invalid_argument("unit_at: index must be >= 0, got " + std::to_string(index));
  const int64_t per = units_per_micro_batch(num_shards);
  const int64_t position = index % per;
  const int last = num_shards - 1;
  Unit unit{task, index, 0, Phase::kForward, index / per};
  if (position < last) {
    unit.shard = static_cast<int>(position);
  } else if (position == last) {
    unit.shard = last;
    unit.phase = Phase::kForwardBackward;
  } else {
    unit.shard = static_cast<int>(2 * int64_t{last} - position);
    unit.phase = Phase::kBackward;
  }
  return unit;
}

}  // namespace hydra::core
