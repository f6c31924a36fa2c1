#include "engine/device_loop.h"

#include <c10/util/Exception.h>

#include <utility>
#include <vector>

namespace hydra::engine {

DeviceLoop::DeviceLoop(core::Scheduler& scheduler, DeviceEngine& engine, int device, LoopOptions options)
    : scheduler_(scheduler), engine_(engine), device_(device), options_(options) {
  TORCH_CHECK(device >= 0 && device < scheduler.num_devices(), "DeviceLoop: device ", device, " is not one of the ",
              scheduler.num_devices(), " devices the scheduler runs");
  TORCH_CHECK(options.plan_units >= 0 && options.committed_units >= 0, "DeviceLoop: negative plan or commitment");
}

int DeviceLoop::model(int task) const {
  const int model = engine_.model_of(task);
  TORCH_CHECK(model >= 0, "task ", task, " has no model on device ", device_);
  return model;
}

void DeviceLoop::release_held() {
  std::erase_if(held_, [this](const std::pair<int, int>& entry) {
    const auto [task, model] = entry;
    if (engine_.model_of(task) == model && engine_.next_step_waits(model)) return false;
    scheduler_.hold(task, false);
    return true;
  });
}

void DeviceLoop::begin(const core::Unit& unit, bool step_follows) {
  TORCH_CHECK(!open_, "DeviceLoop.begin: the visit of shard ", open_ ? open_->shard : -1, " has not ended");
  release_held();
  const int64_t bytes_before = engine_.host_to_device_bytes();
  const int own = model(unit.task);
  // The unit's own visit first, then the units the scheduler will hand this device next, the first
  // committed_units of them kept to: eviction keeps what is needed soonest, and prefetch follows the plan.
  std::vector<std::pair<int, int>> visits{{own, unit.shard}};
  scheduler_.commit_plan(device_, options_.committed_units);
  for (const core::Unit& planned : scheduler_.plan(device_, options_.plan_units)) {
    const int model = engine_.model_of(planned.task);
    if (model >= 0) visits.emplace_back(model, planned.shard);  // not here: a task joining or being re-planned
  }
  engine_.plan(visits);
  const bool backward = unit.phase == core::Phase::kForwardBackward || unit.phase == core::Phase::kBackward;
  // The state's room first, while the arena's working room is whole: the shard's weights would split it. Its copy
  // last (below).
  const bool prefetch = backward && step_follows;
  if (prefetch) engine_.prefetch_step(own, unit.shard);
  try {
    engine_.acquire(own, unit.shard, /*with_grads=*/backward);
  } catch (const c10::OutOfMemoryError&) {
    if (!prefetch) throw;
    // The prefetched state split the room the shard's weights and gradients need (the arena's free bytes in pieces):
    // it goes, and the step brings its state in itself, or runs on the host where there is no room for it then.
    engine_.forget_step_prefetch(own, unit.shard);
    engine_.acquire(own, unit.shard, /*with_grads=*/backward);
  } catch (...) {
    if (prefetch) engine_.forget_step_prefetch(own, unit.shard);  // nothing held when begin throws
    throw;
  }
  try {
    engine_.prefetch_ahead(options_.prefetch_bytes);
    // The state last on the link: the weights of this unit and the next ones are needed first.
    if (prefetch) engine_.issue_step_prefetch(own, unit.shard);
  } catch (...) {
    engine_.release(own, unit.shard);
    throw;
  }
  open_ = Visit{own, unit.shard, bytes_before};
}

int64_t DeviceLoop::end(const core::Unit& unit, const std::optional<BackwardDone>& backward) {
  if (!open_) {
    TORCH_CHECK(!backward, "DeviceLoop.end: a backward reported for shard ", unit.shard, ", which was never acquired");
    return copied_ = 0;
  }
  const Visit visit = *open_;
  open_.reset();
  try {  // however it ends, the shard is released
    TORCH_CHECK(visit.shard == unit.shard, "DeviceLoop.end: shard ", unit.shard, " ends the visit of shard ",
                visit.shard);
    if (backward) engine_.backward_done(visit.model, visit.shard, backward->step, backward->lr_scale, backward->keep);
  } catch (...) {
    engine_.release(visit.model, visit.shard);
    copied_ = engine_.host_to_device_bytes() - visit.bytes_before;
    throw;
  }
  engine_.release(visit.model, visit.shard);
  // The step's last backward: its steps are queued (with clipping, by clip_and_step right after this end), and the
  // task's next forward would wait for the first of its shards stepped on the host (shard 0, or the first past the
  // resident ones), with the device idle: other tasks run until that step is done.
  if (backward && visit.shard == 0 && options_.hold_for_steps && !engine_.resident(visit.model) &&
      (backward->clip_follows || (backward->step && engine_.next_step_waits(visit.model)))) {
    scheduler_.hold(unit.task, true);
    held_.emplace_back(unit.task, visit.model);
  }
  return copied_ = engine_.host_to_device_bytes() - visit.bytes_before;
}

}  // namespace hydra::engine
