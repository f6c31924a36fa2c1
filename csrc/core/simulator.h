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
//
// Prefetch::kAlongPlan replaces the double-buffering rule with what the engine can do: each device has a
// host-to-device copy lane that, at every dispatch, copies the shards of the next `prefetch_units` units the
// scheduler plans for the device (Scheduler::plan), in order, as soon as the lane is free; a unit starts once
// its shard has landed. A copy for a unit the plan no longer holds is dropped (its lane time was spent). The
// same shard back to back needs no copy. Gradients go out on a device-to-host lane of their own, which the
// result accounts for; the compute never waits for it.
//
// Shared bases: a task with TaskSpec::base >= 0 reads its shard's frozen base weights too, whose copy
// (`base_transfer`) a device makes once for every task of that base while it keeps it: it keeps the last base
// shard it copied (one), so tasks of a base that run a shard back to back copy it once.
//
// Optimizer steps (SimulationConfig::steps, kAlongPlan only): each shard steps where its StepSchedule puts it
// (lanes.h), and the weights in and gradients out come from its lanes. After the backward that ends a step:
// - kHost: the gradient goes out on the device-to-host lane, then the host steps it on the one host lane all
//   devices share (first come, first served); every backward that does not end a step sums its gradient there.
//   The shard's next visit copies its weights only once the host step is done, and never reuses a copy across it.
// - kDevice: master and moments come in on the host-to-device lane right behind the backward's own weights (when
//   the plan prefetches them, or when the backward is dispatched); the device steps once they have landed and the
//   backward is done, then sends them back with the new weights, from which a later visit on another device copies.
// - kResident: the device steps; nothing is copied, ever.
// The device is busy until its step is done. A planned copy of a shard whose previous step is not yet done waits
// for a later dispatch. A task whose next forward would wait for a step (its first shard past the resident ones
// stepped on the host, or a device-stepped one in front of that) is held back until the step is done
// (hold_for_steps), so other tasks' units run meanwhile.
//
// The arena (SimulationConfig::arena_bytes >= 0, steps only): as the engine's does, a device keeps the weights it
// copied in (StepSchedule::weight_bytes each) and a later visit of the shard computes on them without a copy while no
// step has made them stale: a host step makes every copy stale, a device step rewrites the copy of the device that
// ran it (and its next visit waits for that step). A device step's state takes StepSchedule::state_bytes of the arena
// from its copy in until it is home, and a kHost gradient its weights' bytes from its backward's end until it has
// left (the unit's working set has room for the next one's); a state that does not fit beside those on the device
// waits, on the host-to-device lane, for them to go home in turn. The kept copies not in use or landing for a planned
// unit fit in what the states leave, and a prefetch goes only as far as there is room; beyond it the device evicts
// (simulator_cache.h): stale ones first, then the copy needed furthest ahead along its plan. The units in use are the
// working set the budget keeps apart.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/lanes.h"
#include "core/policy.h"
#include "core/unit.h"

namespace hydra::core {

enum class Mode { kSharp, kTaskParallel, kModelParallel };

// Seconds for one unit of (task, shard, phase); the same for every micro-batch.
using UnitSeconds = std::function<double(int task, int shard, Phase phase)>;

enum class Prefetch { kPreviousUnit, kAlongPlan };

struct SimulationConfig {
  std::vector<TaskSpec> tasks;
  UnitSeconds compute;
  UnitSeconds transfer;  // weights in; empty: transfers are free
  int num_devices = 1;
  PolicyKind policy = PolicyKind::kLrtf;
  Mode mode = Mode::kSharp;
  uint64_t seed = 0;
  Prefetch prefetch = Prefetch::kPreviousUnit;
  int prefetch_units = 4;            // kAlongPlan: copies issued or landed ahead of use, at most
  UnitSeconds gradient_transfer;     // kAlongPlan: gradients out after a unit with a backward; empty: none
  UnitSeconds base_transfer;         // the unit's base shard in, for tasks with a base; empty: free
  // Per task: its steps and where each shard steps (see above). Weights in and gradients out then come from here,
  // and transfer and gradient_transfer must be empty; the tasks may not evaluate. Empty: no step is modelled.
  std::vector<StepSchedule> steps;
  // Steps: a task whose next forward would wait for a step just queued (see above) is held back (Scheduler::hold)
  // until that step is done, as the engine's device loop holds it (hydra_torch.run.workers.HOLD_FOR_STEPS).
  bool hold_for_steps = true;
  // Steps: device bytes of each device's arena (see above): the weight copies it keeps between visits and its device
  // steps' states; -1: no copy kept (a shard's weights are copied at every visit but the same shard's back to back),
  // and the states take no room.
  int64_t arena_bytes = -1;
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
  double exposed_transfer_seconds = 0.0;  // devices waiting for weights
  double transfer_seconds = 0.0;          // kAlongPlan: busy time of the host-to-device lanes, dropped copies too
  double gradient_transfer_seconds = 0.0;  // kAlongPlan: busy time of the device-to-host lanes
  double base_transfer_seconds = 0.0;      // of which (or of the exposed time, kPreviousUnit): base shards copied
  double host_seconds = 0.0;               // steps: busy time of the host lane
  double device_step_seconds = 0.0;        // steps: device time of kDevice and kResident steps
  int64_t kept_visits = 0;                  // visits that computed on a copy kept from before (arena_bytes)
  std::vector<TraceEntry> trace;  // in dispatch order
};

// Throws std::invalid_argument for an empty compute function or a negative/non-finite unit time, and for
// everything the Scheduler rejects.
SimulationResult simulate(const SimulationConfig& config);

// The tasks' shapes under a placement (lanes.h) as a run to simulate: SHARP along each device's plan, LRTF.
// `arena_bytes` >= 0: each device keeps weight copies and its device steps' states in that many bytes (see above).
SimulationConfig lane_simulation(const std::vector<TaskShape>& tasks, const Placement& placement,
                                 const LaneRates& rates, const StepBytes& bytes, int num_devices,
                                 int64_t arena_bytes = -1);

// Seconds of compute in one task's whole chain.
double task_seconds(const std::vector<TaskSpec>& tasks, int task, const UnitSeconds& compute);

// No schedule on num_devices devices can beat max(total compute / num_devices, longest task chain).
double lower_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute, int num_devices);

// No schedule copying each unit's shard in (the same shard back to back excepted, at most once per micro-batch
// boundary: B(0) then the next F(0)) over one link per device and direction can beat this: the busier
// direction's total copy seconds / num_devices.
double transfer_bound(const std::vector<TaskSpec>& tasks, const UnitSeconds& transfer,
                      const UnitSeconds& gradient_transfer, int num_devices);

// kTaskParallel's binding: device per task.
std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      int num_devices);
// The same, onto devices that already carry `load` seconds of work each (one device per entry).
std::vector<int> assign_longest_first(const std::vector<TaskSpec>& tasks, const UnitSeconds& compute,
                                      std::vector<double> load);

}  // namespace hydra::core
