// What the scheduler tests share: a task's spec, and a worker's next unit that fails the test instead of hanging.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <optional>

#include "core/scheduler.h"
#include "core/unit.h"

namespace hydra::core::scheduler_test {

using namespace std::chrono_literals;

inline TaskSpec spec(int shards, int64_t micro_batches, std::optional<int> device = std::nullopt) {
  return TaskSpec{shards, micro_batches, device};
}

// Runs next(device) on another thread; fails the test instead of hanging if it does not return in time.
inline std::optional<Unit> next_within(Scheduler& scheduler, int device, std::chrono::milliseconds limit = 5000ms) {
  auto pending = std::async(std::launch::async, [&] { return scheduler.next(device); });
  if (pending.wait_for(limit) != std::future_status::ready) {
    scheduler.cancel();  // release the worker so the test can end
    ADD_FAILURE() << "next(" << device << ") did not return within " << limit.count() << " ms";
  }
  return pending.get();
}

}  // namespace hydra::core::scheduler_test
