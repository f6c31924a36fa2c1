// partition: the exact optimum (smallest bottleneck, then fewest shards) checked against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/partitioner.h"

namespace {

using hydra::core::min_budget_bytes;
using hydra::core::partition;
using hydra::core::PieceCost;
using hydra::core::Plan;
using hydra::core::shard_need_bytes;

struct Best {
  bool found = false;
  double bottleneck = 0.0;
  int shards = 0;
};

std::vector<int> ends_of(const std::vector<int>& starts, int n) {
  std::vector<int> ends(starts.begin() + 1, starts.end());
  ends.push_back(n);
  return ends;
}

// Every contiguous partition, each judged by the rule itself: prefetch = the plan's largest shard weights.
// Times are whole numbers, so sums are exact and compare with ==.
Best brute_force(const std::vector<PieceCost>& pieces, int64_t budget, int max_shards) {
  const int n = static_cast<int>(pieces.size());
  Best best;
  for (unsigned mask = 0; mask < (1u << (n - 1)); ++mask) {
    std::vector<int> starts = {0};
    for (int i = 1; i < n; ++i) {
      if (mask & (1u << (i - 1))) starts.push_back(i);
    }
    const int shards = static_cast<int>(starts.size());
    if (max_shards > 0 && shards > max_shards) continue;
    const std::vector<int> ends = ends_of(starts, n);
    std::vector<int64_t> w(shards, 0), a(shards, 0);
    double bottleneck = 0.0;
    for (int s = 0; s < shards; ++s) {
      double t = 0.0;
      for (int i = starts[s]; i < ends[s]; ++i) {
        w[s] += pieces[i].weight_bytes;
        a[s] = std::max(a[s], pieces[i].activation_bytes);
        t += pieces[i].seconds;
      }
      bottleneck = std::max(bottleneck, t);
    }
    const int64_t prefetch = *std::max_element(w.begin(), w.end());
    bool fits = true;
    for (int s = 0; s < shards; ++s) fits = fits && shard_need_bytes(w[s], a[s], prefetch) <= budget;
    if (!fits) continue;
    if (!best.found || bottleneck < best.bottleneck || (bottleneck == best.bottleneck && shards < best.shards)) {
      best = {true, bottleneck, shards};
    }
  }
  return best;
}

void expect_consistent(const std::vector<PieceCost>& pieces, int64_t budget, const Plan& plan) {
  const int n = static_cast<int>(pieces.size());
  ASSERT_FALSE(plan.starts.empty());
  EXPECT_EQ(plan.starts.front(), 0);
  const std::vector<int> ends = ends_of(plan.starts, n);
  int64_t prefetch = 0;
  for (size_t s = 0; s < plan.starts.size(); ++s) {
    ASSERT_LT(plan.starts[s], ends[s]);
    int64_t w = 0, a = 0;
    for (int i = plan.starts[s]; i < ends[s]; ++i) w += pieces[i].weight_bytes, a = std::max(a, pieces[i].activation_bytes);
    EXPECT_EQ(plan.shard_weight_bytes[s], w);
    EXPECT_EQ(plan.shard_activation_bytes[s], a);
    prefetch = std::max(prefetch, w);
  }
  EXPECT_EQ(plan.prefetch_bytes, prefetch);
  for (size_t s = 0; s < plan.starts.size(); ++s) {
    EXPECT_EQ(plan.shard_bytes[s], shard_need_bytes(plan.shard_weight_bytes[s], plan.shard_activation_bytes[s], prefetch));
    EXPECT_LE(plan.shard_bytes[s], budget) << "shard " << s << " breaks the budget";
  }
  EXPECT_EQ(plan.bottleneck_seconds, *std::max_element(plan.shard_seconds.begin(), plan.shard_seconds.end()));
  EXPECT_LE(plan.ideal_seconds, plan.bottleneck_seconds);
}

TEST(Partitioner, MatchesBruteForceOnRandomInstances) {
  std::mt19937 rng(7);
  int checked_limited = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    std::vector<PieceCost> pieces(n);
    for (PieceCost& p : pieces) {
      p.weight_bytes = static_cast<int64_t>(rng() % 1000);
      p.activation_bytes = static_cast<int64_t>(rng() % 2000);
      p.seconds = static_cast<double>(1 + rng() % 20);
    }
    const int64_t minimum = min_budget_bytes(pieces);
    const int64_t budget = minimum + static_cast<int64_t>(rng() % static_cast<unsigned>(minimum));
    const int max_shards = (rng() % 2) ? 0 : 1 + static_cast<int>(rng() % n);
    const Best best = brute_force(pieces, budget, max_shards);
    if (!best.found) {
      EXPECT_THROW(partition(pieces, budget, max_shards), std::invalid_argument);
      continue;
    }
    const Plan plan = partition(pieces, budget, max_shards);
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_consistent(pieces, budget, plan);
    EXPECT_EQ(plan.bottleneck_seconds, best.bottleneck);
    EXPECT_EQ(static_cast<int>(plan.starts.size()), best.shards);
    if (max_shards > 0) {
      EXPECT_LE(static_cast<int>(plan.starts.size()), max_shards);
      ++checked_limited;
    }
  }
  EXPECT_GT(checked_limited, 100);
}

TEST(Partitioner, ErrorGivesTheSmallestBudgetThatWorks) {
  const std::vector<PieceCost> pieces = {{100, 10, 1.0}, {400, 50, 1.0}, {200, 900, 1.0}};
  // Heaviest piece 400 is the prefetch; the worst single need is max(2*400+50, 2*200+900) + 400 + slack.
  const int64_t minimum = 2 * 200 + 900 + 400 + hydra::core::kShardSlackBytes;
  EXPECT_EQ(min_budget_bytes(pieces), minimum);
  try {
    partition(pieces, minimum - 1);
    FAIL() << "a budget one byte short must be refused";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(std::to_string(minimum)), std::string::npos) << error.what();
  }
  const Plan plan = partition(pieces, minimum);
  EXPECT_EQ(plan.starts, (std::vector<int>{0, 1, 2}));
}

TEST(Partitioner, PrefersFewerShardsOnTies) {
  // The slowest piece (4 s) sets the bottleneck; 1+1+2 and 4 reach it in two shards rather than four.
  const std::vector<PieceCost> pieces = {{10, 0, 1.0}, {10, 0, 1.0}, {10, 0, 2.0}, {10, 0, 4.0}};
  const Plan plan = partition(pieces, 1 << 20);
  EXPECT_EQ(plan.starts, (std::vector<int>{0, 3}));
  EXPECT_EQ(plan.bottleneck_seconds, 4.0);
  EXPECT_EQ(plan.ideal_seconds, 4.0);
}

TEST(Partitioner, MemoryForcesMoreShardsThanTimeWould) {
  // One shard of all four would do with max_shards = 1; the budget holds at most two pieces' weights.
  const std::vector<PieceCost> pieces(4, PieceCost{1000, 0, 1.0});
  const int64_t budget = shard_need_bytes(2000, 0, 2000);
  try {
    partition(pieces, budget, 1);
    FAIL() << "one shard of 4000 bytes cannot fit";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("at least 2 shards"), std::string::npos) << error.what();
  }
  const Plan plan = partition(pieces, budget, 3);
  EXPECT_EQ(plan.starts, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.bottleneck_seconds, 2.0);
  EXPECT_EQ(partition(pieces, shard_need_bytes(4000, 0, 4000), 1).starts, (std::vector<int>{0}));
}

TEST(Partitioner, MaxShardsBalancesTime) {
  const std::vector<PieceCost> pieces = {{1, 0, 3.0}, {1, 0, 1.0}, {1, 0, 1.0}, {1, 0, 1.0}, {1, 0, 2.0}};
  const Plan plan = partition(pieces, 1 << 20, 2);
  EXPECT_EQ(plan.bottleneck_seconds, 4.0);  // {3, 1} {1, 1, 2}
  EXPECT_EQ(plan.starts, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.ideal_seconds, 4.0);
}

TEST(Partitioner, RejectsBadInput) {
  EXPECT_THROW(partition({}, 100), std::invalid_argument);
  EXPECT_THROW(partition({{1, 1, 1.0}}, 0), std::invalid_argument);
  EXPECT_THROW(partition({{-1, 1, 1.0}}, 1 << 20), std::invalid_argument);
  EXPECT_THROW(partition({{1, 1, -1.0}}, 1 << 20), std::invalid_argument);
  EXPECT_THROW(partition({{1, 1, 1.0}}, 1 << 20, -1), std::invalid_argument);
}

}  // namespace
