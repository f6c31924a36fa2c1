#include "core/lane_checks.h"

#include <cmath>
#include <stdexcept>

namespace hydra::core::lane_checks {

namespace {

bool finite_nonnegative(double x) { return std::isfinite(x) && x >= 0.0; }
bool finite_positive(double x) { return std::isfinite(x) && x > 0.0; }

}  // namespace

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("lanes: " + what);
}

void validate(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes,
              int num_devices) {
  require(num_devices >= 1, "num_devices must be >= 1");
  require(finite_positive(rates.host_to_device) && finite_positive(rates.device_to_host) &&
              finite_positive(rates.host) && finite_positive(rates.device_memory),
          "every lane rate must be finite and > 0");
  require(finite_nonnegative(bytes.weight) && finite_nonnegative(bytes.state) && finite_nonnegative(bytes.host_step) &&
              finite_nonnegative(bytes.host_accumulate) && finite_nonnegative(bytes.device_step),
          "bytes per element must be finite and >= 0");
  for (size_t t = 0; t < tasks.size(); ++t) {
    const TaskShape& task = tasks[t];
    const std::string name = "task " + std::to_string(t);
    require(!task.shards.empty(), name + " has no shard");
    require(task.micro_batches >= 1 && task.accumulate >= 1, name + " needs micro_batches >= 1 and accumulate >= 1");
    require(task.kept.empty() || task.kept.size() == task.shards.size(), name + ": kept names every shard or none");
    for (size_t s = 0; s < task.shards.size(); ++s) {
      const ShardShape& shard = task.shards[s];
      const std::string where = name + " shard " + std::to_string(s);
      require(finite_nonnegative(shard.forward_seconds) && finite_nonnegative(shard.backward_seconds),
              where + ": seconds must be finite and >= 0");
      require(shard.weights >= 0 && shard.grads >= 0 && shard.params >= 0, where + ": element counts must be >= 0");
      require(shard.borrowed >= 0 && shard.borrowed <= shard.weights && (shard.tied_to >= 0 || shard.borrowed == 0),
              where + ": borrowed must be >= 0, within its weights, and only where it is tied");
      require(shard.tied_to < static_cast<int>(task.shards.size()) && shard.tied_to != static_cast<int>(s),
              where + ": tied_to names no other shard of the task");
    }
  }
}

void validate_placement(const std::vector<TaskShape>& tasks, const Placement& placement) {
  require(placement.size() == tasks.size(), "the placement names " + std::to_string(placement.size()) +
                                                " tasks, the shapes " + std::to_string(tasks.size()));
  for (size_t t = 0; t < tasks.size(); ++t) {
    require(placement[t].size() == tasks[t].shards.size(),
            "task " + std::to_string(t) + ": the placement's shard count differs from the shape's");
    for (size_t s = 0; s < tasks[t].shards.size(); ++s) {
      // A tie's gradient sums where its owner steps, on the device or the host, and its weight lives where its
      // owner does: a resident owner's borrowers read it in its home, but a resident borrower would hold a second
      // copy of a spilled owner's. A borrower with nothing of its own to train steps with a resident owner.
      const ShardShape& shard = tasks[t].shards[s];
      const int tied = shard.tied_to;
      if (tied < 0) continue;
      const bool resident = placement[t][s] == StepPlace::kResident;
      const bool owner_resident = placement[t][static_cast<size_t>(tied)] == StepPlace::kResident;
      const std::string where = "task " + std::to_string(t) + ": shard " + std::to_string(s);
      require(!resident || owner_resident, where + " is resident and borrows a tied weight from shard " +
                                               std::to_string(tied) + ", which is not: its owner is resident too");
      require(resident || !owner_resident || shard.params > 0,
              where + " has nothing of its own to train and borrows a tied weight from resident shard " +
                  std::to_string(tied) + ": it is resident with its owner");
    }
  }
}

}  // namespace hydra::core::lane_checks
