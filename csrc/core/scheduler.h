// SHARP scheduler: hands each device's worker thread the next unit of some task, under a policy.
//
// A task's units run strictly in order, one at a time: a task handed out by next() is `running` until
// its unit is complete()d, and only then can any device get its following unit. Between two units the
// task may move to another device (unless TaskSpec::device pins it), and a device may switch to another
// task after every unit: that alternation is what keeps every device busy with >= G tasks.
//
// Tasks may arrive while it runs (add_task, with set_open(true) so that idle workers wait for them rather than
// end), and fail() drops a task's remaining units at once.
//
// Thread-safe: one mutex guards everything and one condition variable wakes waiting workers. Decisions
// are O(num_tasks) plus the cost model's O(num_shards) cache refresh of the task just completed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "core/cost_model.h"
#include "core/policy.h"
#include "core/saved_bytes_gate.h"
#include "core/unit.h"

namespace hydra::core {

class Scheduler {
 public:
  // Throws std::invalid_argument: no tasks, num_devices < 1, num_shards < 1, micro_batches < 0, or a
  // task's device outside [0, num_devices). A task with no micro-batches (one resumed after its last step)
  // is finished from the start.
  Scheduler(std::vector<TaskSpec> tasks, int num_devices, PolicyKind policy, uint64_t seed = 0);

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Blocks until a unit is ready for `device`, marks its task running there and returns it. Returns
  // nullopt once no unit will ever come for this device (every task allowed on it has finished or
  // failed) or after cancel().
  std::optional<Unit> next(int device);

  // next() waiting at most `timeout_seconds`: nullopt also on time-out, so a caller that must stay
  // responsive (the main thread, for Ctrl-C) asks again while has_work(device) and not cancelled().
  std::optional<Unit> next_for(int device, double timeout_seconds);
  bool cancelled() const;
  // next() without waiting: nullopt when nothing is ready right now (also when nothing ever will be; ask
  // has_work() to tell them apart). The discrete-event simulator drives the scheduler through this.
  std::optional<Unit> try_next(int device);

  // The unit the policy would give `device` if it asked now, for prefetching its shard during the current
  // unit. Tasks running on other devices are left out; the task running on `device` itself is considered
  // as if its unit had just completed (it usually continues here, by affinity). Changes nothing.
  std::optional<Unit> peek(int device) const;
  // The next `count` units the policy would give `device` if it ran them back to back and no other device
  // took any: the order its shards are needed in, for prefetching and eviction. peek() is its first unit.
  // Policies with state of their own (round_robin, random) plan their next choice only; later ones may differ.
  // It follows the device's committed plan first, as far as that still holds, and leaves out tasks that
  // another device's committed plan holds. LRTF's holds no more of the tasks any device may run than the
  // device's share of them (plan_share), and ends where those and its pinned tasks are planned to their end.
  std::vector<Unit> plan(int device, int count) const;
  // plan(), kept: until the next commit_plan, next() and try_next() give `device` the first of these units
  // while it is still its task's next unit and the task is ready (the task may have failed, or moved); at the
  // first that is not, the rest is forgotten and the policy chooses again. Meanwhile another device takes the
  // unit at its head only if it has nothing else to do. So weights copied in ahead along the plan are used,
  // though the estimates behind the policy move meanwhile (the live workers commit a few units; the
  // simulator's Prefetch::kAlongPlan as many as it copies ahead). LRTF only: with fifo, round_robin or random
  // the order asked for is kept exactly, and this is plan().
  std::vector<Unit> commit_plan(int device, int count);

  // `unit` must be the one next() gave `device`. Feeds its duration to the cost model, makes the task
  // ready again (or finished, or failed if fail() came meanwhile) and wakes waiting workers. Without a
  // duration (a GPU unit whose end event has not been reached yet) the cost model learns it later, through
  // observe().
  void complete(int device, const Unit& unit, std::optional<double> seconds);
  // A unit's duration measured after its complete(): the cost model learns it as complete() would have.
  void observe(const Unit& unit, double seconds);

  // While held, a task's next unit goes to a device only if nothing else is ready for it (plans leave it
  // behind too): its weights cannot come in yet, say, until its step is done. A committed plan whose head it is
  // lapses. Release with held = false; an unknown task throws std::invalid_argument.
  void hold(int task, bool held);

  // Drops the task's remaining units. A unit already running still completes normally.
  void fail(int task);

  // `unit` must be the one next() gave `device`, which failed: it ends without a duration, and the task's
  // remaining chain becomes `spec`'s from its first unit (the same task re-cut into other shards, retried from
  // its last step boundary). Its estimates start over. Throws std::invalid_argument, changing nothing, for a
  // unit not running there or a spec the constructor would refuse. A task failed meanwhile ends instead.
  void restart(int device, const Unit& unit, const TaskSpec& spec);

  // A task arriving while the devices run: validated as the constructor's, given the next id (returned), and
  // handed out from now on. Workers waiting in next() wake for it.
  int add_task(const TaskSpec& spec);
  // While open, more tasks may arrive: next() and has_work() wait for them instead of reporting the end once
  // every task is done. Closing wakes the workers, which end when nothing is left. Constructed closed.
  void set_open(bool open);

  // Saved activations under a budget (see core/saved_bytes_gate.h): a new micro-batch starts on `device` only
  // while those in flight there leave `bytes` room for it (< 0: no limit, the default).
  void set_saved_allowance(int device, int64_t bytes);
  // What one micro-batch of `task` holds on the device until its last unit, as measured (the largest so far).
  void set_saved_bytes(int task, int64_t bytes);
  // The known saved bytes of the micro-batches in flight that started on `device`.
  int64_t saved_in_flight(int device) const;

  // Every current and future next() returns nullopt promptly (Ctrl-C). complete() is still accepted.
  void cancel();

  int64_t remaining_units(int task) const;  // 0 once finished or failed
  // True once the task will never run again: all units done, or failed with no unit still running.
  bool finished(int task) const;
  bool failed(int task) const;
  double remaining_seconds(int task) const;  // estimate, 0 once finished or failed
  // Some task allowed on `device` still has units to run (it may be running elsewhere right now).
  bool has_work(int device) const;
  // Estimate of one unit's duration under the current cost model.
  double estimate(const Unit& unit) const;

  int num_tasks() const { return static_cast<int>(tasks_.size()); }
  int num_devices() const { return num_devices_; }

 private:
  enum class State : uint8_t { kIdle, kRunning, kDone };
  struct TaskState {
    TaskSpec spec;
    int64_t total_units = 0;
    int64_t next_index = 0;  // the running unit's index while running
    State state = State::kIdle;
    bool failed = false;
    int running_device = -1;
    int last_device = -1;
    uint64_t ready_sequence = 0;
    bool held = false;  // see hold()
  };

  void check_task(int task) const;
  void check_device(int device) const;
  bool allowed(const TaskState& task, int device) const;
  bool has_work_locked(int device) const;
  // The task of `unit`, which must be running on `device` (else std::invalid_argument naming `caller`).
  TaskState& running(int device, const Unit& unit, const char* caller);
  std::optional<Unit> take_locked(int device);
  Unit take_task(int device, int task);  // marks the task running on `device`; returns its next unit
  // The task's next unit may run on `device` as far as saved activations go: it does not start a micro-batch,
  // or the device has room for one more.
  bool saved_bytes_admit(int task, int device) const;
  // The task's state is done with (finished or failed): its micro-batch in flight, if any, gives its bytes back.
  void settle(int task);
  // The task's next unit heads another device's committed plan: that device is copying its weights in.
  bool reserved_elsewhere(int task, int device) const;
  // A unit of the task still to run is in another device's committed plan: this device's plan leaves the
  // task to that one (unless the task is running here).
  bool planned_elsewhere(int task, int device) const;
  // How many of the tasks that any device may run a plan of `device` holds (besides those pinned to it): its
  // part, one in num_devices. Just one while another device with work is starved (it has not been handed a unit
  // yet, or its last request found nothing ready): that device takes any such task's next unit at once, so
  // weights copied here for it would be wasted, and long tasks planned together on one device would share it
  // while another idles (at the start, or as tasks finish). A device between two units is not starved.
  int plan_share(int device) const;

  std::vector<TaskState> tasks_;
  int num_devices_;
  CostModel cost_model_;  // before policy_: its initialiser validates the specs, so errors name the task
  Policy policy_;
  SavedBytesGate saved_;
  bool cancelled_ = false;
  bool open_ = false;
  uint64_t event_sequence_ = 0;
  std::vector<Candidate> candidates_;  // reused by take_locked to avoid an allocation per decision
  std::vector<std::deque<std::pair<int, int64_t>>> committed_;  // per device: (task, unit index), commit_plan
  bool plans_committed_ = false;  // commit_plan was ever called: until then decisions skip the checks above
  // Per device: it has not been handed a unit yet, or its last request found nothing ready (see plan_share).
  std::vector<bool> starved_;
  // Per device: (base, shard) of the last unit handed to it, base -1 when its task has none (see TaskSpec::base).
  std::vector<std::pair<int, int>> last_base_shard_;
  // Whether the task's unit at `index` reads the base shard `last` names (Candidate::reads_cached_base).
  bool reads_base_shard(int task, int64_t index, std::pair<int, int> last) const;

  mutable std::mutex mutex_;
  std::condition_variable ready_;
};

}  // namespace hydra::core
