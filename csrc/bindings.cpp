// The Python module hydra_torch._C: the only translation unit that includes torch/extension.h.
// Ops register themselves through TORCH_LIBRARY in their own files; this file binds the engine's
// non-tensor objects with pybind11.
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "hydra-torch native engine";
  m.attr("built_torch_version") = HYDRA_TORCH_BUILT_TORCH_VERSION;
}
