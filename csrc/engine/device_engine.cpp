#include "engine/device_engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>

#include "core/eviction.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

namespace {

// Every region is rounded up to the pool's 512-byte alignment: a resident shard has at most 5 regions
// (weights, gradients, master, two optimizer states), a spilled shard in use 2 (weights, gradients).
constexpr int64_t kResidentSlack = 5 * 512;
constexpr int64_t kSpilledSlack = 2 * 512;

// Gradient copies in flight or waiting for their host job, per device: enough for the next shard's copy to
// start while the previous two are stepped, few enough that host memory stays a few shards' gradients.
constexpr int kStagingBuffers = 3;

}  // namespace

DeviceEngine::DeviceEngine(c10::Device device, int64_t budget_bytes, std::shared_ptr<HostWorker> host_steps,
                           double link_bytes_per_second)
    : device_(device),
      has_streams_(!device.is_cpu()),
      pool_(device, budget_bytes),
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
  // Weights and gradients in the compute dtype, an fp32 master when that is bf16, and the optimizer state.
  const int64_t per_element = 2 * store.element_bytes() + (store.bf16() ? 4 : 0) + 4 * store.optimizer().num_states();
  return store.total_owned_numel() * per_element;
}

int64_t DeviceEngine::spilled_need(const ShardStore& store) { return min_spilled_bytes(store) + kSpilledSlack; }

int64_t DeviceEngine::resident_need(const ShardStore& store) {
  return resident_bytes(store) + kResidentSlack * store.num_shards();
}

int DeviceEngine::add_model(std::shared_ptr<ShardStore> store, Residency residency) {
  TORCH_CHECK(store, "add_model: no store");
  // One unit computes at a time on a device, so spilled models share one working set: the largest shard's
  // weights and gradients among them. Resident models each keep their whole state.
  const int64_t resident = resident_need(*store);
  const int64_t spilled = spilled_need(*store);
  const int64_t reserve = std::max(spilled_reserve_, spilled);
  // Once training has started the arena is sized: a model arriving then is spilled, within the arena.
  const bool arriving = pool_.started();
  const int64_t room = arriving ? pool_.capacity() : pool_.budget();
  TORCH_CHECK(resident_committed_ + reserve <= room, "memory budget too small: the largest shard needs ",
              spilled, " bytes on the device (its weights and gradients) but only ", room - resident_committed_,
              " of the ", arriving ? "device's arena's " : "budget's ", room,
              " bytes are left; raise memory_budget or cut the model into smaller shards");
  const bool fits = !arriving && resident_committed_ + spilled_reserve_ + resident <= pool_.budget();
  TORCH_CHECK(residency != Residency::kResident || fits, "add_model: the whole training state needs ", resident,
              " bytes beside ", resident_committed_ + spilled_reserve_, " already promised, but the budget is ",
              pool_.budget(), arriving ? " and training has started" : "");
  Model model;
  model.store = std::move(store);
  model.resident = fits && residency != Residency::kSpilled;
  model.shards.resize(model.store->num_shards());
  if (model.resident) {
    resident_committed_ += resident;
  } else {
    spilled_reserve_ = reserve;
    grad_headroom_ = std::max(grad_headroom_, min_spilled_bytes(*model.store) / 2 + 512);
  }
  models_.push_back(std::move(model));
  if (arriving) return static_cast<int>(models_.size()) - 1;
  // The arena need not exceed what all models could ever hold: resident state, or every spilled weight
  // cached plus one shard's gradients.
  int64_t demand = 0;
  for (const Model& m : models_) {
    if (!m.store) continue;  // released
    if (m.resident) {
      demand += resident_need(*m.store);
      continue;
    }
    demand += spilled_need(*m.store);
    for (int s = 0; s < m.store->num_shards(); ++s) demand += m.store->device_numel(s) * m.store->element_bytes() + 512;
  }
  pool_.set_demand(arrivals_ ? pool_.budget() : std::min(demand, pool_.budget()));
  return static_cast<int>(models_.size()) - 1;
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

bool DeviceEngine::current(int model, int shard) const {
  const ShardState& state = models_[model].shards[shard];
  return state.cached && state.version == input_version(model, shard);
}

int64_t DeviceEngine::input_version(int model, int shard) const {
  // Versions only grow, so the sum changes whenever a step of the shard or of an owner of one of its tied
  // parameters is submitted.
  const ShardStore& store = *models_[model].store;
  int64_t version = 0;
  for (int source : store.sources(shard)) version += store.version(source);
  return version;
}

Fence DeviceEngine::submit(int model, std::function<DeviceEvent()> job) {
  static std::mutex order;  // one global submission order across devices (see ShardStore::exchange_last_job)
  auto done = std::make_shared<std::promise<void>>();
  Fence fence;
  {
    std::lock_guard<std::mutex> lock(order);
    std::shared_future<void> previous = models_[model].store->exchange_last_job(done->get_future().share());
    fence = host_steps_->submit([previous, done, job = std::move(job)]() -> DeviceEvent {
      if (previous.valid()) previous.wait();
      struct Signal {  // completes the chain however the job ends; its error travels in its own Fence
        std::shared_ptr<std::promise<void>> promise;
        ~Signal() { promise->set_value(); }
      } signal{done};
      return job();
    });
  }
  return track(model, fence);
}

Fence DeviceEngine::track(int model, Fence fence) {
  auto& jobs = models_[model].jobs;
  // Finished jobs are forgotten, failed ones kept until synchronize() reports them.
  jobs.erase(std::remove_if(jobs.begin(), jobs.end(), [](const Fence& f) { return f.succeeded(); }), jobs.end());
  jobs.push_back(fence);
  return fence;
}

std::vector<Fence> DeviceEngine::pending_steps(int model, int shard) const {
  const ShardStore& store = *models_[model].store;
  std::vector<Fence> steps;
  for (int source : store.sources(shard)) steps.push_back(store.last_step(source));
  return steps;
}

bool DeviceEngine::steps_done(int model, int shard) const {
  for (const Fence& f : pending_steps(model, shard))
    if (!f.ready()) return false;
  return true;
}

void DeviceEngine::plan(const std::vector<std::pair<int, int>>& visits) {
  upcoming_.clear();
  for (const auto& [model, shard] : visits) upcoming_.push_back(key(model, shard));
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
      for (int s = 0; s < static_cast<int>(models_[m].shards.size()); ++s)
        if (models_[m].shards[s].cached) candidates.push_back({key(m, s), models_[m].shards[s].pins > 0});
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
      TORCH_CHECK_WITH(OutOfMemoryError, need != Need::kMust, "memory budget exhausted on ", device_, ": shard ", shard, " of model ", model, " needs ",
                  bytes, " bytes; ", pool_.in_use(), " of ", pool_.capacity(),
                  " are held by shards in use. Raise memory_budget or use smaller shards.");
      return Allocation{};
    }
    evict(models_[*victim >> 32].shards[*victim & 0xffffffff]);
  }
}

void DeviceEngine::evict(ShardState& state) {
  pool_.release(state.weights, state.last_use);
  state.weights = Region{};
  state.cached = false;
}

bool DeviceEngine::load(int model, int shard, Need need) {
  ShardStore& store = *models_[model].store;
  ShardState& state = models_[model].shards[shard];
  const int64_t numel = store.device_numel(shard);
  Allocation allocation = allocate(model, shard, numel * store.element_bytes(), need);
  if (!allocation.region.valid()) return false;
  state.weights = allocation.region;
  state.cached = true;
  state.version = input_version(model, shard);
  at::Tensor target = pool_.view(state.weights, store.compute_dtype(), numel);
  // Owned parameters travel as one copy; each borrowed (tied) one is copied from its owner's buffer.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  copies.emplace_back(target.narrow(0, 0, store.owned_numel(shard)),
                      store.transfer_source(shard).narrow(0, 0, store.owned_numel(shard)));
  for (const ParamEntry& e : store.layout(shard))
    if (e.owner != shard)
      copies.emplace_back(target.narrow(0, e.device_offset, e.numel),
                          store.transfer_source(e.owner).narrow(0, e.master_offset, e.numel));
  std::vector<Fence> after = std::move(allocation.after);
  // The copy reads what the shard's last step (and its tied parameters' owners' steps) wrote.
  for (Fence& f : pending_steps(model, shard)) after.push_back(std::move(f));
  // A copy the compute is about to wait for goes before the prefetches queued for later visits, unless it
  // waits on anything not yet done: the memory it fills may still be filled by one of them (an evicted
  // prefetch), and a pending step may wait for a copy queued ahead that still reads the step's buffer. A copy
  // that jumped the queue would then wait on a copy queued behind it, forever.
  const bool urgent = (need == Need::kMust || need == Need::kEvictAny) &&
                      std::all_of(after.begin(), after.end(), [](const Fence& f) { return f.ready(); });
  state.ready = track(model, to_device_.submit(std::move(after), [copies = std::move(copies), this]() -> DeviceEvent {
    return to_device_.copy(copies);
  }, urgent));
  state.last_use = state.ready;
  for (int source : store.sources(shard)) store.add_reader(source, state.ready);
  ++state.loads;
  ++stats_.host_to_device_copies;
  stats_.host_to_device_bytes += numel * store.element_bytes();
  return true;
}

void DeviceEngine::start() {
  if (pool_.started()) return;
  // Resident state first, from the start of the arena, so it never splits the space spilled shards share.
  for (int i = 0; i < static_cast<int>(models_.size()); ++i)
    if (models_[i].resident) upload_resident(i);
}

DeviceEngine::Model& DeviceEngine::live(int model) {
  Model& m = models_.at(model);
  TORCH_CHECK(m.store, "model ", model, " was released from this device");
  return m;
}

void DeviceEngine::prefetch(int model, int shard) {
  start();
  ShardState& state = live(model).shards.at(shard);
  if (models_[model].resident || current(model, shard)) return;
  if (state.cached) {
    if (state.pins > 0) return;
    evict(state);  // a copy from before the shard's last step
  }
  load(model, shard, Need::kPrefetch);
}

void DeviceEngine::prefetch_ahead(int64_t max_bytes) {
  start();
  int64_t issued = 0;
  const std::vector<int64_t> planned(upcoming_.begin(), upcoming_.end());  // load() may evict, not re-plan
  for (int64_t k : planned) {
    const int model = static_cast<int>(k >> 32), shard = static_cast<int>(k & 0xffffffff);
    ShardState& state = models_.at(model).shards.at(shard);
    if (models_[model].resident || current(model, shard)) continue;
    if (state.cached) {
      if (state.pins > 0) continue;
      evict(state);  // a copy from before the shard's last step
    }
    if (!steps_done(model, shard)) continue;
    const int64_t bytes = models_[model].store->device_numel(shard) * models_[model].store->element_bytes();
    if (issued > 0 && max_bytes >= 0 && issued + bytes > max_bytes) return;
    if (!load(model, shard, issued == 0 ? Need::kPrefetch : Need::kPrefetchAhead)) return;  // full of sooner needs
    issued += bytes;
  }
}

void DeviceEngine::acquire(int model, int shard, bool with_grads) {
  Model& m = live(model);
  ShardState& state = m.shards.at(shard);
  auto it = std::find(upcoming_.begin(), upcoming_.end(), key(model, shard));
  if (it != upcoming_.end()) upcoming_.erase(it);
  TORCH_CHECK(m.resident || state.pins == 0, "shard ", shard, " of model ", model, " acquired twice on ", device_);
  const bool had_grads = state.grads.valid();
  ++state.pins;
  try {
    start();
    if (!m.resident) {
      const auto waiting = std::chrono::steady_clock::now();
      if (state.cached && !current(model, shard)) evict(state);
      if (!state.cached) {
        load(model, shard, Need::kMust);
        ++stats_.acquire_loads;
      }
      if (with_grads && !state.grads.valid()) {
        const auto allocating = std::chrono::steady_clock::now();
        allocate_grads(model, shard);
        stats_.grad_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - allocating).count();
      }
      state.ready.order_before(compute_stream());
      stats_.acquire_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
    }
    bind(model, shard, with_grads);
  } catch (...) {
    // A failed acquire holds nothing: a pinned shard could never be evicted, and would starve other tasks.
    --state.pins;
    if (!had_grads && state.grads.valid()) {
      pool_.release(state.grads, compute_point());
      state.grads = Region{};
    }
    throw;
  }
}

void DeviceEngine::allocate_grads(int model, int shard) {
  ShardState& state = models_[model].shards[shard];
  const int64_t bytes = models_[model].store->device_numel(shard) * models_[model].store->element_bytes();
  Allocation allocation = allocate(model, shard, bytes, Need::kEvictAny);
  if (!allocation.region.valid()) {
    // Every other shard is gone and the range next to this shard's weights is still too small: the arena is
    // fragmented around them. The budget holds both (add_model checked), so place the gradients first in the
    // emptied arena and copy the weights in again beside them.
    evict(state);
    allocation = allocate(model, shard, bytes, Need::kMust);
    state.grads = allocation.region;
    load(model, shard, Need::kMust);
  } else {
    state.grads = allocation.region;
  }
  for (const Fence& f : allocation.after) f.order_reuse_before(compute_stream());
  grad_view(model, shard).zero_();
}

void DeviceEngine::release(int model, int shard) {
  ShardState& state = models_.at(model).shards.at(shard);
  TORCH_CHECK(state.pins > 0, "release of shard ", shard, " of model ", model, " that was not acquired");
  --state.pins;
  state.bound_grads.clear();  // a backward that never completed (an error) received nothing
  if (models_[model].resident) return;
  state.last_use = compute_point();
  if (state.grads.valid()) {  // backward never completed (an error): the gradients are abandoned
    pool_.release(state.grads, state.last_use);
    state.grads = Region{};
  }
  if (state.cached && state.pins == 0 && !current(model, shard)) evict(state);
}

}  // namespace hydra::engine
