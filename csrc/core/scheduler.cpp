#include "core/scheduler.h"

#include <chrono>

#include <stdexcept>
#include <string>

namespace hydra::core {

namespace {

std::vector<TaskSpec> validated(std::vector<TaskSpec> tasks, int num_devices) {
  if (num_devices < 1) {
    throw std::invalid_argument("Scheduler: num_devices must be >= 1, got " + std::to_string(num_devices));
  }
  if (tasks.empty()) throw std::invalid_argument("Scheduler: no tasks to schedule");
  for (size_t i = 0; i < tasks.size(); ++i) {
    const TaskSpec& spec = tasks[i];
    const std::string which = "Scheduler: task " + std::to_string(i) + ": ";
    if (spec.num_shards < 1) {
      throw std::invalid_argument(which + "num_shards must be >= 1, got " + std::to_string(spec.num_shards));
    }
    if (spec.micro_batches < 1) {
      throw std::invalid_argument(which + "micro_batches must be >= 1, got " + std::to_string(spec.micro_batches));
    }
    if (spec.device && (*spec.device < 0 || *spec.device >= num_devices)) {
      throw std::invalid_argument(which + "device " + std::to_string(*spec.device) + " out of range [0, " +
                                  std::to_string(num_devices) + ")");
    }
  }
  return tasks;
}

}  // namespace

Scheduler::Scheduler(std::vector<TaskSpec> tasks, int num_devices, PolicyKind policy, uint64_t seed)
    : num_devices_(num_devices),
      cost_model_(validated(tasks, num_devices)),
      policy_(policy, static_cast<int>(tasks.size()), num_devices, seed) {
  tasks_.reserve(tasks.size());
  for (const TaskSpec& spec : tasks) tasks_.push_back(TaskState{spec, total_units(spec)});
  candidates_.reserve(tasks.size());
}

void Scheduler::check_task(int task) const {
  if (task < 0 || task >= num_tasks()) {
    throw std::invalid_argument("Scheduler: task " + std::to_string(task) + " out of range [0, " +
                                std::to_string(num_tasks()) + ")");
  }
}

void Scheduler::check_device(int device) const {
  if (device < 0 || device >= num_devices_) {
    throw std::invalid_argument("Scheduler: device " + std::to_string(device) + " out of range [0, " +
                                std::to_string(num_devices_) + ")");
  }
}

bool Scheduler::allowed(const TaskState& task, int device) const {
  return !task.spec.device || *task.spec.device == device;
}

bool Scheduler::has_work_locked(int device) const {
  for (const TaskState& task : tasks_) {
    if (task.state != State::kDone && !task.failed && allowed(task, device)) return true;
  }
  return false;
}

std::optional<Unit> Scheduler::take_locked(int device) {
  candidates_.clear();
  const bool needs_estimates = policy_.kind() == PolicyKind::kLrtf;
  for (int t = 0; t < num_tasks(); ++t) {
    const TaskState& task = tasks_[static_cast<size_t>(t)];
    if (task.state != State::kIdle || !allowed(task, device)) continue;
    const double remaining = needs_estimates ? cost_model_.remaining_seconds(t, task.next_index) : 0.0;
    candidates_.push_back(Candidate{t, remaining, task.ready_sequence, task.last_device == device});
  }
  if (candidates_.empty()) return std::nullopt;
  const int chosen = candidates_[policy_.choose(device, candidates_)].task;
  policy_.commit(device, chosen);
  TaskState& task = tasks_[static_cast<size_t>(chosen)];
  task.state = State::kRunning;
  task.running_device = device;
  task.last_device = device;
  return unit_at(chosen, task.spec.num_shards, task.next_index);
}

std::optional<Unit> Scheduler::next(int device) {
  check_device(device);
  std::unique_lock lock(mutex_);
  for (;;) {
    if (cancelled_ || !has_work_locked(device)) return std::nullopt;
    if (auto unit = take_locked(device)) return unit;
    ready_.wait(lock);
  }
}

std::optional<Unit> Scheduler::next_for(int device, double timeout_seconds) {
  check_device(device);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  std::unique_lock lock(mutex_);
  for (;;) {
    if (cancelled_ || !has_work_locked(device)) return std::nullopt;
    if (auto unit = take_locked(device)) return unit;
    if (ready_.wait_until(lock, deadline) == std::cv_status::timeout) return take_locked(device);
  }
}

bool Scheduler::cancelled() const {
  std::lock_guard lock(mutex_);
  return cancelled_;
}

std::optional<Unit> Scheduler::try_next(int device) {
  check_device(device);
  std::lock_guard lock(mutex_);
  if (cancelled_) return std::nullopt;
  return take_locked(device);
}

std::optional<Unit> Scheduler::peek(int device) const {
  check_device(device);
  std::lock_guard lock(mutex_);
  if (cancelled_) return std::nullopt;
  std::vector<Candidate> candidates;
  std::vector<int64_t> next_index;
  candidates.reserve(tasks_.size());
  const bool needs_estimates = policy_.kind() == PolicyKind::kLrtf;
  for (int t = 0; t < num_tasks(); ++t) {
    const TaskState& task = tasks_[static_cast<size_t>(t)];
    if (!allowed(task, device) || task.state == State::kDone || task.failed) continue;
    int64_t index = task.next_index;
    uint64_t ready = task.ready_sequence;
    if (task.state == State::kRunning) {
      if (task.running_device != device) continue;
      ++index;  // as if its current unit had completed now: the latest to become ready
      ready = event_sequence_ + 1;
      if (index >= task.total_units) continue;
    }
    const double remaining = needs_estimates ? cost_model_.remaining_seconds(t, index) : 0.0;
    candidates.push_back(Candidate{t, remaining, ready, task.last_device == device});
    next_index.push_back(index);
  }
  if (candidates.empty()) return std::nullopt;
  const size_t chosen = policy_.choose(device, candidates);
  const int t = candidates[chosen].task;
  return unit_at(t, tasks_[static_cast<size_t>(t)].spec.num_shards, next_index[chosen]);
}

void Scheduler::complete(int device, const Unit& unit, double seconds) {
  check_device(device);
  check_task(unit.task);
  {
    std::lock_guard lock(mutex_);
    TaskState& task = tasks_[static_cast<size_t>(unit.task)];
    if (task.state != State::kRunning || task.running_device != device || task.next_index != unit.index) {
      throw std::invalid_argument("Scheduler::complete: unit " + std::to_string(unit.index) + " of task " +
                                  std::to_string(unit.task) + " is not running on device " +
                                  std::to_string(device));
    }
    // Validates the duration before any state changes, so a bad report leaves the task running.
    cost_model_.observe(unit.task, unit.shard, unit.phase, seconds);
    ++task.next_index;
    task.running_device = -1;
    task.ready_sequence = ++event_sequence_;
    task.state = (task.failed || task.next_index >= task.total_units) ? State::kDone : State::kIdle;
  }
  ready_.notify_all();
}

void Scheduler::fail(int task) {
  check_task(task);
  {
    std::lock_guard lock(mutex_);
    TaskState& state = tasks_[static_cast<size_t>(task)];
    state.failed = true;
    if (state.state == State::kIdle) state.state = State::kDone;
  }
  // Workers whose only remaining task this was must wake to return nullopt.
  ready_.notify_all();
}

void Scheduler::cancel() {
  {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
  }
  ready_.notify_all();
}

int64_t Scheduler::remaining_units(int task) const {
  check_task(task);
  std::lock_guard lock(mutex_);
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  return state.failed ? 0 : state.total_units - state.next_index;
}

bool Scheduler::finished(int task) const {
  check_task(task);
  std::lock_guard lock(mutex_);
  return tasks_[static_cast<size_t>(task)].state == State::kDone;
}

bool Scheduler::failed(int task) const {
  check_task(task);
  std::lock_guard lock(mutex_);
  return tasks_[static_cast<size_t>(task)].failed;
}

double Scheduler::remaining_seconds(int task) const {
  check_task(task);
  std::lock_guard lock(mutex_);
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  return state.failed ? 0.0 : cost_model_.remaining_seconds(task, state.next_index);
}

bool Scheduler::has_work(int device) const {
  check_device(device);
  std::lock_guard lock(mutex_);
  return has_work_locked(device);
}

double Scheduler::estimate(const Unit& unit) const {
  check_task(unit.task);
  std::lock_guard lock(mutex_);
  return cost_model_.estimate(unit.task, unit.shard, unit.phase);
}

}  // namespace hydra::core
