#include "engine/shard_store.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

#include "engine/host_memory.h"

namespace hydra::engine {

namespace {

int64_t aligned(int64_t n) {
  return (n + ShardStore::kAlignElements - 1) / ShardStore::kAlignElements * ShardStore::kAlignElements;
}

}  // namespace

ShardStore::ShardStore(const std::vector<std::vector<at::Tensor>>& shard_params, OptimizerSpec optimizer,
                       bool bf16, bool pin_memory)
    : optimizer_(optimizer), bf16_(bf16), pinned_(pin_memory) {
  TORCH_CHECK(!shard_params.empty(), "ShardStore: a model needs at least one shard");
  const int n = static_cast<int>(shard_params.size());
  layouts_.resize(n);
  owned_numel_.assign(n, 0);
  trainable_numel_.assign(n, 0);
  device_numel_.assign(n, 0);
  gradient_numel_.assign(n, 0);
  summed_on_device_ = std::vector<std::atomic<bool>>(n);
  steps_.assign(n, 0);
  versions_ = std::vector<std::atomic<int64_t>>(n);
  last_steps_.resize(n);
  readers_.resize(n);
  last_jobs_.resize(n);

  // Owner = first shard listing the parameter; identity is the TensorImpl, as for Python's `is`.
  struct Home {
    int owner;
    int index;
    int64_t master_offset;
  };
  std::unordered_map<const c10::TensorImpl*, Home> owned_by;
  std::vector<std::vector<ParamEntry>> owned(n), borrowed(n);
  for (int s = 0; s < n; ++s) {
    std::unordered_map<const c10::TensorImpl*, bool> seen_here;
    for (const at::Tensor& p : shard_params[s]) {
      TORCH_CHECK(p.defined(), "ShardStore: shard ", s, " lists an undefined parameter");
      TORCH_CHECK(p.device().is_cpu(), "ShardStore: parameters must be on the CPU, found one on ", p.device());
      TORCH_CHECK(at::isFloatingType(p.scalar_type()), "ShardStore: parameters must be floating point, found ",
                  p.scalar_type());
      if (!seen_here.emplace(p.unsafeGetTensorImpl(), true).second) continue;
      ParamEntry entry{p, s, 0, 0, 0, p.numel(), p.requires_grad(), p.scalar_type()};
      auto found = owned_by.find(p.unsafeGetTensorImpl());
      if (found == owned_by.end()) {
        owned[s].push_back(entry);
      } else {
        entry.owner = found->second.owner;
        borrowed[s].push_back(entry);
      }
    }
    // Trainable parameters first, so one contiguous range [0, trainable_numel) is what the optimizer steps.
    std::stable_partition(owned[s].begin(), owned[s].end(), [](const ParamEntry& e) { return e.trainable; });
    int64_t offset = 0;
    for (ParamEntry& e : owned[s]) {
      e.master_offset = e.device_offset = offset;
      offset = aligned(offset + e.numel);
      if (e.trainable) trainable_numel_[s] = offset;
    }
    owned_numel_[s] = offset;
    for (ParamEntry& e : owned[s]) layouts_[s].push_back(e);
    // Register owners only after sorting, so borrowers copy the final master offsets and entry indices.
    for (int i = 0; i < static_cast<int>(layouts_[s].size()); ++i) {
      ParamEntry& e = layouts_[s][i];
      e.owner_index = i;
      owned_by.emplace(e.param.unsafeGetTensorImpl(), Home{s, i, e.master_offset});
    }
  }
  sources_.resize(n);
  for (int s = 0; s < n; ++s) {
    sources_[s].push_back(s);
    int64_t offset = owned_numel_[s];
    for (ParamEntry& e : borrowed[s]) {
      const Home& home = owned_by.at(e.param.unsafeGetTensorImpl());
      e.master_offset = home.master_offset;
      e.owner_index = home.index;
      e.device_offset = offset;
      offset = aligned(offset + e.numel);
      layouts_[s].push_back(e);
      if (std::find(sources_[s].begin(), sources_[s].end(), e.owner) == sources_[s].end()) sources_[s].push_back(e.owner);
    }
    device_numel_[s] = offset;
    for (const ParamEntry& e : layouts_[s])
      if (e.trainable) gradient_numel_[s] = std::max(gradient_numel_[s], aligned(e.device_offset + e.numel));
    received_.emplace_back(layouts_[s].size(), 0);
    borrowed_waiting_.emplace_back(layouts_[s].size(), 0);
    param_steps_.emplace_back(layouts_[s].size(), 0);
    options_.emplace_back(layouts_[s].size(), ParamOptions{optimizer.lr, optimizer.weight_decay});
  }

  std::unordered_map<const c10::TensorImpl*, int> borrowers;
  for (const std::vector<ParamEntry>& entries : borrowed)
    for (const ParamEntry& e : entries)
      if (e.trainable) ++borrowers[e.param.unsafeGetTensorImpl()];
  keeps_borrowed_as_landed_ =
      bf16 && std::all_of(borrowers.begin(), borrowers.end(), [](const auto& b) { return b.second == 1; });

  // Only what crosses to the device is pinned, a DMA needs it, the host-only buffers do not: the transfer sources of
  // all shards as one block.
  const std::vector<at::Tensor> sources = host_buffers(owned_numel_, compute_dtype(), pinned_);
  state_pinned_.assign(n, 0);
  for (int s = 0; s < n; ++s) {
    at::Tensor master = bf16 ? at::empty({owned_numel_[s]}, at::kFloat) : sources[s];
    master.zero_();
    for (const ParamEntry& e : layouts_[s]) {
      if (e.owner != s) continue;
      master.narrow(0, e.master_offset, e.numel).copy_(e.param.detach().reshape({-1}));
    }
    master_.push_back(master);
    grad_.emplace_back();  // allocated by grad() when first needed
    kept_.emplace_back();  // and by kept()
    std::vector<at::Tensor> states;
    // Frozen parameters sort after the trainable ones and never step: the state covers the trainable range only.
    for (int k = 0; k < optimizer.num_states(); ++k) states.push_back(at::zeros({trainable_numel_[s]}, at::kFloat));
    state_.push_back(std::move(states));
    if (bf16) {
      at::Tensor shadow = sources[s];
      shadow.copy_(master);
      shadow_.push_back(shadow);
    }
  }
}

void ShardStore::pin_states(const std::vector<int>& shards) {
  std::lock_guard<std::mutex> lock(pin_mutex_);
  if (!pinned_) return;
  // In fp32 the master is pinned already: it crosses as the weights.
  std::vector<at::Tensor*> buffers;
  for (int s : shards) {
    if (state_pinned_.at(s)) continue;  // a model added again, say
    state_pinned_[s] = 1;
    if (bf16_) buffers.push_back(&master_[s]);
    for (at::Tensor& state : state_[s]) buffers.push_back(&state);
  }
  if (buffers.empty()) return;
  std::vector<int64_t> numels;
  for (const at::Tensor* b : buffers) numels.push_back(b->numel());
  const std::vector<at::Tensor> pinned = host_buffers(numels, at::kFloat, pinned_);
  if (!pinned_) return;  // the block could not be had after all: the pageable buffers stay
  for (size_t i = 0; i < buffers.size(); ++i) {
    at::Tensor copy = pinned[i];
    copy.copy_(*buffers[i]);
    *buffers[i] = std::move(copy);
  }
}

int64_t ShardStore::device_bytes(const std::vector<int64_t>& numels, bool bf16) {
  int64_t elements = 0;
  for (int64_t n : numels) elements += aligned(n);
  return elements * element_bytes(bf16);
}

at::ScalarType ShardStore::compute_dtype() const { return bf16_ ? at::kBFloat16 : at::kFloat; }

int64_t ShardStore::total_owned_numel() const {
  int64_t total = 0;
  for (int64_t n : owned_numel_) total += n;
  return total;
}

int64_t ShardStore::total_trainable_numel() const {
  int64_t total = 0;
  for (int64_t n : trainable_numel_) total += n;
  return total;
}

at::Tensor& ShardStore::grad(int shard) {
  at::Tensor& accumulator = grad_.at(shard);
  if (!accumulator.defined()) accumulator = at::zeros({trainable_numel_[shard]}, at::kFloat);  // frozen: no slot
  return accumulator;
}

at::Tensor& ShardStore::kept(int shard) {
  at::Tensor& landed = kept_.at(shard);
  if (!landed.defined()) landed = at::empty({trainable_numel_[shard]}, at::kBFloat16);
  return landed;
}

int64_t ShardStore::host_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) { bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; };
  for (int s = 0; s < num_shards(); ++s) {
    add(master_[s]);
    add(grad_[s]);
    add(kept_[s]);
    for (const at::Tensor& t : state_[s]) add(t);
    if (bf16_) add(shadow_[s]);
  }
  return bytes;
}

void ShardStore::forget_gradients() {
  for (std::vector<uint8_t>& received : received_) std::fill(received.begin(), received.end(), 0);
  for (std::vector<uint8_t>& waiting : borrowed_waiting_) std::fill(waiting.begin(), waiting.end(), 0);
}

std::vector<std::shared_future<void>> ShardStore::exchange_last_jobs(const std::vector<int>& shards,
                                                                   const std::shared_future<void>& next) {
  std::vector<std::shared_future<void>> waits;
  auto take = [&](int shard) {
    std::shared_future<void>& last = last_jobs_.at(shard);
    if (last.valid()) waits.push_back(std::move(last));
    last = next;
  };
  if (shards.empty()) {
    for (int s = 0; s < num_shards(); ++s) take(s);
  } else {
    for (int s : shards) take(s);
  }
  return waits;
}

std::vector<std::pair<int64_t, int64_t>> ShardStore::take_borrowed_spans(int shard) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  std::vector<uint8_t>& waiting = borrowed_waiting_.at(shard);
  for (size_t i = 0; i < waiting.size(); ++i) {
    if (!waiting[i]) continue;
    const ParamEntry& e = layouts_[shard][i];
    spans.emplace_back(e.master_offset, e.master_offset + e.numel);
    waiting[i] = 0;
  }
  return spans;
}

std::vector<StepRange> ShardStore::take_step(int shard) {
  std::vector<StepRange> ranges;
  std::vector<uint8_t>& received = received_.at(shard);
  const std::vector<ParamEntry>& layout = layouts_[shard];
  for (size_t i = 0; i < layout.size(); ++i) {
    const ParamEntry& e = layout[i];
    if (e.owner != shard || !e.trainable || !received[i]) continue;
    const int64_t step = ++param_steps_[shard][i];
    const ParamOptions& options = options_[shard][i];
    // Up to the next entry's offset: the padding steps with its parameter, so that when every parameter
    // steps the one range is the whole trainable buffer, as one pass of the fused kernel.
    const int64_t end = aligned(e.master_offset + e.numel);
    if (!ranges.empty() && ranges.back().end == e.master_offset && ranges.back().step == step &&
        ranges.back().lr == options.lr && ranges.back().weight_decay == options.weight_decay) {
      ranges.back().end = end;
    } else {
      ranges.push_back({e.master_offset, end, step, options.lr, options.weight_decay});
    }
  }
  std::fill(received.begin(), received.end(), 0);
  ++steps_[shard];
  return ranges;
}

void ShardStore::undo_step(int shard, const std::vector<StepRange>& ranges) {
  const std::vector<ParamEntry>& layout = layouts_.at(shard);
  for (size_t i = 0; i < layout.size(); ++i) {
    const ParamEntry& e = layout[i];
    if (e.owner != shard || !e.trainable) continue;
    for (const StepRange& r : ranges)
      if (e.master_offset >= r.begin && e.master_offset < r.end) --param_steps_[shard][i];
  }
  --steps_[shard];
}

void ShardStore::accumulate_grads(int shard, const at::Tensor& device_layout_grad) {
  accumulate_borrowed(shard, device_layout_grad);
  grad(shard).add_(device_layout_grad.narrow(0, 0, trainable_numel_[shard]));
}

void ShardStore::keep_grads(int shard, const at::Tensor& device_layout_grad) {
  TORCH_CHECK(bf16_ && device_layout_grad.scalar_type() == at::kBFloat16,
              "keep_grads: a kept gradient is a bf16 model's, as it landed");
  accumulate_borrowed(shard, device_layout_grad);
  kept(shard).copy_(device_layout_grad.narrow(0, 0, trainable_numel_[shard]));
}

void ShardStore::set_summed_on_device(const std::vector<int>& owners) {
  std::vector<bool> summed(num_shards());
  for (int s : owners) summed.at(s) = true;
  for (int s = 0; s < num_shards(); ++s) summed_on_device_[s].store(summed[s], std::memory_order_release);
}

int64_t ShardStore::host_gradient_numel(int shard) const {
  int64_t numel = trainable_numel_.at(shard);
  for (const ParamEntry& e : layouts_[shard])
    if (e.owner != shard && e.trainable && !summed_on_device(e.owner))
      numel = std::max(numel, aligned(e.device_offset + e.numel));
  return numel;
}

void ShardStore::accumulate_borrowed(int shard, const at::Tensor& device_layout_grad, bool ends_step, int64_t first) {
  const int64_t end = first + device_layout_grad.numel();
  TORCH_CHECK(device_layout_grad.device().is_cpu() && first >= 0 && first <= owned_numel_.at(shard) &&
                  end >= host_gradient_numel(shard) && end <= device_numel_.at(shard),
              "accumulate_grads: expected a host tensor of the device layout from element ", first, " up to ",
              host_gradient_numel(shard), " to ", device_numel_.at(shard), " of shard ", shard, ", got ",
              device_layout_grad.numel(), " elements");
  for (const ParamEntry& e : layouts_[shard]) {
    if (e.owner == shard || !e.trainable || summed_on_device(e.owner)) continue;
    const at::Tensor part = device_layout_grad.narrow(0, e.device_offset - first, e.numel);
    if (ends_step && keeps_borrowed_as_landed_ && !has_grad(e.owner)) {
      kept(e.owner).narrow(0, e.master_offset, e.numel).copy_(part);
      borrowed_waiting_[e.owner][e.owner_index] = 1;
    } else {
      grad(e.owner).narrow(0, e.master_offset, e.numel).add_(part);
    }
  }
}

std::vector<ShardStore::ParamState> ShardStore::param_states() {
  std::vector<ParamState> found;
  for (int s = 0; s < num_shards(); ++s) {
    for (size_t i = 0; i < layouts_[s].size(); ++i) {
      const ParamEntry& e = layouts_[s][i];
      if (e.owner != s) continue;
      auto view = [&](const at::Tensor& flat) { return flat.narrow(0, e.master_offset, e.numel).view(e.param.sizes()); };
      ParamState state{e.param, view(master_[s]), {}, param_steps_[s][i]};
      if (e.trainable)
        for (const at::Tensor& t : state_[s]) state.states.push_back(view(t));
      found.push_back(std::move(state));
    }
  }
  return found;
}

std::pair<int, size_t> ShardStore::owned_entry(const at::Tensor& param, const char* what) const {
  for (int s = 0; s < num_shards(); ++s) {
    for (size_t i = 0; i < layouts_[s].size(); ++i) {
      const ParamEntry& e = layouts_[s][i];
      if (e.owner == s && e.param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return {s, i};
    }
  }
  TORCH_CHECK(false, what, ": the parameter of shape ", param.sizes(), " is not in this store");
  return {-1, 0};  // not reached
}

void ShardStore::set_param_steps(const at::Tensor& param, int64_t steps) {
  TORCH_CHECK(steps >= 0, "set_param_steps: a step count cannot be negative, got ", steps);
  const auto [shard, index] = owned_entry(param, "set_param_steps");
  param_steps_[shard][index] = steps;
}

void ShardStore::set_steps_taken(int64_t steps) {
  TORCH_CHECK(steps >= 0, "set_steps_taken: a step count cannot be negative, got ", steps);
  std::fill(steps_.begin(), steps_.end(), steps);
}

void ShardStore::set_param_options(const at::Tensor& param, double lr, double weight_decay) {
  TORCH_CHECK(lr >= 0 && weight_decay >= 0, "set_param_options: lr and weight_decay must be >= 0");
  const auto [shard, index] = owned_entry(param, "set_param_options");
  options_[shard][index] = ParamOptions{lr, weight_decay};
}

void ShardStore::refresh_shadow() {
  if (!bf16_) return;
  for (int s = 0; s < num_shards(); ++s) shadow_[s].copy_(master_[s]);
}

void ShardStore::write_back() {
  // Every copy is made before any parameter is rebound: memory running out half-way must not leave some
  // parameters pointing at device memory about to be freed. A parameter whose copy cannot be made keeps a
  // view of its master buffer instead (the same values, in fp32; the buffer stays alive with it).
  std::vector<std::pair<ParamEntry*, at::Tensor>> values;
  for (int s = 0; s < num_shards(); ++s) {
    for (ParamEntry& e : layouts_[s]) {
      if (e.owner != s) continue;
      const at::Tensor master = master_[s].narrow(0, e.master_offset, e.numel).view(e.param.sizes());
      at::Tensor value;
      try {
        value = master.to(e.original_dtype, /*non_blocking=*/false, /*copy=*/true);
      } catch (const std::exception&) {
        value = master;
      }
      values.emplace_back(&e, std::move(value));
    }
  }
  for (auto& [entry, value] : values) {
    entry->param.set_data(value);
    entry->param.mutable_grad() = at::Tensor();
  }
}

}  // namespace hydra::engine
