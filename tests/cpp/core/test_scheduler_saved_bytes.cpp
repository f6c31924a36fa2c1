// Scheduler under a saved-activation allowance (core/saved_bytes_gate.h): a micro-batch starts on a device only
// while those in flight there leave room for it, units inside micro-batches always run, and the plan forecasts
// the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "core/policy.h"
#include "core/scheduler.h"
#include "core/unit.h"

namespace {

using namespace hydra::core;

std::vector<TaskSpec> tasks(int count, int shards = 3, int64_t micro_batches = 3) {
  return std::vector<TaskSpec>(static_cast<size_t>(count), TaskSpec{shards, micro_batches, std::nullopt});
}

// Runs every unit on device 0 in the scheduler's order; returns the most micro-batches in flight at once (and
// checks the known saved bytes in flight against `allowance` after every start).
int most_in_flight(Scheduler& scheduler, int64_t allowance = -1) {
  std::set<int> in_flight;
  size_t most = 0;
  while (auto unit = scheduler.try_next(0)) {
    if (starts_micro_batch(*unit)) in_flight.insert(unit->task);
    most = std::max(most, in_flight.size());
    if (allowance >= 0 && in_flight.size() > 1) EXPECT_LE(scheduler.saved_in_flight(0), allowance);
    scheduler.complete(0, *unit, 1.0);
    if (ends_micro_batch(*unit)) in_flight.erase(unit->task);
  }
  for (int t = 0; t < scheduler.num_tasks(); ++t) EXPECT_TRUE(scheduler.finished(t)) << "task " << t;
  return static_cast<int>(most);
}

TEST(SavedBytes, WithoutAnAllowanceLrtfKeepsEveryModelInFlight) {
  Scheduler scheduler(tasks(4), 1, PolicyKind::kLrtf);
  for (int t = 0; t < 4; ++t) scheduler.set_saved_bytes(t, 100);
  EXPECT_EQ(most_in_flight(scheduler), 4);
}

TEST(SavedBytes, AnAllowanceBoundsTheMicroBatchesInFlight) {
  for (const PolicyKind policy : {PolicyKind::kLrtf, PolicyKind::kRoundRobin, PolicyKind::kFifo}) {
    Scheduler scheduler(tasks(4), 1, policy);
    for (int t = 0; t < 4; ++t) scheduler.set_saved_bytes(t, 100);
    scheduler.set_saved_allowance(0, 250);
    EXPECT_LE(most_in_flight(scheduler, 250), 2) << policy_name(policy);
    EXPECT_EQ(scheduler.saved_in_flight(0), 0);
  }
}

TEST(SavedBytes, ATaskNotMeasuredYetStartsOnlyAlone) {
  Scheduler scheduler(tasks(3), 1, PolicyKind::kLrtf);
  scheduler.set_saved_allowance(0, 1000);
  EXPECT_EQ(most_in_flight(scheduler), 1);
}

TEST(SavedBytes, AMicroBatchLargerThanTheAllowanceStillRunsAlone) {
  Scheduler scheduler(tasks(2), 1, PolicyKind::kLrtf);
  for (int t = 0; t < 2; ++t) scheduler.set_saved_bytes(t, 500);
  scheduler.set_saved_allowance(0, 100);
  EXPECT_EQ(most_in_flight(scheduler), 1);
}

TEST(SavedBytes, AFailedOrRestartedTaskGivesItsBytesBack) {
  Scheduler scheduler(tasks(2), 1, PolicyKind::kFifo);
  for (int t = 0; t < 2; ++t) scheduler.set_saved_bytes(t, 100);
  scheduler.set_saved_allowance(0, 150);
  auto first = scheduler.try_next(0);
  ASSERT_TRUE(first && starts_micro_batch(*first));
  EXPECT_EQ(scheduler.saved_in_flight(0), 100);
  const int other = 1 - first->task;
  scheduler.complete(0, *first, 1.0);
  // The first task's micro-batch holds 100 of 150: the other cannot start beside it, the first goes on.
  auto second = scheduler.try_next(0);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->task, first->task);
  scheduler.restart(0, *second, TaskSpec{3, 3, std::nullopt});  // re-cut: its micro-batch starts over
  EXPECT_EQ(scheduler.saved_in_flight(0), 0);
  auto third = scheduler.try_next(0);
  ASSERT_TRUE(third && starts_micro_batch(*third));
  scheduler.fail(third->task);
  scheduler.complete(0, *third, 1.0);
  EXPECT_EQ(scheduler.saved_in_flight(0), 0);
  auto fourth = scheduler.try_next(0);
  ASSERT_TRUE(fourth);
  EXPECT_EQ(fourth->task, third->task == other ? 1 - other : other);
}

TEST(SavedBytes, ASecondDeviceIsHeldBackByWhatStartedOnIt) {
  // Micro-batches are charged to the device they start on: device 1 has its own room.
  Scheduler scheduler(tasks(3), 2, PolicyKind::kLrtf);
  for (int t = 0; t < 3; ++t) scheduler.set_saved_bytes(t, 100);
  for (int d = 0; d < 2; ++d) scheduler.set_saved_allowance(d, 100);
  auto a = scheduler.try_next(0);
  auto b = scheduler.try_next(1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(scheduler.saved_in_flight(0), 100);
  EXPECT_EQ(scheduler.saved_in_flight(1), 100);
  scheduler.complete(0, *a, 1.0);
  auto c = scheduler.try_next(0);  // the third task may not start here beside a's micro-batch: a goes on
  ASSERT_TRUE(c);
  EXPECT_EQ(c->task, a->task);
  EXPECT_FALSE(starts_micro_batch(*c));
}

TEST(SavedBytes, ThePlanForecastsTheAllowance) {
  Scheduler scheduler(tasks(4), 1, PolicyKind::kLrtf);
  for (int t = 0; t < 4; ++t) scheduler.set_saved_bytes(t, 100);
  scheduler.set_saved_allowance(0, 250);
  std::set<int> in_flight;
  size_t most = 0;
  for (const Unit& unit : scheduler.plan(0, 40)) {
    if (starts_micro_batch(unit)) in_flight.insert(unit.task);
    most = std::max(most, in_flight.size());
    if (ends_micro_batch(unit)) in_flight.erase(unit.task);
  }
  EXPECT_EQ(most, 2u);
}

TEST(SavedBytes, ThePlanCountsAMicroBatchMeasuredWhileInFlight) {
  // The first micro-batch starts unmeasured and is measured part way: the plan takes it off as unknown when it
  // ends, and the task's later micro-batches at their measured size.
  Scheduler scheduler(tasks(2, 2, 4), 1, PolicyKind::kLrtf);
  scheduler.set_saved_allowance(0, 250);
  scheduler.set_saved_bytes(1, 100);
  auto first = scheduler.try_next(0);
  ASSERT_TRUE(first && starts_micro_batch(*first) && first->task == 0);
  scheduler.complete(0, *first, 1.0);
  scheduler.set_saved_bytes(0, 100);
  std::set<int> in_flight = {0};
  size_t most = 0;
  for (const Unit& unit : scheduler.plan(0, 40)) {
    if (starts_micro_batch(unit)) in_flight.insert(unit.task);
    if (unit.micro_batch >= 2) most = std::max(most, in_flight.size());
    if (ends_micro_batch(unit)) in_flight.erase(unit.task);
  }
  EXPECT_EQ(most, 2u) << "both tasks' later micro-batches fit 250 bytes together";
}

TEST(SavedBytes, BadSizesAreRefused) {
  Scheduler scheduler(tasks(1), 1, PolicyKind::kLrtf);
  EXPECT_THROW(scheduler.set_saved_bytes(0, -1), std::invalid_argument);
  EXPECT_THROW(scheduler.set_saved_bytes(1, 10), std::invalid_argument);
  EXPECT_THROW(scheduler.set_saved_allowance(1, 10), std::invalid_argument);
}

}  // namespace
