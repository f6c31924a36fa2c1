// Online duration estimates per (task, shard, phase), and the remaining time of a task's chain.
//
// Estimator: the mean of every observation except a key's first one (see cost_model.cpp for why neither
// an exponential average nor the first sample). Unobserved units get a prior: seconds per unit of shard
// cost (TaskSpec::shard_costs) learned from the observed units, times the unit's shard cost, times the
// phase's cost relative to a forward pass (kPhaseWeight). So a task nothing has been timed of yet is
// ranked by its size relative to the tasks already timed, not as if it were as small as they are. Not
// thread-safe, const methods included (they refresh a cache): the Scheduler calls it under its mutex.
//
// Tasks of one frozen base (TaskSpec::base) with the same shards share their observations: they run the same
// base's layers with adapters of their own, so a unit of one times the same unit of the others, and LRTF ranks
// them by the units they have left rather than by whose noisy first samples came in (which would run one of them
// through its step while the base shards the others need next are evicted).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/unit.h"

namespace hydra::core {

class CostModel {
 public:
  // Cost of a phase in forward passes, used only for priors. Backward re-runs the shard's forward from
  // its checkpointed input (1) and then back-propagates (~2 forwards of FLOPs): 3. FB(n-1) is one forward
  // and one backward with no recompute: also 3. An evaluation unit is one forward without gradients: 1.
  static constexpr std::array<double, 4> kPhaseWeight = {1.0, 3.0, 3.0, 1.0};

  // default_forward_seconds: the prior for a forward unit of average shard cost before anything at all has
  // been observed. Its scale is irrelevant to scheduling (every task shares it), only its use in
  // remaining_seconds. Shard costs are rescaled to mean 1 over the shards that have them; a task without
  // costs counts each of its shards as 1.
  // Throws std::invalid_argument for shard_costs of the wrong length or not positive and finite, and for
  // evaluation passes check_eval_passes rejects.
  explicit CostModel(std::vector<TaskSpec> tasks, double default_forward_seconds = 1.0);

  // A task arriving after the others (an id of num_tasks()); its shard costs take the scale set so far. Same
  // checks as the constructor's. Returns its id.
  int add_task(const TaskSpec& spec);
  // The task's chain is planned anew (other shards, the rest of its micro-batches): its estimates start over
  // from the priors, which keep what its observations taught them. Same checks as add_task.
  void replace_task(int task, const TaskSpec& spec);

  // Throws std::invalid_argument for an unknown task/shard, FB on a shard other than the last, F or B on the
  // last, or a negative / non-finite duration.
  void observe(int task, int shard, Phase phase, double seconds);

  double estimate(int task, int shard, Phase phase) const;
  int64_t observations(int task, int shard, Phase phase) const;

  // Estimated seconds of units next_index .. end of the task's chain. O(1) while the task's estimates are
  // unchanged; the first call after an observation of the task rebuilds its O(num_shards) cache.
  double remaining_seconds(int task, int64_t next_index) const;

  int num_tasks() const { return static_cast<int>(tasks_.size()); }
  const TaskSpec& spec(int task) const { return tasks_.at(static_cast<size_t>(task)).spec; }

 private:
  struct KeyStats {
    int64_t count = 0;
    double first = 0.0;
    double sum_after_first = 0.0;
    double mean() const { return count == 1 ? first : sum_after_first / static_cast<double>(count - 1); }
  };
  // Observations of units, indexed by position_in_micro_batch: a task's own, or its base's (shared).
  struct Observed {
    std::vector<KeyStats> stats;
    int64_t observed_keys = 0;
  };
  struct TaskState {
    TaskSpec spec;
    std::vector<double> cost;  // per shard, normalised
    std::shared_ptr<Observed> observed;
    // Cache, valid while !dirty and (the task has its own observations or global_version matches).
    mutable bool dirty = true;
    mutable uint64_t global_version = 0;
    mutable std::vector<double> estimate;  // per position
    // suffix[p] = sum of estimate[p..end of its micro-batch] for a training position; for an evaluation
    // position, of estimate[p..the evaluation batch's last shard].
    mutable std::vector<double> suffix;
  };

  static void check_spec(const TaskSpec& spec, size_t task);
  TaskState make_state(const TaskSpec& spec) const;
  void check_key(int task, int shard, Phase phase) const;
  const TaskState& refreshed(int task) const;
  double global_forward_seconds() const;

  std::vector<TaskState> tasks_;
  double default_forward_seconds_;
  double cost_scale_ = 0.0;  // turns shard costs into mean-1 units; 0 until some task has given costs
  // Mean forward-equivalent seconds per unit of cost (seconds / kPhaseWeight / shard cost) of every
  // observation of every task: the prior of tasks that have observed nothing yet. Versioned so those
  // tasks' caches refresh when it moves.
  double global_forward_sum_ = 0.0;
  int64_t global_forward_count_ = 0;
  uint64_t global_version_ = 1;
};

}  // namespace hydra::core
