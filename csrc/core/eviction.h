// Schedule-aware eviction: Belady's rule with the future known.
//
// The scheduler knows which shards run next, so when the device budget is full the best victim is the
// resident shard whose next use lies furthest ahead (or never comes). Torch-free.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace hydra::core {

// A shard copy on a device, named by an opaque key the engine chooses.
struct EvictionCandidate {
  int64_t key;
  bool pinned;  // in use or being copied: never a victim
};

// The unpinned candidate whose first occurrence in `upcoming` is furthest ahead; candidates that never
// occur win, and among those the first listed (the engine lists the least recently used first).
std::optional<int64_t> furthest_next_use(const std::vector<EvictionCandidate>& candidates,
                                         const std::deque<int64_t>& upcoming);

}  // namespace hydra::core
