#include "core/simulator.h"

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/scheduler.h"
#include "core/simulator_units.h"

namespace hydra::core {

namespace {

using simulated::checked;
using simulated::has_backward;
using simulated::unit_compute;

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


// A device's host-to-device copy lane under Prefetch::kAlongPlan.
struct CopyLane {
  double free_at = 0.0;
  std::pair<int, int> base_shard{-1, -1};  // (base, shard) of the last base shard it copied
  std::vector<std::pair<Unit, double>> landing;  // planned units whose copy was issued, and when it lands
  std::vector<std::pair<Unit, double>> states;   // steps: planned kDevice steps whose master and moments were issued

  double copy(double now, double seconds, SimulationResult& result, double not_before = 0.0) {
    free_at = std::max({now, free_at, not_before}) + seconds;
    result.transfer_seconds += seconds;
    return free_at;
  }
};

// Per (task, shard) under SimulationConfig::steps: steps issued so far, and when the latest step's weights are on
// the host to copy in.
struct ShardSteps {
  int64_t issued = 0;
  double ready = 0.0;
};

// A job on the host lane (an accumulation or a step of a kHost shard's gradient).
struct HostJob {
  int task;
  int shard;
  double landed;  // its gradient on the host
  double seconds;
  bool step;
  double start = 0.0;
};

struct StepState {
  std::vector<std::vector<ShardSteps>> shards;
  double host_free = 0.0;  // the host lane, all devices'
  std::vector<HostJob> host_jobs;  // the lane's jobs not yet ended when the latest one's gradient landed

  explicit StepState(const SimulationConfig& config) {
    for (const StepSchedule& schedule : config.steps) shards.emplace_back(schedule.places.size());
  }
  ShardSteps& of(const Unit& unit) { return shards[static_cast<size_t>(unit.task)][static_cast<size_t>(unit.shard)]; }
};

StepPlace place_of(const SimulationConfig& config, const Unit& unit) {
  return config.steps.empty() ? StepPlace::kHost
                              : config.steps[static_cast<size_t>(unit.task)].places[static_cast<size_t>(unit.shard)];
}

const ShardLanes& lanes_of(const SimulationConfig& config, const Unit& unit) {
  return config.steps[static_cast<size_t>(unit.task)].lanes[static_cast<size_t>(unit.shard)];
}

bool copies_weights(const SimulationConfig& config, const Unit& unit) {
  return place_of(config, unit) != StepPlace::kResident;
}

double weights_seconds(const SimulationConfig& config, const Unit& unit) {
  if (!config.steps.empty()) return lanes_of(config, unit).weights_in;
  return checked(config.transfer(unit.task, unit.shard, unit.phase), "transfer");
}

// The unit starts a step after a host step of its shard: a copy the device holds from before is stale.
bool after_host_step(const SimulationConfig& config, const Unit& unit) {
  if (config.steps.empty() || place_of(config, unit) != StepPlace::kHost || unit.phase == Phase::kBackward)
    return false;
  return unit.micro_batch > 0 && unit.micro_batch % config.steps[static_cast<size_t>(unit.task)].accumulate == 0;
}

double ready_at(const SimulationConfig& config, StepState& steps, const Unit& unit) {
  return config.steps.empty() ? 0.0 : steps.of(unit).ready;
}

// Every step before the unit's has been issued and is done by `now`: the weights it reads are there to copy. A
// prefetch waits for that, so that a copy lane never stands still behind a step while other copies could run.
bool weights_ready(const SimulationConfig& config, StepState& steps, const Unit& unit, double now) {
  if (config.steps.empty()) return true;
  const int64_t accumulate = config.steps[static_cast<size_t>(unit.task)].accumulate;
  const bool issued = steps.of(unit).issued >= unit.micro_batch / accumulate;
  return issued && ready_at(config, steps, unit) <= now;
}

// When `unit`, dispatched to `device` at `now`, may start: once its shard has landed.
double own_copy(const SimulationConfig& config, const DeviceState& state, CopyLane& lane, StepState& steps,
                const Unit& unit, double now, SimulationResult& result) {
  const bool same_shard = state.ran_before && state.last_task == unit.task && state.last_shard == unit.shard &&
                          !after_host_step(config, unit);
  auto issued = std::find_if(lane.landing.begin(), lane.landing.end(),
                             [&](const auto& entry) { return entry.first == unit; });
  if (issued != lane.landing.end()) {
    const double start = std::max(now, issued->second);
    lane.landing.erase(issued);
    return start;
  }
  if (same_shard || !copies_weights(config, unit)) return now;
  const double seconds = weights_seconds(config, unit) + base_copy(config, unit, lane.base_shard, result);
  return lane.copy(now, seconds, result, ready_at(config, steps, unit));
}

bool ends_step(const SimulationConfig& config, const Unit& unit);

bool ends_step(const SimulationConfig& config, const Unit& unit) {
  const int64_t accumulate = config.steps[static_cast<size_t>(unit.task)].accumulate;
  return (unit.micro_batch + 1) % accumulate == 0 ||
         unit.micro_batch + 1 == config.tasks[static_cast<size_t>(unit.task)].micro_batches;
}

// The unit's backward ends a step of a shard stepped on the device: its master and moments come in for it.
bool steps_on_device(const SimulationConfig& config, const Unit& unit) {
  return !config.steps.empty() && has_backward(unit.phase) && place_of(config, unit) == StepPlace::kDevice &&
         ends_step(config, unit);
}

// The unit (shard 0's backward) ends a step: when the task's next forward can run without waiting for a step, as
// the engine's SpilledModel::next_step_waits reads it. That forward waits for the steps of the shards it copies
// in, up to the first one stepped on the host (the last of its host steps to finish); a resident shard's weights
// are always there. 0 where none is to wait for.
double next_forward_ready(const SimulationConfig& config, StepState& steps, const Unit& unit) {
  if (config.steps.empty() || unit.shard != 0 || !has_backward(unit.phase) || !ends_step(config, unit)) return 0.0;
  const std::vector<StepPlace>& places = config.steps[static_cast<size_t>(unit.task)].places;
  double ready = 0.0;
  for (size_t shard = 0; shard < places.size(); ++shard) {
    if (places[shard] == StepPlace::kResident) continue;
    ready = std::max(ready, steps.shards[static_cast<size_t>(unit.task)][shard].ready);
    if (places[shard] == StepPlace::kHost) break;
  }
  return ready;
}

// The lane copies the shards of the units the scheduler plans next for the device (a plan it commits to), as far
// as `prefetch_units` allows. Each visit of a shard has a copy of its own, but the same shard back to back.
void prefetch_plan(const SimulationConfig& config, Scheduler& scheduler, int device, CopyLane& lane, StepState& steps,
                   const Unit& unit, double now, SimulationResult& result) {
  const std::vector<Unit> planned = scheduler.commit_plan(device, config.prefetch_units);
  std::erase_if(lane.landing, [&](const auto& entry) {
    return std::none_of(planned.begin(), planned.end(), [&](const Unit& p) { return p == entry.first; });
  });
  const Unit* previous = &unit;
  for (const Unit& p : planned) {
    if (static_cast<int>(lane.landing.size()) >= config.prefetch_units) break;
    const bool back_to_back = p.task == previous->task && p.shard == previous->shard && !after_host_step(config, p);
    previous = &p;
    if (back_to_back || !copies_weights(config, p) || !weights_ready(config, steps, p, now) ||
        std::any_of(lane.landing.begin(), lane.landing.end(), [&](const auto& entry) { return entry.first == p; }))
      continue;
    const double seconds = weights_seconds(config, p) + base_copy(config, p, lane.base_shard, result);
    lane.landing.emplace_back(p, lane.copy(now, seconds, result, ready_at(config, steps, p)));
    if (steps_on_device(config, p)) lane.states.emplace_back(p, lane.copy(now, lanes_of(config, p).state_in, result));
  }
}

// A kDevice shard's master and moments for the backward that ends its step: when they land (-1: no such step).
// Prefetched behind the backward's own weights where the plan held it, else issued with it.
double state_in(const SimulationConfig& config, CopyLane& lane, const Unit& unit, double now,
                SimulationResult& result) {
  if (!steps_on_device(config, unit)) return -1.0;
  auto issued = std::find_if(lane.states.begin(), lane.states.end(), [&](const auto& e) { return e.first == unit; });
  if (issued != lane.states.end()) {
    const double landed = issued->second;
    lane.states.erase(issued);
    return landed;
  }
  return lane.copy(now, lanes_of(config, unit).state_in, result);
}

// Puts a host job on the lane as the engine's host-step threads take them: one of a task at a time, and of a task's
// jobs whose gradients have landed, the lowest shard's first (the next forward needs it first). The job goes ahead
// of the task's jobs of higher shards just before it on the lane that had not started when its gradient landed;
// they start again, in turn, after it, and their steps' weights are ready later.
void queue_host_job(StepState& steps, HostJob job) {
  std::vector<HostJob>& lane = steps.host_jobs;
  std::erase_if(lane, [&](const HostJob& queued) { return queued.start + queued.seconds <= job.landed; });
  size_t at = lane.size();
  auto passes = [&](const HostJob& queued) {
    return queued.task == job.task && queued.shard > job.shard && queued.start >= job.landed;
  };
  while (at > 0 && passes(lane[at - 1])) --at;
  // Every job before it on the lane that is not there any more ended by the time its gradient landed.
  double free = at > 0 ? lane[at - 1].start + lane[at - 1].seconds : 0.0;
  lane.insert(lane.begin() + static_cast<std::ptrdiff_t>(at), job);
  for (size_t i = at; i < lane.size(); ++i) {
    HostJob& queued = lane[i];
    queued.start = std::max(queued.landed, free);
    free = queued.start + queued.seconds;
    if (queued.step) steps.shards[static_cast<size_t>(queued.task)][static_cast<size_t>(queued.shard)].ready = free;
  }
  steps.host_free = free;
}

// What follows a unit that computed until `end`: its gradient out and, where it ends a step, the step. Returns
// when the device is free: after a device step, where one runs.
double after_unit(const SimulationConfig& config, const Unit& unit, double end, double state_landed,
                  double& gradient_lane, StepState& steps, SimulationResult& result) {
  if (!has_backward(unit.phase)) return end;
  auto out = [&](double after, double seconds) {
    gradient_lane = std::max(after, gradient_lane) + seconds;
    result.gradient_transfer_seconds += seconds;
    return gradient_lane;
  };
  if (config.steps.empty()) {
    if (config.gradient_transfer)
      out(end, checked(config.gradient_transfer(unit.task, unit.shard, unit.phase), "transfer"));
    return end;
  }
  const ShardLanes& lanes = lanes_of(config, unit);
  const bool step = ends_step(config, unit);
  ShardSteps& shard = steps.of(unit);
  switch (place_of(config, unit)) {
    case StepPlace::kHost: {
      const double landed = out(end, lanes.gradient_out);
      const double seconds = step ? lanes.host_step : lanes.host_accumulate;
      result.host_seconds += seconds;
      if (step) ++shard.issued;
      queue_host_job(steps, HostJob{unit.task, unit.shard, landed, seconds, step});
      return end;
    }
    case StepPlace::kDevice: {
      if (!step) return end;
      result.exposed_transfer_seconds += std::max(0.0, state_landed - end);
      const double stepped = std::max(end, state_landed) + lanes.device_step;
      result.device_step_seconds += lanes.device_step;
      shard = ShardSteps{shard.issued + 1, out(stepped, lanes.state_out)};
      return stepped;
    }
    case StepPlace::kResident:
      if (!step) return end;
      result.device_step_seconds += lanes.device_step;
      shard.issued += 1;
      return end + lanes.device_step;
  }
  return end;
}

SimulationResult simulate_scheduled(const SimulationConfig& config, std::vector<TaskSpec> tasks) {
  Scheduler scheduler(std::move(tasks), config.num_devices, config.policy, config.seed);
  std::vector<DeviceState> devices(static_cast<size_t>(config.num_devices));
  std::vector<CopyLane> lanes(static_cast<size_t>(config.num_devices));
  std::vector<double> gradient_lanes(static_cast<size_t>(config.num_devices), 0.0);
  StepState steps(config);
  const bool along_plan = (config.transfer || !config.steps.empty()) && config.prefetch == Prefetch::kAlongPlan;
  std::priority_queue<Completion, std::vector<Completion>, std::greater<>> events;
  SimulationResult result;
  double now = 0.0;
  std::vector<std::pair<int, double>> held;  // tasks held back for a step their next forward needs, and until when
  for (;;) {
    std::erase_if(held, [&](const std::pair<int, double>& entry) {
      if (entry.second > now) return false;
      scheduler.hold(entry.first, false);
      return true;
    });
    // Free devices ask in id order, so runs are deterministic.
    for (int d = 0; d < config.num_devices; ++d) {
      DeviceState& device = devices[static_cast<size_t>(d)];
      if (device.busy) continue;
      const std::optional<Unit> unit = scheduler.try_next(d);
      if (!unit) continue;
      const double compute = unit_compute(config.compute, *unit);
      CopyLane& lane = lanes[static_cast<size_t>(d)];
      double start = now, state_landed = -1.0;
      if (along_plan) {
        start = own_copy(config, device, lane, steps, *unit, now, result);
        state_landed = state_in(config, lane, *unit, now, result);
        prefetch_plan(config, scheduler, d, lane, steps, *unit, now, result);
      } else {
        start = now + exposed_transfer(config, device, *unit, now, result);
      }
      result.exposed_transfer_seconds += start - now;
      const double end = after_unit(config, *unit, start + compute, state_landed,
                                    gradient_lanes[static_cast<size_t>(d)], steps, result);
      if (const double ready = next_forward_ready(config, steps, *unit); config.hold_for_steps && ready > end) {
        // As the engine's device loop does: the task's next forward would wait for a step, so other tasks go first
        // until it is done.
        scheduler.hold(unit->task, true);
        held.emplace_back(unit->task, ready);
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
  if (!config.steps.empty()) {
    // The run ends when its last step has: the host's, or a device step's state back home.
    result.makespan = std::max({result.makespan, steps.host_free,
                                *std::max_element(gradient_lanes.begin(), gradient_lanes.end())});
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
  if (config.steps.empty()) return;
  if (config.prefetch != Prefetch::kAlongPlan || config.transfer || config.gradient_transfer)
    throw std::invalid_argument("simulate: steps need Prefetch::kAlongPlan, and no transfer or gradient_transfer");
  if (config.steps.size() != config.tasks.size()) throw std::invalid_argument("simulate: one StepSchedule a task");
  for (size_t t = 0; t < config.tasks.size(); ++t) {
    const StepSchedule& schedule = config.steps[t];
    const auto shards = static_cast<size_t>(config.tasks[t].num_shards);
    if (schedule.accumulate < 1 || schedule.places.size() != shards || schedule.lanes.size() != shards)
      throw std::invalid_argument("simulate: task " + std::to_string(t) +
                                  "'s StepSchedule needs accumulate >= 1 and a place and lanes for every shard");
    if (eval_passes(config.tasks[t]) > 0)
      throw std::invalid_argument("simulate: task " + std::to_string(t) + " evaluates; steps are modelled without");
  }
}

}  // namespace

SimulationConfig lane_simulation(const std::vector<TaskShape>& tasks, const Placement& placement,
                                 const LaneRates& rates, const StepBytes& bytes, int num_devices) {
  SimulationConfig config;
  config.tasks = task_specs(tasks);
  config.compute = [tasks](int task, int shard, Phase phase) { return unit_seconds(tasks, task, shard, phase); };
  config.num_devices = num_devices;
  config.prefetch = Prefetch::kAlongPlan;
  config.steps = step_schedules(tasks, placement, rates, bytes);
  return config;
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
