// The squared L2 norm of a gradient buffer, for clipping's global norm.
#pragma once

#include <ATen/core/Tensor.h>

namespace hydra::engine {

// Host float32 and bfloat16 buffers are summed in double by hydra's kernel (ops/kernels/sum_of_squares.h):
// in chunks of a fixed size, whatever the thread count, so the result is the same on every machine. Device
// buffers go through ATen's norm, whose GPU reduction is a tree and accurate in float32; its result is read.
double squared_norm(const at::Tensor& grad);

}  // namespace hydra::engine
