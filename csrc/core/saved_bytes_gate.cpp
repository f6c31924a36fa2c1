#include "core/saved_bytes_gate.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hydra::core {

SavedBytesGate::SavedBytesGate(int num_tasks, int num_devices)
    : allowance_(static_cast<size_t>(num_devices), -1),
      load_(static_cast<size_t>(num_devices)),
      task_bytes_(static_cast<size_t>(num_tasks), -1),
      reservations_(static_cast<size_t>(num_tasks)) {}

void SavedBytesGate::add_task() {
  task_bytes_.push_back(-1);
  reservations_.emplace_back();
}

void SavedBytesGate::set_allowance(int device, int64_t bytes) { allowance_[static_cast<size_t>(device)] = bytes; }

void SavedBytesGate::set_saved_bytes(int task, int64_t bytes) {
  if (bytes < 0) {
    throw std::invalid_argument("Scheduler: task " + std::to_string(task) + ": saved bytes must be >= 0, got " +
                                std::to_string(bytes));
  }
  int64_t& known = task_bytes_[static_cast<size_t>(task)];
  known = std::max(known, bytes);
}

bool SavedBytesGate::admits(const Load& load, int task, int device) const {
  const int64_t allowance = allowance_[static_cast<size_t>(device)];
  if (allowance < 0 || load.micro_batches == 0) return true;
  const int64_t bytes = task_bytes_[static_cast<size_t>(task)];
  if (bytes < 0 || load.unknown > 0) return false;
  return load.bytes + bytes <= allowance;
}

int64_t SavedBytesGate::add(Load& load, int task) const {
  const int64_t bytes = task_bytes_[static_cast<size_t>(task)];
  ++load.micro_batches;
  if (bytes < 0) ++load.unknown; else load.bytes += bytes;
  return bytes;
}

void SavedBytesGate::remove(Load& load, int64_t bytes) {
  --load.micro_batches;
  if (bytes < 0) --load.unknown; else load.bytes -= bytes;
}

void SavedBytesGate::start(int task, int device) {
  end(task);  // defensive: a task has one micro-batch in flight at most
  const int64_t bytes = add(load_[static_cast<size_t>(device)], task);
  reservations_[static_cast<size_t>(task)] = Reservation{device, bytes};
}

void SavedBytesGate::end(int task) {
  Reservation& r = reservations_[static_cast<size_t>(task)];
  if (r.device < 0) return;
  remove(load_[static_cast<size_t>(r.device)], r.bytes);
  r = Reservation{};
}

}  // namespace hydra::core
