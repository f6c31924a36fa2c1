// The placement a run gets: the lane model's choice (choose_placement) at several headrooms, with homes and without
// (device steps only), with room for two device steps at once and for one, each also with each task's first shards off
// the host, and those first shards given the room before any choice, all simulated (with the weights the devices keep
// in the room left), the shortest simulated run kept. The bound alone cannot say how much slack a copy or host lane
// needs, since that depends on how the tasks' steps bunch up, nor what a step late off the host costs the unit that
// waits for it; the simulator, driving the real scheduler, can.
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
// A placement whose device steps take turns in the room of one is chosen over the best whose steps have room for two
// only where its simulated run is this much shorter. The simulator models the turns less closely than the engine runs
// them (measured, benchmarks/RESULTS.md: one model on the emulated link forecast 2% shorter with three steps taking
// turns than with one step and 20% longer as run, and 6% shorter with two steps and 12% longer as run), where several
// models' steps in turns paid 1.7x and more.
inline constexpr double kTurnsMargin = 0.10;

// The placement's run within `room` (bytes a device has beyond `start`'s shards, as choose_placement's): what its homes
// and held gradients leave is the arena its device steps' states and kept weight copies share (lane_simulation's
// arena_bytes).
SimulationConfig simulation_in_room(const std::vector<TaskShape>& tasks, const Placement& placement,
                                    const LaneRates& rates, const StepBytes& bytes, int num_devices, int64_t room,
                                    const Placement& start = {});

// From `start` (empty: every shard on the host) within `room` bytes beyond it, as choose_placement (with rooms for two
// device steps, and for one), each candidate run by simulation_in_room; steps in turns only by kTurnsMargin.
LanePlan plan_lanes(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                    int num_devices, int64_t room, const Placement& start = {});

}  // namespace hydra::core
