#include "engine/resident_model.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "engine/gradient_norm.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

at::Tensor ResidentModel::view(int shard, const Region& region, at::ScalarType dtype) const {
  return engine_.pool_.view(region, dtype, store().owned_numel(shard));
}

at::Tensor ResidentModel::state_view(int shard, const Region& region) const {
  return engine_.pool_.view(region, at::kFloat, store().trainable_numel(shard));
}

void ResidentModel::upload() {
  if (!homes_.empty()) return;
  ShardStore& store = this->store();
  const at::ScalarType dtype = store.compute_dtype();
  c10::DeviceGuard device_guard(engine_.device_);
  // Counts as uploaded only once every shard is: after a failure (the arena could not be made, say) the
  // store still holds the whole state, and nothing of it is held on the device.
  std::vector<Home> homes(store.num_shards());
  try {
    for (int s = 0; s < store.num_shards(); ++s) {
      Home& home = homes[s];
      const int64_t numel = store.owned_numel(s);
      auto region = [&](int64_t bytes) { return engine_.allocate(id(), s, bytes, DeviceEngine::Need::kMust).region; };
      home.weights = region(numel * store.element_bytes());
      home.grads = region(numel * store.element_bytes());
      view(s, home.weights, dtype).copy_(store.transfer_source(s));
      view(s, home.grads, dtype).zero_();
      if (store.bf16()) {
        home.master = region(numel * 4);
        view(s, home.master, at::kFloat).copy_(store.master(s));
      }
      for (int k = 0; k < store.optimizer().num_states(); ++k) {
        home.states.push_back(region(store.trainable_numel(s) * 4));
        state_view(s, home.states.back()).copy_(store.state(s, k));
      }
    }
  } catch (...) {
    free_regions(homes, engine_.compute_point());
    throw;
  }
  homes_ = std::move(homes);
  for (int s = 0; s < store.num_shards(); ++s) {
    count_load(s);
    ++engine_.stats_.host_to_device_copies;
    engine_.stats_.host_to_device_bytes +=
        store.owned_numel(s) * (store.element_bytes() + (store.bf16() ? 4 : 0)) +
        store.trainable_numel(s) * 4 * store.optimizer().num_states();
  }
}

void ResidentModel::make_computable(int shard, bool with_grads) {
  TORCH_CHECK(!homes_.empty(), "shard ", shard, " of model ", id(), " acquired before the model's upload");
  const at::ScalarType dtype = store().compute_dtype();
  bind(shard, with_grads, [&](const ParamEntry& e) {
    const Home& home = homes_[e.owner];
    return Place{view(e.owner, home.weights, dtype), view(e.owner, home.grads, dtype), e.master_offset};
  });
}

void ResidentModel::backward_done(int shard, bool step, double lr_scale, bool /*keep*/) {
  note_gradients(shard);
  if (!step) return;
  // Waits for the loss's copy only (the forward), not for the backward just queued.
  const std::shared_ptr<const LossGate> gate = store().loss_gate();
  if (!gate || gate->open()) this->step(shard, 1.0, lr_scale);
}

void ResidentModel::step(int shard, double grad_scale, double lr_scale) {
  ShardStore& store = this->store();
  const Home& home = homes_[shard];
  c10::DeviceGuard device_guard(engine_.device_);
  const at::Tensor weights = view(shard, home.weights, store.compute_dtype());
  const at::Tensor grads = view(shard, home.grads, store.compute_dtype());
  // In bf16 the fp32 master is stepped and the bf16 weights the shard computes with are its shadow.
  const at::Tensor param = store.bf16() ? view(shard, home.master, at::kFloat) : weights;
  std::vector<at::Tensor> states;
  for (const Region& r : home.states) states.push_back(state_view(shard, r));
  step_ranges(store.optimizer(), param, grads, states, store.bf16() ? weights : at::Tensor(), store.take_step(shard),
              grad_scale, lr_scale);
  grads.zero_();
}

std::shared_ptr<ClipNorm> ResidentModel::clip_and_step(double max_norm, double lr_scale) {
  synchronize();  // nothing of the model's in flight on the host either
  const int shards = store().num_shards();
  std::vector<at::Tensor> grads;
  for (int s = 0; s < shards; ++s)
    grads.push_back(view(s, homes_[s].grads, store().compute_dtype()).narrow(0, 0, store().trainable_numel(s)));
  auto norm = std::make_shared<ClipNorm>(max_norm);
  norm->set(std::sqrt(squared_norm(grads)));
  if (!norm->finite()) {  // no shard steps: the weights stay those of the last completed step
    discard_grads();
    return norm;
  }
  for (int s = shards - 1; s >= 0; --s) step(s, norm->scale(), lr_scale);
  return norm;
}

void ResidentModel::discard_grads() {
  store().forget_gradients();
  for (int s = 0; s < static_cast<int>(homes_.size()); ++s) view(s, homes_[s].grads, store().compute_dtype()).zero_();
}

void ResidentModel::copy_home() {
  ShardStore& store = this->store();
  c10::DeviceGuard device_guard(engine_.device_);
  for (int s = 0; s < static_cast<int>(homes_.size()); ++s) {  // never uploaded: the store holds the state
    const Home& home = homes_[s];
    if (store.bf16()) {
      store.master(s).copy_(view(s, home.master, at::kFloat));
      store.shadow(s).copy_(view(s, home.weights, at::kBFloat16));
    } else {
      store.master(s).copy_(view(s, home.weights, at::kFloat));
    }
    for (int k = 0; k < store.optimizer().num_states(); ++k)
      store.state(s, k).copy_(state_view(s, home.states[k]));
  }
}

void ResidentModel::free_regions(std::vector<Home>& homes, const Fence& issued) {
  for (Home& home : homes) {
    for (Region* region : {&home.weights, &home.grads, &home.master})
      if (region->valid()) engine_.pool_.release(*region, issued);
    for (Region& region : home.states)
      if (region.valid()) engine_.pool_.release(region, issued);
  }
  homes.clear();
}

void ResidentModel::free_device_memory(const Fence& issued) { free_regions(homes_, issued); }

}  // namespace hydra::engine
