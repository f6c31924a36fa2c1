#include "core/cluster_simulator.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace hydra::core {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// One node's SHARP run over some tasks, from `start`.
struct NodeRun {
  double start = 0.0;
  std::vector<int> tasks;        // global ids, in the run's task order
  std::vector<TaskSpec> specs;   // what the run simulated: the micro-batches each had left
  SimulationResult result;
  double end() const { return start + result.makespan; }
};

class ClusterSimulation {
 public:
  explicit ClusterSimulation(const ClusterConfig& config)
      : config_(config),
        remaining_(config.tasks.size()),
        evaluated_at_(config.tasks.size(), -1),
        alive_(static_cast<size_t>(config.num_nodes), true),
        running_(static_cast<size_t>(config.num_nodes)),
        queued_(static_cast<size_t>(config.num_nodes)) {
    for (size_t t = 0; t < config.tasks.size(); ++t) remaining_[t] = config.tasks[t].micro_batches;
    out_.node_end.assign(static_cast<size_t>(config.num_nodes), 0.0);
    out_.lower_bound = lower_bound(config.tasks, config.compute, config.num_nodes * config.devices_per_node);
  }

  ClusterResult run() {
    std::vector<int> all(config_.tasks.size());
    for (size_t t = 0; t < all.size(); ++t) all[t] = static_cast<int>(t);
    queue(std::move(all), 0.0);
    start_queued(0.0);
    std::vector<int> orphans;
    std::vector<NodeFailure> failures = config_.failures;
    std::stable_sort(failures.begin(), failures.end(),
                     [](const NodeFailure& a, const NodeFailure& b) { return a.seconds < b.seconds; });
    size_t next_failure = 0;
    while (true) {
      int ending = -1;
      double end = kNever;
      for (int n = 0; n < config_.num_nodes; ++n) {
        if (running_[static_cast<size_t>(n)] && running_[static_cast<size_t>(n)]->end() < end) {
          end = running_[static_cast<size_t>(n)]->end();
          ending = n;
        }
      }
      const double failure = next_failure < failures.size() ? failures[next_failure].seconds : kNever;
      if (ending < 0 && failure == kNever) break;
      double now;
      if (end <= failure) {
        now = end;
        finish(ending);
      } else {
        now = failure;
        fail(failures[next_failure++], orphans);
        queue(std::move(orphans), now);
        orphans.clear();
      }
      start_queued(now);
      if (config_.balance) balance(now);
    }
    bool unfinished = false;
    for (int n = 0; n < config_.num_nodes; ++n) unfinished |= !queued_[static_cast<size_t>(n)].empty();
    out_.makespan = unfinished ? kNever : *std::max_element(out_.node_end.begin(), out_.node_end.end());
    return out_;
  }

 private:
  // Compute seconds of `spec`'s chain, a spec of task `task` (its whole run, or what is left of it).
  double seconds(int task, const TaskSpec& spec) const {
    return task_seconds({spec}, 0, [&](int, int shard, Phase phase) { return config_.compute(task, shard, phase); });
  }

  // The task's spec with the micro-batches it has left; evaluation passes already behind it dropped.
  TaskSpec left(int task) const {
    TaskSpec spec = config_.tasks[static_cast<size_t>(task)];
    const int64_t done = spec.micro_batches - remaining_[static_cast<size_t>(task)];
    spec.micro_batches = remaining_[static_cast<size_t>(task)];
    spec.device.reset();
    std::vector<int64_t> after;
    for (int64_t e : spec.eval_after) {  // the passes not run yet (one at `done` may have run before a stop)
      if (e > done || (e == done && evaluated_at_[static_cast<size_t>(task)] != done)) after.push_back(e - done);
    }
    spec.eval_after = std::move(after);
    if (spec.eval_after.empty()) spec.eval_batches = 0;
    return spec;
  }

  // Queues `tasks` on the nodes alive, largest first to the node whose work (the rest of its run and its queue)
  // is least, and starts the runs of the nodes with nothing to do. Where no node is alive they stay queued on
  // a dead one: the run never ends.
  void queue(std::vector<int> tasks, double now) {
    if (tasks.empty()) return;
    std::vector<int> alive;
    for (int n = 0; n < config_.num_nodes; ++n) {
      if (alive_[static_cast<size_t>(n)]) alive.push_back(n);
    }
    if (alive.empty()) {
      queued_[0].insert(queued_[0].end(), tasks.begin(), tasks.end());
      return;
    }
    std::vector<TaskSpec> specs;
    for (int t : tasks) specs.push_back(left(t));
    const auto global = [&](int local, int shard, Phase phase) {
      return config_.compute(tasks[static_cast<size_t>(local)], shard, phase);
    };
    std::vector<double> load(alive.size(), 0.0);  // assign_longest_first's devices are the alive nodes
    for (size_t k = 0; k < alive.size(); ++k) {
      const auto n = static_cast<size_t>(alive[k]);
      if (running_[n]) load[k] += running_[n]->end() - now;
      for (int t : queued_[n]) load[k] += seconds(t, left(t));
    }
    const std::vector<int> where = assign_longest_first(specs, global, load);
    for (size_t i = 0; i < tasks.size(); ++i) queued_[static_cast<size_t>(alive[static_cast<size_t>(where[i])])].push_back(tasks[i]);
  }

  // Every node alive with nothing to do runs its queue, from `now`.
  void start_queued(double now) {
    for (int node = 0; node < config_.num_nodes; ++node) {
      const auto n = static_cast<size_t>(node);
      if (!alive_[n] || running_[n] || queued_[n].empty()) continue;
      NodeRun run;
      run.start = now;
      run.tasks = std::move(queued_[n]);
      queued_[n].clear();
      for (int t : run.tasks) run.specs.push_back(left(t));
      const std::vector<int> ids = run.tasks;
      SimulationConfig sim{run.specs,
                           [this, ids](int local, int shard, Phase phase) {
                             return config_.compute(ids[static_cast<size_t>(local)], shard, phase);
                           },
                           {}, config_.devices_per_node, config_.policy, Mode::kSharp,
                           config_.seed + static_cast<uint64_t>(node)};
      run.result = simulate(sim);
      running_[n] = std::move(run);
    }
  }

  void finish(int node) {
    NodeRun& run = *running_[static_cast<size_t>(node)];
    out_.units += static_cast<int64_t>(run.result.trace.size());
    for (int t : run.tasks) remaining_[static_cast<size_t>(t)] = 0;
    out_.node_end[static_cast<size_t>(node)] = run.end();
    running_[static_cast<size_t>(node)].reset();
  }

  // The node dies: each of its tasks keeps the micro-batches it completed (its checkpoints) and waits for a node.
  void fail(const NodeFailure& failure, std::vector<int>& orphans) {
    const auto n = static_cast<size_t>(failure.node);
    if (!alive_[n]) return;
    alive_[n] = false;
    out_.node_end[n] = std::max(out_.node_end[n], std::min(failure.seconds, running_[n] ? running_[n]->end() : 0.0));
    out_.moved_tasks += static_cast<int64_t>(queued_[n].size());  // waiting for this node: they go elsewhere
    orphans.insert(orphans.end(), queued_[n].begin(), queued_[n].end());
    queued_[n].clear();
    if (!running_[n]) return;
    const std::vector<int> left = stop_run(failure.node, failure.seconds, true);
    out_.moved_tasks += static_cast<int64_t>(left.size());
    orphans.insert(orphans.end(), left.begin(), left.end());
  }

  // Micro-batches each task of the node's run has completed by `now`.
  std::vector<int64_t> completed_by(const NodeRun& run, double now) const {
    std::vector<int64_t> completed(run.tasks.size(), 0);
    for (const TraceEntry& e : run.result.trace) {
      if (e.end > now - run.start) continue;
      const Unit unit = unit_at(e.task, run.specs[static_cast<size_t>(e.task)], e.index);
      if (unit.phase != Phase::kEvaluate && unit.shard == 0 && unit.phase != Phase::kForward) {
        ++completed[static_cast<size_t>(e.task)];  // its last unit (B(0), or FB(0) for one shard)
      }
    }
    return completed;
  }

  // Ends the node's run at `now`: its tasks keep the micro-batches and evaluation passes they completed; the
  // rest of the work done since is lost (to the failure, or to balancing). Returns the tasks with work left.
  std::vector<int> stop_run(int node, double now, bool failure) {
    NodeRun& run = *running_[static_cast<size_t>(node)];
    const double t = now - run.start;
    const std::vector<int64_t> completed = completed_by(run, now);
    std::vector<int64_t> passes(run.tasks.size(), 0);  // evaluation passes each completed
    for (const TraceEntry& e : run.result.trace) {
      const TaskSpec& spec = run.specs[static_cast<size_t>(e.task)];
      const Unit unit = unit_at(e.task, spec, e.index);
      if (e.end <= t && unit.phase == Phase::kEvaluate && unit.shard == spec.num_shards - 1 &&
          unit.micro_batch == spec.eval_batches - 1) {
        ++passes[static_cast<size_t>(e.task)];
      }
    }
    double& lost = failure ? out_.lost_seconds : out_.rebalance_lost_seconds;
    for (const TraceEntry& e : run.result.trace) {
      if (e.start >= t) continue;
      ++out_.units;
      const TaskSpec& spec = run.specs[static_cast<size_t>(e.task)];
      const Unit unit = unit_at(e.task, spec, e.index);
      const bool kept = unit.phase == Phase::kEvaluate
                            ? eval_passes_started(spec, e.index) <= passes[static_cast<size_t>(e.task)]
                            : unit.micro_batch < completed[static_cast<size_t>(e.task)];
      if (!kept) lost += std::min(e.end, t) - e.start;
    }
    std::vector<int> left;
    for (size_t i = 0; i < run.tasks.size(); ++i) {
      const auto task = static_cast<size_t>(run.tasks[i]);
      const int64_t before = config_.tasks[task].micro_batches - run.specs[i].micro_batches;  // done at its start
      remaining_[task] = run.specs[i].micro_batches - completed[i];
      const int64_t last_pass = passes[i] - 1;
      if (last_pass >= 0 && run.specs[i].eval_after[static_cast<size_t>(last_pass)] == completed[i]) {
        evaluated_at_[task] = before + completed[i];  // the pass at the boundary it stopped at is done
      }
      if (remaining_[task] > 0) left.push_back(run.tasks[i]);
    }
    running_[static_cast<size_t>(node)].reset();
    return left;
  }

  // A task queued behind another node's run (it has not started there) goes to idle `node` instead: the
  // largest one. Returns whether there was one.
  bool take_queued(int node, double now) {
    int from = -1;
    size_t index = 0;
    double largest = -1.0;
    for (int m = 0; m < config_.num_nodes; ++m) {
      const std::vector<int>& queue = queued_[static_cast<size_t>(m)];
      if (m == node || !running_[static_cast<size_t>(m)]) continue;
      for (size_t k = 0; k < queue.size(); ++k) {
        const int t = queue[k];
        const double work = seconds(t, left(t));
        if (work > largest) largest = work, from = m, index = k;
      }
    }
    if (from < 0) return false;
    std::vector<int>& queue = queued_[static_cast<size_t>(from)];
    queued_[static_cast<size_t>(node)].push_back(queue[index]);
    queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(index));
    start_queued(now);
    return true;
  }

  // A node alive with nothing to do takes, at `now`, a task from the node run with the most work left: the
  // largest that holds at most half of it and is at most 75 % done (as hydra_torch.cluster does; here the
  // donor's run restarts from its tasks' micro-batch boundaries, losing the micro-batches in progress).
  void balance(double now) {
    for (int node = 0; node < config_.num_nodes; ++node) {
      const auto n = static_cast<size_t>(node);
      if (!alive_[n] || running_[n] || !queued_[n].empty()) continue;
      if (take_queued(node, now)) continue;
      int donor = -1, moving = -1;
      double most = 0.0;
      for (int m = 0; m < config_.num_nodes; ++m) {
        if (!running_[static_cast<size_t>(m)]) continue;
        const NodeRun& run = *running_[static_cast<size_t>(m)];
        const std::vector<int64_t> completed = completed_by(run, now);
        std::vector<double> rest(run.tasks.size());
        double total = 0.0;
        for (size_t i = 0; i < run.tasks.size(); ++i) {
          TaskSpec spec = run.specs[i];
          spec.micro_batches -= completed[i];
          rest[i] = seconds(run.tasks[i], spec);
          total += rest[i];
        }
        if (total <= most) continue;
        int pick = -1;
        for (size_t i = 0; i < run.tasks.size(); ++i) {
          const double whole = task_seconds(config_.tasks, run.tasks[i], config_.compute);
          if (rest[i] > 0.0 && rest[i] <= total / 2 && rest[i] > 0.25 * whole && (pick < 0 || rest[i] > rest[static_cast<size_t>(pick)])) {
            pick = static_cast<int>(i);
          }
        }
        if (pick >= 0) {
          most = total;
          donor = m;
          moving = run.tasks[static_cast<size_t>(pick)];
        }
      }
      if (donor < 0) continue;
      for (int t : stop_run(donor, now, false)) (t == moving ? queued_[n] : queued_[static_cast<size_t>(donor)]).push_back(t);
      ++out_.balancing_moves;
      start_queued(now);
    }
  }

  const ClusterConfig& config_;
  std::vector<int64_t> remaining_;
  std::vector<int64_t> evaluated_at_;  // per task: the micro-batch count of the last evaluation pass it completed
  std::vector<bool> alive_;
  std::vector<std::optional<NodeRun>> running_;
  std::vector<std::vector<int>> queued_;  // per node: tasks it runs once its current run ends
  ClusterResult out_;
};

}  // namespace

ClusterResult simulate_cluster(const ClusterConfig& config) {
  if (config.num_nodes < 1) throw std::invalid_argument("simulate_cluster: num_nodes must be >= 1");
  if (config.devices_per_node < 1) throw std::invalid_argument("simulate_cluster: devices_per_node must be >= 1");
  if (!config.compute) throw std::invalid_argument("simulate_cluster: no compute function");
  for (const NodeFailure& failure : config.failures) {
    if (failure.node < 0 || failure.node >= config.num_nodes || !(failure.seconds >= 0.0)) {
      throw std::invalid_argument("simulate_cluster: a failure of node " + std::to_string(failure.node) + " at " +
                                  std::to_string(failure.seconds) + " s: no such node, or a negative time");
    }
  }
  return ClusterSimulation(config).run();
}

}  // namespace hydra::core
