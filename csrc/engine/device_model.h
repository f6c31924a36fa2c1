// One model as one device holds it: the per-model half of DeviceEngine (engine/device_engine.h). A model is
// one of two kinds, fixed when it is added:
//   ResidentModel (engine/resident_model.h): its whole training state lives on the device; steps run there.
//   SpilledModel (engine/spilled_model.h): weights and gradients visit the device around each shard's
//   compute; steps run on the host. Some of its shards may be resident, as a ResidentModel's all are.
// What both kinds share lives here: pinning a shard while it computes, pointing the user's parameters at
// device memory, noting which parameters received a gradient, and the model's chain of host jobs.
// DeviceEngine owns the models and the device-wide parts they use (memory pool, copy lanes, host-step
// threads, statistics); every call comes from the thread that issues the device's compute.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "engine/clip_norm.h"
#include "engine/device_engine.h"
#include "engine/shard_homes.h"

namespace hydra::engine {

class DeviceModel {
 public:
  DeviceModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store);
  virtual ~DeviceModel() = default;
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  // The whole model lives on the device.
  virtual bool resident() const = 0;
  // The shard's whole state lives on the device (engine/shard_homes.h): every shard of a resident model, the
  // resident shards of a spilled one.
  virtual bool homed(int shard) const = 0;
  // Puts the state of the shards that live on the device there (the engine's first use); all or nothing.
  virtual void upload() {}
  // Pins the shard, makes it computable (its weights, and with_grads room for its gradients) and points the
  // module's parameters at it. A failed acquire holds nothing: a pinned shard could never be evicted.
  void acquire(int shard, bool with_grads);
  // Unpins the shard; gradients of a backward that never completed (an error) are dropped.
  void release(int shard);
  // See DeviceEngine::backward_done.
  virtual void backward_done(int shard, bool step, double lr_scale, bool keep) = 0;
  // See DeviceEngine::clip_and_step.
  virtual std::shared_ptr<ClipNorm> clip_and_step(double max_norm, double lr_scale) = 0;
  // Forgets the gradients accumulated since the last step (after synchronize()).
  virtual void discard_grads() = 0;
  // Copies state that lives on the device into the store (after synchronize()); nothing for a spilled model.
  virtual void copy_home() {}
  // Frees everything the model holds on the device, and the host buffers its gradients landed in; `issued`:
  // everything issued on the compute stream so far.
  virtual void free_device_memory(const Fence& issued) = 0;

  // Queues a host job of `shards` (a shard and the owners of what it borrows: ShardStore::sources; none: of every
  // shard) after the model's jobs of those shards queued before it, on any device (the store keeps the chain).
  // `startable` says, without blocking, whether whatever else the job waits for (copies) is done; none: nothing else.
  // Of the model's jobs that can start, the one of the lowest shard runs first: the next forward needs it first (a
  // tied head's job ranks as the embedding it sums into, whose step waits for it).
  Fence submit(std::function<DeviceEvent()> job, std::function<bool()> startable = {},
               const std::vector<int>& shards = {});
  // A copy or job of the model's, whose error synchronize() must report.
  Fence track(Fence fence);
  // Waits for every queued host job and copy of the model's, rethrowing the first error among them.
  void synchronize();

  int id() const { return id_; }
  ShardStore& store() const { return *store_; }
  std::shared_ptr<ShardStore> store_ptr() const { return store_; }
  int pins(int shard) const { return visits_.at(shard).pins; }
  // Throws c10::Error naming the model's shard count unless 0 <= shard < it.
  void check_shard(int shard) const;
  bool released() const { return !store_; }
  // After free_device_memory: the engine no longer holds the store.
  void drop_store() { store_.reset(); }
  std::vector<int64_t> shard_loads() const;
  // What the model takes of the device's budget for good (its homes), set by the engine when it is added.
  int64_t committed_bytes() const { return committed_bytes_; }
  void set_committed_bytes(int64_t bytes) { committed_bytes_ = bytes; }

 protected:
  // Brings the pinned shard's state to the device for its compute and binds it. If it throws, it holds
  // nothing it did not hold before.
  virtual void make_computable(int shard, bool with_grads) = 0;
  // The shard is unpinned (pins(shard) counts what is left).
  virtual void after_release(int shard) {}
  // Whether a pinned shard may be pinned again by another unit: a homed shard's state is always in place (an
  // evaluation's unit may hold it too), and a shared frozen base's shard serves every task that uses it.
  virtual bool may_pin_again(int shard) const { return homed(shard); }
  // Where bind() points one parameter: a flat weight buffer (and gradient buffer) and the parameter's offset
  // in it; its gradient's offset where that differs (a tied weight whose gradient sums in its owner's buffer).
  struct Place {
    at::Tensor weights, grads;
    int64_t offset = 0;
    int64_t grad_offset = -1;  // -1: `offset`
  };
  // Points every parameter of the shard at its place (and, with_grads, its .grad at its offset of the gradient
  // buffer), and remembers the .grad tensors for note_gradients.
  void bind(int shard, bool with_grads, const std::function<Place(const ParamEntry&)>& place);
  // Tells the store which of the shard's parameters received a gradient since bind() (see Visit).
  void note_gradients(int shard);
  void count_load(int shard) { ++visits_[shard].loads; }
  // The shard's home was uploaded: one load of `bytes` to the device.
  void count_upload(int shard, int64_t bytes);
  // bind() for a shard whose parameters all live in their owners' homes.
  void bind_homes(const ShardHomes& homes, int shard, bool with_grads);

  DeviceEngine& engine_;

 private:
  struct Visit {
    int pins = 0;
    int64_t loads = 0;  // copies of the shard to the device
    // The .grad tensors bind() gave the parameters, per layout entry (undefined where none), while the shard
    // is acquired with gradients. Each has a version counter of its own, which autograd's in-place
    // accumulation bumps: a tensor whose counter moved is a parameter that received a gradient.
    std::vector<at::Tensor> bound_grads;
  };
  const int id_;
  std::shared_ptr<ShardStore> store_;
  std::vector<Visit> visits_;
  std::vector<Fence> jobs_;  // queued copies and host jobs, so errors surface on synchronize
  int64_t committed_bytes_ = 0;
};

}  // namespace hydra::engine
