#include "engine/copy_lane.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <thread>

namespace hydra::engine {

CopyLane::CopyLane(c10::Device device, double link_bytes_per_second)
    : device_(device), bytes_per_second_(device.is_cpu() ? link_bytes_per_second : 0.0) {
  TORCH_CHECK(link_bytes_per_second >= 0.0, "link bandwidth must be >= 0 bytes/s, got ", link_bytes_per_second);
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl guard(device.type());
    stream_ = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  }
}

CopyLane::~CopyLane() {
  thread_.drain();
  // Copies issued by jobs whose fences nobody waited for (a failed run) must finish before their memory goes.
  if (stream_) stream_->synchronize();
}

std::function<DeviceEvent()> CopyLane::ordered(std::vector<Fence> after, std::function<DeviceEvent()> job) {
  return [this, after = std::move(after), job = std::move(job)]() -> DeviceEvent {
    // On a CPU device events are null: ordering on any stream is waiting for the host part.
    for (const Fence& f : after) f.order_reuse_before(order_stream());
    if (!stream_) return job();
    c10::StreamGuard guard(*stream_);
    return job();
  };
}

Fence CopyLane::submit(std::vector<Fence> after, std::function<DeviceEvent()> job, bool urgent) {
  return thread_.submit(ordered(std::move(after), std::move(job)), urgent);
}

Fence CopyLane::submit_when(std::vector<Fence> after, std::function<DeviceEvent()> job, int64_t chain,
                           std::function<bool()> startable) {
  return thread_.submit_chained(ordered(std::move(after), std::move(job)), chain, std::move(startable),
                                /*only_once_startable=*/true);
}

DeviceEvent CopyLane::copy(const Copies& copies) {
  const auto start = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  for (const auto& [dst, src] : copies) {
    dst.copy_(src, /*non_blocking=*/stream_.has_value());
    bytes += dst.numel() * dst.element_size();
  }
  DeviceEvent event;
  if (stream_) {
    event = std::make_shared<c10::Event>(device_.type());
    event->record(*stream_);
  } else if (bytes_per_second_ > 0.0) {
    std::this_thread::sleep_until(start + std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_second_));
  }
  busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return event;
}

DeviceEvent CopyLane::run(const std::function<void()>& work) {
  const auto start = std::chrono::steady_clock::now();
  work();
  DeviceEvent event;
  if (stream_) {
    event = std::make_shared<c10::Event>(device_.type());
    event->record(*stream_);
  }
  busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return event;
}

}  // namespace hydra::engine
