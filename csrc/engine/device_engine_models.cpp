// DeviceEngine's register of models: what each asks of the budget, their admission (add_model), the arena sized
// to what they could hold, and their release when a task ends while others train. Kept apart from the per-visit
// work (engine/device_engine.cpp), which reads what is decided here.
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "engine/device_engine.h"
#include "engine/resident_model.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

int64_t DeviceEngine::min_spilled_bytes(const ShardStore& store) {
  int64_t largest = 0;
  for (int s = 0; s < store.num_shards(); ++s) largest = std::max(largest, store.device_numel(s));
  return 2 * largest * store.element_bytes();
}

int64_t DeviceEngine::resident_bytes(const ShardStore& store) {
  // Weights and gradients in the compute dtype, an fp32 master when that is bf16, and the optimizer state of the
  // trainable parameters.
  const int64_t per_element = 2 * store.element_bytes() + (store.bf16() ? 4 : 0);
  return store.total_owned_numel() * per_element + store.total_trainable_numel() * 4 * store.optimizer().num_states();
}

int64_t DeviceEngine::spilled_need(const ShardStore& store) { return SpilledModel::spilled_need(store, {}); }

int64_t DeviceEngine::resident_need(const ShardStore& store) {
  int64_t need = 0;
  for (int s = 0; s < store.num_shards(); ++s) need += ShardHomes::need(store, s);
  return need;
}

int DeviceEngine::add_model(std::shared_ptr<ShardStore> store, Residency residency, int task,
                            std::vector<int> resident_shards, int base, std::vector<int> device_shards) {
  TORCH_CHECK(store, "add_model: no store");
  const ShardStore* base_of = base >= 0 ? &base_store(base) : nullptr;
  TORCH_CHECK(!base_of || base_of->num_shards() == store->num_shards(), "add_model: a base of ",
              base_of ? base_of->num_shards() : 0, " shards for a model of ", store->num_shards());
  TORCH_CHECK(resident_shards.empty() || residency == Residency::kSpilled,
              "add_model: resident shards are a spilled model's");
  if (const std::string error = SpilledModel::resident_shards_error(*store, resident_shards); !error.empty())
    TORCH_CHECK(false, "add_model: ", error);
  TORCH_CHECK(device_shards.empty() || residency == Residency::kSpilled,
              "add_model: device-stepped shards are a spilled model's");
  if (const std::string error = SpilledModel::device_shards_error(*store, resident_shards, device_shards);
      !error.empty())
    TORCH_CHECK(false, "add_model: ", error);
  // One unit computes at a time on a device, so spilled models share one working set: the largest shard's
  // weights and gradients among them. Resident models each keep their whole state, and a spilled model its
  // resident shards'.
  const int64_t resident = resident_need(*store);
  // A device-stepped shard's gradient buffer stays for the whole run, as a home does.
  const int64_t homes =
      SpilledModel::homes_need(*store, resident_shards) +
      SpilledModel::held_grads_need(*store, device_shards, resident_shards);
  const int64_t spilled = SpilledModel::spilled_need(*store, resident_shards, base_of, device_shards);
  const int64_t reserve = std::max(spilled_reserve_, spilled);
  // Resident, its units still hold their base shards.
  const int64_t resident_reserve = std::max(spilled_reserve_, SpilledModel::base_shard_need(base_of));
  // Once training has started the arena is sized: a model arriving then is spilled, within the arena.
  const bool arriving = pool_.started();
  const int64_t room = arriving ? pool_.capacity() : pool_.budget();
  TORCH_CHECK(!arriving || homes == 0,
              "add_model: training has started: an arriving model has no resident or device-stepped shards");
  TORCH_CHECK(resident_committed_ + homes + reserve <= room, "memory budget too small: the largest shard needs ",
              spilled, " bytes on the device (its weights and gradients", base_of ? ", and its base's" : "", ")",
              homes > 0 ? " beside its resident shards' and held gradients' " + std::to_string(homes) + " bytes"
                        : std::string(),
              " but only ", room - resident_committed_, " of the ", arriving ? "device's arena's " : "budget's ", room,
              " bytes are left; raise memory_budget or cut the model into smaller shards");
  // Resident beside a base, the base's shards stay cached for good (SpilledModel::keep_cached): committed too.
  const int64_t kept_base = base_of && !this->spilled(base)->kept_cached() ? SpilledModel::cached_need(*base_of) : 0;
  const bool fits = !arriving && resident_committed_ + resident_reserve + resident + kept_base <= pool_.budget();
  TORCH_CHECK(residency != Residency::kResident || fits, "add_model: the whole training state needs ", resident,
              " bytes beside ", resident_committed_ + resident_reserve, " already promised, but the budget is ",
              pool_.budget(), arriving ? " and training has started" : "");
  const int id = static_cast<int>(models_.size());
  const bool resident_here = fits && residency != Residency::kSpilled;
  const int64_t committed = resident_here ? resident : homes;
  if (resident_here) {
    spilled_reserve_ = resident_reserve;
    if (kept_base > 0) {  // the base's, not the model's: it stays when the model leaves (a re-plan spills it)
      this->spilled(base)->keep_cached();
      resident_committed_ += kept_base;
    }
    models_.push_back(std::make_unique<ResidentModel>(*this, id, std::move(store)));
  } else {
    spilled_reserve_ = reserve;
    grad_headroom_ = std::max(grad_headroom_, spilled / 2);
    models_.push_back(std::make_unique<SpilledModel>(*this, id, std::move(store), std::move(resident_shards), false,
                                                     std::move(device_shards)));
  }
  resident_committed_ += committed;
  models_.back()->set_committed_bytes(committed);
  uploads_pending_ = uploads_pending_ || committed > 0;
  if (task >= 0) {
    task_models_[task] = id;
    model_tasks_[id] = task;
  }
  if (base_of) base_uses_[id] = BaseUse{base, {}};
  if (!arriving) size_arena();
  return id;
}

void DeviceEngine::size_arena() {
  int64_t demand = spilled_reserve_;  // a unit's working set, with its base shard where it has one
  for (const auto& m : models_) {
    if (m->released()) continue;
    const ShardStore& store = m->store();
    demand += m->committed_bytes();
    if (m->resident()) continue;
    const SpilledModel& spilled = static_cast<const SpilledModel&>(*m);
    // A base's working set is in its users' (add_model's `base`).
    if (!spilled.frozen_base())
      demand += SpilledModel::spilled_need(store, spilled.resident_shards(), nullptr, spilled.device_shards());
    demand += SpilledModel::cached_need(store, spilled.resident_shards());
  }
  pool_.set_demand(arrivals_ ? pool_.budget() : std::min(demand, pool_.budget()));
}

void DeviceEngine::keep_outside_arena(int64_t bytes) {
  TORCH_CHECK(!pool_.started(), "keep_outside_arena: training has started");
  TORCH_CHECK(bytes >= 0 && bytes <= free_bytes() && bytes < pool_.budget(), "keep_outside_arena: ", bytes,
              " bytes asked, but the budget has ", free_bytes(), " left");
  if (bytes > 0) pool_.keep_outside(bytes);
}

void DeviceEngine::expect_arrivals() {
  TORCH_CHECK(!pool_.started(), "expect_arrivals: training has started");
  arrivals_ = true;
  pool_.set_demand(pool_.budget());
}

int DeviceEngine::model_of(int task) const {
  auto it = task_models_.find(task);
  return it == task_models_.end() ? -1 : it->second;
}

int DeviceEngine::task_of(int model) const {
  auto it = model_tasks_.find(model);
  return it == model_tasks_.end() ? -1 : it->second;
}

bool DeviceEngine::resident(int model) const {
  const DeviceModel& m = model_at(model);
  return !m.released() && m.resident();
}

std::vector<int> DeviceEngine::resident_shards(int model) const {
  const DeviceModel& m = model_at(model);
  std::vector<int> shards;
  if (m.released()) return shards;
  for (int s = 0; s < m.store().num_shards(); ++s)
    if (m.homed(s)) shards.push_back(s);
  return shards;
}

std::vector<int> DeviceEngine::device_shards(int model) const {
  const DeviceModel& m = model_at(model);
  if (m.released() || m.resident()) return {};
  return static_cast<const SpilledModel&>(m).device_shards();
}

void DeviceEngine::release_model(int model) {
  DeviceModel& m = model_at(model);
  if (m.released()) return;
  for (const auto& [user, use] : base_uses_)
    TORCH_CHECK(use.base != model, "release_model: model ", user, " still uses base ", model);
  m.synchronize();
  for (int s = 0; s < m.store().num_shards(); ++s)
    TORCH_CHECK(m.pins(s) == 0, "release_model: shard ", s, " of model ", model, " is still acquired");
  // Visits planned before the task ended must not bring its shards back in.
  std::erase_if(upcoming_, [model](int64_t visit) { return (visit >> 32) == model; });
  m.free_device_memory(compute_point());
  resident_committed_ -= m.committed_bytes();
  if (const SpilledModel* base = spilled(model); base && base->kept_cached())
    resident_committed_ -= SpilledModel::cached_need(m.store());  // a base a resident model kept cached
  m.drop_store();
  std::erase_if(task_models_, [model](const auto& entry) { return entry.second == model; });
  base_uses_.erase(model);
}

}  // namespace hydra::engine
