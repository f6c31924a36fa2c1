// The search. For a fixed cap P on every shard's weights, a shard [a, b) is allowed when
//   time(a, b) <= T,  W(a, b) <= P,  2 W(a, b) + A(a, b) + P + slack <= budget,
// and each condition only gets harder as the shard grows. For such monotone constraints the greedy that
// makes every shard as long as allowed is exact: it finds a partition iff one exists, and with the fewest
// shards (a shorter first shard never lets the rest end sooner). A plan whose largest shard weighs P* is
// allowed under cap P*, and a plan allowed under any cap P has prefetch <= P, so trying every P that some
// W(a, b) takes covers every plan: min over P of the smallest feasible T is the exact optimum.
// Cost: O(#P * n * log #T) with #P, #T <= n(n+1)/2; well under a second for a few hundred pieces.
#include "core/partitioner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace hydra::core {

namespace {

constexpr int kInfeasible = std::numeric_limits<int>::max();

struct Prefix {
  std::vector<int64_t> weight;  // weight[i]: bytes of pieces [0, i)
  std::vector<double> seconds;

  explicit Prefix(const std::vector<PieceCost>& pieces) : weight(pieces.size() + 1, 0), seconds(pieces.size() + 1, 0.0) {
    for (size_t i = 0; i < pieces.size(); ++i) {
      weight[i + 1] = weight[i] + pieces[i].weight_bytes;
      seconds[i + 1] = seconds[i] + pieces[i].seconds;
    }
  }
  // Every shard time is computed by this one expression, so comparisons with candidate times (which come
  // from it too) are exact despite floating point.
  double time(int a, int b) const { return seconds[b] - seconds[a]; }
  int64_t bytes(int a, int b) const { return weight[b] - weight[a]; }
};

// Greedy longest shards under (T, P); fills `starts` when given. Returns the shard count, or kInfeasible
// when some piece fits nowhere or more than `limit` shards would be needed.
int greedy(const std::vector<PieceCost>& pieces, const Prefix& prefix, int64_t budget, double max_time,
           int64_t cap, int limit, std::vector<int>* starts) {
  const int n = static_cast<int>(pieces.size());
  int count = 0;
  for (int a = 0; a < n;) {
    int64_t activations = 0;
    int b = a;
    while (b < n) {
      const int64_t act = std::max(activations, pieces[b].activation_bytes);
      const int64_t w = prefix.bytes(a, b + 1);
      if (prefix.time(a, b + 1) > max_time || w > cap || shard_need_bytes(w, act, cap) > budget) break;
      activations = act;
      ++b;
    }
    if (b == a || ++count > limit) return kInfeasible;
    if (starts) starts->push_back(a);
    a = b;
  }
  return count;
}

template <typename T>
std::vector<T> sorted_unique(std::vector<T> values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  return values;
}

void check_input(const std::vector<PieceCost>& pieces, int64_t budget_bytes, int max_shards) {
  if (pieces.empty()) throw std::invalid_argument("partition: no pieces to partition");
  if (budget_bytes <= 0) throw std::invalid_argument("partition: the budget must be positive");
  if (max_shards < 0) throw std::invalid_argument("partition: max_shards must be >= 0 (0: no limit)");
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PieceCost& p = pieces[i];
    if (p.weight_bytes < 0 || p.activation_bytes < 0 || !std::isfinite(p.seconds) || p.seconds < 0.0) {
      throw std::invalid_argument("partition: piece " + std::to_string(i) +
                                  " has negative bytes or a negative or non-finite time");
    }
  }
}

}  // namespace

int64_t shard_need_bytes(int64_t weight_bytes, int64_t activation_bytes, int64_t prefetch_bytes) {
  return 2 * weight_bytes + activation_bytes + prefetch_bytes + kShardSlackBytes;
}

int64_t min_budget_bytes(const std::vector<PieceCost>& pieces) {
  // Any plan's prefetch is at least the heaviest piece's weights, and every shard needs at least what its
  // most demanding piece needs alone; the all-singletons plan meets both bounds at once.
  int64_t heaviest = 0, worst = 0;
  for (const PieceCost& p : pieces) heaviest = std::max(heaviest, p.weight_bytes);
  for (const PieceCost& p : pieces) worst = std::max(worst, shard_need_bytes(p.weight_bytes, p.activation_bytes, heaviest));
  return worst;
}

Plan partition(const std::vector<PieceCost>& pieces, int64_t budget_bytes, int max_shards) {
  check_input(pieces, budget_bytes, max_shards);
  const int n = static_cast<int>(pieces.size());
  const int limit = max_shards == 0 ? n : std::min(max_shards, n);
  const int64_t minimum = min_budget_bytes(pieces);
  if (budget_bytes < minimum) {
    throw std::invalid_argument("memory budget of " + std::to_string(budget_bytes) +
                                " bytes is too small: the smallest budget that works is " + std::to_string(minimum) +
                                " bytes (the most demanding piece alone: 2 x weights + activations, plus room to "
                                "prefetch the heaviest piece)");
  }
  const Prefix prefix(pieces);

  int64_t heaviest = 0;
  double slowest = 0.0;
  for (int i = 0; i < n; ++i) {
    heaviest = std::max(heaviest, prefix.bytes(i, i + 1));
    slowest = std::max(slowest, prefix.time(i, i + 1));
  }
  std::vector<double> times;
  std::vector<int64_t> caps;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b <= n; ++b) {
      if (prefix.time(a, b) >= slowest) times.push_back(prefix.time(a, b));
      // A cap below the heaviest piece admits nothing; one above budget - (2W + A of any piece) neither.
      if (prefix.bytes(a, b) >= heaviest && prefix.bytes(a, b) <= budget_bytes) caps.push_back(prefix.bytes(a, b));
    }
  }
  times = sorted_unique(std::move(times));
  caps = sorted_unique(std::move(caps));

  // Phase 1: the smallest time index any cap reaches. A cap is only searched when it beats the best so far.
  size_t best = times.size();
  for (int64_t cap : caps) {
    if (best == 0) break;
    if (greedy(pieces, prefix, budget_bytes, times[best - 1], cap, limit, nullptr) == kInfeasible) continue;
    size_t lo = 0, hi = best - 1;  // times[hi] is feasible; find the first feasible index
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (greedy(pieces, prefix, budget_bytes, times[mid], cap, limit, nullptr) != kInfeasible) hi = mid;
      else lo = mid + 1;
    }
    best = lo;
  }
  if (best == times.size()) {
    const int fewest = [&] {
      int f = kInfeasible;
      for (int64_t cap : caps) f = std::min(f, greedy(pieces, prefix, budget_bytes, prefix.time(0, n), cap, n, nullptr));
      return f;
    }();
    throw std::invalid_argument("no plan of at most " + std::to_string(limit) + " shards fits a budget of " +
                                std::to_string(budget_bytes) + " bytes: it needs at least " + std::to_string(fewest) +
                                " shards");
  }

  // Phase 2: at that bottleneck, the fewest shards; among those the smallest cap (least memory).
  const double bottleneck = times[best];
  int fewest = kInfeasible;
  int64_t chosen_cap = 0;
  for (int64_t cap : caps) {
    const int count = greedy(pieces, prefix, budget_bytes, bottleneck, cap, limit, nullptr);
    if (count < fewest) fewest = count, chosen_cap = cap;
  }

  Plan plan;
  greedy(pieces, prefix, budget_bytes, bottleneck, chosen_cap, limit, &plan.starts);
  const int shards = static_cast<int>(plan.starts.size());
  for (int s = 0; s < shards; ++s) {
    const int a = plan.starts[s], b = s + 1 < shards ? plan.starts[s + 1] : n;
    int64_t activations = 0;
    for (int i = a; i < b; ++i) activations = std::max(activations, pieces[i].activation_bytes);
    plan.shard_weight_bytes.push_back(prefix.bytes(a, b));
    plan.shard_activation_bytes.push_back(activations);
    plan.shard_seconds.push_back(prefix.time(a, b));
    plan.prefetch_bytes = std::max(plan.prefetch_bytes, prefix.bytes(a, b));
    plan.bottleneck_seconds = std::max(plan.bottleneck_seconds, prefix.time(a, b));
  }
  // The plan's real prefetch may be below the cap it was found under; the needs use the real one.
  for (int s = 0; s < shards; ++s) {
    plan.shard_bytes.push_back(
        shard_need_bytes(plan.shard_weight_bytes[s], plan.shard_activation_bytes[s], plan.prefetch_bytes));
  }
  plan.ideal_seconds = std::max(prefix.time(0, n) / shards, slowest);
  return plan;
}

}  // namespace hydra::core
