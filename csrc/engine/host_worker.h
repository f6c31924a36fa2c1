// Host threads that run jobs. Plain jobs run in submission order: a job starts only after every job submitted
// before it has started, so with one thread jobs also finish in that order.
//
// A device's copy lanes are one-thread workers of plain jobs (their copies are issued in order). The host
// optimizer steps of every device share one worker with several threads, whose jobs come in *chains* (one model's
// host jobs, ordered among themselves by fences, one at a time) and say whether they can start without waiting: a
// free thread takes the first job that can, one of a chain something waits for (`want`) first, so that a thread does
// not sit in one job's wait while another job could run, and then, of that job's chain, the one of lowest rank that
// can start (the shard the model's next forward needs first); where none can start, the first queued job, which may
// wait, unless a job of its chain runs. A job may wait for work submitted before it, never after. A job taken out
// of turn waits for nothing; one that may wait is the first queued, taken after every job submitted before it:
// every wait stays acyclic, as in submission order. A chained job may instead be one that never waits
// (`only_once_startable`, a copy lane's gradient copy that needs a free landing buffer): where it is the first
// queued and none can start, the threads wait until poke() says that something may have become startable. A running
// chained job may also let its chain's jobs of lower rank that can start run within it, on its thread, between the
// parts of its work (let_lower_ranks_run).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "engine/fence.h"

namespace hydra::engine {

class HostWorker {
 public:
  // `on_start` runs first on each thread (say, to size the OpenMP team of the thread's jobs).
  // `in_submission_order`: every job is taken as a plain one, in turn (what the chains' order is measured against).
  explicit HostWorker(int threads = 1, std::function<void()> on_start = {}, bool in_submission_order = false);
  ~HostWorker();  // finishes the queued jobs, then joins
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // `job` returns the event its device work is ordered by, or null for host-only work. An `urgent` job goes
  // before every job still queued (something waits for it now); it must not wait for any of them.
  Fence submit(std::function<DeviceEvent()> job, bool urgent = false);
  // A job of `chain` (>= 0): `startable` says, without blocking and under the worker's lock, whether everything the
  // job waits for is done. No thread takes it out of turn while another job of its chain runs; of a chain's jobs
  // that can start, the lowest `rank` goes first (ties: in submission order). A worker `in_submission_order` runs it
  // as a plain job, in turn, still one of its chain at a time. With `only_once_startable` no thread takes it before
  // `startable` says so; then whatever makes it startable must poke() the worker.
  Fence submit_chained(std::function<DeviceEvent()> job, int64_t chain, std::function<bool()> startable,
                       bool only_once_startable = false, int64_t rank = 0);
  // Something a queued job's `startable` reads may have changed: the idle threads look again. Never call it
  // holding a lock that `startable` takes.
  void poke();
  // Something waits for `chain`'s queued jobs now (a copy of the weights its steps rewrite): they go first among
  // those that can start, until none of the chain is queued.
  void want(int64_t chain);
  // Called by a running job between parts of its work (a host step, chunk by chunk): the jobs of its chain of lower
  // rank that can start now run first, on this thread, lowest rank first, while the job waits where it stands; so a
  // model's step that its next forward needs first is not held behind a longer one of a later shard that began
  // before its gradient landed. Each only where `go_on(rank)`, asked of the lowest-ranked one before it runs, says
  // so (where given). A no-op outside a chained job, and in a worker `in_submission_order`.
  static void let_lower_ranks_run(const std::function<bool(int64_t rank)>& go_on = {});
  // Blocks until every job submitted so far has run; rethrows nothing (each job's Fence carries its error).
  void drain();
  int threads() const { return static_cast<int>(threads_.size()); }
  bool in_submission_order() const { return in_submission_order_; }

 private:
  struct Job {
    std::function<DeviceEvent()> run;
    std::promise<DeviceEvent> done;
    bool urgent = false;
    int64_t chain = -1;               // -1: a plain job of none
    std::function<bool()> startable;  // a chained job's
    bool only_once_startable = false;
    int64_t rank = 0;                 // among its chain's jobs that can start, the lowest goes first
  };
  // Runs `job`, taken off the queue, on this thread, and fulfils its Fence with its event or its error.
  void run_job(Job& job);
  // The queued job of `chain` below `rank` that can start now, lowest rank first, or end().
  std::deque<Job>::iterator lower_rank_job(int64_t chain, int64_t rank);
  // A job taken off the queue: its chain stops being wanted once none of it is queued.
  void taken(const Job& job);
  // Whether a free thread may take `job` now, out of turn: chained, none of its chain running, and startable.
  bool can_take(const Job& job) const;
  Fence enqueue(Job job);
  void run();
  // The queued job a free thread takes now (the queue is not empty), or end() where it must wait for a poke().
  std::deque<Job>::iterator next_job();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  // Not packaged_task: its future would own the job, and a Fence kept by what the job captures (a store
  // remembering its last step) would keep that alive forever. A promise's future holds only the result.
  std::deque<Job> queue_;
  std::set<int64_t> wanted_;  // chains with a queued job that something waits for
  std::set<int64_t> running_;  // chains with a job running
  int busy_ = 0;
  bool stopping_ = false;
  bool in_submission_order_;
  std::vector<std::thread> threads_;
};

}  // namespace hydra::engine
