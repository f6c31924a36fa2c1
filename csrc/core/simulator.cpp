#include "core/simulator.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/scheduler.h"
#include "core/simulator_cache.h"
#include "core/simulator_steps.h"
#include "core/simulator_units.h"

namespace hydra::core {

namespace {

using simulated::after_host_step;
using simulated::after_unit;
using simulated::checked;
using simulated::copies_weights;
using simulated::CopyOutLane;
using simulated::lanes_of;
using simulated::next_forward_ready;
using simulated::ready_at;
using simulated::StepState;
using simulated::steps_on_device;
using simulated::unit_compute;
using simulated::WeightCache;
using simulated::weights_ready;
using simulated::weights_seconds;

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
  struct Landing {
    Unit unit;
    double landed;
    bool kept;  // no copy: the device keeps the unit's weights (held for it)
  };
  std::vector<Landing> landing;  // planned units whose copy was issued (or is kept), and when it lands
  struct Region {
    double home;    // its arena room is free again (infinity until its step is placed)
    int64_t bytes;
  };
  // Device steps' states and gradients going out, in the arena (SimulationConfig::arena_bytes).
  std::vector<Region> regions;

  int64_t region_bytes(double now) const {
    int64_t taken = 0;
    for (const Region& region : regions)
      if (region.home > now) taken += region.bytes;
    return taken;
  }

  double copy(double now, double seconds, SimulationResult& result, double not_before = 0.0) {
    free_at = std::max({now, free_at, not_before}) + seconds;
    result.transfer_seconds += seconds;
    return free_at;
  }
};

// The step whose weights the unit reads: the number of its shard's steps before its micro-batch.
int64_t step_read(const SimulationConfig& config, const Unit& unit) {
  return unit.micro_batch / config.steps[static_cast<size_t>(unit.task)].accumulate;
}

int64_t weight_bytes(const SimulationConfig& config, const Unit& unit) {
  return config.steps[static_cast<size_t>(unit.task)].weight_bytes[static_cast<size_t>(unit.shard)];
}

// When the copy `cache` keeps of the unit's weights is there to compute on; -1 where it keeps none (or none is kept).
double kept(const SimulationConfig& config, WeightCache* cache, const Unit& unit) {
  if (!cache) return -1.0;
  const WeightCache::Entry* entry = cache->use(unit.task, unit.shard, step_read(config, unit));
  return entry ? entry->landed : -1.0;
}

// When `unit`, dispatched to `device` at `now`, may start: once its shard has landed. `cache`: the device's kept
// copies (null: none kept).
double own_copy(const SimulationConfig& config, const DeviceState& state, CopyLane& lane, StepState& steps,
                WeightCache* cache, const Unit& unit, double now, SimulationResult& result) {
  const bool same_shard = state.ran_before && state.last_task == unit.task && state.last_shard == unit.shard &&
                          !after_host_step(config, unit);
  auto issued = std::find_if(lane.landing.begin(), lane.landing.end(),
                             [&](const CopyLane::Landing& entry) { return entry.unit == unit; });
  if (issued != lane.landing.end()) {
    const double start = std::max(now, issued->landed);
    if (issued->kept) ++result.kept_visits;
    lane.landing.erase(issued);
    return start;
  }
  // The same shard again computes on the copy it holds, once the step on the device that rewrites it is done.
  if (same_shard) return config.steps.empty() ? now : std::max(now, steps.of(unit).stepped);
  if (!copies_weights(config, unit)) return now;
  if (const double landed = kept(config, cache, unit); landed >= 0.0) {
    ++result.kept_visits;
    return std::max(now, landed);
  }
  const double seconds = weights_seconds(config, unit) + base_copy(config, unit, lane.base_shard, result);
  const double landed = lane.copy(now, seconds, result, ready_at(config, steps, unit));
  if (cache) cache->put(unit.task, unit.shard, step_read(config, unit), landed, weight_bytes(config, unit));
  return landed;
}

// Evicts kept copies until `need` bytes more fit in the device's arena beside its device steps' states, the gradients
// going out and the copies landing for its plan (the unit in use is the working set the budget keeps apart); false
// where those alone leave no such room.
bool make_room(const SimulationConfig& config, WeightCache& cache, const CopyLane& lane, StepState& steps,
               const Unit& unit, const std::vector<Unit>& planned, double now, int64_t need) {
  std::vector<Unit> pinned{unit};
  for (const CopyLane::Landing& landing : lane.landing) pinned.push_back(landing.unit);
  const int64_t room = config.arena_bytes - lane.region_bytes(now) + cache.held(unit.task, unit.shard) - need;
  return cache.trim(room, pinned, planned, [&](int task, int shard) {
    return steps.shards[static_cast<size_t>(task)][static_cast<size_t>(shard)].issued;
  });
}

// The lane copies the shards of the units the scheduler plans next for the device (a plan it commits to), as far
// as `prefetch_units` allows and, with an arena, as far as it has room for them (evicting kept copies needed later).
// Each visit of a shard has a copy of its own, but the same shard back to back and one the device keeps (`cache`,
// null: none). Returns the plan.
std::vector<Unit> prefetch_plan(const SimulationConfig& config, Scheduler& scheduler, int device, CopyLane& lane,
                                StepState& steps, WeightCache* cache, const Unit& unit, double now,
                                SimulationResult& result) {
  const std::vector<Unit> planned = scheduler.commit_plan(device, config.prefetch_units);
  std::erase_if(lane.landing, [&](const CopyLane::Landing& entry) {
    return std::none_of(planned.begin(), planned.end(), [&](const Unit& p) { return p == entry.unit; });
  });
  const Unit* previous = &unit;
  for (const Unit& p : planned) {
    if (static_cast<int>(lane.landing.size()) >= config.prefetch_units) break;
    const bool back_to_back = p.task == previous->task && p.shard == previous->shard && !after_host_step(config, p);
    previous = &p;
    if (back_to_back || !copies_weights(config, p) ||
        std::any_of(lane.landing.begin(), lane.landing.end(),
                    [&](const CopyLane::Landing& entry) { return entry.unit == p; }))
      continue;
    if (const double landed = kept(config, cache, p); landed >= 0.0) {
      lane.landing.push_back({p, landed, true});  // held for the unit as a copy would be
      continue;
    }
    if (!weights_ready(config, steps, p, now)) continue;
    if (cache && !make_room(config, *cache, lane, steps, unit, planned, now, weight_bytes(config, p))) break;
    const double seconds = weights_seconds(config, p) + base_copy(config, p, lane.base_shard, result);
    lane.landing.push_back({p, lane.copy(now, seconds, result, ready_at(config, steps, p)), false});
    if (cache) cache->put(p.task, p.shard, step_read(config, p), lane.landing.back().landed, weight_bytes(config, p));
  }
  return planned;
}

// A kDevice shard's master and moments for the backward that ends its step: when they land (-1: no such step), and
// with an arena, the state it takes there (`taken`, -1: none; its `home` is set once its step is placed). Issued as
// the backward starts, behind its own weights and those prefetched for the units planned next, as the engine's device
// loop issues them (the compute needs those first), and once the states on the device leave it room, going home in
// turn (one that needs more than the whole arena waits for all of them).
double state_in(const SimulationConfig& config, CopyLane& lane, const Unit& unit, double now,
                SimulationResult& result, int& taken) {
  taken = -1;
  if (!steps_on_device(config, unit)) return -1.0;
  double room_at = 0.0;
  if (config.arena_bytes >= 0) {
    std::erase_if(lane.regions, [&](const CopyLane::Region& region) { return region.home <= now; });
    std::vector<CopyLane::Region> in_turn = lane.regions;
    std::sort(in_turn.begin(), in_turn.end(),
              [](const CopyLane::Region& a, const CopyLane::Region& b) { return a.home < b.home; });
    const int64_t need = config.steps[static_cast<size_t>(unit.task)].state_bytes[static_cast<size_t>(unit.shard)];
    int64_t held = lane.region_bytes(now);
    for (const CopyLane::Region& region : in_turn) {
      if (held + need <= config.arena_bytes) break;
      room_at = region.home;
      held -= region.bytes;
    }
    lane.regions.push_back({std::numeric_limits<double>::infinity(), need});
    taken = static_cast<int>(lane.regions.size()) - 1;
  }
  return lane.copy(now, lanes_of(config, unit).state_in, result, room_at);
}

SimulationResult simulate_scheduled(const SimulationConfig& config, std::vector<TaskSpec> tasks) {
  Scheduler scheduler(std::move(tasks), config.num_devices, config.policy, config.seed);
  std::vector<DeviceState> devices(static_cast<size_t>(config.num_devices));
  std::vector<CopyLane> lanes(static_cast<size_t>(config.num_devices));
  std::vector<CopyOutLane> copies_out(static_cast<size_t>(config.num_devices));
  StepState steps(config);
  const bool along_plan = (config.transfer || !config.steps.empty()) && config.prefetch == Prefetch::kAlongPlan;
  const bool keeps = along_plan && !config.steps.empty() && config.arena_bytes >= 0;
  std::vector<WeightCache> caches(static_cast<size_t>(config.num_devices));
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
      int state = -1;
      WeightCache* cache = keeps ? &caches[static_cast<size_t>(d)] : nullptr;
      if (along_plan) {
        start = own_copy(config, device, lane, steps, cache, *unit, now, result);
        const std::vector<Unit> planned = prefetch_plan(config, scheduler, d, lane, steps, cache, *unit, now, result);
        state_landed = state_in(config, lane, *unit, now, result, state);
        if (cache) make_room(config, *cache, lane, steps, *unit, planned, now, 0);
      } else {
        start = now + exposed_transfer(config, device, *unit, now, result);
      }
      result.exposed_transfer_seconds += start - now;
      double gradient_out = -1.0;
      const double end = after_unit(config, *unit, start + compute, state_landed,
                                    copies_out[static_cast<size_t>(d)], steps, result, gradient_out);
      // The step's state leaves the arena once it is home; a gradient going out holds its room until it has left
      // (the unit's working set has room for the next one's).
      if (state >= 0) lane.regions[static_cast<size_t>(state)].home = steps.of(*unit).ready;
      if (cache && gradient_out > end) lane.regions.push_back({gradient_out, weight_bytes(config, *unit)});
      // A device step rewrites the copy the device keeps of the weights it stepped.
      if (cache && steps_on_device(config, *unit))
        cache->rewrite(unit->task, unit->shard, steps.of(*unit).issued, steps.of(*unit).stepped);
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
    for (const CopyOutLane& lane : copies_out) result.makespan = std::max(result.makespan, lane.last_end);
    result.makespan = std::max(result.makespan, steps.host_free);
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
  if (config.arena_bytes < -1) throw std::invalid_argument("simulate: arena_bytes must be >= -1");
  for (size_t t = 0; t < config.tasks.size(); ++t) {
    const StepSchedule& schedule = config.steps[t];
    const auto shards = static_cast<size_t>(config.tasks[t].num_shards);
    if (schedule.accumulate < 1 || schedule.places.size() != shards || schedule.lanes.size() != shards)
      throw std::invalid_argument("simulate: task " + std::to_string(t) +
                                  "'s StepSchedule needs accumulate >= 1 and a place and lanes for every shard");
    auto sized = [&](const std::vector<int64_t>& per_shard) {
      return per_shard.size() == shards &&
             std::none_of(per_shard.begin(), per_shard.end(), [](int64_t b) { return b < 0; });
    };
    if (config.arena_bytes >= 0 && (!sized(schedule.weight_bytes) || !sized(schedule.state_bytes)))
      throw std::invalid_argument("simulate: task " + std::to_string(t) +
                                  "'s StepSchedule needs weight_bytes and state_bytes >= 0 for every shard to keep "
                                  "an arena");
    if (eval_passes(config.tasks[t]) > 0)
      throw std::invalid_argument("simulate: task " + std::to_string(t) + " evaluates; steps are modelled without");
  }
}

}  // namespace

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
