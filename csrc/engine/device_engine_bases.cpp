// DeviceEngine's frozen bases (add_base, use_base): the registration and the binding of a base several models
// share; how their units hold its shards is in acquire, release and plan (engine/device_engine.cpp).
#include <c10/util/Exception.h>

#include "engine/device_engine.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

int DeviceEngine::add_base(std::shared_ptr<ShardStore> store) {
  TORCH_CHECK(store, "add_base: no store");
  TORCH_CHECK(store->total_trainable_numel() == 0, "add_base: a base's weights are frozen, but ",
              store->total_trainable_numel(), " of them are trainable");
  const int id = static_cast<int>(models_.size());
  models_.push_back(std::make_unique<SpilledModel>(*this, id, std::move(store), std::vector<int>{}, true));
  if (!pool_.started()) size_arena();  // once started, its shards are cached in the arena as it is
  return id;
}

const ShardStore& DeviceEngine::base_store(int base) {
  const SpilledModel* b = spilled(base);
  TORCH_CHECK(b && b->frozen_base(), "model ", base, " is not a frozen base on ", device_);
  return b->store();
}

void DeviceEngine::use_base(int model, int base, std::vector<std::vector<at::Tensor>> params) {
  live(model);
  auto it = base_uses_.find(model);
  TORCH_CHECK(it != base_uses_.end() && it->second.base == base, "use_base: model ", model,
              " was not added with base ", base);
  const ShardStore& base_of = base_store(base);
  const int n = base_of.num_shards();
  TORCH_CHECK(static_cast<int>(params.size()) == n, "use_base: a base of ", n, " shards, parameters for ",
              params.size());
  for (int s = 0; s < n; ++s) {
    const std::vector<ParamEntry>& layout = base_of.layout(s);
    TORCH_CHECK(params[s].size() == layout.size(), "use_base: shard ", s, " of the base holds ", layout.size(),
                " weights, but ", params[s].size(), " parameters were given for it");
    for (size_t i = 0; i < layout.size(); ++i)
      TORCH_CHECK(params[s][i].defined() && params[s][i].numel() == layout[i].numel, "use_base: parameter ", i,
                  " of shard ", s, " does not match the base's weight of ", layout[i].numel, " elements");
  }
  it->second.params = std::move(params);
}

const DeviceEngine::BaseUse* DeviceEngine::base_use(int model, int shard) const {
  auto it = base_uses_.find(model);
  if (it == base_uses_.end()) return nullptr;
  // Its units would compute with the base's weights wherever the user's tensors were: on a CPU device, silently.
  TORCH_CHECK(!it->second.params.empty(), "model ", model, " uses base ", it->second.base,
              ", but use_base has not named its parameters");
  return it->second.params.at(shard).empty() ? nullptr : &it->second;
}

}  // namespace hydra::engine
