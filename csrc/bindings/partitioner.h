// Python bindings of the torch-free partitioner, kept out of module.cpp so they compile without torch.
#pragma once

#include <pybind11/pybind11.h>

namespace hydra {

void bind_partitioner(pybind11::module_& m);

}  // namespace hydra
