// A tie split between kHost and kDevice in the lane model: the tied weight's gradient sums where its owner steps, so
// a kHost borrower of a kDevice owner sends out only what it owns, and a kDevice borrower of a kHost owner sends its
// share of the tie out after every backward, to be summed on the host. A resident owner lends to a spilled borrower.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/lane_plan.h"
#include "core/lane_ties.h"
#include "core/lanes.h"
#include "core/simulator.h"
#include "lane_shapes.h"

namespace {

using namespace hydra::core;
using namespace hydra::core::lane_test;

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
}

// A resident owner's tie: a spilled borrower reads it in the owner's home and sums its gradient there, whichever way
// the borrower steps; it copies in and sends out only what it owns.
TEST(ResidentOwnerTies, ASpilledBorrowerCopiesNothingOfTheTie) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks = tied_task(4, 2);
  const Placement host_head{{StepPlace::kResident, StepPlace::kHost, StepPlace::kHost}};
  const Placement device_head{{StepPlace::kResident, StepPlace::kHost, StepPlace::kDevice}};
  EXPECT_TRUE(tie_apart(tasks[0], host_head[0], 2)) << "stepped on the host, its tie on the device";
  EXPECT_FALSE(tie_apart(tasks[0], device_head[0], 2));
  for (const Placement& placement : {host_head, device_head})
    EXPECT_EQ(as_placed(tasks[0], placement[0], 2).weights, 30) << "its own weights alone come in";
  EXPECT_EQ(as_placed(tasks[0], host_placement(tasks)[0], 2).weights, 70);
  EXPECT_EQ(as_placed(tasks[0], {StepPlace::kDevice, StepPlace::kHost, StepPlace::kHost}, 2).weights, 70);
  EXPECT_EQ(as_placed(tasks[0], host_head[0], 1).weights, 50) << "untied";
  // What goes out: shard 1's gradients, and the head's own (host-stepped) or its step's state (device-stepped).
  const ShardLanes middle = shard_lanes(tasks[0].shards[1], StepPlace::kHost, true, kRates, bytes);
  const ShardLanes host =
      shard_lanes(as_placed(tasks[0], host_head[0], 2), StepPlace::kHost, true, kRates, bytes, /*tie_apart=*/true);
  const ShardLanes device =
      shard_lanes(as_placed(tasks[0], device_head[0], 2), StepPlace::kDevice, true, kRates, bytes);
  EXPECT_DOUBLE_EQ(host.gradient_out, 30 * bytes.weight / kRates.device_to_host);
  EXPECT_DOUBLE_EQ(device.gradient_out, 0.0);
  EXPECT_NEAR(lane_bound(tasks, host_head, kRates, bytes, 1).device_to_host,
              4 * (middle.gradient_out + host.gradient_out), 1e-9);
  EXPECT_NEAR(lane_bound(tasks, device_head, kRates, bytes, 1).device_to_host,
              4 * middle.gradient_out + 2 * device.state_out, 1e-9);
  // Its gradient buffer, where a step sums several backwards, holds what it owns: the tie's sums in the home.
  EXPECT_EQ(placement_bytes(tasks, device_head, bytes, {}, 0) - placement_bytes(tasks, host_head, bytes, {}, 0),
            30 * 2);
}

TEST(ResidentOwnerTies, AResidentBorrowerOfASpilledOwnerOrAHeadAloneApartFromItsOwnerIsRefused) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks = tied_task(4, 1);
  const Placement resident_head{{StepPlace::kHost, StepPlace::kHost, StepPlace::kResident}};
  EXPECT_THROW(lane_bound(tasks, resident_head, kRates, bytes, 1), std::invalid_argument);
  const Placement both{{StepPlace::kResident, StepPlace::kHost, StepPlace::kResident}};
  EXPECT_NO_THROW(lane_bound(tasks, both, kRates, bytes, 1));
  std::vector<TaskShape> alone = tasks;
  alone[0].shards[2] = ShardShape{1.0, 2.0, 40, 40, 0, 0};  // the head alone: nothing of its own to train
  EXPECT_THROW(lane_bound(alone, {{StepPlace::kResident, StepPlace::kHost, StepPlace::kHost}}, kRates, bytes, 1),
               std::invalid_argument);
  EXPECT_NO_THROW(lane_bound(alone, both, kRates, bytes, 1));
  alone[0].shards[2] = ShardShape{1.0, 2.0, 40, 0, 0, 0};  // a frozen tie alone: nothing to train either
  EXPECT_THROW(lane_bound(alone, {{StepPlace::kResident, StepPlace::kHost, StepPlace::kHost}}, kRates, bytes, 1),
               std::invalid_argument);
  EXPECT_TRUE(owners_alone(alone[0], {0, 2}).empty());
}

// Where the room holds the embedding's home but not the head's beside it, the lane model may make the owner alone
// resident; with room for both it may take the head too.
TEST(ResidentOwnerTies, TheLaneModelMayMakeTheOwnerAloneResident) {
  const StepBytes bytes;
  const LaneRates slow_link{10.0, 10.0, 1e6, 1e6};  // the copies bind: a home saves most
  const std::vector<TaskShape> tasks = tied_task(8, 1);
  const int64_t owner = held_bytes(tasks[0].shards[0], StepPlace::kResident, bytes, false);
  const int64_t head = held_bytes(tasks[0].shards[2], StepPlace::kResident, bytes, false);
  int64_t reserve = 0;
  for (const ShardShape& shard : tasks[0].shards)
    reserve = std::max(reserve, step_room(shard, StepPlace::kDevice, bytes, false));
  const Placement alone = choose_placement(tasks, slow_link, bytes, 1, owner + reserve, 1.0, {}, true, 1);
  EXPECT_EQ(alone[0][0], StepPlace::kResident);
  EXPECT_NE(alone[0][2], StepPlace::kResident);
  EXPECT_NO_THROW(lane_bound(tasks, alone, slow_link, bytes, 1));
  const Placement none = choose_placement(tasks, slow_link, bytes, 1, owner + reserve - 1, 1.0, {}, true, 1);
  EXPECT_NE(none[0][0], StepPlace::kResident);
  const Placement whole = choose_placement(tasks, slow_link, bytes, 1, owner + head + reserve, 1.0, {}, true, 1);
  EXPECT_EQ(whole[0][0], StepPlace::kResident);
  EXPECT_EQ(whole[0][2], StepPlace::kResident);
  std::vector<TaskShape> head_alone = tasks;
  head_alone[0].shards[2] = ShardShape{1.0, 2.0, 40, 40, 0, 0};  // nothing of its own: the tie moves whole
  const Placement refused = choose_placement(head_alone, slow_link, bytes, 1, owner + reserve, 1.0, {}, true, 1);
  EXPECT_NE(refused[0][0], StepPlace::kResident);
}

// One tied GPT-2 (4 layers, width 256) as measured on the emulated link with the host at 4x its rate
// (benchmarks/RESULTS.md), its last shard holding two blocks besides the head; the room holds one home. By the bound
// a block's home ranks first (the shorter chain), but the embedding's is the one the next step's first unit waits
// for: the plan tries the leading shards' homes first, the tie's owner alone among them, and simulates both.
TEST(ResidentOwnerTies, ThePlanGivesTheEmbeddingItsHomeWhereThatRunsShorter) {
  const std::vector<TaskShape> tasks{
      TaskShape{{ShardShape{0.0007526343324570917, 0.002257902997371275, 540672, 540672, 540672, -1},
                 ShardShape{0.009132715999536837, 0.02739814799861051, 789760, 789760, 789760, -1},
                 ShardShape{0.010051122999963505, 0.030153368999890517, 789760, 789760, 789760, -1},
                 ShardShape{0.0, 0.05520759399951203, 2104320, 2104320, 1580032, 0}},
                6, 1}};
  const LaneRates rates{383366904.9312482, 383366904.9312482, 1533467619.7249928, 86672552049.81981};
  const StepBytes fp32{4.0, 8.0, 28.0, 8.0, 28.0};
  const int64_t room = 17135104;
  const Placement by_bound = choose_placement(tasks, rates, fp32, 1, room, 1.0, {}, true, 2);
  EXPECT_EQ(by_bound[0], (std::vector<StepPlace>{StepPlace::kHost, StepPlace::kResident, StepPlace::kHost,
                                                  StepPlace::kHost}));
  const LanePlan plan = plan_lanes(tasks, rates, fp32, 1, room);
  const Placement owner{{StepPlace::kResident, StepPlace::kHost, StepPlace::kHost, StepPlace::kHost}};
  EXPECT_EQ(plan.placement, owner);
  EXPECT_LT(plan.run.makespan, simulate(simulation_in_room(tasks, by_bound, rates, fp32, 1, room)).makespan);
}

// A task placed mid-run steps none of its tied shards off the host: kept as the start has them, the choice is among
// the others, by the bound and by the plan alike.
TEST(KeptShards, StayAsTheStartHasThemAndTheChoiceIsAmongTheOthers) {
  const StepBytes bytes;
  const LaneRates slow_host{1e6, 1e6, 10.0, 1e6};  // the host binds: every step would leave it
  std::vector<TaskShape> tasks = tied_task(8, 1);
  const int64_t room = int64_t{1} << 40;
  const Placement free = plan_lanes(tasks, slow_host, bytes, 1, room).placement;
  EXPECT_NE(free[0][0], StepPlace::kHost);
  EXPECT_NE(free[0][2], StepPlace::kHost);
  tasks[0].kept = {true, false, true};
  for (const Placement& placement : {choose_placement(tasks, slow_host, bytes, 1, room, 1.0, {}, true, 2),
                                     plan_lanes(tasks, slow_host, bytes, 1, room).placement}) {
    EXPECT_EQ(placement[0][0], StepPlace::kHost);
    EXPECT_EQ(placement[0][2], StepPlace::kHost);
    EXPECT_NE(placement[0][1], StepPlace::kHost);
  }
  tasks[0].kept = {true};
  EXPECT_THROW(plan_lanes(tasks, slow_host, bytes, 1, room), std::invalid_argument);
}

// A frozen tie lent by a resident owner: the borrower copies none of it, though its gradients hold none of it either
// (`borrowed` says what it reads of the owner's); without it only a trainable tie is known to be borrowed.
TEST(ResidentOwnerTies, AFrozenTieIsNotCopiedEitherWhereTheShapeSaysWhatIsBorrowed) {
  std::vector<TaskShape> tasks = tied_task(8, 1);
  tasks[0].shards[2] = ShardShape{1.0, 2.0, 70, 30, 30, 0};  // the 40 tied elements frozen
  const Placement owner{{StepPlace::kResident, StepPlace::kHost, StepPlace::kHost}};
  EXPECT_EQ(as_placed(tasks[0], owner[0], 2).weights, 70);
  tasks[0].shards[2].borrowed = 40;
  EXPECT_EQ(as_placed(tasks[0], owner[0], 2).weights, 30);
  EXPECT_EQ(as_placed(tasks[0], {StepPlace::kHost, StepPlace::kHost, StepPlace::kHost}, 2).weights, 70);
  tasks[0].shards[2].borrowed = 71;
  EXPECT_THROW(lane_bound(tasks, owner, kRates, StepBytes{}, 1), std::invalid_argument);
}

}  // namespace
