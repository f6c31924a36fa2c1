// One direction of a device's host link: host to device, or device to host. (Also the device's step lane: the
// optimizer steps of device-stepped shards, which wait for their state's copy without holding up the compute.)
//
// A lane's copies are issued by its own thread, in submission order, so no copy waits behind host arithmetic
// it does not depend on (an optimizer step of another shard or model). The one exception is a copy that says
// when it can start (submit_when: a gradient that needs a free landing buffer of its model's): it is not taken
// before it can, and meanwhile the thread takes a later such copy that can, so one model's slow host steps do not
// hold up another's copies. On a GPU they run on the lane's own stream: two lanes make the link full duplex. On a
// CPU device the lane's thread performs them itself and, with a link bandwidth set, each copy takes at least
// bytes / bandwidth seconds, as it would over PCIe: a CPU run then takes the GPU's asynchronous path with a GPU's
// copy times (for tests and benchmarks).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "engine/fence.h"
#include "engine/host_worker.h"

namespace hydra::engine {

class CopyLane {
 public:
  using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (destination, source)

  // `link_bytes_per_second` paces a CPU device's copies; 0 copies at memory speed. Ignored on a GPU.
  CopyLane(c10::Device device, double link_bytes_per_second);
  ~CopyLane();  // waits for every copy issued

  // Runs `job` on the lane's thread once the host part of each of `after` is done, with the lane's stream
  // ordered after their device parts (on the device, not the thread). `after` orders reuse of memory: a
  // failed job there delays the copy but is reported through its own fence.
  // An `urgent` copy (the compute is about to wait for it) goes before the prefetches still queued.
  Fence submit(std::vector<Fence> after, std::function<DeviceEvent()> job, bool urgent = false);
  // As submit, for a job of `chain` (a model) taken only once `startable` (asked without blocking, under the
  // lane's lock) says it can start (its `after` waited for as submit's are: pass work already issued); it may go
  // before a queued one that cannot (HostWorker's chained jobs, `only_once_startable`), never before a plain job
  // queued before it. Whatever makes `startable` true must poke() the lane.
  Fence submit_when(std::vector<Fence> after, std::function<DeviceEvent()> job, int64_t chain,
                    std::function<bool()> startable);
  // Something a queued job's `startable` reads may have changed (HostWorker::poke).
  void poke() { thread_.poke(); }
  // Inside a job: issues the copies and returns the event that marks their end (null on a CPU device, where
  // they are done on return).
  DeviceEvent copy(const Copies& copies);
  // Inside a job: issues `work` (device kernels) on the lane's stream and returns the event that marks its end.
  DeviceEvent run(const std::function<void()>& work);
  // What a job orders itself after: the lane's stream, or on a CPU device the default one (waiting for the host).
  c10::Stream order_stream() const { return stream_ ? *stream_ : c10::Stream(c10::Stream::DEFAULT, device_); }
  const std::optional<c10::Stream>& stream() const { return stream_; }
  // Time the lane's thread spent copying, pacing included (on a GPU: issuing).
  double busy_seconds() const { return static_cast<double>(busy_ns_.load()) * 1e-9; }
  void drain() { thread_.drain(); }

 private:
  // `job` on the lane's stream (where it has one), after the host part of each of `after`.
  std::function<DeviceEvent()> ordered(std::vector<Fence> after, std::function<DeviceEvent()> job);

  c10::Device device_;
  std::optional<c10::Stream> stream_;
  double bytes_per_second_;
  std::atomic<int64_t> busy_ns_{0};
  HostWorker thread_;  // last member: destroyed first, so no job outlives what it captures
};

}  // namespace hydra::engine
