// Cluster simulator: placement across nodes plus SHARP inside each; node failures that move tasks.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "core/cluster_simulator.h"

namespace {

using namespace hydra::core;

// Equal one-shard tasks of `micro_batches` units of one second each: a task's work is its micro-batch count.
ClusterConfig unit_tasks(std::vector<int64_t> micro_batches, int nodes, int devices) {
  ClusterConfig config;
  for (int64_t m : micro_batches) config.tasks.push_back(TaskSpec{1, m, std::nullopt});
  config.compute = [](int, int, Phase) { return 1.0; };
  config.num_nodes = nodes;
  config.devices_per_node = devices;
  config.balance = false;  // the placement and queueing rules alone; balancing has tests of its own
  return config;
}

TEST(ClusterSimulator, WithoutFailuresEachNodeRunsItsShareAndTheBoundHolds) {
  // Works 8, 6, 5, 4, 3 on 2 nodes of one device: LPT gives {8, 4} = 12 and {6, 5, 3} = 14.
  const ClusterResult result = simulate_cluster(unit_tasks({8, 6, 5, 4, 3}, 2, 1));
  EXPECT_DOUBLE_EQ(result.makespan, 14.0);
  EXPECT_DOUBLE_EQ(result.lower_bound, 13.0);
  EXPECT_EQ(result.units, 26);
  EXPECT_EQ(result.moved_tasks, 0);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.0);
  EXPECT_EQ(result.node_end, (std::vector<double>{12.0, 14.0}));
}

TEST(ClusterSimulator, OneNodeIsTheSingleMachineSimulator) {
  ClusterConfig config = unit_tasks({4, 4, 4}, 1, 2);
  SimulationConfig single{config.tasks, config.compute, {}, 2, PolicyKind::kLrtf, Mode::kSharp, 0};
  EXPECT_DOUBLE_EQ(simulate_cluster(config).makespan, simulate(single).makespan);
}

TEST(ClusterSimulator, ADeadNodesTasksKeepTheirCompletedMicroBatchesAndMoveToAFreeNode) {
  // Node 1 runs the task of 6 and dies at 2.5 s: it keeps 2 micro-batches, loses half of the third, and waits
  // for node 0 (done with its 8 at 8 s) to run its other 4.
  ClusterConfig config = unit_tasks({8, 6}, 2, 1);
  config.failures = {{1, 2.5}};
  const ClusterResult result = simulate_cluster(config);
  EXPECT_EQ(result.moved_tasks, 1);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.5);
  EXPECT_DOUBLE_EQ(result.makespan, 12.0);
  EXPECT_EQ(result.units, 8 + 3 + 4);
  EXPECT_DOUBLE_EQ(result.node_end[1], 2.5);
}

TEST(ClusterSimulator, AnIdleNodeTakesADeadNodesTasksAtOnce) {
  ClusterConfig config = unit_tasks({2, 6}, 2, 1);
  config.failures = {{1, 3.0}};  // node 0 has been idle since 2 s
  const ClusterResult result = simulate_cluster(config);
  EXPECT_DOUBLE_EQ(result.makespan, 6.0);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.0);
}

TEST(ClusterSimulator, ADeadNodesTasksAreSpreadOverTheNodesLeftByTheirWork) {
  // 9 -> node 0, 7 -> node 1, 3 and 3 -> node 2, which dies at once: one 3 is queued behind node 1's 7 (the
  // least work), the other behind node 0's 9 (now the least), so both end by 12, not 7 + 6 = 13 on one node.
  ClusterConfig config = unit_tasks({9, 7, 3, 3}, 3, 1);
  config.failures = {{2, 0.0}};
  const ClusterResult result = simulate_cluster(config);
  EXPECT_DOUBLE_EQ(result.makespan, 12.0);
  EXPECT_EQ(result.node_end, (std::vector<double>{12.0, 10.0, 0.0}));
  EXPECT_EQ(result.moved_tasks, 2);
}

TEST(ClusterSimulator, ANodeWithNothingLeftTakesATaskFromTheBusiestNode) {
  // 6, 6, 6 on 2 one-device nodes: node 0 trains two side by side (12 s), node 1 one (6 s). At 6 s node 0's two
  // have 3 s each left; node 1 takes one, and both nodes end at 9 s.
  ClusterConfig config = unit_tasks({6, 6, 6}, 2, 1);
  config.balance = true;
  const ClusterResult result = simulate_cluster(config);
  EXPECT_EQ(result.balancing_moves, 1);
  EXPECT_DOUBLE_EQ(result.makespan, 9.0);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.0);            // no failure
  EXPECT_DOUBLE_EQ(result.rebalance_lost_seconds, 0.0);  // at 6 s both sit at a micro-batch boundary
  config.balance = false;
  EXPECT_DOUBLE_EQ(simulate_cluster(config).makespan, 12.0);
}

TEST(ClusterSimulator, ATaskNearItsEndOrHoldingMostOfTheWorkStays) {
  // 9 on node 0, 3 and 3 on node 1 (one device each). Node 1 ends at 6 s; node 0's
  // only task holds all its work: moving it would not help.
  ClusterConfig config = unit_tasks({9, 3, 3}, 2, 1);
  config.balance = true;
  const ClusterResult result = simulate_cluster(config);
  EXPECT_EQ(result.balancing_moves, 0);
  EXPECT_DOUBLE_EQ(result.makespan, 9.0);
}

// Node 0 trains a task of 8, node 1 one of 4 micro-batches evaluated after the 2nd and the 4th (one-shard
// units of 1 s: FB FB E FB FB E). Node 1 dies; the task resumes behind node 0's run, at 8 s.
TEST(ClusterSimulator, AnEvaluationInProgressIsRunAgainAndACompletedOneIsNot) {
  ClusterConfig config = unit_tasks({8, 4}, 2, 1);
  config.tasks[1].eval_after = {2, 4};
  config.tasks[1].eval_batches = 1;
  config.failures = {{1, 2.5}};  // in the first evaluation: it runs again, E FB FB E, ending at 12
  ClusterResult result = simulate_cluster(config);
  EXPECT_DOUBLE_EQ(result.makespan, 12.0);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.5);
  config.failures = {{1, 3.5}};  // after it: FB FB E, ending at 11
  result = simulate_cluster(config);
  EXPECT_DOUBLE_EQ(result.makespan, 11.0);
  EXPECT_DOUBLE_EQ(result.lost_seconds, 0.5);
  EXPECT_EQ(result.units, 4 + 8 + 3);
}

TEST(ClusterSimulator, WhenEveryNodeDiesTheRunNeverEnds) {
  ClusterConfig config = unit_tasks({5, 5}, 2, 1);
  config.failures = {{0, 1.0}, {1, 1.5}};
  EXPECT_TRUE(std::isinf(simulate_cluster(config).makespan));
}

TEST(ClusterSimulator, BadConfigurationsAreRefused) {
  EXPECT_THROW(simulate_cluster(unit_tasks({1}, 0, 1)), std::invalid_argument);
  EXPECT_THROW(simulate_cluster(unit_tasks({1}, 1, 0)), std::invalid_argument);
  ClusterConfig config = unit_tasks({1}, 2, 1);
  config.failures = {{2, 1.0}};
  EXPECT_THROW(simulate_cluster(config), std::invalid_argument);
  config.failures = {{0, -1.0}};
  EXPECT_THROW(simulate_cluster(config), std::invalid_argument);
}

}  // namespace
