// Everything one compute device does for the models that train on it: where each shard's training state
// lives, copies in and out, rebinding module parameters, and the optimizer steps. This class is the facade and
// owns what the device's models share (memory, copy lanes, host-step threads, the plan); each model is a
// ResidentModel or a SpilledModel (engine/device_model.h), which do the per-model work.
//
// A model is *resident* on the device when all of its training state (weights, gradients, optimizer state)
// fits in what the budget has left: then nothing is copied after the first upload and steps run on the
// device. Otherwise it is *spilled*: weights and gradients visit the device around each shard's compute,
// copies overlap other compute (prefetch), the optimizer runs on the host as soon as a shard's gradients
// arrive, and weight copies stay cached while the budget allows, evicted by furthest next use.
//
// Three kinds of work run beside the compute, none waiting for another unless it reads its result: weight
// copies in (the host-to-device lane), gradient copies out (the device-to-host lane, into each model's own
// landing buffers; a gradient region is free again as soon as its copy is done) and host jobs (accumulation and optimizer steps, on host-step
// threads shared by every device and ordered per model). A weight copy waits only for the step of the shard
// it reads; a step waits for its gradient copy and for copies still reading the weights it rewrites.
//
// Call order per shard visit, from the thread that issues the compute (DeviceLoop's begin and end make these
// calls for a device's worker):
//   plan(...) -> acquire(model, shard, with_grads) -> prefetch_ahead() -> compute -> [watch_loss]
//   -> [backward_done] -> release
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "engine/clip_norm.h"
#include "engine/copy_lane.h"
#include "engine/device_pool.h"
#include "engine/host_pace.h"
#include "engine/host_worker.h"
#include "engine/shard_store.h"
#include "engine/step_log.h"

namespace hydra::engine {

class DeviceModel;
class SpilledModel;

struct EngineStats {
  int64_t budget_bytes = 0;
  int64_t capacity_bytes = 0;
  int64_t high_water_bytes = 0;
  int64_t host_to_device_bytes = 0;
  int64_t device_to_host_bytes = 0;
  int64_t host_to_device_copies = 0;
  int64_t device_to_host_copies = 0;
  // Where the time beside the compute goes (spilled models), in seconds summed over jobs: host jobs
  // (gradient accumulation and optimizer steps), and each copy lane's thread copying (on a CPU device, at
  // the emulated link's pace) or issuing copies (on a GPU).
  int64_t host_steps = 0;
  int64_t device_steps = 0;  // of device-stepped shards (resident shards' steps are not counted)
  double host_step_seconds = 0.0;
  int64_t host_step_bytes = 0;  // host memory the host jobs touched (gradients, masters, optimizer states)
  double grad_copy_seconds = 0.0;
  double weight_copy_seconds = 0.0;
  double device_step_seconds = 0.0;  // the step lane's thread issuing device steps (on a CPU device: running them)
  // Shards acquire() had to copy in itself (no prefetch had brought them), and the host time acquire()
  // took to make a spilled shard computable (its weights in, room for its gradients): on a CPU device every
  // wait for a copy; on a GPU the compute stream waits for copies instead, so only waits for memory count.
  int64_t acquire_loads = 0;
  double acquire_wait_seconds = 0.0;
  double grad_wait_seconds = 0.0;  // of which: room for the gradients (earlier gradients still copying out)
  // Host memory the gradient copies land in now (every spilled model's landing buffers), in bytes.
  int64_t staging_bytes = 0;
};

class DeviceEngine {
 public:
  // `host_steps`: the host-step threads, shared by the devices of one run (null: one thread of its own).
  // `link_bytes_per_second` paces a CPU device's copies like a PCIe link (0: memory speed); see CopyLane.
  // `host_pace`: an emulated host memory bandwidth the host jobs of every device of a run share (null: the
  // machine's own); see HostPace.
  DeviceEngine(c10::Device device, int64_t budget_bytes, std::shared_ptr<HostWorker> host_steps = nullptr,
               double link_bytes_per_second = 0.0, std::shared_ptr<HostPace> host_pace = nullptr);
  ~DeviceEngine();

  // kAuto: resident if its whole state fits what the budget has left, else spilled; kResident: resident or
  // an error; kSpilled: spilled (a model that may run on several devices must be spilled on all of them).
  enum class Residency { kAuto, kResident, kSpilled };
  // Validates that the model can train within what the budget has left and registers it, resident or spilled
  // as `residency` says. Throws, changing nothing, when even its largest shard cannot fit (or, for kResident,
  // its whole state). Returns the model's id on this device. A model added after training started (a task
  // arriving) is spilled, within the arena already sized. Which device a run's model is resident on is
  // place_models' choice (engine/placement.h).
  // `task`: the scheduler's id of the model's task (-1: none), by which DeviceLoop finds the model (model_of).
  // `resident_shards` (kSpilled only, before training starts): shards of the spilled model whose whole state
  // lives on this device and steps here (see SpilledModel); the model then trains on this device alone.
  // `base`: the frozen base (add_base) the model uses, whose shard each of its units holds beside its own (counted
  // in its working set); use_base then names the model's parameters the base binds.
  // `device_shards` (kSpilled only, before training starts): shards of the spilled model stepped on this device
  // (see SpilledModel), whose gradient buffers stay here; the model then trains on this device alone.
  int add_model(std::shared_ptr<ShardStore> store, Residency residency = Residency::kAuto, int task = -1,
                std::vector<int> resident_shards = {}, int base = -1, std::vector<int> device_shards = {});
  // Registers the frozen weights that several models share (a sweep's pretrained base) as a model of their own:
  // `store` holds them once on the host, cut as its users are (its shard s is the shared weights of each
  // user's shard s), with nothing trainable. On the device each of its shards is copied in, cached and evicted
  // as a spilled model's is, once for all its users: a unit of a user holds its base shard beside its own, and
  // the plan's visits of every user count as the base shard's next uses. Its users' working sets make room for
  // it (add_model's `base`). Returns its id.
  int add_base(std::shared_ptr<ShardStore> store);
  // The store of base `base`; throws unless it is a base added here and not released.
  const ShardStore& base_store(int base);
  // Model `model`, added with `base`, binds `params[s]` (its own parameters that base shard s holds, one per
  // entry of its layout) to the base's copy in its units. Throws, changing nothing, when they do not match.
  void use_base(int model, int base, std::vector<std::vector<at::Tensor>> params);
  // The model added for the scheduler's task `task` and not released since; -1 when there is none.
  int model_of(int task) const;
  bool resident(int model) const;
  // The shards whose whole state lives on this device: all of a resident model's, a spilled one's resident
  // shards (empty for a released model).
  std::vector<int> resident_shards(int model) const;
  // A spilled model's device-stepped shards (empty for any other, or a released one).
  std::vector<int> device_shards(int model) const;
  // Models will arrive after training starts: the arena takes the whole budget when it is made, not just
  // what the models added by then could use, so that they have room. Before training starts.
  void expect_arrivals();
  // Keeps `bytes` of what the budget has left outside the arena (a resident model's autograd graphs, which
  // live beside it while its micro-batch is in flight): the arena, and so every later model, gets that much
  // less. Before training starts; throws, changing nothing, when the budget has not that much left.
  void keep_outside_arena(int64_t bytes);
  // The smallest budget a spilled model needs: its largest shard's weights and gradients at once.
  static int64_t min_spilled_bytes(const ShardStore& store);
  static int64_t resident_bytes(const ShardStore& store);
  // What add_model checks against the budget: the above plus the arena's alignment of each region.
  static int64_t spilled_need(const ShardStore& store);
  static int64_t resident_need(const ShardStore& store);

  // The shard visits expected next on this device, in order, replacing the previous plan; eviction looks
  // ahead through it and each acquire consumes its visit.
  void plan(const std::vector<std::pair<int, int>>& visits);
  void plan(int model, const std::vector<int>& shards);
  void prefetch(int model, int shard);
  // Brings in the planned shards in plan order: the first one not on the device as prefetch() does, then
  // others into free memory only, while at most `max_bytes` are on their way (< 0: as far as the budget
  // allows; 0: the first only). A shard whose step is
  // still running on the host is skipped: its copy would wait for the step and hold up every copy behind it.
  void prefetch_ahead(int64_t max_bytes = -1);
  void acquire(int model, int shard, bool with_grads);
  // Before acquire: the shard's backward about to run ends the model's step (no clipping), so a device-stepped
  // shard's master and optimizer state take their room while the arena's working room is whole (the shard's
  // weights, placed first, would split it: SpilledModel::prefetch_state); their copy starts at issue_step_prefetch.
  void prefetch_step(int model, int shard);
  // After acquire and prefetch_ahead: the state prefetch_step made room for starts coming in, behind the weights the
  // compute needs first.
  void issue_step_prefetch(int model, int shard);
  // The acquire after prefetch_step failed: what it prefetched is given back.
  void forget_step_prefetch(int model, int shard);
  // The model's next forward would wait for a step still running: the weights of a shard it visits first are not
  // on the device and cannot be copied yet (SpilledModel::next_step_waits). False for a resident model.
  bool next_step_waits(int model);
  void release(int model, int shard);
  // The shard's backward for this micro-batch is issued. Gradients are accumulated; with `step` the shard's
  // optimizer step follows (on the host for spilled models, overlapping the compute of other shards), unless
  // the loss gate set by watch_loss is closed (a non-finite loss): then it is skipped. A step updates only the
  // parameters that received a gradient since the last one, through the shard's own use or another's (a tied
  // weight), in any micro-batch: the others keep their values, state and step count, as torch.optim leaves a
  // parameter whose .grad is None. The step's learning rate is the optimizer's times
  // `lr_scale` (the task's schedule at this step).
  // `keep` (bf16, spilled): this is the shard's only gradient of a step that clip_and_step will take: it is
  // kept as it landed (ShardStore::kept) rather than summed into an fp32 accumulator.
  void backward_done(int model, int shard, bool step, double lr_scale = 1.0, bool keep = false);
  // The micro-batch's loss, just computed on this device: the gate of the step it ends (see LossGate), which
  // steps of the model submitted from now on read, on any device. Returns it, for the caller to read the value
  // once the backward is issued.
  std::shared_ptr<LossGate> watch_loss(int model, const at::Tensor& loss);
  // Global-norm clipping: after backward_done(step=false) on every shard, scales all gradients so their
  // norm is at most max_norm (as torch.nn.utils.clip_grad_norm_) and steps every shard. Returns the norm (see
  // ClipNorm): a spilled model's is summed by a host job once its gradients have landed, and this returns at
  // once; a resident model's is known on return. Where it is not finite no shard steps, the gradients are
  // forgotten and the weights stay those of the last completed step. Host gradients' squares are summed in
  // double (engine/gradient_norm.h), the same on any machine.
  std::shared_ptr<ClipNorm> clip_and_step(int model, double max_norm, double lr_scale = 1.0);
  // Forgets the gradients accumulated since the last step (a failed micro-batch must not leak into one).
  void discard_grads(int model);
  // Waits for all of the model's queued host jobs, on every device (they form one chain), and the copies
  // queued here, rethrowing the first error among them.
  void synchronize(int model);
  // Brings the model's whole training state up to date in its ShardStore, for a checkpoint: waits for its
  // host jobs (synchronize) and copies a resident model's device state home. Training goes on afterwards.
  void snapshot(int model);
  // Brings device-resident state home and points the user's parameters at host tensors again; does so
  // even when a queued job failed, then rethrows that job's error.
  void finish(int model);

  // After finish() (on the device that finished it) or synchronize(): frees everything the model holds on this
  // device (cached shards, resident state, its share of the budget) and drops this engine's reference to its
  // store. Its id stays taken; nothing may be asked of it afterwards. For a task that ended while others train.
  void release_model(int model);

  EngineStats stats() const;
  int64_t host_to_device_bytes() const { return stats_.host_to_device_bytes; }
  // What the budget has left after the models added so far (their resident state or spilled working set).
  int64_t free_bytes() const { return pool_.budget() - resident_committed_ - spilled_reserve_; }
  // What a model's working set and device steps may share now: the arena (the budget before it is sized, as
  // add_model counts it) less the resident state, homes and held gradients committed.
  int64_t uncommitted_bytes() const {
    return (pool_.started() ? pool_.capacity() : pool_.budget()) - resident_committed_;
  }
  // How many times each of the model's shards was copied to the device.
  std::vector<int64_t> shard_loads(int model) const;
  // Every optimizer step of a shard this device ran or handed to the host so far (engine/step_log.h), and the
  // scheduler's task of a model added here (-1: added without one), released or not.
  std::vector<StepRecord> step_log() const { return step_log_.records(); }
  int task_of(int model) const;

 private:
  friend class DeviceModel;
  friend class ResidentModel;
  friend class SpilledModel;
  friend class ShardHomes;
  static int64_t key(int model, int shard) { return (static_cast<int64_t>(model) << 32) | shard; }
  DeviceModel& model_at(int model) const;  // throws for a model never added
  DeviceModel& live(int model);         // throws for a released model
  DeviceModel& live(int model, int shard);  // and for a shard it does not have
  SpilledModel* spilled(int model) const;  // null for a resident or released model
  c10::Stream compute_stream() const;
  Fence compute_point() const;  // everything issued so far on the compute stream
  // How hard an allocation tries: a prefetch of the next planned visit only displaces shards needed later
  // than its own (Belady); one further ahead only takes free memory and leaves room for a shard's gradients
  // (plans change as the cost model learns: evicting for them copied more than it saved); an allocation for
  // the shard about to compute evicts any unpinned shard, and `kMust` fails loudly.
  enum class Need { kPrefetchAhead, kPrefetch, kEvictAny, kMust };
  // Device memory for the shard, evicting spilled models' cached shards by furthest next use as `need` allows.
  Allocation allocate(int model, int shard, int64_t bytes, Need need);
  void start();  // on first use (and after a failed upload): uploads every resident model
  // The arena need not exceed what all models could ever hold: resident state, or every spilled weight cached
  // plus one shard's working set.
  void size_arena();
  // The base shard a unit of `model` on `shard` holds beside its own, or null.
  struct BaseUse {
    int base;
    std::vector<std::vector<at::Tensor>> params;  // per base shard, the model's own parameters it binds (use_base)
  };
  const BaseUse* base_use(int model, int shard) const;
  // A host job that began at `start_ns` (steady clock) and touched `bytes` of host memory ends: paced by the
  // emulated host bandwidth, if any, and counted. On a host-step thread.
  void count_host_job(int64_t bytes, int64_t start_ns);

  c10::Device device_;
  bool has_streams_;
  DevicePool pool_;
  std::vector<std::unique_ptr<DeviceModel>> models_;
  std::deque<int64_t> upcoming_;
  std::unordered_map<int, int> task_models_;  // scheduler task id -> model id
  std::unordered_map<int, int> model_tasks_;  // model id -> scheduler task id, kept after the model's release
  std::unordered_map<int, BaseUse> base_uses_;  // model id -> the frozen base it uses
  int64_t resident_committed_ = 0;  // the resident models' whole state, and spilled models' resident shards'
  int64_t spilled_reserve_ = 0;     // a unit's largest working set: a spilled shard's weights, gradients, base shard
  int64_t grad_headroom_ = 0;       // the largest gradient region of a spilled model
  bool arrivals_ = false;           // see expect_arrivals()
  bool uploads_pending_ = false;    // a resident model is not on the device yet (start() uploads it)
  EngineStats stats_;
  StepLog step_log_;  // written by every thread that runs a step
  // Written by host-step threads, read by stats(): kept apart from stats_, which only the caller's thread touches.
  std::atomic<int64_t> host_steps_done_{0}, host_step_ns_{0}, host_step_bytes_{0};
  std::shared_ptr<HostPace> host_pace_;
  // Destroyed in reverse order: the lanes first (they finish their copies), then what their jobs use.
  std::shared_ptr<HostWorker> host_steps_;
  CopyLane to_device_, to_host_;
  // Device-stepped shards' steps, each once its state has landed: the compute stream never waits for that copy.
  CopyLane steps_;
};

}  // namespace hydra::engine
