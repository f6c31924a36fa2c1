#include "core/eviction.h"

#include <limits>
#include <unordered_map>

namespace hydra::core {

std::optional<int64_t> furthest_next_use(const std::vector<EvictionCandidate>& candidates,
                                         const std::deque<int64_t>& upcoming) {
  std::unordered_map<int64_t, int64_t> first_use;
  for (int64_t i = 0; i < static_cast<int64_t>(upcoming.size()); ++i) first_use.emplace(upcoming[i], i);
  std::optional<int64_t> victim;
  int64_t victim_distance = -1;
  for (const auto& candidate : candidates) {
    if (candidate.pinned) continue;
    auto it = first_use.find(candidate.key);
    const int64_t distance = it == first_use.end() ? std::numeric_limits<int64_t>::max() : it->second;
    if (distance > victim_distance) {
      victim = candidate.key;
      victim_distance = distance;
    }
  }
  return victim;
}

}  // namespace hydra::core
