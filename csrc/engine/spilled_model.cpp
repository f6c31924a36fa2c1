#include "engine/spilled_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>

#include "engine/gradient_norm.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Steps the shard's host buffers over `ranges` (ShardStore::take_step, taken when the step was submitted);
// runs on a host-step thread. `landed`: the shard's own gradient of this step, in device layout and compute
// dtype, read in the step's single pass, summed with a borrower's where one waits in the kept buffer;
// undefined: the accumulator, zeroed for the next step, or where the shard has none, its kept gradient.
void step_host(ShardStore& store, int shard, const std::vector<StepRange>& ranges, double grad_scale,
               double lr_scale, const at::Tensor& landed) {
  std::vector<at::Tensor> states;
  for (int k = 0; k < store.optimizer().num_states(); ++k) states.push_back(store.state(shard, k));
  const at::Tensor shadow = store.bf16() ? store.shadow(shard) : at::Tensor();
  const OptimizerSpec& spec = store.optimizer();
  if (landed.defined()) {
    const auto waiting = store.take_borrowed_spans(shard);
    if (waiting.empty()) {
      step_ranges(spec, store.master(shard), landed, states, shadow, ranges, grad_scale, lr_scale);
    } else {
      step_ranges_summing(spec, store.master(shard), landed, store.kept(shard), waiting, states, shadow, ranges,
                          grad_scale, lr_scale);
    }
    return;
  }
  step_ranges(spec, store.master(shard), store.pending_grad(shard), states, shadow, ranges, grad_scale, lr_scale);
  if (store.has_grad(shard)) store.grad(shard).zero_();
}

// The host memory a step of the shard touches: the gradient read (`grad_bytes` an element), the fp32 master and
// the optimizer states read and written, the bf16 shadow written.
int64_t step_bytes(const ShardStore& store, int shard, int64_t grad_bytes) {
  return store.trainable_numel(shard) * (grad_bytes + 8 + 8 * store.optimizer().num_states() + (store.bf16() ? 2 : 0));
}

}  // namespace

SpilledModel::SpilledModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store,
                           std::vector<int> resident_shards, bool frozen_base)
    : DeviceModel(engine, id, std::move(store)),
      resident_shards_(std::move(resident_shards)),
      frozen_base_(frozen_base),
      homes_(engine) {
  const std::string error = resident_shards_error(this->store(), resident_shards_);
  TORCH_CHECK(error.empty(), error);
  TORCH_CHECK(!frozen_base || (resident_shards_.empty() && this->store().total_trainable_numel() == 0),
              "a frozen base has no trainable weights and no resident shards");
  for (int s : resident_shards_) homed_[s] = true;
}

bool SpilledModel::homed(int shard) const { return homed_.at(shard); }

void SpilledModel::upload() {
  if (resident_shards_.empty() || homes_.uploaded()) return;
  homes_.upload(id(), store(), resident_shards_);
  for (int s : resident_shards_) count_upload(s, ShardHomes::upload_bytes(store(), s));
}

void SpilledModel::copy_home() { homes_.copy_home(store()); }

int64_t SpilledModel::weight_bytes(int shard) const { return store().device_numel(shard) * store().element_bytes(); }

at::Tensor SpilledModel::grad_view(int shard) const {
  return engine_.pool_.view(weights_[shard].grads, store().compute_dtype(), store().device_numel(shard));
}

int64_t SpilledModel::input_version(int shard) const {
  // Versions only grow, so the sum changes whenever a step of the shard or of an owner of one of its tied
  // parameters is submitted.
  int64_t version = 0;
  for (int source : store().sources(shard)) version += store().version(source);
  return version;
}

bool SpilledModel::current(int shard) const {
  if (homed_.at(shard)) return true;
  const Weights& w = weights_.at(shard);
  return w.cached && w.version == input_version(shard);
}

std::vector<Fence> SpilledModel::pending_steps(int shard) const {
  std::vector<Fence> steps;
  for (int source : store().sources(shard)) steps.push_back(store().last_step(source));
  return steps;
}

bool SpilledModel::steps_done(int shard) const {
  for (const Fence& f : pending_steps(shard))
    if (!f.ready()) return false;
  return true;
}

void SpilledModel::evict(int shard) {
  Weights& w = weights_[shard];
  engine_.pool_.release(w.weights, w.last_use);
  w.weights = Region{};
  w.cached = false;
  w.step_queued_next = false;
}

bool SpilledModel::load(int shard, DeviceEngine::Need need) {
  ShardStore& store = this->store();
  Weights& w = weights_[shard];
  const int64_t numel = store.device_numel(shard);
  Allocation allocation = engine_.allocate(id(), shard, weight_bytes(shard), need);
  if (!allocation.region.valid()) return false;
  w.weights = allocation.region;
  w.cached = true;
  w.step_queued_next = false;
  w.version = input_version(shard);
  at::Tensor target = engine_.pool_.view(w.weights, store.compute_dtype(), numel);
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
  for (Fence& f : pending_steps(shard)) after.push_back(std::move(f));
  // A copy the compute is about to wait for goes before the prefetches queued for later visits, unless it
  // waits on anything not yet done: the memory it fills may still be filled by one of them (an evicted
  // prefetch), and a pending step may wait for a copy queued ahead that still reads the step's buffer. A copy
  // that jumped the queue would then wait on a copy queued behind it, forever.
  const bool urgent = (need == DeviceEngine::Need::kMust || need == DeviceEngine::Need::kEvictAny) &&
                      std::all_of(after.begin(), after.end(), [](const Fence& f) { return f.ready(); });
  CopyLane& lane = engine_.to_device_;
  w.ready = track(lane.submit(
      std::move(after), [copies = std::move(copies), &lane]() -> DeviceEvent { return lane.copy(copies); }, urgent));
  w.last_use = w.ready;
  for (int source : store.sources(shard)) store.add_reader(source, w.ready);
  count_load(shard);
  ++engine_.stats_.host_to_device_copies;
  engine_.stats_.host_to_device_bytes += weight_bytes(shard);
  return true;
}

void SpilledModel::prefetch(int shard) {
  if (current(shard)) return;  // a resident shard too
  if (cached(shard)) {
    if (pinned(shard)) return;
    evict(shard);  // a copy from before the shard's last step
  }
  load(shard, DeviceEngine::Need::kPrefetch);
}

void SpilledModel::make_computable(int shard, bool with_grads) {
  if (homed_[shard]) {
    TORCH_CHECK(homes_.uploaded(), "shard ", shard, " of model ", id(), " acquired before the model's upload");
    bind_homes(homes_, shard, with_grads);  // its tied weights' owners are resident too
    return;
  }
  Weights& w = weights_[shard];
  const bool had_grads = w.grads.valid();
  EngineStats& stats = engine_.stats_;
  try {
    const auto waiting = std::chrono::steady_clock::now();
    if (w.cached && !current(shard)) evict(shard);
    if (!w.cached) {
      load(shard, DeviceEngine::Need::kMust);
      ++stats.acquire_loads;
    }
    if (with_grads && !w.grads.valid()) {
      const auto allocating = std::chrono::steady_clock::now();
      allocate_grads(shard);
      stats.grad_wait_seconds += seconds_since(allocating);
    }
    w.ready.order_before(engine_.compute_stream());
    stats.acquire_wait_seconds += seconds_since(waiting);
    if (frozen_base_) return;  // its users' parameters are bound by bind_frozen
    const at::Tensor weights = engine_.pool_.view(w.weights, store().compute_dtype(), store().device_numel(shard));
    const at::Tensor grads = with_grads ? grad_view(shard) : at::Tensor();
    // Every parameter the shard uses is in its own copy, tied ones included.
    bind(shard, with_grads, [&](const ParamEntry& e) { return Place{weights, grads, e.device_offset}; });
  } catch (...) {
    if (!had_grads && w.grads.valid()) {
      engine_.pool_.release(w.grads, engine_.compute_point());
      w.grads = Region{};
    }
    throw;
  }
}

void SpilledModel::bind_frozen(int shard, const std::vector<at::Tensor>& params) {
  TORCH_CHECK(frozen_base_ && pinned(shard), "bind_frozen: shard ", shard, " of model ", id(),
              " is not an acquired shard of a frozen base");
  const std::vector<ParamEntry>& layout = store().layout(shard);
  TORCH_CHECK(params.size() == layout.size(), "bind_frozen: ", params.size(), " parameters for the ", layout.size(),
              " of shard ", shard);
  const at::Tensor weights =
      engine_.pool_.view(weights_[shard].weights, store().compute_dtype(), store().device_numel(shard));
  for (size_t i = 0; i < layout.size(); ++i)
    params[i].set_data(weights.narrow(0, layout[i].device_offset, layout[i].numel).view(params[i].sizes()));
}

void SpilledModel::allocate_grads(int shard) {
  Weights& w = weights_[shard];
  Allocation allocation = engine_.allocate(id(), shard, weight_bytes(shard), DeviceEngine::Need::kEvictAny);
  if (!allocation.region.valid()) {
    // Every other shard is gone and the range next to this shard's weights is still too small: the arena is
    // fragmented around them. The budget holds both (add_model checked), so place the gradients first in the
    // emptied arena and copy the weights in again beside them.
    evict(shard);
    allocation = engine_.allocate(id(), shard, weight_bytes(shard), DeviceEngine::Need::kMust);
    w.grads = allocation.region;
    load(shard, DeviceEngine::Need::kMust);
  } else {
    w.grads = allocation.region;
  }
  for (const Fence& f : allocation.after) f.order_reuse_before(engine_.compute_stream());
  grad_view(shard).zero_();
}

void SpilledModel::after_release(int shard) {
  if (homed_[shard]) return;
  Weights& w = weights_[shard];
  w.last_use = engine_.compute_point();
  if (w.grads.valid()) {  // backward never completed (an error): the gradients are abandoned
    engine_.pool_.release(w.grads, w.last_use);
    w.grads = Region{};
  }
  if (w.cached && !pinned(shard) && (!current(shard) || w.step_queued_next)) evict(shard);
}

void SpilledModel::backward_done(int shard, bool step, double lr_scale, bool keep) {
  if (homed_.at(shard)) {  // as a ResidentModel's shard: its step is queued on the compute stream
    note_gradients(shard);
    if (!step) return;
    const std::shared_ptr<const LossGate> gate = store().loss_gate();
    if (!gate || gate->open()) homes_.step(store(), shard, 1.0, lr_scale);
    return;
  }
  Weights& w = weights_.at(shard);
  TORCH_CHECK(w.grads.valid(), "backward_done: shard ", shard, " was not acquired with gradients");
  note_gradients(shard);
  // Kept for clip_and_step, whose step is next and makes this copy stale: it goes at release (after_release).
  if (keep) w.step_queued_next = true;
  std::shared_ptr<const LossGate> gate = step ? store().loss_gate() : nullptr;
  // Only the prefix holding trainable gradients goes out: a frozen tail (a LoRA model's base weights) stays.
  const int64_t numel = store().gradient_numel(shard);
  const at::Tensor device_grad = grad_view(shard).narrow(0, 0, numel);
  const at::ScalarType dtype = store().compute_dtype();
  const int64_t bytes = numel * store().element_bytes();
  // The staging buffer the gradient lands in: leased by the copy, given back when the host job is done with
  // it (or when both jobs are gone, however they ended).
  auto landing = std::make_shared<std::unique_ptr<StagingRing::Lease>>();
  CopyLane& lane = engine_.to_host_;
  StagingRing& staging = engine_.staging_;
  const Fence landed = track(lane.submit({engine_.compute_point()}, [=, &lane, &staging]() -> DeviceEvent {
    *landing = staging.acquire(bytes);
    return lane.copy({{(*landing)->view(dtype, numel), device_grad}});
  }));
  ++engine_.stats_.device_to_host_copies;
  engine_.stats_.device_to_host_bytes += bytes;
  const std::vector<Fence> readers = store().readers(shard);  // the step rewrites the buffer they read
  // Taken now, on this thread: later micro-batches note their gradients for the next step meanwhile.
  const std::vector<StepRange> ranges = step ? store().take_step(shard) : std::vector<StepRange>{};
  std::shared_ptr<ShardStore> owner = store_ptr();
  DeviceEngine& engine = engine_;
  Fence done = submit([=, &engine]() -> DeviceEvent {
    landed.wait();
    if (gate && !gate->open()) {  // landed after the loss on the same stream: no wait here
      owner->undo_step(shard, ranges);
      landing->reset();
      return nullptr;
    }
    const at::Tensor gradient = (*landing)->view(dtype, numel);
    int64_t start = now_ns();
    // The step's only gradient of this shard (no accumulator yet: one micro-batch, no clipping, nothing
    // borrowed from it) is stepped from where it landed: one pass, and no fp32 copy of it on the host.
    const bool single_pass = step && !owner->has_grad(shard);
    const int64_t landed_bytes = owner->gradient_numel(shard) * owner->element_bytes();
    int64_t touched = 0;
    if (single_pass) {
      owner->accumulate_borrowed(shard, gradient, /*ends_step=*/true);
    } else if (keep && owner->bf16() && !owner->has_grad(shard)) {
      owner->keep_grads(shard, gradient);  // for clip_and_step, as landed: half an accumulator's bytes
      touched += landed_bytes + owner->trainable_numel(shard) * 2;
    } else {
      owner->accumulate_grads(shard, gradient);
      touched += landed_bytes + owner->trainable_numel(shard) * 8;
    }
    if (step) {
      const bool zeroes_accumulator = !single_pass && owner->has_grad(shard);
      const int64_t waiting = now_ns();
      for (const Fence& copy : readers) copy.wait_done();
      start += now_ns() - waiting;  // waiting for copies to finish reading is not host memory traffic
      step_host(*owner, shard, ranges, 1.0, lr_scale, single_pass ? gradient : at::Tensor());
      ++engine.host_steps_done_;
      touched += step_bytes(*owner, shard, single_pass ? owner->element_bytes() : zeroes_accumulator ? 8 : 2);
    }
    engine.count_host_job(touched, start);
    landing->reset();
    return nullptr;
  });
  // Free again once copied out: the next shard's gradients need not wait for this one's step.
  engine_.pool_.release(w.grads, landed);
  w.grads = Region{};
  if (step) {
    store().set_last_step(shard, done);
    store().bump_version(shard);  // the device copy predates the step: dropped on release
  }
}

std::shared_ptr<ClipNorm> SpilledModel::clip_and_step(double max_norm, double lr_scale) {
  if (!resident_shards_.empty()) return clip_and_step_here(max_norm, lr_scale);
  auto norm = std::make_shared<ClipNorm>(max_norm);
  std::shared_ptr<ShardStore> owner = store_ptr();
  // After every gradient job of the step (the model's jobs run in their order), on a host-step thread.
  submit([owner, norm]() -> DeviceEvent {
    try {
      // A failed job may have left a gradient out: no step is taken over what is left.
      if (const std::exception_ptr failed = owner->failed_job()) std::rethrow_exception(failed);
      std::vector<at::Tensor> grads;
      for (int s = 0; s < owner->num_shards(); ++s)
        grads.push_back(owner->pending_grad(s).narrow(0, 0, owner->trainable_numel(s)));
      norm->set(std::sqrt(squared_norm(grads)));
    } catch (...) {
      norm->fail(std::current_exception());  // every step reads it: none applies
      throw;
    }
    return nullptr;
  });
  for (int s = store().num_shards() - 1; s >= 0; --s) step(s, norm, lr_scale);
  return norm;
}

std::shared_ptr<ClipNorm> SpilledModel::clip_and_step_here(double max_norm, double lr_scale) {
  auto norm = std::make_shared<ClipNorm>(max_norm);
  ShardStore& store = this->store();
  try {
    synchronize();  // every gradient job done: the spilled shards' gradients wait in the store
    std::vector<at::Tensor> grads = homes_.trainable_grads(store);
    for (int s = 0; s < store.num_shards(); ++s)
      if (!homed_[s]) grads.push_back(store.pending_grad(s).narrow(0, 0, store.trainable_numel(s)));
    norm->set(std::sqrt(squared_norm(grads)));
  } catch (...) {
    // A gradient job failed (or the norm could not be taken): no shard steps, and the reading says why, as a
    // norm taken by a host job does; the model's next synchronize() reports the error again, as it would the
    // failed job's own.
    norm->fail(std::current_exception());
    std::promise<DeviceEvent> failed;
    failed.set_exception(std::current_exception());
    track(Fence(failed.get_future().share()));
    return norm;
  }
  if (!norm->finite()) {  // no shard steps: the weights stay those of the last completed step
    discard_grads();
    return norm;
  }
  for (int s = store.num_shards() - 1; s >= 0; --s) {
    if (homed_[s]) {
      homes_.step(store, s, norm->scale(), lr_scale);
    } else {
      step(s, norm, lr_scale);
    }
  }
  return norm;
}

void SpilledModel::step(int shard, std::shared_ptr<const ClipNorm> norm, double lr_scale) {
  std::shared_ptr<ShardStore> owner = store_ptr();
  const std::vector<Fence> readers = owner->readers(shard);
  const std::vector<StepRange> ranges = owner->take_step(shard);
  DeviceEngine& engine = engine_;
  const Fence done = submit([=, &engine]() -> DeviceEvent {
    bool finite = false;
    try {
      finite = norm->finite();
    } catch (...) {  // the norm could not be taken: no shard steps
      owner->undo_step(shard, ranges);
      throw;
    }
    if (!finite) {  // skipped, as every shard's step: its gradients are forgotten, its step count as before
      owner->undo_step(shard, ranges);
      if (owner->has_grad(shard)) owner->grad(shard).zero_();
      return nullptr;
    }
    for (const Fence& copy : readers) copy.wait_done();
    const int64_t start = now_ns();
    const bool zeroes_accumulator = owner->has_grad(shard);
    step_host(*owner, shard, ranges, norm->scale(), lr_scale, at::Tensor());
    ++engine.host_steps_done_;
    engine.count_host_job(step_bytes(*owner, shard, zeroes_accumulator ? 8 : 2), start);
    return nullptr;
  });
  owner->set_last_step(shard, done);
  owner->bump_version(shard);
  if (cached(shard) && !pinned(shard)) evict(shard);
}

void SpilledModel::discard_grads() {
  store().forget_gradients();
  for (int s = 0; s < store().num_shards(); ++s)
    if (store().has_grad(s)) store().grad(s).zero_();
  homes_.zero_grads(store());
}

void SpilledModel::free_device_memory(const Fence& issued) {
  for (int s = 0; s < static_cast<int>(weights_.size()); ++s)
    if (cached(s)) evict(s);
  homes_.free(issued);
}

}  // namespace hydra::engine
