// An emulated host memory bandwidth, shared by every host-step thread of a run: a host job that touched
// `bytes` of host memory holds the host's memory lane for bytes / rate seconds, one job after another, and
// does not end before its time on the lane does. On a machine whose memory is faster than the one emulated, a
// CPU run's host steps then take the time they would take there (tests and benchmarks of the host lane, as the
// emulated link paces copies: CopyLane).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace hydra::engine {

class HostPace {
 public:
  using Clock = std::chrono::steady_clock;

  explicit HostPace(double bytes_per_second) : bytes_per_second_(bytes_per_second) {
    if (!std::isfinite(bytes_per_second) || bytes_per_second <= 0)
      throw std::invalid_argument("HostPace: bytes_per_second must be positive, got " +
                                  std::to_string(bytes_per_second));
  }

  // A job that began at `start` and touched `bytes`: waits until its turn on the lane, begun no earlier than
  // `start` and no earlier than the previous job's turn ended, has lasted bytes / rate.
  void pace(int64_t bytes, Clock::time_point start) {
    Clock::time_point end;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto turn = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_second_));
      end = std::max(start, free_at_) + turn;
      free_at_ = end;
    }
    std::this_thread::sleep_until(end);
  }

  double bytes_per_second() const { return bytes_per_second_; }

 private:
  const double bytes_per_second_;
  std::mutex mutex_;
  Clock::time_point free_at_{};
};

}  // namespace hydra::engine
