// The placement a run gets: the lane model's choice (choose_placement) at several headrooms, with homes and
// without (device steps only), each also with each task's first shards off the host, all simulated, the shortest
// simulated run kept. The bound alone cannot say how much slack a copy or host lane needs, since that depends on
// how the tasks' steps bunch up, nor what a step late off the host costs the unit that waits for it; the
// simulator, driving the real scheduler, can.
#pragma once

#include <cstdint>
#include <vector>

#include "core/lanes.h"
#include "core/simulator.h"

namespace hydra::core {

struct LanePlan {
  Placement placement;
  double headroom = 1.0;  // the one chosen
  LaneBound bound;        // of the placement
  SimulationResult run;   // its simulated run
};

// Headrooms tried, from none to the host lane kept 40% idle.
inline constexpr double kHeadrooms[] = {1.0, 0.9, 0.8, 0.7, 0.6};
// How many of each task's first shards are tried off the host (resident where room allows, else on the device).
inline constexpr int kLeadingShards[] = {1, 2, 4, 8};

// From `start` (empty: every shard on the host) within `room` bytes beyond it, as choose_placement.
LanePlan plan_lanes(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                    int num_devices, int64_t room, const Placement& start = {});

}  // namespace hydra::core
