#include "core/lane_plan.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "core/lane_ties.h"

namespace hydra::core {

namespace {

// `placement` with each task's first `count` shards (each with the shards tied to it) off the host where room
// allows: resident, else (a tie's owner) resident alone, else stepped on the device; shard 0 of every task first,
// then shard 1, ... The bound does not see what that saves: the first shards' steps are the ones the next step's
// first units wait for, in turn, and the scheduler may give the device those units at once.
Placement leading_shards_off_host(const std::vector<TaskShape>& tasks, Placement placement, int count,
                                  const StepBytes& bytes, int num_devices, int64_t room, const Placement& start,
                                  int step_rooms) {
  for (int s = 0; s < count; ++s)
    for (size_t t = 0; t < tasks.size(); ++t) {
      if (tasks[t].fixed || s >= static_cast<int>(tasks[t].shards.size()) ||
          placement[t][static_cast<size_t>(s)] != StepPlace::kHost)
        continue;
      const std::vector<int> group = tie_group(tasks[t], s);
      std::vector<std::pair<std::vector<int>, StepPlace>> moves;
      if (num_devices == 1) {
        moves.emplace_back(group, StepPlace::kResident);
        // A tied embedding's home may fit where its head's does not (measured, benchmarks/RESULTS.md).
        std::vector<int> owners = owners_alone(tasks[t], group);
        if (std::find(owners.begin(), owners.end(), s) != owners.end())
          moves.emplace_back(std::move(owners), StepPlace::kResident);
      }
      moves.emplace_back(group, StepPlace::kDevice);  // a tie steps on the device as one
      for (const auto& [shards, to] : moves) {
        if (tasks[t].keeps(shards)) continue;
        Placement moved = placement;
        for (int g : shards) moved[t][static_cast<size_t>(g)] = to;
        if (placement_bytes(tasks, moved, bytes, start, step_rooms) <= room) {
          placement = std::move(moved);
          break;
        }
      }
    }
  return placement;
}

// `placement` with each task's first shard (and the shards tied to it) stepped on the host where it was stepped on the
// device. A language model's first shard is its embeddings: the most state a parameter-priced step moves (the
// largest matrix) for the least compute, and the backward that ends each step. Where every task's backward ends at
// about the same time, their states come in one behind another on the host-to-device lane, and the weights queued
// behind them wait: the bound sees only each lane's total.
Placement first_shards_stepped_on_host(const std::vector<TaskShape>& tasks, Placement placement) {
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (tasks[t].fixed || placement[t].empty() || placement[t][0] != StepPlace::kDevice) continue;
    const std::vector<int> group = tie_group(tasks[t], 0);
    if (tasks[t].keeps(group)) continue;
    for (int g : group) placement[t][static_cast<size_t>(g)] = StepPlace::kHost;
  }
  return placement;
}

}  // namespace

SimulationConfig simulation_in_room(const std::vector<TaskShape>& tasks, const Placement& placement,
                                    const LaneRates& rates, const StepBytes& bytes, int num_devices, int64_t room,
                                    const Placement& start) {
  const int64_t held = placement_bytes(tasks, placement, bytes, start, 0);
  return lane_simulation(tasks, placement, rates, bytes, num_devices, std::max<int64_t>(0, room - held));
}

LanePlan plan_lanes(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                    int num_devices, int64_t room, const Placement& start) {
  // The shortest run of the placements whose device steps have room for two at once, and of those whose steps take
  // turns in the room of one.
  std::optional<LanePlan> best, best_in_turns;
  std::vector<Placement> tried;
  for (double headroom : kHeadrooms) {
    std::vector<Placement> variants;
    if (headroom == kHeadrooms[0])
      // The leading shards given the room first: the choice by the bound may spend it on a shard whose step the
      // next step's first units do not wait for (a block's home before a tied embedding's).
      for (int step_rooms : {2, 1})
        for (int count : kLeadingShards) {
          variants.push_back(leading_shards_off_host(tasks, start.empty() ? host_placement(tasks) : start, count,
                                                     bytes, num_devices, room, start, step_rooms));
          variants.push_back(first_shards_stepped_on_host(tasks, variants.back()));
        }
    for (int step_rooms : {2, 1})
      for (bool homes : {true, false}) {
        const Placement chosen =
            choose_placement(tasks, rates, bytes, num_devices, room, headroom, start, homes, step_rooms);
        variants.push_back(chosen);
        variants.push_back(first_shards_stepped_on_host(tasks, chosen));
        for (int count : kLeadingShards) {
          variants.push_back(
              leading_shards_off_host(tasks, chosen, count, bytes, num_devices, room, start, step_rooms));
          variants.push_back(first_shards_stepped_on_host(tasks, variants.back()));
        }
      }
    for (Placement& placement : variants) {
      bool seen = false;
      for (const Placement& p : tried) seen = seen || p == placement;
      if (seen) continue;
      tried.push_back(placement);
      SimulationResult run =
          simulate(simulation_in_room(tasks, placement, rates, bytes, num_devices, room, start));
      const bool at_once = placement_bytes(tasks, placement, bytes, start, 2) <= room;
      std::optional<LanePlan>& kept = at_once ? best : best_in_turns;
      if (!kept || run.makespan < kept->run.makespan) {
        const LaneBound bound = lane_bound(tasks, placement, rates, bytes, num_devices);
        kept = LanePlan{std::move(placement), headroom, bound, std::move(run)};
      }
    }
  }
  if (best_in_turns && (!best || best_in_turns->run.makespan < (1.0 - kTurnsMargin) * best->run.makespan))
    return *best_in_turns;
  return *best;
}

}  // namespace hydra::core
