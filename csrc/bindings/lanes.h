// Python bindings of the lane model (core/lanes.h, core/lane_plan.h), kept out of module.cpp so they compile
// without torch.
#pragma once

#include <pybind11/pybind11.h>

namespace hydra {

void bind_lanes(pybind11::module_& m);

}  // namespace hydra
