#include "core/simulator.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>

#include "core/scheduler.h"

namespace hydra::core {

namespace {

double checked(double seconds, const char* what) {
  if (!(seconds >= 0.0) || !std::isfinite(seconds)) {
    throw std::invalid_argument(std::string("simulate: ") + what + " time must be finite and >= 0, got " +
                                std::to_string(seconds));
  }
  return seconds;
}

double unit_compute(const UnitSeconds& compute, const Unit& unit) {
  return checked(compute(unit.task, unit.shard, unit.phase), "compute");
}

struct DeviceState {
  bool busy = false;
  bool ran_before = false;
  int last_task = -1;
  int last_shard = -1;
  double last_end = 0.0;
  double last_compute = 0.0;
};

struct Completion {
  double time;
  int device;
  Unit unit;
  double compute;
  bool operator>(const Completion& other) const {
    return time != other.time ? time > other.time : device > other.device;
  }
};

double exposed_transfer(const SimulationConfig& config, const DeviceState& device, const Unit& unit, double now) {
  if (!config.transfer) return 0.0;
  if (device.ran_before && device.last_task == unit.task && device.last_shard == unit.shard) return 0.0;
  const double transfer = checked(config.transfer(unit.task, unit.shard, unit.phase), "transfer");
  if (device.ran_before && device.last_end == now) return std::max(0.0, transfer - device.last_compute);
  return transfer;
}

SimulationResult simulate_scheduled(const SimulationConfig& config, std::vector<TaskSpec> tasks) {
  Scheduler scheduler(std::move(tasks), config.num_devices, config.policy, config.seed);
  std::vector<DeviceState> devices(static_cast<size_t>(config.num_devices));
  std::priority_queue<Completion, std::vector<Completion>, std::greater<>> events;
  SimulationResult result;
  double now = 0.0;
  for (;;) {
    // Free devices ask in id order, so runs are deterministic.
    for (int d = 0; d < config.num_devices; ++d) {
      DeviceState& device = devices[static_cast<size_t>(d)];
      if (device.busy) continue;
      const std::optional<Unit> unit = scheduler.try_next(d);
      if (!unit) continue;
      const double compute = unit_compute(config.compute, *unit);
      const double exposed = exposed_transfer(config, device, *unit, now);
      result.exposed_transfer_seconds += exposed;
      const double end = now + exposed + compute;
      result.trace.push_back(TraceEntry{d, unit->task, unit->index, now, end});
      device.busy = true;
      events.push(Completion{end, d, *unit, compute});
    }
    if (events.empty()) break;
    now = events.top().time;
    while (!events.empty() && events.top().time == now) {
      const Completion done = events.top();
      events.pop();
      scheduler.complete(done.device, done.unit, done.compute);
      DeviceState& device = devices[static_cast<size_t>(done.device)];
      device = DeviceState{false, true, done.unit.task, done.unit.shard, done.time, done.compute};
    }
    result.makespan = now;
  }
  for (int t = 0; t < scheduler.num_tasks(); ++t) {
    if (!scheduler.finished(t)) {
      throw std::logic_error("simulate: task " + std::to_string(t) + " never finished (no device may run it)");
    }
  }
  return result;
}

SimulationResult simulate_model_parallel(const SimulationConfig& config) {
  SimulationResult result;
  double now = 0.0;
  for (int t = 0; t < static_cast<int>(config.tasks.size()); ++t) {
    const TaskSpec& spec = config.tasks[static_cast<size_t>(t)];
    for (int64_t i = 0; i < total_units(spec); ++i) {
      const Unit unit = unit_at(t, spec, i);
      const int device = static_cast<int>(int64_t{unit.shard} * config.num_devices / spec.num_shards);
      const double end = now + unit_compute(config.compute, unit);
      result.trace.push_back(TraceEntry{device, t, i, now, end});
      now = end;
    }
  }
  result.makespan = now;
  return result;
}

void validate(const SimulationConfig& config) {
  if (!config.compute) throw std::invalid_argument("simulate: compute function is empty");
  if (config.num_devices < 1) throw std::invalid_argument("simulate: num_devices must be >= 1");
  if (config.tasks.empty()) throw std::invalid_argument("simulate: no tasks");
  for (const TaskSpec& spec : config.tasks) {
    if (spec.num_shards < 1 || spec.micro_batches < 1) {
      throw std::invalid_argument("simulate: every task needs num_shards >= 1 and micro_batches >= 1");
    }
  }
}

}  // namespace

double task_seconds(const std::vector<TaskSpec>& tasks, int task, const UnitSeconds& compute) {
  const TaskSpec& spec = tasks.at(static_cast<size_t>(task));
  double per_micro_batch = 0.0;
  for (int64_t p = 0; p < units_per_micro_batch(spec.num_shards); ++p) {
    per_micro_batch += unit_compute(compute, unit_at(task, spec.num_shards, p));
  }
  double per_eval_batch = 0.0;
  for (int shard = 0; shard < spec.num_shards; ++shard) {
    per_eval_batch += unit_compute(compute, Unit{task, 0, shard, Phase::kEvaluate, 0});
  }
  return per_micro_batch * static_cast<double>(spec.micro_batches) +
         per_eval_batch * static_cast<double>(spec.eval_batches * eval_passes(spec));
}

double lower_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute, int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("lower_bound: num_devices must be >= 1");
  double total = 0.0;
  double longest = 0.0;
  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) {
    const double chain = task_seconds(tasks, t, compute);
    total += chain;
    longest = std::max(longest, chain);
  }
  return std::max(total / num_devices, longest);
}

std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("assign_longest_first: num_devices must be >= 1");
  return assign_longest_first(tasks, compute, std::vector<double>(static_cast<size_t>(num_devices), 0.0));
}

std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      std::vector<double> load) {
  if (load.empty()) throw std::invalid_argument("assign_longest_first: no device to assign to");
  const int num_devices = static_cast<int>(load.size());
  const int n = static_cast<int>(tasks.size());
  std::vector<double> work(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) work[static_cast<size_t>(t)] = task_seconds(tasks, t, compute);
  std::vector<int> assignment(static_cast<size_t>(n), -1);
  // Pinned tasks load their device first, so the greedy pass sees the real loads.
  for (int t = 0; t < n; ++t) {
    if (const auto& device = tasks[static_cast<size_t>(t)].device) {
      if (*device < 0 || *device >= num_devices) {
        throw std::invalid_argument("assign_longest_first: task " + std::to_string(t) + " pinned to device " +
                                    std::to_string(*device) + ", out of range");
      }
      assignment[static_cast<size_t>(t)] = *device;
      load.at(static_cast<size_t>(*device)) += work[static_cast<size_t>(t)];
    }
  }
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return work[static_cast<size_t>(a)] > work[static_cast<size_t>(b)]; });
  for (int t : order) {
    if (assignment[static_cast<size_t>(t)] >= 0) continue;
    const auto lightest = std::min_element(load.begin(), load.end()) - load.begin();
    assignment[static_cast<size_t>(t)] = static_cast<int>(lightest);
    load[static_cast<size_t>(lightest)] += work[static_cast<size_t>(t)];
  }
  return assignment;
}

SimulationResult simulate(const SimulationConfig& config) {
  validate(config);
  switch (config.mode) {
    case Mode::kModelParallel: return simulate_model_parallel(config);
    case Mode::kTaskParallel: {
      std::vector<TaskSpec> bound = config.tasks;
      const std::vector<int> assignment = assign_longest_first(config.tasks, config.compute, config.num_devices);
      for (size_t t = 0; t < bound.size(); ++t) bound[t].device = assignment[t];
      return simulate_scheduled(config, std::move(bound));
    }
    case Mode::kSharp: return simulate_scheduled(config, config.tasks);
  }
  throw std::invalid_argument("simulate: unknown mode");
}

}  // namespace hydra::core
