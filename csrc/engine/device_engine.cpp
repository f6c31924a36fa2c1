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

DeviceEngine::DeviceEngine(c10::Device device, int64_t budget_bytes, std::shared_ptr<HostWorker> host_steps,
                           double link_bytes_per_second, std::shared_ptr<HostPace> host_pace)
    : device_(device),
      has_streams_(!device.is_cpu()),
      pool_(device, budget_bytes),
      host_pace_(std::move(host_pace)),
      host_steps_(host_steps ? std::move(host_steps) : std::make_shared<HostWorker>(1)),
      to_device_(device, link_bytes_per_second),
      to_host_(device, link_bytes_per_second),
      steps_(device, 0.0) {
  stats_.budget_bytes = budget_bytes;
}

DeviceEngine::~DeviceEngine() {
  // Host jobs capture this engine; the lanes finish their own copies as they are destroyed.
  host_steps_->drain();
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

SpilledModel* DeviceEngine::spilled(int model) const {
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

void DeviceEngine::prefetch_step(int model, int shard) {
  live(model, shard);
  start();  // resident state first, from the start of the arena
  if (SpilledModel* m = spilled(model)) m->prefetch_state(shard);
}

void DeviceEngine::issue_step_prefetch(int model, int shard) {
  live(model, shard);
  if (SpilledModel* m = spilled(model)) m->issue_prefetched_state(shard);
}

void DeviceEngine::forget_step_prefetch(int model, int shard) {
  live(model, shard);
  if (SpilledModel* m = spilled(model)) m->forget_prefetched_state(shard);
}

bool DeviceEngine::next_step_waits(int model) {
  const SpilledModel* m = spilled(model);
  return m && m->next_step_waits();
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

// A released model's store is gone: waiting for it is an error, not a read of freed state.
void DeviceEngine::synchronize(int model) { live(model).synchronize(); }

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

EngineStats DeviceEngine::stats() const {
  EngineStats stats = stats_;
  stats.capacity_bytes = pool_.capacity();
  stats.high_water_bytes = pool_.high_water();
  stats.host_steps = host_steps_done_.load();
  stats.host_step_seconds = static_cast<double>(host_step_ns_.load()) * 1e-9;
  stats.host_step_bytes = host_step_bytes_.load();
  stats.grad_copy_seconds = to_host_.busy_seconds();
  stats.weight_copy_seconds = to_device_.busy_seconds();
  stats.device_step_seconds = steps_.busy_seconds();
  for (int model = 0; model < static_cast<int>(models_.size()); ++model)
    if (const SpilledModel* m = spilled(model)) stats.staging_bytes += m->landing_bytes();
  return stats;
}

std::vector<int64_t> DeviceEngine::shard_loads(int model) const { return model_at(model).shard_loads(); }

}  // namespace hydra::engine
