// The placement the lane model chooses: steps moved off a busy host within the room, from a start and around fixed
// tasks, homes weighed against device steps, and an idle host left alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/lane_plan.h"
#include "core/lanes.h"
#include "core/simulator.h"
#include "lane_shapes.h"

namespace {

using namespace hydra::core;
using namespace hydra::core::lane_test;

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

}  // namespace
