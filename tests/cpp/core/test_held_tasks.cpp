// Scheduler::hold: a held task's units go to a device only when nothing else is ready for it.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "core/scheduler.h"

namespace {

using namespace hydra::core;

Scheduler two_tasks(PolicyKind policy = PolicyKind::kLrtf) {
  return Scheduler({TaskSpec{2, 2, std::nullopt}, TaskSpec{2, 2, std::nullopt}}, 1, policy);
}

TEST(HeldTask, WaitsWhileAnotherTaskIsReadyAndRunsWhenNoneIs) {
  for (PolicyKind policy : {PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom}) {
    Scheduler scheduler = two_tasks(policy);
    scheduler.hold(0, true);
    // Task 1 runs to its end while task 0 is held...
    for (int i = 0; i < 6; ++i) {
      const Unit unit = *scheduler.try_next(0);
      ASSERT_EQ(unit.task, 1) << "policy " << static_cast<int>(policy) << ", unit " << i;
      scheduler.complete(0, unit, 0.01);
    }
    // ...then, with nothing else left, the held task runs rather than the device idling.
    EXPECT_EQ(scheduler.try_next(0)->task, 0);
  }
}

TEST(HeldTask, ReleasedItIsChosenAsBefore) {
  Scheduler held = two_tasks(), never = two_tasks();
  held.hold(0, true);
  held.hold(0, false);
  for (int i = 0; i < 12; ++i) {
    const Unit a = *held.try_next(0), b = *never.try_next(0);
    ASSERT_EQ(a, b) << "unit " << i;
    held.complete(0, a, 0.01);
    never.complete(0, b, 0.01);
  }
}

TEST(HeldTask, ACommittedPlanWhoseHeadItIsLapses) {
  Scheduler scheduler = two_tasks();
  const std::vector<Unit> planned = scheduler.commit_plan(0, 4);
  ASSERT_FALSE(planned.empty());
  const int head = planned.front().task;
  scheduler.hold(head, true);
  EXPECT_NE(scheduler.try_next(0)->task, head);
}

TEST(HeldTask, PlansPutItAfterTheOthers) {
  Scheduler scheduler = two_tasks();
  scheduler.hold(1, true);
  const std::vector<Unit> planned = scheduler.plan(0, 9);  // each task has 6 units
  ASSERT_EQ(planned.size(), 9u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(planned[static_cast<size_t>(i)].task, 0) << "position " << i;
  for (int i = 6; i < 9; ++i) EXPECT_EQ(planned[static_cast<size_t>(i)].task, 1) << "position " << i;
}

TEST(HeldTask, AnUnknownTaskIsRefused) {
  Scheduler scheduler = two_tasks();
  EXPECT_THROW(scheduler.hold(2, true), std::invalid_argument);
}

}  // namespace
