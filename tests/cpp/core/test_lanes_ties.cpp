// A tie split between kHost and kDevice in the lane model: the tied weight's gradient sums where its owner steps, so
// a kHost borrower of a kDevice owner sends out only what it owns, and a kDevice borrower of a kHost owner sends its
// share of the tie out after every backward, to be summed on the host.
#include <gtest/gtest.h>

#include <vector>

#include "core/lanes.h"
#include "core/simulator.h"

namespace {

using namespace hydra::core;

const LaneRates kRates{100.0, 50.0, 200.0, 1000.0};  // bytes/s: in, out, host, device memory

// Shard 0 owns 100 elements, 40 of which shard 2 borrows; shard 2 owns 30 (its gradients: 70).
std::vector<TaskShape> tied_task(int64_t micro_batches, int64_t accumulate) {
  TaskShape task{{ShardShape{1.0, 2.0, 100, 100, 100, -1}, ShardShape{1.0, 2.0, 50, 50, 50, -1},
                  ShardShape{1.0, 2.0, 70, 70, 30, 0}},
                 micro_batches, accumulate};
  return {task};
}

TEST(SplitTies, AHostSteppedBorrowerOfADeviceSteppedOwnerSendsOutOnlyWhatItOwns) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks = tied_task(4, 2);
  const Placement split{{StepPlace::kDevice, StepPlace::kHost, StepPlace::kHost}};
  ASSERT_TRUE(tie_apart(tasks[0], split[0], 2));
  const ShardShape& head = tasks[0].shards[2];
  const ShardLanes together = shard_lanes(head, StepPlace::kHost, true, kRates, bytes);
  const ShardLanes apart = shard_lanes(head, StepPlace::kHost, true, kRates, bytes, /*tie_apart=*/true);
  EXPECT_DOUBLE_EQ(together.gradient_out, 70 * bytes.weight / kRates.device_to_host);
  EXPECT_DOUBLE_EQ(apart.gradient_out, 30 * bytes.weight / kRates.device_to_host);
  EXPECT_DOUBLE_EQ(apart.host_accumulate, 30 * bytes.host_accumulate / kRates.host);
  EXPECT_DOUBLE_EQ(apart.host_step, 30 * (bytes.host_step + 2 * bytes.host_accumulate) / kRates.host);
  EXPECT_DOUBLE_EQ(together.host_step - apart.host_step, 40 * (bytes.weight + bytes.host_accumulate) / kRates.host)
      << "the borrowed share is no longer summed on the host";
  EXPECT_NO_THROW(lane_bound(tasks, split, kRates, bytes, 1));
}

TEST(SplitTies, ADeviceSteppedBorrowerOfAHostSteppedOwnerSendsItsShareOutToBeSummedThere) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks = tied_task(4, 1);
  const Placement split{{StepPlace::kHost, StepPlace::kHost, StepPlace::kDevice}};
  ASSERT_TRUE(tie_apart(tasks[0], split[0], 2));
  const ShardShape& head = tasks[0].shards[2];
  const ShardLanes whole = shard_lanes(head, StepPlace::kDevice, false, kRates, bytes);
  const ShardLanes apart = shard_lanes(head, StepPlace::kDevice, false, kRates, bytes, /*tie_apart=*/true);
  EXPECT_EQ(whole.gradient_out, 0.0);
  EXPECT_DOUBLE_EQ(apart.gradient_out, 40 * bytes.weight / kRates.device_to_host);
  EXPECT_DOUBLE_EQ(apart.host_step, 40 * (bytes.weight + bytes.host_accumulate) / kRates.host);
  EXPECT_DOUBLE_EQ(apart.state_out, whole.state_out) << "it steps what it owns on the device as ever";
  // Its unit's region holds the share going out: nothing of the working set is left to its step.
  EXPECT_EQ(step_room(head, StepPlace::kDevice, bytes, true, true), step_room(head, StepPlace::kDevice, bytes, false));
  // Each step's four backwards send the share out, and each step sums it on the host; the simulator runs the same.
  const LaneBound bound = lane_bound(tasks, split, kRates, bytes, 1);
  const LaneBound host = lane_bound(tasks, host_placement(tasks), kRates, bytes, 1);
  const double head_out = shard_lanes(head, StepPlace::kHost, false, kRates, bytes).gradient_out;
  EXPECT_DOUBLE_EQ(host.device_to_host - bound.device_to_host,
                   4 * (head_out - apart.gradient_out) - 4 * apart.state_out);
  const SimulationResult simulated = simulate(lane_simulation(tasks, split, kRates, bytes, 1));
  const SimulationResult whole_tie = simulate(
      lane_simulation(tasks, {{StepPlace::kDevice, StepPlace::kHost, StepPlace::kDevice}}, kRates, bytes, 1));
  const ShardLanes owner_host = shard_lanes(tasks[0].shards[0], StepPlace::kHost, false, kRates, bytes);
  const ShardLanes owner_device = shard_lanes(tasks[0].shards[0], StepPlace::kDevice, false, kRates, bytes);
  EXPECT_NEAR(simulated.host_seconds - whole_tie.host_seconds, 4 * (apart.host_step + owner_host.host_step), 1e-9);
  // Gradients and states going out: the owner's gradient for its state, and the head's share besides.
  EXPECT_NEAR(simulated.gradient_transfer_seconds - whole_tie.gradient_transfer_seconds,
              4 * (apart.gradient_out + owner_host.gradient_out - owner_device.state_out), 1e-9);
}

TEST(SplitTies, KeepTheEnginesGradientBuffers) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks = tied_task(4, 1);  // each backward followed by its step
  const int64_t owner = 100 * 2, head = 30 * 2;
  const Placement owner_on_device{{StepPlace::kDevice, StepPlace::kHost, StepPlace::kHost}};
  const Placement head_on_device{{StepPlace::kHost, StepPlace::kHost, StepPlace::kDevice}};
  EXPECT_EQ(placement_bytes(tasks, owner_on_device, bytes, {}, 0), owner) << "the head's share sums in it";
  EXPECT_EQ(placement_bytes(tasks, head_on_device, bytes, {}, 0), head) << "the head's own, its unit's holds the share";
  const Placement resident_apart{{StepPlace::kResident, StepPlace::kHost, StepPlace::kDevice}};
  EXPECT_THROW(lane_bound(tasks, resident_apart, kRates, bytes, 1), std::invalid_argument);
}

}  // namespace
