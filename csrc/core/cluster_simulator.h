// Discrete-event simulation of a run across nodes, as hydra_torch.cluster runs it: tasks placed on nodes
// largest first to the least-loaded node (by compute seconds), then SHARP inside each node (the simulator of
// simulator.h over the node's devices). A node that dies loses the micro-batch each of its tasks was in (they
// checkpoint at every step boundary); those tasks are queued on the nodes alive, largest first to the node
// with the least work left (the rest of its run and its queue), and a node runs its queue once its run ends,
// the tasks resuming with the micro-batches they had left. With `balance`, a node left with nothing to do when
// a run ends or a node dies takes a task from the node run with the most work left, as the driver does.
#pragma once

#include <cstdint>
#include <vector>

#include "core/simulator.h"

namespace hydra::core {

struct NodeFailure {
  int node;
  double seconds;  // after the start of the run
};

struct ClusterConfig {
  std::vector<TaskSpec> tasks;  // TaskSpec::device is ignored: any device of the task's node
  UnitSeconds compute;
  int num_nodes = 1;
  int devices_per_node = 1;
  PolicyKind policy = PolicyKind::kLrtf;
  std::vector<NodeFailure> failures;
  uint64_t seed = 0;
  bool balance = true;  // a node with nothing to do takes a task from the busiest (see simulate_cluster)
};

struct ClusterResult {
  double makespan = 0.0;
  double lower_bound = 0.0;      // max(total compute / all devices, longest task chain): failures ignored
  int64_t units = 0;             // units simulated, those a failure lost included
  double lost_seconds = 0.0;     // compute of the units a failure lost
  double rebalance_lost_seconds = 0.0;  // of the units balancing lost (a donor's micro-batches in progress)
  int64_t moved_tasks = 0;       // task restarts on another node after a death
  int64_t balancing_moves = 0;   // tasks a node with nothing to do took from a busy one
  std::vector<double> node_end;  // when each node finished its last run (or died)
};

// Throws std::invalid_argument for num_nodes or devices_per_node < 1, a failure of an unknown node or at a
// negative time, and for everything simulate() rejects. A task left when every node has died makes the run
// end with it unfinished: makespan is then infinite.
ClusterResult simulate_cluster(const ClusterConfig& config);

}  // namespace hydra::core
