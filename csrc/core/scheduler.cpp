#include "core/scheduler.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace hydra::core {

namespace {

void check_spec(const TaskSpec& spec, size_t task, int num_devices) {
  const std::string which = "Scheduler: task " + std::to_string(task) + ": ";
  if (spec.num_shards < 1) {
    throw std::invalid_argument(which + "num_shards must be >= 1, got " + std::to_string(spec.num_shards));
  }
  if (spec.micro_batches < 0) {
    throw std::invalid_argument(which + "micro_batches must be >= 0, got " + std::to_string(spec.micro_batches));
  }
  check_eval_passes(spec, which);
  if (spec.device && (*spec.device < 0 || *spec.device >= num_devices)) {
    throw std::invalid_argument(which + "device " + std::to_string(*spec.device) + " out of range [0, " +
                                std::to_string(num_devices) + ")");
  }
}

std::vector<TaskSpec> validated(std::vector<TaskSpec> tasks, int num_devices) {
  if (num_devices < 1) {
    throw std::invalid_argument("Scheduler: num_devices must be >= 1, got " + std::to_string(num_devices));
  }
  if (tasks.empty()) throw std::invalid_argument("Scheduler: no tasks to schedule");
  for (size_t i = 0; i < tasks.size(); ++i) check_spec(tasks[i], i, num_devices);
  return tasks;
}

}  // namespace

Scheduler::Scheduler(std::vector<TaskSpec> tasks, int num_devices, PolicyKind policy, uint64_t seed)
    : num_devices_(num_devices),
      cost_model_(validated(tasks, num_devices)),
      policy_(policy, static_cast<int>(tasks.size()), num_devices, seed),
      saved_(static_cast<int>(tasks.size()), num_devices),
      committed_(static_cast<size_t>(num_devices)),
      starved_(static_cast<size_t>(num_devices), true),
      last_base_shard_(static_cast<size_t>(num_devices), {-1, -1}) {
  tasks_.reserve(tasks.size());
  for (const TaskSpec& spec : tasks) {
    tasks_.push_back(TaskState{spec, total_units(spec)});
    if (tasks_.back().total_units == 0) tasks_.back().state = State::kDone;  // resumed after its last step
  }
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
  if (open_) return true;
  for (const TaskState& task : tasks_) {
    if (task.state != State::kDone && !task.failed && allowed(task, device)) return true;
  }
  return false;
}

std::optional<Unit> Scheduler::take_locked(int device) {
  auto& committed = committed_[static_cast<size_t>(device)];
  while (!committed.empty()) {
    const auto [t, index] = committed.front();
    committed.pop_front();
    const TaskState& task = tasks_[static_cast<size_t>(t)];
    if (task.state == State::kIdle && !task.held && allowed(task, device) && task.next_index == index &&
        saved_bytes_admit(t, device))
      return take_task(device, t);
    committed.clear();
  }
  candidates_.clear();
  const bool needs_estimates = policy_.kind() == PolicyKind::kLrtf;
  // A unit at the head of another device's committed plan waits for that device (its weights are on their way
  // there), and a held task waits for its release, unless this device would otherwise have nothing to do: then
  // the reserved unit goes (that commitment lapses), and failing that the held one.
  for (const int pass : {0, 1, 2}) {
    for (int t = 0; t < num_tasks(); ++t) {
      const TaskState& task = tasks_[static_cast<size_t>(t)];
      if (task.state != State::kIdle || !allowed(task, device) || !saved_bytes_admit(t, device)) continue;
      if (pass == 0 && reserved_elsewhere(t, device)) continue;
      if (pass < 2 && task.held) continue;
      const double remaining = needs_estimates ? cost_model_.remaining_seconds(t, task.next_index) : 0.0;
      const bool reads_base = reads_base_shard(t, task.next_index, last_base_shard_[static_cast<size_t>(device)]);
      candidates_.push_back(Candidate{t, remaining, task.ready_sequence, task.last_device == device, reads_base});
    }
    if (!candidates_.empty()) break;
  }
  if (candidates_.empty()) {
    starved_[static_cast<size_t>(device)] = true;
    return std::nullopt;
  }
  return take_task(device, candidates_[policy_.choose(device, candidates_)].task);
}

Unit Scheduler::take_task(int device, int chosen) {
  policy_.commit(device, chosen);
  starved_[static_cast<size_t>(device)] = false;
  TaskState& task = tasks_[static_cast<size_t>(chosen)];
  task.state = State::kRunning;
  task.running_device = device;
  task.last_device = device;
  const Unit unit = unit_at(chosen, task.spec, task.next_index);
  if (starts_micro_batch(unit)) saved_.start(chosen, device);
  last_base_shard_[static_cast<size_t>(device)] = {task.spec.base, unit.shard};
  return unit;
}

bool Scheduler::reads_base_shard(int task, int64_t index, std::pair<int, int> last) const {
  const TaskSpec& spec = tasks_[static_cast<size_t>(task)].spec;
  return spec.base >= 0 && spec.base == last.first && unit_at(task, spec, index).shard == last.second;
}

bool Scheduler::saved_bytes_admit(int task, int device) const {
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  return !starts_micro_batch(unit_at(task, state.spec, state.next_index)) ||
         saved_.admits(saved_.load(device), task, device);
}

void Scheduler::settle(int task) {
  if (tasks_[static_cast<size_t>(task)].state == State::kDone) saved_.end(task);
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

Scheduler::TaskState& Scheduler::running(int device, const Unit& unit, const char* caller) {
  TaskState& task = tasks_[static_cast<size_t>(unit.task)];
  if (task.state != State::kRunning || task.running_device != device || task.next_index != unit.index) {
    throw std::invalid_argument(std::string("Scheduler::") + caller + ": unit " + std::to_string(unit.index) +
                                " of task " + std::to_string(unit.task) + " is not running on device " +
                                std::to_string(device));
  }
  return task;
}

void Scheduler::complete(int device, const Unit& unit, std::optional<double> seconds) {
  check_device(device);
  check_task(unit.task);
  {
    std::lock_guard lock(mutex_);
    TaskState& task = running(device, unit, "complete");
    // Validates the duration before any state changes, so a bad report leaves the task running.
    if (seconds) cost_model_.observe(unit.task, unit.shard, unit.phase, *seconds);
    ++task.next_index;
    task.running_device = -1;
    task.ready_sequence = ++event_sequence_;
    task.state = (task.failed || task.next_index >= task.total_units) ? State::kDone : State::kIdle;
    if (ends_micro_batch(unit)) saved_.end(unit.task);
    settle(unit.task);
  }
  ready_.notify_all();
}

void Scheduler::observe(const Unit& unit, double seconds) {
  check_task(unit.task);
  std::lock_guard lock(mutex_);
  cost_model_.observe(unit.task, unit.shard, unit.phase, seconds);
}

void Scheduler::hold(int task, bool held) {
  check_task(task);
  {
    std::lock_guard lock(mutex_);
    tasks_[static_cast<size_t>(task)].held = held;
  }
  if (!held) ready_.notify_all();
}

void Scheduler::fail(int task) {
  check_task(task);
  {
    std::lock_guard lock(mutex_);
    TaskState& state = tasks_[static_cast<size_t>(task)];
    state.failed = true;
    if (state.state == State::kIdle) state.state = State::kDone;
    settle(task);
  }
  // Workers whose only remaining task this was must wake to return nullopt.
  ready_.notify_all();
}

void Scheduler::restart(int device, const Unit& unit, const TaskSpec& spec) {
  check_device(device);
  check_task(unit.task);
  {
    std::lock_guard lock(mutex_);
    TaskState& task = running(device, unit, "restart");
    check_spec(spec, static_cast<size_t>(unit.task), num_devices_);
    cost_model_.replace_task(unit.task, spec);
    task.spec = spec;
    saved_.end(unit.task);  // its micro-batch starts over
    task.total_units = total_units(spec);
    task.next_index = 0;
    task.running_device = -1;
    task.ready_sequence = ++event_sequence_;
    task.state = (task.failed || task.total_units == 0) ? State::kDone : State::kIdle;
  }
  ready_.notify_all();
}

int Scheduler::add_task(const TaskSpec& spec) {
  int id;
  {
    std::lock_guard lock(mutex_);
    check_spec(spec, tasks_.size(), num_devices_);
    id = cost_model_.add_task(spec);
    policy_.add_task();
    saved_.add_task();
    tasks_.push_back(TaskState{spec, total_units(spec)});
    if (tasks_.back().total_units == 0) tasks_.back().state = State::kDone;
    tasks_.back().ready_sequence = ++event_sequence_;
  }
  ready_.notify_all();
  return id;
}

void Scheduler::set_saved_allowance(int device, int64_t bytes) {
  check_device(device);
  {
    std::lock_guard lock(mutex_);
    saved_.set_allowance(device, bytes);
  }
  ready_.notify_all();
}

void Scheduler::set_saved_bytes(int task, int64_t bytes) {
  check_task(task);
  {
    std::lock_guard lock(mutex_);
    saved_.set_saved_bytes(task, bytes);
  }
  ready_.notify_all();
}

int64_t Scheduler::saved_in_flight(int device) const {
  check_device(device);
  std::lock_guard lock(mutex_);
  return saved_.load(device).bytes;
}

void Scheduler::set_open(bool open) {
  {
    std::lock_guard lock(mutex_);
    open_ = open;
  }
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
