// What the simulator and its bounds share: a unit's checked times. Internal to csrc/core.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/simulator.h"

namespace hydra::core::simulated {

inline double checked(double seconds, const char* what) {
  if (!(seconds >= 0.0) || !std::isfinite(seconds)) {
    throw std::invalid_argument(std::string("simulate: ") + what + " time must be finite and >= 0, got " +
                                std::to_string(seconds));
  }
  return seconds;
}

inline double unit_compute(const UnitSeconds& compute, const Unit& unit) {
  return checked(compute(unit.task, unit.shard, unit.phase), "compute");
}

inline bool has_backward(Phase phase) { return phase == Phase::kForwardBackward || phase == Phase::kBackward; }

}  // namespace hydra::core::simulated
