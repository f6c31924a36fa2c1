// Scheduler: tasks arriving while its workers run (an open scheduler), and a task restarted on a new chain after its
// unit ran out of device memory (also run under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/policy.h"
#include "core/scheduler.h"
#include "core/unit.h"
#include "scheduler_helpers.h"

namespace {

using namespace hydra::core;
using namespace hydra::core::scheduler_test;

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
