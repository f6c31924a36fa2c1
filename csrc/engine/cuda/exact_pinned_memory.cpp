// Pinned host blocks at their exact size, straight from the CUDA runtime (engine/host_memory.h says why).
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "engine/host_memory.h"

namespace hydra::engine {

namespace {

at::Tensor exact_pinned_block(int64_t bytes) {
  void* data = nullptr;
  // Portable: pinned for every device's context, since a model may be placed on another device when re-planned.
  const cudaError_t error = cudaHostAlloc(&data, static_cast<size_t>(bytes > 0 ? bytes : 1), cudaHostAllocPortable);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // taken, so that the next CUDA call does not report it as its own
    TORCH_CHECK(false, "cudaHostAlloc of ", bytes, " bytes failed: ", cudaGetErrorString(error));
  }
  // cudaFreeHost waits for the device to be idle: a block goes only when its model's store does, not per step.
  return at::from_blob(
      data, {bytes}, [](void* block) { (void)cudaFreeHost(block); }, at::TensorOptions().dtype(at::kByte));
}

[[maybe_unused]] const PinnedAllocator replaced = set_pinned_allocator(&exact_pinned_block);

}  // namespace

}  // namespace hydra::engine
