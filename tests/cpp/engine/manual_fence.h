// A Fence a test finishes by hand, and waiting for one with a time limit: shared by the engine's tests.
#pragma once

#include <chrono>
#include <future>
#include <thread>

#include "engine/fence.h"

namespace hydra::engine::testing {

// A range released after it stays in use until finish().
struct ManualFence {
  std::promise<DeviceEvent> promise;
  Fence fence{promise.get_future().share()};
  void finish() { promise.set_value(nullptr); }
};

// Whether `fence` is done within `limit`: a test of something that must not block fails instead of hanging.
inline bool ready_within(const Fence& fence, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!fence.ready()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace hydra::engine::testing
