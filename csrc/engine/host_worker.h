// One host thread per device that issues copies and runs host-side optimizer steps, in submission order.
//
// FIFO order is what keeps the engine simple: a shard's optimizer step and the next copy of that shard to a
// device are submitted in that order, so the copy always reads the updated weights.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "engine/fence.h"

namespace hydra::engine {

class HostWorker {
 public:
  HostWorker();
  ~HostWorker();  // finishes the queued jobs, then joins
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // `job` returns the event its device work is ordered by, or null for host-only work.
  Fence submit(std::function<DeviceEvent()> job);
  // Blocks until every job submitted so far has run; rethrows nothing (each job's Fence carries its error).
  void drain();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::packaged_task<DeviceEvent()>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace hydra::engine
