// The lane model's tasks under a placement as a run for the simulator (lanes.h, simulator.h): each shard's lanes,
// weight and state bytes where it steps, the scheduler's task specs, and the units' compute.
#include <algorithm>
#include <cmath>

#include "core/lane_checks.h"
#include "core/lanes.h"
#include "core/simulator.h"

namespace hydra::core {

using lane_checks::validate;
using lane_checks::validate_placement;

std::vector<StepSchedule> step_schedules(const std::vector<TaskShape>& tasks, const Placement& placement,
                                         const LaneRates& rates, const StepBytes& bytes) {
  validate(tasks, rates, bytes, 1);
  validate_placement(tasks, placement);
  std::vector<StepSchedule> schedules;
  for (size_t t = 0; t < tasks.size(); ++t) {
    StepSchedule schedule{tasks[t].accumulate, placement[t], {}, {}, {}};
    for (size_t s = 0; s < tasks[t].shards.size(); ++s) {
      // A visit's region holds what it copies in: a resident owner's tied weight is read in its home.
      const ShardShape shard = as_placed(tasks[t], placement[t], static_cast<int>(s));
      const bool apart = tie_apart(tasks[t], placement[t], static_cast<int>(s));
      schedule.lanes.push_back(shard_lanes(shard, placement[t][s], tasks[t].accumulate > 1, rates, bytes, apart));
      const double weight_bytes = std::ceil(bytes.weight * static_cast<double>(shard.weights));
      schedule.weight_bytes.push_back(static_cast<int64_t>(weight_bytes));
      schedule.state_bytes.push_back(step_room(shard, placement[t][s], bytes, tasks[t].sums_backwards(), apart));
    }
    schedules.push_back(std::move(schedule));
  }
  return schedules;
}

std::vector<TaskSpec> task_specs(const std::vector<TaskShape>& tasks) {
  std::vector<TaskSpec> specs;
  for (const TaskShape& task : tasks) {
    TaskSpec spec{static_cast<int>(task.shards.size()), task.micro_batches, std::nullopt};
    for (const ShardShape& shard : task.shards)
      spec.shard_costs.push_back(shard.forward_seconds + shard.backward_seconds);
    // The cost model takes positive costs only; with a shard that computes nothing, it assumes all alike.
    if (std::any_of(spec.shard_costs.begin(), spec.shard_costs.end(), [](double c) { return c <= 0.0; }))
      spec.shard_costs.clear();
    specs.push_back(std::move(spec));
  }
  return specs;
}

double unit_seconds(const std::vector<TaskShape>& tasks, int task, int shard, Phase phase) {
  const ShardShape& s = tasks.at(static_cast<size_t>(task)).shards.at(static_cast<size_t>(shard));
  switch (phase) {
    case Phase::kForward:
    case Phase::kEvaluate: return s.forward_seconds;
    case Phase::kBackward: return s.backward_seconds;
    case Phase::kForwardBackward: return s.forward_seconds + s.backward_seconds;
  }
  return 0.0;
}

SimulationConfig lane_simulation(const std::vector<TaskShape>& tasks, const Placement& placement,
                                 const LaneRates& rates, const StepBytes& bytes, int num_devices,
                                 int64_t arena_bytes) {
  SimulationConfig config;
  config.tasks = task_specs(tasks);
  config.compute = [tasks](int task, int shard, Phase phase) { return unit_seconds(tasks, task, shard, phase); };
  config.num_devices = num_devices;
  config.prefetch = Prefetch::kAlongPlan;
  config.steps = step_schedules(tasks, placement, rates, bytes);
  config.arena_bytes = arena_bytes;
  return config;
}

}  // namespace hydra::core
