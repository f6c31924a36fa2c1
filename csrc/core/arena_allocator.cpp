#include "core/arena_allocator.h"

#include <stdexcept>
#include <string>

namespace hydra::core {

ArenaAllocator::ArenaAllocator(int64_t capacity, int64_t alignment) : alignment_(alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("ArenaAllocator: alignment must be a power of two, got " + std::to_string(alignment));
  if (capacity < 0) throw std::invalid_argument("ArenaAllocator: negative capacity");
  // A trailing partial unit could never be handed out whole; not counting it keeps in_use <= capacity exact.
  capacity_ = capacity & ~(alignment - 1);
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<int64_t> ArenaAllocator::allocate(int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("ArenaAllocator: negative size");
  const int64_t size = rounded(bytes == 0 ? 1 : bytes);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
  }
  if (best == free_.end()) return std::nullopt;
  const int64_t offset = best->first;
  const int64_t remaining = best->second - size;
  free_.erase(best);
  if (remaining > 0) free_.emplace(offset + size, remaining);
  used_.emplace(offset, size);
  in_use_ += size;
  if (in_use_ > high_water_) high_water_ = in_use_;
  return offset;
}

void ArenaAllocator::release(int64_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end())
    throw std::invalid_argument("ArenaAllocator: release of offset " + std::to_string(offset) + " that is not allocated");
  int64_t start = offset;
  int64_t size = it->second;
  used_.erase(it);
  in_use_ -= size;
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

int64_t ArenaAllocator::largest_free() const {
  int64_t largest = 0;
  for (const auto& [offset, size] : free_) largest = size > largest ? size : largest;
  return largest;
}

}  // namespace hydra::core
