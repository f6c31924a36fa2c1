#include "bindings/scheduler.h"

#include <pybind11/stl.h>

#include <string>

#include "core/scheduler.h"
#include "core/successive_halving.h"

namespace py = pybind11;

namespace hydra {

namespace {

// (num_shards, micro_batches, device or None, shard costs[, eval_after, eval_batches[, base]])
core::TaskSpec task_spec(const py::tuple& task) {
  if (task.size() != 4 && task.size() != 6 && task.size() != 7) {
    throw py::value_error("Scheduler: a task is (num_shards, micro_batches, device, shard_costs"
                          "[, eval_after, eval_batches[, base]]), got " + std::to_string(task.size()) + " items");
  }
  core::TaskSpec spec{task[0].cast<int>(), task[1].cast<int64_t>(), task[2].cast<std::optional<int>>(),
                      task[3].cast<std::vector<double>>()};
  if (task.size() >= 6) {
    spec.eval_after = task[4].cast<std::vector<int64_t>>();
    spec.eval_batches = task[5].cast<int64_t>();
  }
  if (task.size() == 7) spec.base = task[6].cast<int>();
  return spec;
}

}  // namespace

void bind_scheduler(py::module_& m) {
  using core::Phase;
  using core::Scheduler;
  using core::Unit;

  py::enum_<Phase>(m, "Phase")
      .value("forward", Phase::kForward)
      .value("forward_backward", Phase::kForwardBackward)
      .value("backward", Phase::kBackward)
      .value("evaluate", Phase::kEvaluate);

  py::class_<Unit>(m, "Unit")
      .def_readonly("task", &Unit::task)
      .def_readonly("index", &Unit::index)
      .def_readonly("shard", &Unit::shard)
      .def_readonly("phase", &Unit::phase)
      .def_readonly("micro_batch", &Unit::micro_batch)
      .def("__repr__", [](const Unit& u) {
        return "Unit(task=" + std::to_string(u.task) + ", index=" + std::to_string(u.index) +
               ", shard=" + std::to_string(u.shard) + ", phase=" + std::to_string(static_cast<int>(u.phase)) + ")";
      });

  py::class_<core::RungDecision>(m, "RungDecision")
      .def_readonly("keep", &core::RungDecision::keep)
      .def_readonly("rung", &core::RungDecision::rung)
      .def_readonly("rank", &core::RungDecision::rank)
      .def_readonly("competitors", &core::RungDecision::competitors)
      .def_readonly("kept", &core::RungDecision::kept);

  py::class_<core::SuccessiveHalving>(m, "SuccessiveHalving")
      .def(py::init<int64_t, int64_t>(), py::arg("min_steps"), py::arg("reduction_factor"))
      .def("rungs", &core::SuccessiveHalving::rungs, py::arg("total_steps"))
      .def("report", &core::SuccessiveHalving::report, py::arg("rung"), py::arg("metric"));

  m.def("parse_policy", [](const std::string& name) { return std::string(core::policy_name(core::parse_policy(name))); },
        "The canonical name of a scheduling policy; ValueError for an unknown one.");

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init([](const std::vector<py::tuple>& tasks, int num_devices, const std::string& policy, uint64_t seed) {
             std::vector<core::TaskSpec> specs;
             for (const py::tuple& task : tasks) specs.push_back(task_spec(task));
             return std::make_unique<Scheduler>(std::move(specs), num_devices, core::parse_policy(policy), seed);
           }),
           py::arg("tasks"), py::arg("num_devices"), py::arg("policy") = "lrtf", py::arg("seed") = 0,
           "tasks: (num_shards, micro_batches, device or None, shard costs or [][, eval_after, eval_batches]) per "
           "task; a shard's cost (its parameter count, say) ranks a task before any of its units has been timed; "
           "an evaluation pass of eval_batches batches follows each count of micro-batches in eval_after")
      .def("next", &Scheduler::next, py::call_guard<py::gil_scoped_release>())
      .def("next_for", &Scheduler::next_for, py::call_guard<py::gil_scoped_release>())
      .def("has_work", &Scheduler::has_work)
      .def("cancelled", &Scheduler::cancelled)
      .def("peek", &Scheduler::peek)
      .def("plan", &Scheduler::plan, py::arg("device"), py::arg("count"))
      .def("commit_plan", &Scheduler::commit_plan, py::arg("device"), py::arg("count"))
      .def("complete", &Scheduler::complete, py::arg("device"), py::arg("unit"), py::arg("seconds"))
      .def("observe", &Scheduler::observe, py::arg("unit"), py::arg("seconds"))
      .def("fail", &Scheduler::fail)
      .def("restart", [](Scheduler& self, int device, const Unit& unit, const py::tuple& task) {
             self.restart(device, unit, task_spec(task));
           }, py::arg("device"), py::arg("unit"), py::arg("spec"))
      .def("cancel", &Scheduler::cancel)
      .def("add_task", [](Scheduler& self, const py::tuple& task) { return self.add_task(task_spec(task)); },
           py::arg("task"), "A task joining while the devices run (the constructor's tuple); returns its id")
      .def("set_open", &Scheduler::set_open, py::arg("open"))
      .def("set_saved_allowance", &Scheduler::set_saved_allowance, py::arg("device"), py::arg("bytes"))
      .def("set_saved_bytes", &Scheduler::set_saved_bytes, py::arg("task"), py::arg("bytes"))
      .def("saved_in_flight", &Scheduler::saved_in_flight, py::arg("device"))
      .def("remaining_units", &Scheduler::remaining_units)
      .def("remaining_seconds", &Scheduler::remaining_seconds)
      .def("finished", &Scheduler::finished)
      .def("failed", &Scheduler::failed)
      .def("estimate", &Scheduler::estimate);
}

}  // namespace hydra
