// Saved activations under a budget. A training micro-batch holds its shards' saved inputs on the device from
// its first unit until its last (the backward of shard 0), and with several models in flight on a device their
// micro-batches hold theirs at the same time. The scheduler starts a new micro-batch on a device only while the
// bytes of those in flight there leave room for it; the units inside a micro-batch are never held back, so every
// micro-batch in flight can finish and give its bytes back (no deadlock). One micro-batch may always start on a
// device with none in flight: the budget's split leaves room for the largest (and a task that cannot train even
// alone has been refused before). A task's bytes are unknown until its first micro-batch has been measured: it
// starts only on a device with nothing in flight, and nothing starts beside it.
//
// Bytes are charged to the device the micro-batch starts on (a task that moves to another device part way
// through carries its saved inputs along, copied when its backward needs them). Not thread-safe: the
// Scheduler's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hydra::core {

class SavedBytesGate {
 public:
  // What is in flight on one device: the sum of the known sizes and how many micro-batches, of which unknown.
  struct Load {
    int64_t bytes = 0;
    int micro_batches = 0;
    int unknown = 0;
  };

  SavedBytesGate(int num_tasks, int num_devices);
  void add_task();

  // < 0: no limit (the default), and then nothing is held back.
  void set_allowance(int device, int64_t bytes);
  int64_t allowance(int device) const { return allowance_[static_cast<size_t>(device)]; }
  // What one micro-batch of the task holds (its largest measured so far); std::invalid_argument if < 0.
  void set_saved_bytes(int task, int64_t bytes);

  Load load(int device) const { return load_[static_cast<size_t>(device)]; }
  // Whether a micro-batch of `task` may start on `device` beside `load` (the device's own, or a forecast's).
  bool admits(const Load& load, int task, int device) const;
  // Adds a micro-batch of the task to `load` (a start, as a forecast makes it) and returns the bytes it counted
  // (-1: unknown); remove takes such a micro-batch off again (its end).
  int64_t add(Load& load, int task) const;
  static void remove(Load& load, int64_t bytes);

  // The task's micro-batch starts on `device` / has ended (its last unit completed, or the task failed or
  // restarted). end() without a micro-batch in flight does nothing.
  void start(int task, int device);
  void end(int task);
  // The device the task's micro-batch in flight started on; -1 when none is.
  int reserved_on(int task) const { return reservations_[static_cast<size_t>(task)].device; }
  // The bytes its micro-batch in flight was counted with when it started (-1: unknown then).
  int64_t reserved_bytes(int task) const { return reservations_[static_cast<size_t>(task)].bytes; }

 private:
  struct Reservation {
    int device = -1;
    int64_t bytes = -1;  // as known at the start: -1 unknown
  };

  std::vector<int64_t> allowance_;
  std::vector<Load> load_;
  std::vector<int64_t> task_bytes_;  // -1: not measured yet
  std::vector<Reservation> reservations_;
};

}  // namespace hydra::core
