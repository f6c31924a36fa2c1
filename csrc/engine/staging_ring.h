// Host buffers that a device's gradient copies land in. Each is held from its copy until the host step
// that reads it is done; a fixed number of them bounds the host memory they take, and a copy that finds
// none free waits (host steps that fall behind slow the copies down, not the other way round).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

namespace hydra::engine {

class StagingRing {
 public:
  // A buffer held until the lease is destroyed, whichever job ends up holding it last.
  class Lease {
   public:
    Lease(StagingRing* ring, int index, at::Tensor bytes) : ring_(ring), index_(index), bytes_(std::move(bytes)) {}
    ~Lease() { ring_->give_back(index_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    // `numel` elements of `dtype` at the start of the buffer.
    at::Tensor view(at::ScalarType dtype, int64_t numel) const;

   private:
    StagingRing* ring_;
    int index_;
    at::Tensor bytes_;
  };

  StagingRing(int buffers, bool pinned);
  // Blocks until a buffer is free; grows it to `bytes` when smaller.
  std::unique_ptr<Lease> acquire(int64_t bytes);
  int64_t host_bytes() const;

 private:
  void give_back(int index);
  at::Tensor allocate(int64_t bytes) const;

  bool pinned_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<at::Tensor> buffers_;
  std::vector<bool> free_;
};

}  // namespace hydra::engine
