#include "engine/spilled_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace hydra::engine {

namespace {

// Gradient copies of one model landed or landing and not yet read by its host job: one copy lands while the
// previous shard's gradient waits for its step and the one before it is stepped. Fewer cost the chain its overlap
// (two: 1.17x the span, one: 1.59x, four models on the emulated link; benchmarks/RESULTS.md); host memory stays
// three shards' gradients a model.
constexpr int kLandingBuffers = 3;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

SpilledModel::SpilledModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store,
                           std::vector<int> resident_shards, bool frozen_base, std::vector<int> device_shards)
    : DeviceModel(engine, id, std::move(store)),
      resident_shards_(std::move(resident_shards)),
      device_shards_(std::move(device_shards)),
      frozen_base_(frozen_base),
      homes_(engine, id),
      // A gradient copy waiting for a free buffer is taken by the device-to-host lane once one comes free. The
      // lane outlives every lease: the engine drains the host jobs that hold them before its lanes go.
      landing_(StagingRing::make(kLandingBuffers, /*pinned=*/engine.has_streams_,
                                 [lane = &engine.to_host_] { lane->poke(); })) {
  const std::string error = resident_shards_error(this->store(), resident_shards_);
  TORCH_CHECK(error.empty(), error);
  const std::string device_error = device_shards_error(this->store(), resident_shards_, device_shards_);
  TORCH_CHECK(device_error.empty(), device_error);
  TORCH_CHECK(!frozen_base || (resident_shards_.empty() && device_shards_.empty() &&
                               this->store().total_trainable_numel() == 0),
              "a frozen base has no trainable weights, no resident shards and no device-stepped ones");
  for (int s : resident_shards_) homed_[s] = true;
  for (int s = 0; s < this->store().num_shards(); ++s)
    visit_numel_[s] = visit_numel(this->store(), resident_shards_, s);
  ShardStore& own = this->store();
  for (int s : device_shards_) {
    device_stepped_[s] = true;
    holds_grads_[s] = keeps_gradient_buffer(own, device_shards_, s, resident_shards_);
    sends_borrowed_[s] = sends_borrowed_grads(own, device_shards_, s, resident_shards_);
  }
  // A tied weight whose owner is device-stepped sums its gradient in the owner's buffer, from every borrower; one
  // whose owner is resident, in the owner's home.
  std::vector<int> summed_here;
  for (int b = 0; b < own.num_shards(); ++b)
    for (int owner : borrowed_grad_owners(own, b)) {
      if (device_stepped_[owner]) device_grad_owners_[b].push_back(owner);
      if (device_stepped_[owner] || homed_[owner]) summed_here.push_back(owner);
    }
  own.set_summed_on_device(summed_here);
  own.pin_states(device_shards_);
}

bool SpilledModel::homed(int shard) const { return homed_.at(shard); }

void SpilledModel::upload() {
  upload_held_grads();
  if (resident_shards_.empty() || homes_.uploaded()) return;
  homes_.upload(store(), resident_shards_);
  for (int s : resident_shards_) count_upload(s, ShardHomes::upload_bytes(store(), s));
}

void SpilledModel::copy_home() { homes_.copy_home(store()); }

int64_t SpilledModel::weight_bytes(int shard) const { return visit_numel_[shard] * store().element_bytes(); }

at::Tensor SpilledModel::grad_view(int shard) const {
  return engine_.pool_.view(weights_[shard].grads, store().compute_dtype(), visit_numel_[shard]);
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

bool SpilledModel::steps_done(int shard) const { return all_ready(pending_steps(shard)); }

bool SpilledModel::next_step_waits() const {
  for (int shard = 0; shard < store().num_shards(); ++shard) {
    if (!current(shard) && !steps_done(shard)) return true;
    if (!homed(shard) && !device_stepped(shard)) return false;
  }
  return false;
}

int SpilledModel::lowest_host_stepped() const {
  int shard = 0;
  while (shard < store().num_shards() && (homed(shard) || device_stepped(shard))) ++shard;
  return shard;
}

void SpilledModel::evict(int shard) {
  Weights& w = weights_[shard];
  engine_.pool_.release(w.weights, w.last_use);
  w.weights = Region{};
  w.cached = false;
  w.step_queued_next = false;
  w.device_step_queued = false;
}

bool SpilledModel::load(int shard, DeviceEngine::Need need) {
  ShardStore& store = this->store();
  Weights& w = weights_[shard];
  const int64_t numel = visit_numel_[shard];
  Allocation allocation = engine_.allocate(id(), shard, weight_bytes(shard), need);
  if (!allocation.region.valid()) return false;
  w.weights = allocation.region;
  w.cached = true;
  w.step_queued_next = false;
  w.device_step_queued = false;
  w.version = input_version(shard);
  at::Tensor target = engine_.pool_.view(w.weights, store.compute_dtype(), numel);
  // Owned parameters travel as one copy; each borrowed (tied) one is copied from its owner's buffer, unless the
  // owner is resident (the unit reads it in the owner's home).
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  copies.emplace_back(target.narrow(0, 0, store.owned_numel(shard)),
                      store.transfer_source(shard).narrow(0, 0, store.owned_numel(shard)));
  for (const ParamEntry& e : store.layout(shard))
    if (e.owner != shard && !homed_[e.owner])
      copies.emplace_back(target.narrow(0, e.device_offset, e.numel),
                          store.transfer_source(e.owner).narrow(0, e.master_offset, e.numel));
  int64_t copied = 0;
  for (const auto& copy : copies) copied += copy.first.numel() * store.element_bytes();
  std::vector<Fence> after = std::move(allocation.after);
  // The copy reads what the shard's last step (and its tied parameters' owners' steps) wrote: where one is still to
  // run on the host, the model's host jobs go first there, as the copy lane waits for them.
  std::vector<Fence> steps = pending_steps(shard);
  if (!all_ready(steps)) engine_.host_steps_->want(store.host_chain());
  for (Fence& f : steps) after.push_back(std::move(f));
  // A copy the compute is about to wait for goes before the prefetches queued for later visits, unless it
  // waits on anything not yet done: the memory it fills may still be filled by one of them (an evicted
  // prefetch), and a pending step may wait for a copy queued ahead that still reads the step's buffer. A copy
  // that jumped the queue would then wait on a copy queued behind it, forever.
  const bool urgent = (need == DeviceEngine::Need::kMust || need == DeviceEngine::Need::kEvictAny) &&
                      all_ready(after);
  CopyLane& lane = engine_.to_device_;
  w.ready = track(lane.submit(
      std::move(after), [copies = std::move(copies), &lane]() -> DeviceEvent { return lane.copy(copies); }, urgent));
  w.last_use = w.ready;
  for (int source : store.sources(shard))
    if (!homed_[source]) store.add_reader(source, w.ready);
  count_load(shard);
  ++engine_.stats_.host_to_device_copies;
  engine_.stats_.host_to_device_bytes += copied;
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
    // A device-stepped borrower with nothing of its own to train writes every gradient into its owners' buffers;
    // one that sends some out holds them in its unit's region.
    const bool own_grads = !device_stepped_[shard] || store().trainable_numel(shard) > 0;
    if (with_grads && own_grads && !w.grads.valid() && (!holds_grads(shard) || sends_borrowed_[shard])) {
      const auto allocating = std::chrono::steady_clock::now();
      allocate_grads(shard);
      stats.grad_wait_seconds += seconds_since(allocating);
    }
    w.ready.order_before(engine_.compute_stream());
    w.device_step_queued = false;  // the compute now comes after the step that wrote these weights
    // The buffers its backward adds to are those the last steps read and zeroed: its own, and the device-stepped
    // owners' of the tied weights it borrows.
    const bool borrows_here = with_grads && !device_grad_owners_[shard].empty();
    if (with_grads && holds_grads(shard)) held_grads_ready_[shard].order_before(engine_.compute_stream());
    if (borrows_here)
      for (int owner : device_grad_owners_[shard]) held_grads_ready_[owner].order_before(engine_.compute_stream());
    stats.acquire_wait_seconds += seconds_since(waiting);
    if (frozen_base_) return;  // its users' parameters are bound by bind_frozen
    const at::Tensor weights = engine_.pool_.view(w.weights, store().compute_dtype(), visit_numel_[shard]);
    const at::Tensor grads = !with_grads || !own_grads ? at::Tensor()
                             : holds_grads(shard)     ? held_grads(shard)
                                                      : grad_view(shard);
    const at::Tensor unit_grads = w.grads.valid() ? grad_view(shard) : at::Tensor();
    // Every parameter the shard uses is in its own copy, tied ones included, but those of a resident owner: they
    // are read in its home, where their gradient sums. Its gradient of a tied weight it borrows sums in the owner's
    // buffer where the owner is device-stepped (the owner's step reads it there), and else waits in the unit's
    // region to go out with (or, device-stepped, apart from) its own.
    const bool reads_homes = std::any_of(store().sources(shard).begin(), store().sources(shard).end(),
                                         [&](int source) { return homed_[source]; });
    TORCH_CHECK(!reads_homes || homes_.uploaded(), "shard ", shard, " of model ", id(),
                " acquired before the model's upload");
    bind(shard, with_grads, [&](const ParamEntry& e) {
      if (e.owner != shard && homed_[e.owner])
        return Place{homes_.weights(store(), e.owner), homes_.grads(store(), e.owner), e.master_offset};
      if (e.owner == shard || !e.trainable) return Place{weights, grads, e.device_offset};
      if (borrows_here && device_stepped_[e.owner])
        return Place{weights, held_grads(e.owner), e.device_offset, e.master_offset};
      return Place{weights, with_grads ? unit_grads : at::Tensor(), e.device_offset};
    });
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
      engine_.pool_.view(weights_[shard].weights, store().compute_dtype(), visit_numel_[shard]);
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
  if (!w.device_step_queued) w.last_use = engine_.compute_point();
  if (w.grads.valid()) {  // backward never completed (an error): the gradients are abandoned
    engine_.pool_.release(w.grads, w.last_use);
    w.grads = Region{};
  }
  // State prefetched for a step that did not come (its loss gate closed, or its backward failed).
  if (state_visits_[shard].in_use()) drop_state(shard, w.last_use);
  if (w.cached && !pinned(shard) && (!current(shard) || w.step_queued_next)) evict(shard);
}

void SpilledModel::backward_done(int shard, bool step, double lr_scale, bool keep) {
  if (homed_.at(shard) || device_stepped_.at(shard)) {  // its gradients stay on the device: summed and stepped there
    note_gradients(shard);
    if (sends_borrowed_[shard]) send_borrowed_grads(shard, step);  // but those of weights stepped on the host
    // A unit's own gradient region would be given back at release, before any step read it.
    TORCH_CHECK(step || homed_[shard] || holds_grads(shard) || store().trainable_numel(shard) == 0,
                "backward_done: shard ", shard, " of model ", id(),
                " is stepped on the device after each backward (ShardStore::steps_after_each_backward), but this "
                "backward is not followed by its step");
    if (!step) return;
    const std::shared_ptr<const LossGate> gate = store().loss_gate();
    if (gate && !gate->open()) return;
    if (homed_[shard]) {  // as a ResidentModel's shard: its step is queued on the compute stream
      homes_.step(store(), shard, 1.0, lr_scale);
    } else if (holds_grads(shard) || bring_state(shard, /*must=*/false)) {
      device_step(shard, 1.0, lr_scale);
    } else {
      // No room for the step's regions now, even with every unpinned weight evicted: add_model's count is exact, but
      // the arena's free bytes can lie in pieces around the unit's own regions and other models' in flight. Its state
      // is home in the store between steps, so this step runs on the host from the unit's gradient region, as a
      // host-stepped shard's does, instead of failing the task.
      send_gradients(shard, /*step=*/true, lr_scale, /*keep=*/false);
    }
    return;
  }
  send_gradients(shard, step, lr_scale, keep);
}

void SpilledModel::discard_grads() {
  store().forget_gradients();
  for (int s = 0; s < store().num_shards(); ++s)
    if (store().has_grad(s)) store().grad(s).zero_();
  homes_.zero_grads(store());
  for (int s : device_shards_) {
    if (held_grads_.size() > static_cast<size_t>(s) && held_grads_[s].valid()) held_grads(s).zero_();
    if (state_visits_[s].in_use()) drop_state(s, engine_.compute_point());
  }
}

void SpilledModel::free_device_memory(const Fence& issued) {
  for (int s = 0; s < static_cast<int>(weights_.size()); ++s)
    if (cached(s)) evict(s);
  for (int s : device_shards_)
    if (state_visits_[s].in_use()) drop_state(s, issued);
  homes_.free(issued);
  free_held_grads(issued);
  landing_->shrink();  // after synchronize(): no copy or host job holds a buffer
}

}  // namespace hydra::engine
