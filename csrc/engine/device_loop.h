// The seam between a device's worker thread (Python) and the native parts, per unit: a unit's shard visit is
// one begin() and one end() call around its compute.
//
//   begin: plans the device's next shard visits (the unit's own, then the scheduler's plan for this device,
//          its first units committed to), acquires the unit's shard (with gradient room for a backward) and
//          prefetches the next planned shard. The runner calls it where the unit's compute starts, once the
//          unit's inputs are on their way (loading a batch overlaps the copy the acquire may wait for);
//   end:   reports the shard's backward when the unit ran one (its gradients go out, its step is queued) and
//          releases the shard; a spilled task whose step it queued is held until that step is done. The
//          worker calls it after the runner, however the runner ended: with no visit open (the unit failed
//          before begin, or begin failed) it does nothing.
//
// Tasks are named by the scheduler's ids; the engine finds their models (DeviceEngine::model_of).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/scheduler.h"
#include "engine/device_engine.h"

namespace hydra::engine {

struct LoopOptions {
  int plan_units = 32;       // how many units ahead the engine's plan looks (eviction keeps what is needed soonest)
  int committed_units = 4;   // how many of them the device commits to running in order (Scheduler::commit_plan)
  int64_t prefetch_bytes = 0;  // how far beyond the next planned shard prefetch goes (DeviceEngine::prefetch_ahead)
  // A spilled task whose step has just been queued (or, clipped, is queued next by clip_and_step) is held
  // (Scheduler::hold) until its next forward would no longer wait for the step (DeviceEngine::next_step_waits):
  // another task's units run meanwhile.
  bool hold_for_steps = true;
};

// What end() reports of a unit that ran a backward: as DeviceEngine::backward_done's arguments, and
// `clip_follows`: the backward ends a clipped step, whose steps clip_and_step queues right after this end.
struct BackwardDone {
  bool step = false;
  double lr_scale = 1.0;
  bool keep = false;
  bool clip_follows = false;
};

class DeviceLoop {
 public:
  // Both outlive the loop.
  DeviceLoop(core::Scheduler& scheduler, DeviceEngine& engine, int device, LoopOptions options);

  // On the device's worker thread, before the unit's compute. Throws, with no visit open and nothing held,
  // when the unit's shard cannot be acquired (torch.OutOfMemoryError when it does not fit) or its task has no
  // model here. `step_follows`: the unit is a backward whose end() will report a step (not a clipped one): a
  // device-stepped shard's optimizer state is prefetched beside its compute (DeviceEngine::prefetch_step).
  void begin(const core::Unit& unit, bool step_follows = false);
  // After the unit's compute, or its failure (then with no backward). Closes the visit begin opened: the shard
  // is released even when reporting the backward throws. Returns the bytes copied to the device since begin(),
  // 0 when no visit was open.
  int64_t end(const core::Unit& unit, const std::optional<BackwardDone>& backward);
  // What the last end() returned (for a unit that failed: the worker records the copies it caused).
  int64_t copied() const { return copied_; }
  const LoopOptions& options() const { return options_; }

 private:
  int model(int task) const;  // throws when the task has no model on this device
  // Releases the tasks this loop held whose first shard no longer waits for a step (or that left the device).
  void release_held();

  core::Scheduler& scheduler_;
  DeviceEngine& engine_;
  const int device_;
  const LoopOptions options_;
  struct Visit {
    int model, shard;
    int64_t bytes_before;  // the engine's host-to-device bytes when it began
  };
  std::optional<Visit> open_;
  std::vector<std::pair<int, int>> held_;  // (task, model) held by this loop
  int64_t copied_ = 0;
};

}  // namespace hydra::engine
