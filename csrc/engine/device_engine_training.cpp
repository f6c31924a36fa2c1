// DeviceEngine, the training half: parameter binding, gradients, optimizer steps, and bringing state home.
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cmath>

#include "engine/device_engine.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Steps the shard's host buffers over `ranges` (ShardStore::take_step, taken when the step was submitted);
// runs on a host-step thread. `landed`: the shard's one gradient of this step, in device layout and compute
// dtype, read in the step's single pass; undefined: the accumulator, zeroed for the next step, or where the
// shard has none, its kept gradient.
void step_host(ShardStore& store, int shard, const std::vector<StepRange>& ranges, double grad_scale,
               double lr_scale, const at::Tensor& landed) {
  std::vector<at::Tensor> states;
  for (int k = 0; k < store.optimizer().num_states(); ++k) states.push_back(store.state(shard, k));
  const at::Tensor shadow = store.bf16() ? store.shadow(shard) : at::Tensor();
  const at::Tensor grad = landed.defined() ? landed : store.pending_grad(shard);
  step_ranges(store.optimizer(), store.master(shard), grad, states, shadow, ranges, grad_scale, lr_scale);
  if (!landed.defined() && store.has_grad(shard)) store.grad(shard).zero_();
}

}  // namespace

at::Tensor DeviceEngine::grad_view(int model, int shard) {
  const ShardStore& store = *models_[model].store;
  return pool_.view(models_[model].shards[shard].grads, store.compute_dtype(), store.device_numel(shard));
}

at::Tensor DeviceEngine::home_view(int model, int shard, const Region& region, at::ScalarType dtype) {
  return pool_.view(region, dtype, models_[model].store->owned_numel(shard));
}

void DeviceEngine::upload_resident(int model) {
  Model& m = models_[model];
  ShardStore& store = *m.store;
  const at::ScalarType dtype = store.compute_dtype();
  c10::DeviceGuard device_guard(device_);
  for (int s = 0; s < store.num_shards(); ++s) {
    ShardState& state = m.shards[s];
    const int64_t numel = store.owned_numel(s);
    auto region = [&](int64_t bytes) { return allocate(model, s, bytes, Need::kMust).region; };
    state.home_weights = region(numel * store.element_bytes());
    state.home_grads = region(numel * store.element_bytes());
    home_view(model, s, state.home_weights, dtype).copy_(store.transfer_source(s));
    home_view(model, s, state.home_grads, dtype).zero_();
    if (store.bf16()) {
      state.home_master = region(numel * 4);
      home_view(model, s, state.home_master, at::kFloat).copy_(store.master(s));
    }
    for (int k = 0; k < store.optimizer().num_states(); ++k) {
      state.home_states.push_back(region(numel * 4));
      home_view(model, s, state.home_states.back(), at::kFloat).copy_(store.state(s, k));
    }
    ++state.loads;
    ++stats_.host_to_device_copies;
    stats_.host_to_device_bytes += numel * (store.element_bytes() + (store.bf16() ? 4 : 0) + 4 * store.optimizer().num_states());
  }
  m.uploaded = true;
}

void DeviceEngine::bind(int model, int shard, bool with_grads) {
  Model& m = models_[model];
  const ShardStore& store = *m.store;
  const at::ScalarType dtype = store.compute_dtype();
  // Spilled shards hold every parameter they use (tied ones copied in); resident models keep one copy of
  // each parameter, in its owner's buffers, so a tied weight is one tensor on the device too.
  std::vector<at::Tensor> weights(store.num_shards()), grads(store.num_shards()), bound;
  for (const ParamEntry& e : store.layout(shard)) {
    const int source = m.resident ? e.owner : shard;
    if (!weights[source].defined()) {
      if (m.resident) {
        weights[source] = home_view(model, source, m.shards[source].home_weights, dtype);
        grads[source] = home_view(model, source, m.shards[source].home_grads, dtype);
      } else {
        weights[source] = pool_.view(m.shards[shard].weights, dtype, store.device_numel(shard));
        if (with_grads) grads[source] = grad_view(model, shard);
      }
    }
    const int64_t offset = m.resident ? e.master_offset : e.device_offset;
    e.param.set_data(weights[source].narrow(0, offset, e.numel).view(e.param.sizes()));
    // variable_data(): the same memory under a version counter of its own (see ShardState::bound_grads).
    const at::Tensor grad = with_grads && e.trainable
                                ? grads[source].narrow(0, offset, e.numel).view(e.param.sizes()).variable_data()
                                : at::Tensor();
    e.param.mutable_grad() = grad;
    bound.push_back(grad);
  }
  m.shards[shard].bound_grads = std::move(bound);
}

void DeviceEngine::note_gradients(int model, int shard) {
  ShardStore& store = *models_[model].store;
  std::vector<at::Tensor>& bound = models_[model].shards[shard].bound_grads;
  const std::vector<ParamEntry>& layout = store.layout(shard);
  for (size_t i = 0; i < bound.size(); ++i)
    if (bound[i].defined() && bound[i]._version() > 0) store.note_gradient(layout[i].owner, layout[i].owner_index);
  bound.clear();  // noted once: a later backward of the shard binds afresh
}

std::shared_ptr<LossGate> DeviceEngine::watch_loss(int model, const at::Tensor& loss) {
  Model& m = live(model);
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
  m.store->set_loss_gate(gate);
  return gate;
}

void DeviceEngine::backward_done(int model, int shard, bool step, double lr_scale, bool keep) {
  Model& m = live(model);
  ShardState& state = m.shards.at(shard);
  TORCH_CHECK(m.resident || state.grads.valid(), "backward_done: shard ", shard, " was not acquired with gradients");
  note_gradients(model, shard);
  const std::shared_ptr<const LossGate> gate = step ? m.store->loss_gate() : nullptr;
  if (m.resident) {
    // Waits for the loss's copy only (the forward), not for the backward just queued.
    if (step && (!gate || gate->open())) step_resident(model, shard, 1.0, lr_scale);
    return;
  }
  const at::Tensor device_grad = grad_view(model, shard);
  const at::ScalarType dtype = m.store->compute_dtype();
  const int64_t numel = device_grad.numel();
  const int64_t bytes = numel * m.store->element_bytes();
  // The staging buffer the gradient lands in: leased by the copy, given back when the host job is done with
  // it (or when both jobs are gone, however they ended).
  auto landing = std::make_shared<std::unique_ptr<StagingRing::Lease>>();
  const Fence landed = track(model, to_host_.submit({compute_point()}, [=, this]() -> DeviceEvent {
    *landing = staging_.acquire(bytes);
    return to_host_.copy({{(*landing)->view(dtype, numel), device_grad}});
  }));
  ++stats_.device_to_host_copies;
  stats_.device_to_host_bytes += bytes;
  const std::vector<Fence> readers = m.store->readers(shard);  // the step rewrites the buffer they read
  // Taken now, on this thread: later micro-batches note their gradients for the next step meanwhile.
  const std::vector<StepRange> ranges = step ? m.store->take_step(shard) : std::vector<StepRange>{};
  std::shared_ptr<ShardStore> owner = m.store;
  Fence done = submit(model, [=, this]() -> DeviceEvent {
    landed.wait();
    if (gate && !gate->open()) {  // landed after the loss on the same stream: no wait here
      owner->undo_step(shard, ranges);
      landing->reset();
      return nullptr;
    }
    const at::Tensor gradient = (*landing)->view(dtype, numel);
    const int64_t start = now_ns();
    // The step's only gradient of this shard (no accumulator yet: one micro-batch, no clipping, nothing
    // borrowed from it) is stepped from where it landed: one pass, and no fp32 copy of it on the host.
    const bool single_pass = step && !owner->has_grad(shard);
    if (single_pass) {
      owner->accumulate_borrowed(shard, gradient);
    } else if (keep && owner->bf16() && !owner->has_grad(shard)) {
      owner->keep_grads(shard, gradient);  // for clip_and_step, as landed: half an accumulator's bytes
    } else {
      owner->accumulate_grads(shard, gradient);
    }
    if (step) {
      for (const Fence& copy : readers) copy.wait_done();
      step_host(*owner, shard, ranges, 1.0, lr_scale, single_pass ? gradient : at::Tensor());
      ++host_steps_done_;
    }
    host_step_ns_ += now_ns() - start;
    landing->reset();
    return nullptr;
  });
  // Free again once copied out: the next shard's gradients need not wait for this one's step.
  pool_.release(state.grads, landed);
  state.grads = Region{};
  if (step) {
    m.store->set_last_step(shard, done);
    m.store->bump_version(shard);  // the device copy predates the step: dropped on release
  }
}

void DeviceEngine::step_resident(int model, int shard, double grad_scale, double lr_scale) {
  Model& m = models_[model];
  ShardStore& store = *m.store;
  ShardState& state = m.shards[shard];
  c10::DeviceGuard device_guard(device_);
  const at::Tensor weights = home_view(model, shard, state.home_weights, store.compute_dtype());
  const at::Tensor grads = home_view(model, shard, state.home_grads, store.compute_dtype());
  // In bf16 the fp32 master is stepped and the bf16 weights the shard computes with are its shadow.
  const at::Tensor param = store.bf16() ? home_view(model, shard, state.home_master, at::kFloat) : weights;
  std::vector<at::Tensor> states;
  for (const Region& r : state.home_states) states.push_back(home_view(model, shard, r, at::kFloat));
  step_ranges(store.optimizer(), param, grads, states, store.bf16() ? weights : at::Tensor(), store.take_step(shard),
              grad_scale, lr_scale);
  grads.zero_();
}

void DeviceEngine::step_spilled(int model, int shard, double grad_scale, double lr_scale) {
  ShardState& state = models_[model].shards[shard];
  std::shared_ptr<ShardStore> owner = models_[model].store;
  const std::vector<Fence> readers = owner->readers(shard);
  const std::vector<StepRange> ranges = owner->take_step(shard);
  const Fence done = submit(model, [=, this]() -> DeviceEvent {
    for (const Fence& copy : readers) copy.wait_done();
    const int64_t start = now_ns();
    step_host(*owner, shard, ranges, grad_scale, lr_scale, at::Tensor());
    ++host_steps_done_;
    host_step_ns_ += now_ns() - start;
    return nullptr;
  });
  owner->set_last_step(shard, done);
  owner->bump_version(shard);
  if (state.cached && state.pins == 0) evict(state);
}

double DeviceEngine::clip_and_step(int model, double max_norm, double lr_scale) {
  // Not gated by the loss: the caller reads it first (the runner's _end_micro_batch raises on a non-finite one).
  synchronize(model);
  Model& m = models_.at(model);
  ShardStore& store = *m.store;
  double sum_of_squares = 0.0;
  for (int s = 0; s < store.num_shards(); ++s) {
    const int64_t n = store.trainable_numel(s);
    const at::Tensor g = m.resident ? home_view(model, s, m.shards[s].home_grads, store.compute_dtype()).narrow(0, 0, n)
                                    : store.pending_grad(s).narrow(0, 0, n);
    const double norm = at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kFloat).item<double>();
    sum_of_squares += norm * norm;
  }
  const double total = std::sqrt(sum_of_squares);
  if (!std::isfinite(total)) {
    discard_grads(model);
    TORCH_CHECK(false, "the gradient norm is not finite (", total, "); the step was skipped, weights unchanged");
  }
  const double scale = std::min(1.0, max_norm / (total + 1e-6));
  for (int s = store.num_shards() - 1; s >= 0; --s) {
    if (m.resident) {
      step_resident(model, s, scale, lr_scale);
    } else {
      step_spilled(model, s, scale, lr_scale);
    }
  }
  return total;
}

void DeviceEngine::discard_grads(int model) {
  synchronize(model);
  Model& m = models_.at(model);
  m.store->forget_gradients();
  for (int s = 0; s < m.store->num_shards(); ++s) {
    if (m.resident && m.uploaded) {
      home_view(model, s, m.shards[s].home_grads, m.store->compute_dtype()).zero_();
    } else if (!m.resident && m.store->has_grad(s)) {
      m.store->grad(s).zero_();
    }
  }
}

void DeviceEngine::synchronize(int model) {
  // An empty job at the end of the model's chain finishes after every earlier host job, whichever device
  // queued it.
  submit(model, []() -> DeviceEvent { return nullptr; });
  std::vector<Fence> jobs = std::move(models_.at(model).jobs);
  models_[model].jobs.clear();
  // Every job's device work is waited for, so nothing is in flight afterwards; then the first error is raised.
  std::exception_ptr first_error;
  for (const Fence& job : jobs) {
    try {
      job.wait();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

void DeviceEngine::copy_resident_home(int model) {
  Model& m = models_.at(model);
  ShardStore& store = *m.store;
  if (!m.resident || !m.uploaded) return;  // never uploaded: the store holds the state
  c10::DeviceGuard device_guard(device_);
  for (int s = 0; s < store.num_shards(); ++s) {
    const ShardState& state = m.shards[s];
    if (store.bf16()) {
      store.master(s).copy_(home_view(model, s, state.home_master, at::kFloat));
      store.shadow(s).copy_(home_view(model, s, state.home_weights, at::kBFloat16));
    } else {
      store.master(s).copy_(home_view(model, s, state.home_weights, at::kFloat));
    }
    for (int k = 0; k < store.optimizer().num_states(); ++k)
      store.state(s, k).copy_(home_view(model, s, state.home_states[k], at::kFloat));
  }
}

void DeviceEngine::snapshot(int model) {
  synchronize(model);
  copy_resident_home(model);
}

void DeviceEngine::finish(int model) {
  live(model);
  std::exception_ptr failure;
  try {
    synchronize(model);
  } catch (...) {
    failure = std::current_exception();
  }
  copy_resident_home(model);
  models_.at(model).store->write_back();
  if (failure) std::rethrow_exception(failure);
}

void DeviceEngine::release_model(int model) {
  Model& m = models_.at(model);
  if (!m.store) return;
  synchronize(model);
  // Visits planned before the task ended must not bring its shards back in.
  std::erase_if(upcoming_, [model](int64_t visit) { return (visit >> 32) == model; });
  const Fence issued = compute_point();
  for (ShardState& state : m.shards) {
    TORCH_CHECK(state.pins == 0, "release_model: a shard of model ", model, " is still acquired");
    if (state.cached) evict(state);
    for (Region* region : {&state.home_weights, &state.home_grads, &state.home_master}) {
      if (region->valid()) pool_.release(*region, issued);
      *region = Region{};
    }
    for (Region& region : state.home_states) pool_.release(region, issued);
    state.home_states.clear();
    state.bound_grads.clear();
  }
  if (m.resident) resident_committed_ -= resident_need(*m.store);
  m.resident = false;
  m.store.reset();
}

EngineStats DeviceEngine::stats() const {
  EngineStats stats = stats_;
  stats.capacity_bytes = pool_.capacity();
  stats.high_water_bytes = pool_.high_water();
  stats.host_steps = host_steps_done_.load();
  stats.host_step_seconds = static_cast<double>(host_step_ns_.load()) * 1e-9;
  stats.grad_copy_seconds = to_host_.busy_seconds();
  stats.weight_copy_seconds = to_device_.busy_seconds();
  stats.staging_bytes = staging_.host_bytes();
  return stats;
}

std::vector<int64_t> DeviceEngine::shard_loads(int model) const {
  std::vector<int64_t> loads;
  for (const ShardState& state : models_.at(model).shards) loads.push_back(state.loads);
  return loads;
}

}  // namespace hydra::engine
