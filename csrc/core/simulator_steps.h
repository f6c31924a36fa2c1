// The simulator's step lanes (SimulationConfig::steps): where each shard steps, the host lane's jobs, and what
// follows a unit's compute (its gradient out, its step). Internal to csrc/core, beside simulator_units.h.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/simulator.h"

namespace hydra::core::simulated {

// Per (task, shard) under SimulationConfig::steps: steps issued so far, and when the latest step's weights are on
// the host to copy in.
struct ShardSteps {
  int64_t issued = 0;
  double ready = 0.0;    // its host copy is current: the next copy in may start
  double stepped = 0.0;  // a kDevice shard: its last step has rewritten the copy the device holds
};

// Each task's gradients land in this many buffers, as a model's do in the engine (kLandingBuffers in
// spilled_model.cpp). A gradient's copy out begins only while its task's jobs on the host lane leave one free (each
// holds its buffer until it ends), and a step that holds one lets lower shards' steps run between its parts only
// while another is free.
constexpr int kLandingBuffers = 3;

// A device's device-to-host lane, as the spans of the copies it runs. A copy that waits (for a landing buffer)
// leaves the lane to the copies that can start meanwhile, as the engine's copy lane takes those first.
struct CopyOutLane {
  std::vector<std::pair<double, double>> busy;  // (start, end) in order; those ended by the device's latest unit gone
  double last_end = 0.0;

  // Runs a copy of `seconds` in the first gap from `not_before` on; `now` is the device's latest unit's end (no
  // copy asked later may start before it). Returns when the copy ends.
  double place(double now, double not_before, double seconds);
};

// A job on the host lane (an accumulation or a step of a kHost shard's gradient).
struct HostJob {
  int task;
  int shard;
  double landed;  // its gradient on the host
  double seconds;
  bool step;
  bool last_to_land = false;  // a step of its task's lowest kHost shard: nothing of the task lands until it is done
  bool split = false;         // the first piece of a job that a lower one's ran inside: its rest holds the buffer
  double start = 0.0;
};

struct StepState {
  std::vector<std::vector<ShardSteps>> shards;
  double host_free = 0.0;   // the host lane, all devices'
  double host_ended = 0.0;  // when the latest job no longer on it ended
  std::vector<HostJob> host_jobs;  // the lane's jobs not yet ended when the latest one's gradient landed

  explicit StepState(const SimulationConfig& config) {
    for (const StepSchedule& schedule : config.steps) shards.emplace_back(schedule.places.size());
  }
  ShardSteps& of(const Unit& unit) { return shards[static_cast<size_t>(unit.task)][static_cast<size_t>(unit.shard)]; }
};

// Where the unit's shard steps (on the host where the config has no steps).
StepPlace place_of(const SimulationConfig& config, const Unit& unit);

// The seconds the unit's shard takes on each lane.
const ShardLanes& lanes_of(const SimulationConfig& config, const Unit& unit);

// The unit's weights cross to the device for it: every shard's but a resident one's.
bool copies_weights(const SimulationConfig& config, const Unit& unit);

// Seconds to copy the unit's weights in.
double weights_seconds(const SimulationConfig& config, const Unit& unit);

// The unit starts a step after a host step of its shard: a copy the device holds from before is stale.
bool after_host_step(const SimulationConfig& config, const Unit& unit);

// When the latest step of the unit's shard is done, its weights on the host to copy in.
double ready_at(const SimulationConfig& config, StepState& steps, const Unit& unit);

// Every step before the unit's has been issued and is done by `now`: the weights it reads are there to copy. A
// prefetch waits for that, so that a copy lane never stands still behind a step while other copies could run.
bool weights_ready(const SimulationConfig& config, StepState& steps, const Unit& unit, double now);

// The unit's micro-batch is the last of its task's step.
bool ends_step(const SimulationConfig& config, const Unit& unit);

// The unit's backward ends a step of a shard stepped on the device: its master and moments come in for it.
bool steps_on_device(const SimulationConfig& config, const Unit& unit);

// The unit (shard 0's backward) ends a step: when the task's next forward can run without waiting for a step, as
// the engine's SpilledModel::next_step_waits reads it. That forward waits for the steps of the shards it copies
// in, up to the first one stepped on the host (the last of its host steps to finish); a resident shard's weights
// are always there. 0 where none is to wait for.
double next_forward_ready(const SimulationConfig& config, StepState& steps, const Unit& unit);

// The earliest time from `from` at which the task's jobs on the host lane hold fewer than kLandingBuffers buffers:
// when its next gradient's copy out can begin.
double landing_free(const StepState& steps, int task, double from);

// Puts a host job on the lane as the engine's host-step threads take them: one of a task at a time, and of a task's
// jobs whose gradients have landed, the lowest shard's first (the next forward needs it first). The job goes ahead
// of the task's jobs of higher shards just before it on the lane that had not started when its gradient landed;
// they start again, in turn, after it, and their steps' weights are ready later. Where the job running as it lands
// is one of its task's of a higher shard, it runs at once, between that job's parts (HostWorker::let_lower_ranks_run),
// and the rest of that job after it, where the task's jobs on the lane leave a landing buffer free or the job is
// `last_to_land`.
void queue_host_job(StepState& steps, HostJob job);

// What follows a unit that computed until `end`: its gradient out (on `copies_out`, the device's lane) and, where it
// ends a step, the step. Returns when the device is free: after a device step, where one runs. `gradient_out`: when a
// kHost shard's gradient has left the device (-1 where none goes out).
double after_unit(const SimulationConfig& config, const Unit& unit, double end, double state_landed,
                  CopyOutLane& copies_out, StepState& steps, SimulationResult& result, double& gradient_out);

}  // namespace hydra::core::simulated
