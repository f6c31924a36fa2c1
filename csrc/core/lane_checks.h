// The lane model's checks of its inputs, before anything is computed from them. Internal to csrc/core.
#pragma once

#include <string>
#include <vector>

#include "core/lanes.h"

namespace hydra::core::lane_checks {

// Throws std::invalid_argument("lanes: " + what) unless `ok`.
void require(bool ok, const std::string& what);

// Every rate finite and > 0, every byte count and time finite and >= 0, every task with a shard, ties within it.
void validate(const std::vector<TaskShape>& tasks, const LaneRates& rates, const StepBytes& bytes, int num_devices);

// One place for every shard of every task, and tied shards in the same place.
void validate_placement(const std::vector<TaskShape>& tasks, const Placement& placement);

}  // namespace hydra::core::lane_checks
