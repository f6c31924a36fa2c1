#include "core/arena_allocator.h"

#include <iterator>

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
  return allocate(bytes, [](int64_t, int64_t) { return true; });
}

std::optional<int64_t> ArenaAllocator::allocate(int64_t bytes, const std::function<bool(int64_t, int64_t)>& acceptable,
                                                const std::vector<int64_t>& also_try) {
  if (bytes < 0) throw std::invalid_argument("ArenaAllocator: negative size");
  const int64_t size = rounded(bytes == 0 ? 1 : bytes);
  // Best fit among acceptable places: the start or the end of each free range that is large enough, or one of
  // `also_try` inside it.
  std::optional<int64_t> offset;
  int64_t best_range = 0;
  std::vector<int64_t> candidates;
  for (const auto& [start, range] : free_) {
    if (range < size || (offset && range >= best_range)) continue;
    candidates = {start, start + range - size};
    for (int64_t place : also_try)
      if (place > start && place + size < start + range && place % alignment_ == 0) candidates.push_back(place);
    for (int64_t candidate : candidates) {
      if (acceptable(candidate, size)) {
        offset = candidate;
        best_range = range;
        break;
      }
    }
  }
  if (!offset) return std::nullopt;
  auto range = std::prev(free_.upper_bound(*offset));
  const int64_t start = range->first, end = range->first + range->second;
  free_.erase(range);
  if (*offset > start) free_.emplace(start, *offset - start);
  if (*offset + size < end) free_.emplace(*offset + size, end - *offset - size);
  used_.emplace(*offset, size);
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
