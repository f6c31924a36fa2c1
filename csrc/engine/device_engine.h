// Everything one compute device does for the models that train on it: where each shard's training state
// lives, copies in and out on a side stream, rebinding module parameters, and the optimizer steps.
//
// A model is *resident* on the device when all of its training state (weights, gradients, optimizer state)
// fits in what the budget has left: then nothing is copied after the first upload and steps run on the
// device. Otherwise it is *spilled*: weights and gradients visit the device around each shard's compute,
// copies overlap other compute (prefetch), the optimizer runs on the host as soon as a shard's gradients
// arrive, and weight copies stay cached while the budget allows, evicted by furthest next use.
//
// Call order per shard visit, from the thread that issues the compute:
//   acquire(model, shard, with_grads) -> prefetch(next...) -> compute -> [backward_done] -> release
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "engine/device_pool.h"
#include "engine/host_worker.h"
#include "engine/shard_store.h"

namespace hydra::engine {

struct EngineStats {
  int64_t budget_bytes = 0;
  int64_t capacity_bytes = 0;
  int64_t high_water_bytes = 0;
  int64_t host_to_device_bytes = 0;
  int64_t device_to_host_bytes = 0;
  int64_t host_to_device_copies = 0;
  int64_t device_to_host_copies = 0;
  // Where the host worker's time goes (spilled models): fp32 optimizer steps, and waiting for gradient
  // copies to land plus adding them into the fp32 accumulators. Seconds summed over jobs.
  int64_t host_steps = 0;
  double host_step_seconds = 0.0;
  double grad_copy_seconds = 0.0;
};

class DeviceEngine {
 public:
  DeviceEngine(c10::Device device, int64_t budget_bytes);
  ~DeviceEngine();

  // Validates that the model can train within what the budget has left and decides resident (when allowed
  // and it fits) or spilled. Throws, changing nothing, when even its largest shard cannot fit. Returns the
  // model's id on this device. A model that may run on several devices must be spilled on all of them.
  int add_model(std::shared_ptr<ShardStore> store, bool allow_resident = true);
  bool resident(int model) const { return models_.at(model).resident; }
  // The smallest budget a spilled model needs: its largest shard's weights and gradients at once.
  static int64_t min_spilled_bytes(const ShardStore& store);
  static int64_t resident_bytes(const ShardStore& store);
  // What add_model checks against the budget: the above plus the arena's alignment of each region.
  static int64_t spilled_need(const ShardStore& store);
  static int64_t resident_need(const ShardStore& store);

  // The shard visits expected next on this device, in order, replacing the previous plan; eviction looks
  // ahead through it and each acquire consumes its visit.
  void plan(const std::vector<std::pair<int, int>>& visits);
  void plan(int model, const std::vector<int>& shards);
  void prefetch(int model, int shard);
  void acquire(int model, int shard, bool with_grads);
  void release(int model, int shard);
  // The shard's backward for this micro-batch is issued. Gradients are accumulated; with `step` the shard's
  // optimizer step follows (on the host for spilled models, overlapping the compute of other shards).
  void backward_done(int model, int shard, bool step);
  // Global-norm clipping: after backward_done(step=false) on every shard, scales all gradients so their
  // norm is at most max_norm (as torch.nn.utils.clip_grad_norm_), steps every shard, returns the norm.
  double clip_and_step(int model, double max_norm);
  // Forgets the gradients accumulated since the last step (a failed micro-batch must not leak into one).
  void discard_grads(int model);
  // Waits for all of the model's queued host work, on every device (the model's jobs form one chain),
  // rethrowing the first error of the jobs queued here.
  void synchronize(int model);
  // Brings device-resident state home and points the user's parameters at host tensors again; does so
  // even when a queued job failed, then rethrows that job's error.
  void finish(int model);

  EngineStats stats() const;
  int64_t host_to_device_bytes() const { return stats_.host_to_device_bytes; }
  // What the budget has left after the models added so far (their resident state or spilled working set).
  int64_t free_bytes() const { return pool_.budget() - resident_committed_ - spilled_reserve_; }
  // How many times each of the model's shards was copied to the device.
  std::vector<int64_t> shard_loads(int model) const;

 private:
  struct ShardState {
    // Spilled: a cached weight copy, and a gradient buffer while backward runs.
    Region weights, grads;
    Fence ready, last_use;
    bool cached = false;
    int64_t version = 0;  // of the store's shard when copied in
    int pins = 0;
    int64_t loads = 0;
    // Resident: the shard's whole training state, in master layout.
    Region home_weights, home_grads, home_master;
    std::vector<Region> home_states;
  };
  struct Model {
    std::shared_ptr<ShardStore> store;
    bool resident = false;
    bool uploaded = false;
    std::vector<ShardState> shards;
    std::vector<Fence> jobs;  // queued host work, so errors surface on synchronize
  };

  static int64_t key(int model, int shard) { return (static_cast<int64_t>(model) << 32) | shard; }
  c10::Stream compute_stream() const;
  Fence compute_point() const;  // everything issued so far on the compute stream
  // How hard an allocation tries: a prefetch only displaces shards needed later than its own (Belady); an
  // allocation for the shard about to compute evicts any unpinned shard, and `kMust` fails loudly.
  enum class Need { kPrefetch, kEvictAny, kMust };
  Allocation allocate(int model, int shard, int64_t bytes, Need need);
  bool load(int model, int shard, Need need);
  void allocate_grads(int model, int shard);
  void start();  // on first use: uploads every resident model
  void upload_resident(int model);
  void bind(int model, int shard, bool with_grads);
  void step_resident(int model, int shard, double grad_scale);
  void step_spilled(int model, int shard, double grad_scale);
  // On the worker thread; `landed` as step_host's (device_engine_training.cpp).
  void timed_step_host(ShardStore& store, int shard, double grad_scale, const at::Tensor& landed);
  Fence submit(int model, std::function<DeviceEvent()> job);
  void evict(ShardState& state);
  bool current(int model, int shard) const;
  at::Tensor grad_view(int model, int shard);
  at::Tensor home_view(int model, int shard, const Region& region, at::ScalarType dtype);

  c10::Device device_;
  bool has_streams_;
  std::optional<c10::Stream> copy_stream_;
  DevicePool pool_;
  std::vector<Model> models_;
  std::deque<int64_t> upcoming_;
  at::Tensor staging_;  // pinned host landing buffer for gradient copies, one shard at a time
  int64_t resident_committed_ = 0;  // the resident models' whole state
  int64_t spilled_reserve_ = 0;     // the largest working set (one shard's weights and gradients) of a spilled model
  EngineStats stats_;
  // Written by the worker thread, read by stats(): kept apart from stats_, which only the caller's thread touches.
  std::atomic<int64_t> host_steps_{0}, host_step_ns_{0}, grad_copy_ns_{0};
  HostWorker worker_;  // last member: destroyed first, so no job outlives what it captures
};

}  // namespace hydra::engine
