#include "core/cost_model.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace hydra::core {

// Why the mean of all observations (after the first):
// - A shard's duration is stationary over a run: same shapes, same kernels, every step. The plain mean is
//   then the minimum-variance estimate and its error shrinks as 1/sqrt(n), epoch after epoch.
// - An exponential average weights only the last ~1/alpha samples: its noise never shrinks, and a
//   transient (an eval pass contending for the device, a throttled minute) drags it away from the truth
//   for as long as the transient lasts. The original Hydra's estimates drifted across epochs this way.
// - The first call of each shard is not representative (lazy initialisation, allocator growth, kernel
//   autotuning make it many times slower), and one 100x sample would take ~1000 samples to wash out of a
//   mean. So a key's first sample is its estimate only until a second one arrives, then it is dropped.

namespace {

double phase_weight(Phase phase) { return CostModel::kPhaseWeight[static_cast<size_t>(phase)]; }

Phase phase_at(int num_shards, int64_t position) {
  if (position >= units_per_micro_batch(num_shards)) return Phase::kEvaluate;
  if (position < num_shards - 1) return Phase::kForward;
  if (position == num_shards - 1) return Phase::kForwardBackward;
  return Phase::kBackward;
}

int shard_at(int num_shards, int64_t position) {
  const int64_t per = units_per_micro_batch(num_shards);
  if (position >= per) return static_cast<int>(position - per);
  return static_cast<int>(position < num_shards ? position : 2 * int64_t{num_shards} - 2 - position);
}

void check_shard_costs(const TaskSpec& spec, size_t task) {
  if (static_cast<int64_t>(spec.shard_costs.size()) != spec.num_shards) {
    throw std::invalid_argument("CostModel: task " + std::to_string(task) + " has " +
                                std::to_string(spec.shard_costs.size()) + " shard costs for " +
                                std::to_string(spec.num_shards) + " shards");
  }
  for (double cost : spec.shard_costs) {
    if (!(cost > 0.0) || !std::isfinite(cost)) {
      throw std::invalid_argument("CostModel: task " + std::to_string(task) +
                                  ": shard costs must be positive and finite, got " + std::to_string(cost));
    }
  }
}

// One scale for every task's shard costs: mean 1 over the costed shards of `tasks` (0 when none has costs).
double cost_scale(const std::vector<TaskSpec>& tasks) {
  double sum = 0.0;
  int64_t count = 0;
  for (const TaskSpec& spec : tasks) {
    for (double cost : spec.shard_costs) {
      sum += cost;
      ++count;
    }
  }
  return count > 0 ? static_cast<double>(count) / sum : 0.0;
}

}  // namespace

CostModel::CostModel(std::vector<TaskSpec> tasks, double default_forward_seconds)
    : default_forward_seconds_(default_forward_seconds) {
  if (!(default_forward_seconds > 0.0) || !std::isfinite(default_forward_seconds)) {
    throw std::invalid_argument("CostModel: default_forward_seconds must be positive and finite");
  }
  for (size_t t = 0; t < tasks.size(); ++t) check_spec(tasks[t], t);
  cost_scale_ = cost_scale(tasks);
  tasks_.reserve(tasks.size());
  for (const TaskSpec& spec : tasks) tasks_.push_back(make_state(spec));
}

void CostModel::check_spec(const TaskSpec& spec, size_t task) {
  if (spec.num_shards < 1) throw std::invalid_argument("CostModel: num_shards must be >= 1");
  if (!spec.shard_costs.empty()) check_shard_costs(spec, task);
  check_eval_passes(spec, "CostModel: task " + std::to_string(task) + ": ");
}

int CostModel::add_task(const TaskSpec& spec) {
  check_spec(spec, tasks_.size());
  if (cost_scale_ == 0.0) cost_scale_ = cost_scale({spec});  // the first costed task sets the scale
  tasks_.push_back(make_state(spec));
  return num_tasks() - 1;
}

void CostModel::replace_task(int task, const TaskSpec& spec) {
  if (task < 0 || task >= num_tasks()) {
    throw std::invalid_argument("CostModel::replace_task: task " + std::to_string(task) + " out of range");
  }
  check_spec(spec, static_cast<size_t>(task));
  if (cost_scale_ == 0.0) cost_scale_ = cost_scale({spec});
  tasks_[static_cast<size_t>(task)] = make_state(spec);
}

CostModel::TaskState CostModel::make_state(const TaskSpec& spec) const {
  TaskState state;
  state.spec = spec;
  state.cost.assign(static_cast<size_t>(spec.num_shards), 1.0);
  for (size_t s = 0; s < spec.shard_costs.size(); ++s) state.cost[s] = spec.shard_costs[s] * cost_scale_;
  const auto positions = static_cast<size_t>(units_per_micro_batch(spec.num_shards) + spec.num_shards);
  // The observations of the tasks of its base with its shards, if there are any, else its own.
  for (const TaskState& other : tasks_)
    if (spec.base >= 0 && other.spec.base == spec.base && other.spec.num_shards == spec.num_shards) {
      state.observed = other.observed;
      break;
    }
  if (!state.observed) {
    state.observed = std::make_shared<Observed>();
    state.observed->stats.resize(positions);
  }
  state.estimate.resize(positions);
  state.suffix.resize(positions);
  return state;
}

void CostModel::check_key(int task, int shard, Phase phase) const {
  if (task < 0 || task >= num_tasks()) {
    throw std::invalid_argument("CostModel: task " + std::to_string(task) + " out of range [0, " +
                                std::to_string(num_tasks()) + ")");
  }
  const int n = tasks_[static_cast<size_t>(task)].spec.num_shards;
  if (shard < 0 || shard >= n) {
    throw std::invalid_argument("CostModel: shard " + std::to_string(shard) + " out of range for task " +
                                std::to_string(task) + " with " + std::to_string(n) + " shards");
  }
  if (phase == Phase::kForwardBackward && shard != n - 1) {
    throw std::invalid_argument("CostModel: forward-backward only exists for the last shard");
  }
  if ((phase == Phase::kForward || phase == Phase::kBackward) && shard == n - 1) {
    throw std::invalid_argument("CostModel: the last shard only runs forward-backward");
  }
}

void CostModel::observe(int task, int shard, Phase phase, double seconds) {
  check_key(task, shard, phase);
  if (!(seconds >= 0.0) || !std::isfinite(seconds)) {
    throw std::invalid_argument("CostModel: observed duration must be finite and >= 0, got " +
                                std::to_string(seconds));
  }
  TaskState& state = tasks_[static_cast<size_t>(task)];
  Observed& observed = *state.observed;
  KeyStats& key = observed.stats[static_cast<size_t>(position_in_micro_batch(state.spec.num_shards, shard, phase))];
  if (key.count == 0) {
    key.first = seconds;
    ++observed.observed_keys;
  } else {
    key.sum_after_first += seconds;
  }
  ++key.count;
  for (TaskState& sharing : tasks_) sharing.dirty = sharing.dirty || sharing.observed == state.observed;
  global_forward_sum_ += seconds / phase_weight(phase) / state.cost[static_cast<size_t>(shard)];
  ++global_forward_count_;
  ++global_version_;
}

double CostModel::global_forward_seconds() const {
  return global_forward_count_ > 0 ? global_forward_sum_ / static_cast<double>(global_forward_count_)
                                   : default_forward_seconds_;
}

const CostModel::TaskState& CostModel::refreshed(int task) const {
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  const std::vector<KeyStats>& stats = state.observed->stats;
  const int64_t observed_keys = state.observed->observed_keys;
  const bool uses_global_prior = observed_keys == 0;
  if (!state.dirty && (!uses_global_prior || state.global_version == global_version_)) return state;

  // Priors, per unit of shard cost, most specific first: this task's observed units of the same phase;
  // else this task's observed units converted through kPhaseWeight; else every task's observations, likewise.
  const int n = state.spec.num_shards;
  auto cost_at = [&](int64_t p) { return state.cost[static_cast<size_t>(shard_at(n, p))]; };
  std::array<double, kPhaseWeight.size()> phase_rate_sum{};
  std::array<int64_t, kPhaseWeight.size()> phase_count{};
  double forward_rate_sum = 0.0;
  for (int64_t p = 0; p < static_cast<int64_t>(stats.size()); ++p) {
    const KeyStats& key = stats[static_cast<size_t>(p)];
    if (key.count == 0) continue;
    const Phase phase = phase_at(n, p);
    phase_rate_sum[static_cast<size_t>(phase)] += key.mean() / cost_at(p);
    ++phase_count[static_cast<size_t>(phase)];
    forward_rate_sum += key.mean() / phase_weight(phase) / cost_at(p);
  }
  const double task_forward_rate = observed_keys > 0
                                       ? forward_rate_sum / static_cast<double>(observed_keys)
                                       : global_forward_seconds();

  double running = 0.0;
  const int64_t per = units_per_micro_batch(n);
  for (int64_t p = static_cast<int64_t>(stats.size()) - 1; p >= 0; --p) {
    if (p == per - 1) running = 0.0;  // a micro-batch's suffix ends with it, before the evaluation positions
    const KeyStats& key = stats[static_cast<size_t>(p)];
    const auto phase = static_cast<size_t>(phase_at(n, p));
    double value;
    if (key.count > 0) {
      value = key.mean();
    } else if (phase_count[phase] > 0) {
      value = phase_rate_sum[phase] / static_cast<double>(phase_count[phase]) * cost_at(p);
    } else {
      value = task_forward_rate * kPhaseWeight[phase] * cost_at(p);
    }
    state.estimate[static_cast<size_t>(p)] = value;
    running += value;
    state.suffix[static_cast<size_t>(p)] = running;
  }
  state.dirty = false;
  state.global_version = global_version_;
  return state;
}

double CostModel::estimate(int task, int shard, Phase phase) const {
  check_key(task, shard, phase);
  const TaskState& state = refreshed(task);
  return state.estimate[static_cast<size_t>(position_in_micro_batch(state.spec.num_shards, shard, phase))];
}

int64_t CostModel::observations(int task, int shard, Phase phase) const {
  check_key(task, shard, phase);
  const TaskState& state = tasks_[static_cast<size_t>(task)];
  return state.observed->stats[static_cast<size_t>(position_in_micro_batch(state.spec.num_shards, shard, phase))]
      .count;
}

double CostModel::remaining_seconds(int task, int64_t next_index) const {
  if (task < 0 || task >= num_tasks()) {
    throw std::invalid_argument("CostModel::remaining_seconds: task " + std::to_string(task) + " out of range");
  }
  const TaskState& state = refreshed(task);
  const TaskSpec& spec = state.spec;
  const int n = spec.num_shards;
  const int64_t per = units_per_micro_batch(n);
  if (next_index < 0) next_index = 0;
  if (next_index >= total_units(spec)) return 0.0;
  const auto suffix = [&](int64_t position) { return state.suffix[static_cast<size_t>(position)]; };
  const double per_eval_batch = suffix(per);  // E(0)..E(n-1)
  const double per_eval_pass = static_cast<double>(spec.eval_batches) * per_eval_batch;

  // Where next_index falls: inside evaluation pass `started - 1`, or among the training units.
  const int64_t started = eval_passes_started(spec, next_index);
  double eval = static_cast<double>(eval_passes(spec) - started) * per_eval_pass;
  int64_t train_index;  // the first training unit not yet run, counted without the evaluation units
  const int64_t offset = started > 0 ? next_index - eval_pass_start(spec, started - 1) : -1;
  if (offset >= 0 && offset < units_per_eval_pass(spec)) {
    const int64_t batches_after = spec.eval_batches - offset / n - 1;
    eval += suffix(per + offset % n) + static_cast<double>(batches_after) * per_eval_batch;
    train_index = spec.eval_after[static_cast<size_t>(started - 1)] * per;
  } else {
    train_index = next_index - started * units_per_eval_pass(spec);
  }
  double train = 0.0;
  if (train_index < spec.micro_batches * per) {
    const int64_t whole_after = spec.micro_batches - train_index / per - 1;
    train = suffix(train_index % per) + static_cast<double>(whole_after) * suffix(0);
  }
  return train + eval;
}

}  // namespace hydra::core
