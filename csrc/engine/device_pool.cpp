#include "engine/device_pool.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace hydra::engine {

namespace {
// Matches the CUDA caching allocator's granularity, so views are as aligned as ordinary tensors.
constexpr int64_t kAlignment = 512;
}  // namespace

DevicePool::DevicePool(c10::Device device, int64_t budget_bytes)
    : device_(device), budget_(budget_bytes), demand_(budget_bytes) {
  TORCH_CHECK(budget_bytes > 0, "DevicePool: the memory budget must be positive, got ", budget_bytes);
}

void DevicePool::set_demand(int64_t bytes) {
  TORCH_CHECK(!arena_, "DevicePool: demand must be set before the first allocation");
  demand_ = bytes;
}

void DevicePool::keep_outside(int64_t bytes) {
  TORCH_CHECK(!arena_, "DevicePool: bytes kept outside the arena must be set before the first allocation");
  TORCH_CHECK(bytes >= 0 && bytes < budget_, "DevicePool: cannot keep ", bytes, " of the budget's ", budget_,
              " bytes outside the arena");
  budget_ -= bytes;
}

void DevicePool::ensure_arena() {
  if (arena_) return;
  const int64_t capacity = std::min(budget_, demand_) / kAlignment * kAlignment;
  storage_ = at::empty({capacity}, at::TensorOptions().dtype(at::kByte).device(device_));
  arena_.emplace(capacity, kAlignment);
}

std::optional<Allocation> DevicePool::allocate(int64_t bytes) {
  ensure_arena();
  std::erase_if(released_, [](const auto& entry) { return entry.second.ready(); });
  // Memory nobody is still using first: reusing a range a copy is still reading would make the new user
  // wait for that copy.
  auto idle = [this](int64_t offset, int64_t size) {
    for (const auto& [region, fence] : released_)
      if (region.offset < offset + size && offset < region.offset + region.bytes) return false;
    return true;
  };
  // Besides the ends of each free range, the places just past and just before each such range: memory freed
  // out of order (gradient regions, from the ends of the free space) may leave only the middle idle.
  std::vector<int64_t> beside;
  for (const auto& [region, fence] : released_) {
    beside.push_back(region.offset + region.bytes);
    beside.push_back(region.offset - arena_->rounded(bytes));
  }
  std::optional<int64_t> offset = arena_->allocate(bytes, idle, beside);
  if (!offset) offset = arena_->allocate(bytes);
  if (!offset) return std::nullopt;
  Allocation allocation{Region{*offset, arena_->rounded(bytes)}, {}};
  const int64_t end = allocation.region.offset + allocation.region.bytes;
  for (const auto& [region, fence] : released_) {
    if (region.offset < end && allocation.region.offset < region.offset + region.bytes) allocation.after.push_back(fence);
  }
  return allocation;
}

void DevicePool::release(Region region, Fence after) {
  TORCH_CHECK(region.valid(), "DevicePool: release of an empty region");
  arena_->release(region.offset);
  released_.emplace_back(region, std::move(after));
}

at::Tensor DevicePool::view(const Region& region, at::ScalarType dtype, int64_t numel) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(bytes <= region.bytes, "DevicePool: a view of ", bytes, " bytes does not fit a region of ",
              region.bytes);
  return storage_.narrow(0, region.offset, bytes).view(dtype);
}

}  // namespace hydra::engine
