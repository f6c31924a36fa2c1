// Scheduler and simulator benchmark. Prints markdown tables for benchmarks/RESULTS.md.
//
// Build and run (torch-free, from the repository root):
//   mkdir -p build && g++ -std=c++20 -O2 -Icsrc benchmarks/bench_scheduler.cpp csrc/core/*.cpp -pthread -o build/bench_scheduler
//   build/bench_scheduler
//
// (a) Simulated makespan of the paper-shaped workload (12 models: four each of 24/36/48 shards, per-shard
//     times +-30%, 8 micro-batches) for every policy, against the lower bound max(work/G, longest chain),
//     and LRTF's strong-scaling speedup over G=1. (b) Cost of one scheduling decision: next()+complete()
//     single-threaded over 12 tasks. (a'') The same workload with copies that follow each device's committed
//     plan, also on two other draws of the per-shard times. (c) Cold start: 12 models of 1x-4x sizes, nothing
//     timed at the start; LRTF with shard costs (sizes, as parameter counts give them) and without, beside the
//     other policies.
// (d) At cluster scale: 1,000 models on 16 nodes of 8 GPUs, placed across nodes largest first, SHARP (LRTF)
//     inside each node; without failures and with 1 and 4 node deaths; and the scheduling cost per unit.
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/cluster_simulator.h"
#include "core/scheduler.h"
#include "core/simulator.h"
#include "core/synthetic_workload.h"

using namespace hydra::core;

namespace {

constexpr PolicyKind kPolicies[] = {PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom};

double makespan(const SyntheticWorkload& workload, int devices, PolicyKind policy, Mode mode, double transfer) {
  SimulationConfig config{workload.tasks, workload.compute(), transfer > 0 ? workload.transfer(transfer) : UnitSeconds{},
                          devices, policy, mode, 1};
  return simulate(config).makespan;
}

void simulated_makespans() {
  const SyntheticWorkload workload = paper_workload();
  const UnitSeconds compute = workload.compute();
  const double lrtf_one = makespan(workload, 1, PolicyKind::kLrtf, Mode::kSharp, 0.0);
  std::printf("### (a) Simulated makespan / lower bound (no transfers)\n\n");
  std::printf("| G | bound (s) | lrtf | fifo | round_robin | random | task parallel | model parallel | "
              "lrtf speedup vs G=1 | speedup / G |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (int devices : {1, 2, 4, 8, 16, 64}) {
    const double bound = lower_bound(workload.tasks, compute, devices);
    std::printf("| %d | %.3f", devices, bound);
    double lrtf = 0.0;
    for (PolicyKind policy : kPolicies) {
      const double span = makespan(workload, devices, policy, Mode::kSharp, 0.0);
      if (policy == PolicyKind::kLrtf) lrtf = span;
      std::printf(" | %.3f", span / bound);
    }
    std::printf(" | %.3f", makespan(workload, devices, PolicyKind::kLrtf, Mode::kTaskParallel, 0.0) / bound);
    std::printf(" | %.3f", makespan(workload, devices, PolicyKind::kLrtf, Mode::kModelParallel, 0.0) / bound);
    std::printf(" | %.2f | %.3f |\n", lrtf_one / lrtf, lrtf_one / lrtf / devices);
  }

  std::printf("\n### (a') LRTF with weight copies of 0.5x / 2x a shard's forward time (double buffering)\n\n");
  std::printf("| G | makespan/bound, copy 0.5x fwd | exposed copy share | makespan/bound, copy 2x fwd | "
              "exposed copy share |\n|---|---|---|---|---|\n");
  for (int devices : {1, 2, 4, 8, 16, 64}) {
    const double bound = lower_bound(workload.tasks, compute, devices);
    std::printf("| %d", devices);
    for (double fraction : {0.5, 2.0}) {
      SimulationConfig config{workload.tasks, compute, workload.transfer(fraction), devices, PolicyKind::kLrtf,
                              Mode::kSharp, 1};
      const SimulationResult result = simulate(config);
      double busy = 0.0;
      for (const TraceEntry& entry : result.trace) busy += entry.end - entry.start;
      std::printf(" | %.3f | %.3f", result.makespan / bound, result.exposed_transfer_seconds / busy);
    }
    std::printf(" |\n");
  }
}

// LRTF with a copy lane per device and direction that follows the scheduler's committed plan
// (Prefetch::kAlongPlan, `ahead` units), against max(work / G, longest chain, the busier direction's copy
// seconds / G).
void prefetch_along_plan() {
  const SyntheticWorkload workload = paper_workload();
  const UnitSeconds compute = workload.compute();
  std::printf("\n### (a'') LRTF with copies along the plan: weights in and gradients out, 0.5x / 2x a shard's "
              "forward each; makespan / bound (exposed copy share)\n\n");
  std::printf("| G | copy 0.5x, 4 ahead | copy 2x, 8 ahead | copy 2x, 32 ahead | copy 2x, 64 ahead "
              "|\n|---|---|---|---|---|\n");
  for (int devices : {1, 2, 4, 8, 16, 64}) {
    std::printf("| %d", devices);
    for (auto [fraction, ahead] : {std::pair{0.5, 4}, {2.0, 8}, {2.0, 32}, {2.0, 64}}) {
      SimulationConfig config{workload.tasks, compute, workload.transfer(fraction), devices, PolicyKind::kLrtf,
                              Mode::kSharp, 1, Prefetch::kAlongPlan, ahead, workload.transfer(fraction)};
      const SimulationResult result = simulate(config);
      const double bound = std::max(lower_bound(workload.tasks, compute, devices),
                                    transfer_bound(workload.tasks, config.transfer, config.gradient_transfer, devices));
      double busy = 0.0;
      for (const TraceEntry& entry : result.trace) busy += entry.end - entry.start;
      std::printf(" | %.3f (%.3f)", result.makespan / bound, result.exposed_transfer_seconds / busy);
    }
    std::printf(" |\n");
  }
}

// The same at 2x, on other draws of the workload's per-shard times (seeds 2 and 3).
void prefetch_along_plan_other_draws() {
  std::printf("\n### (a'') on other draws of the per-shard times: copies 2x a forward, makespan / bound\n\n");
  std::printf("| G | seed 2, 32 ahead | seed 2, 64 ahead | seed 3, 32 ahead | seed 3, 64 ahead |\n"
              "|---|---|---|---|---|\n");
  for (int devices : {1, 2, 4, 8, 16}) {
    std::printf("| %d", devices);
    for (uint64_t seed : {2, 3}) {
      const SyntheticWorkload workload = paper_workload(8, seed);
      for (int ahead : {32, 64}) {
        SimulationConfig config{workload.tasks, workload.compute(), workload.transfer(2.0), devices, PolicyKind::kLrtf,
                                Mode::kSharp, 1, Prefetch::kAlongPlan, ahead, workload.transfer(2.0)};
        const double bound =
            std::max(lower_bound(workload.tasks, config.compute, devices),
                     transfer_bound(workload.tasks, config.transfer, config.gradient_transfer, devices));
        std::printf(" | %.3f", simulate(config).makespan / bound);
      }
    }
    std::printf(" |\n");
  }
}

void cold_start() {
  const std::vector<double> sizes = {1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4};
  // A language model's shards: an embedding lookup (0.05 of a block), 24 blocks, the output head (2 blocks).
  std::vector<double> profile(26, 1.0);
  profile.front() = 0.05;
  profile.back() = 2.0;
  const SyntheticWorkload with_costs = sized_workload(sizes, profile, 8, 1e-3, 0.3, 1, true);
  const SyntheticWorkload without = sized_workload(sizes, profile, 8, 1e-3, 0.3, 1, false);
  const UnitSeconds compute = with_costs.compute();
  std::printf("\n### (c) Cold start: 12 models of 1x-4x sizes (26 shards: embedding 0.05, 24 blocks 1, head 2; "
              "8 micro-batches; +-30%%), unit times unknown at the start; makespan / lower bound\n\n");
  std::printf("| G | bound (s) | lrtf, shard costs | lrtf, no costs | fifo | round_robin | random |\n"
              "|---|---|---|---|---|---|---|\n");
  for (int devices : {1, 2, 4, 8}) {
    const double bound = lower_bound(with_costs.tasks, compute, devices);
    std::printf("| %d | %.3f", devices, bound);
    std::printf(" | %.3f", makespan(with_costs, devices, PolicyKind::kLrtf, Mode::kSharp, 0.0) / bound);
    for (PolicyKind policy : kPolicies) {
      std::printf(" | %.3f", makespan(without, devices, policy, Mode::kSharp, 0.0) / bound);
    }
    std::printf(" |\n");
  }
}

void decision_cost() {
  const SyntheticWorkload workload = paper_workload();
  std::printf("\n### (b) Decision cost: next()+complete(), one thread, 12 tasks\n\n");
  std::printf("| policy | pairs | ns per pair |\n|---|---|---|\n");
  for (PolicyKind policy : kPolicies) {
    int64_t pairs = 0;
    const auto start = std::chrono::steady_clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    while (elapsed() < 0.5) {
      Scheduler scheduler(workload.tasks, 1, policy, 1);
      while (auto unit = scheduler.try_next(0)) {
        scheduler.complete(0, *unit, 1e-3 * (1 + unit->shard % 3));
        ++pairs;
      }
    }
    std::printf("| %s | %lld | %.0f |\n", policy_name(policy).data(), static_cast<long long>(pairs),
                elapsed() * 1e9 / static_cast<double>(pairs));
  }
}

void at_cluster_scale(int kModels) {
  constexpr int kNodes = 16, kGpus = 8;
  std::vector<int> shards(kModels);
  for (int t = 0; t < kModels; ++t) shards[static_cast<size_t>(t)] = 24 + 12 * (t % 3);  // 24, 36, 48
  const SyntheticWorkload workload = synthetic_workload(shards, 8, 1e-3, 0.3, 7);
  std::printf("\n### (d) %d models (24/36/48 shards, 8 micro-batches, +-30%%) on %d nodes x %d GPUs: placement "
              "across nodes, LRTF inside each\n\n", kModels, kNodes, kGpus);
  std::printf("| node deaths | balancing | makespan / bound | moved after deaths | balancing moves | compute lost (s) | "
              "units | simulated us per unit | decision us per unit (one node's scheduler) |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  ClusterConfig config{workload.tasks, workload.compute(), kNodes, kGpus, PolicyKind::kLrtf, {}, 1};
  const double healthy = simulate_cluster(config).makespan;
  for (bool balance : {true, false}) {
  config.balance = balance;
  const std::vector<std::vector<NodeFailure>> scenarios = {
      {}, {{3, 0.5 * healthy}}, {{1, 0.2 * healthy}, {5, 0.4 * healthy}, {9, 0.6 * healthy}, {13, 0.8 * healthy}}};
  for (const std::vector<NodeFailure>& failures : scenarios) {
    config.failures = failures;
    const auto start = std::chrono::steady_clock::now();
    const ClusterResult result = simulate_cluster(config);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("| %zu | %s | %.3f | %lld | %lld | %.2f | %lld | %.2f |", failures.size(), balance ? "on" : "off",
                result.makespan / result.lower_bound, static_cast<long long>(result.moved_tasks),
                static_cast<long long>(result.balancing_moves), result.lost_seconds,
                static_cast<long long>(result.units), seconds * 1e6 / static_cast<double>(result.units));
    // The decisions alone: one node's share (the first 63 tasks) through next()+complete() on its 8 devices.
    const std::vector<TaskSpec> share(workload.tasks.begin(), workload.tasks.begin() + (kModels + kNodes - 1) / kNodes);
    int64_t pairs = 0;
    const auto begin = std::chrono::steady_clock::now();
    Scheduler scheduler(share, kGpus, PolicyKind::kLrtf, 1);
    for (bool any = true; any;) {
      any = false;
      for (int device = 0; device < kGpus; ++device) {
        if (auto unit = scheduler.try_next(device)) {
          scheduler.complete(device, *unit, 1e-3 * (1 + unit->shard % 3));
          ++pairs;
          any = true;
        }
      }
    }
    const double decisions = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::printf(" %.2f |\n", decisions * 1e6 / static_cast<double>(pairs));
  }
  }
}

}  // namespace

int main() {
  simulated_makespans();
  prefetch_along_plan();
  prefetch_along_plan_other_draws();
  cold_start();
  decision_cost();
  at_cluster_scale(1000);
  at_cluster_scale(40);  // 2.5 models a node: where balancing between nodes matters
  return 0;
}
