// The lane model's test shapes: rates, and shards and tasks of given compute and size, as the lane tests build them.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/lanes.h"

namespace hydra::core::lane_test {

inline const LaneRates kRates{100.0, 50.0, 200.0, 1000.0};  // bytes/s: in, out, host, device memory

// A shard of `params` elements, its weights and gradients as many (a tied weight borrowed from `tied_to` counts among
// them).
inline ShardShape shard(double forward, double backward, int64_t params, int tied_to = -1) {
  return ShardShape{forward, backward, params, params, params, tied_to};
}

inline TaskShape task(std::vector<ShardShape> shards, int64_t micro_batches, int64_t accumulate = 1) {
  return TaskShape{std::move(shards), micro_batches, accumulate};
}

}  // namespace hydra::core::lane_test
