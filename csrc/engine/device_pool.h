// A device's byte budget, enforced: every shard buffer on the device is a range of one arena tensor of at
// most `budget` bytes, so the bytes of resident weights, gradients and optimizer state can never exceed it.
//
// A released range is free at once, but remembered with the work that last touched it (a kernel, a copy)
// until that work is done: whoever is handed an overlapping range is also handed those fences, so a new
// buffer never overwrites memory something still reads, and on a stream the wait stays on the device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

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

// A region and the work its first user must be ordered after: the unfinished last users of the released
// ranges it overlaps.
struct Allocation {
  Region region;
  std::vector<Fence> after;
};

class DevicePool {
 public:
  DevicePool(c10::Device device, int64_t budget_bytes);

  // The arena is allocated on first use at min(budget, demand): memory a workload cannot use stays free.
  void set_demand(int64_t bytes);
  // Lowers the budget by `bytes` that the device must keep outside the arena; before the first allocation.
  void keep_outside(int64_t bytes);
  // Nothing when no free range is large enough.
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
  void ensure_arena();

  c10::Device device_;
  int64_t budget_;
  int64_t demand_;
  std::optional<core::ArenaAllocator> arena_;
  at::Tensor storage_;
  std::vector<std::pair<Region, Fence>> released_;  // released ranges whose last user may still run
};

}  // namespace hydra::engine
