// Host buffers that cross to a device: pinned where the process can pin, each family one block cut in pieces.
//
// The caching host allocator behind at::empty(..., pinned_memory(true)) rounds every block up to a power of two
// and keeps freed blocks for reuse: a model's shards pinned one buffer at a time cost up to twice their bytes
// (4.5 GB more than they hold for four GPT-2-large models). A block per model, allocated at its exact size by the
// accelerator's runtime, costs what it holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hydra::engine {

// Allocates `bytes` bytes of pinned host memory as one uint8 tensor that frees them with it; throws c10::Error
// where it cannot.
using PinnedAllocator = at::Tensor (*)(int64_t bytes);

// Installs the allocator pinned_block uses and returns the one it replaces; nullptr restores the default, the
// caching host allocator. The CUDA sources install theirs (exact sizes) when the library loads.
PinnedAllocator set_pinned_allocator(PinnedAllocator allocator);

// One block of `bytes` pinned bytes; throws c10::Error where pinning is impossible.
at::Tensor pinned_block(int64_t bytes);

// Where each piece of a block starts: a cache line, so that no two pieces share one and vector loads align.
constexpr int64_t kPieceAlignBytes = 64;

// Buffers of `numels` elements of `dtype`. Where `pin`: one pinned block cut into the buffers in order, each
// starting on a kPieceAlignBytes boundary; the block is freed when the last of them is. Elsewhere, or where the
// block cannot be had (no accelerator runtime, no pinned memory left), one pageable buffer each, and `pin` turns
// false. Values are uninitialised.
std::vector<at::Tensor> host_buffers(const std::vector<int64_t>& numels, at::ScalarType dtype, bool& pin);

}  // namespace hydra::engine
