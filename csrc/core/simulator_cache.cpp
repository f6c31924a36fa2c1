#include "core/simulator_cache.h"

#include <algorithm>
#include <deque>
#include <numeric>

#include "core/eviction.h"

namespace hydra::core::simulated {

namespace {

bool is_pinned(const std::vector<Unit>& pinned, const WeightCache::Entry& entry) {
  return std::any_of(pinned.begin(), pinned.end(),
                     [&](const Unit& unit) { return unit.task == entry.task && unit.shard == entry.shard; });
}

int64_t key(int task, int shard) { return (int64_t{task} << 32) | static_cast<uint32_t>(shard); }

}  // namespace

const WeightCache::Entry* WeightCache::use(int task, int shard, int64_t step) {
  for (Entry& entry : entries_)
    if (entry.task == task && entry.shard == shard && entry.step == step) {
      entry.used = ++clock_;
      return &entry;
    }
  return nullptr;
}

void WeightCache::put(int task, int shard, int64_t step, double landed, int64_t bytes) {
  std::erase_if(entries_, [&](const Entry& entry) { return entry.task == task && entry.shard == shard; });
  entries_.push_back(Entry{task, shard, step, landed, bytes, ++clock_});
}

void WeightCache::rewrite(int task, int shard, int64_t step, double landed) {
  for (Entry& entry : entries_)
    if (entry.task == task && entry.shard == shard) {
      entry.step = step;
      entry.landed = landed;
      entry.used = ++clock_;
    }
}

int64_t WeightCache::held(int task, int shard) const {
  for (const Entry& entry : entries_)
    if (entry.task == task && entry.shard == shard) return entry.bytes;
  return 0;
}

int64_t WeightCache::bytes() const {
  int64_t total = 0;
  for (const Entry& entry : entries_) total += entry.bytes;
  return total;
}

bool WeightCache::evict_one(const std::vector<Unit>& pinned, const std::vector<Unit>& upcoming,
                            const std::vector<bool>& stale) {
  // The engine's rule (core/eviction.h) over the stale copies, else over all: the candidates least recently used
  // first, which it takes first among those never used along the plan.
  std::vector<size_t> by_use(entries_.size());
  std::iota(by_use.begin(), by_use.end(), size_t{0});
  std::sort(by_use.begin(), by_use.end(), [&](size_t a, size_t b) { return entries_[a].used < entries_[b].used; });
  std::deque<int64_t> next;
  for (const Unit& unit : upcoming) next.push_back(key(unit.task, unit.shard));
  for (bool only_stale : {true, false}) {
    std::vector<EvictionCandidate> candidates;
    for (size_t i : by_use)
      if (!only_stale || stale[i])
        candidates.push_back({key(entries_[i].task, entries_[i].shard), is_pinned(pinned, entries_[i])});
    if (const std::optional<int64_t> victim = furthest_next_use(candidates, next)) {
      std::erase_if(entries_, [&](const Entry& entry) { return key(entry.task, entry.shard) == *victim; });
      return true;
    }
  }
  return false;
}

}  // namespace hydra::core::simulated
