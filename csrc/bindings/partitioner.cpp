#include "bindings/partitioner.h"

#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "core/partitioner.h"

namespace py = pybind11;

namespace hydra {

void bind_partitioner(py::module_& m) {
  using core::Plan;

  // std::invalid_argument (a budget too small, bad costs) reaches Python as ValueError.
  py::class_<Plan>(m, "PartitionPlan")
      .def_readonly("starts", &Plan::starts)
      .def_readonly("shard_bytes", &Plan::shard_bytes)
      .def_readonly("shard_weight_bytes", &Plan::shard_weight_bytes)
      .def_readonly("shard_activation_bytes", &Plan::shard_activation_bytes)
      .def_readonly("shard_seconds", &Plan::shard_seconds)
      .def_readonly("prefetch_bytes", &Plan::prefetch_bytes)
      .def_readonly("bottleneck_seconds", &Plan::bottleneck_seconds)
      .def_readonly("ideal_seconds", &Plan::ideal_seconds);

  m.def(
      "partition",
      [](const std::vector<std::tuple<int64_t, int64_t, double>>& pieces, int64_t budget_bytes, int max_shards) {
        std::vector<core::PieceCost> costs;
        costs.reserve(pieces.size());
        for (const auto& [weight, activation, seconds] : pieces) costs.push_back({weight, activation, seconds});
        return core::partition(costs, budget_bytes, max_shards);
      },
      py::arg("pieces"), py::arg("budget_bytes"), py::arg("max_shards") = 0,
      "pieces: (weight_bytes, activation_bytes, seconds) per piece, in order. The contiguous shards with the "
      "smallest largest time, then the fewest, whose 2 x weights + activations + prefetch fit the budget.");
  m.def(
      "min_partition_budget",
      [](const std::vector<std::tuple<int64_t, int64_t, double>>& pieces) {
        std::vector<core::PieceCost> costs;
        for (const auto& [weight, activation, seconds] : pieces) costs.push_back({weight, activation, seconds});
        return core::min_budget_bytes(costs);
      },
      py::arg("pieces"), "The smallest budget any partition of these pieces fits.");
  m.attr("shard_slack_bytes") = core::kShardSlackBytes;
}

}  // namespace hydra
