#include "core/simulator.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

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
  std::pair<int, int> base_shard{-1, -1};  // (base, shard) of the last base shard copied here
};

// Seconds to copy the unit's base shard, 0 where `kept` (the device's last base shard) is it; `kept` becomes it.
double base_copy(const SimulationConfig& config, const Unit& unit, std::pair<int, int>& kept,
                 SimulationResult& result) {
  const int base = config.tasks.at(static_cast<size_t>(unit.task)).base;
  if (base < 0 || !config.base_transfer || kept == std::pair<int, int>{base, unit.shard}) return 0.0;
  kept = {base, unit.shard};
  const double seconds = checked(config.base_transfer(unit.task, unit.shard, unit.phase), "transfer");
  result.base_transfer_seconds += seconds;
  return seconds;
}

struct Completion {
  double time;
  int device;
  Unit unit;
  double compute;
  bool operator>(const Completion& other) const {
    return time != other.time ? time > other.time : device > other.device;
  }
};

double exposed_transfer(const SimulationConfig& config, DeviceState& device, const Unit& unit, double now,
                        SimulationResult& result) {
  if (!config.transfer) return 0.0;
  if (device.ran_before && device.last_task == unit.task && device.last_shard == unit.shard) return 0.0;
  const double transfer = checked(config.transfer(unit.task, unit.shard, unit.phase), "transfer") +
                          base_copy(config, unit, device.base_shard, result);
  if (device.ran_before && device.last_end == now) return std::max(0.0, transfer - device.last_compute);
  return transfer;
}

bool has_backward(Phase phase) { return phase == Phase::kForwardBackward || phase == Phase::kBackward; }

// A device's host-to-device copy lane under Prefetch::kAlongPlan.
struct CopyLane {
  double free_at = 0.0;
  std::pair<int, int> base_shard{-1, -1};  // (base, shard) of the last base shard it copied
  std::vector<std::pair<Unit, double>> landing;  // planned units whose copy was issued, and when it lands

  double copy(double now, double seconds, SimulationResult& result) {
    free_at = std::max(now, free_at) + seconds;
    result.transfer_seconds += seconds;
    return free_at;
  }
};

// When `unit`, dispatched to `device` at `now`, may start: once its shard has landed. Then the lane copies the
// shards of the units the scheduler plans next for the device (a plan it commits to), as far as
// `prefetch_units` allows. Each visit of a shard has a copy of its own, but the same shard back to back.
double start_along_plan(const SimulationConfig& config, Scheduler& scheduler, int device,
                        const DeviceState& state, CopyLane& lane, const Unit& unit, double now,
                        SimulationResult& result) {
  double start = now;
  const bool same_shard = state.ran_before && state.last_task == unit.task && state.last_shard == unit.shard;
  auto issued = std::find_if(lane.landing.begin(), lane.landing.end(),
                             [&](const auto& entry) { return entry.first == unit; });
  if (issued != lane.landing.end()) {
    start = std::max(now, issued->second);
    lane.landing.erase(issued);
  } else if (!same_shard) {
    const double seconds = checked(config.transfer(unit.task, unit.shard, unit.phase), "transfer") +
                           base_copy(config, unit, lane.base_shard, result);
    start = lane.copy(now, seconds, result);
  }
  const std::vector<Unit> planned = scheduler.commit_plan(device, config.prefetch_units);
  std::erase_if(lane.landing, [&](const auto& entry) {
    return std::none_of(planned.begin(), planned.end(), [&](const Unit& p) { return p == entry.first; });
  });
  const Unit* previous = &unit;
  for (const Unit& p : planned) {
    if (static_cast<int>(lane.landing.size()) >= config.prefetch_units) break;
    const bool back_to_back = p.task == previous->task && p.shard == previous->shard;
    previous = &p;
    if (back_to_back || std::any_of(lane.landing.begin(), lane.landing.end(),
                                    [&](const auto& entry) { return entry.first == p; }))
      continue;
    const double seconds = checked(config.transfer(p.task, p.shard, p.phase), "transfer") +
                           base_copy(config, p, lane.base_shard, result);
    lane.landing.emplace_back(p, lane.copy(now, seconds, result));
  }
  return start;
}

SimulationResult simulate_scheduled(const SimulationConfig& config, std::vector<TaskSpec> tasks) {
  Scheduler scheduler(std::move(tasks), config.num_devices, config.policy, config.seed);
  std::vector<DeviceState> devices(static_cast<size_t>(config.num_devices));
  std::vector<CopyLane> lanes(static_cast<size_t>(config.num_devices));
  std::vector<double> gradient_lanes(static_cast<size_t>(config.num_devices), 0.0);
  const bool along_plan = config.transfer && config.prefetch == Prefetch::kAlongPlan;
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
      CopyLane& lane = lanes[static_cast<size_t>(d)];
      const double exposed = along_plan ? start_along_plan(config, scheduler, d, device, lane, *unit, now, result) - now
                                        : exposed_transfer(config, device, *unit, now, result);
      result.exposed_transfer_seconds += exposed;
      const double end = now + exposed + compute;
      if (along_plan && config.gradient_transfer && has_backward(unit->phase)) {
        const double seconds = checked(config.gradient_transfer(unit->task, unit->shard, unit->phase), "transfer");
        double& lane = gradient_lanes[static_cast<size_t>(d)];
        lane = std::max(end, lane) + seconds;
        result.gradient_transfer_seconds += seconds;
      }
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
      device = DeviceState{false, true, done.unit.task, done.unit.shard, done.time, done.compute, device.base_shard};
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

double transfer_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& transfer,
                      const UnitSeconds& gradient_transfer, int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("transfer_bound: num_devices must be >= 1");
  double in = 0.0, out = 0.0;
  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) {
    const TaskSpec& spec = tasks[static_cast<size_t>(t)];
    for (int64_t i = 0; i < total_units(spec); ++i) {
      const Unit unit = unit_at(t, spec, i);
      // A micro-batch's first unit (F(0), or FB(0) of a one-shard task) may reuse the weights the previous
      // micro-batch's last unit, on shard 0 too, left on the device.
      const bool may_reuse = unit.micro_batch > 0 && unit.shard == 0 &&
                             (unit.phase == Phase::kForward || unit.phase == Phase::kForwardBackward);
      if (transfer && !may_reuse) in += checked(transfer(unit.task, unit.shard, unit.phase), "transfer");
      if (gradient_transfer && has_backward(unit.phase))
        out += checked(gradient_transfer(unit.task, unit.shard, unit.phase), "transfer");
    }
  }
  return std::max(in, out) / num_devices;
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
