#include "bindings/lanes.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "core/lane_plan.h"

namespace py = pybind11;

namespace hydra {

namespace {

using core::StepPlace;

// (forward seconds, backward seconds, weights, grads, params, tied_to[, borrowed]) per shard.
using ShardTuple = std::tuple<double, double, int64_t, int64_t, int64_t, int>;
using BorrowingShardTuple = std::tuple<double, double, int64_t, int64_t, int64_t, int, int64_t>;

core::TaskShape task_shape(const std::vector<std::variant<ShardTuple, BorrowingShardTuple>>& shards,
                           int64_t micro_batches, int64_t accumulate, bool clipped) {
  core::TaskShape task{{}, micro_batches, accumulate, clipped};
  for (const auto& shard : shards) {
    if (const auto* borrowing = std::get_if<BorrowingShardTuple>(&shard)) {
      const auto& [forward, backward, weights, grads, params, tied_to, borrowed] = *borrowing;
      task.shards.push_back(core::ShardShape{forward, backward, weights, grads, params, tied_to, borrowed});
    } else {
      const auto& [forward, backward, weights, grads, params, tied_to] = std::get<ShardTuple>(shard);
      task.shards.push_back(core::ShardShape{forward, backward, weights, grads, params, tied_to});
    }
  }
  return task;
}

StepPlace parse_place(const std::string& name) {
  for (StepPlace place : {StepPlace::kHost, StepPlace::kDevice, StepPlace::kResident})
    if (name == core::step_place_name(place)) return place;
  throw py::value_error("lane_forecast: a shard's place is 'host', 'device' or 'resident', got '" + name + "'");
}

core::Placement parse_placement(const std::vector<std::vector<std::string>>& names) {
  core::Placement placement;
  for (const auto& places : names) {
    placement.emplace_back();
    for (const std::string& name : places) placement.back().push_back(parse_place(name));
  }
  return placement;
}

py::dict bound_dict(const core::LaneBound& b) {
  py::dict d;
  d["compute"] = b.compute;
  d["host_to_device"] = b.host_to_device;
  d["device_to_host"] = b.device_to_host;
  d["host"] = b.host;
  d["chain"] = b.chain;
  d["bound"] = b.bound();
  return d;
}

}  // namespace

void bind_lanes(py::module_& m) {
  m.def(
      "lane_forecast",
      [](const std::vector<std::tuple<std::vector<std::variant<ShardTuple, BorrowingShardTuple>>, int64_t, int64_t,
                                      bool>>& tasks,
         const std::tuple<double, double, double, double>& rates,
         const std::optional<std::tuple<double, double, double, double, double>>& bytes, int devices,
         const std::optional<std::vector<std::vector<std::string>>>& placement, std::optional<int64_t> room,
         const std::optional<std::vector<std::vector<std::string>>>& start,
         const std::optional<std::vector<bool>>& fixed, const std::optional<std::vector<std::vector<int>>>& kept) {
        std::vector<core::TaskShape> shapes;
        for (const auto& [shards, micro_batches, accumulate, clipped] : tasks)
          shapes.push_back(task_shape(shards, micro_batches, accumulate, clipped));
        if (fixed) {
          if (fixed->size() != shapes.size())
            throw py::value_error("lane_forecast: `fixed` names " + std::to_string(fixed->size()) + " tasks of " +
                                  std::to_string(shapes.size()));
          for (size_t t = 0; t < shapes.size(); ++t) shapes[t].fixed = (*fixed)[t];
        }
        if (kept) {
          if (kept->size() != shapes.size())
            throw py::value_error("lane_forecast: `kept` names " + std::to_string(kept->size()) + " tasks of " +
                                  std::to_string(shapes.size()));
          for (size_t t = 0; t < shapes.size(); ++t) {
            shapes[t].kept.assign(shapes[t].shards.size(), false);
            for (int s : (*kept)[t]) {
              if (s < 0 || s >= static_cast<int>(shapes[t].shards.size()))
                throw py::value_error("lane_forecast: `kept` names shard " + std::to_string(s) + " of task " +
                                      std::to_string(t) + ", which has " + std::to_string(shapes[t].shards.size()));
              shapes[t].kept[static_cast<size_t>(s)] = true;
            }
          }
        }
        const auto& [in, out, host, device_memory] = rates;
        const core::LaneRates lane_rates{in, out, host, device_memory};
        core::StepBytes step_bytes;
        if (bytes) {
          const auto& [weight, state, host_step, host_accumulate, device_step] = *bytes;
          step_bytes = core::StepBytes{weight, state, host_step, host_accumulate, device_step};
        }
        py::dict result;
        core::Placement chosen;
        core::SimulationResult run;
        if (placement) {
          chosen = parse_placement(*placement);
          const core::Placement from = start ? parse_placement(*start) : core::Placement{};
          run = core::simulate(room ? core::simulation_in_room(shapes, chosen, lane_rates, step_bytes, devices, *room,
                                                               from)
                                    : core::lane_simulation(shapes, chosen, lane_rates, step_bytes, devices));
          result["headroom"] = py::none();
        } else {
          if (!room) throw py::value_error("lane_forecast: without a placement, give the room to choose one in");
          core::LanePlan plan = core::plan_lanes(shapes, lane_rates, step_bytes, devices, *room,
                                                 start ? parse_placement(*start) : core::Placement{});
          chosen = std::move(plan.placement);
          run = std::move(plan.run);
          result["headroom"] = plan.headroom;
        }
        std::vector<std::vector<std::string>> names;
        for (const auto& places : chosen) {
          names.emplace_back();
          for (StepPlace place : places) names.back().push_back(core::step_place_name(place));
        }
        result["placement"] = names;
        result["makespan"] = run.makespan;
        double span = 0.0;  // the last unit's end: the steps that end after it are the makespan's drain
        for (const core::TraceEntry& entry : run.trace) span = std::max(span, entry.end);
        result["span"] = span;
        result["bound"] = bound_dict(core::lane_bound(shapes, chosen, lane_rates, step_bytes, devices));
        py::dict busy;
        busy["host_to_device"] = run.transfer_seconds;
        busy["device_to_host"] = run.gradient_transfer_seconds;
        busy["host"] = run.host_seconds;
        busy["device_step"] = run.device_step_seconds;
        busy["exposed"] = run.exposed_transfer_seconds;
        result["busy_seconds"] = busy;
        return result;
      },
      py::arg("tasks"), py::arg("rates"), py::arg("bytes") = py::none(), py::arg("devices") = 1,
      py::arg("placement") = py::none(), py::arg("room") = py::none(), py::arg("start") = py::none(),
      py::arg("fixed") = py::none(), py::arg("kept") = py::none(),
      "The lane model's forecast of a run (core/lanes.h): tasks as (shards, micro_batches, accumulate, clipped), each "
      "shard (forward s, backward s, weights, grads, params, tied_to[, borrowed: elements of weights borrowed from "
      "tied_to, frozen ones included]); rates (host-to-device, device-to-host, host, device "
      "memory) in bytes/s; bytes (weight, state, host_step, host_accumulate, device_step) per element, None: bf16 "
      "AdamW. With `placement` (per task, per shard: 'host', 'device' or 'resident') that placement is simulated (with "
      "`room`, as plan_lanes runs it in that room: simulation_in_room); "
      "without it plan_lanes chooses one within `room` device bytes, from `start` (placed alike; None: every shard on "
      "the host) with `room` counted beyond what start's shards hold, the tasks `fixed` names (per task, a bool) "
      "kept as start places them, and so each shard `kept` names (per task, a list of shard indices). Returns its "
      "placement, headroom, simulated "
      "makespan (its last step done), span (its last unit done), four-lane bound and lanes' busy seconds.");
}

}  // namespace hydra
