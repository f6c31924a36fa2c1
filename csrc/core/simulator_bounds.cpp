// The bounds no simulated run can beat, and the task-parallel mode's binding of tasks to devices.
#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/simulator.h"
#include "core/simulator_units.h"

namespace hydra::core {

using simulated::checked;
using simulated::has_backward;
using simulated::unit_compute;

double task_seconds(const std::vector<TaskSpec>& tasks, int task, const UnitSeconds& compute) {
  const TaskSpec& spec = tasks.at(static_cast<size_t>(task));
  double per_micro_batch = 0.0;
  for (int64_t p = 0; p < units_per_micro_batch(spec.num_shards); ++p) {
    per_micro_batch += unit_compute(compute, unit_at(task, spec.num_shards, p));
  }
  double per_eval_batch = 0.0;
  for (int shard = 0; shard < spec.num_shards; ++shard) {
    per_eval_batch += unit_compute(compute, Unit{task, 0, shard, Phase::kEvaluate, 0});
  }
  return per_micro_batch * static_cast<double>(spec.micro_batches) +
         per_eval_batch * static_cast<double>(spec.eval_batches * eval_passes(spec));
}

double lower_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute, int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("lower_bound: num_devices must be >= 1");
  double total = 0.0;
  double longest = 0.0;
  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) {
    const double chain = task_seconds(tasks, t, compute);
    total += chain;
    longest = std::max(longest, chain);
  }
  return std::max(total / num_devices, longest);
}

double transfer_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& transfer,
                      const UnitSeconds& gradient_transfer, int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("transfer_bound: num_devices must be >= 1");
  double in = 0.0, out = 0.0;
  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) {
    const TaskSpec& spec = tasks[static_cast<size_t>(t)];
    for (int64_t i = 0; i < total_units(spec); ++i) {
      const Unit unit = unit_at(t, spec, i);
      // A micro-batch's first unit (F(0), or FB(0) of a one-shard task) may reuse the weights the previous
      // micro-batch's last unit, on shard 0 too, left on the device.
      const bool may_reuse = unit.micro_batch > 0 && unit.shard == 0 &&
                             (unit.phase == Phase::kForward || unit.phase == Phase::kForwardBackward);
      if (transfer && !may_reuse) in += checked(transfer(unit.task, unit.shard, unit.phase), "transfer");
      if (gradient_transfer && has_backward(unit.phase))
        out += checked(gradient_transfer(unit.task, unit.shard, unit.phase), "transfer");
    }
  }
  return std::max(in, out) / num_devices;
}

std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      int num_devices) {
  if (num_devices < 1) throw std::invalid_argument("assign_longest_first: num_devices must be >= 1");
  return assign_longest_first(tasks, compute, std::vector<double>(static_cast<size_t>(num_devices), 0.0));
}

std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      std::vector<double> load) {
  if (load.empty()) throw std::invalid_argument("assign_longest_first: no device to assign to");
  const int num_devices = static_cast<int>(load.size());
  const int n = static_cast<int>(tasks.size());
  std::vector<double> work(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) work[static_cast<size_t>(t)] = task_seconds(tasks, t, compute);
  std::vector<int> assignment(static_cast<size_t>(n), -1);
  // Pinned tasks load their device first, so the greedy pass sees the real loads.
  for (int t = 0; t < n; ++t) {
    if (const auto& device = tasks[static_cast<size_t>(t)].device) {
      if (*device < 0 || *device >= num_devices) {
        throw std::invalid_argument("assign_longest_first: task " + std::to_string(t) + " pinned to device " +
                                    std::to_string(*device) + ", out of range");
      }
      assignment[static_cast<size_t>(t)] = *device;
      load.at(static_cast<size_t>(*device)) += work[static_cast<size_t>(t)];
    }
  }
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return work[static_cast<size_t>(a)] > work[static_cast<size_t>(b)]; });
  for (int t : order) {
    if (assignment[static_cast<size_t>(t)] >= 0) continue;
    const auto lightest = std::min_element(load.begin(), load.end()) - load.begin();
    assignment[static_cast<size_t>(t)] = static_cast<int>(lightest);
    load[static_cast<size_t>(lightest)] += work[static_cast<size_t>(t)];
  }
  return assignment;
}

}  // namespace hydra::core
