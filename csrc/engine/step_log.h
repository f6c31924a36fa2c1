// Where and when each optimizer step of a shard ran, as the trace of a run shows it (Results.steps): on the host
// (a host-step thread), on the device (a spilled model's device-stepped shard, on the step lane), or in its home
// on the device (a resident model's shard, or a spilled model's resident shard, on the compute stream). Written
// by every thread that runs or issues a step; read once the run's work is done.
//
// Times are the steady clock's, on the thread that runs the step: a host step's are its own (its wait for
// copies still reading the buffers it rewrites left out, the emulated host bandwidth's pace included), and span
// the steps of its model's lower shards that ran between its parts (HostWorker::let_lower_ranks_run); a step on
// a CPU device runs where it is issued, so its times are its own too; on a GPU they are when it was issued.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace hydra::engine {

inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum class StepPlace { kHost, kDevice, kResident };

inline const char* step_place_name(StepPlace place) {
  switch (place) {
    case StepPlace::kHost:
      return "host";
    case StepPlace::kDevice:
      return "device";
    case StepPlace::kResident:
      return "resident";
  }
  return "?";
}

struct StepRecord {
  int model;     // the engine's id of the model
  int shard;
  int64_t step;  // the shard's step count once this step is taken: 1 for its first (a resumed run goes on counting)
  StepPlace place;
  int64_t start_ns;
  int64_t end_ns;
};

class StepLog {
 public:
  void add(const StepRecord& record) {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.push_back(record);
  }
  std::vector<StepRecord> records() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return records_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<StepRecord> records_;
};

}  // namespace hydra::engine
