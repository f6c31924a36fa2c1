// The lane model: each place's lane seconds, the four-lane bound against the simulator (never above a simulated
// run), the simulator's steps on exact timelines, and bad input refused (the placement it chooses:
// test_lane_placement.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/lane_plan.h"
#include "core/lanes.h"
#include "core/simulator.h"
#include "lane_shapes.h"

namespace {

using namespace hydra::core;
using namespace hydra::core::lane_test;

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
