// Paper-shaped synthetic workloads for the simulator: several models of different depths (shard counts)
// whose per-shard times vary, as after a partitioner that balances shards only approximately.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/simulator.h"
#include "core/unit.h"

namespace hydra::core {

struct SyntheticWorkload {
  std::vector<TaskSpec> tasks;
  // forward_seconds[task][shard]; a unit costs forward x CostModel::kPhaseWeight[phase].
  std::shared_ptr<const std::vector<std::vector<double>>> forward_seconds;

  UnitSeconds compute() const;
  // Weight copy time per unit, as a fraction of the shard's forward time.
  UnitSeconds transfer(double fraction_of_forward) const;
};

// One task per entry of shard_counts, each with `micro_batches` micro-batches; every shard's forward
// time is base_forward_seconds x (1 + u), u uniform in [-jitter, +jitter], drawn from `seed`.
SyntheticWorkload synthetic_workload(const std::vector<int>& shard_counts, int64_t micro_batches,
                                     double base_forward_seconds, double jitter, uint64_t seed);

// One task per entry of `sizes`, each with one shard per entry of `profile`: shard s's forward takes
// base_forward_seconds x size x profile[s] x (1 + u), u uniform in [-jitter, +jitter] (a language model's
// profile: a cheap embedding shard, equal blocks, a costly output head). With `costs`, TaskSpec::shard_costs
// is size x profile (what parameter counts tell the scheduler before anything is timed), not the jitter.
SyntheticWorkload sized_workload(const std::vector<double>& sizes, const std::vector<double>& profile,
                                 int64_t micro_batches, double base_forward_seconds, double jitter, uint64_t seed,
                                 bool costs);

// The benchmark's default: 12 models, four each of 24, 36 and 48 shards, per-shard times +-30%.
SyntheticWorkload paper_workload(int64_t micro_batches = 8, uint64_t seed = 1);

}  // namespace hydra::core
