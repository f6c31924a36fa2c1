#include "bindings/scheduler.h"

#include <pybind11/stl.h>

#include <string>

#include "core/scheduler.h"

namespace py = pybind11;

namespace hydra {

void bind_scheduler(py::module_& m) {
  using core::Phase;
  using core::Scheduler;
  using core::Unit;

  py::enum_<Phase>(m, "Phase")
      .value("forward", Phase::kForward)
      .value("forward_backward", Phase::kForwardBackward)
      .value("backward", Phase::kBackward);

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

  m.def("parse_policy", [](const std::string& name) { return std::string(core::policy_name(core::parse_policy(name))); },
        "The canonical name of a scheduling policy; ValueError for an unknown one.");

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init([](const std::vector<std::tuple<int, int64_t, std::optional<int>, std::vector<double>>>& tasks,
                       int num_devices, const std::string& policy, uint64_t seed) {
             std::vector<core::TaskSpec> specs;
             for (const auto& [shards, micro_batches, device, costs] : tasks) {
               specs.push_back({shards, micro_batches, device, costs});
             }
             return std::make_unique<Scheduler>(std::move(specs), num_devices, core::parse_policy(policy), seed);
           }),
           py::arg("tasks"), py::arg("num_devices"), py::arg("policy") = "lrtf", py::arg("seed") = 0,
           "tasks: (num_shards, micro_batches, device or None, shard costs or []) per task; a shard's cost (its "
           "parameter count, say) ranks a task before any of its units has been timed")
      .def("next", &Scheduler::next, py::call_guard<py::gil_scoped_release>())
      .def("next_for", &Scheduler::next_for, py::call_guard<py::gil_scoped_release>())
      .def("has_work", &Scheduler::has_work)
      .def("cancelled", &Scheduler::cancelled)
      .def("peek", &Scheduler::peek)
      .def("plan", &Scheduler::plan, py::arg("device"), py::arg("count"))
      .def("complete", &Scheduler::complete, py::arg("device"), py::arg("unit"), py::arg("seconds"))
      .def("observe", &Scheduler::observe, py::arg("unit"), py::arg("seconds"))
      .def("fail", &Scheduler::fail)
      .def("cancel", &Scheduler::cancel)
      .def("remaining_units", &Scheduler::remaining_units)
      .def("remaining_seconds", &Scheduler::remaining_seconds)
      .def("finished", &Scheduler::finished)
      .def("failed", &Scheduler::failed)
      .def("estimate", &Scheduler::estimate);
}

}  // namespace hydra
