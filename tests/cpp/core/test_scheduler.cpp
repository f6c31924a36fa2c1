// Scheduler: unit mapping, policies, blocking/fail/cancel semantics, device restriction, and a
// multi-threaded stress test whose trace must respect every chain's order (also run under TSan).
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

namespace {

using namespace hydra::core;
using namespace std::chrono_literals;

TaskSpec spec(int shards, int64_t micro_batches, std::optional<int> device = std::nullopt) {
  return TaskSpec{shards, micro_batches, device};
}

// Runs next(device) on another thread; fails the test instead of hanging if it does not return in time.
std::optional<Unit> next_within(Scheduler& scheduler, int device, std::chrono::milliseconds limit = 5000ms) {
  auto pending = std::async(std::launch::async, [&] { return scheduler.next(device); });
  if (pending.wait_for(limit) != std::future_status::ready) {
    scheduler.cancel();  // release the worker so the test can end
    ADD_FAILURE() << "next(" << device << ") did not return within " << limit.count() << " ms";
  }
  return pending.get();
}

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

TEST(ParsePolicy, KnowsEveryNameAndListsThemOnError) {
  for (auto kind : {PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom}) {
    EXPECT_EQ(parse_policy(policy_name(kind)), kind);
  }
  try {
    parse_policy("shortest");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    for (const char* name : {"shortest", "lrtf", "fifo", "round_robin", "random"}) {
      EXPECT_NE(message.find(name), std::string::npos) << message;
    }
  }
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

TEST(Policy, LrtfPrefersTheResidentTaskOnlyWithinOnePercent) {
  const Policy policy(PolicyKind::kLrtf, 3, 1, 0);
  const std::vector<Candidate> near = {{0, 100.0, 0, false}, {1, 99.5, 0, true}, {2, 50.0, 0, false}};
  EXPECT_EQ(near[policy.choose(0, near)].task, 1);
  const std::vector<Candidate> far = {{0, 100.0, 0, false}, {1, 98.0, 0, true}};
  EXPECT_EQ(far[policy.choose(0, far)].task, 0);
  const std::vector<Candidate> tie = {{2, 7.0, 0, false}, {1, 7.0, 0, false}, {0, 3.0, 0, false}};
  EXPECT_EQ(tie[policy.choose(0, tie)].task, 1);
}

TEST(Policy, LrtfRunsATaskReadingTheCachedBaseShardWithinFivePercentFirst) {
  const Policy policy(PolicyKind::kLrtf, 4, 1, 0);
  // The base's reader wins over the best, and over the task that ran here last, within 5%.
  const std::vector<Candidate> near = {
      {0, 100.0, 0, true, false}, {1, 96.0, 0, false, true}, {2, 97.0, 0, false, true}, {3, 99.9, 0, false, false}};
  EXPECT_EQ(near[policy.choose(0, near)].task, 2);
  const std::vector<Candidate> far = {{0, 100.0, 0, false, false}, {1, 94.0, 0, false, true}};
  EXPECT_EQ(far[policy.choose(0, far)].task, 0);
  const Policy fifo(PolicyKind::kFifo, 2, 1, 0);  // only LRTF knows it
  const std::vector<Candidate> ready = {{0, 100.0, 0, false, false}, {1, 100.0, 1, false, true}};
  EXPECT_EQ(ready[fifo.choose(0, ready)].task, 0);
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

TEST(Policy, FifoTakesTheEarliestReadyThenTheResidentTask) {
  const Policy policy(PolicyKind::kFifo, 3, 1, 0);
  const std::vector<Candidate> waiting = {{0, 9.0, 5, true}, {1, 1.0, 2, false}, {2, 1.0, 3, false}};
  EXPECT_EQ(waiting[policy.choose(0, waiting)].task, 1);
  const std::vector<Candidate> tie = {{0, 0.0, 1, false}, {2, 0.0, 1, true}};
  EXPECT_EQ(tie[policy.choose(0, tie)].task, 2);
}

TEST(Policy, RoundRobinCyclesPerDevice) {
  Policy policy(PolicyKind::kRoundRobin, 4, 2, 0);
  const std::vector<Candidate> all = {{0, 0, 0, false}, {1, 0, 0, false}, {2, 0, 0, false}, {3, 0, 0, false}};
  std::vector<int> picked;
  for (int i = 0; i < 5; ++i) {
    const int task = all[policy.choose(0, all)].task;
    policy.commit(0, task);
    picked.push_back(task);
  }
  EXPECT_EQ(picked, (std::vector<int>{0, 1, 2, 3, 0}));
  EXPECT_EQ(all[policy.choose(1, all)].task, 0);  // device 1 has its own position
  const std::vector<Candidate> some = {{0, 0, 0, false}, {3, 0, 0, false}};
  EXPECT_EQ(some[policy.choose(0, some)].task, 3);  // after 0 comes 1, 2 (absent), then 3
}

TEST(Policy, RandomIsDeterministicGivenTheSeedAndChooseHasNoSideEffects) {
  const std::vector<Candidate> all = {{0, 0, 0, false}, {1, 0, 0, false}, {2, 0, 0, false}, {3, 0, 0, false}};
  auto sequence = [&](uint64_t seed) {
    Policy policy(PolicyKind::kRandom, 4, 1, seed);
    std::vector<int> picked;
    for (int i = 0; i < 32; ++i) {
      const size_t first = policy.choose(0, all);
      EXPECT_EQ(policy.choose(0, all), first);
      policy.commit(0, all[first].task);
      picked.push_back(all[first].task);
    }
    return picked;
  };
  EXPECT_EQ(sequence(7), sequence(7));
  EXPECT_NE(sequence(7), sequence(8));
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

namespace {

TEST(SchedulerArrivals, AnOpenSchedulerWaitsForArrivingTasksAndEndsWhenClosed) {
  Scheduler scheduler({spec(1, 1)}, 1, PolicyKind::kLrtf);
  scheduler.set_open(true);
  auto first = scheduler.next(0);
  ASSERT_TRUE(first);
  scheduler.complete(0, *first, 1e-3);
  EXPECT_TRUE(scheduler.has_work(0));  // open: more may come
  auto waiting = std::async(std::launch::async, [&] { return scheduler.next(0); });
  EXPECT_EQ(waiting.wait_for(50ms), std::future_status::timeout);
  EXPECT_EQ(scheduler.add_task(spec(2, 1)), 1);
  ASSERT_EQ(waiting.wait_for(5000ms), std::future_status::ready);
  EXPECT_EQ(waiting.get(), unit_at(1, 2, 0));
  auto rest = std::async(std::launch::async, [&] {
    std::vector<Unit> units;
    while (auto unit = scheduler.next(0)) {
      units.push_back(*unit);
      scheduler.complete(0, *unit, 1e-3);
    }
    return units;
  });
  scheduler.complete(0, unit_at(1, 2, 0), 1e-3);
  std::this_thread::sleep_for(20ms);
  scheduler.set_open(false);
  ASSERT_EQ(rest.wait_for(5000ms), std::future_status::ready);
  EXPECT_EQ(rest.get(), (std::vector<Unit>{unit_at(1, 2, 1), unit_at(1, 2, 2)}));
  EXPECT_TRUE(scheduler.finished(1));
  EXPECT_FALSE(scheduler.has_work(0));
}

TEST(SchedulerArrivals, AnArrivingTaskIsValidatedAndJoinsThePolicy) {
  Scheduler scheduler({spec(1, 2), spec(1, 2)}, 2, PolicyKind::kRoundRobin);
  EXPECT_THROW(scheduler.add_task(spec(0, 1)), std::invalid_argument);
  EXPECT_THROW(scheduler.add_task(spec(1, 1, 2)), std::invalid_argument);
  TaskSpec bad_costs = spec(2, 1);
  bad_costs.shard_costs = {1.0};
  EXPECT_THROW(scheduler.add_task(bad_costs), std::invalid_argument);
  EXPECT_EQ(scheduler.num_tasks(), 2);  // nothing was added by the refused ones
  EXPECT_EQ(scheduler.add_task(spec(1, 2)), 2);
  std::vector<int> order;
  for (int i = 0; i < 6; ++i) {
    auto unit = scheduler.next(0);
    ASSERT_TRUE(unit);
    order.push_back(unit->task);
    scheduler.complete(0, *unit, 1e-3);
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 0, 1, 2}));  // round robin over the newcomer too
  EXPECT_EQ(scheduler.add_task(spec(1, 0)), 3);             // an arrival with nothing to do is done at once
  EXPECT_TRUE(scheduler.finished(3));
}

TEST(SchedulerArrivals, TasksArrivingWhileWorkersRunAreAllRunInOrder) {
  constexpr int kDevices = 3, kArrivals = 12;
  Scheduler scheduler({spec(2, 3)}, kDevices, PolicyKind::kLrtf);
  scheduler.set_open(true);
  std::mutex trace_mutex;
  std::vector<std::vector<int64_t>> seen(1 + kArrivals);
  std::vector<std::thread> workers;
  for (int d = 0; d < kDevices; ++d) {
    workers.emplace_back([&, d] {
      while (auto unit = scheduler.next(d)) {
        {
          std::lock_guard lock(trace_mutex);
          seen[static_cast<size_t>(unit->task)].push_back(unit->index);
        }
        scheduler.complete(d, *unit, 1e-4);
      }
    });
  }
  for (int i = 0; i < kArrivals; ++i) {
    scheduler.add_task(spec(1 + i % 3, 2));
    std::this_thread::sleep_for(1ms);
  }
  scheduler.set_open(false);
  for (auto& worker : workers) worker.join();
  for (int t = 0; t < 1 + kArrivals; ++t) {
    const auto& indices = seen[static_cast<size_t>(t)];
    const TaskSpec arrived = t == 0 ? spec(2, 3) : spec(1 + (t - 1) % 3, 2);
    ASSERT_EQ(static_cast<int64_t>(indices.size()), total_units(arrived)) << "task " << t;
    for (size_t i = 0; i < indices.size(); ++i) EXPECT_EQ(indices[i], static_cast<int64_t>(i)) << "task " << t;
    EXPECT_TRUE(scheduler.finished(t));
  }
}

}  // namespace

namespace {

// A task whose unit ran out of device memory is re-cut into more shards and retried from its step boundary.
TEST(SchedulerRestart, AFailedUnitRestartsItsTaskOnANewChain) {
  Scheduler scheduler({spec(2, 3, 0), spec(1, 2)}, 2, PolicyKind::kLrtf);
  auto first = scheduler.next(0);
  ASSERT_TRUE(first);
  ASSERT_EQ(first->task, 0);  // the longer task goes first
  scheduler.complete(0, *first, 1e-3);
  auto failing = scheduler.next(0);
  ASSERT_TRUE(failing);
  ASSERT_EQ(failing->task, 0);
  const TaskSpec finer = spec(4, 2);  // spilled now: any device
  scheduler.restart(0, *failing, finer);
  EXPECT_THROW(scheduler.complete(0, *failing, 1e-3), std::invalid_argument);  // it ended with the restart
  EXPECT_EQ(scheduler.remaining_units(0), total_units(finer));
  std::vector<Unit> seen;
  for (int device : {1, 0}) {  // no longer pinned to device 0
    while (auto unit = scheduler.try_next(device)) {
      if (unit->task == 0) seen.push_back(*unit);
      scheduler.complete(device, *unit, 1e-3);
    }
  }
  ASSERT_EQ(static_cast<int64_t>(seen.size()), total_units(finer));
  for (int64_t i = 0; i < total_units(finer); ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], unit_at(0, finer, i));
  EXPECT_TRUE(scheduler.finished(0));
  // Estimates follow the new chain's shards: shard 3 exists now.
  EXPECT_GT(scheduler.estimate(unit_at(0, finer, 3)), 0.0);
}

TEST(SchedulerRestart, ARefusedRestartChangesNothing) {
  Scheduler scheduler({spec(2, 2)}, 1, PolicyKind::kFifo);
  auto unit = scheduler.next(0);
  ASSERT_TRUE(unit);
  EXPECT_THROW(scheduler.restart(0, unit_at(0, 2, 1), spec(2, 1)), std::invalid_argument);  // not the running unit
  EXPECT_THROW(scheduler.restart(0, *unit, spec(0, 1)), std::invalid_argument);             // no shards
  EXPECT_THROW(scheduler.restart(0, *unit, spec(2, 1, 3)), std::invalid_argument);          // no such device
  scheduler.complete(0, *unit, 1e-3);  // still running, as before
  EXPECT_EQ(scheduler.remaining_units(0), total_units(spec(2, 2)) - 1);
}

TEST(SchedulerRestart, ATaskFailedWhileItsUnitRanEndsInsteadOfRestarting) {
  Scheduler scheduler({spec(2, 2)}, 1, PolicyKind::kLrtf);
  auto unit = scheduler.next(0);
  ASSERT_TRUE(unit);
  scheduler.fail(0);
  scheduler.restart(0, *unit, spec(3, 2));
  EXPECT_TRUE(scheduler.finished(0));
  EXPECT_FALSE(scheduler.has_work(0));
  EXPECT_FALSE(scheduler.try_next(0));
}

}  // namespace
