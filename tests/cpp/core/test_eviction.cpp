// furthest_next_use: Belady's eviction rule over the scheduler's known future.
#include <gtest/gtest.h>

#include <deque>
#include <vector>

#include "core/eviction.h"

namespace {

using hydra::core::EvictionCandidate;
using hydra::core::furthest_next_use;

TEST(Eviction, PicksTheCandidateUsedFurthestAhead) {
  const std::vector<EvictionCandidate> candidates = {{1, false}, {2, false}, {3, false}};
  EXPECT_EQ(furthest_next_use(candidates, {1, 2, 3}), 3);
  EXPECT_EQ(furthest_next_use(candidates, {3, 2, 1}), 1);
  EXPECT_EQ(furthest_next_use(candidates, {2, 3, 1, 2}), 1);
  EXPECT_EQ(furthest_next_use(candidates, {9, 3, 9, 1, 9, 9, 2}), 2);
}

TEST(Eviction, OnlyTheFirstOccurrenceCounts) {
  // 1 is used again at the very end, but its next use is position 0: 2 (next at 1) is further.
  const std::vector<EvictionCandidate> candidates = {{1, false}, {2, false}};
  EXPECT_EQ(furthest_next_use(candidates, {1, 2, 1, 1, 1}), 2);
  EXPECT_EQ(furthest_next_use(candidates, {2, 1, 2, 2}), 1);
}

TEST(Eviction, NeverUsedBeatsUsed) {
  const std::vector<EvictionCandidate> candidates = {{1, false}, {2, false}, {3, false}};
  EXPECT_EQ(furthest_next_use(candidates, {1, 3}), 2);
  EXPECT_EQ(furthest_next_use(candidates, {3, 1, 5, 6, 7, 8}), 2);
  // Nothing upcoming at all: every candidate is never used, so the first listed goes.
  EXPECT_EQ(furthest_next_use(candidates, {}), 1);
}

TEST(Eviction, PinnedIsNeverChosen) {
  // 3 is never used again but is pinned; of the others, 1 is used last.
  const std::vector<EvictionCandidate> candidates = {{1, false}, {2, false}, {3, true}};
  EXPECT_EQ(furthest_next_use(candidates, {2, 1}), 1);
  EXPECT_EQ(furthest_next_use({{1, true}, {2, false}, {3, true}}, {2, 1, 3}), 2);
}

TEST(Eviction, NothingEligibleReturnsNullopt) {
  EXPECT_FALSE(furthest_next_use({}, {1, 2, 3}).has_value());
  EXPECT_FALSE(furthest_next_use({}, {}).has_value());
  EXPECT_FALSE(furthest_next_use({{1, true}, {2, true}}, {1, 2}).has_value());
  EXPECT_FALSE(furthest_next_use({{1, true}}, {}).has_value());
}

TEST(Eviction, TiesGoToTheFirstListed) {
  // Several never-used candidates tie: the engine lists the least recently used first.
  EXPECT_EQ(furthest_next_use({{4, false}, {5, false}, {6, false}}, {6}), 4);
  EXPECT_EQ(furthest_next_use({{5, false}, {4, false}, {6, false}}, {6}), 5);
  EXPECT_EQ(furthest_next_use({{6, true}, {5, false}, {4, false}}, {1}), 5);
  // A single candidate that is used soon is still a valid victim when it is the only one.
  EXPECT_EQ(furthest_next_use({{7, false}}, {7, 8}), 7);
}

TEST(Eviction, KeysAreOpaque64BitValues) {
  const int64_t a = (int64_t{3} << 32) | 1, b = (int64_t{1} << 32) | 3;
  EXPECT_EQ(furthest_next_use({{a, false}, {b, false}}, {a, b}), b);
  EXPECT_EQ(furthest_next_use({{a, false}, {b, false}}, {b, a}), a);
  EXPECT_EQ(furthest_next_use({{-1, false}, {0, false}}, {-1}), 0);
}

}  // namespace
