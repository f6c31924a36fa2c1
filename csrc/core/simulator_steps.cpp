#include "core/simulator_steps.h"

#include <algorithm>

#include "core/simulator_units.h"

namespace hydra::core::simulated {

StepPlace place_of(const SimulationConfig& config, const Unit& unit) {
  return config.steps.empty() ? StepPlace::kHost
                              : config.steps[static_cast<size_t>(unit.task)].places[static_cast<size_t>(unit.shard)];
}

const ShardLanes& lanes_of(const SimulationConfig& config, const Unit& unit) {
  return config.steps[static_cast<size_t>(unit.task)].lanes[static_cast<size_t>(unit.shard)];
}

bool copies_weights(const SimulationConfig& config, const Unit& unit) {
  return place_of(config, unit) != StepPlace::kResident;
}

double weights_seconds(const SimulationConfig& config, const Unit& unit) {
  if (!config.steps.empty()) return lanes_of(config, unit).weights_in;
  return checked(config.transfer(unit.task, unit.shard, unit.phase), "transfer");
}

bool after_host_step(const SimulationConfig& config, const Unit& unit) {
  if (config.steps.empty() || place_of(config, unit) != StepPlace::kHost || unit.phase == Phase::kBackward)
    return false;
  return unit.micro_batch > 0 && unit.micro_batch % config.steps[static_cast<size_t>(unit.task)].accumulate == 0;
}

double ready_at(const SimulationConfig& config, StepState& steps, const Unit& unit) {
  return config.steps.empty() ? 0.0 : steps.of(unit).ready;
}

bool weights_ready(const SimulationConfig& config, StepState& steps, const Unit& unit, double now) {
  if (config.steps.empty()) return true;
  const int64_t accumulate = config.steps[static_cast<size_t>(unit.task)].accumulate;
  const bool issued = steps.of(unit).issued >= unit.micro_batch / accumulate;
  return issued && ready_at(config, steps, unit) <= now;
}

bool ends_step(const SimulationConfig& config, const Unit& unit) {
  const int64_t accumulate = config.steps[static_cast<size_t>(unit.task)].accumulate;
  return (unit.micro_batch + 1) % accumulate == 0 ||
         unit.micro_batch + 1 == config.tasks[static_cast<size_t>(unit.task)].micro_batches;
}

bool steps_on_device(const SimulationConfig& config, const Unit& unit) {
  return !config.steps.empty() && has_backward(unit.phase) && place_of(config, unit) == StepPlace::kDevice &&
         ends_step(config, unit);
}

double next_forward_ready(const SimulationConfig& config, StepState& steps, const Unit& unit) {
  if (config.steps.empty() || unit.shard != 0 || !has_backward(unit.phase) || !ends_step(config, unit)) return 0.0;
  const std::vector<StepPlace>& places = config.steps[static_cast<size_t>(unit.task)].places;
  double ready = 0.0;
  for (size_t shard = 0; shard < places.size(); ++shard) {
    if (places[shard] == StepPlace::kResident) continue;
    ready = std::max(ready, steps.shards[static_cast<size_t>(unit.task)][shard].ready);
    if (places[shard] == StepPlace::kHost) break;
  }
  return ready;
}

double CopyOutLane::place(double now, double not_before, double seconds) {
  std::erase_if(busy, [&](const std::pair<double, double>& span) { return span.second <= now; });
  double start = not_before;
  auto at = busy.begin();
  for (; at != busy.end(); ++at) {
    if (at->second <= start) continue;
    if (at->first >= start + seconds) break;
    start = at->second;
  }
  busy.insert(at, {start, start + seconds});
  last_end = std::max(last_end, start + seconds);
  return start + seconds;
}

double landing_free(const StepState& steps, int task, double from) {
  std::vector<double> ends;
  for (const HostJob& job : steps.host_jobs)
    if (job.task == task && !job.split && job.start + job.seconds > from) ends.push_back(job.start + job.seconds);
  if (static_cast<int>(ends.size()) < kLandingBuffers) return from;
  // Of the buffers held past `from`, the one given back the latest but kLandingBuffers - 1 frees the one it needs.
  std::sort(ends.begin(), ends.end());
  return ends[ends.size() - kLandingBuffers];
}

void queue_host_job(StepState& steps, HostJob job) {
  std::vector<HostJob>& lane = steps.host_jobs;
  std::erase_if(lane, [&](const HostJob& queued) {
    if (queued.start + queued.seconds > job.landed) return false;
    steps.host_ended = std::max(steps.host_ended, queued.start + queued.seconds);
    return true;
  });
  size_t at = lane.size();
  const auto holding = std::count_if(lane.begin(), lane.end(), [&](const HostJob& queued) {
    return queued.task == job.task && !queued.split;
  });
  // Only a step runs in parts, not an accumulation. (A split's first piece, marked no step below, ends as the job that
  // split it lands: it is gone before another lands.)
  if (!lane.empty() && lane[0].step && lane[0].start < job.landed && lane[0].task == job.task &&
      lane[0].shard > job.shard && (holding + 1 < kLandingBuffers || job.last_to_land)) {
    // The task's step running as it lands, of a higher shard, lets it run between its parts (taken as at once), while
    // a landing buffer of the task's is left free, or where no gradient of the task's is to land before it is done.
    // The task's lower jobs queued behind that step go in too, lowest first (each ending gives its buffer back), and
    // that step's rest after them.
    HostJob rest = lane[0];
    rest.landed = job.landed;
    rest.seconds -= job.landed - lane[0].start;
    lane[0].seconds = job.landed - lane[0].start;
    lane[0].step = false;  // its step ends with its rest
    lane[0].split = true;
    size_t lower = 1;
    while (lower < lane.size() && lane[lower].task == job.task && lane[lower].shard < rest.shard) ++lower;
    lane.insert(lane.begin() + static_cast<std::ptrdiff_t>(lower), rest);
    at = 1;
    while (at < lower && lane[at].shard < job.shard) ++at;
  } else {
    auto passes = [&](const HostJob& queued) {
      return queued.task == job.task && queued.shard > job.shard && queued.start >= job.landed;
    };
    while (at > 0 && passes(lane[at - 1])) --at;
  }
  // Every job before it on the lane that is not there any more ended by the time its gradient landed; a gradient that
  // lands before a job that is not there any more ended (one waited for a landing buffer, or came from another device)
  // finds the lane taken until then.
  double free = at > 0 ? lane[at - 1].start + lane[at - 1].seconds : steps.host_ended;
  lane.insert(lane.begin() + static_cast<std::ptrdiff_t>(at), job);
  for (size_t i = at; i < lane.size(); ++i) {
    HostJob& queued = lane[i];
    queued.start = std::max(queued.landed, free);
    free = queued.start + queued.seconds;
    if (queued.step) steps.shards[static_cast<size_t>(queued.task)][static_cast<size_t>(queued.shard)].ready = free;
  }
  steps.host_free = free;
}

double after_unit(const SimulationConfig& config, const Unit& unit, double end, double state_landed,
                  CopyOutLane& copies_out, StepState& steps, SimulationResult& result, double& gradient_out) {
  gradient_out = -1.0;
  if (!has_backward(unit.phase)) return end;
  auto out = [&](double after, double seconds) {
    result.gradient_transfer_seconds += seconds;
    return copies_out.place(end, after, seconds);
  };
  if (config.steps.empty()) {
    if (config.gradient_transfer)
      out(end, checked(config.gradient_transfer(unit.task, unit.shard, unit.phase), "transfer"));
    return end;
  }
  const ShardLanes& lanes = lanes_of(config, unit);
  const bool step = ends_step(config, unit);
  ShardSteps& shard = steps.of(unit);
  switch (place_of(config, unit)) {
    case StepPlace::kHost: {
      const double landed = out(landing_free(steps, unit.task, end), lanes.gradient_out);
      gradient_out = landed;
      const double seconds = step ? lanes.host_step : lanes.host_accumulate;
      result.host_seconds += seconds;
      if (step) ++shard.issued;
      const std::vector<StepPlace>& places = config.steps[static_cast<size_t>(unit.task)].places;
      const bool lowest = std::find(places.begin(), places.end(), StepPlace::kHost) - places.begin() == unit.shard;
      queue_host_job(steps, HostJob{unit.task, unit.shard, landed, seconds, step, step && lowest});
      return end;
    }
    case StepPlace::kDevice: {
      if (lanes.gradient_out > 0.0) {  // its share of a tied weight a host-stepped owner steps: summed there
        gradient_out = out(landing_free(steps, unit.task, end), lanes.gradient_out);
        const double seconds = step ? lanes.host_step : lanes.host_accumulate;
        result.host_seconds += seconds;
        queue_host_job(steps, HostJob{unit.task, unit.shard, gradient_out, seconds, false, false});
      }
      if (!step) return end;
      // The step runs once its state has landed, on the device's step lane: the compute goes on with other units
      // meanwhile (it pays the step's own time, not the wait), and the shard's next visit waits for the step.
      const double stepped = std::max(end, state_landed) + lanes.device_step;
      result.device_step_seconds += lanes.device_step;
      shard = ShardSteps{shard.issued + 1, out(stepped, lanes.state_out), stepped};
      return end + lanes.device_step;
    }
    case StepPlace::kResident:
      if (!step) return end;
      result.device_step_seconds += lanes.device_step;
      shard.issued += 1;
      return end + lanes.device_step;
  }
  return end;
}

}  // namespace hydra::core::simulated
