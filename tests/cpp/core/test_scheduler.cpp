// Scheduler: unit mapping, policies, blocking/fail/cancel semantics and device restriction (also run under TSan;
// tasks arriving and restarting: test_scheduler_arrivals.cpp).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <stdexcept>
#include <tuple>
#include <vector>
#include <mutex>
#include <thread>

#include "core/policy.h"
#include "core/scheduler.h"
#include "core/unit.h"
#include "scheduler_helpers.h"

namespace {

using namespace hydra::core;
using namespace std::chrono_literals;
using namespace hydra::core::scheduler_test;

TEST(UnitAt, FourShardsRunForwardThenForwardBackwardThenBackward) {
  const std::vector<std::pair<int, Phase>> expected = {
      {0, Phase::kForward},  {1, Phase::kForward},  {2, Phase::kForward}, {3, Phase::kForwardBackward},
      {2, Phase::kBackward}, {1, Phase::kBackward}, {0, Phase::kBackward}};
  for (int64_t mb = 0; mb < 3; ++mb) {
    for (int64_t p = 0; p < 7; ++p) {
      const Unit unit = unit_at(5, 4, mb * 7 + p);
      EXPECT_EQ(unit.task, 5);
      EXPECT_EQ(unit.index, mb * 7 + p);
      EXPECT_EQ(unit.micro_batch, mb);
      EXPECT_EQ(unit.shard, expected[static_cast<size_t>(p)].first) << "position " << p;
      EXPECT_EQ(unit.phase, expected[static_cast<size_t>(p)].second) << "position " << p;
      EXPECT_EQ(position_in_micro_batch(4, unit.shard, unit.phase), p);
    }
  }
}

TEST(UnitAt, OneShardIsOneForwardBackwardPerMicroBatch) {
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(unit_at(0, 1, i), (Unit{0, i, 0, Phase::kForwardBackward, i}));
  }
  EXPECT_EQ(total_units(spec(1, 4)), 4);
  EXPECT_EQ(total_units(spec(48, 8)), 8 * 95);
}

TEST(UnitAt, RejectsBadArguments) {
  EXPECT_THROW(unit_at(0, 0, 0), std::invalid_argument);
  EXPECT_THROW(unit_at(0, 2, -1), std::invalid_argument);
}

TEST(UnitAt, EvaluationPassesSitBetweenMicroBatches) {
  TaskSpec s = spec(2, 3);
  s.eval_after = {0, 2, 3};
  s.eval_batches = 2;
  // 3 micro-batches of F0 FB1 B0, passes of 2 batches of E0 E1 before the first, after the second and the third.
  const std::vector<std::tuple<int, Phase, int64_t>> expected = {
      {0, Phase::kEvaluate, 0}, {1, Phase::kEvaluate, 0}, {0, Phase::kEvaluate, 1}, {1, Phase::kEvaluate, 1},
      {0, Phase::kForward, 0},  {1, Phase::kForwardBackward, 0}, {0, Phase::kBackward, 0},
      {0, Phase::kForward, 1},  {1, Phase::kForwardBackward, 1}, {0, Phase::kBackward, 1},
      {0, Phase::kEvaluate, 0}, {1, Phase::kEvaluate, 0}, {0, Phase::kEvaluate, 1}, {1, Phase::kEvaluate, 1},
      {0, Phase::kForward, 2},  {1, Phase::kForwardBackward, 2}, {0, Phase::kBackward, 2},
      {0, Phase::kEvaluate, 0}, {1, Phase::kEvaluate, 0}, {0, Phase::kEvaluate, 1}, {1, Phase::kEvaluate, 1}};
  ASSERT_EQ(total_units(s), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < total_units(s); ++i) {
    const Unit unit = unit_at(7, s, i);
    const auto& [shard, phase, micro_batch] = expected[static_cast<size_t>(i)];
    EXPECT_EQ(unit, (Unit{7, i, shard, phase, micro_batch})) << "index " << i;
  }
  EXPECT_EQ(eval_passes_started(s, 0), 1);
  EXPECT_EQ(eval_passes_started(s, 9), 1);
  EXPECT_EQ(eval_passes_started(s, 10), 2);
  EXPECT_EQ(eval_passes_started(s, 20), 3);
}

TEST(UnitAt, WithoutEvaluationTheSpecFormMatchesTheShardCountForm) {
  const TaskSpec s = spec(4, 3);
  for (int64_t i = 0; i < total_units(s); ++i) EXPECT_EQ(unit_at(1, s, i), unit_at(1, 4, i));
}

TEST(SchedulerConstruction, RejectsBadInputWithClearMessages) {
  auto message = [](auto make) {
    try {
      make();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no exception");
  };
  EXPECT_NE(message([] { Scheduler({}, 1, PolicyKind::kLrtf); }).find("no tasks"), std::string::npos);
  EXPECT_NE(message([] { Scheduler({spec(2, 1)}, 0, PolicyKind::kLrtf); }).find("num_devices"), std::string::npos);
  EXPECT_NE(message([] { Scheduler({spec(2, 1), spec(0, 1)}, 1, PolicyKind::kLrtf); }).find("task 1: num_shards"),
            std::string::npos);
  EXPECT_NE(message([] { Scheduler({spec(2, -1)}, 1, PolicyKind::kLrtf); }).find("micro_batches"), std::string::npos);
  EXPECT_NE(message([] { Scheduler({spec(2, 1, 2)}, 2, PolicyKind::kLrtf); }).find("device 2 out of range"),
            std::string::npos);
  TaskSpec late = spec(2, 3);
  late.eval_after = {4};
  late.eval_batches = 1;
  EXPECT_NE(message([&] { Scheduler({spec(2, 1), late}, 1, PolicyKind::kLrtf); }).find("task 1: eval_after"),
            std::string::npos);
}

TEST(Scheduler, RunsEvaluationUnitsInTheirPlaceInTheChain) {
  TaskSpec s = spec(3, 2);
  s.eval_after = {1, 2};
  s.eval_batches = 1;
  Scheduler scheduler({s}, 1, PolicyKind::kLrtf);
  int64_t evaluations = 0;
  for (int64_t i = 0; i < total_units(s); ++i) {
    const auto unit = scheduler.next(0);
    ASSERT_TRUE(unit);
    EXPECT_EQ(*unit, unit_at(0, s, i));
    evaluations += unit->phase == Phase::kEvaluate;
    scheduler.complete(0, *unit, 0.001);
  }
  EXPECT_EQ(evaluations, 6);
  EXPECT_TRUE(scheduler.finished(0));
}

TEST(Scheduler, ATaskWithNoMicroBatchesIsFinishedFromTheStart) {
  Scheduler scheduler({spec(2, 0), spec(1, 1)}, 1, PolicyKind::kLrtf);
  EXPECT_TRUE(scheduler.finished(0));
  EXPECT_EQ(scheduler.remaining_units(0), 0);
  const auto unit = scheduler.next(0);
  ASSERT_TRUE(unit);
  EXPECT_EQ(unit->task, 1);
  scheduler.complete(0, *unit, 1e-3);
  EXPECT_FALSE(scheduler.next(0));
}

TEST(Scheduler, OneDeviceRunsEveryUnitInOrderThenStops) {
  Scheduler scheduler({spec(3, 2)}, 1, PolicyKind::kLrtf);
  for (int64_t i = 0; i < 10; ++i) {
    const auto unit = scheduler.next(0);
    ASSERT_TRUE(unit);
    EXPECT_EQ(*unit, unit_at(0, 3, i));
    EXPECT_EQ(scheduler.remaining_units(0), 10 - i);
    scheduler.complete(0, *unit, 0.001);
  }
  EXPECT_TRUE(scheduler.finished(0));
  EXPECT_EQ(scheduler.remaining_units(0), 0);
  EXPECT_EQ(scheduler.remaining_seconds(0), 0.0);
  EXPECT_FALSE(next_within(scheduler, 0));
}

TEST(Scheduler, CompleteRejectsAUnitThatIsNotRunningThere) {
  Scheduler scheduler({spec(2, 1), spec(2, 1)}, 2, PolicyKind::kLrtf);
  const auto unit = scheduler.next(0);
  ASSERT_TRUE(unit);
  EXPECT_THROW(scheduler.complete(1, *unit, 1.0), std::invalid_argument);
  Unit later = *unit;
  later.index += 1;
  EXPECT_THROW(scheduler.complete(0, later, 1.0), std::invalid_argument);
  EXPECT_THROW(scheduler.complete(0, *unit, -1.0), std::invalid_argument);
  scheduler.complete(0, *unit, 1.0);  // still running after the rejected reports
  EXPECT_THROW(scheduler.complete(0, *unit, 1.0), std::invalid_argument);
}

TEST(Scheduler, LrtfStartsWithTheTaskWithMostWork) {
  Scheduler scheduler({spec(2, 1), spec(4, 2), spec(3, 2)}, 1, PolicyKind::kLrtf);
  EXPECT_EQ(scheduler.next(0)->task, 1);
}

TEST(Scheduler, LrtfFollowsMeasuredTimes) {
  // Same shape; measurements decide. Task 0's unit takes 10 s: 2 x 10 s remain, while task 1 is estimated
  // from the global prior (10 s) at 3 units = 30 s. Once task 1 measures 1 s, task 0 is the longest.
  Scheduler scheduler({spec(1, 3), spec(1, 3)}, 1, PolicyKind::kLrtf);
  auto unit = scheduler.next(0);
  ASSERT_EQ(unit->task, 0);
  scheduler.complete(0, *unit, 10.0);
  EXPECT_DOUBLE_EQ(scheduler.remaining_seconds(0), 20.0);
  EXPECT_DOUBLE_EQ(scheduler.remaining_seconds(1), 30.0);
  unit = scheduler.next(0);
  ASSERT_EQ(unit->task, 1);
  scheduler.complete(0, *unit, 1.0);
  EXPECT_EQ(scheduler.next(0)->task, 0);
}

TEST(Scheduler, TasksOfABaseRunAShardBackToBack) {
  // Task 0 costs 5% more a unit: LRTF alone would run its next shard after its first; with a base, the
  // other tasks' first shard (the base shard just used) goes first, and the plan forecasts the same.
  for (const int base : {-1, 0}) {
    std::vector<TaskSpec> specs;
    for (int t = 0; t < 3; ++t) {
      TaskSpec s{2, 10, std::nullopt, {t == 0 ? 1.05 : 1.0, t == 0 ? 1.05 : 1.0}};
      s.base = base;
      specs.push_back(s);
    }
    Scheduler scheduler(specs, 1, PolicyKind::kLrtf);
    const auto first = scheduler.next(0);
    ASSERT_TRUE(first);
    EXPECT_EQ(first->task, 0);
    const std::vector<Unit> plan = scheduler.plan(0, 2);  // what follows the running unit
    scheduler.complete(0, *first, std::nullopt);
    const auto second = scheduler.next(0);
    ASSERT_TRUE(second && plan.size() == 2);
    EXPECT_EQ(plan[0], *second);
    if (base < 0) {
      EXPECT_EQ(second->task, 0);
      EXPECT_EQ(second->shard, 1);
    } else {
      EXPECT_EQ(second->task, 1);
      EXPECT_EQ(second->shard, 0);
      EXPECT_EQ(plan[1].task, 2);
      EXPECT_EQ(plan[1].shard, 0);
    }
  }
}

class PeekMatchesNext : public ::testing::TestWithParam<PolicyKind> {};

TEST_P(PeekMatchesNext, WhenNothingChangesInBetween) {
  Scheduler scheduler({spec(2, 2), spec(3, 1), spec(1, 4)}, 1, GetParam(), 11);
  for (;;) {
    const auto peeked = scheduler.peek(0);
    const auto unit = scheduler.next(0);
    EXPECT_EQ(peeked, unit);
    if (!unit) break;
    scheduler.complete(0, *unit, 0.01 * (unit->shard + 1));
  }
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, PeekMatchesNext,
                         ::testing::Values(PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin,
                                           PolicyKind::kRandom));

TEST(Scheduler, PlanIsTheSequenceNextGivesOneDevice) {
  // fifo reads no estimates, so what the run learns cannot change the order the plan foresaw.
  Scheduler scheduler({spec(2, 2), spec(3, 1), spec(1, 4)}, 1, PolicyKind::kFifo);
  const std::vector<Unit> planned = scheduler.plan(0, 100);
  EXPECT_EQ(planned.size(), 6u + 5u + 4u);
  EXPECT_EQ(scheduler.plan(0, 3), std::vector<Unit>(planned.begin(), planned.begin() + 3));
  std::vector<Unit> given;
  while (auto unit = scheduler.next(0)) {
    given.push_back(*unit);
    scheduler.complete(0, *unit, 0.01);
  }
  EXPECT_EQ(given, planned);
}

TEST(Scheduler, PlanDuringAUnitContinuesAfterIt) {
  Scheduler scheduler({spec(3, 1)}, 2, PolicyKind::kLrtf);
  const auto unit = scheduler.next(0);
  EXPECT_EQ(scheduler.plan(0, 10),
            (std::vector<Unit>{unit_at(0, 3, 1), unit_at(0, 3, 2), unit_at(0, 3, 3), unit_at(0, 3, 4)}));
  EXPECT_TRUE(scheduler.plan(1, 10).empty());  // running elsewhere
}

TEST(Scheduler, ADurationReportedAfterCompleteTeachesTheCostModel) {
  Scheduler scheduler({spec(2, 2), spec(2, 2)}, 1, PolicyKind::kLrtf);
  const auto unit = scheduler.next(0);
  scheduler.complete(0, *unit, std::nullopt);  // its end event not reached yet
  EXPECT_EQ(scheduler.remaining_units(unit->task), 5) << "the task moved on without a duration";
  const double before = scheduler.remaining_seconds(unit->task);
  scheduler.observe(*unit, 40.0);
  EXPECT_GT(scheduler.remaining_seconds(unit->task), before) << "a slow first unit makes the rest look slower";
  EXPECT_THROW(scheduler.observe(*unit, -1.0), std::invalid_argument);
  Unit stranger = *unit;
  stranger.task = 7;
  EXPECT_THROW(scheduler.observe(stranger, 1.0), std::invalid_argument);
}

TEST(Scheduler, PeekDuringAUnitSeesTheRunningTaskAsIfDone) {
  Scheduler scheduler({spec(3, 1)}, 2, PolicyKind::kLrtf);
  const auto unit = scheduler.next(0);
  EXPECT_EQ(scheduler.peek(0), unit_at(0, 3, 1));
  EXPECT_FALSE(scheduler.peek(1));  // running elsewhere: not device 1's to prefetch
}

TEST(Scheduler, WaitsWhileTheOnlyTaskRunsElsewhere) {
  Scheduler scheduler({spec(2, 1)}, 2, PolicyKind::kLrtf);
  const auto first = scheduler.next(0);
  auto waiting = std::async(std::launch::async, [&] { return scheduler.next(1); });
  EXPECT_EQ(waiting.wait_for(50ms), std::future_status::timeout);
  scheduler.complete(0, *first, 1.0);
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(waiting.get(), unit_at(0, 2, 1));
}

TEST(Scheduler, RestrictedTaskOnlyRunsOnItsDevice) {
  Scheduler scheduler({spec(2, 2, 1), spec(1, 1)}, 2, PolicyKind::kLrtf);
  auto unit = scheduler.next(0);
  ASSERT_EQ(unit->task, 1);  // task 0 is the longer, but it lives on device 1
  EXPECT_EQ(scheduler.peek(0), std::nullopt);
  scheduler.complete(0, *unit, 1.0);
  EXPECT_FALSE(next_within(scheduler, 0));  // only task 0 is left, and device 0 may never run it
  EXPECT_EQ(scheduler.next(1)->task, 0);
}

TEST(Scheduler, FailOfARunningTaskLetsItsUnitCompleteAndReleasesWaiters) {
  Scheduler scheduler({spec(2, 3), spec(1, 1, 0)}, 2, PolicyKind::kLrtf);
  const auto other = scheduler.next(0);  // task 0 (longest)
  ASSERT_EQ(other->task, 0);
  auto waiting = std::async(std::launch::async, [&] { return scheduler.next(1); });
  EXPECT_EQ(waiting.wait_for(50ms), std::future_status::timeout);
  scheduler.fail(0);  // running: its unit completes, nothing more is handed out
  EXPECT_EQ(scheduler.remaining_units(0), 0);
  EXPECT_FALSE(scheduler.finished(0));
  scheduler.complete(0, *other, 1.0);
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready);
  EXPECT_FALSE(waiting.get());
  EXPECT_TRUE(scheduler.finished(0));
  EXPECT_TRUE(scheduler.failed(0));
  EXPECT_EQ(scheduler.next(0)->task, 1);
}

TEST(Scheduler, FailOfAnIdleTaskIsImmediate) {
  Scheduler scheduler({spec(2, 3), spec(1, 1)}, 1, PolicyKind::kLrtf);
  scheduler.fail(0);
  EXPECT_TRUE(scheduler.finished(0));
  EXPECT_EQ(scheduler.remaining_seconds(0), 0.0);
  EXPECT_EQ(scheduler.next(0)->task, 1);
}

TEST(Scheduler, CancelReleasesEveryWaiterPromptly) {
  Scheduler scheduler({spec(2, 1)}, 3, PolicyKind::kLrtf);
  const auto running = scheduler.next(0);
  std::vector<std::future<std::optional<Unit>>> waiting;
  for (int d = 1; d < 3; ++d) waiting.push_back(std::async(std::launch::async, [&, d] { return scheduler.next(d); }));
  std::this_thread::sleep_for(20ms);
  scheduler.cancel();
  for (auto& pending : waiting) {
    ASSERT_EQ(pending.wait_for(5s), std::future_status::ready);
    EXPECT_FALSE(pending.get());
  }
  scheduler.complete(0, *running, 1.0);  // the running unit may still report
  EXPECT_FALSE(scheduler.next(0));
  EXPECT_FALSE(scheduler.peek(0));
}

}  // namespace
