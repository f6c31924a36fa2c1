// HostWorker's chains: which queued job a free thread takes (one that can start before one that would wait, a wanted
// chain's first, the lowest rank, lower ranks let in by a running job), one job of a chain at a time, and jobs taken
// only once they can start (test_host_worker.cpp has the worker's basics).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/fence.h"
#include "engine/host_worker.h"
#include "manual_fence.h"

namespace {

using namespace hydra::engine;
using hydra::engine::testing::ManualFence;
using hydra::engine::testing::ready_within;

// Occupies one of the worker's threads with a job of `chain` until `hold` finishes; returns once it runs, so that
// the jobs queued next wait for a free thread together.
void hold_a_thread(HostWorker& worker, ManualFence& hold, int64_t chain) {
  std::promise<void> started;
  worker.submit_chained([&]() -> DeviceEvent {
    started.set_value();
    hold.fence.wait();
    return nullptr;
  }, chain, [] { return true; });
  started.get_future().wait();
}

// A job of one chain that would wait (its gradient has not landed) does not hold the only thread while a job of
// another chain could run.
TEST(HostWorker, AChainedJobThatCanStartGoesBeforeOneThatWouldWait) {
  HostWorker worker;
  ManualFence hold, landed;
  std::mutex mutex;
  std::vector<char> order;
  auto note = [&](char c) {
    std::lock_guard<std::mutex> lock(mutex);
    order.push_back(c);
  };
  hold_a_thread(worker, hold, 2);  // until both are queued
  worker.submit_chained([&]() -> DeviceEvent {
    landed.fence.wait();
    note('a');
    return nullptr;
  }, 0, [&] { return landed.fence.ready(); });
  Fence b = worker.submit_chained([&]() -> DeviceEvent {
    note('b');
    return nullptr;
  }, 1, [] { return true; });
  hold.finish();
  EXPECT_TRUE(ready_within(b, std::chrono::seconds(10))) << "b waited behind a";
  landed.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<char>{'b', 'a'}));
}

// Among the jobs that can start, those of a chain something waits for (a copy lane, for its step) go first; the
// others keep their turn.
TEST(HostWorker, AWantedChainsJobsGoFirst) {
  HostWorker worker;
  ManualFence hold;
  hold_a_thread(worker, hold, 9);
  std::vector<int> order;
  for (int chain : {0, 1, 0, 1})
    worker.submit_chained([&order, chain]() -> DeviceEvent {
      order.push_back(chain);
      return nullptr;
    }, chain, [] { return true; });
  worker.want(1);
  worker.want(5);  // nothing of it queued: nothing changes
  hold.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<int>{1, 1, 0, 0}));
  // Once none of it is queued, a chain is no longer wanted: its next jobs take their turn.
  order.clear();
  worker.submit_chained([&]() -> DeviceEvent {
    hold.fence.wait();  // done already: only keeps the order
    return nullptr;
  }, 9, [] { return true; });
  for (int chain : {0, 1}) worker.submit_chained([&order, chain]() -> DeviceEvent {
      order.push_back(chain);
      return nullptr;
    }, chain, [] { return true; });
  worker.drain();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

// Of a chain's jobs that can start, the lowest rank goes first (a model's next forward needs its lowest shard's
// step first, though that shard's gradient came last); the chain whose job was queued first keeps its turn.
TEST(HostWorker, AChainsJobOfLowestRankThatCanStartGoesFirst) {
  HostWorker worker;
  ManualFence hold;
  hold_a_thread(worker, hold, 9);
  std::vector<std::pair<int, int>> order;  // (chain, rank)
  for (auto [chain, rank] : std::vector<std::pair<int, int>>{{0, 4}, {1, 0}, {0, 3}, {0, 2}, {0, 3}})
    worker.submit_chained([&order, chain, rank]() -> DeviceEvent {
      order.emplace_back(chain, rank);
      return nullptr;
    }, chain, [] { return true; }, false, rank);
  hold.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<std::pair<int, int>>{{0, 2}, {0, 3}, {0, 3}, {0, 4}, {1, 0}}));
}

// A job that lets lower ranks run (between the parts of a step) runs its chain's jobs of lower rank that can start
// there, on its own thread (the worker has one), lowest first, and an error of one reaches that job's Fence only.
// Not a job of higher rank, of another chain, or one that cannot start; not at all in submission order, nor outside
// a job.
TEST(HostWorker, AJobLettingLowerRanksRunRunsItsChainsLowerRanksThatCanStart) {
  for (bool in_submission_order : {false, true}) {
    SCOPED_TRACE(in_submission_order ? "in submission order" : "chains");
    HostWorker worker(1, {}, in_submission_order);
    HostWorker::let_lower_ranks_run();  // outside a job: nothing to do
    ManualFence queued, never;
    std::mutex mutex;
    std::vector<std::string> order;
    auto note = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(what);
    };
    std::promise<void> began;
    const Fence outer = worker.submit_chained([&]() -> DeviceEvent {
      note("4 begins");
      began.set_value();
      queued.fence.wait();
      HostWorker::let_lower_ranks_run();
      note("4 ends");
      return nullptr;
    }, 0, [] { return true; }, false, 4);
    began.get_future().wait();
    auto job = [&](const std::string& name, bool fails = false) {
      return [&, name, fails]() -> DeviceEvent {
        note(name);
        if (fails) throw std::runtime_error("step " + name + " failed");
        return nullptr;
      };
    };
    worker.submit_chained(job("5"), 0, [] { return true; }, false, 5);
    worker.submit_chained(job("3 waits"), 0, [&] { return never.fence.ready(); }, false, 3);
    const Fence failing = worker.submit_chained(job("2", true), 0, [] { return true; }, false, 2);
    worker.submit_chained(job("other chain"), 1, [] { return true; }, false, 0);
    worker.submit_chained(job("1"), 0, [] { return true; }, false, 1);
    queued.finish();
    ASSERT_TRUE(ready_within(failing, std::chrono::seconds(10)));
    EXPECT_THROW(failing.wait(), std::runtime_error);
    worker.drain();  // "3 waits" never can start: taken last, where nothing else can
    never.finish();
    if (in_submission_order) {
      EXPECT_EQ(order, (std::vector<std::string>{"4 begins", "4 ends", "5", "3 waits", "2", "other chain", "1"}));
    } else {
      EXPECT_EQ(order, (std::vector<std::string>{"4 begins", "1", "2", "4 ends", "5", "other chain", "3 waits"}));
    }
    EXPECT_TRUE(outer.succeeded()) << "a lower rank's error reached the job that let it run";
  }
}

// `go_on` is asked, with its rank, of each job before it is let in (lowest first): here the lowest is, the next not,
// and that one runs after the job that let the first in.
TEST(HostWorker, GoOnIsAskedOfEachLowerRankBeforeItRuns) {
  HostWorker worker(1);
  ManualFence queued;
  std::mutex mutex;
  std::vector<std::string> order;
  std::vector<int64_t> asked;
  auto note = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    order.push_back(what);
  };
  std::promise<void> began;
  worker.submit_chained([&]() -> DeviceEvent {
    began.set_value();
    queued.fence.wait();
    HostWorker::let_lower_ranks_run([&](int64_t rank) {
      asked.push_back(rank);
      return rank == 1;
    });
    note("4 ends");
    return nullptr;
  }, 0, [] { return true; }, false, 4);
  began.get_future().wait();
  for (int rank : {2, 1})
    worker.submit_chained([&, rank]() -> DeviceEvent {
      note(std::to_string(rank));
      return nullptr;
    }, 0, [] { return true; }, false, rank);
  queued.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<std::string>{"1", "4 ends", "2"}));
  EXPECT_EQ(asked, (std::vector<int64_t>{1, 2}));
}

// One job of a chain runs at a time: a second thread takes another chain's job meanwhile, not the same chain's (in
// submission order too, where it waits for its turn instead).
TEST(HostWorker, OneJobOfAChainRunsAtATime) {
  for (bool in_submission_order : {false, true}) {
    HostWorker worker(2, {}, in_submission_order);
    ManualFence hold;
    hold_a_thread(worker, hold, 0);
    Fence same = worker.submit_chained([]() -> DeviceEvent { return nullptr; }, 0, [] { return true; });
    if (!in_submission_order) {
      Fence other = worker.submit_chained([]() -> DeviceEvent { return nullptr; }, 1, [] { return true; });
      EXPECT_TRUE(ready_within(other, std::chrono::seconds(10))) << "the free thread sat idle";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(same.ready()) << "two jobs of one chain ran at once, in submission order: " << in_submission_order;
    hold.finish();
    EXPECT_TRUE(ready_within(same, std::chrono::seconds(10))) << "the chain's next job was not taken once it could be";
    worker.drain();
  }
}

// Where no job can start, a thread takes the first queued one and waits in it, as in submission order; the queue
// drains once what it waits for is done.
TEST(HostWorker, WhereNoChainedJobCanStartTheFirstQueuedOneIsTaken) {
  HostWorker worker;
  ManualFence landed;
  std::vector<int> order;
  std::vector<Fence> fences;
  for (int chain = 0; chain < 3; ++chain)
    fences.push_back(worker.submit_chained([&, chain]() -> DeviceEvent {
      landed.fence.wait();
      order.push_back(chain);
      return nullptr;
    }, chain, [&] { return landed.fence.ready(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(fences[0].ready());
  landed.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

// A job that may only be taken once it can start is not taken before: the threads wait for a poke, and a later job
// that can start goes first.
TEST(HostWorker, AJobTakenOnlyOnceStartableWaitsForAPoke) {
  HostWorker worker;
  std::atomic<bool> can_start{false};
  std::vector<char> order;
  Fence a = worker.submit_chained([&]() -> DeviceEvent {
    order.push_back('a');
    return nullptr;
  }, 0, [&] { return can_start.load(); }, /*only_once_startable=*/true);
  Fence b = worker.submit_chained([&]() -> DeviceEvent {
    order.push_back('b');
    return nullptr;
  }, 1, [] { return true; }, true);
  EXPECT_TRUE(ready_within(b, std::chrono::seconds(10)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(a.ready()) << "taken before it could start";
  can_start = true;
  worker.poke();
  EXPECT_TRUE(ready_within(a, std::chrono::seconds(10)));
  EXPECT_EQ(order, (std::vector<char>{'b', 'a'}));
  EXPECT_THROW(worker.submit_chained([]() -> DeviceEvent { return nullptr; }, 0, {}), std::invalid_argument);
}

// drain() waits for a job taken only once it can start until a poke starts it.
TEST(HostWorker, DrainWaitsForAJobTakenOnlyOnceStartable) {
  HostWorker worker;
  std::atomic<bool> can_start{false}, ran{false};
  worker.submit_chained([&]() -> DeviceEvent {
    ran = true;
    return nullptr;
  }, 0, [&] { return can_start.load(); }, true);
  std::thread poker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    can_start = true;
    worker.poke();
  });
  worker.drain();
  poker.join();
  EXPECT_TRUE(ran);
}

// In submission order (what the chains' order is measured against), a chained job is a plain one: it waits in turn.
TEST(HostWorker, InSubmissionOrderChainedJobsRunInTurn) {
  HostWorker worker(1, {}, /*in_submission_order=*/true);
  EXPECT_TRUE(worker.in_submission_order());
  ManualFence landed;
  std::vector<char> order;
  worker.submit_chained([&]() -> DeviceEvent {
    landed.fence.wait();
    order.push_back('a');
    return nullptr;
  }, 0, [&] { return landed.fence.ready(); });
  Fence b = worker.submit_chained([&]() -> DeviceEvent {
    order.push_back('b');
    return nullptr;
  }, 1, [] { return true; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(b.ready()) << "b went before a";
  landed.finish();
  worker.drain();
  EXPECT_EQ(order, (std::vector<char>{'a', 'b'}));
  EXPECT_THROW(worker.submit_chained([]() -> DeviceEvent { return nullptr; }, -1, [] { return true; }),
               std::invalid_argument);
}

}  // namespace
