#include "engine/staging_ring.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace hydra::engine {

namespace {

// The first buffer no lease holds, or -1.
int first_free(const std::vector<bool>& free) {
  const auto it = std::find(free.begin(), free.end(), true);
  return it == free.end() ? -1 : static_cast<int>(it - free.begin());
}

}  // namespace

at::Tensor StagingRing::allocate(int64_t bytes) const {
  // The caching host allocator, not host_memory.h's exact blocks: a buffer grows while the model trains, and the
  // cache takes the one it replaces back without waiting for the device, which cudaFreeHost would.
  if (pinned_) {
    try {
      return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    } catch (const c10::Error&) {
      // no pinned memory left (or none on this machine): pageable memory still works, copies are slower
    }
  }
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
}

at::Tensor StagingRing::Lease::view(at::ScalarType dtype, int64_t numel) const {
  return bytes_.narrow(0, 0, numel * c10::elementSize(dtype)).view(dtype);
}

StagingRing::StagingRing(int buffers, bool pinned, std::function<void()> on_free)
    : pinned_(pinned), on_free_(std::move(on_free)), buffers_(buffers), free_(buffers, true) {}

std::shared_ptr<StagingRing> StagingRing::make(int buffers, bool pinned, std::function<void()> on_free) {
  TORCH_CHECK(buffers >= 1, "StagingRing: buffers must be >= 1, got ", buffers);
  return std::shared_ptr<StagingRing>(new StagingRing(buffers, pinned, std::move(on_free)));
}

bool StagingRing::has_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_free(free_) >= 0;
}

void StagingRing::shrink() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (free_[i]) buffers_[i] = at::Tensor();
}

std::unique_ptr<StagingRing::Lease> StagingRing::acquire(int64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  int index = -1;
  freed_.wait(lock, [this, &index] { return (index = first_free(free_)) >= 0; });
  free_[index] = false;
  at::Tensor& buffer = buffers_[index];
  if (!buffer.defined() || buffer.numel() < bytes) {
    lock.unlock();  // allocating pinned memory is slow: other leases may come and go meanwhile
    at::Tensor grown;
    try {
      grown = allocate(bytes);
    } catch (...) {
      give_back(index);
      throw;
    }
    lock.lock();
    buffer = std::move(grown);
  }
  return std::make_unique<Lease>(shared_from_this(), index, buffer);
}

int64_t StagingRing::host_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const at::Tensor& b : buffers_) total += b.defined() ? b.numel() : 0;
  return total;
}

void StagingRing::give_back(int index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[index] = true;
  }
  freed_.notify_one();
  if (on_free_) on_free_();
}

}  // namespace hydra::engine
