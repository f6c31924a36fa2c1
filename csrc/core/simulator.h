// Discrete-event simulation of a multi-model training run, driving the real Scheduler (and so the very
// policy code the live workers use) with durations from a cost function instead of a device.
//
// Modes:
//   kSharp          every task on any device, a device switching task after every unit (Hydra).
//   kTaskParallel   each task bound to one device for the whole run; tasks assigned greedily, largest
//                   total work first, to the least-loaded device (LPT). A TaskSpec::device is honoured.
//   kModelParallel  one task at a time, tasks in id order; each task's shards split into contiguous
//                   blocks over the devices, so its units hop devices but never overlap (no pipelining).
//
// Transfer rule (double buffering): before a unit computes, its shard's weights must be on the device.
// - The same (task, shard) ran on this device just before (e.g. B(0) then the next micro-batch's F(0)):
//   the shard is resident, no transfer.
// - The device ran another unit that ended exactly when this one starts: the copy overlapped that unit's
//   compute, so only max(0, transfer - previous compute) is exposed.
// - The device was idle (or this is its first unit): nothing to hide the copy behind; it is all exposed.
// kModelParallel keeps every shard resident on its device (the baseline's one advantage): no transfers.
// The cost model is fed compute seconds only; exposed transfer is the engine's overhead, not the shard's.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/policy.h"
#include "core/unit.h"

namespace hydra::core {

enum class Mode { kSharp, kTaskParallel, kModelParallel };

// Seconds for one unit of (task, shard, phase); the same for every micro-batch.
using UnitSeconds = std::function<double(int task, int shard, Phase phase)>;

struct SimulationConfig {
  std::vector<TaskSpec> tasks;
  UnitSeconds compute;
  UnitSeconds transfer;  // empty: transfers are free
  int num_devices = 1;
  PolicyKind policy = PolicyKind::kLrtf;
  Mode mode = Mode::kSharp;
  uint64_t seed = 0;
};

struct TraceEntry {
  int device;
  int task;
  int64_t index;
  double start;
  double end;  // includes the exposed part of the transfer
};

struct SimulationResult {
  double makespan = 0.0;
  double exposed_transfer_seconds = 0.0;
  std::vector<TraceEntry> trace;  // in dispatch order
};

// Throws std::invalid_argument for an empty compute function or a negative/non-finite unit time, and for
// everything the Scheduler rejects.
SimulationResult simulate(const SimulationConfig& config);

// Seconds of compute in one task's whole chain.
double task_seconds(const std::vector<TaskSpec>& tasks, int task, const UnitSeconds& compute);

// No schedule on num_devices devices can beat max(total compute / num_devices, longest task chain).
double lower_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute, int num_devices);

// kTaskParallel's binding: device per task.
std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      int num_devices);
// The same, onto devices that already carry `load` seconds of work each (one device per entry).
std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      std::vector<double> load);

}  // namespace hydra::core
