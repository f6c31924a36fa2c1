// A device's kept weight copies in the simulator (SimulationConfig::arena_bytes), as the engine's arena keeps
// them: a shard's weights, once copied in, serve its later visits until a step makes them stale or room for other
// copies evicts them, furthest next use along the device's plan first (core/eviction.h). Internal to csrc/core,
// beside simulator_steps.h.
#pragma once

#include <cstdint>
#include <vector>

#include "core/unit.h"

namespace hydra::core::simulated {

class WeightCache {
 public:
  struct Entry {
    int task;
    int shard;
    int64_t step;    // the weights are those after this many of the shard's steps
    double landed;   // when they are there to compute on
    int64_t bytes;
    uint64_t used;   // recency: the larger, the later
  };

  // The shard's copy as of `step`, now the most recently used, or null.
  const Entry* use(int task, int shard, int64_t step);
  // Keeps the shard's weights as of `step` from `landed` on, in place of any older copy of it.
  void put(int task, int shard, int64_t step, double landed, int64_t bytes);
  // A kept copy of the shard, whatever its step, is rewritten by a step on this device: it then holds `step`'s weights
  // from `landed` on. Nothing where none is kept.
  void rewrite(int task, int shard, int64_t step, double landed);
  // Evicts copies until all of them hold at most `capacity` bytes, never those of shards `pinned` (in use, or landing
  // for a planned unit): copies older than their shard's latest step (`current(task, shard)`) first, then the one
  // whose next use along `upcoming` lies furthest ahead, least recently used first among those never used there.
  // False where the pinned ones alone hold more.
  template <typename Current>
  bool trim(int64_t capacity, const std::vector<Unit>& pinned, const std::vector<Unit>& upcoming, Current current);
  // Bytes of the shard's copy (0: none kept).
  int64_t held(int task, int shard) const;

 private:
  // Evicts one copy not `pinned`, stale ones (`stale`, per entry) first; false where every copy is pinned.
  bool evict_one(const std::vector<Unit>& pinned, const std::vector<Unit>& upcoming, const std::vector<bool>& stale);
  int64_t bytes() const;

  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

template <typename Current>
bool WeightCache::trim(int64_t capacity, const std::vector<Unit>& pinned, const std::vector<Unit>& upcoming,
                       Current current) {
  while (bytes() > capacity) {
    std::vector<bool> stale;
    for (const Entry& entry : entries_) stale.push_back(entry.step < current(entry.task, entry.shard));
    if (!evict_one(pinned, upcoming, stale)) return false;
  }
  return true;
}

}  // namespace hydra::core::simulated
