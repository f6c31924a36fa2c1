#include "core/synthetic_workload.h"

#include <random>
#include <stdexcept>

#include "core/cost_model.h"

namespace hydra::core {

UnitSeconds SyntheticWorkload::compute() const {
  return [table = forward_seconds](int task, int shard, Phase phase) {
    return (*table)[static_cast<size_t>(task)][static_cast<size_t>(shard)] *
           CostModel::kPhaseWeight[static_cast<size_t>(phase)];
  };
}

UnitSeconds SyntheticWorkload::transfer(double fraction_of_forward) const {
  return [table = forward_seconds, fraction_of_forward](int task, int shard, Phase) {
    return (*table)[static_cast<size_t>(task)][static_cast<size_t>(shard)] * fraction_of_forward;
  };
}

SyntheticWorkload synthetic_workload(const std::vector<int>& shard_counts, int64_t micro_batches,
                                     double base_forward_seconds, double jitter, uint64_t seed) {
  if (!(jitter >= 0.0 && jitter < 1.0)) throw std::invalid_argument("synthetic_workload: jitter must be in [0, 1)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> spread(-jitter, jitter);
  SyntheticWorkload workload;
  auto table = std::make_shared<std::vector<std::vector<double>>>();
  for (int shards : shard_counts) {
    workload.tasks.push_back(TaskSpec{shards, micro_batches, std::nullopt});
    std::vector<double>& row = table->emplace_back();
    for (int s = 0; s < shards; ++s) row.push_back(base_forward_seconds * (1.0 + spread(rng)));
  }
  workload.forward_seconds = std::move(table);
  return workload;
}

SyntheticWorkload sized_workload(const std::vector<double>& sizes, const std::vector<double>& profile,
                                 int64_t micro_batches, double base_forward_seconds, double jitter, uint64_t seed,
                                 bool costs) {
  const int shards = static_cast<int>(profile.size());
  SyntheticWorkload workload = synthetic_workload(std::vector<int>(sizes.size(), shards), micro_batches,
                                                  base_forward_seconds, jitter, seed);
  auto table = std::make_shared<std::vector<std::vector<double>>>(*workload.forward_seconds);
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (size_t s = 0; s < profile.size(); ++s) {
      if (!(sizes[t] > 0.0) || !(profile[s] > 0.0)) {
        throw std::invalid_argument("sized_workload: sizes and profile must be positive");
      }
      (*table)[t][s] *= sizes[t] * profile[s];
      if (costs) workload.tasks[t].shard_costs.push_back(sizes[t] * profile[s]);
    }
  }
  workload.forward_seconds = std::move(table);
  return workload;
}

SyntheticWorkload paper_workload(int64_t micro_batches, uint64_t seed) {
  return synthetic_workload({24, 36, 48, 24, 36, 48, 24, 36, 48, 24, 36, 48}, micro_batches, 1e-3, 0.3, seed);
}

}  // namespace hydra::core
