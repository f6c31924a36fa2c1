#include "core/simulator_cache.h"

#include <algorithm>
#include <limits>
#include <optional>

namespace hydra::core::simulated {

namespace {

bool names(const Unit& unit, const WeightCache::Entry& entry) {
  return unit.task == entry.task && unit.shard == entry.shard;
}

bool is_pinned(const std::vector<Unit>& pinned, const WeightCache::Entry& entry) {
  return std::any_of(pinned.begin(), pinned.end(), [&](const Unit& unit) { return names(unit, entry); });
}

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

int64_t WeightCache::unpinned_bytes(const std::vector<Unit>& pinned) const {
  int64_t total = 0;
  for (const Entry& entry : entries_)
    if (!is_pinned(pinned, entry)) total += entry.bytes;
  return total;
}

void WeightCache::evict_one(const std::vector<Unit>& pinned, const std::vector<Unit>& upcoming,
                            const std::vector<bool>& stale) {
  // Rank: stale first, then next use furthest ahead (never: furthest of all), then least recently used.
  auto next_use = [&](const Entry& entry) {
    for (size_t i = 0; i < upcoming.size(); ++i)
      if (names(upcoming[i], entry)) return i;
    return std::numeric_limits<size_t>::max();
  };
  std::optional<size_t> victim;
  auto worse = [&](size_t a, size_t b) {  // entry a is a better victim than entry b
    if (stale[a] != stale[b]) return static_cast<bool>(stale[a]);
    const size_t use_a = next_use(entries_[a]), use_b = next_use(entries_[b]);
    if (use_a != use_b) return use_a > use_b;
    return entries_[a].used < entries_[b].used;
  };
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_pinned(pinned, entries_[i])) continue;
    if (!victim || worse(i, *victim)) victim = i;
  }
  if (victim) entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(*victim));
}

}  // namespace hydra::core::simulated
