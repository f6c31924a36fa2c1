// The lane model's view of tied weights (lanes.h): where a tie's gradient sums, what a borrower of a resident owner
// copies, the groups a move takes as one, and the gradient buffers ties keep on the device.
#pragma once

#include <cstdint>
#include <vector>

#include "core/lanes.h"

namespace hydra::core {

// Where each backward is followed by its step, the bytes of the gradient buffers a task's device-stepped ties keep
// for the run (see lane_ties.cpp).
int64_t tie_buffer_bytes(const TaskShape& task, const std::vector<StepPlace>& places, const StepBytes& bytes);
// The owners of a tie group's tied weights, which a move to kResident may take alone, where every borrower trains
// weights of its own besides (`params` > 0); else none.
std::vector<int> owners_alone(const TaskShape& task, const std::vector<int>& group);

}  // namespace hydra::core
