#include "engine/host_memory.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace hydra::engine {

namespace {

// Constant-initialised, so an allocator installed by another translation unit's static initialiser stays.
std::atomic<PinnedAllocator> installed{nullptr};

at::Tensor caching_pinned_block(int64_t bytes) {
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
}

int64_t round_up(int64_t bytes) { return (bytes + kPieceAlignBytes - 1) / kPieceAlignBytes * kPieceAlignBytes; }

}  // namespace

PinnedAllocator set_pinned_allocator(PinnedAllocator allocator) { return installed.exchange(allocator); }

at::Tensor pinned_block(int64_t bytes) {
  const PinnedAllocator allocate = installed.load();
  return allocate ? allocate(bytes) : caching_pinned_block(bytes);
}

std::vector<at::Tensor> host_buffers(const std::vector<int64_t>& numels, at::ScalarType dtype, bool& pin) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  std::vector<at::Tensor> buffers;
  buffers.reserve(numels.size());
  if (pin) {
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (int64_t n : numels) {
      TORCH_CHECK(n >= 0, "host_buffers: a buffer of ", n, " elements");
      offsets.push_back(total);
      total = round_up(total + n * element);
    }
    try {
      const at::Tensor block = pinned_block(total);
      for (size_t i = 0; i < numels.size(); ++i)
        buffers.push_back(block.narrow(0, offsets[i], numels[i] * element).view(dtype));
      return buffers;
    } catch (const c10::Error&) {
      pin = false;  // no pinning here: copies still work, staged through a bounce buffer and synchronous
    }
  }
  for (int64_t n : numels) buffers.push_back(at::empty({n}, at::TensorOptions().dtype(dtype)));
  return buffers;
}

}  // namespace hydra::engine
