// Copies along the plan: the scheduler's committed plans (commit_plan), and the simulator's copy lanes that
// follow them (Prefetch::kAlongPlan), with the transfer bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/scheduler.h"
#include "core/simulator.h"
#include "core/synthetic_workload.h"

namespace {

using namespace hydra::core;

TEST(CommittedPlan, IsHandedOutInItsOrderThoughTheEstimatesMove) {
  // Two equal tasks: LRTF's plan alternates between them. The durations then reported make task 1 look far
  // longer, which would send LRTF to it at once; the committed units still come in their order.
  Scheduler scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 1, PolicyKind::kLrtf);
  const std::vector<Unit> planned = scheduler.commit_plan(0, 4);
  ASSERT_EQ(planned.size(), 4u);
  for (const Unit& expected : planned) {
    const Unit got = *scheduler.try_next(0);
    EXPECT_EQ(got, expected);
    scheduler.complete(0, got, got.task == 1 ? 100.0 : 0.001);
  }
  // Committing again continues the committed order where it still holds: a plan is stable.
  EXPECT_EQ(scheduler.commit_plan(0, 2), scheduler.plan(0, 2));
}

TEST(CommittedPlan, OnlyLrtfCommits) {
  // fifo, round_robin and random keep the order asked for at every decision: commit_plan is plan().
  for (PolicyKind policy : {PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom}) {
    Scheduler scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 2, policy);
    const std::vector<Unit> planned = scheduler.commit_plan(0, 1);
    ASSERT_EQ(planned.size(), 1u);
    EXPECT_EQ(scheduler.try_next(1)->task, planned[0].task) << "device 1 may take what device 0 planned";
  }
}

TEST(CommittedPlan, AnotherDeviceLeavesItsHeadAloneAndItsTasksOutOfItsOwnPlan) {
  Scheduler scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 2, PolicyKind::kLrtf);
  const std::vector<Unit> planned = scheduler.commit_plan(0, 1);
  ASSERT_EQ(planned.size(), 1u);
  const int reserved = planned[0].task;
  // Device 1 asks first: it gets the other task, not the one whose weights device 0 is copying in.
  const Unit other = *scheduler.try_next(1);
  EXPECT_NE(other.task, reserved);
  for (const Unit& unit : scheduler.plan(1, 4)) EXPECT_NE(unit.task, reserved);
  EXPECT_EQ(scheduler.try_next(0)->task, reserved);
}

TEST(CommittedPlan, ADeviceWithNothingElseToDoTakesAnotherDevicesHead) {
  // Device 0 runs task 0 and commits to task 1 next; device 1 has nothing but task 1: it runs it rather than
  // idle, and device 0's commitment lapses.
  Scheduler scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 2, PolicyKind::kLrtf);
  const Unit running = *scheduler.try_next(0);
  scheduler.commit_plan(0, 2);
  const std::optional<Unit> taken = scheduler.try_next(1);
  ASSERT_TRUE(taken.has_value()) << "an idle device waited for another device's commitment";
  EXPECT_NE(taken->task, running.task);
  scheduler.complete(0, running, 1.0);
  EXPECT_EQ(scheduler.try_next(0)->task, running.task);
}

TEST(CommittedPlan, ATaskRunningHereStaysInThisDevicesPlan) {
  // Device 0 committed to two units of task 0; device 1 ran the first of them: the second is still device 0's,
  // but task 0 now runs on device 1, whose plan must foresee its next units (for prefetch and eviction).
  Scheduler scheduler({TaskSpec{3, 1, std::nullopt}}, 2, PolicyKind::kLrtf);
  const Unit first = *scheduler.try_next(0);
  scheduler.complete(0, first, 1.0);
  scheduler.commit_plan(0, 3);
  scheduler.commit_plan(1, 1);  // device 1 now asks while device 0 is idle: nothing else for it to do
  const std::optional<Unit> second = scheduler.try_next(1);
  ASSERT_TRUE(second.has_value());
  const std::vector<Unit> planned = scheduler.plan(1, 2);
  ASSERT_FALSE(planned.empty());
  EXPECT_EQ(planned.front().task, 0);
  EXPECT_EQ(planned.front().index, second->index + 1);
}

TEST(CommittedPlan, AStaleCommitmentIsForgotten) {
  Scheduler scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 2, PolicyKind::kLrtf);
  const std::vector<Unit> planned = scheduler.commit_plan(0, 2);
  ASSERT_EQ(planned.size(), 2u);
  scheduler.fail(planned[0].task);  // its units are gone: the commitment cannot hold
  const std::optional<Unit> unit = scheduler.try_next(0);
  ASSERT_TRUE(unit.has_value());
  EXPECT_NE(unit->task, planned[0].task);
  EXPECT_EQ(scheduler.try_next(1), std::nullopt) << "both tasks' units are taken or gone";
}

// The tasks of `units`, in the order they first appear.
std::vector<int> tasks_of(const std::vector<Unit>& units) {
  std::vector<int> tasks;
  for (const Unit& unit : units)
    if (std::ranges::find(tasks, unit.task) == tasks.end()) tasks.push_back(unit.task);
  return tasks;
}

TEST(PlanShare, WhileAnotherDeviceWaitsForWorkAPlanHoldsOnlyTheTaskRunningHere) {
  // Three equal tasks of 6 units, two devices; device 0 runs one. LRTF alone would plan the others next (they have
  // more left), but device 1, not yet started, would take them at once: copies made for them on device 0 would be
  // wasted.
  Scheduler scheduler(std::vector<TaskSpec>(3, TaskSpec{2, 2, std::nullopt}), 2, PolicyKind::kLrtf);
  const Unit running = *scheduler.try_next(0);
  const std::vector<Unit> planned = scheduler.plan(0, 8);
  EXPECT_EQ(planned.size(), 5u) << "the rest of its task, then nothing";
  EXPECT_EQ(tasks_of(planned), std::vector<int>{running.task});
  // Device 1 runs a unit and is between two (its worker will ask again at once): device 0 plans its share, two.
  const Unit there = *scheduler.try_next(1);
  scheduler.complete(1, there, 1.0);
  EXPECT_EQ(tasks_of(scheduler.plan(0, 20)).size(), 2u);
}

TEST(PlanShare, ADeviceThatFoundNothingReadyWaitsForWork) {
  // One task on two devices: device 1 asked and found nothing (the task runs on device 0). Two more tasks arrive
  // before it asks again: device 0's plan holds its own task only, not ceil(3 / 2) = 2.
  Scheduler scheduler({TaskSpec{2, 2, std::nullopt}}, 2, PolicyKind::kLrtf);
  ASSERT_TRUE(scheduler.try_next(0).has_value());
  EXPECT_EQ(scheduler.try_next(1), std::nullopt);
  for (int i = 0; i < 2; ++i) scheduler.add_task(TaskSpec{2, 2, std::nullopt});
  EXPECT_EQ(tasks_of(scheduler.plan(0, 20)), std::vector<int>{0});
  ASSERT_TRUE(scheduler.try_next(1).has_value());
  EXPECT_EQ(tasks_of(scheduler.plan(0, 20)).size(), 2u) << "device 1 runs now";
}

TEST(PlanShare, OnlyLrtfPlansByShare) {
  // fifo's plan is its order of choice, as if no other device took any: the starved device 1 changes nothing.
  Scheduler scheduler(std::vector<TaskSpec>(3, TaskSpec{2, 2, std::nullopt}), 2, PolicyKind::kFifo);
  ASSERT_TRUE(scheduler.try_next(0).has_value());
  EXPECT_EQ(tasks_of(scheduler.plan(0, 17)).size(), 3u);
}

TEST(PlanShare, WithEveryDeviceBusyAPlanHoldsItsPartOfTheTasks) {
  // Five equal tasks, both devices running one: device 0's plan holds ceil(5 / 2) = 3 tasks to their end (its own
  // and two of the three waiting), where LRTF alone would go on to the third.
  Scheduler scheduler(std::vector<TaskSpec>(5, TaskSpec{2, 2, std::nullopt}), 2, PolicyKind::kLrtf);
  const Unit here = *scheduler.try_next(0);
  const Unit there = *scheduler.try_next(1);
  const std::vector<Unit> planned = scheduler.plan(0, 40);
  const std::vector<int> tasks = tasks_of(planned);
  ASSERT_EQ(tasks.size(), 3u);
  EXPECT_EQ(std::ranges::count(tasks, here.task), 1);
  EXPECT_EQ(std::ranges::count(tasks, there.task), 0);
  EXPECT_EQ(planned.size(), 5u + 6u + 6u);
}

TEST(PlanShare, TasksPinnedToTheDeviceAreAllInItsPlan) {
  // Tasks 0-2 may run on device 0 only, 3 and 4 anywhere; device 0 runs task 0, device 1 task 3. Device 0's share
  // of the two free-moving tasks is one (task 4); its pinned tasks do not count against it.
  std::vector<TaskSpec> tasks(3, TaskSpec{2, 2, 0});
  tasks.insert(tasks.end(), 2, TaskSpec{2, 2, std::nullopt});
  Scheduler scheduler(tasks, 2, PolicyKind::kLrtf);
  ASSERT_EQ(scheduler.try_next(0)->task, 0);  // equal estimates: the lowest id
  ASSERT_EQ(scheduler.try_next(1)->task, 3);
  std::vector<int> planned = tasks_of(scheduler.plan(0, 40));
  std::ranges::sort(planned);
  EXPECT_EQ(planned, (std::vector<int>{0, 1, 2, 4}));
  EXPECT_EQ(scheduler.plan(0, 40).size(), 5u + 6u + 6u + 6u);
}

TEST(CopiesAlongThePlan, CopiesShorterThanTheComputeAreHiddenAfterTheFirst) {
  // One task of three shards, one micro-batch: F0 F1 (1 s each), FB2, B1, B0 (3 s each); copies 0.5 s.
  SimulationConfig config;
  config.tasks = {TaskSpec{3, 1, std::nullopt}};
  config.compute = [](int, int, Phase phase) { return phase == Phase::kForward ? 1.0 : 3.0; };
  config.transfer = [](int, int, Phase) { return 0.5; };
  config.gradient_transfer = [](int, int, Phase) { return 0.5; };
  config.prefetch = Prefetch::kAlongPlan;
  config.prefetch_units = 2;
  const SimulationResult result = simulate(config);
  EXPECT_DOUBLE_EQ(result.exposed_transfer_seconds, 0.5) << "only the first copy, on an idle device";
  EXPECT_DOUBLE_EQ(result.makespan, 0.5 + 11.0);
  EXPECT_DOUBLE_EQ(result.transfer_seconds, 5 * 0.5) << "every unit's shard once, nothing wasted";
  EXPECT_DOUBLE_EQ(result.gradient_transfer_seconds, 3 * 0.5) << "FB2, B1, B0";
  EXPECT_DOUBLE_EQ(transfer_bound(config.tasks, config.transfer, config.gradient_transfer, 1), 2.5);
}

TEST(CopiesAlongThePlan, TheBoundLetsAOneShardTaskKeepItsWeights) {
  // Every unit of a one-shard task is FB(0) on the same shard: one copy is all any schedule needs.
  const std::vector<TaskSpec> tasks = {TaskSpec{1, 5, std::nullopt}};
  EXPECT_DOUBLE_EQ(transfer_bound(tasks, [](int, int, Phase) { return 1.0; }, {}, 1), 1.0);
  SimulationConfig config;
  config.tasks = tasks;
  config.compute = [](int, int, Phase) { return 0.1; };
  config.transfer = [](int, int, Phase) { return 1.0; };
  config.prefetch = Prefetch::kAlongPlan;
  EXPECT_DOUBLE_EQ(simulate(config).makespan, 1.0 + 5 * 0.1);
}

TEST(CopiesAlongThePlan, ALinkSlowerThanTheComputeSetsThePace) {
  // Copies of 2 s against 1 s forwards: the link is the bottleneck, and it never idles once started.
  SimulationConfig config;
  config.tasks = {TaskSpec{3, 2, std::nullopt}};
  config.compute = [](int, int, Phase) { return 1.0; };
  config.transfer = [](int, int, Phase) { return 2.0; };
  config.prefetch = Prefetch::kAlongPlan;
  config.prefetch_units = 4;
  const SimulationResult result = simulate(config);
  // 10 units, the second micro-batch's F0 follows B0 on the same shard: 9 copies of 2 s, then the last unit.
  EXPECT_DOUBLE_EQ(transfer_bound(config.tasks, config.transfer, {}, 1), 18.0);
  EXPECT_DOUBLE_EQ(result.makespan, 18.0 + 1.0);
  EXPECT_DOUBLE_EQ(result.transfer_seconds, 18.0);
}

TEST(CopiesAlongThePlan, TwelveModelsWasteNoCopyAndBeatDoubleBuffering) {
  const SyntheticWorkload workload = paper_workload();
  for (int devices : {1, 4}) {
    SCOPED_TRACE(devices);
    SimulationConfig config{workload.tasks, workload.compute(), workload.transfer(2.0), devices, PolicyKind::kLrtf,
                            Mode::kSharp, 1, Prefetch::kAlongPlan, 8, workload.transfer(2.0)};
    const SimulationResult along = simulate(config);
    config.prefetch = Prefetch::kPreviousUnit;
    const SimulationResult previous = simulate(config);
    const double needed = transfer_bound(workload.tasks, workload.transfer(2.0), {}, 1);
    EXPECT_LE(along.transfer_seconds, 1.01 * needed) << "copies for units the plan dropped";
    EXPECT_LT(along.makespan, previous.makespan);
  }
}

}  // namespace
