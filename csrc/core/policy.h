// Which ready task a free device runs next. Shared, unchanged, by the live Scheduler and the simulator.
//
//   lrtf         longest estimated remaining time first (sharded-LRTF, the paper's policy): classic
//                longest-processing-time-first for makespan; ties go to the lower task id.
//   fifo         the task that became ready earliest (has waited longest for a device).
//   round_robin  the next task id, cyclically, after the last task this device ran.
//   random       uniform over the candidates, from a seeded std::mt19937_64: deterministic given the seed
//                and the sequence of decisions.
//
// Affinity: among candidates whose score ties (lrtf: within kLrtfAffinityBand of the best; fifo: equal
// ready time), the task whose last unit ran on this device wins, since its shards may still be resident
// there. round_robin has no ties; random ignores affinity (it is the unbiased baseline).
//
// Shared bases (lrtf): a task whose next unit reads the frozen base shard the device's last unit read (a task of
// the same base, on the same shard) wins among those within kBaseAffinityBand of the best, before the affinity
// above: the tasks of a base then run a shard back to back and its weights are copied in once for all of them.
// The band is wider than the tie band because the gain is a whole shard's copy, and the tasks of a sweep
// have nearly equal remaining times, one unit apart each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

namespace hydra::core {

enum class PolicyKind { kLrtf, kFifo, kRoundRobin, kRandom };

// Accepts "lrtf", "fifo", "round_robin", "random"; throws std::invalid_argument listing them otherwise.
PolicyKind parse_policy(std::string_view name);
std::string_view policy_name(PolicyKind kind);

struct Candidate {
  int task;
  double remaining_seconds;  // only read by lrtf
  uint64_t ready_sequence;   // smaller: ready earlier
  bool ran_last_here;        // the task's previous unit ran on the asking device
  bool reads_cached_base = false;  // its next unit reads the base shard the asking device's last unit read
};

class Policy {
 public:
  static constexpr double kLrtfAffinityBand = 0.01;  // relative
  static constexpr double kBaseAffinityBand = 0.05;  // relative

  Policy(PolicyKind kind, int num_tasks, int num_devices, uint64_t seed);

  // Index of the chosen candidate. `candidates` must be non-empty. Does not change the policy's state, so
  // the Scheduler can ask "what would you pick" (peek) without disturbing the real sequence.
  size_t choose(int device, std::span<const Candidate> candidates) const;

  // Records that `device` was given `task` after a choose(): round_robin's position, random's draw.
  void commit(int device, int task);

  PolicyKind kind() const { return kind_; }
  void add_task() { ++num_tasks_; }  // a task arrived: round_robin's cycle includes it

 private:
  size_t choose_lrtf(std::span<const Candidate> candidates) const;
  size_t choose_fifo(std::span<const Candidate> candidates) const;
  size_t choose_round_robin(int device, std::span<const Candidate> candidates) const;

  PolicyKind kind_;
  int num_tasks_;
  std::vector<int> last_task_;  // per device, -1 before its first unit
  std::mt19937_64 rng_;
};

}  // namespace hydra::core
