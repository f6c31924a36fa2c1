// Host-side training state of one model, one flat buffer family per shard.
//
// Each shard's parameters are packed into one contiguous fp32 master buffer with a gradient buffer, the
// optimizer's state buffers and, for bf16 training, a bf16 shadow that is what travels to the device.
// A parameter shared by several shards (tied weights) is stored once, by the lowest-numbered shard that
// uses it: backward runs from the last shard to the first, so by the time the owner's gradients are in,
// every borrower's contribution has been added and the owner's optimizer step sees their sum.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <exception>
#include <future>
#include <mutex>
#include <vector>

#include "engine/fence.h"
#include "engine/loss_gate.h"
#include "engine/optimizer_spec.h"
#include "engine/optimizer_step.h"

namespace hydra::engine {

// One parameter's place in a shard. Offsets count elements; every offset is aligned to kAlignElements.
struct ParamEntry {
  at::Tensor param;       // the user's Parameter: its data is rebound, the object stays the same
  int owner;              // shard whose master buffer holds it
  int owner_index;        // its entry's index in the owner's layout: where its step count and gradient note are
  int64_t master_offset;  // in the owner's master buffer
  int64_t device_offset;  // in this shard's device buffers (owned first, borrowed after)
  int64_t numel;
  bool trainable;
  at::ScalarType original_dtype;
};

class ShardStore {
 public:
  static constexpr int64_t kAlignElements = 16;

  // Copies the parameters' current values; the user's modules are not modified until `bind`.
  ShardStore(const std::vector<std::vector<at::Tensor>>& shard_params, OptimizerSpec optimizer, bool bf16,
             bool pin_memory);

  // Bytes on a device of parameters of these sizes laid out as a shard is (each padded to kAlignElements), in
  // the compute dtype: what a planner counts for a piece of a model before any store exists.
  static int64_t device_bytes(const std::vector<int64_t>& numels, bool bf16);

  int num_shards() const { return static_cast<int>(layouts_.size()); }
  const std::vector<ParamEntry>& layout(int shard) const { return layouts_.at(shard); }
  // The shards whose transfer sources a copy of `shard` to a device reads: itself, then each distinct owner
  // of a parameter it borrows (a tied weight).
  const std::vector<int>& sources(int shard) const { return sources_.at(shard); }
  const OptimizerSpec& optimizer() const { return optimizer_; }
  bool bf16() const { return bf16_; }
  // Whether each backward of a shard is followed by its step: no micro-batches summed into one step, no clipped step
  // waiting for every shard's gradients. A device-stepped shard's gradients then take device memory only from its
  // backward to its step (SpilledModel), not for the whole run. A model added to a device keeps what this said then
  // (its budget counted it).
  bool steps_after_each_backward() const { return steps_after_each_backward_; }
  void set_steps_after_each_backward(bool steps) { steps_after_each_backward_ = steps; }
  bool pinned() const { return pinned_; }
  at::ScalarType compute_dtype() const;
  // Bytes of one element in the compute dtype: what weights and gradients take on the device.
  static int64_t element_bytes(bool bf16) { return bf16 ? 2 : 4; }
  int64_t element_bytes() const { return element_bytes(bf16_); }

  int64_t owned_numel(int shard) const { return owned_numel_.at(shard); }
  int64_t trainable_numel(int shard) const { return trainable_numel_.at(shard); }
  // The device layout's prefix that holds every trainable gradient (owned and borrowed): what a spilled shard's
  // gradient copy moves. Frozen parameters sorted to the end of the owned part are never copied back.
  int64_t gradient_numel(int shard) const { return gradient_numel_.at(shard); }
  // The owners whose tied weights' gradients sum on the device, in a buffer of the owner's there (a device-stepped
  // owner, SpilledModel): a borrower's gradient that lands on the host holds nothing of theirs, and
  // accumulate_borrowed passes them over. Set where the model is placed (replacing what was set); none at first.
  // Each flag is atomic: the engines of several devices place a model at once, and host jobs read them.
  void set_summed_on_device(const std::vector<int>& owners);
  bool summed_on_device(int owner) const { return summed_on_device_.at(owner).load(std::memory_order_acquire); }
  // The device layout's prefix holding the trainable gradients that sum on the host: the owned ones, and the
  // borrowed ones whose owner's do not sum on the device. What a host-stepped shard's gradient copy moves.
  int64_t host_gradient_numel(int shard) const;
  int64_t device_numel(int shard) const { return device_numel_.at(shard); }
  int64_t total_owned_numel() const;
  int64_t total_trainable_numel() const;  // what has optimizer state

  at::Tensor& master(int shard) { return master_.at(shard); }
  // The shard's fp32 gradient accumulator, allocated (zeroed) at its first use. Only a shard that sums several
  // gradients before a step needs one: micro-batches, clipping (every shard's gradient waits for the norm), or
  // a parameter another shard borrows (a tied embedding). Otherwise the step reads the gradient where it
  // landed, and the 4 bytes a parameter of an accumulator are never spent. It spans the trainable range only
  // (as do kept() and the optimizer states): a frozen parameter's host state is its master weights alone.
  at::Tensor& grad(int shard);
  bool has_grad(int shard) const { return grad_.at(shard).defined(); }
  // In bf16, the shard's one gradient of a step, kept as it landed (bf16) until the step: with clipping and
  // one micro-batch a step, every shard's step waits for the global norm but sums nothing, so 2 bytes a
  // parameter hold it instead of an fp32 accumulator's 4. A shard that has an accumulator uses it instead (the
  // owner of a borrowed parameter sums the borrowers' gradients). Allocated at its first use.
  at::Tensor& kept(int shard);
  bool has_kept(int shard) const { return kept_.at(shard).defined(); }
  // bf16, one micro-batch a step, no clipping: a borrower's gradient of a tied parameter is the first of the
  // two its owner's step sums. It waits as it landed, in the owner's kept buffer (2 bytes a parameter), instead
  // of in an fp32 accumulator (4); the owner's step sums it with its own as the accumulator would (see
  // step_ranges_summing). Only where every trainable parameter has at most one borrower: a third gradient
  // would have to be summed in bf16, or wait in fp32.
  bool keeps_borrowed_as_landed() const { return keeps_borrowed_as_landed_; }
  // The owned parameters of `shard` whose borrower's gradient is waiting in kept(shard), as [offset, offset +
  // numel) of its master layout; forgets them (the shard's step is summing them now).
  std::vector<std::pair<int64_t, int64_t>> take_borrowed_spans(int shard);
  // Where the shard's gradient of its pending step is: its accumulator if it has one, else the kept gradient.
  at::Tensor& pending_grad(int shard) { return has_grad(shard) || !has_kept(shard) ? grad(shard) : kept(shard); }
  // What the shard's host buffers hold now, in bytes: master, accumulator, kept gradient, optimizer states,
  // shadow.
  int64_t host_bytes() const;
  at::Tensor& state(int shard, int k) { return state_.at(shard).at(k); }
  // Moves the shards' fp32 masters and optimizer states into pinned memory, one block for all of them, values kept,
  // where the store pins what crosses to the device: a device-stepped shard's state crosses both ways every step,
  // and a copy from pageable memory is staged through a bounce buffer and holds its lane's thread until it is done.
  // Before the shards' first step (nothing may be reading the buffers it replaces); a shard moved already is left
  // as it is; a no-op where pinning turns out impossible.
  void pin_states(const std::vector<int>& shards);
  // What is copied to the device: the bf16 shadow when training in bf16, else the master.
  at::Tensor& transfer_source(int shard) { return bf16_ ? shadow_.at(shard) : master_.at(shard); }
  at::Tensor& shadow(int shard) { return shadow_.at(shard); }

  // Optimizer steps the shard has been through, whether or not any of its parameters received a gradient.
  int64_t steps_taken(int shard) const { return steps_.at(shard); }
  // Every shard has been through `steps` steps: the task's count, where this store carries on from another (a
  // checkpoint resumed, a re-plan's new cut). Before any step is taken here.
  void set_steps_taken(int64_t steps);
  // Steps one owned parameter (entry `index` of the shard's layout) has taken: only those of steps in which it
  // received a gradient, as torch.optim, which skips a parameter whose .grad is None.
  int64_t param_steps(int shard, int index) const { return param_steps_.at(shard).at(index); }

  // A gradient of the parameter at entry `index` of `owner`'s layout came in, through any shard that uses it
  // (a tied weight through its borrowers too), in any micro-batch since the owner's last step. Called by the
  // thread issuing the model's units, as take_step is.
  void note_gradient(int owner, int index) { received_.at(owner).at(index) = 1; }
  // Forgets the gradients noted since the last step (a failed micro-batch must not leak into one).
  void forget_gradients();
  // Starts one optimizer step of the shard, at its submission: the ranges of its flat buffers to update, each
  // with its parameters' step number. A parameter that received no gradient since the last step is left out
  // and keeps its step count, as torch.optim leaves it. When every trainable parameter received one (the usual
  // case) the step is one range over all of them. Resets the notes for the next step.
  std::vector<StepRange> take_step(int shard);
  // Takes back the counts of a step taken with take_step that was then skipped (its loss gate closed, or its
  // clipped step's norm was not finite): the shard's and its parameters' step counts are as before it. From the
  // host job that skipped it; the issuing thread takes no step of the model after that (the task stops), but
  // may still be taking this step for lower shards (clip_and_step queues them one by one): each touches only
  // its own shard's counts.
  void undo_step(int shard, const std::vector<StepRange>& ranges);

  // The gate of the step in progress: the loss of its latest micro-batch (see LossGate). Set by the thread
  // issuing the model's units, on whichever device computes the loss; read when a shard's step is submitted,
  // on any device, so it lives with the model's state rather than in one device's engine.
  void set_loss_gate(std::shared_ptr<const LossGate> gate) { loss_gate_ = std::move(gate); }
  std::shared_ptr<const LossGate> loss_gate() const { return loss_gate_; }
  // Bumped when a step of the shard is submitted: a device copy of an older version is stale.
  // Atomic: one device's thread bumps what another device's prefetch reads.
  int64_t version(int shard) const { return versions_.at(shard).load(std::memory_order_acquire); }
  void bump_version(int shard) { versions_.at(shard).fetch_add(1, std::memory_order_acq_rel); }

  // The shard's last submitted host step: a copy to any device reads the transfer source only after it.
  Fence last_step(int shard) const {
    std::lock_guard<std::mutex> lock(step_mutex_);
    return last_steps_.at(shard);
  }
  void set_last_step(int shard, Fence step) {
    std::lock_guard<std::mutex> lock(step_mutex_);
    last_steps_.at(shard) = std::move(step);
  }

  // Copies to a device still reading the shard's transfer source (its own loads, and those of shards that
  // borrow one of its parameters): a step of the shard rewrites that buffer only after them.
  void add_reader(int shard, Fence copy) {
    std::lock_guard<std::mutex> lock(step_mutex_);
    auto& readers = readers_.at(shard);
    std::erase_if(readers, [](const Fence& f) { return f.ready(); });
    readers.push_back(std::move(copy));
  }
  std::vector<Fence> readers(int shard) const {
    std::lock_guard<std::mutex> lock(step_mutex_);
    return readers_.at(shard);
  }

  // The model's host jobs (gradient accumulation and optimizer steps, submitted by any of its devices) wait for the
  // jobs queued before them that touch the same shards: a job of `shards` (a shard and the owners of the parameters
  // it borrows, see sources) for the last job of each of them, a job of every shard (`shards` empty: a clipped
  // step's norm, synchronize) for the last job of all. Returns what the new job (`next`) waits for and records it.
  // Callers hold a lock that also covers the enqueue, so the order is one global order and every job waits only
  // for jobs queued before it. Jobs of different shards may then run out of submission order (the host-step
  // threads take the one the next forward needs first, see HostWorker), never two of one model at once.
  std::vector<std::shared_future<void>> exchange_last_jobs(const std::vector<int>& shards,
                                                          const std::shared_future<void>& next);
  // The chain those jobs make on the host-step worker (HostWorker::submit_chained): one number per store.
  int64_t host_chain() const { return host_chain_; }
  // The first error among the model's host jobs, kept for the jobs after it: a clipped step's norm must not be
  // taken over gradients that a failed job left incomplete (the chain goes on after a failure, see
  // DeviceModel::submit). Null while none has failed.
  void note_failed_job(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(step_mutex_);
    if (!failed_job_) failed_job_ = std::move(error);
  }
  std::exception_ptr failed_job() const {
    std::lock_guard<std::mutex> lock(step_mutex_);
    return failed_job_;
  }

  // Adds a shard's device-layout gradient (host-visible, compute dtype) into the master gradients:
  // the owned part in one pass, each borrowed parameter into its owner's buffer.
  void accumulate_grads(int shard, const at::Tensor& device_layout_grad);
  // Only the borrowed parameters' part of it, into their owners' accumulators (the owned part is stepped from
  // where it landed), but those of owners summed_on_device. `ends_step`: this micro-batch ends the step, and where
  // the owner has no accumulator and keeps_borrowed_as_landed(), the part waits in the owner's kept buffer instead.
  // `first`: the device layout's element that the gradient's first is (a device-stepped shard sends only its
  // borrowed part, from owned_numel on).
  void accumulate_borrowed(int shard, const at::Tensor& device_layout_grad, bool ends_step = false,
                           int64_t first = 0);
  // The owned part into the kept gradient (see kept), the borrowed part into the owners' accumulators.
  void keep_grads(int shard, const at::Tensor& device_layout_grad);
  // One owned parameter's host training state, for checkpoints: the parameter, views shaped like it of its
  // fp32 master value and of its optimizer states (none when it is frozen), and its own step count.
  struct ParamState {
    at::Tensor param, master;
    std::vector<at::Tensor> states;
    int64_t steps;
  };
  // Every parameter once (a tied one under its owner). Current only when no step is pending (after
  // DeviceEngine::snapshot or before training). Writing into the views restores a checkpoint; refresh_shadow()
  // then.
  std::vector<ParamState> param_states();
  // Sets an owned parameter's own step count (a restored checkpoint). Throws if the store does not hold it.
  void set_param_steps(const at::Tensor& param, int64_t steps);
  // Gives a parameter its group's learning rate and weight decay (torch.optim's param_groups) instead of the
  // optimizer's, before training. Throws if the store does not hold it.
  void set_param_options(const at::Tensor& param, double lr, double weight_decay);
  // After the master values were overwritten: the bf16 copies that travel to the device follow them.
  void refresh_shadow();

  // Points every parameter at a host tensor of its own holding the master value in its original dtype,
  // and drops the gradients: the user's modules come back as plain PyTorch modules, ties intact.
  void write_back();

 private:
  OptimizerSpec optimizer_;
  bool bf16_;
  bool pinned_;
  bool steps_after_each_backward_ = false;
  std::vector<std::vector<ParamEntry>> layouts_;
  std::vector<std::vector<int>> sources_;
  std::vector<int64_t> owned_numel_, trainable_numel_, device_numel_, gradient_numel_, steps_;
  // Per shard, per entry of its layout (only owned, trainable ones are used): whether a gradient came in
  // since the shard's last step, and the parameter's own step count.
  std::vector<std::vector<uint8_t>> received_;
  std::vector<std::vector<int64_t>> param_steps_;
  // Per shard, per owned entry: a borrower's gradient of it waits in kept (keeps_borrowed_as_landed).
  std::vector<std::vector<uint8_t>> borrowed_waiting_;
  std::vector<std::atomic<bool>> summed_on_device_;  // per shard: set_summed_on_device
  bool keeps_borrowed_as_landed_ = false;
  // Per shard, per entry: its learning rate and weight decay (the optimizer's unless set_param_options).
  struct ParamOptions {
    double lr;
    double weight_decay;
  };
  std::vector<std::vector<ParamOptions>> options_;
  // The owned entry holding `param`: (shard, index); throws naming `what` if there is none.
  std::pair<int, size_t> owned_entry(const at::Tensor& param, const char* what) const;
  std::vector<std::atomic<int64_t>> versions_;
  std::shared_ptr<const LossGate> loss_gate_;
  std::vector<std::shared_future<void>> last_jobs_;  // per shard: its last host job (exchange_last_jobs)
  static inline std::atomic<int64_t> chains_{0};
  const int64_t host_chain_ = chains_++;
  std::exception_ptr failed_job_;
  mutable std::mutex step_mutex_;
  std::vector<Fence> last_steps_;
  std::vector<std::vector<Fence>> readers_;
  // The transfer sources of all shards are one block when pinned (host_buffers), and pin_states's shards another.
  std::vector<at::Tensor> master_, grad_, kept_, shadow_;
  std::vector<uint8_t> state_pinned_;  // per shard: pin_states moved its master and states
  std::mutex pin_mutex_;  // the engines of several devices add a model at once, each pinning its states
  std::vector<std::vector<at::Tensor>> state_;
};

}  // namespace hydra::engine
