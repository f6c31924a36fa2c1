// The squared L2 norm of a model's gradients, for clipping's global norm.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace hydra::engine {

// Host float32 and bfloat16 buffers are summed in double by hydra's kernel (ops/kernels/sum_of_squares.h):
// in chunks of a fixed size, whatever the thread count, so the result is the same on every machine. Other
// buffers go through ATen's norm (on a GPU a tree reduction, accurate in float32); their norms are summed where
// they are and read once, so a model's gradients on a device cost one synchronisation, not one a shard.
double squared_norm(const std::vector<at::Tensor>& grads);
inline double squared_norm(const at::Tensor& grad) { return squared_norm(std::vector<at::Tensor>{grad}); }

}  // namespace hydra::engine
