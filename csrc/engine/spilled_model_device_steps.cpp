// The device-stepped shards of a spilled model (engine/spilled_model.h): their gradient buffers, which stay on the
// device for the whole run where a step sums several backwards (accumulation, clipping), and the optimizer step that
// brings a shard's fp32 master and optimizer states in, steps them on the device's step lane once they have landed
// and sends them home with the new weights.
//
// Per parameter of a bf16 AdamW shard a step copies 12 bytes in (master, two moments) and 14 out (the same, and
// the new bf16 weights), where a host step copies its 2-byte gradient out and then reads and writes about 28 bytes
// of host memory with the host's cores: the device step trades host arithmetic for the link's idle time. A cached
// copy of the shard's weights is updated on the device too, so its next visit need not wait for the trip home.
//
// A tied weight (an embedding and the head that borrows it) steps once, in its owner's step, over the sum of every
// shard's gradient of it. Where the owner is device-stepped, each borrower's backward (device- or host-stepped) adds
// its share to the owner's gradient buffer on the device, which the owner's backward, the last of the step, adds to.
// Where the owner is stepped on the host, a device-stepped borrower sends its share there after each backward, and
// it is summed as a host-stepped borrower's is. A borrower with nothing of its own to train steps with its owner.
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "engine/optimizer_step.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

namespace {

// What a piece of `bytes` takes at most where every piece starts at the pool's 512-byte alignment.
int64_t aligned(int64_t bytes) { return bytes + 512; }

}  // namespace

std::vector<int> SpilledModel::borrowed_grad_owners(const ShardStore& store, int shard) {
  std::vector<int> owners;
  for (const ParamEntry& e : store.layout(shard))
    if (e.owner != shard && e.trainable && std::find(owners.begin(), owners.end(), e.owner) == owners.end())
      owners.push_back(e.owner);
  return owners;
}

std::string SpilledModel::device_shards_error(const ShardStore& store, const std::vector<int>& resident_shards,
                                              const std::vector<int>& shards) {
  const int n = store.num_shards();
  std::vector<bool> in(n);
  for (int s : shards) {
    const std::string name = "device-stepped shard " + std::to_string(s);
    if (s < 0 || s >= n) return name + " of a model of " + std::to_string(n) + " shards";
    if (in[s]) return name + " named twice";
    in[s] = true;
    if (std::find(resident_shards.begin(), resident_shards.end(), s) != resident_shards.end())
      return name + " is resident too";
    // A borrower of a trainable tied weight with nothing of its own (a head alone) takes its tie's gradient there.
    if (store.trainable_numel(s) == 0 && borrowed_grad_owners(store, s).empty()) return name + " has nothing to train";
  }
  // Such a borrower's step is the count alone and its gradient all its owners': it steps where they do.
  for (int b = 0; b < n; ++b) {
    if (store.trainable_numel(b) > 0) continue;
    for (int owner : borrowed_grad_owners(store, b))
      if (in[b] != in[owner])
        return in[b] ? "device-stepped shard " + std::to_string(b) +
                           " has nothing of its own to train and borrows a tied weight from shard " +
                           std::to_string(owner) + ", which is not device-stepped: such a borrower steps with its owner"
                     : "device-stepped shard " + std::to_string(owner) + " lends a tied weight to shard " +
                           std::to_string(b) + ", which has nothing of its own to train and is not device-stepped: "
                           "such a borrower steps with its owner";
  }
  return {};
}

bool SpilledModel::sends_borrowed_grads(const ShardStore& store, const std::vector<int>& shards, int shard,
                                       const std::vector<int>& resident_shards) {
  auto in = [](const std::vector<int>& among, int s) {
    return std::find(among.begin(), among.end(), s) != among.end();
  };
  if (!in(shards, shard)) return false;
  const std::vector<int> owners = borrowed_grad_owners(store, shard);
  return std::any_of(owners.begin(), owners.end(),
                     [&](int owner) { return !in(shards, owner) && !in(resident_shards, owner); });
}

bool SpilledModel::keeps_gradient_buffer(const ShardStore& store, const std::vector<int>& shards, int shard,
                                         const std::vector<int>& resident_shards) {
  auto in = [&](int s) { return std::find(shards.begin(), shards.end(), s) != shards.end(); };
  if (!in(shard) || store.trainable_numel(shard) == 0) return false;
  if (!store.steps_after_each_backward() || sends_borrowed_grads(store, shards, shard, resident_shards)) return true;
  for (int b = 0; b < store.num_shards(); ++b) {  // a borrower of any placement adds its share to the buffer
    if (b == shard) continue;
    const std::vector<int> owners = borrowed_grad_owners(store, b);
    if (std::find(owners.begin(), owners.end(), shard) != owners.end()) return true;
  }
  return false;
}

int64_t SpilledModel::held_grads_need(const ShardStore& store, const std::vector<int>& shards,
                                      const std::vector<int>& resident_shards) {
  int64_t need = 0;
  for (int s : shards)
    if (keeps_gradient_buffer(store, shards, s, resident_shards))
      need += aligned(store.trainable_numel(s) * store.element_bytes());
  return need;
}

int64_t SpilledModel::device_step_need(const ShardStore& store, int shard) {
  const int64_t numel = store.trainable_numel(shard);
  const int states = store.optimizer().num_states();
  return aligned(numel * 4) + states * aligned(numel * 4) + (store.bf16() ? aligned(numel * 2) : 0);
}

void SpilledModel::upload_held_grads() {
  if (!held_grads_.empty() || std::none_of(holds_grads_.begin(), holds_grads_.end(), [](bool b) { return b; })) return;
  std::vector<Region> held(store().num_shards());
  try {
    for (int s : device_shards_) {
      if (!holds_grads(s)) continue;
      const int64_t bytes = store().trainable_numel(s) * store().element_bytes();
      held[s] = engine_.allocate(id(), s, bytes, DeviceEngine::Need::kMust).region;
      engine_.pool_.view(held[s], store().compute_dtype(), store().trainable_numel(s)).zero_();
    }
  } catch (...) {
    for (Region& region : held)
      if (region.valid()) engine_.pool_.release(region, engine_.compute_point());
    throw;
  }
  held_grads_ = std::move(held);
}

at::Tensor SpilledModel::held_grads(int shard) const {
  TORCH_CHECK(shard < static_cast<int>(held_grads_.size()) && held_grads_[shard].valid(), "shard ", shard,
              " of model ", id(), " has no gradient buffer on the device");
  return engine_.pool_.view(held_grads_[shard], store().compute_dtype(), store().trainable_numel(shard));
}

void SpilledModel::free_held_grads(const Fence& issued) {
  for (Region& region : held_grads_)
    if (region.valid()) engine_.pool_.release(region, issued);
  held_grads_.clear();
}

bool SpilledModel::bring_state(int shard, bool must, bool defer) {
  ShardStore& store = this->store();
  const int64_t numel = store.trainable_numel(shard);
  StateVisit& visit = state_visits_.at(shard);
  if (numel == 0 || visit.in_use()) return true;
  c10::DeviceGuard device_guard(engine_.device_);
  // One region for the step's length (fewer holes to find in a fragmented arena): any cached weights but those
  // pinned may make room; a prefetch takes none where there is none now (the step brings the state in itself).
  const int64_t bytes = device_step_need(store, shard);
  Allocation allocation = engine_.allocate(id(), shard, bytes, DeviceEngine::Need::kEvictAny);
  if (!allocation.region.valid() && must)
    allocation = engine_.allocate(id(), shard, bytes, DeviceEngine::Need::kMust);
  if (!allocation.region.valid()) return false;
  visit.regions.push_back(allocation.region);
  int64_t offset = allocation.region.offset;
  auto carve = [&](at::ScalarType dtype) {  // the next piece, at the pool's alignment
    const int64_t piece = numel * (dtype == at::kFloat ? 4 : 2);
    const at::Tensor view = engine_.pool_.view(Region{offset, piece}, dtype, numel);
    offset += (piece + 511) / 512 * 512;
    return view;
  };
  visit.master = carve(at::kFloat);
  for (int k = 0; k < store.optimizer().num_states(); ++k) visit.states.push_back(carve(at::kFloat));
  if (store.bf16()) visit.shadow = carve(at::kBFloat16);  // the new weights
  visit.waiting = std::move(allocation.after);  // earlier users of that memory
  visit.waiting.push_back(store.last_step(shard));  // the master's last writer
  visit.deferred = true;
  if (!defer) submit_state(shard, must);
  return true;
}

void SpilledModel::submit_state(int shard, bool must) {
  StateVisit& visit = state_visits_.at(shard);
  if (!visit.deferred) return;
  ShardStore& store = this->store();
  const int64_t numel = store.trainable_numel(shard);
  std::vector<Fence> after = std::move(visit.waiting);
  visit.deferred = false;
  try {
    CopyLane::Copies in{{visit.master, store.master(shard).narrow(0, 0, numel)}};
    for (size_t k = 0; k < visit.states.size(); ++k)
      in.emplace_back(visit.states[k], store.state(shard, static_cast<int>(k)));
    const bool urgent = must && all_ready(after);
    CopyLane& to_device = engine_.to_device_;
    visit.in = track(to_device.submit(
        std::move(after), [in, &to_device]() -> DeviceEvent { return to_device.copy(in); }, urgent));
    EngineStats& stats = engine_.stats_;
    ++stats.host_to_device_copies;
    for (const auto& [to, from] : in) stats.host_to_device_bytes += from.nbytes();
  } catch (...) {
    visit.waiting = std::move(after);  // left unless the copy took them
    visit.deferred = true;
    drop_state(shard, engine_.compute_point());
    throw;
  }
}

void SpilledModel::drop_state(int shard, const Fence& issued) {
  StateVisit& visit = state_visits_.at(shard);
  Fence reusable = issued;
  if (visit.deferred) {  // no copy took the regions: their next user waits for their earlier users alone
    for (const Fence& f : visit.waiting) f.order_reuse_before(engine_.compute_stream());
    reusable = engine_.compute_point();
  } else {
    visit.in.wait_done();  // the copy in may still be filling the regions (its error is reported by synchronize)
  }
  for (const Region& r : visit.regions) engine_.pool_.release(r, reusable);
  visit = StateVisit{};
}

void SpilledModel::prefetch_state(int shard) {
  if (device_stepped_.at(shard)) bring_state(shard, /*must=*/false, /*defer=*/true);
}

void SpilledModel::issue_prefetched_state(int shard) { submit_state(shard, /*must=*/false); }

void SpilledModel::forget_prefetched_state(int shard) {
  if (state_visits_.at(shard).in_use()) drop_state(shard, engine_.compute_point());
}

void SpilledModel::device_step(int shard, double grad_scale, double lr_scale) {
  ShardStore& store = this->store();
  const int64_t numel = store.trainable_numel(shard);
  c10::DeviceGuard device_guard(engine_.device_);
  if (numel == 0) {  // a borrower with nothing of its own: its gradients are in their owners' buffers
    store.take_step(shard);
    Weights& w = weights_[shard];
    if (w.grads.valid()) {
      engine_.pool_.release(w.grads, engine_.compute_point());
      w.grads = Region{};
    }
    const int64_t now = steady_ns();
    engine_.step_log_.add({id(), shard, store.steps_taken(shard), StepPlace::kDevice, now, now});
    ++engine_.stats_.device_steps;
    return;
  }
  // Room first: a step that cannot get it (out of memory, re-planned) must leave the step counts as they were.
  bring_state(shard, /*must=*/true);  // unless a prefetch brought it
  submit_state(shard, /*must=*/true);  // a prefetch's copy not issued yet: the step waits for it now
  const std::vector<StepRange> ranges = store.take_step(shard);
  const int64_t step_number = store.steps_taken(shard);
  const StateVisit visit = state_visits_[shard];  // forgotten once the step that uses it is queued
  Weights& w = weights_[shard];
  // A cached copy of the weights takes the new ones on the device: the next visit copies nothing in, and does not
  // wait for the state to go home. Its owned part is laid out as the master.
  const at::Tensor cached = w.cached ? engine_.pool_.view(w.weights, store.compute_dtype(), numel) : at::Tensor();
  const bool held = holds_grads(shard);
  const at::Tensor grads = (held ? held_grads(shard) : grad_view(shard)).narrow(0, 0, numel);
  std::shared_ptr<ShardStore> owner = store_ptr();
  CopyLane& lane = engine_.steps_;
  // On the step lane once the backward that wrote the gradients is issued and the state has landed: the compute
  // goes on with the next units meanwhile. A failed copy in fails the step, and the step's failure stops the copy
  // home, so the host keeps the state of the last completed step.
  // A cached copy may still be on its way in (reloaded for the next visit before a clipped step): after it.
  std::vector<Fence> after{engine_.compute_point()};
  if (w.cached) after.push_back(w.ready);
  StepLog& log = engine_.step_log_;
  const int model = id();
  const Fence stepped = track(lane.submit(std::move(after), [=, &lane, &log]() -> DeviceEvent {
    visit.in.order_before(lane.order_stream());
    const int64_t start = steady_ns();
    DeviceEvent done = lane.run([&] {
      step_ranges(owner->optimizer(), visit.master, grads, visit.states, visit.shadow, ranges, grad_scale, lr_scale);
      if (held) grads.zero_();  // for the next step's backwards; a unit's own region goes back to the arena
      const at::Tensor fresh = visit.shadow.defined() ? visit.shadow : visit.master;
      if (cached.defined())
        for (const StepRange& r : ranges)
          cached.narrow(0, r.begin, r.end - r.begin).copy_(fresh.narrow(0, r.begin, r.end - r.begin));
    });
    log.add({model, shard, step_number, StepPlace::kDevice, start, steady_ns()});
    return done;
  }));
  state_visits_[shard] = StateVisit{};
  if (!held) {  // given back now the step is queued (its next user waits for it), whatever happens below
    engine_.pool_.release(w.grads, stepped);
    w.grads = Region{};
  }
  CopyLane::Copies out{{store.master(shard).narrow(0, 0, numel), visit.master}};
  for (size_t k = 0; k < visit.states.size(); ++k)
    out.emplace_back(store.state(shard, static_cast<int>(k)), visit.states[k]);
  if (visit.shadow.defined())  // only what the step rewrote: the rest of the shadow is already what it was
    for (const StepRange& r : ranges)
      out.emplace_back(store.shadow(shard).narrow(0, r.begin, r.end - r.begin),
                       visit.shadow.narrow(0, r.begin, r.end - r.begin));
  // The host buffers it rewrites may still be read by weight copies queued before it.
  std::vector<Fence> before_out = store.readers(shard);
  CopyLane& to_host = engine_.to_host_;
  const Fence home = track(to_host.submit(std::move(before_out), [out, stepped, &to_host]() -> DeviceEvent {
    stepped.order_before(to_host.order_stream());
    return to_host.copy(out);
  }));
  for (const Region& r : visit.regions) engine_.pool_.release(r, home);
  store.set_last_step(shard, home);
  store.bump_version(shard);
  if (w.cached) {  // current again once the step is done: its next use waits for it
    w.version = input_version(shard);
    w.ready = w.last_use = stepped;
    w.device_step_queued = true;
  }
  // The gradients' next writer (the shard's next backward) waits for the step that reads and zeroes them.
  if (held) held_grads_ready_[shard] = stepped;
  EngineStats& stats = engine_.stats_;
  ++stats.device_steps;
  ++stats.device_to_host_copies;
  for (const auto& [to, from] : out) stats.device_to_host_bytes += from.nbytes();
}

}  // namespace hydra::engine
