#include "engine/gradient_norm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>

#include <algorithm>

#include "ops/kernels/sum_of_squares.h"

namespace hydra::engine {

namespace {

bool summed_by_host_kernel(const at::Tensor& grad) {
  return grad.device().is_cpu() && grad.is_contiguous() &&
         (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16);
}

double host_squared_norm(const at::Tensor& grad) {
  // Chunks of a fixed size, summed in their order: threads only decide who computes which chunk.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t n = grad.numel();
  std::vector<double> partial(static_cast<size_t>((n + kChunk - 1) / kChunk), 0.0);
  const bool bf16 = grad.scalar_type() == at::kBFloat16;
  const void* data = grad.data_ptr();
  at::parallel_for(0, static_cast<int64_t>(partial.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * kChunk, count = std::min(kChunk, n - begin);
      partial[static_cast<size_t>(c)] =
          bf16 ? kernels::sum_of_squares(static_cast<const uint16_t*>(data) + begin, count)
               : kernels::sum_of_squares(static_cast<const float*>(data) + begin, count);
    }
  });
  double total = 0.0;
  for (const double p : partial) total += p;
  return total;
}

}  // namespace

double squared_norm(const std::vector<at::Tensor>& grads) {
  double total = 0.0;
  std::vector<at::Tensor> norms;  // of the buffers ATen reduces, one element each, where the buffers are
  for (const at::Tensor& grad : grads) {
    if (summed_by_host_kernel(grad)) {
      total += host_squared_norm(grad);
      continue;
    }
    // Reduced precision accumulates in float32; float32 and double in their own type.
    const bool reduced = grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kHalf;
    const auto accumulate = reduced ? c10::optional<at::ScalarType>(at::kFloat) : c10::nullopt;
    norms.push_back(at::linalg_vector_norm(grad, 2, c10::nullopt, false, accumulate).to(at::kDouble));
  }
  // One read: a model's buffers are all on one device (a resident model's) or on the host.
  if (!norms.empty()) total += at::stack(norms).square().sum().item<double>();
  return total;
}

}  // namespace hydra::engine
