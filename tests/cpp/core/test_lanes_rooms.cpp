// What the lane model's simulator runs within a device's room: the arena, where a device keeps weights between visits
// (evicted stale first, then by furthest next use) and its device steps' states take room while they run, and the
// plan that weighs both.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/lane_plan.h"
#include "core/lanes.h"
#include "core/simulator.h"
#include "core/simulator_cache.h"
#include "lane_shapes.h"

namespace {

using namespace hydra::core;
using namespace hydra::core::lane_test;

Unit visit(int task, int shard) { return Unit{task, 0, shard, Phase::kForward, 0}; }

// Three shards, two steps on the host: F0 F1 FB2 B1 B0 each step. Without kept weights every visit but none copies
// (ten copies); kept, B1 and B0 compute on their forwards' copies (six), and each step's host step makes them stale.
TEST(KeptWeights, ServeTheBackwardAndGoStaleWithTheHostStep) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(3, shard(1.0, 2.0, 100)), 2)};
  const double w = shard_lanes(tasks[0].shards[0], StepPlace::kHost, false, kRates, bytes).weights_in;
  const Placement host = host_placement(tasks);
  const SimulationResult copied = simulate(lane_simulation(tasks, host, kRates, bytes, 1));
  EXPECT_DOUBLE_EQ(copied.transfer_seconds, 10 * w);
  EXPECT_EQ(copied.kept_visits, 0);
  const SimulationResult kept = simulate(lane_simulation(tasks, host, kRates, bytes, 1, 1 << 20));
  EXPECT_DOUBLE_EQ(kept.transfer_seconds, 6 * w);
  EXPECT_EQ(kept.kept_visits, 4);
  EXPECT_LE(kept.makespan, copied.makespan);
}

// Two shards stepped on the device, two steps: F0 FB1 B0 each. The device step rewrites the copy the device keeps, so
// the next step's FB1 computes on it: only the first F0 and FB1 copy weights in (B0 then F0 is the same shard).
TEST(KeptWeights, ADeviceStepRewritesTheDevicesCopy) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(2, shard(1.0, 2.0, 100)), 2)};
  const ShardLanes lanes = shard_lanes(tasks[0].shards[0], StepPlace::kDevice, false, kRates, bytes);
  const Placement device{{StepPlace::kDevice, StepPlace::kDevice}};
  const SimulationResult copied = simulate(lane_simulation(tasks, device, kRates, bytes, 1));
  EXPECT_DOUBLE_EQ(copied.transfer_seconds, 5 * lanes.weights_in + 4 * lanes.state_in);
  const SimulationResult kept = simulate(lane_simulation(tasks, device, kRates, bytes, 1, 1 << 20));
  EXPECT_DOUBLE_EQ(kept.transfer_seconds, 2 * lanes.weights_in + 4 * lanes.state_in);
  EXPECT_EQ(kept.kept_visits, 3);
}

// Room for one shard's weights beside the ones in use: fewer copies than none kept, more than all kept.
TEST(KeptWeights, ASmallRoomKeepsSome) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(6, shard(1.0, 2.0, 100)), 2),
                                     task(std::vector<ShardShape>(6, shard(1.0, 2.0, 100)), 2)};
  const Placement host = host_placement(tasks);
  const double none = simulate(lane_simulation(tasks, host, kRates, bytes, 1)).transfer_seconds;
  const double some = simulate(lane_simulation(tasks, host, kRates, bytes, 1, 200)).transfer_seconds;
  const double all = simulate(lane_simulation(tasks, host, kRates, bytes, 1, 1 << 20)).transfer_seconds;
  EXPECT_LT(some, none);
  EXPECT_GT(some, all);
}

TEST(KeptWeights, EvictsStaleCopiesFirstThenTheOneNeededFurthestAhead) {
  using hydra::core::simulated::WeightCache;
  WeightCache cache;
  for (int s = 0; s < 4; ++s) cache.put(0, s, 0, 1.0, 100);
  int64_t current_of_2 = 0;
  auto current = [&](int, int shard) { return shard == 2 ? current_of_2 : int64_t{0}; };
  const std::vector<Unit> upcoming{visit(0, 2), visit(0, 0)};
  const std::vector<Unit> pinned{visit(0, 3)};
  // Shard 3 is in use; of the others shard 1 is never used along the plan, then shard 0 comes after shard 2.
  EXPECT_TRUE(cache.trim(300, pinned, upcoming, current));
  EXPECT_EQ(cache.use(0, 1, 0), nullptr);
  EXPECT_NE(cache.use(0, 0, 0), nullptr);
  EXPECT_TRUE(cache.trim(200, pinned, upcoming, current));
  EXPECT_EQ(cache.use(0, 0, 0), nullptr);
  EXPECT_NE(cache.use(0, 2, 0), nullptr);
  EXPECT_EQ(cache.held(0, 3), 100) << "a copy in use is never evicted";
  // A step of shard 2 makes its copy stale: it goes first, though needed next.
  cache.put(0, 1, 0, 1.0, 100);
  current_of_2 = 1;
  EXPECT_TRUE(cache.trim(200, pinned, upcoming, current));
  EXPECT_EQ(cache.use(0, 2, 0), nullptr);
  EXPECT_NE(cache.use(0, 1, 0), nullptr);
  EXPECT_EQ(cache.use(0, 1, 1), nullptr) << "a copy serves only the step it is of";
  EXPECT_FALSE(cache.trim(0, pinned, upcoming, current)) << "the copy in use alone is more";
  EXPECT_EQ(cache.held(0, 3), 100);
  EXPECT_EQ(cache.held(0, 1), 0);
}

// F0 FB1 B0 with both shards stepped on the device, in an arena of one step's state: B0's state comes in only once
// FB1's step has sent its own home, so the run is longer than in an arena of two.
TEST(Arena, AStateWaitsForTheStatesOnTheDeviceToGoHome) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(2, shard(1.0, 2.0, 100)), 1)};
  const ShardLanes lanes = shard_lanes(tasks[0].shards[0], StepPlace::kDevice, false, kRates, bytes);
  const int64_t state = step_room(tasks[0].shards[0], StepPlace::kDevice, bytes, false);
  const Placement device{{StepPlace::kDevice, StepPlace::kDevice}};
  const SimulationResult two = simulate(lane_simulation(tasks, device, kRates, bytes, 1, 2 * state));
  const SimulationResult one = simulate(lane_simulation(tasks, device, kRates, bytes, 1, state));
  EXPECT_GT(one.makespan, two.makespan);
  // Each step's state in, its step and its state home, one after another (the first one's in after F0's and FB1's
  // weights).
  EXPECT_GE(one.makespan, 2 * lanes.weights_in + 2 * (lanes.state_in + lanes.device_step + lanes.state_out) - 1e-9);
  EXPECT_DOUBLE_EQ(one.transfer_seconds, two.transfer_seconds);
}

// Two tasks of four shards, shard 1 of each stepped on the device, in an arena of one step's state and four weight
// copies: while a state is on the device it takes the room of copies the other task's backwards would find.
TEST(Arena, AStateTakesTheRoomOfKeptCopies) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks(2, task(std::vector<ShardShape>(4, shard(1.0, 2.0, 100)), 2));
  const int64_t state = step_room(tasks[0].shards[0], StepPlace::kDevice, bytes, false);
  Placement device = host_placement(tasks);
  device[0][1] = device[1][1] = StepPlace::kDevice;
  SimulationConfig config = lane_simulation(tasks, device, kRates, bytes, 1, state + 4 * 200);
  const SimulationResult taking = simulate(config);
  for (StepSchedule& schedule : config.steps) schedule.state_bytes.assign(4, 0);
  const SimulationResult free = simulate(config);
  EXPECT_LT(taking.kept_visits, free.kept_visits);
  EXPECT_GT(taking.transfer_seconds, free.transfer_seconds);
}

// F0 FB1 B0, shard 0 stepped on the device and shard 1 on the host, in an arena of one step's state: B0's state comes
// in only once FB1's gradient has left the device, which it holds room for until then.
TEST(Arena, AGradientGoingOutHoldsItsRoom) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(2, shard(1.0, 2.0, 100)), 1)};
  const ShardLanes host = shard_lanes(tasks[0].shards[1], StepPlace::kHost, false, kRates, bytes);
  const ShardLanes device = shard_lanes(tasks[0].shards[0], StepPlace::kDevice, false, kRates, bytes);
  const int64_t state = step_room(tasks[0].shards[0], StepPlace::kDevice, bytes, false);
  const Placement placement{{StepPlace::kDevice, StepPlace::kHost}};
  const SimulationResult tight = simulate(lane_simulation(tasks, placement, kRates, bytes, 1, state));
  // F0 computes after its copy (w + 1), FB1 after its prefetched copy (2w + 3): its gradient is out at 2w + 3 + g.
  const double gradient_left = 2 * host.weights_in + 3 + host.gradient_out;
  EXPECT_GE(tight.makespan, gradient_left + device.state_in + device.device_step + device.state_out - 1e-9);
  const SimulationResult roomy = simulate(lane_simulation(tasks, placement, kRates, bytes, 1, 1 << 20));
  EXPECT_LT(roomy.makespan, tight.makespan);
}

// Room for one device step, not two: the plan still steps shards on the device where the host binds, more than the
// one that room holds with two steps at once, the steps taking turns in it, and the run is shorter.
TEST(StepRooms, PlanStepsOnTheDeviceInTheRoomOfOneStep) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task(std::vector<ShardShape>(3, shard(0.05, 0.1, 100)), 4)};
  const LaneRates host_binds{20000.0, 20000.0, 100 * 28 / 0.3, 1e5};
  const int64_t one_step = step_room(tasks[0].shards[0], StepPlace::kDevice, bytes, false);
  const Placement all(1, std::vector<StepPlace>(3, StepPlace::kDevice));
  ASSERT_GT(placement_bytes(tasks, all, bytes), one_step);
  EXPECT_EQ(placement_bytes(tasks, all, bytes, {}, 1), one_step);
  const Placement two_rooms = choose_placement(tasks, host_binds, bytes, 1, one_step, 1.0, {}, false);
  EXPECT_EQ(std::count(two_rooms[0].begin(), two_rooms[0].end(), StepPlace::kDevice), 1);
  const LanePlan plan = plan_lanes(tasks, host_binds, bytes, 1, one_step);
  EXPECT_GE(std::count(plan.placement[0].begin(), plan.placement[0].end(), StepPlace::kDevice), 2);
  EXPECT_EQ(placement_bytes(tasks, plan.placement, bytes, {}, 1), one_step);
  EXPECT_LT(plan.run.makespan,
            simulate(simulation_in_room(tasks, two_rooms, host_binds, bytes, 1, one_step)).makespan);
  EXPECT_THROW(placement_bytes(tasks, all, bytes, {}, 3), std::invalid_argument);
  EXPECT_THROW(placement_bytes(tasks, all, bytes, {}, -1), std::invalid_argument);
}

using P = StepPlace;

// One 4.22M-parameter GPT-2 model in fp32 cut in six shards (the embeddings, four blocks, the tied head) on the
// emulated link, the host at 1.6x the link, with each shard's (forward, backward) seconds and the lanes' rates as
// "auto" measured them (benchmarks/RESULTS.md): its ends resident, room for one middle shard's step.
struct MeasuredModel {
  std::vector<TaskShape> tasks;
  LaneRates rates;
  StepBytes fp32{4, 8, 28, 8, 28};
  int64_t room = 11612160;
  Placement start{{P::kResident, P::kHost, P::kHost, P::kHost, P::kHost, P::kResident}};
  Placement one{{P::kResident, P::kDevice, P::kHost, P::kHost, P::kHost, P::kResident}};  // one middle step

  MeasuredModel(const std::vector<std::pair<double, double>>& seconds, LaneRates measured) : rates(measured) {
    const int64_t sizes[] = {540672, 789760, 789760, 789760, 789760, 524800};
    TaskShape model{{}, 6, 1};
    for (size_t s = 0; s < 6; ++s) {
      const bool head = s == 5;
      model.shards.push_back(ShardShape{seconds[s].first, seconds[s].second, sizes[s], sizes[s],
                                        head ? 512 : sizes[s], head ? 0 : -1});
    }
    tasks.push_back(std::move(model));
  }
  double run(const Placement& placement) const {
    return simulate(simulation_in_room(tasks, placement, rates, fp32, 1, room, start)).makespan;
  }
  Placement planned() const { return plan_lanes(tasks, rates, fp32, 1, room, start).placement; }
};

// At copy / forward 0.25: three middle shards stepped on the device, taking turns, simulate 2% shorter than one; run,
// they took 20% longer. The plan keeps the placement whose steps have room at once, where steps in turns are not
// kTurnsMargin shorter.
TEST(StepRooms, StepsInTurnsAreChosenOnlyWhereTheyPayClearly) {
  const MeasuredModel m({{0.000586, 0.001759}, {0.011126, 0.033379}, {0.009345, 0.028035}, {0.008489, 0.025468},
                         {0.008937, 0.026812}, {0.0, 0.000144}},
                        {6.778e8, 6.778e8, 1.0845e9, 8.256e10});
  const Placement in_turns{{P::kResident, P::kDevice, P::kDevice, P::kDevice, P::kHost, P::kResident}};
  ASSERT_LE(placement_bytes(m.tasks, m.one, m.fp32, m.start, 2), m.room);
  ASSERT_GT(placement_bytes(m.tasks, in_turns, m.fp32, m.start, 2), m.room);
  ASSERT_LT(m.run(in_turns), m.run(m.one)) << "the simulator favours the turns";
  ASSERT_GT(m.run(in_turns), (1.0 - kTurnsMargin) * m.run(m.one)) << "but not by the margin";
  EXPECT_LE(placement_bytes(m.tasks, m.planned(), m.fp32, m.start, 2), m.room) << "steps with room at once";
}

// At copy / forward 2: two steps in turns (shards 1 and 2) simulate 6% shorter than shard 1's step alone, and ran 12%
// longer: the plan keeps the one step.
TEST(StepRooms, StepsInTurnsSixPercentShorterAreNotChosen) {
  const MeasuredModel m({{0.0005754173350093575, 0.0017262520050280727}, {0.009477532665187027, 0.028432597995561082},
                         {0.008359983999980614, 0.02507995199994184}, {0.008438667333393823, 0.02531600200018147},
                         {0.008324507999835381, 0.024973523999506142}, {0.0, 0.0001411440025549382}},
                        {109649738.62284076, 109649738.62284076, 175439581.79654524, 86035501254.93524});
  const Placement in_turns{{P::kResident, P::kDevice, P::kDevice, P::kHost, P::kHost, P::kResident}};
  ASSERT_GT(placement_bytes(m.tasks, in_turns, m.fp32, m.start, 2), m.room);
  ASSERT_LT(m.run(in_turns), 0.95 * m.run(m.one)) << "the simulator favours the turns by more than 5%";
  EXPECT_EQ(m.planned(), m.one);
}

// A placement's run within a room: the arena is what its homes and held gradients leave; device steps' states take
// their rooms from it as they run.
TEST(StepRooms, ARunInARoomHasWhatItsPlacementHoldsLeft) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1.0, 2.0, 300), shard(1.0, 2.0, 100), shard(1.0, 2.0, 200)}, 2)};
  const Placement all(1, std::vector<StepPlace>(3, StepPlace::kDevice));
  EXPECT_EQ(simulation_in_room(tasks, host_placement(tasks), kRates, bytes, 1, 5000).arena_bytes, 5000);
  EXPECT_EQ(simulation_in_room(tasks, all, kRates, bytes, 1, 5000).arena_bytes, 5000) << "nothing held for the run";
  Placement home = all;
  home[0][1] = StepPlace::kResident;
  const int64_t held = held_bytes(tasks[0].shards[1], StepPlace::kResident, bytes, false);
  EXPECT_EQ(simulation_in_room(tasks, home, kRates, bytes, 1, 5000).arena_bytes, 5000 - held);
  EXPECT_EQ(simulation_in_room(tasks, home, kRates, bytes, 1, held - 1).arena_bytes, 0) << "beyond the room";
  EXPECT_EQ(placement_bytes(tasks, home, bytes, {}, 0), held);
  EXPECT_GT(simulate(simulation_in_room(tasks, host_placement(tasks), kRates, bytes, 1, 5000)).kept_visits, 0);
}

TEST(StepRooms, BadInputIsRefused) {
  const StepBytes bytes;
  const std::vector<TaskShape> tasks{task({shard(1.0, 2.0, 100)}, 1)};
  SimulationConfig config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1, -2);
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1, 100);
  config.steps[0].weight_bytes.clear();
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = lane_simulation(tasks, host_placement(tasks), kRates, bytes, 1, 100);
  config.steps[0].state_bytes = {-1};
  EXPECT_THROW(simulate(config), std::invalid_argument);
  EXPECT_THROW(choose_placement(tasks, kRates, bytes, 1, 100, 1.0, {}, true, 0), std::invalid_argument);
}

}  // namespace
