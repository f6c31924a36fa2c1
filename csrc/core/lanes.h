// The lanes a training run keeps busy, where each shard's optimizer step runs, and the placement that keeps the
// busiest lane least busy. Torch-free: placement reads it, the simulator follows it, benchmarks forecast with it.
//
// Lanes. Per device: compute, host-to-device copies, device-to-host copies. One host lane for all devices: the
// host steps' memory traffic at the rate the host-step pool sustains (LaneRates::host). The copies' own traffic
// through host memory is carried by the copy lanes, not the host lane: the host's rate is what its cores step at,
// which on a GPU box is well below what its memory serves the copy engines.
//
// Where a shard of a spilled model steps (StepPlace):
//   kHost      its gradient goes out after every backward (summed on the host when a step accumulates, and, for a
//              tied weight it borrows, into the owner's, unless the owner is kDevice: that part then sums in the
//              owner's buffer on the device), the host steps it, and its next visit copies the stepped weights in.
//              The fp32 master and the optimizer moments never leave the host.
//   kDevice    its gradient stays on the device (held there for the whole run where a step sums several backwards,
//              where it owns a tied weight (every borrower's gradient of it sums in its buffer), or where it borrows
//              one from a kHost owner; else from its backward to its step, in the unit's working set as a kHost
//              shard's is); after the step's last backward its master and moments come in (prefetched while that
//              backward computes), the device steps them, and master, moments and the new weights go back out. No
//              host arithmetic, about 12 bytes a parameter each way on the copy lanes, and no round trip through the
//              host before its next visit. Its gradient of a tied weight a kHost owner steps goes out after every
//              backward, summed on the host as a kHost borrower's is.
//   kResident  weights, gradient, master and moments live on the device for the whole run and step there: no copy,
//              for 16 bytes a parameter (bf16 with AdamW) of device memory.
// The bound counts a weight copy at every visit of a kHost or kDevice shard on one device (but the first shard's
// backward and next forward back to back, where no host step comes between): an upper estimate of the copy lanes
// where a device keeps weights between visits, as the engine's arena and the simulator in a room do (lane_plan.h's
// simulation_in_room). On several devices it counts one a step of a kHost shard and one in all of a kDevice one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/unit.h"

namespace hydra::core {

enum class StepPlace : uint8_t { kHost, kDevice, kResident };

const char* step_place_name(StepPlace place);

struct LaneRates {
  double host_to_device;  // bytes/s, each device's link
  double device_to_host;  // bytes/s
  double host;            // bytes/s of host-step memory traffic, all devices' steps together
  double device_memory;   // bytes/s of a device step's memory traffic
};

// Bytes per element. The defaults are bf16 compute with AdamW, as the engine counts them (Results.stats'
// host_step_bytes): fp32 compute with AdamW has weight 4, state 8 (the master is the weight), resident 16.
struct StepBytes {
  double weight = 2;            // a weight copied in, a gradient copied out (the compute dtype)
  double state = 12;            // fp32 master and moments: what a kDevice step brings in and sends back
  double host_step = 28;        // host memory one host step touches a parameter
  double host_accumulate = 8;   // each micro-batch's gradient summed on the host when a step accumulates
  double device_step = 28;      // device memory one device step touches a parameter

  // The fp32 master is the weight itself where the compute dtype is fp32 (4 bytes), apart from it (in `state`) in
  // bf16. A kDevice step copies the master and the moments in, and sends them home with, in bf16, the new weights.
  bool master_is_weight() const { return weight >= 4; }
  double state_in() const { return state + (master_is_weight() ? weight : 0.0); }
  double state_out() const { return state + weight; }
};

struct ShardShape {
  double forward_seconds = 0.0;   // F(s) of one micro-batch on one device
  double backward_seconds = 0.0;  // B(s), recomputation included; the last shard's FB is forward + backward
  int64_t weights = 0;  // elements its visit reads and copies in (a tied weight it borrows included)
  int64_t grads = 0;    // gradient elements its backward produces (a borrowed tied weight's included)
  int64_t params = 0;   // elements it owns and steps
  int tied_to = -1;     // a shard of the same task whose weights it borrows: resident only where that one is
  int64_t borrowed = 0;  // elements of `weights` borrowed from tied_to, frozen ones included (0: only the trainable
                         // ones are known, grads - params)
  int64_t borrowed_weights() const { return std::max(borrowed, std::max<int64_t>(0, grads - params)); }
};

struct TaskShape {
  std::vector<ShardShape> shards;
  int64_t micro_batches = 1;  // over the whole run
  int64_t accumulate = 1;     // micro-batches a step
  bool clipped = false;       // a clipped step waits for every shard's gradients
  bool fixed = false;         // its placement is kept as the start has it (a task already training): it loads the
                              // lanes, and no move of the lane model's choice is made on its shards
  // Per shard (empty: none), kept as the start has it: where the engine would not move it (a task placed mid-run
  // steps no tied shard off the host), so that the choice is of what the engine grants.
  std::vector<bool> kept;
  // Whether any of `shards` is kept so.
  bool keeps(const std::vector<int>& shards) const {
    return fixed || (!kept.empty() && std::any_of(shards.begin(), shards.end(),
                                                  [&](int s) { return kept[static_cast<size_t>(s)]; }));
  }
  // Whether a step sums several backwards of a shard: then a kDevice shard's gradients are held between them.
  bool sums_backwards() const { return accumulate > 1 || clipped; }
};

using Placement = std::vector<std::vector<StepPlace>>;  // per task, per shard

// One shard's lane seconds in one place: per visit, per backward, per step.
struct ShardLanes {
  double weights_in = 0.0;       // each visit (kHost, kDevice)
  double gradient_out = 0.0;     // each backward (kHost)
  double host_accumulate = 0.0;  // each backward that does not end a step, on the host lane (kHost)
  double host_step = 0.0;        // each step, on the host lane (kHost)
  double state_in = 0.0;         // each step (kDevice)
  double device_step = 0.0;      // each step, on the device's compute (kDevice, kResident)
  double state_out = 0.0;        // each step (kDevice)
};

// `tie_apart`: the shard borrows a trainable tied weight whose owner steps on the other side of host and device
// (tie_apart below): its gradient of it sums where the owner steps.
ShardLanes shard_lanes(const ShardShape& shard, StepPlace place, bool accumulates, const LaneRates& rates,
                       const StepBytes& bytes, bool tie_apart = false);
// Whether shard `s` borrows a trainable tied weight (gradients beyond what it owns) from a shard placed apart from it:
// one stepped on the host, the other on the device (kDevice or kResident).
bool tie_apart(const TaskShape& task, const std::vector<StepPlace>& places, int s);
// Shard `s` as its placement copies it: a spilled borrower of a kResident owner reads the tied weight in the owner's
// home, and copies in and holds only the rest (`weights` less what it borrows, frozen or not: borrowed_weights).
ShardShape as_placed(const TaskShape& task, const std::vector<StepPlace>& places, int s);

// Device memory a shard in `place` holds for the whole run (a home, or a kDevice shard's gradient buffer of what it
// owns where its task's steps sum several backwards, `sums_backwards`; a tie's owner's otherwise is counted by
// placement_bytes and choose_placement), and what its step needs while it runs beyond the working
// set of a unit (its weights and gradients) that every room leaves out (kDevice: master, moments and the new
// weights' staging, less the gradients' share of the working set where they are held apart).
int64_t held_bytes(const ShardShape& shard, StepPlace place, const StepBytes& bytes, bool sums_backwards);
int64_t step_room(const ShardShape& shard, StepPlace place, const StepBytes& bytes, bool sums_backwards,
                  bool tie_apart = false);

struct LaneBound {
  double compute = 0.0;         // busiest device's lanes, with tasks spread evenly: totals / devices
  double host_to_device = 0.0;
  double device_to_host = 0.0;
  double host = 0.0;            // the one host lane
  double chain = 0.0;           // the longest task's own chain: its units, its device steps, its step round trips
  double bound() const;         // no schedule is shorter than the largest of them
};

// What the placement puts on each lane. A lower bound on the simulated makespan (simulate with lane_simulation).
LaneBound lane_bound(const std::vector<TaskShape>& tasks, const Placement& placement, const LaneRates& rates,
                     const StepBytes& bytes, int num_devices);

// A placement with the smallest bound found: from `start` (empty: every shard on kHost), one move at a time (a shard,
// with the shards tied to it, towards kDevice or kResident; to kResident also a tie's owners alone, where each borrower
// has weights of its own to train: owners_alone) while the lanes, largest first, fall; within `room` bytes a
// device for homes, kept gradients and `step_rooms` device steps' rooms (two: the two largest, one step's state goes
// home as the next one's comes in; one: the largest, the steps take turns) beyond what the start's shards hold (homes
// leave room for one step). kResident only with one device, where a
// task's home is. `headroom` < 1 counts the copy and host lanes that much busier, so that they keep slack: a lane near
// full queues, and a step late off the host stalls the shard's next visit (see lane_plan.h, which picks it by
// simulation). Without `homes` no shard moves to kResident: one home takes the room of several device steps' gradient
// buffers, so moves that each pay most can together pay less. A `fixed` task's shards stay where the start has them.
// Throws std::invalid_argument for malformed shapes, rates or start.
Placement choose_placement(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
                           int num_devices, int64_t room, double headroom = 1.0, const Placement& start = {},
                           bool homes = true, int step_rooms = 2);
Placement host_placement(const std::vector<TaskShape>& tasks);
// The shards tied to `shard`, and to them, in order: the lane model moves them as one.
std::vector<int> tie_group(const TaskShape& task, int shard);

// Device memory a placement asks: held bytes (beyond what `start`'s shards hold, where given) plus its device steps'
// rooms: the two largest (`step_rooms` 2: one step's state on its way home while the next one's comes in), the
// largest (1: the steps take turns, as the simulator's arena makes them where two do not fit), or none (0: what it
// holds for the whole run).
int64_t placement_bytes(const std::vector<TaskShape>& tasks, const Placement& placement, const StepBytes& bytes,
                        const Placement& start = {}, int step_rooms = 2);

// The simulator's view of a task under a placement.
struct StepSchedule {
  int64_t accumulate = 1;
  std::vector<StepPlace> places;   // per shard
  std::vector<ShardLanes> lanes;   // per shard, in its place
  std::vector<int64_t> weight_bytes;  // per shard: device bytes its weights' copy takes (a kept copy, simulator.h)
  std::vector<int64_t> state_bytes;   // per shard: device bytes its step's state takes while there (kDevice: step_room)
};
std::vector<StepSchedule> step_schedules(const std::vector<TaskShape>& tasks, const Placement& placement,
                                         const LaneRates& rates, const StepBytes& bytes);
std::vector<TaskSpec> task_specs(const std::vector<TaskShape>& tasks);  // shard costs: forward + backward, if all > 0
double unit_seconds(const std::vector<TaskShape>& tasks, int task, int shard, Phase phase);

}  // namespace hydra::core
