// A model whose whole training state (weights, gradients, an fp32 master in bf16, optimizer states) fits on
// the device: every shard has a home there (engine/shard_homes.h), uploaded once, on first use; its shards
// compute in place and step on the device, after their backward on the compute stream.
#pragma once

#include "engine/device_model.h"
#include "engine/shard_homes.h"

namespace hydra::engine {

class ResidentModel final : public DeviceModel {
 public:
  ResidentModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store);
  bool resident() const override { return true; }
  bool homed(int /*shard*/) const override { return true; }
  void upload() override;
  void backward_done(int shard, bool step, double lr_scale, bool keep) override;
  std::shared_ptr<ClipNorm> clip_and_step(double max_norm, double lr_scale) override;
  void discard_grads() override;
  void copy_home() override;
  void free_device_memory(const Fence& issued) override;

 protected:
  void make_computable(int shard, bool with_grads) override;

 private:
  ShardHomes homes_;
};

}  // namespace hydra::engine
