// A model whose whole training state (weights, gradients, an fp32 master in bf16, optimizer states) fits on
// the device: uploaded once, on first use; its shards compute in place and step on the device, after their
// backward on the compute stream. Each parameter has one copy, in its owner shard's buffers, so a tied weight
// is one tensor on the device too.
#pragma once

#include "engine/device_model.h"

namespace hydra::engine {

class ResidentModel final : public DeviceModel {
 public:
  using DeviceModel::DeviceModel;
  bool resident() const override { return true; }
  // Puts the model's state on the device (the engine's first use). Either all of it is uploaded, or, when
  // this throws, none: the next first use tries again.
  void upload();
  void backward_done(int shard, bool step, double lr_scale, bool keep) override;
  std::shared_ptr<ClipNorm> clip_and_step(double max_norm, double lr_scale) override;
  void discard_grads() override;
  void copy_home() override;
  void free_device_memory(const Fence& issued) override;

 protected:
  void make_computable(int shard, bool with_grads) override;

 private:
  struct Home {  // a shard's owned parameters' state, in master layout
    Region weights, grads, master;
    std::vector<Region> states;
  };
  at::Tensor view(int shard, const Region& region, at::ScalarType dtype) const;
  at::Tensor state_view(int shard, const Region& region) const;  // optimizer state: the trainable range
  // The shard's optimizer step over its gradients, scaled by `grad_scale`, queued on the compute stream.
  void step(int shard, double grad_scale, double lr_scale);
  // Gives the valid regions of `homes` back to the pool, once `issued` is done, and empties it.
  void free_regions(std::vector<Home>& homes, const Fence& issued);
  std::vector<Home> homes_;
};

}  // namespace hydra::engine
