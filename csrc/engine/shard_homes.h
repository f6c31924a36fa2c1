// The device homes of a model's shards: each held shard's whole training state (weights and gradients in the
// compute dtype, an fp32 master in bf16, optimizer states) lives on the device, uploaded once, stepped there
// through the hydra ops after its backward on the compute stream, and copied home for a checkpoint or the
// model's end. A ResidentModel holds every shard this way; a SpilledModel may hold some (its resident shards:
// by default the first and the last, whose round trip through the host would bound the step) and spill the
// rest. Each parameter lives once, in its owner shard's home, so a tied weight is one tensor on the device.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "engine/device_pool.h"
#include "engine/fence.h"
#include "engine/shard_store.h"

namespace hydra::engine {

class DeviceEngine;

class ShardHomes {
 public:
  // Every region is rounded up to the pool's 512-byte alignment: a home has at most 5 regions (weights,
  // gradients, master, two optimizer states).
  static constexpr int64_t kSlack = 5 * 512;
  // What a home of `shard` takes of the budget, its regions' alignment included.
  static int64_t need(const ShardStore& store, int shard);

  // The homes of model `model` of the engine.
  ShardHomes(DeviceEngine& engine, int model) : engine_(engine), model_(model) {}
  ShardHomes(const ShardHomes&) = delete;
  ShardHomes& operator=(const ShardHomes&) = delete;

  // Copies the listed shards' state to the device (the model's first use). Either all of it is uploaded, or,
  // when this throws, none: the next first use tries again.
  void upload(ShardStore& store, const std::vector<int>& shards);
  bool uploaded() const { return !homes_.empty(); }
  bool holds(int shard) const;
  // The owner shard's weights and gradients in the compute dtype, in its master layout.
  at::Tensor weights(const ShardStore& store, int shard) const;
  at::Tensor grads(const ShardStore& store, int shard) const;
  // The trainable part of each held shard's gradients: what a global norm sums.
  std::vector<at::Tensor> trainable_grads(const ShardStore& store) const;
  // The shard's optimizer step over its gradients (the parameters take_step chose), scaled by `grad_scale`,
  // queued on the compute stream; the gradients are zeroed for the next step. Logged (engine/step_log.h).
  void step(ShardStore& store, int shard, double grad_scale, double lr_scale);
  void zero_grads(const ShardStore& store);
  // Copies the held shards' state into the store (after the model's work on the device is issued).
  void copy_home(ShardStore& store) const;
  // Gives every region back to the pool, once `issued` is done.
  void free(const Fence& issued);
  // Bytes an upload copies to the device.
  static int64_t upload_bytes(const ShardStore& store, int shard);

 private:
  struct Home {  // in master layout; invalid regions for a shard not held
    Region weights, grads, master;
    std::vector<Region> states;
  };
  static void free_regions(DeviceEngine& engine, std::vector<Home>& homes, const Fence& issued);
  at::Tensor view(const ShardStore& store, int shard, const Region& region, at::ScalarType dtype) const;
  at::Tensor state_view(const ShardStore& store, int shard, const Region& region) const;

  DeviceEngine& engine_;
  const int model_;
  std::vector<Home> homes_;  // per shard of the model, once uploaded
};

}  // namespace hydra::engine
