#include "core/lanes.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "core/lane_checks.h"
#include "core/lane_ties.h"

namespace hydra::core {

namespace {

using lane_checks::require;
using lane_checks::validate;
using lane_checks::validate_placement;

int64_t steps_of(const TaskShape& task) { return (task.micro_batches + task.accumulate - 1) / task.accumulate; }

// One task's share of each lane and its own chain. `one_device`: one device runs all its units (the back-to-back
// reuse of shard 0's weights is then the only reuse), else any device may (a host-stepped shard's weights then come
// in at least once a step, a kDevice shard's at least once).
struct TaskLanes {
  double compute = 0.0, host_to_device = 0.0, device_to_host = 0.0, host = 0.0, chain = 0.0;
};

TaskLanes task_lanes(const TaskShape& task, const std::vector<StepPlace>& places, const LaneRates& rates,
                     const StepBytes& bytes, bool one_device) {
  TaskLanes out;
  const int n = static_cast<int>(task.shards.size());
  const int64_t mb = task.micro_batches;
  const int64_t steps = steps_of(task);
  const bool accumulates = task.accumulate > 1;
  double own_compute = 0.0, gap = 0.0, boundary = 0.0;
  // The task's host steps of one boundary, the units before the last host-stepped shard (the first whose backward
  // ends), and the fewest seconds a host-stepped shard's gradient takes to go out and its weights to come in.
  constexpr double kNone = std::numeric_limits<double>::infinity();
  double host_steps = 0.0, first_gap = 0.0, fewest_out = kNone, fewest_in = kNone;
  for (int s = 0; s < n; ++s) {
    const ShardShape& shard = task.shards[static_cast<size_t>(s)];
    const StepPlace place = places[static_cast<size_t>(s)];
    const ShardLanes lanes =
        shard_lanes(as_placed(task, places, s), place, accumulates, rates, bytes, tie_apart(task, places, s));
    const double per_micro_batch = shard.forward_seconds + shard.backward_seconds;
    own_compute += static_cast<double>(mb) * per_micro_batch + static_cast<double>(steps) * lanes.device_step;
    if (place != StepPlace::kResident) {
      const int64_t visits = (s == n - 1 ? 1 : 2) * mb;
      int64_t copies = place == StepPlace::kHost ? steps : 1;
      if (one_device) {
        // B(0) then the next micro-batch's F(0) may share a copy, but across a host step.
        const int64_t reusable = s == 0 ? (mb - 1) - (place == StepPlace::kHost ? steps - 1 : 0) : 0;
        copies = visits - reusable;
      }
      out.host_to_device += static_cast<double>(copies) * lanes.weights_in;
    }
    out.host_to_device += static_cast<double>(steps) * lanes.state_in;
    out.device_to_host += static_cast<double>(mb) * lanes.gradient_out + static_cast<double>(steps) * lanes.state_out;
    out.host += static_cast<double>(mb - steps) * lanes.host_accumulate + static_cast<double>(steps) * lanes.host_step;
    // Between B(s) of one step and F(s) of the next run B(s-1)..B(0) and F(0)..F(s-1) with their device steps;
    // a host-stepped shard's gradient out, host step and weights in must fit there or the chain waits.
    if (place == StepPlace::kHost) {
      boundary = std::max(boundary, lanes.gradient_out + lanes.host_step + lanes.weights_in - gap);
      host_steps += lanes.host_step;
      first_gap = gap;
      fewest_out = std::min(fewest_out, lanes.gradient_out);
      fewest_in = std::min(fewest_in, lanes.weights_in);
    }
    gap += per_micro_batch + lanes.device_step;
  }
  // And one after another on the host lane: none starts before the last host-stepped shard's backward ends and a
  // gradient is out, the next step's forward of the shard stepped last waits for it and its weights in, and only
  // the units below the last host-stepped shard can run meanwhile.
  if (host_steps > 0.0) boundary = std::max(boundary, fewest_out + host_steps + fewest_in - first_gap);
  out.compute = own_compute;
  out.chain = own_compute + static_cast<double>(steps - 1) * boundary;
  return out;
}

// Largest first, compared in turn: the bound, then the lane next to it, ... (ties within a relative 1e-9).
using Ranking = std::array<double, 5>;

// `headroom` < 1 ranks the copy and host lanes as if that much busier.
Ranking ranking(const LaneBound& b, double headroom) {
  Ranking r{b.compute, b.host_to_device / headroom, b.device_to_host / headroom, b.host / headroom, b.chain};
  std::sort(r.begin(), r.end(), std::greater<>());
  return r;
}

bool better(const Ranking& a, const Ranking& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    const double tolerance = 1e-9 * std::max(std::abs(a[i]), std::abs(b[i]));
    if (a[i] < b[i] - tolerance) return true;
    if (a[i] > b[i] + tolerance) return false;
  }
  return false;
}

LaneBound combine(const std::vector<TaskLanes>& per_task, int num_devices) {
  LaneBound b;
  for (const TaskLanes& t : per_task) {
    b.compute += t.compute;
    b.host_to_device += t.host_to_device;
    b.device_to_host += t.device_to_host;
    b.host += t.host;
    b.chain = std::max(b.chain, t.chain);
  }
  b.compute /= num_devices;
  b.host_to_device /= num_devices;
  b.device_to_host /= num_devices;
  return b;
}

}  // namespace

const char* step_place_name(StepPlace place) {
  switch (place) {
    case StepPlace::kHost: return "host";
    case StepPlace::kDevice: return "device";
    case StepPlace::kResident: return "resident";
  }
  return "?";
}

ShardLanes shard_lanes(const ShardShape& shard, StepPlace place, bool accumulates, const LaneRates& rates,
                       const StepBytes& bytes, bool tie_apart) {
  ShardLanes lanes;
  const auto p = static_cast<double>(shard.params);
  // A borrowed (tied) weight's gradient: where the owner steps on the host, summed into its owner's there, read as
  // landed and the sum read and written.
  const auto borrowed_grads = static_cast<double>(std::max<int64_t>(0, shard.grads - shard.params));
  const double summed_on_host = (place == StepPlace::kHost) != tie_apart ? borrowed_grads : 0.0;
  if (place != StepPlace::kResident)
    lanes.weights_in = static_cast<double>(shard.weights) * bytes.weight / rates.host_to_device;
  switch (place) {
    case StepPlace::kHost:
      lanes.gradient_out = (p + summed_on_host) * bytes.weight / rates.device_to_host;
      lanes.host_accumulate = accumulates ? (p + summed_on_host) * bytes.host_accumulate / rates.host : 0.0;
      // With accumulation the step reads the host's sum and zeroes it besides.
      lanes.host_step = (p * (bytes.host_step + (accumulates ? 2 * bytes.host_accumulate : 0.0)) +
                         summed_on_host * (bytes.weight + bytes.host_accumulate)) /
                        rates.host;
      break;
    case StepPlace::kDevice:
      lanes.state_in = p * bytes.state_in() / rates.host_to_device;
      lanes.device_step = p * bytes.device_step / rates.device_memory;
      lanes.state_out = p * bytes.state_out() / rates.device_to_host;
      // Its share of a tied weight a kHost owner steps goes out after every backward and is summed there.
      lanes.gradient_out = summed_on_host * bytes.weight / rates.device_to_host;
      lanes.host_accumulate = accumulates ? summed_on_host * bytes.host_accumulate / rates.host : 0.0;
      lanes.host_step = summed_on_host * (bytes.weight + bytes.host_accumulate) / rates.host;
      break;
    case StepPlace::kResident:
      lanes.device_step = p * bytes.device_step / rates.device_memory;
      break;
  }
  return lanes;
}

int64_t held_bytes(const ShardShape& shard, StepPlace place, const StepBytes& bytes, bool sums_backwards) {
  switch (place) {
    case StepPlace::kHost: return 0;
    // What it owns: a borrowed tied weight's gradient sums in its owner's buffer (tie_buffer_bytes).
    case StepPlace::kDevice: return sums_backwards ? static_cast<int64_t>(std::ceil(shard.params * bytes.weight)) : 0;
    case StepPlace::kResident:
      return static_cast<int64_t>(std::ceil((shard.weights + shard.grads) * bytes.weight + shard.params * bytes.state));
  }
  return 0;
}

int64_t step_room(const ShardShape& shard, StepPlace place, const StepBytes& bytes, bool sums_backwards,
                  bool tie_apart) {
  if (place != StepPlace::kDevice) return 0;
  // The engine's step regions: what the step sends home, fp32 master and moments, and the new weights' staging in
  // bf16. Beside the working set every room counts (a shard's weights and gradients): a unit whose gradients are
  // held apart leaves that much of it to the step, unless its region holds a tied weight's gradient going out.
  const double regions = static_cast<double>(shard.params) * bytes.state_out();
  const double apart = sums_backwards && !tie_apart ? static_cast<double>(shard.weights) * bytes.weight : 0.0;
  return static_cast<int64_t>(std::ceil(std::max(0.0, regions - apart)));
}

double LaneBound::bound() const { return std::max({compute, host_to_device, device_to_host, host, chain}); }

LaneBound lane_bound(const std::vector<TaskShape>& tasks, const Placement& placement, const LaneRates& rates,
                     const StepBytes& bytes, int num_devices) {
  validate(tasks, rates, bytes, num_devices);
  validate_placement(tasks, placement);
  std::vector<TaskLanes> per_task;
  for (size_t t = 0; t < tasks.size(); ++t)
    per_task.push_back(task_lanes(tasks[t], placement[t], rates, bytes, num_devices == 1));
  return combine(per_task, num_devices);
}

Placement host_placement(const std::vector<TaskShape>& tasks) {
  Placement placement;
  for (const TaskShape& task : tasks) placement.emplace_back(task.shards.size(), StepPlace::kHost);
  return placement;
}

namespace {

// The room device steps take at once: the two largest steps' regions, as one step's state goes home while the next
// one's comes in (a shard's own steps never overlap). One step's room alone is not enough in practice: each step
// then waits for the one before it to be home, or its state's prefetch evicts the weights the next units need.
struct StepRooms {
  int64_t largest = 0, second = 0;
  void add(int64_t room) {
    if (room > largest) {
      second = largest;
      largest = room;
    } else {
      second = std::max(second, room);
    }
  }
  // One room: the steps take turns; two: one step's state goes home as the next one's comes in.
  int64_t total(int step_rooms) const { return step_rooms == 0 ? 0 : step_rooms == 1 ? largest : largest + second; }
};

StepRooms device_steps_rooms(const std::vector<TaskShape>& tasks, const Placement& placement, const StepBytes& bytes) {
  StepRooms rooms;
  for (size_t t = 0; t < tasks.size(); ++t)
    for (size_t s = 0; s < tasks[t].shards.size(); ++s)
      rooms.add(step_room(as_placed(tasks[t], placement[t], static_cast<int>(s)), placement[t][s], bytes,
                          tasks[t].sums_backwards(), tie_apart(tasks[t], placement[t], static_cast<int>(s))));
  return rooms;
}

}  // namespace

int64_t placement_bytes(const std::vector<TaskShape>& tasks, const Placement& placement, const StepBytes& bytes,
                        const Placement& start, int step_rooms) {
  require(step_rooms >= 0 && step_rooms <= 2, "step_rooms must be 0, 1 or 2");
  validate_placement(tasks, placement);
  if (!start.empty()) validate_placement(tasks, start);
  int64_t held = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const bool sums = tasks[t].sums_backwards();
    for (size_t s = 0; s < tasks[t].shards.size(); ++s) {
      const ShardShape& shard = tasks[t].shards[s];
      held += held_bytes(shard, placement[t][s], bytes, sums) -
              (start.empty() ? 0 : held_bytes(shard, start[t][s], bytes, sums));
    }
    held += tie_buffer_bytes(tasks[t], placement[t], bytes) -
            (start.empty() ? 0 : tie_buffer_bytes(tasks[t], start[t], bytes));
  }
  return held + device_steps_rooms(tasks, placement, bytes).total(step_rooms);
}

Placement choose_placement(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                           int num_devices, int64_t room, double headroom, const Placement& start, bool homes,
                           int step_rooms) {
  require(step_rooms == 1 || step_rooms == 2, "step_rooms must be 1 or 2");
  validate(tasks, rates, bytes, num_devices);
  require(room >= 0, "room must be >= 0");
  require(headroom > 0.0 && headroom <= 1.0, "headroom must be in (0, 1]");
  const bool one_device = num_devices == 1;
  if (!start.empty()) {
    validate_placement(tasks, start);
    // On several devices any device may run a unit of a task that moves, which a home would give up; a task kept
    // where it is (a model resident on one of them) loads its device's compute and nothing else.
    for (size_t t = 0; t < start.size(); ++t)
      for (StepPlace place : start[t])
        require(one_device || tasks[t].fixed || place != StepPlace::kResident,
                "a start with resident shards needs one device, or the task fixed where it is");
  }
  Placement placement = start.empty() ? host_placement(tasks) : start;
  std::vector<TaskLanes> per_task;
  for (size_t t = 0; t < tasks.size(); ++t)
    per_task.push_back(task_lanes(tasks[t], placement[t], rates, bytes, one_device));
  // Homes leave room for the largest device step, so that homes never crowd out every kDevice move.
  int64_t reserve = 0;
  for (const TaskShape& task : tasks)
    for (const ShardShape& shard : task.shards)
      reserve = std::max(reserve, step_room(shard, StepPlace::kDevice, bytes, task.sums_backwards()));
  // Each tie group once, by its first shard: what one move changes (and, for a tie, its owners alone).
  std::vector<std::vector<std::vector<std::vector<int>>>> move_choices(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t)
    for (int s = 0; s < static_cast<int>(tasks[t].shards.size()); ++s) {
      std::vector<int> group = tie_group(tasks[t], s);
      if (group.front() != s) continue;
      std::vector<std::vector<int>> choices{group};
      if (std::vector<int> owners = owners_alone(tasks[t], group); !owners.empty()) choices.push_back(owners);
      move_choices[t].push_back(std::move(choices));
    }
  int64_t held = 0;  // beyond the start's
  // Its device steps' rooms; a shard moved on to kResident keeps its step's room counted (moves only add rooms).
  StepRooms steps = device_steps_rooms(tasks, placement, bytes);
  Ranking current = ranking(combine(per_task, num_devices), headroom);
  for (;;) {
    struct Move {
      size_t task;
      std::vector<int> group;
      StepPlace place;
      int64_t held;
      StepRooms steps;
      TaskLanes lanes;  // the task's with the move made
    };
    std::optional<Move> best;
    Ranking best_rank = current;
    // Moves the shards of `choice` not yet at `to` there, where that fits the room, and keeps it if it is the best.
    auto consider = [&](size_t t, const std::vector<int>& choice, StepPlace to) {
      const TaskShape& task = tasks[t];
      std::vector<int> group;
      for (int g : choice)
        if (placement[t][static_cast<size_t>(g)] < to) group.push_back(g);
      if (group.empty() || task.keeps(group)) return;
      std::vector<StepPlace> places = placement[t];
      for (int g : group) places[static_cast<size_t>(g)] = to;
      int64_t group_held = held + tie_buffer_bytes(task, places, bytes) - tie_buffer_bytes(task, placement[t], bytes);
      StepRooms group_steps = steps;
      for (int g : group) {
        const ShardShape& shard = task.shards[static_cast<size_t>(g)];
        const StepPlace now = placement[t][static_cast<size_t>(g)];
        const bool sums = task.sums_backwards();
        group_held += held_bytes(shard, to, bytes, sums) - held_bytes(shard, now, bytes, sums);
        group_steps.add(step_room(as_placed(task, places, g), to, bytes, sums));
      }
      const int64_t asked = group_held + (reserve <= room ? std::max(group_steps.total(step_rooms), reserve)
                                                          : group_steps.total(step_rooms));
      if (asked > room) return;
      TaskLanes lanes = task_lanes(task, places, rates, bytes, one_device);
      std::swap(per_task[t], lanes);
      const Ranking rank = ranking(combine(per_task, num_devices), headroom);
      std::swap(per_task[t], lanes);  // `lanes` is the task's with the move made again
      if (better(rank, best_rank)) {
        best_rank = rank;
        best = Move{t, group, to, group_held, group_steps, lanes};
      }
    };
    for (size_t t = 0; t < tasks.size(); ++t) {
      if (tasks[t].fixed) continue;
      for (const std::vector<std::vector<int>>& choices : move_choices[t]) {
        consider(t, choices.front(), StepPlace::kDevice);  // a tie moves as one
        if (!one_device || !homes) continue;
        // To kResident its owners may also move alone, borrowers with weights of their own staying where they are.
        for (const std::vector<int>& choice : choices) consider(t, choice, StepPlace::kResident);
      }
    }
    if (!best) return placement;
    for (int g : best->group) placement[best->task][static_cast<size_t>(g)] = best->place;
    per_task[best->task] = best->lanes;
    held = best->held;
    steps = best->steps;
    current = best_rank;
  }
}

}  // namespace hydra::core
