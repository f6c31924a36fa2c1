#include "core/lane_plan.h"

#include <optional>

namespace hydra::core {

namespace {

// `placement` with each task's first shard (and the shards tied to it) off the host where room allows: resident,
// else stepped on the device. The bound does not see what that saves: a task's first shard's step is the one its
// next step's first unit waits for, and the scheduler may give the device that unit at once.
Placement first_shards_off_host(const std::vector<TaskShape>& tasks, Placement placement, const StepBytes& bytes,
                                int num_devices, int64_t room) {
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (placement[t][0] != StepPlace::kHost) continue;
    for (StepPlace to : {StepPlace::kResident, StepPlace::kDevice}) {
      if (to == StepPlace::kResident && num_devices > 1) continue;
      Placement moved = placement;
      for (size_t s = 0; s < tasks[t].shards.size(); ++s) {
        const int tied = tasks[t].shards[s].tied_to;
        if (s == 0 || tied == 0 || (tied < 0 && tasks[t].shards[0].tied_to == static_cast<int>(s))) moved[t][s] = to;
      }
      if (placement_bytes(tasks, moved, bytes) <= room) {
        placement = std::move(moved);
        break;
      }
    }
  }
  return placement;
}

}  // namespace

LanePlan plan_lanes(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                    int num_devices, int64_t room) {
  std::optional<LanePlan> best;
  std::vector<Placement> tried;
  for (double headroom : kHeadrooms) {
    const Placement chosen = choose_placement(tasks, rates, bytes, num_devices, room, headroom);
    for (Placement placement : {chosen, first_shards_off_host(tasks, chosen, bytes, num_devices, room)}) {
      bool seen = false;
      for (const Placement& p : tried) seen = seen || p == placement;
      if (seen) continue;
      tried.push_back(placement);
      SimulationResult run = simulate(lane_simulation(tasks, placement, rates, bytes, num_devices));
      if (!best || run.makespan < best->run.makespan) {
        const LaneBound bound = lane_bound(tasks, placement, rates, bytes, num_devices);
        best = LanePlan{std::move(placement), headroom, bound, std::move(run)};
      }
    }
  }
  return *best;
}

}  // namespace hydra::core
