// Simulator: the paper's toy example, trace validity, lower bounds, and LRTF's distance from the bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <vector>

#include "core/simulator.h"
#include "core/synthetic_workload.h"

namespace {

using namespace hydra::core;

// The paper's toy: 3 models, 2 devices, 4 units of 1 time unit per model. A model with one shard and 4
// micro-batches is exactly that: each micro-batch is a single FB(0) unit, so 4 equal units per model
// (with >= 2 shards, 2n-1 is odd and no micro-batch count gives 4).
SimulationConfig toy(Mode mode, PolicyKind policy = PolicyKind::kLrtf) {
  SimulationConfig config;
  config.tasks = std::vector<TaskSpec>(3, TaskSpec{1, 4, std::nullopt});
  config.compute = [](int, int, Phase) { return 1.0; };
  config.num_devices = 2;
  config.mode = mode;
  config.policy = policy;
  return config;
}

void expect_valid_trace(const SimulationConfig& config, const SimulationResult& result) {
  std::map<int, std::vector<TraceEntry>> by_device;
  std::map<int, std::vector<TraceEntry>> by_task;
  for (const TraceEntry& entry : result.trace) {
    by_device[entry.device].push_back(entry);
    by_task[entry.task].push_back(entry);
    EXPECT_LE(entry.end, result.makespan + 1e-12);
  }
  auto by_start = [](const TraceEntry& a, const TraceEntry& b) { return a.start < b.start; };
  for (auto& [device, entries] : by_device) {
    std::sort(entries.begin(), entries.end(), by_start);
    for (size_t i = 1; i < entries.size(); ++i) {
      EXPECT_LE(entries[i - 1].end, entries[i].start + 1e-12) << "device " << device << " overlaps";
    }
  }
  ASSERT_EQ(by_task.size(), config.tasks.size());
  for (auto& [task, entries] : by_task) {
    std::sort(entries.begin(), entries.end(), by_start);
    ASSERT_EQ(static_cast<int64_t>(entries.size()), total_units(config.tasks[static_cast<size_t>(task)]));
    for (size_t i = 0; i < entries.size(); ++i) {
      EXPECT_EQ(entries[i].index, static_cast<int64_t>(i)) << "task " << task << " out of order";
      if (i > 0) EXPECT_LE(entries[i - 1].end, entries[i].start + 1e-12) << "task " << task << " overlaps";
    }
  }
}

TEST(Simulator, PaperToyExampleModelParallel12TaskParallel8Sharp6) {
  EXPECT_DOUBLE_EQ(simulate(toy(Mode::kModelParallel)).makespan, 12.0);
  EXPECT_DOUBLE_EQ(simulate(toy(Mode::kTaskParallel)).makespan, 8.0);
  const SimulationResult sharp = simulate(toy(Mode::kSharp));
  EXPECT_DOUBLE_EQ(sharp.makespan, 6.0);
  expect_valid_trace(toy(Mode::kSharp), sharp);
  EXPECT_DOUBLE_EQ(lower_bound(toy(Mode::kSharp).tasks, toy(Mode::kSharp).compute, 2), 6.0);
}

TEST(Simulator, TaskParallelAssignsLongestFirstToTheLeastLoadedDevice) {
  const std::vector<TaskSpec> tasks(4, TaskSpec{1, 1, std::nullopt});
  const UnitSeconds compute = [](int task, int, Phase) { return std::vector<double>{3, 5, 2, 4}[task]; };
  // 5 -> d0, 4 -> d1, 3 -> d1 (4 < 5), 2 -> d0.
  EXPECT_EQ(assign_longest_first(tasks, compute, 2), (std::vector<int>{1, 0, 0, 1}));
}

TEST(Simulator, EveryModeAndPolicyProducesAValidTraceAboveTheBound) {
  const SyntheticWorkload workload = synthetic_workload({3, 5, 2, 4, 6}, 2, 1.0, 0.3, 4);
  for (Mode mode : {Mode::kSharp, Mode::kTaskParallel, Mode::kModelParallel}) {
    for (PolicyKind policy : {PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom}) {
      for (int devices : {1, 2, 3}) {
        SimulationConfig config{workload.tasks, workload.compute(), workload.transfer(0.5), devices, policy, mode, 7};
        const SimulationResult result = simulate(config);
        expect_valid_trace(config, result);
        EXPECT_GE(result.makespan, lower_bound(config.tasks, config.compute, devices) - 1e-9);
      }
    }
  }
}

TEST(Simulator, DoubleBufferingHidesTransfersBehindTheDevicesPreviousUnit) {
  // One task of two shards, one micro-batch: F0, FB1, B0, each 1 s; copies 0.4 s.
  SimulationConfig config;
  config.tasks = {TaskSpec{2, 1, std::nullopt}};
  config.compute = [](int, int, Phase) { return 1.0; };
  config.transfer = [](int, int, Phase) { return 0.4; };
  const SimulationResult result = simulate(config);
  // F0's copy is exposed (idle device), FB1's hides behind F0, B0's behind FB1.
  EXPECT_DOUBLE_EQ(result.exposed_transfer_seconds, 0.4);
  EXPECT_DOUBLE_EQ(result.makespan, 3.4);
  config.transfer = [](int, int, Phase) { return 1.5; };
  EXPECT_DOUBLE_EQ(simulate(config).makespan, 3.0 + 1.5 + 0.5 + 0.5);
  // A second micro-batch starts with F0 right after B0: the same shard, already resident.
  config.tasks[0].micro_batches = 2;
  EXPECT_DOUBLE_EQ(simulate(config).exposed_transfer_seconds, 1.5 + 0.5 + 0.5 + 0.0 + 0.5 + 0.5);
}

TEST(Simulator, TasksOfABaseCopyItsShardsOnceForAShardRunBackToBack) {
  // Eight tasks of four shards, each shard's base weights 10x its own; copies along the plan. Shared, LRTF runs
  // the tasks a shard back to back and the device copies each base shard once for all of them; separate, every
  // visit copies its own.
  for (const bool shared : {false, true}) {
    SimulationConfig config;
    for (int t = 0; t < 8; ++t) {
      TaskSpec spec{4, 2, std::nullopt};
      spec.base = shared ? 0 : -1;
      config.tasks.push_back(spec);
    }
    config.compute = [](int, int, Phase) { return 1.0; };
    config.prefetch = Prefetch::kAlongPlan;
    if (shared) {
      config.transfer = [](int, int, Phase) { return 0.1; };
      config.base_transfer = [](int, int, Phase) { return 1.0; };
    } else {
      config.transfer = [](int, int, Phase) { return 1.1; };
    }
    const SimulationResult result = simulate(config);
    expect_valid_trace(config, result);
    const double visits = 8 * 2 * 7;  // units; back-to-back visits of one shard copy nothing either way
    if (shared) {
      EXPECT_GT(result.base_transfer_seconds, 0.0);
      EXPECT_LE(result.base_transfer_seconds, 1.2 / 8 * visits) << "base shards copied once a shard run";
      EXPECT_LE(result.makespan, visits * 1.0 * 1.05) << "compute-bound";
    } else {
      EXPECT_EQ(result.base_transfer_seconds, 0.0);
      EXPECT_GE(result.transfer_seconds, 1.1 * visits * 0.9);
      EXPECT_GE(result.makespan, 1.1 * visits * 0.9) << "copy-bound";
    }
  }
}

TEST(Simulator, RestrictedTasksStayOnTheirDevice) {
  SimulationConfig config = toy(Mode::kSharp);
  config.tasks[0].device = 1;
  const SimulationResult result = simulate(config);
  for (const TraceEntry& entry : result.trace) {
    if (entry.task == 0) EXPECT_EQ(entry.device, 1);
  }
  expect_valid_trace(config, result);
}

TEST(Simulator, RejectsBadInput) {
  SimulationConfig config = toy(Mode::kSharp);
  config.compute = nullptr;
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = toy(Mode::kSharp);
  config.compute = [](int, int, Phase) { return -1.0; };
  EXPECT_THROW(simulate(config), std::invalid_argument);
  config = toy(Mode::kTaskParallel);
  config.tasks[0].device = 5;
  EXPECT_THROW(simulate(config), std::invalid_argument);
}

class LrtfNearTheBound : public ::testing::TestWithParam<int> {};

TEST_P(LrtfNearTheBound, TwelveMixedModelsWithinFivePercent) {
  const int devices = GetParam();
  const SyntheticWorkload workload = paper_workload();
  SimulationConfig config{workload.tasks, workload.compute(), {}, devices, PolicyKind::kLrtf, Mode::kSharp, 0};
  const double makespan = simulate(config).makespan;
  const double bound = lower_bound(config.tasks, config.compute, devices);
  EXPECT_LE(makespan, 1.05 * bound) << "G=" << devices << " makespan/bound = " << makespan / bound;
}

INSTANTIATE_TEST_SUITE_P(Devices, LrtfNearTheBound, ::testing::Values(1, 2, 4, 8));

}  // namespace
