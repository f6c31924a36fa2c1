// A model whose training state stays on the host: a shard's weights are copied to the device for its compute
// (prefetched ahead of it, and kept while the budget allows, evicted by furthest next use), its gradients are
// copied out as soon as its backward is issued, and its optimizer step runs on a host-step thread once they
// have landed, overlapping the compute of other shards.
//
// A weight copy waits only for the steps of the shards it reads (its own, and its tied parameters' owners');
// a step waits for its gradient copy and for copies still reading the weights it rewrites.
//
// Some shards may be *resident* instead: their whole state has a home on the device (engine/shard_homes.h)
// and steps there, as a ResidentModel's shards do, with no copy at all. The first shard resident takes the
// step boundary's round trip (its gradient out, its host step, its weights back in before the next forward)
// off the model's chain. A tied weight lives where its owner does: a resident owner's borrowers may be spilled (their
// units read the weight in its home and sum their gradient of it there, copying none of it), but a resident
// borrower's owner is resident.
//
// Others may be *device-stepped*: spilled, their weights visit as any spilled shard's, but their gradients stay on
// the device in a buffer of their own (summed there over a step's micro-batches, as a resident shard's), and
// after the step's last backward their fp32 master and optimizer states come in, the device's step lane steps them
// once they have landed (the compute goes on meanwhile) and they go back out with the new weights, which a cached
// copy takes on the device too (spilled_model_device_steps.cpp): no gradient copy, no host arithmetic. Where
// the host's memory bandwidth binds a run, that moves its busiest lane's work to the device and the link's other
// direction. A tied weight steps once, in its owner's step, wherever that is; each borrower steps what it owns where
// it is placed. A device-stepped owner keeps a gradient buffer on the device for the run, into which every
// borrower's backward, device- or host-stepped, adds its share before the owner's own backward (backward runs from
// the last shard to the first), so the owner's step sees their sum; a host-stepped borrower's copy out then leaves
// that part behind. A device-stepped borrower of a host-stepped owner keeps its own gradients in a buffer and sends
// its share of the tied weight's out after each backward, to be summed on the host as a host-stepped borrower's is.
// Every unit of a model with a tie so split or stepped on the device runs on one device (the buffers are there).
#pragma once

#include <string>

#include "engine/device_model.h"
#include "engine/shard_homes.h"
#include "engine/staging_ring.h"

namespace hydra::engine {

class SpilledModel final : public DeviceModel {
 public:
  // `resident_shards`: the shards whose state lives on the device (ShardHomes), closed under ties
  // (resident_shards_error). `frozen_base`: the model is the frozen weights several tasks share
  // (DeviceEngine::add_base): it has no parameters of its own to bind, its shards are bound to each user's
  // parameters in turn (bind_frozen), and units of several users may hold one of them at once.
  // `device_shards`: the shards stepped on the device (device_shards_error).
  SpilledModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store, std::vector<int> resident_shards = {},
               bool frozen_base = false, std::vector<int> device_shards = {});
  // Why `shards` cannot be a spilled model's resident shards (out of range, repeated, all of them, or against the
  // ties' rule: a resident borrower of a tied weight whose owner is spilled, or a borrower with nothing of its own to
  // train spilled apart from its resident owner), or empty when they can. A resident owner may lend to a spilled
  // borrower: the borrower's unit reads the weight in the owner's home, and its gradient of it sums there.
  static std::string resident_shards_error(const ShardStore& store, const std::vector<int>& shards);
  // The shards `shards` names and those the ties' rule of resident_shards_error adds (the owners of the tied weights
  // they borrow, and each shard with nothing of its own to train that borrows from an owner among them), sorted.
  static std::vector<int> with_tied_owners(const ShardStore& store, const std::vector<int>& shards);
  // Why `shards` cannot be a spilled model's device-stepped shards beside `resident_shards` (out of range,
  // repeated, resident, with nothing to train, or a borrower with nothing of its own to train apart from the owner
  // of the tied weight it borrows: its step is the count alone, and its gradient is all the owner's), or empty when
  // they can.
  static std::string device_shards_error(const ShardStore& store, const std::vector<int>& resident_shards,
                                         const std::vector<int>& shards);
  // What the resident shards' homes take of the budget.
  static int64_t homes_need(const ShardStore& store, const std::vector<int>& shards);
  // The elements a visit of spilled `shard` holds beside `resident_shards`: its device layout, less a tail of tied
  // weights it borrows from resident owners (read in their homes).
  static int64_t visit_numel(const ShardStore& store, const std::vector<int>& resident_shards, int shard);
  // What the device-stepped shards' gradient buffers take of the budget, for good (keeps_gradient_buffer).
  static int64_t held_grads_need(const ShardStore& store, const std::vector<int>& shards,
                                 const std::vector<int>& resident_shards = {});
  // Whether `shard`, among the device-stepped `shards`, keeps its gradients in a buffer of its own for the run:
  // where a step sums several backwards (not ShardStore::steps_after_each_backward), where another shard borrows a
  // trainable tied weight from it (that backward's gradient waits there for the owner's), and where it borrows one
  // from a host-stepped owner (sends_borrowed_grads: its unit's region holds only the share that goes out). Else a
  // unit's gradients take an arena region, given back once its step has read them. The buffer spans the shard's
  // trainable weights: a borrowed weight's gradient is in its owner's.
  static bool keeps_gradient_buffer(const ShardStore& store, const std::vector<int>& shards, int shard,
                                    const std::vector<int>& resident_shards = {});
  // The shards owning a trainable tied weight that `shard` borrows (its gradient sums in theirs), each once.
  static std::vector<int> borrowed_grad_owners(const ShardStore& store, int shard);
  // Whether `shard`, among the device-stepped `shards`, borrows a trainable tied weight from a shard among neither
  // them nor `resident_shards`: its backward's gradient of that weight goes out to be summed on the host.
  static bool sends_borrowed_grads(const ShardStore& store, const std::vector<int>& shards, int shard,
                                   const std::vector<int>& resident_shards = {});
  // The regions one device step of `shard` brings in for its length: fp32 master, optimizer states and, in bf16,
  // the new weights' staging, aligned.
  static int64_t device_step_need(const ShardStore& store, int shard);
  // The working set of the spilled shards: the largest one's weights and gradients, aligned. With the frozen
  // `base` the model uses (DeviceEngine::add_base), a unit holds its base shard beside its own: the most a
  // shard needs of both (a resident shard's unit holds its base shard alone). A device-stepped shard's unit holds
  // its weights and, while its step runs, the step's regions (its gradients are in held_grads_need, or, where each
  // backward is followed by its step, beside its weights as a host-stepped shard's).
  static int64_t spilled_need(const ShardStore& store, const std::vector<int>& resident_shards,
                              const ShardStore* base = nullptr, const std::vector<int>& device_shards = {});
  // What a resident model's unit holds of its frozen `base` (none: 0): its largest shard, aligned.
  static int64_t base_shard_need(const ShardStore* base);
  // Arena bytes that cache the weights of every shard but the resident ones at once (each region aligned).
  static int64_t cached_need(const ShardStore& store, const std::vector<int>& resident_shards = {});

  bool resident() const override { return false; }
  bool homed(int shard) const override;
  bool frozen_base() const { return frozen_base_; }
  // A frozen base that a resident model uses: its shards, once copied in, are never evicted (DeviceEngine::allocate
  // passes them over). The resident model's kept autograd graphs hold tensors saved from their copies (a
  // transposed weight, say) from its forward until its backward, which must still find them there.
  void keep_cached() { kept_ = true; }
  bool kept_cached() const { return kept_; }
  // A frozen base's acquired shard: points `params` (one per entry of its layout, a user's own parameters)
  // at its weights on the device.
  void bind_frozen(int shard, const std::vector<at::Tensor>& params);
  const std::vector<int>& resident_shards() const { return resident_shards_; }
  const std::vector<int>& device_shards() const { return device_shards_; }
  bool device_stepped(int shard) const { return device_stepped_.at(shard); }
  // The first shard stepped on the host (neither homed nor device-stepped), or num_shards() where none is.
  int lowest_host_stepped() const;
  // Host memory its gradient copies land in now.
  int64_t landing_bytes() const { return landing_->host_bytes(); }
  void upload() override;
  void copy_home() override;
  void backward_done(int shard, bool step, double lr_scale, bool keep) override;
  std::shared_ptr<ClipNorm> clip_and_step(double max_norm, double lr_scale) override;
  void discard_grads() override;
  void free_device_memory(const Fence& issued) override;

  // For the engine's prefetch and eviction: a resident shard is never cached (nothing to evict) and always
  // current.
  bool cached(int shard) const { return weights_.at(shard).cached; }
  bool pinned(int shard) const { return pins(shard) > 0; }
  // A cached copy of the shard that no step has made stale since.
  bool current(int shard) const;
  // The steps a copy of the shard reads the result of are done.
  bool steps_done(int shard) const;
  // The next forward, visiting the shards in order, would wait for a step: a shard it reaches no later than the
  // first host-stepped one is neither current nor copyable yet. Resident and device-stepped shards in front of
  // that one do not end the search (a resident shard is always current; a device-stepped one's copy may be gone
  // and its step still running), and shards past it need not be looked at: a model's host steps run one after
  // another in the order they were queued, from the last shard down, so the first host-stepped shard's step is
  // the last of them to finish.
  bool next_step_waits() const;
  int64_t weight_bytes(int shard) const;
  // Copies the shard's weights in, after the steps they read; false when `need` allows no room for them.
  bool load(int shard, DeviceEngine::Need need);
  // Frees the shard's cached weights (once copies and compute reading them are done).
  void evict(int shard);
  // Brings in the shard unless a current copy is on the device or on its way (DeviceEngine::prefetch).
  void prefetch(int shard);
  // The shard's backward about to run ends its step: a device-stepped shard's master and optimizer states take
  // their room now (where the arena has it without waiting), and start coming in at issue_prefetched_state, beside
  // that backward's compute.
  void prefetch_state(int shard);
  // The copy prefetch_state made room for goes on the link now: after the weights the unit and the next ones need,
  // which would otherwise queue behind it (the state is needed only once the backward is done, and is several
  // times the weights' size).
  void issue_prefetched_state(int shard);
  // The unit prefetch_state was called for did not begin (its acquire failed): the state goes back.
  void forget_prefetched_state(int shard);

 protected:
  void make_computable(int shard, bool with_grads) override;
  void after_release(int shard) override;
  bool may_pin_again(int shard) const override { return frozen_base_ || homed(shard); }

 private:
  struct Weights {
    Region weights, grads;  // the cached weight copy, and a gradient buffer while backward runs
    Fence ready, last_use;
    bool cached = false;
    // Its gradient waits for clip_and_step, whose step will make this copy stale: not kept past its release.
    bool step_queued_next = false;
    // A device step queued on the step lane writes the new weights into this copy after everything issued on
    // the compute stream so far: its last use is that step (`ready`) until the compute is next ordered after it.
    bool device_step_queued = false;
    int64_t version = 0;  // of the store's shards it was copied from
  };
  void allocate_grads(int shard);
  // Copies `device_grad` out to a buffer of the model's landing ring, after everything issued on the compute stream
  // so far: leased by the copy into `*landing`, given back when the host job is done with it (or when both jobs are
  // gone, however they ended). While the model has none free, the lane copies other models' gradients that can land.
  using Landing = std::shared_ptr<std::unique_ptr<StagingRing::Lease>>;
  Fence land(const at::Tensor& device_grad, const Landing& landing);
  // backward_done for a host-stepped shard (spilled_model_host_steps.cpp): its gradient goes out to a staging
  // buffer, and a host job sums or keeps it and, with `step`, steps the shard.
  void send_gradients(int shard, bool step, double lr_scale, bool keep);
  // backward_done's part for a device-stepped shard that sends_borrowed_grads: its unit's region, which holds only
  // its gradients of the weights it borrows from host-stepped owners, goes out, and a host job adds them to the
  // owners' (ends_step `step`), as a host-stepped borrower's would be.
  void send_borrowed_grads(int shard, bool step);
  // The shard's optimizer step over its accumulated (or kept) gradients, queued on the model's host jobs after
  // `norm`: scaled by it, or skipped where it is not finite.
  void step(int shard, std::shared_ptr<const ClipNorm> norm, double lr_scale);
  int64_t input_version(int shard) const;  // of what a copy of the shard reads
  std::vector<Fence> pending_steps(int shard) const;
  at::Tensor grad_view(int shard) const;
  // clip_and_step for a model with resident or device-stepped shards: their gradients are on the device, so the
  // norm is taken here once every gradient job is done, and each shard steps where it lives.
  std::shared_ptr<ClipNorm> clip_and_step_here(double max_norm, double lr_scale);
  // Device-stepped shards (spilled_model_device_steps.cpp). Their gradient buffers (keeps_gradient_buffer), made
  // at the first use.
  bool holds_grads(int shard) const { return holds_grads_[shard]; }
  void upload_held_grads();
  at::Tensor held_grads(int shard) const;
  // The shard's optimizer step on the device over its gradients, scaled by `grad_scale`: master and states
  // copied in (after the shard's last step went home) unless prefetch_state brought them, stepped on the step lane
  // once they have landed, copied home with the new weights; a cached copy of its weights takes them too.
  void device_step(int shard, double grad_scale, double lr_scale);
  // Where a device step's master and states are on the device: its regions and their copy in.
  struct StateVisit {
    std::vector<Region> regions;
    at::Tensor master, shadow;  // shadow: the new bf16 weights (bf16 only)
    std::vector<at::Tensor> states;
    Fence in;
    // Room taken, copy not submitted yet (bring_state's `defer`): what the copy will wait for.
    bool deferred = false;
    std::vector<Fence> waiting;
    bool in_use() const { return !regions.empty(); }
  };
  // Starts the copy of the shard's master and states to the device, unless it is on its way (or, with `defer`, only
  // takes their room: submit_state then). Without `must` (a prefetch) takes no room that needs more than evicting
  // cached weights, and returns false where there is none.
  bool bring_state(int shard, bool must, bool defer = false);
  // Submits a deferred visit's copy (an urgent one where `must`: the step waits for it now).
  void submit_state(int shard, bool must);
  // Gives back a visit that no step used (its regions, once `issued` is done).
  void drop_state(int shard, const Fence& issued);
  void free_held_grads(const Fence& issued);
  std::vector<Weights> weights_ = std::vector<Weights>(store().num_shards());
  std::vector<int64_t> visit_numel_ = std::vector<int64_t>(store().num_shards());  // visit_numel, per shard
  std::vector<int> resident_shards_;
  std::vector<int> device_shards_;
  std::vector<bool> device_stepped_ = std::vector<bool>(store().num_shards());
  // Per shard, as the store said when the model was added (which its budget counted: a later change of
  // steps_after_each_backward does not move them): it keeps a gradient buffer (keeps_gradient_buffer); and, where it
  // borrows trainable tied weights from device-stepped owners, those owners (its gradients of them go to their
  // buffers, whichever way it is stepped).
  std::vector<bool> holds_grads_ = std::vector<bool>(store().num_shards());
  std::vector<std::vector<int>> device_grad_owners_ = std::vector<std::vector<int>>(store().num_shards());
  std::vector<bool> sends_borrowed_ = std::vector<bool>(store().num_shards());  // sends_borrowed_grads
  std::vector<Region> held_grads_;  // per shard once uploaded: a device-stepped shard's gradient buffer
  std::vector<StateVisit> state_visits_ = std::vector<StateVisit>(store().num_shards());
  std::vector<Fence> held_grads_ready_ = std::vector<Fence>(store().num_shards());  // after the step that zeroes them
  const bool frozen_base_;
  bool kept_ = false;
  std::vector<bool> homed_ = std::vector<bool>(store().num_shards());
  ShardHomes homes_;
  // The host-stepped shards' gradient copies land here, the model's own: another model's host steps falling
  // behind never hold its copies up.
  std::shared_ptr<StagingRing> landing_;
};

}  // namespace hydra::engine
