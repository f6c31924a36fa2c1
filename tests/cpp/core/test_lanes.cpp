// The lane model: each place's lane seconds, the four-lane bound against the simulator (never above a simulated
// run), the simulator's steps on exact timelines, and the placement the model chooses.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/lane_plan.h"
#include "core/lanes.h"
#include "core/simulator.h"

namespace {

using namespace hydra::core;

const LaneRates kRates{100.0, 50.0, 200.0, 1000.0};  // bytes/s: in, out, host, device memory

ShardShape shard(double forward, double backward, int64_t params, int tied_to = -1) {
  return ShardShape{forward, backward, params, params, params, tied_to};
}

TaskShape task(std::vector<ShardShape> shards, int64_t micro_batches, int64_t accumulate = 1) {
  return TaskShape{std::move(shards), micro_batches, accumulate};
}

TEST(Lanes, EachPlaceLoadsItsLanes) {
  const StepBytes bytes;
  const ShardShape s = shard(1.0, 2.0, 100);
  const ShardLanes host = shard_lanes(s, StepPlace::kHost, false, kRates, bytes);
  EXPECT_DOUBLE_EQ(host.weights_in, 100 * 2 / 100.0);
  EXPECT_DOUBLE_EQ(host.gradient_out, 100 * 2 / 50.0);
  EXPECT_DOUBLE_EQ(host.host_step, 100 * 28 / 200.0);
  EXPECT_DOUBLE_EQ(host.host_accumulate, 0.0);
  EXPECT_EQ(host.state_in + host.state_out + host.device_step, 0.0);
  const ShardLanes accumulating = shard_lanes(s, StepPlace::kHost, true, kRates, bytes);
  EXPECT_DOUBLE_EQ(accumulating.host_accumulate, 100 * 8 / 200.0);
  EXPECT_DOUBLE_EQ(accumulating.host_step, 100 * (28 + 16) / 200.0);
  const ShardLanes device = shard_lanes(s, StepPlace::kDevice, false, kRates, bytes);
  EXPECT_DOUBLE_EQ(device.weights_in, host.weights_in);
  EXPECT_EQ(device.gradient_out + device.host_step + device.host_accumulate, 0.0);
  EXPECT_DOUBLE_EQ(device.state_in, 100 * 12 / 100.0);
  EXPECT_DOUBLE_EQ(device.state_out, 100 * 14 / 50.0);
  EXPECT_DOUBLE_EQ(device.device_step, 100 * 28 / 1000.0);
  const ShardLanes resident = shard_lanes(s, StepPlace::kResident, false, kRates, bytes);
  EXPECT_EQ(resident.weights_in + resident.gradient_out + resident.host_step + resident.state_in + resident.state_out,
            0.0);
  EXPECT_DOUBLE_EQ(resident.device_step, device.device_step);
  EXPECT_EQ(held_bytes(s, StepPlace::kResident, bytes, false), 100 * 16);
  // Its gradient buffer, kept for the whole run where a step sums several backwards, as the engine does; else its
  // gradients are in the unit's working set, from its backward to its step.
  EXPECT_EQ(held_bytes(s, StepPlace::kDevice, bytes, true), 100 * 2);
  EXPECT_EQ(held_bytes(s, StepPlace::kDevice, bytes, false), 0);
  // The step's regions (master and moments, the new weights' staging) beside the unit's weights and gradients; where
  // the gradients are held apart, the working set's room for them goes to the step.
  EXPECT_EQ(step_room(s, StepPlace::kDevice, bytes, false), 100 * 14);
  EXPECT_EQ(step_room(s, StepPlace::kDevice, bytes, true), 100 * 12);
  EXPECT_EQ(step_room(s, StepPlace::kHost, bytes, false), 0);
}

// One task of one shard, two micro-batches, each its own step: every lane's time on the timeline, by hand.
// A tie steps in one place: the owner's step sums its borrowers' gradients of the tied weight in its gradient buffer,
// which it then keeps for the run even where each backward is followed by its step; where a step sums backwards each
// kDevice shard keeps a buffer of what it owns (a borrowed weight's gradient is its owner's).
TEST(Lanes, ADeviceSteppedTiesOwnerKeepsItsGradientBufferForTheRun) {
  TaskShape task;
  task.shards = {ShardShape{1.0, 2.0, 100, 100, 100, -1}, ShardShape{1.0, 2.0, 50, 50, 50, -1},
                 ShardShape{1.0, 2.0, 130, 130, 30, 0}};
  const StepBytes bytes;
  const Placement tie{{StepPlace::kDevice, StepPlace::kHost, StepPlace::kDevice}};
  const Placement untied{{StepPlace::kHost, StepPlace::kDevice, StepPlace::kHost}};
  auto rooms = [&](bool sums) {
    return step_room(task.shards[0], StepPlace::kDevice, bytes, sums) +
           step_room(task.shards[2], StepPlace::kDevice, bytes, sums);
  };
  EXPECT_EQ(placement_bytes({task}, tie, bytes), 100 * 2 + rooms(false));
  EXPECT_EQ(placement_bytes({task}, untied, bytes), step_room(task.shards[1], StepPlace::kDevice, bytes, false));
  EXPECT_EQ(placement_bytes({task}, tie, bytes, tie), rooms(false)) << "held by the start already";
  task.clipped = true;
  EXPECT_EQ(placement_bytes({task}, tie, bytes), (100 + 30) * 2 + rooms(true));
  EXPECT_EQ(tie_group(task, 2), (std::vector<int>{0, 2}));
}

TEST(Lanes, SimulatorTimelinesOfEachPlace) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1.0, 2.0, 100)}, 2)};
  const ShardLanes host = shard_lanes(tasks[0].shards[0], StepPlace::kHost, false, kRates, bytes);
  const double w = host.weights_in, g = host.gradient_out, h = host.host_step;
  // kHost: copy, FB, gradient out, host step, copy again (never reused across the step), FB, its step.
  SimulationResult r = simulate(lane_simulation(tasks, {{StepPlace::kHost}}, kRates, bytes, 1));
  EXPECT_DOUBLE_EQ(r.makespan, (w + 3 + g + h) + w + 3 + g + h);
  EXPECT_DOUBLE_EQ(r.transfer_seconds, 2 * w);
  EXPECT_DOUBLE_EQ(r.host_seconds, 2 * h);
  EXPECT_DOUBLE_EQ(r.gradient_transfer_seconds, 2 * g);
  // kDevice: copy, then master and moments in behind it; the device steps once both the FB and they are done (the
  // compute pays the step's own time, not the wait); the next FB reuses the stepped weights in place, once stepped.
  const ShardLanes device = shard_lanes(tasks[0].shards[0], StepPlace::kDevice, false, kRates, bytes);
  r = simulate(lane_simulation(tasks, {{StepPlace::kDevice}}, kRates, bytes, 1));
  const double first = std::max(w + 3, w + device.state_in) + device.device_step;
  const double second_in = std::max(w + device.state_in, w + 3 + device.device_step) + device.state_in;
  const double second = std::max(first + 3, second_in) + device.device_step;
  const double first_out = first + device.state_out;  // the device-to-host lane sends each step's state in turn
  EXPECT_DOUBLE_EQ(r.makespan, std::max(second, first_out) + device.state_out);
  EXPECT_DOUBLE_EQ(r.transfer_seconds, w + 2 * device.state_in);
  EXPECT_DOUBLE_EQ(r.host_seconds, 0.0);
  EXPECT_DOUBLE_EQ(r.device_step_seconds, 2 * device.device_step);
  // kResident: nothing copied; compute and the two device steps.
  r = simulate(lane_simulation(tasks, {{StepPlace::kResident}}, kRates, bytes, 1));
  EXPECT_DOUBLE_EQ(r.makespan, 2 * (3 + device.device_step));
  EXPECT_EQ(r.transfer_seconds + r.gradient_transfer_seconds + r.host_seconds, 0.0);
}

// A kDevice backward's master and moments go on the host-to-device lane after the weights prefetched for the units
// planned next, as the engine's device loop issues them, and the compute goes on meanwhile: the step waits for them on
// the device's step lane. Shard 0 on the host, shard 1 on the device: F0, FB1, B0.
TEST(Lanes, ADeviceStepsStateComesInBehindTheNextWeightsAndTheComputeGoesOn) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1.0, 2.0, 100), shard(1.0, 2.0, 100)}, 1)};
  const ShardLanes device = shard_lanes(tasks[0].shards[1], StepPlace::kDevice, false, kRates, bytes);
  const double w = device.weights_in;
  ASSERT_GT(device.state_in, 3.0) << "the state lands after FB1's compute";
  const SimulationResult host = simulate(lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1));
  const SimulationResult r =
      simulate(lane_simulation(tasks, {{StepPlace::kHost, StepPlace::kDevice}}, kRates, bytes, 1));
  ASSERT_EQ(r.trace.size(), 3u);
  // F0 copies shard 0 in and prefetches FB1's and B0's weights behind it: FB1 starts as its copy lands, at 2w.
  EXPECT_DOUBLE_EQ(r.trace[1].end, 2 * w + 3 + device.device_step) << "FB1 does not wait for its step's state";
  EXPECT_DOUBLE_EQ(host.trace[1].end, 2 * w + 3);
  // B0's weights were on the lane before FB1's state: it starts as FB1 ends and computes as in the host-only run.
  EXPECT_DOUBLE_EQ(r.trace[2].start, r.trace[1].end);
  EXPECT_DOUBLE_EQ(r.trace[2].end - r.trace[2].start, host.trace[2].end - host.trace[2].start);
  EXPECT_DOUBLE_EQ(r.transfer_seconds, 3 * w + device.state_in);
  // The run ends once the step, after its state landed (3w + state_in), has sent the state home.
  EXPECT_GE(r.makespan, 3 * w + device.state_in + device.device_step + device.state_out - 1e-9);
}

TEST(Lanes, AccumulatedMicroBatchesSumOnTheHostAndStepOnce) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1.0, 2.0, 100), shard(1.0, 2.0, 100)}, 4, 2)};
  const SimulationResult r = simulate(lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1));
  const ShardLanes lanes = shard_lanes(tasks[0].shards[0], StepPlace::kHost, true, kRates, bytes);
  EXPECT_DOUBLE_EQ(r.host_seconds, 2 * (2 * lanes.host_accumulate + 2 * lanes.host_step));
  EXPECT_GE(r.makespan, lane_bound(tasks, host_placement(tasks), kRates, bytes, 1).bound() - 1e-9);
}

// Random shapes, placements, devices and rates: the bound is never above the simulated run.
TEST(Lanes, BoundNeverExceedsTheSimulatedMakespan) {
  std::mt19937_64 random(7);
  auto uniform = [&](double low, double high) { return std::uniform_real_distribution<double>(low, high)(random); };
  auto integer = [&](int low, int high) { return std::uniform_int_distribution<int>(low, high)(random); };
  const StepBytes bytes;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<TaskShape> tasks;
    Placement placement;
    for (int t = integer(1, 4); t > 0; --t) {
      TaskShape shape;
      const int shards = integer(1, 5);
      std::vector<StepPlace> places;
      for (int s = 0; s < shards; ++s) {
        shape.shards.push_back(shard(uniform(0.1, 2), uniform(0.2, 4), integer(1, 400)));
        places.push_back(static_cast<StepPlace>(integer(0, 2)));
      }
      if (shards > 1 && integer(0, 1)) {  // the last shard borrows the first's weights, as a tied head does
        shape.shards.back().tied_to = 0;
        places.back() = places.front();
      }
      shape.micro_batches = integer(1, 6);
      shape.accumulate = integer(1, 3);
      tasks.push_back(shape);
      placement.push_back(places);
    }
    const LaneRates rates{uniform(20, 400), uniform(20, 400), uniform(20, 400), uniform(200, 4000)};
    const int devices = integer(1, 3);
    const SimulationResult result = simulate(lane_simulation(tasks, placement, rates, bytes, devices));
    const double bound = lane_bound(tasks, placement, rates, bytes, devices).bound();
    ASSERT_GE(result.makespan, bound * (1 - 1e-9)) << "trial " << trial << " on " << devices << " devices";
  }
}

// Four models whose host steps take longer than their compute: the placement moves steps off the host until the
// compute binds, within the room it is given, and the simulated run follows the bound.
// A shard of 100 elements (shard(0.05, 0.1, 100)) steps on the host in 0.3 s against its 0.15 s of compute a step;
// its kDevice copies take 0.08 s each way.
const LaneRates kHostBinds{20000.0, 20000.0, 100 * 28 / 0.3, 1e5};

// Two tasks of six such shards, the first kept where its start has it (`fixed`).
std::vector<TaskShape> one_fixed_one_free() {
  std::vector<ShardShape> shards(6, shard(0.05, 0.1, 100));
  std::vector<TaskShape> tasks{task(shards, 8), task(shards, 8)};
  tasks[0].fixed = true;
  return tasks;
}

TEST(Lanes, PlacementMovesStepsOffABusyHost) {
  const StepBytes bytes;
  std::vector<TaskShape> tasks;
  for (int t = 0; t < 4; ++t) {
    std::vector<ShardShape> shards;
    for (int s = 0; s < 8; ++s) shards.push_back(shard(0.05, 0.1, 100));
    shards.back().tied_to = 0;
    tasks.push_back(task(shards, 8));
  }
  const LaneRates rates = kHostBinds;
  const Placement host = host_placement(tasks);
  const LaneBound host_bound = lane_bound(tasks, host, rates, bytes, 1);
  EXPECT_EQ(host_bound.bound(), host_bound.host);
  for (int64_t room : {int64_t{0}, int64_t{40000}, int64_t{1} << 40}) {
    const Placement chosen = choose_placement(tasks, rates, bytes, 1, room);
    EXPECT_LE(placement_bytes(tasks, chosen, bytes), room);
    for (const auto& places : chosen) EXPECT_EQ(places.back(), places.front()) << "tied shards in one place";
    const LaneBound bound = lane_bound(tasks, chosen, rates, bytes, 1);
    if (room == 0) {
      EXPECT_EQ(chosen, host);
      continue;
    }
    EXPECT_LT(bound.bound(), host_bound.bound());
    EXPECT_DOUBLE_EQ(bound.bound(), bound.compute) << "room " << room;
    // The bound alone does not see how the tasks' units and host steps interleave: its choice, the host lane as full
    // as the compute, may run well above it (one task resident whole ends early and leaves the others' host steps
    // nothing to overlap; how each task's held back meanwhile is the two tests below).
    const SimulationResult run = simulate(simulation_in_room(tasks, chosen, rates, bytes, 1, room));
    // Chosen by simulation (slack on the copy and host lanes, the first shards off the host), the run keeps to the
    // bound, and is no longer than the one chosen by the bound alone.
    const LanePlan plan = plan_lanes(tasks, rates, bytes, 1, room);
    EXPECT_LE(plan.run.makespan, run.makespan);
    EXPECT_LE(placement_bytes(tasks, plan.placement, bytes, {}, 1), room) << "its steps in one room at least";
    EXPECT_LE(plan.run.makespan, 1.05 * plan.bound.bound()) << "room " << room;
    EXPECT_LT(plan.run.makespan, 0.55 * simulate(simulation_in_room(tasks, host, rates, bytes, 1, room)).makespan)
        << "room " << room;
  }
  // Several devices keep no home: steps move to the devices only.
  for (const auto& places : choose_placement(tasks, rates, bytes, 2, int64_t{1} << 40))
    for (StepPlace place : places) EXPECT_NE(place, StepPlace::kResident);
}

// One task's host steps run one after another on the host lane: at each step boundary the next forward of the shard
// stepped last waits for all of them, and only the units below the last host-stepped shard run meanwhile. That
// chain binds here (above the host lane and the compute), and the simulated run keeps above it.
TEST(Lanes, TheChainCountsOneTasksHostStepsOneAfterAnother) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(4, shard(0.1, 0.2, 100)), 4)};
  const LaneRates rates{1e6, 1e6, 100 * 28 / 0.5, 1e6};  // a shard's host step 0.5 s, its copies 0.2 ms
  const Placement placement{{StepPlace::kHost, StepPlace::kHost, StepPlace::kHost, StepPlace::kResident}};
  const ShardLanes lanes = shard_lanes(tasks[0].shards[0], StepPlace::kHost, false, rates, bytes);
  const double resident_step =
      shard_lanes(tasks[0].shards[3], StepPlace::kResident, false, rates, bytes).device_step;
  const double compute = 4 * 4 * 0.3 + 4 * resident_step;
  // Shard 2's backward ends first; shards 0 and 1 (0.6 s of units) run while the three host steps take 1.5 s.
  const double boundary = lanes.gradient_out + 3 * lanes.host_step + lanes.weights_in - 2 * 0.3;
  const LaneBound bound = lane_bound(tasks, placement, rates, bytes, 1);
  EXPECT_NEAR(bound.chain, compute + 3 * boundary, 1e-9);
  EXPECT_GT(bound.chain, std::max({bound.compute, bound.host, bound.host_to_device, bound.device_to_host}));
  EXPECT_GE(simulate(lane_simulation(tasks, placement, rates, bytes, 1)).makespan, bound.bound() * (1 - 1e-9));
}

// The host lane takes a task's jobs as the engine's host-step threads do: of those whose gradients have landed, the
// lowest shard's first, between the parts of a higher shard's step that began before while a landing buffer is left
// free (or where the job is the last of its task's to land), and a gradient lands only in a free buffer. Shard 3's
// step begins at its backward's end; shard 2's gradient lands 0.2 s later and steps at once, between 3's parts; 1's
// lands at 0.4 s in the task's third buffer and waits for 2's step (no buffer is left free to let it in); 0's
// gradient, done at 0.6 s, waits for a buffer until 2's step ends (0.7 s), then steps at once between 1's parts: it is
// the last to land. The next step's forward of shard 0 waits 0.2 + 2 * 0.5 s, not for three steps taken whole lowest
// first (3 * 0.5 s), nor for four in landing order.
TEST(Lanes, ATasksHostStepsGoLowestShardFirstOnceLanded) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(4, shard(0.1, 0.2, 100)), 2)};
  const LaneRates rates{1e6, 1e6, 100 * 28 / 0.5, 1e6};  // a shard's host step 0.5 s, its copies 0.2 ms
  const SimulationResult r = simulate(lane_simulation(tasks, host_placement(tasks), rates, bytes, 1));
  auto end_of = [&](int64_t index) {
    return std::find_if(r.trace.begin(), r.trace.end(), [&](const TraceEntry& e) { return e.index == index; })->end;
  };
  // Units of a micro-batch: F0 F1 F2 FB3 B2 B1 B0; the second's F0 is unit 7. Its weights come in after shard 0's
  // step (0.2 ms), it computes 0.1 s.
  const double waited = end_of(7) - end_of(3);
  EXPECT_NEAR(waited, 0.2 + 2 * 0.5 + 0.1, 0.005)
      << "whole steps lowest first: 3 * 0.5 + 0.1; in landing order 4 * 0.5 + 0.1";
  EXPECT_GE(r.makespan, lane_bound(tasks, host_placement(tasks), rates, bytes, 1).bound() * (1 - 1e-9));
}

// Two tasks on one device, the host slow: a task whose first shard was just stepped on the host is held back, as
// the engine's device loop holds it, and the other task's units run meanwhile instead of the device waiting.
TEST(Lanes, ATaskWaitingForItsFirstShardsHostStepIsHeldBack) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks(2, task({shard(0.1, 0.2, 100), shard(0.1, 0.2, 100)}, 6));
  const LaneRates rates{1e5, 1e5, 100 * 28 / 0.4, 1e6};  // a shard's host step 0.4 s, its compute 0.3 s
  SimulationConfig config = lane_simulation(tasks, host_placement(tasks), rates, bytes, 1);
  const SimulationResult held = simulate(config);
  config.hold_for_steps = false;
  const SimulationResult waiting = simulate(config);
  EXPECT_LT(held.exposed_transfer_seconds, waiting.exposed_transfer_seconds);
  EXPECT_LE(held.makespan, waiting.makespan);
  EXPECT_GE(held.makespan, lane_bound(tasks, host_placement(tasks), rates, bytes, 1).bound());
}

// The same with each task's first shard resident (stepped on the device): the next forward first waits at shard 1,
// the first stepped on the host, and the task is held back until that step is done.
TEST(Lanes, ATaskWaitingForTheFirstHostStepPastItsResidentShardIsHeldBack) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks(2, task(std::vector<ShardShape>(3, shard(0.1, 0.2, 100)), 6));
  const LaneRates rates{1e5, 1e5, 100 * 28 / 0.4, 1e6};
  Placement placement = host_placement(tasks);
  for (auto& places : placement) places[0] = StepPlace::kResident;
  SimulationConfig config = lane_simulation(tasks, placement, rates, bytes, 1);
  const SimulationResult held = simulate(config);
  config.hold_for_steps = false;
  const SimulationResult waiting = simulate(config);
  EXPECT_LT(held.exposed_transfer_seconds, waiting.exposed_transfer_seconds);
  EXPECT_LT(held.makespan, waiting.makespan);
  EXPECT_GE(held.makespan, lane_bound(tasks, placement, rates, bytes, 1).bound());
}

// A tied weight's gradient is summed into its owner's on the host: the borrower's host step counts it.
TEST(Lanes, ABorrowedGradientIsSummedOnTheHost) {
  const StepBytes bytes;
  const ShardShape head{0.1, 0.2, 1100, 1100, 100, 0};  // reads and sends out 1000 elements of shard 0's
  const ShardLanes lanes = shard_lanes(head, StepPlace::kHost, false, kRates, bytes);
  EXPECT_DOUBLE_EQ(lanes.host_step, (100 * 28 + 1000 * (2 + 8)) / kRates.host);
  EXPECT_DOUBLE_EQ(lanes.gradient_out, 1100 * 2 / kRates.device_to_host);
}

// From a start whose first shards are resident (the engine's resident ends): they stay so, the room counts what
// moves beyond them take, and with no room the start is the placement.
TEST(Lanes, PlacementStartsFromTheShardsAlreadyResident) {
  const StepBytes bytes;
  std::vector<ShardShape> shards(6, shard(0.05, 0.1, 100));
  const std::vector<TaskShape> tasks{task(shards, 8)};
  const LaneRates rates = kHostBinds;
  Placement start = host_placement(tasks);
  start[0][0] = StepPlace::kResident;
  EXPECT_EQ(choose_placement(tasks, rates, bytes, 1, 0, 1.0, start), start);
  for (int64_t room : {int64_t{1400}, int64_t{3000}, int64_t{1} << 40}) {
    const Placement chosen = choose_placement(tasks, rates, bytes, 1, room, 1.0, start);
    EXPECT_EQ(chosen[0][0], StepPlace::kResident);
    EXPECT_NE(chosen, start) << "room " << room;
    EXPECT_LE(placement_bytes(tasks, chosen, bytes, start), room);
    EXPECT_EQ(placement_bytes(tasks, chosen, bytes, start),
              placement_bytes(tasks, chosen, bytes) - held_bytes(shards[0], StepPlace::kResident, bytes, false));
    const LanePlan plan = plan_lanes(tasks, rates, bytes, 1, room, start);
    EXPECT_EQ(plan.placement[0][0], StepPlace::kResident);
    EXPECT_LE(placement_bytes(tasks, plan.placement, bytes, start, 1), room);
  }
  EXPECT_THROW(choose_placement(tasks, rates, bytes, 2, 0, 1.0, start), std::invalid_argument) << "one device";
  EXPECT_THROW(choose_placement(tasks, rates, bytes, 1, 0, 1.0, {{StepPlace::kHost}}), std::invalid_argument);
}

// A task already training keeps its placement (`fixed`): the one that joins takes its shards off the host around it,
// within the room, and the fixed task's load still counts on the lanes.
TEST(Lanes, AFixedTaskKeepsItsPlacementAndTheOthersMoveAroundIt) {
  const StepBytes bytes;
  std::vector<TaskShape> tasks = one_fixed_one_free();
  const LaneRates rates = kHostBinds;
  Placement start = host_placement(tasks);
  start[0][1] = StepPlace::kDevice;
  for (int64_t room : {int64_t{3000}, int64_t{1} << 40}) {
    const Placement chosen = choose_placement(tasks, rates, bytes, 1, room, 1.0, start);
    EXPECT_EQ(chosen[0], start[0]) << "room " << room;
    EXPECT_NE(chosen[1], start[1]) << "room " << room;
    EXPECT_LE(placement_bytes(tasks, chosen, bytes, start), room);
    const LanePlan plan = plan_lanes(tasks, rates, bytes, 1, room, start);
    EXPECT_EQ(plan.placement[0], start[0]) << "room " << room;
    EXPECT_NE(plan.placement[1], start[1]) << "room " << room;
  }
  // Free to move, the first task's shards come off the host too.
  tasks[0].fixed = false;
  EXPECT_NE(choose_placement(tasks, rates, bytes, 1, int64_t{1} << 40, 1.0, start)[0], start[0]);
}

// On several devices a model resident on one of them is kept where it is (`fixed`); the spilled one takes its steps
// off the host onto the devices, never into a home (it runs on any device).
TEST(Lanes, OnSeveralDevicesOnlyAFixedTaskStartsResident) {
  const StepBytes bytes;
  std::vector<TaskShape> tasks = one_fixed_one_free();
  const LaneRates rates = kHostBinds;
  Placement start = host_placement(tasks);
  start[0].assign(tasks[0].shards.size(), StepPlace::kResident);
  const Placement chosen = choose_placement(tasks, rates, bytes, 2, int64_t{1} << 40, 1.0, start);
  const LanePlan plan = plan_lanes(tasks, rates, bytes, 2, int64_t{1} << 40, start);
  for (const Placement& placement : {chosen, plan.placement}) {
    EXPECT_EQ(placement[0], start[0]);
    EXPECT_NE(placement[1], start[1]) << "steps come off the host";
    for (StepPlace place : placement[1]) EXPECT_NE(place, StepPlace::kResident);
  }
  tasks[0].fixed = false;
  EXPECT_THROW(choose_placement(tasks, rates, bytes, 2, 0, 1.0, start), std::invalid_argument)
      << "a home on one of two devices";
}

// Room for two homes or for four device steps' gradient buffers (held for the run: the steps are clipped): each home
// pays more than a device step, so the greedy choice with homes fills the room with two of them, but four device
// steps pay more; plan_lanes tries both.
TEST(Lanes, PlanWeighsHomesAgainstTheDeviceStepsTheirRoomWouldHold) {
  const StepBytes bytes;
  std::vector<TaskShape> tasks{task(std::vector<ShardShape>(6, shard(0.05, 0.1, 100)), 8)};
  tasks[0].clipped = true;
  const LaneRates rates{20000.0, 20000.0, 100 * 28 / 1.0, 1e5};  // a host step: 1 s, against 0.15 s of compute
  Placement start = host_placement(tasks);
  start[0][0] = start[0][5] = StepPlace::kResident;
  const int64_t room = 2 * held_bytes(tasks[0].shards[1], StepPlace::kResident, bytes, false) +
                       step_room(tasks[0].shards[1], StepPlace::kDevice, bytes, tasks[0].sums_backwards());
  const Placement with_homes = choose_placement(tasks, rates, bytes, 1, room, 1.0, start);
  EXPECT_EQ(std::count(with_homes[0].begin(), with_homes[0].end(), StepPlace::kResident), 4);
  const Placement steps = choose_placement(tasks, rates, bytes, 1, room, 1.0, start, false);
  EXPECT_EQ(steps[0], (std::vector<StepPlace>{StepPlace::kResident, StepPlace::kDevice, StepPlace::kDevice,
                                              StepPlace::kDevice, StepPlace::kDevice, StepPlace::kResident}));
  const double homes_run = simulate(lane_simulation(tasks, with_homes, rates, bytes, 1)).makespan;
  const double steps_run = simulate(lane_simulation(tasks, steps, rates, bytes, 1)).makespan;
  ASSERT_LT(steps_run, homes_run);
  EXPECT_LE(plan_lanes(tasks, rates, bytes, 1, room, start).run.makespan, steps_run);
}

// Twelve GPT-2-large-shaped models of 12 layers (benchmarks/bench_lanes.cpp's shape, shorter) under a 16 GiB budget
// with the host at 50 GB/s. The greedy choice can step every task's embeddings (shard 0, tied to the head) on the
// device: the most state a step moves for the least compute, and the backward that ends each task's step, so the
// tasks' embedding states come in one behind another as their steps end together and the weights queued behind them
// wait. Stepped on the host instead the run is shorter, and plan_lanes finds it.
TEST(Lanes, PlanStepsTheEmbeddingsOnTheHostWhereTheirStatesWouldQueue) {
  const StepBytes bytes;
  const int64_t d = 1280, vocab = 50257, context = 1024, batch = 8;
  const int64_t layer = 12 * d * d + 13 * d, wte = vocab * d, embeddings = wte + context * d;
  const double layer_flops = 2.0 * layer + 2.0 * context * d, head_flops = 2.0 * wte;
  const double per_flop = 0.210 / 3 / (36 * layer_flops + head_flops), forward = layer_flops * per_flop;
  const double head = head_flops * per_flop;
  TaskShape shape;
  shape.shards.push_back(ShardShape{0.01 * forward, 0.02 * forward, embeddings, embeddings, embeddings, -1});
  for (int l = 0; l < 12; ++l) shape.shards.push_back(ShardShape{forward, 3 * forward, layer, layer, layer, -1});
  shape.shards.push_back(ShardShape{head, 2 * head, wte + 2 * d, wte + 2 * d, 2 * d, 0});
  shape.micro_batches = 4;
  const std::vector<TaskShape> tasks(12, shape);
  const double gib = 1024.0 * 1024 * 1024;
  const auto room = static_cast<int64_t>(14 * gib - 12 * 13.0 * batch * context * d * 2);
  const LaneRates rates{55e9, 55e9, 50e9, 3e12};
  // Device steps only (no homes), the host lane kept 40% idle: the greedy choice takes every task's embeddings first.
  const Placement chosen = choose_placement(tasks, rates, bytes, 1, room, 0.6, {}, /*homes=*/false);
  Placement embeddings_on_host = chosen;
  int moved = 0;
  for (std::vector<StepPlace>& places : embeddings_on_host) {
    if (places.front() != StepPlace::kDevice) continue;
    places.front() = places.back() = StepPlace::kHost;
    ++moved;
  }
  ASSERT_EQ(moved, 12);
  const double device_run = simulate(lane_simulation(tasks, chosen, rates, bytes, 1)).makespan;
  const double host_run = simulate(lane_simulation(tasks, embeddings_on_host, rates, bytes, 1)).makespan;
  EXPECT_LT(host_run, device_run);
  const LanePlan plan = plan_lanes(tasks, rates, bytes, 1, room);
  EXPECT_LE(plan.run.makespan, host_run);
  for (const std::vector<StepPlace>& places : plan.placement) EXPECT_NE(places.front(), StepPlace::kDevice);
}

// A device-stepped shard's gradients are held for the run only where its task's steps sum several backwards.
TEST(Lanes, DeviceStepsHoldGradientsOnlyWhereStepsSumBackwards) {
  const StepBytes bytes;
  const ShardShape s = shard(0.05, 0.1, 100);
  const Placement device{{StepPlace::kDevice, StepPlace::kDevice}};
  EXPECT_EQ(placement_bytes({task({s, s}, 4)}, device, bytes), 2 * 100 * 14);
  EXPECT_EQ(placement_bytes({task({s, s}, 4, 2)}, device, bytes), 2 * 100 * 12 + 2 * 100 * 2);
  TaskShape clipped = task({s, s}, 4);
  clipped.clipped = true;
  EXPECT_TRUE(clipped.sums_backwards());
  EXPECT_EQ(placement_bytes({clipped}, device, bytes), 2 * 100 * 12 + 2 * 100 * 2);
}

// Device steps take the room of the two largest at once (one step's state goes home as the next one's comes in), and
// one device-stepped shard the room of its own step only (its steps never overlap); the choice keeps within it.
TEST(Lanes, DeviceStepsTakeTheRoomOfTheTwoLargestAtOnce) {
  const StepBytes bytes;
  const std::vector<ShardShape> shards{shard(0.05, 0.1, 300), shard(0.05, 0.1, 100), shard(0.05, 0.1, 200)};
  const std::vector<TaskShape> tasks{task(shards, 4)};
  const Placement one{{StepPlace::kHost, StepPlace::kDevice, StepPlace::kHost}};
  EXPECT_EQ(placement_bytes(tasks, one, bytes), 100 * 14);
  const Placement all(1, std::vector<StepPlace>(3, StepPlace::kDevice));
  EXPECT_EQ(placement_bytes(tasks, all, bytes), (300 + 200) * 14);
  // Room for the largest step alone: one shard steps on the device, not two.
  const Placement chosen = choose_placement(tasks, kHostBinds, bytes, 1, 300 * 14, 1.0, {}, false);
  EXPECT_EQ(std::count(chosen[0].begin(), chosen[0].end(), StepPlace::kDevice), 1);
  EXPECT_LE(placement_bytes(tasks, chosen, bytes), 300 * 14);
  // Room for the two largest: every shard.
  EXPECT_EQ(choose_placement(tasks, kHostBinds, bytes, 1, 500 * 14, 1.0, {}, false), all);
}

TEST(Lanes, PlacementLeavesAnIdleHostAlone) {
  const StepBytes bytes;
  // Two tasks: each one's step round trip hides behind the other's compute.
  const TaskShape shape = task({shard(1, 2, 100), shard(1, 2, 100), shard(1, 2, 100)}, 4);
  const std::vector<TaskShape> tasks{shape, shape};
  const LaneRates rates{1e6, 1e6, 1e6, 1e7};  // every copy and step a small fraction of the compute
  // The compute binds already: a device step would only lengthen it.
  EXPECT_EQ(choose_placement(tasks, rates, bytes, 1, int64_t{1} << 40), host_placement(tasks));
}

TEST(Lanes, BadInputIsRefused) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1, 2, 100), shard(1, 2, 100, 0)}, 2)};
  EXPECT_THROW(lane_bound(tasks, {{StepPlace::kHost, StepPlace::kResident}}, kRates, bytes, 1), std::invalid_argument)
      << "a resident borrower of a spilled owner";
  EXPECT_NO_THROW(lane_bound(tasks, {{StepPlace::kResident, StepPlace::kHost}}, kRates, bytes, 1))
      << "a resident owner of a spilled borrower";
  EXPECT_NO_THROW(lane_bound(tasks, {{StepPlace::kHost, StepPlace::kDevice}}, kRates, bytes, 1)) << "a tie split";
  EXPECT_THROW(lane_bound(tasks, {{StepPlace::kHost}}, kRates, bytes, 1), std::invalid_argument);
  EXPECT_THROW(lane_bound(tasks, host_placement(tasks), kRates, bytes, 0), std::invalid_argument);
  EXPECT_THROW(lane_bound(tasks, host_placement(tasks), LaneRates{0, 1, 1, 1}, bytes, 1), std::invalid_argument);
  EXPECT_THROW(choose_placement(tasks, kRates, bytes, 1, -1), std::invalid_argument);
  EXPECT_THROW(choose_placement(tasks, kRates, bytes, 1, 0, 0.0), std::invalid_argument);
  EXPECT_THROW(choose_placement(tasks, kRates, bytes, 1, 0, 1.5), std::invalid_argument);
  EXPECT_THROW(choose_placement({task({}, 1)}, kRates, bytes, 1, 0), std::invalid_argument);
  EXPECT_THROW(choose_placement({task({shard(1, 2, 100, 0)}, 1)}, kRates, bytes, 1, 0), std::invalid_argument);
  EXPECT_THROW(choose_placement({task({shard(-1, 2, 100)}, 1)}, kRates, bytes, 1, 0), std::invalid_argument);
  SimulationConfig config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1);
  config.transfer = [](int, int, Phase) { return 1.0; };
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1);
  config.prefetch = Prefetch::kPreviousUnit;
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1);
  config.steps[0].places.pop_back();
  EXPECT_THROW(simulate(config), std::invalid_argument);
}

}  // namespace
