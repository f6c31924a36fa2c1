// Host buffers that one model's gradient copies land in. Each is held from its copy until the host step
// that reads it is done; a fixed number of them bounds the host memory they take, and a copy that finds
// none free waits (the model's host steps that fall behind slow its copies down, not the other way round).
// Each spilled model has its own (SpilledModel): one model's slow steps never hold up another's copies.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace hydra::engine {

class StagingRing : public std::enable_shared_from_this<StagingRing> {
 public:
  // A buffer held until the lease is destroyed, whichever job ends up holding it last. It keeps its ring alive.
  class Lease {
   public:
    Lease(std::shared_ptr<StagingRing> ring, int index, at::Tensor bytes)
        : ring_(std::move(ring)), index_(index), bytes_(std::move(bytes)) {}
    ~Lease() { ring_->give_back(index_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    // `numel` elements of `dtype` at the start of the buffer.
    at::Tensor view(at::ScalarType dtype, int64_t numel) const;

   private:
    std::shared_ptr<StagingRing> ring_;
    int index_;
    at::Tensor bytes_;
  };

  // Made only as a shared_ptr (make), which its leases share. `on_free` runs whenever a buffer comes free, with
  // no lock of the ring's held (say, to poke the copy lane whose copies wait for one).
  static std::shared_ptr<StagingRing> make(int buffers, bool pinned, std::function<void()> on_free = {});
  // Blocks until a buffer is free; grows it to `bytes` when smaller.
  std::unique_ptr<Lease> acquire(int64_t bytes);
  // Whether acquire would return without waiting.
  bool has_free() const;
  // Frees the memory of the buffers no lease holds (their model is done with them); they grow again on use.
  void shrink();
  int64_t host_bytes() const;

 private:
  StagingRing(int buffers, bool pinned, std::function<void()> on_free);
  void give_back(int index);
  at::Tensor allocate(int64_t bytes) const;

  bool pinned_;
  std::function<void()> on_free_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<at::Tensor> buffers_;
  std::vector<bool> free_;
};

}  // namespace hydra::engine
