// A Fence a test finishes by hand, shared by the DevicePool and Fence tests.
#pragma once

#include <future>

#include "engine/fence.h"

namespace hydra::engine::testing {

// A range released after it stays in use until finish().
struct ManualFence {
  std::promise<DeviceEvent> promise;
  Fence fence{promise.get_future().share()};
  void finish() { promise.set_value(nullptr); }
};

}  // namespace hydra::engine::testing
