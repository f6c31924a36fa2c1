// Several worker threads hammer one Scheduler with random unit durations; the recorded trace must show
// every chain in order, each unit exactly once, never two units of a task at once, and pinned tasks only
// on their device. Meant to run under ThreadSanitizer as well (see benchmarks/RESULTS.md for the command).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "core/scheduler.h"

namespace {

using namespace hydra::core;
using Clock = std::chrono::steady_clock;

struct Record {
  int device;
  Unit unit;
  Clock::time_point start;
  Clock::time_point end;
};

std::vector<TaskSpec> stress_tasks() {
  std::vector<TaskSpec> tasks;
  std::mt19937 rng(3);
  for (int t = 0; t < 10; ++t) {
    const int shards = 1 + static_cast<int>(rng() % 5);
    const int64_t micro_batches = 2 + static_cast<int64_t>(rng() % 6);
    // Tasks 2 and 7 live on one device, as a task whose state cannot move would.
    const std::optional<int> device = t == 2 ? std::optional<int>(1) : t == 7 ? std::optional<int>(3) : std::nullopt;
    tasks.push_back(TaskSpec{shards, micro_batches, device});
  }
  return tasks;
}

std::vector<Record> hammer(Scheduler& scheduler, int num_devices) {
  std::mutex trace_mutex;
  std::vector<Record> trace;
  std::vector<std::thread> workers;
  for (int d = 0; d < num_devices; ++d) {
    workers.emplace_back([&, d] {
      std::mt19937 rng(100 + d);
      std::vector<Record> local;
      while (auto unit = scheduler.next(d)) {
        const auto start = Clock::now();
        if (rng() % 4 == 0) (void)scheduler.peek(d);
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
        const auto end = Clock::now();
        local.push_back(Record{d, *unit, start, end});
        scheduler.complete(d, *unit, std::chrono::duration<double>(end - start).count());
      }
      std::lock_guard lock(trace_mutex);
      trace.insert(trace.end(), local.begin(), local.end());
    });
  }
  for (auto& worker : workers) worker.join();
  return trace;
}

class SchedulerStress : public ::testing::TestWithParam<PolicyKind> {};

TEST_P(SchedulerStress, TraceRespectsEveryChain) {
  constexpr int kDevices = 4;
  const std::vector<TaskSpec> tasks = stress_tasks();
  Scheduler scheduler(tasks, kDevices, GetParam(), 5);
  const std::vector<Record> trace = hammer(scheduler, kDevices);

  int64_t expected_units = 0;
  for (const TaskSpec& task : tasks) expected_units += total_units(task);
  ASSERT_EQ(static_cast<int64_t>(trace.size()), expected_units);

  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) {
    std::vector<Record> chain;
    for (const Record& record : trace) {
      if (record.unit.task == t) chain.push_back(record);
    }
    std::sort(chain.begin(), chain.end(), [](const Record& a, const Record& b) { return a.start < b.start; });
    ASSERT_EQ(static_cast<int64_t>(chain.size()), total_units(tasks[static_cast<size_t>(t)]));
    for (size_t i = 0; i < chain.size(); ++i) {
      EXPECT_EQ(chain[i].unit, unit_at(t, tasks[static_cast<size_t>(t)].num_shards, static_cast<int64_t>(i)))
          << "task " << t << " ran out of order";
      if (i > 0) EXPECT_LE(chain[i - 1].end, chain[i].start) << "task " << t << " ran two units at once";
      if (const auto device = tasks[static_cast<size_t>(t)].device) EXPECT_EQ(chain[i].device, *device);
    }
    EXPECT_TRUE(scheduler.finished(t));
  }
  for (int d = 0; d < kDevices; ++d) EXPECT_FALSE(scheduler.has_work(d));
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, SchedulerStress,
                         ::testing::Values(PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin,
                                           PolicyKind::kRandom));

TEST(SchedulerStress, FailAndCancelUnderLoadNeverHang) {
  constexpr int kDevices = 4;
  std::vector<TaskSpec> tasks = stress_tasks();
  for (TaskSpec& task : tasks) task.micro_batches *= 50;  // long enough to be cut short
  Scheduler scheduler(tasks, kDevices, PolicyKind::kLrtf);
  std::thread saboteur([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int t = 0; t < 10; t += 2) scheduler.fail(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    scheduler.cancel();
  });
  const auto started = Clock::now();
  const std::vector<Record> trace = hammer(scheduler, kDevices);
  saboteur.join();
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(10));
  for (int t = 0; t < 10; t += 2) {
    EXPECT_EQ(scheduler.remaining_units(t), 0);
    EXPECT_TRUE(scheduler.finished(t));  // every worker completed its running unit before leaving
  }
  EXPECT_FALSE(trace.empty());
}

}  // namespace
