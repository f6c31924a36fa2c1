// Asynchronous successive halving (ASHA, Li et al. 2020), as a stopping rule: a task that reaches a rung
// continues only if its metric ranks among the best 1/reduction_factor of every result reported at that
// rung so far, itself included (at least the best one: the first task to reach a rung always continues).
// Rungs sit at min_steps * reduction_factor^k steps. Lower metrics are better; NaN ranks last.
//
// Decisions never wait for slower tasks (hence asynchronous): a task judged early competes with fewer
// results, so a rung keeps somewhat more than 1/reduction_factor of the tasks in the end. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace hydra::core {

struct RungDecision {
  bool keep;
  int rung;
  int64_t rank;         // 1-based among the results at this rung so far, this one included
  int64_t competitors;  // results at this rung so far, this one included
  int64_t kept;         // how many of them the rule keeps now
};

class SuccessiveHalving {
 public:
  // Throws std::invalid_argument for min_steps < 1 or reduction_factor < 2.
  SuccessiveHalving(int64_t min_steps, int64_t reduction_factor);

  // The rungs a task of `total_steps` steps passes: every rung step strictly below total_steps (a task at
  // its last step has nothing left to stop).
  std::vector<int64_t> rungs(int64_t total_steps) const;

  // Records a task's metric at rung `rung` (an index into rungs()) and decides whether it continues.
  RungDecision report(int rung, double metric);

  int64_t min_steps() const { return min_steps_; }
  int64_t reduction_factor() const { return reduction_factor_; }

 private:
  int64_t min_steps_;
  int64_t reduction_factor_;
  std::vector<std::vector<double>> results_;  // per rung, sorted, NaN as +infinity
  std::mutex mutex_;
};

}  // namespace hydra::core
