// A device's byte budget, enforced: every shard buffer on the device is a range of one arena tensor of at
// most `budget` bytes, so the bytes of resident weights, gradients and optimizer state can never exceed it.
//
// Releasing a range is deferred until the work that last touched it (a kernel, a copy) is done, so a new
// buffer never overwrites memory something still reads. On CPU devices that work is already done.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <deque>
#include <optional>
#include <vector>

#include "core/arena_allocator.h"
#include "engine/fence.h"

namespace hydra::engine {

struct Region {
  int64_t offset = -1;
  int64_t bytes = 0;
  bool valid() const { return offset >= 0; }
};

// A region and the work its first user must be ordered after: the last users of the released ranges it
// reuses. On a stream that ordering is a device-side wait, so reusing memory never blocks the host.
struct Allocation {
  Region region;
  std::vector<Fence> after;
};

class DevicePool {
 public:
  DevicePool(c10::Device device, int64_t budget_bytes);

  // The arena is allocated on first use at min(budget, demand): memory a workload cannot use stays free.
  void set_demand(int64_t bytes);
  // Reuses finished releases first, then pending ones oldest first; nothing when even that is not enough.
  std::optional<Allocation> allocate(int64_t bytes);
  void release(Region region, Fence after);
  // A typed, contiguous view of `numel` elements at the start of `region`.
  at::Tensor view(const Region& region, at::ScalarType dtype, int64_t numel);

  c10::Device device() const { return device_; }
  int64_t budget() const { return budget_; }
  int64_t in_use() const { return arena_ ? arena_->in_use() : 0; }
  int64_t high_water() const { return arena_ ? arena_->high_water() : 0; }
  int64_t capacity() const { return arena_ ? arena_->capacity() : std::min(budget_, demand_); }
  bool started() const { return arena_.has_value(); }

 private:
  void reclaim_ready();
  void ensure_arena();

  c10::Device device_;
  int64_t budget_;
  int64_t demand_;
  std::optional<core::ArenaAllocator> arena_;
  at::Tensor storage_;
  std::deque<std::pair<Region, Fence>> pending_;
  // Fences of ranges released into the arena before their users finished; the next allocation, whatever
  // range it gets, is ordered after all of them (conservative, never wrong).
  std::vector<Fence> unordered_;
};

}  // namespace hydra::engine
