#include "engine/device_engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "core/eviction.h"
#include "engine/resident_model.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

namespace {

// Gradient copies in flight or waiting for their host job, per device: enough for the next shard's copy to
// start while the previous two are stepped, few enough that host memory stays a few shards' gradients.
constexpr int kStagingBuffers = 3;

}  // namespace

DeviceEngine::DeviceEngine(c10::Device device, int64_t budget_bytes, std::shared_ptr<HostWorker> host_steps,
                           double link_bytes_per_second, std::shared_ptr<HostPace> host_pace)
    : device_(device),
      has_streams_(!device.is_cpu()),
      pool_(device, budget_bytes),
      host_pace_(std::move(host_pace)),
      host_steps_(host_steps ? std::move(host_steps) : std::make_shared<HostWorker>(1)),
      staging_(kStagingBuffers, /*pinned=*/!device.is_cpu()),
      to_device_(device, link_bytes_per_second),
      to_host_(device, link_bytes_per_second) {
  stats_.budget_bytes = budget_bytes;
}

DeviceEngine::~DeviceEngine() {
  // Host jobs capture this engine; the lanes finish their own copies as they are destroyed.
  host_steps_->drain();
}

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
                            std::vector<int> resident_shards, int base) {
  TORCH_CHECK(store, "add_model: no store");
  const ShardStore* base_of = base >= 0 ? &base_store(base) : nullptr;
  TORCH_CHECK(!base_of || base_of->num_shards() == store->num_shards(), "add_model: a base of ",
              base_of ? base_of->num_shards() : 0, " shards for a model of ", store->num_shards());
  TORCH_CHECK(resident_shards.empty() || residency == Residency::kSpilled,
              "add_model: resident shards are a spilled model's");
  if (const std::string error = SpilledModel::resident_shards_error(*store, resident_shards); !error.empty())
    TORCH_CHECK(false, "add_model: ", error);
  // One unit computes at a time on a device, so spilled models share one working set: the largest shard's
  // weights and gradients among them. Resident models each keep their whole state, and a spilled model its
  // resident shards'.
  const int64_t resident = resident_need(*store);
  const int64_t homes = SpilledModel::homes_need(*store, resident_shards);
  const int64_t spilled = SpilledModel::spilled_need(*store, resident_shards, base_of);
  const int64_t reserve = std::max(spilled_reserve_, spilled);
  // Resident, its units still hold their base shards.
  const int64_t resident_reserve = std::max(spilled_reserve_, SpilledModel::base_shard_need(base_of));
  // Once training has started the arena is sized: a model arriving then is spilled, within the arena.
  const bool arriving = pool_.started();
  const int64_t room = arriving ? pool_.capacity() : pool_.budget();
  TORCH_CHECK(!arriving || homes == 0, "add_model: training has started: an arriving model has no resident shards");
  TORCH_CHECK(resident_committed_ + homes + reserve <= room, "memory budget too small: the largest shard needs ",
              spilled, " bytes on the device (its weights and gradients", base_of ? ", and its base's" : "", ")",
              homes > 0 ? " beside its resident shards' " + std::to_string(homes) + " bytes" : std::string(),
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
    models_.push_back(std::make_unique<SpilledModel>(*this, id, std::move(store), std::move(resident_shards)));
  }
  resident_committed_ += committed;
  models_.back()->set_committed_bytes(committed);
  uploads_pending_ = uploads_pending_ || committed > 0;
  if (task >= 0) task_models_[task] = id;
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
    if (!spilled.frozen_base()) demand += SpilledModel::spilled_need(store, spilled.resident_shards());
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

c10::Stream DeviceEngine::compute_stream() const {
  c10::impl::VirtualGuardImpl guard(device_.type());
  return guard.getStream(device_);
}

Fence DeviceEngine::compute_point() const {
  if (!has_streams_) return Fence();  // CPU compute ran synchronously on the calling thread
  auto event = std::make_shared<c10::Event>(device_.type());
  event->record(compute_stream());
  return Fence(std::move(event));
}

void DeviceEngine::plan(const std::vector<std::pair<int, int>>& visits) {
  upcoming_.clear();
  for (const auto& [model, shard] : visits) {
    // Each user's visit is a next use of its base shard, held (and so copied in) before the user's own.
    if (const BaseUse* use = base_use(model, shard)) upcoming_.push_back(key(use->base, shard));
    upcoming_.push_back(key(model, shard));
  }
}

void DeviceEngine::plan(int model, const std::vector<int>& shards) {
  std::vector<std::pair<int, int>> visits;
  for (int s : shards) visits.emplace_back(model, s);
  plan(visits);
}

Allocation DeviceEngine::allocate(int model, int shard, int64_t bytes, Need need) {
  for (;;) {
    const bool room = need != Need::kPrefetchAhead || pool_.in_use() + bytes + grad_headroom_ <= pool_.capacity();
    if (room)
      if (std::optional<Allocation> allocation = pool_.allocate(bytes)) return std::move(*allocation);
    std::vector<core::EvictionCandidate> candidates;
    for (int m = 0; m < static_cast<int>(models_.size()); ++m)
      if (const SpilledModel* candidate = spilled(m))
        for (int s = 0; s < candidate->store().num_shards(); ++s)
          if (candidate->cached(s)) candidates.push_back({key(m, s), candidate->pinned(s) || candidate->kept_cached()});
    std::optional<int64_t> victim = core::furthest_next_use(candidates, upcoming_);
    if (need == Need::kPrefetchAhead) victim.reset();  // only into free memory: measured, evicting there churns
    if (victim && need == Need::kPrefetch) {
      // A prefetch may only displace a shard needed later than the one it brings in (Belady).
      auto position = [&](int64_t k) {
        auto it = std::find(upcoming_.begin(), upcoming_.end(), k);
        return it == upcoming_.end() ? std::numeric_limits<int64_t>::max() : it - upcoming_.begin();
      };
      if (position(*victim) <= position(key(model, shard))) victim.reset();
    }
    if (!victim) {
      // torch.OutOfMemoryError, as a device allocation that fails: the task is re-planned into smaller shards.
      TORCH_CHECK_WITH(OutOfMemoryError, need != Need::kMust, "memory budget exhausted on ", device_, ": shard ",
                       shard, " of model ", model, " needs ", bytes, " bytes; ", pool_.in_use(), " of ",
                       pool_.capacity(), " are held by shards in use. Raise memory_budget or use smaller shards.");
      return Allocation{};
    }
    spilled(static_cast<int>(*victim >> 32))->evict(static_cast<int>(*victim & 0xffffffff));
  }
}

void DeviceEngine::start() {
  if (!uploads_pending_) return;
  // Resident state first, from the start of the arena, so it never splits the space spilled shards share.
  for (auto& m : models_)
    if (!m->released()) m->upload();
  uploads_pending_ = false;  // not after a failed upload: the next first use tries again
}

void DeviceEngine::count_host_job(int64_t bytes, int64_t start_ns) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start{std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(start_ns))};
  if (host_pace_) host_pace_->pace(bytes, start);
  host_step_bytes_ += bytes;
  host_step_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

int DeviceEngine::model_of(int task) const {
  auto it = task_models_.find(task);
  return it == task_models_.end() ? -1 : it->second;
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

DeviceModel& DeviceEngine::model_at(int model) const {
  TORCH_CHECK(model >= 0 && model < static_cast<int>(models_.size()), "no model ", model, " on this device (",
              models_.size(), " added)");
  return *models_[static_cast<size_t>(model)];
}

DeviceModel& DeviceEngine::live(int model, int shard) {
  DeviceModel& m = live(model);
  m.check_shard(shard);
  return m;
}

DeviceModel& DeviceEngine::live(int model) {
  DeviceModel& m = model_at(model);
  TORCH_CHECK(!m.released(), "model ", model, " was released from this device");
  return m;
}

SpilledModel* DeviceEngine::spilled(int model) {
  DeviceModel& m = model_at(model);
  return m.released() || m.resident() ? nullptr : static_cast<SpilledModel*>(&m);
}

void DeviceEngine::prefetch(int model, int shard) {
  start();
  live(model, shard);
  if (const BaseUse* use = base_use(model, shard)) spilled(use->base)->prefetch(shard);
  if (SpilledModel* m = spilled(model)) m->prefetch(shard);
}

void DeviceEngine::prefetch_ahead(int64_t max_bytes) {
  start();
  int64_t issued = 0;
  const std::vector<int64_t> planned(upcoming_.begin(), upcoming_.end());  // load() may evict, not re-plan
  for (int64_t k : planned) {
    const int shard = static_cast<int>(k & 0xffffffff);
    SpilledModel* m = spilled(static_cast<int>(k >> 32));
    if (!m || m->current(shard)) continue;
    if (m->cached(shard)) {
      if (m->pinned(shard)) continue;
      m->evict(shard);  // a copy from before the shard's last step
    }
    if (!m->steps_done(shard)) continue;
    const int64_t bytes = m->weight_bytes(shard);
    if (issued > 0 && max_bytes >= 0 && issued + bytes > max_bytes) return;
    if (!m->load(shard, issued == 0 ? Need::kPrefetch : Need::kPrefetchAhead)) return;  // full of sooner needs
    issued += bytes;
  }
}

void DeviceEngine::acquire(int model, int shard, bool with_grads) {
  DeviceModel& m = live(model, shard);
  const BaseUse* use = base_use(model, shard);
  for (int64_t visit : {key(model, shard), use ? key(use->base, shard) : int64_t{-1}}) {
    auto it = std::find(upcoming_.begin(), upcoming_.end(), visit);
    if (it != upcoming_.end()) upcoming_.erase(it);
  }
  start();
  if (!use) {
    m.acquire(shard, with_grads);
    return;
  }
  // The base shard first: pinned, it stays while the model's own shard may evict others to come in.
  SpilledModel& base = *spilled(use->base);
  base.acquire(shard, /*with_grads=*/false);
  try {
    base.bind_frozen(shard, use->params[shard]);
    m.acquire(shard, with_grads);
  } catch (...) {
    base.release(shard);
    throw;
  }
}

bool DeviceEngine::waits_for_step(int model, int shard) {
  model_at(model).check_shard(shard);
  const SpilledModel* m = spilled(model);
  return m && !m->current(shard) && !m->steps_done(shard);
}

void DeviceEngine::release(int model, int shard) {
  DeviceModel& m = model_at(model);
  m.check_shard(shard);
  m.release(shard);
  if (const BaseUse* use = base_use(model, shard)) spilled(use->base)->release(shard);
}

std::shared_ptr<LossGate> DeviceEngine::watch_loss(int model, const at::Tensor& loss) {
  DeviceModel& m = live(model);
  TORCH_CHECK(loss.numel() == 1, "watch_loss: the loss must have one element, got ", loss.numel());
  const at::Tensor value = loss.detach().reshape({}).to(at::kFloat);
  std::shared_ptr<LossGate> gate;
  if (has_streams_) {
    c10::DeviceGuard device_guard(device_);
    // Pinned: the copy is asynchronous on the compute stream, ordered after the loss and before the backward.
    at::Tensor host = at::empty({}, value.options().device(at::kCPU).pinned_memory(true));
    host.copy_(value, /*non_blocking=*/true);
    gate = std::make_shared<LossGate>(std::move(host), compute_point());
  } else {
    gate = std::make_shared<LossGate>(value.clone(), Fence());
  }
  m.store().set_loss_gate(gate);
  return gate;
}

void DeviceEngine::backward_done(int model, int shard, bool step, double lr_scale, bool keep) {
  live(model, shard).backward_done(shard, step, lr_scale, keep);
}

std::shared_ptr<ClipNorm> DeviceEngine::clip_and_step(int model, double max_norm, double lr_scale) {
  TORCH_CHECK(max_norm > 0, "clip_and_step: max_norm must be positive, got ", max_norm);
  // Not gated by the loss: the caller reads it first (the runner's _end_micro_batch raises on a non-finite one).
  return live(model).clip_and_step(max_norm, lr_scale);
}

void DeviceEngine::discard_grads(int model) {
  synchronize(model);
  model_at(model).discard_grads();
}

void DeviceEngine::synchronize(int model) { model_at(model).synchronize(); }

void DeviceEngine::snapshot(int model) {
  synchronize(model);
  model_at(model).copy_home();
}

void DeviceEngine::finish(int model) {
  DeviceModel& m = live(model);
  std::exception_ptr failure;
  try {
    m.synchronize();
  } catch (...) {
    failure = std::current_exception();
  }
  m.copy_home();
  m.store().write_back();
  if (failure) std::rethrow_exception(failure);
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

EngineStats DeviceEngine::stats() const {
  EngineStats stats = stats_;
  stats.capacity_bytes = pool_.capacity();
  stats.high_water_bytes = pool_.high_water();
  stats.host_steps = host_steps_done_.load();
  stats.host_step_seconds = static_cast<double>(host_step_ns_.load()) * 1e-9;
  stats.host_step_bytes = host_step_bytes_.load();
  stats.grad_copy_seconds = to_host_.busy_seconds();
  stats.weight_copy_seconds = to_device_.busy_seconds();
  stats.staging_bytes = staging_.host_bytes();
  return stats;
}

std::vector<int64_t> DeviceEngine::shard_loads(int model) const { return model_at(model).shard_loads(); }

}  // namespace hydra::engine
