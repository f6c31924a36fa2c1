// Automatic partitioning: where to cut a model's ordered pieces into shards.
//
// A shard of pieces [a, b) needs, while it computes on the device,
//   2 * W(a, b) + A(a, b) + prefetch + kShardSlackBytes
// W: its summed weight bytes (the weights and, in backward, their gradients: hence 2x);
// A: the largest activation need of its pieces (pieces run one after another, so their peaks do not add);
// prefetch: room for the next shard's weights, copied in while this one computes (double buffering).
//
// The prefetch rule: prefetch = the largest shard's weights in the plan. The shard copied in next is not
// always a neighbour: under SHARP it may be any shard of the model (forward goes up, backward down, and
// another model's shards interleave), so the only bound that holds for every schedule is the largest one.
// This makes the constraint depend on the whole plan; the search handles it exactly by trying every
// possible value of that largest weight (see partitioner.cpp).
//
// Objective: the smallest bottleneck (largest shard time), then the fewest shards at that bottleneck
// (each shard visit costs a copy, a rebind and a Python round trip). Without a shard limit the bottleneck is
// the slowest piece whenever every piece fits alone, so the useful choice is how few shards reach it;
// `max_shards` asks for the best plan with at most that many shards instead.
#pragma once

#include <cstdint>
#include <vector>

namespace hydra::core {

struct PieceCost {
  int64_t weight_bytes = 0;      // device bytes of its parameters in the compute dtype
  int64_t activation_bytes = 0;  // peak extra device memory of its forward + backward at the probed batch
  double seconds = 0.0;          // forward + backward time
};

struct Plan {
  std::vector<int> starts;                     // first piece of each shard; starts[0] == 0
  std::vector<int64_t> shard_bytes;            // each shard's device need under the plan's prefetch
  std::vector<int64_t> shard_weight_bytes;     // W of each shard
  std::vector<int64_t> shard_activation_bytes; // A of each shard
  std::vector<double> shard_seconds;
  int64_t prefetch_bytes = 0;                  // the largest shard's weights
  double bottleneck_seconds = 0.0;
  // max(total time / shard count, slowest piece): no partition into this many shards can do better, since
  // the largest shard is at least the mean shard and at least the piece it must contain.
  double ideal_seconds = 0.0;
};

// Each of a shard's three device regions (weights, gradients, the prefetched weights) is rounded up to the
// device pool's 512-byte alignment; DeviceEngine reserves the same slack for the first two.
constexpr int64_t kShardSlackBytes = 3 * 512;

// Device bytes a shard needs: 2 * weights + activations + prefetch + kShardSlackBytes.
int64_t shard_need_bytes(int64_t weight_bytes, int64_t activation_bytes, int64_t prefetch_bytes);

// The smallest budget any plan fits: every piece alone, prefetch = the heaviest piece's weights.
int64_t min_budget_bytes(const std::vector<PieceCost>& pieces);

// The exact optimum over contiguous partitions (see the top of this file). max_shards = 0: no limit.
// Throws std::invalid_argument for bad input, for a budget below min_budget_bytes (the message gives that
// number), and when no plan of at most max_shards shards fits.
Plan partition(const std::vector<PieceCost>& pieces, int64_t budget_bytes, int max_shards = 0);

}  // namespace hydra::core
