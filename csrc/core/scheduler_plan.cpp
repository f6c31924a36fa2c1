// Scheduler's plans: the units a device will run next, as far as they can be foreseen, and the commitments that
// keep a device to them (see plan() and commit_plan() in scheduler.h).
#include <algorithm>

#include "core/scheduler.h"

namespace hydra::core {

bool Scheduler::reserved_elsewhere(int task, int device) const {
  if (!plans_committed_) return false;
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  for (int d = 0; d < num_devices_; ++d) {
    const auto& committed = committed_[static_cast<size_t>(d)];
    // A device that may no longer run the task (it was pinned elsewhere since) holds nothing for it: it might
    // never ask again.
    if (d != device && !committed.empty() && committed.front() == std::pair<int, int64_t>{task, state.next_index} &&
        allowed(state, d))
      return true;
  }
  return false;
}

bool Scheduler::planned_elsewhere(int task, int device) const {
  if (!plans_committed_) return false;
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  if (state.state == State::kRunning && state.running_device == device) return false;  // its own
  for (int d = 0; d < num_devices_; ++d) {
    if (d == device) continue;
    // Entries for units the task has already run (elsewhere) are stale: they hold nothing.
    for (const auto& [t, index] : committed_[static_cast<size_t>(d)])
      if (t == task && index >= state.next_index) return true;
  }
  return false;
}

std::vector<Unit> Scheduler::commit_plan(int device, int count) {
  std::vector<Unit> units = plan(device, count);
  // Only LRTF's order is a means (to the makespan) that a plan may fix early; the others' is the contract.
  if (policy_.kind() != PolicyKind::kLrtf) return units;
  std::lock_guard lock(mutex_);
  auto& committed = committed_[static_cast<size_t>(device)];
  committed.clear();
  for (const Unit& unit : units) committed.emplace_back(unit.task, unit.index);
  plans_committed_ = true;
  ready_.notify_all();  // a unit this device held before may be free for another now
  return units;
}

std::optional<Unit> Scheduler::peek(int device) const {
  std::vector<Unit> units = plan(device, 1);
  if (units.empty()) return std::nullopt;
  return units.front();
}

std::vector<Unit> Scheduler::plan(int device, int count) const {
  check_device(device);
  std::lock_guard lock(mutex_);
  std::vector<Unit> units;
  if (cancelled_) return units;
  // Each task's next unit here, as if this device ran the planned units back to back and no other device
  // took any: the running task's unit completes first, each planned unit becomes its task's latest event.
  struct Planned {
    int task;
    int64_t index;
    uint64_t ready;
    bool ran_last_here;
    bool held;
  };
  std::vector<Planned> planned;
  uint64_t sequence = event_sequence_;
  for (int t = 0; t < num_tasks(); ++t) {
    const TaskState& task = tasks_[static_cast<size_t>(t)];
    if (!allowed(task, device) || task.state == State::kDone || task.failed || planned_elsewhere(t, device)) continue;
    Planned p{t, task.next_index, task.ready_sequence, task.last_device == device, task.held};
    if (task.state == State::kRunning) {
      if (task.running_device != device) continue;
      ++p.index;
      p.ready = ++sequence;
      p.ran_last_here = true;
    }
    if (p.index < task.total_units) planned.push_back(p);
  }
  // A task pinned to this device is in its plan whatever the share: no other device may run it.
  auto pinned = [&](int t) { return tasks_[static_cast<size_t>(t)].spec.device.has_value(); };
  const bool needs_estimates = policy_.kind() == PolicyKind::kLrtf;
  // Only LRTF's plan is a forecast shaped for the devices as a whole; the others' is their order of choice.
  const int share = needs_estimates ? plan_share(device) : num_tasks();
  // The tasks any device may run planned so far, at most `share` of them: first the one running here, which
  // usually continues here.
  std::vector<int> in_plan;
  for (const Planned& p : planned) {
    const TaskState& task = tasks_[static_cast<size_t>(p.task)];
    if (task.state == State::kRunning && !pinned(p.task)) in_plan.push_back(p.task);
  }
  // Saved activations as the plan goes: micro-batches it starts here join those in flight, and those it ends that
  // started here (in flight or planned) leave.
  SavedBytesGate::Load load = saved_.load(device);
  std::vector<std::pair<int, int64_t>> started_here;  // (task, the bytes its planned start counted)
  auto admitted = [&](const Planned& p) {
    return !starts_micro_batch(unit_at(p.task, tasks_[static_cast<size_t>(p.task)].spec, p.index)) ||
           saved_.admits(load, p.task, device);
  };
  std::vector<Candidate> candidates;
  std::pair<int, int> last_base_shard = last_base_shard_[static_cast<size_t>(device)];
  // The committed plan first, as far as it still holds (see commit_plan), then the policy.
  const auto& committed = committed_[static_cast<size_t>(device)];
  auto kept = committed.begin();
  while (static_cast<int>(units.size()) < count && !planned.empty()) {
    size_t chosen = planned.size();
    if (kept != committed.end()) {
      for (size_t i = 0; i < planned.size(); ++i)
        if (planned[i].task == kept->first && planned[i].index == kept->second && !planned[i].held &&
            admitted(planned[i]))
          chosen = i;
      kept = chosen < planned.size() ? kept + 1 : committed.end();
    }
    if (chosen == planned.size()) {
      // Its share of the tasks any device may run planned, it plans the rest of those only (and the tasks only it
      // may run). A held task comes after the others (it is released meanwhile, or nothing else is left).
      auto eligible = [&](const Planned& p) {
        return pinned(p.task) || static_cast<int>(in_plan.size()) < share ||
               std::ranges::find(in_plan, p.task) != in_plan.end();
      };
      const bool all_held = std::ranges::all_of(planned, [&](const Planned& p) { return p.held || !eligible(p); });
      candidates.clear();
      std::vector<size_t> positions;
      for (size_t i = 0; i < planned.size(); ++i) {
        const Planned& p = planned[i];
        if (!eligible(p) || (p.held && !all_held) || !admitted(p)) continue;
        const double remaining = needs_estimates ? cost_model_.remaining_seconds(p.task, p.index) : 0.0;
        candidates.push_back(
            Candidate{p.task, remaining, p.ready, p.ran_last_here, reads_base_shard(p.task, p.index, last_base_shard)});
        positions.push_back(i);
      }
      if (candidates.empty()) break;
      chosen = positions[policy_.choose(device, candidates)];
    }
    Planned& p = planned[chosen];
    if (!pinned(p.task) && std::ranges::find(in_plan, p.task) == in_plan.end())
      in_plan.push_back(p.task);
    const Unit unit = unit_at(p.task, tasks_[static_cast<size_t>(p.task)].spec, p.index);
    units.push_back(unit);
    last_base_shard = {tasks_[static_cast<size_t>(p.task)].spec.base, unit.shard};
    if (starts_micro_batch(unit)) started_here.emplace_back(p.task, saved_.add(load, p.task));
    if (ends_micro_batch(unit)) {
      auto here = std::ranges::find_if(started_here, [&](const auto& s) { return s.first == p.task; });
      if (here != started_here.end()) {
        SavedBytesGate::remove(load, here->second);
        started_here.erase(here);
      } else if (saved_.reserved_on(p.task) == device) {
        SavedBytesGate::remove(load, saved_.reserved_bytes(p.task));
      }
    }
    for (Planned& other : planned) other.ran_last_here = false;
    ++p.index;
    p.ready = ++sequence;
    p.ran_last_here = true;
    if (p.index >= tasks_[static_cast<size_t>(p.task)].total_units) planned.erase(planned.begin() + chosen);
  }
  return units;
}

int Scheduler::plan_share(int device) const {
  for (int d = 0; d < num_devices_; ++d)
    if (d != device && starved_[static_cast<size_t>(d)] && has_work_locked(d)) return 1;
  int shared = 0;
  for (const TaskState& task : tasks_) shared += task.state != State::kDone && !task.failed && !task.spec.device;
  return std::max(1, (shared + num_devices_ - 1) / num_devices_);
}

}  // namespace hydra::core
