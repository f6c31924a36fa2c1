// Host threads that run jobs in submission order: a job starts only after every job submitted before it has
// started, so with one thread jobs also finish in that order.
//
// A device's copy lanes are one-thread workers (their copies are issued in order); the host optimizer steps
// of every device share one worker with several threads, and order the jobs of one model among themselves
// with fences. A job may wait for work submitted before it, never after: that keeps every wait acyclic.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/fence.h"

namespace hydra::engine {

class HostWorker {
 public:
  // `on_start` runs first on each thread (say, to size the OpenMP team of the thread's jobs).
  explicit HostWorker(int threads = 1, std::function<void()> on_start = {});
  ~HostWorker();  // finishes the queued jobs, then joins
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // `job` returns the event its device work is ordered by, or null for host-only work. An `urgent` job goes
  // before every job still queued (something waits for it now); it must not wait for any of them.
  Fence submit(std::function<DeviceEvent()> job, bool urgent = false);
  // Blocks until every job submitted so far has run; rethrows nothing (each job's Fence carries its error).
  void drain();
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  struct Job {
    std::function<DeviceEvent()> run;
    std::promise<DeviceEvent> done;
  };
  // Not packaged_task: its future would own the job, and a Fence kept by what the job captures (a store
  // remembering its last step) would keep that alive forever. A promise's future holds only the result.
  std::deque<Job> queue_;
  int busy_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace hydra::engine
