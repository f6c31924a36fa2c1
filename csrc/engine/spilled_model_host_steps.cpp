// A spilled model's host-stepped shards (engine/spilled_model.h): each backward's gradient copied out to a staging
// buffer, summed or kept on the host where a step needs more than one, and the optimizer step on a host-step
// thread; and global-norm clipping, whose steps wait for every shard's gradient.
#include <c10/util/Exception.h>

#include <cmath>
#include <functional>
#include <future>

#include "engine/gradient_norm.h"
#include "engine/host_worker.h"
#include "engine/optimizer_step.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

namespace {

// Steps the shard's host buffers over `ranges` (ShardStore::take_step, taken when the step was submitted);
// runs on a host-step thread. `landed`: the shard's own gradient of this step, in device layout and compute
// dtype, read in the step's single pass, summed with a borrower's where one waits in the kept buffer;
// undefined: the accumulator, zeroed for the next step, or where the shard has none, its kept gradient.
// Part by part (step_parts): after each, `after_part(elements, last)`.
void step_host(ShardStore& store, int shard, const std::vector<StepRange>& ranges, double grad_scale,
               double lr_scale, const at::Tensor& landed, const std::function<void(int64_t, bool)>& after_part) {
  std::vector<at::Tensor> states;
  for (int k = 0; k < store.optimizer().num_states(); ++k) states.push_back(store.state(shard, k));
  const at::Tensor shadow = store.bf16() ? store.shadow(shard) : at::Tensor();
  const OptimizerSpec& spec = store.optimizer();
  const std::vector<std::pair<int64_t, int64_t>> waiting =
      landed.defined() ? store.take_borrowed_spans(shard) : std::vector<std::pair<int64_t, int64_t>>{};
  const at::Tensor grad = landed.defined() ? landed : store.pending_grad(shard);
  const bool zeroes_accumulator = !landed.defined() && store.has_grad(shard);
  // Summing a borrower's gradient decides per range whether to sum (0 + first + grad): a range cut in parts could
  // decide otherwise for a part (the sign of a zero gradient). Such a step is the embedding's, which no step of its
  // model's outranks: it runs whole.
  const std::vector<std::vector<StepRange>> parts = waiting.empty() ? step_parts(ranges)
                                                                    : std::vector<std::vector<StepRange>>{ranges};
  for (size_t i = 0; i < parts.size(); ++i) {
    if (waiting.empty()) {
      step_ranges(spec, store.master(shard), grad, states, shadow, parts[i], grad_scale, lr_scale);
    } else {
      step_ranges_summing(spec, store.master(shard), grad, store.kept(shard), waiting, states, shadow, parts[i],
                          grad_scale, lr_scale);
    }
    const bool last = i + 1 == parts.size();
    if (last && zeroes_accumulator) store.grad(shard).zero_();  // counted in the step's bytes: before the last count
    after_part(range_elements(parts[i]), last);
  }
  if (parts.empty() && zeroes_accumulator) store.grad(shard).zero_();
}

// Counts a host step's `bytes` (step_bytes) on the host lane part by part, each part's share from when it began, and
// between parts lets the model's steps of lower shards that can start run first (HostWorker::let_lower_ranks_run):
// the next forward needs them before this one. Where the step holds a landing buffer (it reads its gradient there),
// only while the model has another free (`may_yield`): a step waiting with its buffer held would otherwise keep the
// next gradients from landing, and each step let in would then wait for its gradient's copy. The model's lowest
// host-stepped shard's step is let in even so: its gradient is the last of the backward, and none lands before
// that step is done (the next forward waits for it).
class PartPacer {
 public:
  using Count = std::function<void(int64_t bytes, int64_t start_ns)>;  // DeviceEngine::count_host_job
  PartPacer(Count count, int64_t bytes, int64_t elements, int64_t start,
            std::function<bool(int64_t rank)> may_yield = {})
      : count_(std::move(count)), may_yield_(std::move(may_yield)), bytes_(bytes), elements_(elements),
        start_(start) {}

  void operator()(int64_t part, bool last) {
    stepped_ += part;
    // In double: bytes times elements overflows int64 for a shard of a billion parameters.
    const int64_t upto = stepped_ >= elements_ ? bytes_
                                               : static_cast<int64_t>(static_cast<double>(bytes_) * stepped_ / elements_);
    const int64_t share = upto - counted_;
    counted_ += share;
    count_(share, start_);
    if (!last) HostWorker::let_lower_ranks_run(may_yield_);
    start_ = steady_ns();
  }
  // A step of no elements (no parameter of the shard had a gradient) still counts its bytes, as it always did.
  void finish() {
    if (counted_ < bytes_) count_(bytes_ - counted_, start_);
  }

 private:
  const Count count_;
  const std::function<bool(int64_t rank)> may_yield_;
  const int64_t bytes_, elements_;
  int64_t start_, stepped_ = 0, counted_ = 0;
};

// The host memory a step of the shard touches: the gradient read (`grad_bytes` an element), the fp32 master and
// the optimizer states read and written, the bf16 shadow written.
int64_t step_bytes(const ShardStore& store, int shard, int64_t grad_bytes) {
  return store.trainable_numel(shard) * (grad_bytes + 8 + 8 * store.optimizer().num_states() + (store.bf16() ? 2 : 0));
}

}  // namespace

Fence SpilledModel::land(const at::Tensor& device_grad, const Landing& landing) {
  const int64_t numel = device_grad.numel();
  const int64_t bytes = numel * store().element_bytes();
  const at::ScalarType dtype = store().compute_dtype();
  CopyLane& lane = engine_.to_host_;
  std::shared_ptr<StagingRing> ring = landing_;
  auto copy_out = [=, &lane]() -> DeviceEvent {
    *landing = ring->acquire(bytes);
    return lane.copy({{(*landing)->view(dtype, numel), device_grad}});
  };
  const Fence landed =
      track(lane.submit_when({engine_.compute_point()}, copy_out, id(), [ring] { return ring->has_free(); }));
  ++engine_.stats_.device_to_host_copies;
  engine_.stats_.device_to_host_bytes += bytes;
  return landed;
}

void SpilledModel::send_gradients(int shard, bool step, double lr_scale, bool keep) {
  Weights& w = weights_.at(shard);
  TORCH_CHECK(w.grads.valid(), "backward_done: shard ", shard, " was not acquired with gradients");
  note_gradients(shard);
  // Kept for clip_and_step, whose step is next and makes this copy stale: it goes at release (after_release).
  if (keep) w.step_queued_next = true;
  std::shared_ptr<const LossGate> gate = step ? store().loss_gate() : nullptr;
  // Only the prefix holding trainable gradients summed on the host goes out: a frozen tail (a LoRA model's base
  // weights) stays, and so does a tied weight's whose owner sums it on the device (it is not in this region).
  const int64_t numel = store().host_gradient_numel(shard);
  const at::ScalarType dtype = store().compute_dtype();
  const Landing landing = std::make_shared<std::unique_ptr<StagingRing::Lease>>();
  const Fence landed = land(grad_view(shard).narrow(0, 0, numel), landing);
  std::shared_ptr<StagingRing> ring = landing_;
  const std::vector<Fence> readers = store().readers(shard);  // the step rewrites the buffer they read
  // Taken now, on this thread: later micro-batches note their gradients for the next step meanwhile.
  const std::vector<StepRange> ranges = step ? store().take_step(shard) : std::vector<StepRange>{};
  const int64_t step_number = store().steps_taken(shard);
  std::shared_ptr<ShardStore> owner = store_ptr();
  DeviceEngine& engine = engine_;
  const int model = id();
  const int lowest_host_stepped = this->lowest_host_stepped();
  Fence done = submit([=, &engine]() -> DeviceEvent {
    landed.wait();
    if (gate && !gate->open()) {  // landed after the loss on the same stream: no wait here
      owner->undo_step(shard, ranges);
      landing->reset();
      return nullptr;
    }
    const at::Tensor gradient = (*landing)->view(dtype, numel);
    int64_t start = steady_ns();
    int64_t step_start = start;
    // The step's only gradient of this shard (no accumulator yet: one micro-batch, no clipping, nothing
    // borrowed from it) is stepped from where it landed: one pass, and no fp32 copy of it on the host.
    const bool single_pass = step && !owner->has_grad(shard);
    const int64_t landed_bytes = numel * owner->element_bytes();
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
    if (touched > 0) engine.count_host_job(touched, start);
    if (!single_pass) landing->reset();  // summed or kept: the buffer may take the next gradient during the step
    if (step) {
      const bool zeroes_accumulator = !single_pass && owner->has_grad(shard);
      for (const Fence& copy : readers) copy.wait_done();
      step_start = steady_ns();  // waiting for copies to finish reading is not host memory traffic
      const int64_t grad_bytes = single_pass ? owner->element_bytes() : zeroes_accumulator ? 8 : 2;
      std::function<bool(int64_t)> may_yield;
      if (single_pass)
        may_yield = [&ring, lowest_host_stepped](int64_t rank) {
          return rank == lowest_host_stepped || ring->has_free();
        };
      PartPacer pace([&engine](int64_t bytes, int64_t at) { engine.count_host_job(bytes, at); },
                     step_bytes(*owner, shard, grad_bytes), range_elements(ranges), step_start, std::move(may_yield));
      step_host(*owner, shard, ranges, 1.0, lr_scale, single_pass ? gradient : at::Tensor(), std::ref(pace));
      pace.finish();
      ++engine.host_steps_done_;
      engine.step_log_.add({model, shard, step_number, StepPlace::kHost, step_start, steady_ns()});
    }
    landing->reset();
    return nullptr;
  }, [landed, readers] { return landed.ready() && all_ready(readers); }, store().sources(shard));
  // Free again once copied out: the next shard's gradients need not wait for this one's step.
  engine_.pool_.release(w.grads, landed);
  w.grads = Region{};
  if (step) {
    store().set_last_step(shard, done);
    store().bump_version(shard);  // the device copy predates the step: dropped on release
  }
}

void SpilledModel::send_borrowed_grads(int shard, bool step) {
  Weights& w = weights_.at(shard);
  TORCH_CHECK(w.grads.valid(), "backward_done: shard ", shard, " was not acquired with gradients");
  std::shared_ptr<const LossGate> gate = step ? store().loss_gate() : nullptr;
  const int64_t first = store().owned_numel(shard);  // borrowed weights follow the owned ones
  const int64_t numel = store().host_gradient_numel(shard) - first;
  const at::ScalarType dtype = store().compute_dtype();
  const int64_t bytes = numel * store().element_bytes();
  const Landing landing = std::make_shared<std::unique_ptr<StagingRing::Lease>>();
  const Fence landed = land(grad_view(shard).narrow(0, first, numel), landing);
  std::shared_ptr<ShardStore> owner = store_ptr();
  DeviceEngine& engine = engine_;
  // Among the jobs of the shard and its owners (sources): before the owners' next, which sum or step the gradient.
  submit([=, &engine]() -> DeviceEvent {
    landed.wait();
    if (!gate || gate->open()) {  // else the step is skipped, the owners' too: nothing to sum
      const int64_t start = steady_ns();
      owner->accumulate_borrowed(shard, (*landing)->view(dtype, numel), /*ends_step=*/step, first);
      engine.count_host_job(bytes + numel * 8, start);
    }
    landing->reset();
    return nullptr;
  }, [landed] { return landed.ready(); }, store().sources(shard));
  engine_.pool_.release(w.grads, landed);
  w.grads = Region{};
}

std::shared_ptr<ClipNorm> SpilledModel::clip_and_step(double max_norm, double lr_scale) {
  if (!resident_shards_.empty() || !device_shards_.empty()) return clip_and_step_here(max_norm, lr_scale);
  auto norm = std::make_shared<ClipNorm>(max_norm);
  std::shared_ptr<ShardStore> owner = store_ptr();
  // After every gradient job of the step (a job of every shard waits for all before it), on a host-step thread.
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
    for (int s = 0; s < store.num_shards(); ++s) {
      if (homed_[s]) continue;
      if (store.trainable_numel(s) == 0) continue;  // a tie's borrower with nothing of its own: in its owner's
      const at::Tensor grad = device_stepped_[s] ? held_grads(s) : store.pending_grad(s);
      grads.push_back(grad.narrow(0, 0, store.trainable_numel(s)));
    }
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
    } else if (device_stepped_[s]) {
      device_step(s, norm->scale(), lr_scale);
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
  const int64_t step_number = owner->steps_taken(shard);
  DeviceEngine& engine = engine_;
  const int model = id();
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
    const int64_t start = steady_ns();
    const bool zeroes_accumulator = owner->has_grad(shard);
    PartPacer pace([&engine](int64_t bytes, int64_t at) { engine.count_host_job(bytes, at); },
                   step_bytes(*owner, shard, zeroes_accumulator ? 8 : 2), range_elements(ranges), start);
    step_host(*owner, shard, ranges, norm->scale(), lr_scale, at::Tensor(), std::ref(pace));
    pace.finish();
    ++engine.host_steps_done_;
    engine.step_log_.add({model, shard, step_number, StepPlace::kHost, start, steady_ns()});
    return nullptr;
  }, [readers, norm] { return norm->ready() && all_ready(readers); }, owner->sources(shard));
  owner->set_last_step(shard, done);
  owner->bump_version(shard);
  if (cached(shard) && !pinned(shard)) evict(shard);
}

}  // namespace hydra::engine
