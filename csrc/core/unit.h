// The unit of scheduled work: one shard's forward, backward, the last shard's forward+loss+backward, or one
// shard's share of an evaluation.
//
// A task (one model being trained) is a strict chain of units. Per micro-batch, a task with n shards runs
// F(0)..F(n-2), then FB(n-1), then B(n-2)..B(0): 2n-1 units. The last shard's forward and backward are one
// unit because nothing else can usefully run between them (the loss gradient is needed at once, and
// splitting them would only add a second fetch of the same shard). An evaluation pass, between two training
// micro-batches, runs each evaluation batch forward through the shards, no gradients: E(0)..E(n-1) per batch,
// the last one computing the loss. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hydra::core {

enum class Phase : uint8_t { kForward, kForwardBackward, kBackward, kEvaluate };

struct Unit {
  int task;
  int64_t index;  // position in the task's chain, 0 .. total_units(spec) - 1
  int shard;
  Phase phase;
  int64_t micro_batch;  // training micro-batch; for kEvaluate, the batch's index in its evaluation pass

  friend bool operator==(const Unit&, const Unit&) = default;
};

struct TaskSpec {
  int num_shards;
  int64_t micro_batches;      // steps x gradient-accumulation micro-batches, over the whole run
  std::optional<int> device;  // set when the task's state lives on one device; unset: any device
  // Relative cost of each shard's compute (e.g. its parameter count), comparable across tasks: what the
  // scheduler assumes about a unit before it has timed it. Empty: every shard of every such task alike.
  std::vector<double> shard_costs = {};
  // Evaluation passes of `eval_batches` batches each: one after every listed count of training micro-batches
  // (strictly ascending, within [0, micro_batches]; 0 evaluates before the first micro-batch).
  std::vector<int64_t> eval_after = {};
  int64_t eval_batches = 0;
  // The frozen base the task shares with others (>= 0), whose shard s holds frozen weights of the task's shard
  // s: a unit of a task of the same base on the same shard just run on a device left them cached there.
  int base = -1;
};

// A training micro-batch's first unit (F(0), or FB(0) with one shard) and last (B(0), or that FB(0)): between
// them its saved shard inputs are held on the device (see SavedBytesGate).
inline constexpr bool starts_micro_batch(const Unit& unit) {
  return unit.shard == 0 && (unit.phase == Phase::kForward || unit.phase == Phase::kForwardBackward);
}
inline constexpr bool ends_micro_batch(const Unit& unit) {
  return unit.shard == 0 && (unit.phase == Phase::kBackward || unit.phase == Phase::kForwardBackward);
}

inline constexpr int64_t units_per_micro_batch(int num_shards) { return 2 * int64_t{num_shards} - 1; }

inline int64_t units_per_eval_pass(const TaskSpec& spec) { return spec.eval_batches * spec.num_shards; }

inline int64_t eval_passes(const TaskSpec& spec) { return static_cast<int64_t>(spec.eval_after.size()); }

inline int64_t total_units(const TaskSpec& spec) {
  return spec.micro_batches * units_per_micro_batch(spec.num_shards) + eval_passes(spec) * units_per_eval_pass(spec);
}

// Chain index of evaluation pass `pass`'s first unit.
inline int64_t eval_pass_start(const TaskSpec& spec, int64_t pass) {
  return spec.eval_after[static_cast<size_t>(pass)] * units_per_micro_batch(spec.num_shards) +
         pass * units_per_eval_pass(spec);
}

// Evaluation passes whose first unit is at or before chain index `index`. O(log passes).
inline int64_t eval_passes_started(const TaskSpec& spec, int64_t index) {
  int64_t low = 0, high = eval_passes(spec);  // invariant: passes < low have started, passes >= high have not
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (eval_pass_start(spec, mid) <= index) low = mid + 1; else high = mid;
  }
  return low;
}

// Throws std::invalid_argument for evaluation passes that are not strictly ascending within
// [0, micro_batches], or listed with no batches. `which` prefixes the message.
inline void check_eval_passes(const TaskSpec& spec, const std::string& which) {
  if (spec.eval_after.empty()) return;
  if (spec.eval_batches < 1) {
    throw std::invalid_argument(which + "evaluation passes need eval_batches >= 1, got " +
                                std::to_string(spec.eval_batches));
  }
  int64_t previous = -1;
  for (int64_t after : spec.eval_after) {
    if (after <= previous || after > spec.micro_batches) {
      throw std::invalid_argument(which + "eval_after must ascend strictly within [0, " +
                                  std::to_string(spec.micro_batches) + "], got " + std::to_string(after) +
                                  " after " + std::to_string(previous));
    }
    previous = after;
  }
}

// Position of (shard, phase) inside one micro-batch, the inverse of unit_at's mapping; an evaluation unit's
// position follows the 2n-1 training ones (the cost model keys its estimates by these positions).
inline constexpr int64_t position_in_micro_batch(int num_shards, int shard, Phase phase) {
  switch (phase) {
    case Phase::kForward: return shard;
    case Phase::kForwardBackward: return num_shards - 1;
    case Phase::kBackward: return 2 * int64_t{num_shards} - 2 - shard;
    case Phase::kEvaluate: return units_per_micro_batch(num_shards) + shard;  // after the training positions
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

// The unit at `index` of a chain with evaluation passes (TaskSpec::eval_after).
inline Unit unit_at(int task, const TaskSpec& spec, int64_t index) {
  if (index < 0) throw std::invalid_argument("unit_at: index must be >= 0, got " + std::to_string(index));
  const int64_t started = eval_passes_started(spec, index);
  const int64_t per_pass = units_per_eval_pass(spec);
  if (started > 0) {
    const int64_t offset = index - eval_pass_start(spec, started - 1);
    if (offset < per_pass) {
      return Unit{task, index, static_cast<int>(offset % spec.num_shards), Phase::kEvaluate, offset / spec.num_shards};
    }
  }
  Unit unit = unit_at(task, spec.num_shards, index - started * per_pass);
  unit.index = index;
  return unit;
}

}  // namespace hydra::core
