// Offset allocator over one fixed-size arena: the device byte budget made concrete.
//
// Every device buffer the engine uses is a range of one arena of `capacity` bytes, so the budget holds
// by construction (nothing is allocated outside it) and fragmentation is visible rather than hidden in a
// caching allocator. Torch-free; the engine maps offsets to views of a device tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

namespace hydra::core {

class ArenaAllocator {
 public:
  // `alignment` must be a power of two; every offset and size is rounded up to it.
  explicit ArenaAllocator(int64_t capacity, int64_t alignment = 256);

  // Best fit: the smallest free range that holds `bytes`, so large holes survive for large shards.
  // Returns the offset, or nothing when no free range is large enough.
  std::optional<int64_t> allocate(int64_t bytes);
  // Best fit among the places `acceptable(offset, size)` admits, trying the start and the end of each free
  // range, and each of `also_try` that lies in one with room for the request: the engine uses it to avoid memory
  // whose last user (a copy) has not finished yet, trying the places just before and past such memory too.
  std::optional<int64_t> allocate(int64_t bytes, const std::function<bool(int64_t, int64_t)>& acceptable,
                                  const std::vector<int64_t>& also_try = {});
  // Returns a range to the free list, merging it with its free neighbours.
  void release(int64_t offset);

  int64_t capacity() const { return capacity_; }
  int64_t in_use() const { return in_use_; }
  int64_t high_water() const { return high_water_; }
  int64_t largest_free() const;
  int64_t rounded(int64_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }

 private:
  int64_t capacity_;
  int64_t alignment_;
  int64_t in_use_ = 0;
  int64_t high_water_ = 0;
  std::map<int64_t, int64_t> free_;  // offset -> size, ordered so neighbours are found by lookup
  std::map<int64_t, int64_t> used_;  // offset -> size
};

}  // namespace hydra::core
