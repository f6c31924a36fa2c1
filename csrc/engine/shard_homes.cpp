#include "engine/shard_homes.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "engine/device_engine.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

int64_t ShardHomes::need(const ShardStore& store, int shard) {
  const int64_t per_element = 2 * store.element_bytes() + (store.bf16() ? 4 : 0);
  return store.owned_numel(shard) * per_element +
         store.trainable_numel(shard) * 4 * store.optimizer().num_states() + kSlack;
}

int64_t ShardHomes::upload_bytes(const ShardStore& store, int shard) {
  return store.owned_numel(shard) * (store.element_bytes() + (store.bf16() ? 4 : 0)) +
         store.trainable_numel(shard) * 4 * store.optimizer().num_states();
}

bool ShardHomes::holds(int shard) const {
  return shard >= 0 && shard < static_cast<int>(homes_.size()) && homes_[shard].weights.valid();
}

at::Tensor ShardHomes::view(const ShardStore& store, int shard, const Region& region, at::ScalarType dtype) const {
  return engine_.pool_.view(region, dtype, store.owned_numel(shard));
}

at::Tensor ShardHomes::state_view(const ShardStore& store, int shard, const Region& region) const {
  return engine_.pool_.view(region, at::kFloat, store.trainable_numel(shard));
}

at::Tensor ShardHomes::weights(const ShardStore& store, int shard) const {
  TORCH_CHECK(holds(shard), "shard ", shard, " has no home on the device");
  return view(store, shard, homes_[shard].weights, store.compute_dtype());
}

at::Tensor ShardHomes::grads(const ShardStore& store, int shard) const {
  TORCH_CHECK(holds(shard), "shard ", shard, " has no home on the device");
  return view(store, shard, homes_[shard].grads, store.compute_dtype());
}

void ShardHomes::upload(ShardStore& store, const std::vector<int>& shards) {
  if (uploaded()) return;
  const at::ScalarType dtype = store.compute_dtype();
  c10::DeviceGuard device_guard(engine_.device_);
  std::vector<Home> homes(store.num_shards());
  try {
    for (int s : shards) {
      Home& home = homes[s];
      const int64_t numel = store.owned_numel(s);
      auto region = [&](int64_t bytes) {
        return engine_.allocate(model_, s, bytes, DeviceEngine::Need::kMust).region;
      };
      home.weights = region(numel * store.element_bytes());
      home.grads = region(numel * store.element_bytes());
      view(store, s, home.weights, dtype).copy_(store.transfer_source(s));
      view(store, s, home.grads, dtype).zero_();
      if (store.bf16()) {
        home.master = region(numel * 4);
        view(store, s, home.master, at::kFloat).copy_(store.master(s));
      }
      for (int k = 0; k < store.optimizer().num_states(); ++k) {
        home.states.push_back(region(store.trainable_numel(s) * 4));
        state_view(store, s, home.states.back()).copy_(store.state(s, k));
      }
    }
  } catch (...) {
    free_regions(engine_, homes, engine_.compute_point());
    throw;
  }
  homes_ = std::move(homes);
}

std::vector<at::Tensor> ShardHomes::trainable_grads(const ShardStore& store) const {
  std::vector<at::Tensor> grads;
  for (int s = 0; s < static_cast<int>(homes_.size()); ++s)
    if (holds(s)) grads.push_back(this->grads(store, s).narrow(0, 0, store.trainable_numel(s)));
  return grads;
}

void ShardHomes::step(ShardStore& store, int shard, double grad_scale, double lr_scale) {
  const Home& home = homes_.at(shard);
  c10::DeviceGuard device_guard(engine_.device_);
  const at::Tensor weights = this->weights(store, shard);
  const at::Tensor grads = this->grads(store, shard);
  // In bf16 the fp32 master is stepped and the bf16 weights the shard computes with are its shadow.
  const at::Tensor param = store.bf16() ? view(store, shard, home.master, at::kFloat) : weights;
  std::vector<at::Tensor> states;
  for (const Region& r : home.states) states.push_back(state_view(store, shard, r));
  const int64_t start = steady_ns();
  const std::vector<StepRange> ranges = store.take_step(shard);
  step_ranges(store.optimizer(), param, grads, states, store.bf16() ? weights : at::Tensor(), ranges, grad_scale,
              lr_scale);
  grads.zero_();
  engine_.step_log_.add({model_, shard, store.steps_taken(shard), StepPlace::kResident, start, steady_ns()});
}

void ShardHomes::zero_grads(const ShardStore& store) {
  for (int s = 0; s < static_cast<int>(homes_.size()); ++s)
    if (holds(s)) grads(store, s).zero_();
}

void ShardHomes::copy_home(ShardStore& store) const {
  c10::DeviceGuard device_guard(engine_.device_);
  for (int s = 0; s < static_cast<int>(homes_.size()); ++s) {  // never uploaded: the store holds the state
    if (!holds(s)) continue;
    const Home& home = homes_[s];
    if (store.bf16()) {
      store.master(s).copy_(view(store, s, home.master, at::kFloat));
      store.shadow(s).copy_(view(store, s, home.weights, at::kBFloat16));
    } else {
      store.master(s).copy_(view(store, s, home.weights, at::kFloat));
    }
    for (int k = 0; k < store.optimizer().num_states(); ++k)
      store.state(s, k).copy_(state_view(store, s, home.states[k]));
  }
}

void ShardHomes::free_regions(DeviceEngine& engine, std::vector<Home>& homes, const Fence& issued) {
  for (Home& home : homes) {
    for (Region* region : {&home.weights, &home.grads, &home.master})
      if (region->valid()) engine.pool_.release(*region, issued);
    for (Region& region : home.states)
      if (region.valid()) engine.pool_.release(region, issued);
  }
  homes.clear();
}

void ShardHomes::free(const Fence& issued) { free_regions(engine_, homes_, issued); }

}  // namespace hydra::engine
