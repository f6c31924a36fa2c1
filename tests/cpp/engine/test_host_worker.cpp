// Fence and HostWorker: readiness, submission order, draining, errors through fences, shutdown, an urgent job
// (test_host_worker_chains.cpp: which of the chains' jobs a thread takes).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine/fence.h"
#include "engine/host_worker.h"
#include "manual_fence.h"

namespace {

using hydra::engine::DeviceEvent;
using hydra::engine::Fence;
using hydra::engine::HostWorker;
using hydra::engine::testing::ManualFence;
using hydra::engine::testing::ready_within;

TEST(Fence, DefaultAndNullEventFencesAreReady) {
  Fence done;
  EXPECT_TRUE(done.ready());
  EXPECT_NO_THROW(done.wait());
  Fence null_event{DeviceEvent{}};
  EXPECT_TRUE(null_event.ready());
  ManualFence pending;
  EXPECT_FALSE(pending.fence.ready());
  pending.finish();
  EXPECT_TRUE(pending.fence.ready());
}

TEST(HostWorker, RunsJobsInSubmissionOrder) {
  HostWorker worker;
  std::mutex mutex;
  std::vector<int> order;
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  // The first job holds the queue until everything is submitted, so the order is the queue's.
  worker.submit([open]() -> DeviceEvent {
    open.wait();
    return nullptr;
  });
  std::vector<Fence> fences;
  for (int i = 0; i < 200; ++i) {
    fences.push_back(worker.submit([i, &mutex, &order]() -> DeviceEvent {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(i);
      return nullptr;
    }));
  }
  EXPECT_FALSE(fences.back().ready());
  gate.set_value();
  worker.drain();
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
  for (const Fence& f : fences) EXPECT_TRUE(f.ready());
}

TEST(HostWorker, OnStartRunsOnEveryThreadBeforeAnyOfItsJobs) {
  std::mutex mutex;
  std::set<std::thread::id> started;
  HostWorker worker(3, [&] {
    std::lock_guard<std::mutex> lock(mutex);
    started.insert(std::this_thread::get_id());
  });
  std::vector<Fence> fences;
  std::atomic<int> unstarted{0};
  for (int i = 0; i < 50; ++i) {
    fences.push_back(worker.submit([&]() -> DeviceEvent {
      std::lock_guard<std::mutex> lock(mutex);
      if (!started.count(std::this_thread::get_id())) ++unstarted;
      return nullptr;
    }));
  }
  worker.drain();
  EXPECT_EQ(unstarted.load(), 0);
  std::lock_guard<std::mutex> lock(mutex);
  EXPECT_LE(started.size(), 3u);
}

TEST(HostWorker, DrainWaitsForRunningAndQueuedJobs) {
  HostWorker worker;
  std::atomic<int> done{0};
  for (int i = 0; i < 3; ++i) {
    worker.submit([&done]() -> DeviceEvent {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      done.fetch_add(1);
      return nullptr;
    });
  }
  worker.drain();
  EXPECT_EQ(done.load(), 3);
  worker.drain();  // idle: returns at once
  EXPECT_EQ(done.load(), 3);
}

TEST(HostWorker, JobExceptionSurfacesThroughItsFence) {
  HostWorker worker;
  Fence failed = worker.submit([]() -> DeviceEvent { throw std::runtime_error("copy failed: boom"); });
  std::atomic<bool> later_ran{false};
  Fence later = worker.submit([&later_ran]() -> DeviceEvent {
    later_ran = true;
    return nullptr;
  });
  worker.drain();  // rethrows nothing
  EXPECT_TRUE(failed.ready()) << "a failed job is finished";
  try {
    failed.wait();
    ADD_FAILURE() << "wait() must rethrow the job's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "copy failed: boom");
  }
  EXPECT_THROW(failed.wait(), std::runtime_error) << "every wait rethrows";
  EXPECT_TRUE(later_ran.load()) << "the worker survives a failing job";
  EXPECT_NO_THROW(later.wait());
}

TEST(HostWorker, DestructorFinishesQueuedJobs) {
  std::atomic<int> done{0};
  {
    HostWorker worker;
    for (int i = 0; i < 20; ++i)
      worker.submit([&done]() -> DeviceEvent {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        done.fetch_add(1);
        return nullptr;
      });
  }
  EXPECT_EQ(done.load(), 20);
}

TEST(HostWorker, SeveralThreadsRunJobsSideBySide) {
  HostWorker worker(2);
  EXPECT_EQ(worker.threads(), 2);
  std::promise<void> started;
  ManualFence gate;
  worker.submit([&]() -> DeviceEvent {
    started.set_value();
    gate.fence.wait();  // holds one thread, as a long optimizer step would
    return nullptr;
  });
  started.get_future().wait();
  Fence other = worker.submit([]() -> DeviceEvent { return nullptr; });
  const bool ran_beside = hydra::engine::testing::ready_within(other, std::chrono::seconds(10));
  gate.finish();
  worker.drain();
  EXPECT_TRUE(ran_beside) << "the second thread did not take the next job";
}

TEST(HostWorker, RejectsZeroThreads) { EXPECT_THROW(HostWorker(0), std::invalid_argument); }

TEST(HostWorker, AJobsCapturesGoOnceItRanThoughItsFenceIsKept) {
  HostWorker worker;
  auto captured = std::make_shared<int>(1);
  std::weak_ptr<int> watch = captured;
  Fence fence = worker.submit([captured = std::move(captured)]() -> DeviceEvent { return nullptr; });
  fence.wait();
  EXPECT_TRUE(watch.expired()) << "a kept Fence keeps its job's captures alive";
}

TEST(HostWorker, AnUrgentJobGoesBeforeTheQueuedOnes) {
  HostWorker worker;
  ManualFence gate;
  std::vector<int> order;
  worker.submit([&]() -> DeviceEvent {
    gate.fence.wait();
    return nullptr;
  });
  for (int i : {1, 2}) worker.submit([&order, i]() -> DeviceEvent {
    order.push_back(i);
    return nullptr;
  });
  worker.submit([&order]() -> DeviceEvent {
    order.push_back(0);
    return nullptr;
  }, /*urgent=*/true);
  gate.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2})) << "the running job finishes, then the urgent one";
}

}  // namespace

