// Completion of asynchronous engine work, whichever side runs it.
//
// Work is issued by a host thread (the device's worker) and may then continue on the device (a copy on a
// side stream). A Fence is the host part as a future whose value is the device part's event, null when the
// work was host-only (CPU devices): waiting on it waits for both, in that order.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

namespace hydra::engine {

using DeviceEvent = std::shared_ptr<c10::Event>;

class Fence {
 public:
  Fence() : Fence(DeviceEvent{}) {}
  explicit Fence(std::shared_future<DeviceEvent> issued) : issued_(std::move(issued)) {}
  // Already issued: device work ordered by `event` (null: nothing left to wait for).
  explicit Fence(DeviceEvent event) {
    std::promise<DeviceEvent> promise;
    promise.set_value(std::move(event));
    issued_ = promise.get_future().share();
  }

  // Never throws: work that failed is finished too, and its error surfaces through wait().
  bool ready() const {
    if (issued_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    try {
      const DeviceEvent& event = issued_.get();
      return !event || event->query();
    } catch (...) {
      return true;
    }
  }
  // Finished without an error.
  bool succeeded() const {
    if (!ready()) return false;
    try {
      issued_.get();
      return true;
    } catch (...) {
      return false;
    }
  }
  // Blocks the calling thread until the work is done; rethrows the issuing job's exception. The device part is
  // polled, the thread sleeping between polls (10 us, doubling to at most 100 us): a synchronising wait
  // (cudaEventSynchronize) spins a core meanwhile, and the host-step threads that wait for gradients would
  // take the cores and memory bandwidth the host steps need.
  void wait() const {
    const DeviceEvent& event = issued_.get();
    if (!event) return;
    for (std::chrono::microseconds pause{10}; !event->query(); pause = std::min(2 * pause, kLongestPause))
      std::this_thread::sleep_for(pause);
  }
  // Blocks until the work is done, whether or not it succeeded: its error is reported through its own fence.
  void wait_done() const {
    try {
      wait();
    } catch (...) {
    }
  }
  // Orders `stream` after the work without blocking the host on the device part; rethrows likewise.
  void order_before(const c10::Stream& stream) const {
    const DeviceEvent& event = issued_.get();
    if (event) event->block(stream);
  }
  // For memory reuse, where only the end of the work matters, not whether it succeeded: a failed job's
  // error is reported through its own fence, not by whoever next uses the memory it touched.
  void order_reuse_before(const c10::Stream& stream) const {
    issued_.wait();
    try {
      order_before(stream);
    } catch (...) {
    }
  }

 private:
  static constexpr std::chrono::microseconds kLongestPause{100};
  std::shared_future<DeviceEvent> issued_;
};

// Whether every one of `fences` is done (nothing waiting for them would block).
inline bool all_ready(const std::vector<Fence>& fences) {
  return std::all_of(fences.begin(), fences.end(), [](const Fence& f) { return f.ready(); });
}

}  // namespace hydra::engine
