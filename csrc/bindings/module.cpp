// The Python module hydra_torch._C: the only translation unit that includes torch/extension.h.
// Ops register themselves through TORCH_LIBRARY in their own files; this file binds the engine's
// non-tensor objects with pybind11. Every call that may wait releases the GIL.
#include <torch/extension.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bindings/lanes.h"
#include "bindings/partitioner.h"
#include "bindings/scheduler.h"
#include "engine/device_engine.h"
#include "engine/device_loop.h"
#include "engine/optimizer_spec.h"
#include "engine/placement.h"
#include "engine/shard_store.h"

namespace py = pybind11;
using hydra::engine::BackwardDone;
using hydra::engine::ClipNorm;
using hydra::engine::DeviceEngine;
using hydra::engine::DeviceLoop;
using hydra::engine::EngineStats;
using hydra::engine::HostPace;
using hydra::engine::HostWorker;
using hydra::engine::LossGate;
using hydra::engine::OptimizerSpec;
using hydra::engine::ShardStore;

namespace {

py::dict stats_dict(const EngineStats& s) {
  py::dict d;
  d["budget_bytes"] = s.budget_bytes;
  d["capacity_bytes"] = s.capacity_bytes;
  d["high_water_bytes"] = s.high_water_bytes;
  d["host_to_device_bytes"] = s.host_to_device_bytes;
  d["device_to_host_bytes"] = s.device_to_host_bytes;
  d["host_to_device_copies"] = s.host_to_device_copies;
  d["device_to_host_copies"] = s.device_to_host_copies;
  d["host_steps"] = s.host_steps;
  d["device_steps"] = s.device_steps;
  d["host_step_seconds"] = s.host_step_seconds;
  d["host_step_bytes"] = s.host_step_bytes;
  d["grad_copy_seconds"] = s.grad_copy_seconds;
  d["weight_copy_seconds"] = s.weight_copy_seconds;
  d["device_step_seconds"] = s.device_step_seconds;
  d["staging_bytes"] = s.staging_bytes;
  d["acquire_loads"] = s.acquire_loads;
  d["acquire_wait_seconds"] = s.acquire_wait_seconds;
  d["grad_wait_seconds"] = s.grad_wait_seconds;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hydra-torch native engine";
  m.attr("built_torch_version") = HYDRA_TORCH_BUILT_TORCH_VERSION;
  hydra::bind_scheduler(m);
  hydra::bind_partitioner(m);
  hydra::bind_lanes(m);
  using release_gil = py::call_guard<py::gil_scoped_release>;

  py::class_<OptimizerSpec> spec(m, "OptimizerSpec");
  py::enum_<OptimizerSpec::Kind>(spec, "Kind")
      .value("adam", OptimizerSpec::Kind::kAdam)
      .value("sgd", OptimizerSpec::Kind::kSgd);
  spec.def(py::init<>())
      .def_readwrite("kind", &OptimizerSpec::kind)
      .def_readwrite("lr", &OptimizerSpec::lr)
      .def_readwrite("beta1", &OptimizerSpec::beta1)
      .def_readwrite("beta2", &OptimizerSpec::beta2)
      .def_readwrite("eps", &OptimizerSpec::eps)
      .def_readwrite("weight_decay", &OptimizerSpec::weight_decay)
      .def_readwrite("decoupled_weight_decay", &OptimizerSpec::decoupled_weight_decay)
      .def_readwrite("momentum", &OptimizerSpec::momentum)
      .def_readwrite("dampening", &OptimizerSpec::dampening)
      .def_readwrite("nesterov", &OptimizerSpec::nesterov)
      .def_property_readonly("num_states", &OptimizerSpec::num_states);

  py::class_<ShardStore, std::shared_ptr<ShardStore>>(m, "ShardStore")
      .def(py::init<const std::vector<std::vector<at::Tensor>>&, OptimizerSpec, bool, bool>(), py::arg("shard_params"),
           py::arg("optimizer"), py::arg("bf16"), py::arg("pin_memory"))
      .def_static("device_bytes", &ShardStore::device_bytes, py::arg("numels"), py::arg("bf16"))
      .def_property_readonly("num_shards", &ShardStore::num_shards)
      .def_property_readonly("pinned", &ShardStore::pinned)
      .def("owned_numel", &ShardStore::owned_numel)
      .def("device_numel", &ShardStore::device_numel)
      .def("trainable_numel", &ShardStore::trainable_numel)
      .def("gradient_numel", &ShardStore::gradient_numel)
      .def("sources", &ShardStore::sources)
      .def("steps_taken", &ShardStore::steps_taken)
      .def("set_steps_taken", &ShardStore::set_steps_taken, py::arg("steps"))
      .def_property("steps_after_each_backward", &ShardStore::steps_after_each_backward,
                    &ShardStore::set_steps_after_each_backward)
      .def("master", &ShardStore::master)
      .def("grad", &ShardStore::grad)
      .def("has_grad", &ShardStore::has_grad)
      .def_property_readonly("host_bytes", &ShardStore::host_bytes)
      .def("layout_params",  // the parameters of the shard's layout, in its order (owned, then borrowed)
           [](const ShardStore& store, int shard) {
             std::vector<at::Tensor> params;
             for (const hydra::engine::ParamEntry& e : store.layout(shard)) params.push_back(e.param);
             return params;
           })
      .def("param_states",
           [](ShardStore& store) {
             std::vector<std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, int64_t>> states;
             for (ShardStore::ParamState& p : store.param_states())
               states.emplace_back(p.param, p.master, std::move(p.states), p.steps);
             return states;
           })
      .def("set_param_steps", &ShardStore::set_param_steps, py::arg("param"), py::arg("steps"))
      .def("set_param_options", &ShardStore::set_param_options, py::arg("param"), py::arg("lr"),
           py::arg("weight_decay"))
      .def("refresh_shadow", &ShardStore::refresh_shadow)
      .def("write_back", &ShardStore::write_back);

  // The host-step threads one run's device engines share. `team_threads` > 0: each thread's jobs open OpenMP
  // teams of that many threads (omp_set_num_threads is per thread; at::set_num_threads would set every
  // thread's), so that the threads' teams together fit the cores left to them; 0: the process's default.
  // `in_submission_order`: the models' jobs are taken in turn, not the first that can start (engine/host_worker.h):
  // what the benchmarks compare that order against.
  py::class_<HostWorker, std::shared_ptr<HostWorker>>(m, "HostSteps")
      .def(py::init([](int threads, int team_threads, bool in_submission_order) {
             TORCH_CHECK(team_threads >= 0, "HostSteps: team_threads must be >= 0, got ", team_threads);
             std::function<void()> on_start;
#ifdef _OPENMP
             if (team_threads > 0) {
               on_start = [team_threads] {
                 // ATen sizes a thread's team once, at its first parallel call (to torch.set_num_threads' count
                 // when that was ever called), in libtorch and, inlined, in this module: both first, then ours.
                 at::get_num_threads();
                 at::internal::lazy_init_num_threads();
                 omp_set_num_threads(team_threads);
               };
             }
#endif
             return std::make_shared<HostWorker>(threads, std::move(on_start), in_submission_order);
           }),
           py::arg("threads"), py::arg("team_threads") = 0, py::arg("in_submission_order") = false)
      // Whether team_threads takes effect: this build parallelises with OpenMP (the ThreadSanitizer test build
      // does not, so its host steps keep the default team).
      .def_property_readonly_static("sizes_openmp_teams",
                                    [](py::object) {
#ifdef _OPENMP
                                      return true;
#else
                                      return false;
#endif
                                    })
      // The OpenMP team a host step opens: what a job on one of the threads sees after an ATen op.
      .def(
          "openmp_threads",
          [](HostWorker& worker) {
            auto seen = std::make_shared<int>(1);
            worker
                .submit([seen]() -> hydra::engine::DeviceEvent {
                  at::ones({4096}).mul_(2.0).sum();  // through libtorch's parallel_for, as a step's ops go
                  *seen = at::get_num_threads();
                  return nullptr;
                })
                .wait();
            return *seen;
          },
          release_gil())
      .def_property_readonly("threads", &HostWorker::threads);

  // An emulated host memory bandwidth the host steps of a run's engines share (engine/host_pace.h).
  py::class_<HostPace, std::shared_ptr<HostPace>>(m, "HostPace")
      .def(py::init<double>(), py::arg("bytes_per_second"))
      .def_property_readonly("bytes_per_second", &HostPace::bytes_per_second);

  // A micro-batch's loss on its way to the host (see LossGate): value() waits for its copy only.
  py::class_<LossGate, std::shared_ptr<LossGate>>(m, "LossReading")
      .def("value", &LossGate::value, release_gil());

  // A clipped step's global gradient norm (see ClipNorm): value() waits until it is computed; a non-finite
  // one means no shard stepped.
  py::class_<ClipNorm, std::shared_ptr<ClipNorm>>(m, "GradientNormReading")
      .def("value", &ClipNorm::value, release_gil());

  py::class_<DeviceEngine>(m, "DeviceEngine")
      .def(py::init([](const std::string& device, int64_t budget, std::shared_ptr<HostWorker> host_steps,
                       double link_bytes_per_second, std::shared_ptr<HostPace> host_pace) {
             return std::make_unique<DeviceEngine>(c10::Device(device), budget, std::move(host_steps),
                                                   link_bytes_per_second, std::move(host_pace));
           }),
           py::arg("device"), py::arg("budget_bytes"), py::arg("host_steps") = nullptr,
           py::arg("link_bytes_per_second") = 0.0, py::arg("host_pace") = nullptr)
      .def(
          "add_model",
          [](DeviceEngine& engine, std::shared_ptr<ShardStore> store, bool allow_resident, int task,
             std::vector<int> resident_shards, int base, std::vector<int> device_shards) {
            return engine.add_model(std::move(store),
                                    allow_resident ? DeviceEngine::Residency::kAuto : DeviceEngine::Residency::kSpilled,
                                    task, std::move(resident_shards), base, std::move(device_shards));
          },
          py::arg("store"), py::arg("allow_resident") = true, py::arg("task") = -1,
          py::arg("resident_shards") = std::vector<int>{}, py::arg("base") = -1,
          py::arg("device_shards") = std::vector<int>{})
      .def("model_of", &DeviceEngine::model_of, py::arg("task"))
      .def("resident", &DeviceEngine::resident)
      .def("resident_shards", &DeviceEngine::resident_shards)
      .def("device_shards", &DeviceEngine::device_shards)
      .def_static("min_spilled_bytes", &DeviceEngine::min_spilled_bytes)
      .def_static("resident_bytes", &DeviceEngine::resident_bytes)
      .def_static("spilled_need", &DeviceEngine::spilled_need)
      .def_static("resident_need", &DeviceEngine::resident_need)
      .def("plan", py::overload_cast<const std::vector<std::pair<int, int>>&>(&DeviceEngine::plan))
      .def("prefetch", &DeviceEngine::prefetch, release_gil())
      .def("prefetch_ahead", &DeviceEngine::prefetch_ahead, py::arg("max_bytes") = -1, release_gil())
      .def("acquire", &DeviceEngine::acquire, py::arg("model"), py::arg("shard"), py::arg("with_grads"), release_gil())
      .def("release", &DeviceEngine::release, release_gil())
      .def("backward_done", &DeviceEngine::backward_done, py::arg("model"), py::arg("shard"), py::arg("step"),
           py::arg("lr_scale") = 1.0, py::arg("keep") = false, release_gil())
      .def("clip_and_step", &DeviceEngine::clip_and_step, py::arg("model"), py::arg("max_norm"),
           py::arg("lr_scale") = 1.0, release_gil())
      .def("watch_loss", &DeviceEngine::watch_loss, py::arg("model"), py::arg("loss"), release_gil())
      .def("discard_grads", &DeviceEngine::discard_grads, release_gil())
      .def("synchronize", &DeviceEngine::synchronize, release_gil())
      .def("snapshot", &DeviceEngine::snapshot, release_gil())
      .def("finish", &DeviceEngine::finish, release_gil())
      .def("release_model", &DeviceEngine::release_model, release_gil())
      .def("add_base", &DeviceEngine::add_base, py::arg("store"))
      .def("use_base", &DeviceEngine::use_base, py::arg("model"), py::arg("base"), py::arg("params"))
      .def("expect_arrivals", &DeviceEngine::expect_arrivals)
      .def("stats", [](const DeviceEngine& e) { return stats_dict(e.stats()); })
      .def("host_to_device_bytes", &DeviceEngine::host_to_device_bytes)
      .def("free_bytes", &DeviceEngine::free_bytes)
      .def("uncommitted_bytes", &DeviceEngine::uncommitted_bytes)
      .def("shard_loads", &DeviceEngine::shard_loads)
      // Every shard's optimizer steps so far (engine/step_log.h): (task, shard, step, "host" | "device" |
      // "resident", start, end), times in seconds of the steady clock (steady_seconds), task -1 for a model added
      // without one.
      .def("step_log", [](const DeviceEngine& e) {
        std::vector<std::tuple<int, int, int64_t, std::string, double, double>> steps;
        for (const hydra::engine::StepRecord& r : e.step_log())
          steps.emplace_back(e.task_of(r.model), r.shard, r.step, hydra::engine::step_place_name(r.place),
                             1e-9 * static_cast<double>(r.start_ns), 1e-9 * static_cast<double>(r.end_ns));
        return steps;
      });
  // The steady clock the step log's times are read from, in seconds: its offset from time.perf_counter().
  m.def("steady_seconds", [] { return 1e-9 * static_cast<double>(hydra::engine::steady_ns()); });

  // What DeviceLoop.end reports of a unit that ran a backward (DeviceEngine.backward_done's arguments).
  py::class_<BackwardDone>(m, "BackwardDone")
      .def(py::init([](bool step, double lr_scale, bool keep, bool clip_follows) {
             return BackwardDone{step, lr_scale, keep, clip_follows};
           }),
           py::arg("step"), py::arg("lr_scale") = 1.0, py::arg("keep") = false, py::arg("clip_follows") = false)
      .def_readonly("step", &BackwardDone::step)
      .def_readonly("lr_scale", &BackwardDone::lr_scale)
      .def_readonly("keep", &BackwardDone::keep)
      .def_readonly("clip_follows", &BackwardDone::clip_follows);

  // A device worker's per-unit seam (engine/device_loop.h); it keeps the scheduler and the engine alive.
  py::class_<DeviceLoop>(m, "DeviceLoop")
      .def(py::init([](hydra::core::Scheduler& scheduler, DeviceEngine& engine, int device, int plan_units,
                       int committed_units, int64_t prefetch_bytes, bool hold_for_steps) {
             const hydra::engine::LoopOptions options{plan_units, committed_units, prefetch_bytes, hold_for_steps};
             return std::make_unique<DeviceLoop>(scheduler, engine, device, options);
           }),
           py::arg("scheduler"), py::arg("engine"), py::arg("device"), py::arg("plan_units"),
           py::arg("committed_units"), py::arg("prefetch_bytes"), py::arg("hold_for_steps") = true,
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("begin", &DeviceLoop::begin, py::arg("unit"), py::arg("step_follows") = false, release_gil())
      .def("end", &DeviceLoop::end, py::arg("unit"), py::arg("backward"), release_gil())
      .def("copied", &DeviceLoop::copied);

  // A run's models registered with its devices' engines (engine/placement.h): per model, the device it is
  // resident on (-1: none), the one device it trains on (-1: any), a spilled model's resident shards, and its id
  // in each engine (-1 where it is not registered), and its device-stepped shards; `wishes`, per model, (more
  // resident shards, device-stepped shards) asked. With `decide_only` nothing is registered, and what each
  // device's budget would have left comes after them.
  using Placed = std::vector<std::tuple<int, int, std::vector<int>, std::vector<int>, std::vector<int>>>;
  m.def(
      "place_models",
      [](const std::vector<DeviceEngine*>& engines, const std::vector<std::shared_ptr<ShardStore>>& stores,
         const std::vector<std::string>& names, const std::vector<int64_t>& graph_bytes,
         const std::vector<bool>& resident_ends, const std::vector<int>& bases,
         const std::vector<std::tuple<std::vector<int>, std::vector<int>>>& wished, bool decide_only) {
        std::vector<hydra::engine::ShardWishes> wishes;
        for (const auto& [resident, device] : wished) wishes.push_back({resident, device});
        std::vector<int64_t> free_left;
        Placed placed;
        for (hydra::engine::Placement& p :
             decide_only ? hydra::engine::decide_placement(engines, stores, names, graph_bytes, resident_ends, bases,
                                                           wishes, free_left)
                         : hydra::engine::place_models(engines, stores, names, graph_bytes, resident_ends, bases,
                                                       wishes))
          placed.emplace_back(p.resident_device, p.home_device, std::move(p.resident_shards), std::move(p.model_ids),
                              std::move(p.device_shards));
        return std::make_pair(std::move(placed), std::move(free_left));
      },
      py::arg("engines"), py::arg("stores"), py::arg("names"), py::arg("graph_bytes") = std::vector<int64_t>{},
      py::arg("resident_ends") = std::vector<bool>{}, py::arg("bases") = std::vector<int>{},
      py::arg("wishes") = std::vector<std::tuple<std::vector<int>, std::vector<int>, bool>>{},
      py::arg("decide_only") = false,
      release_gil());
}
