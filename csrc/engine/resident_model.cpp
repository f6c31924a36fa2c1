#include "engine/resident_model.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <numeric>

#include "engine/gradient_norm.h"

namespace hydra::engine {

ResidentModel::ResidentModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store)
    : DeviceModel(engine, id, std::move(store)), homes_(engine, id) {}

void ResidentModel::upload() {
  if (homes_.uploaded()) return;
  ShardStore& store = this->store();
  std::vector<int> shards(store.num_shards());
  std::iota(shards.begin(), shards.end(), 0);
  homes_.upload(store, shards);
  for (int s : shards) count_upload(s, ShardHomes::upload_bytes(store, s));
}

void ResidentModel::make_computable(int shard, bool with_grads) {
  TORCH_CHECK(homes_.uploaded(), "shard ", shard, " of model ", id(), " acquired before the model's upload");
  bind_homes(homes_, shard, with_grads);
}

void ResidentModel::backward_done(int shard, bool step, double lr_scale, bool /*keep*/) {
  note_gradients(shard);
  if (!step) return;
  // Waits for the loss's copy only (the forward), not for the backward just queued.
  const std::shared_ptr<const LossGate> gate = store().loss_gate();
  if (!gate || gate->open()) homes_.step(store(), shard, 1.0, lr_scale);
}

std::shared_ptr<ClipNorm> ResidentModel::clip_and_step(double max_norm, double lr_scale) {
  synchronize();  // nothing of the model's in flight on the host either
  auto norm = std::make_shared<ClipNorm>(max_norm);
  norm->set(std::sqrt(squared_norm(homes_.trainable_grads(store()))));
  if (!norm->finite()) {  // no shard steps: the weights stay those of the last completed step
    discard_grads();
    return norm;
  }
  for (int s = store().num_shards() - 1; s >= 0; --s) homes_.step(store(), s, norm->scale(), lr_scale);
  return norm;
}

void ResidentModel::discard_grads() {
  store().forget_gradients();
  homes_.zero_grads(store());
}

void ResidentModel::copy_home() { homes_.copy_home(store()); }

void ResidentModel::free_device_memory(const Fence& issued) { homes_.free(issued); }

}  // namespace hydra::engine
