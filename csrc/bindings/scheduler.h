// Python bindings of the torch-free scheduler, kept out of module.cpp so they compile without torch.
#pragma once

#include <pybind11/pybind11.h>

namespace hydra {

void bind_scheduler(pybind11::module_& m);

}  // namespace hydra
