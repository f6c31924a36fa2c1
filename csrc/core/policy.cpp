#include "core/policy.h"

#include <optional>
#include <stdexcept>
#include <string>

namespace hydra::core {

namespace {

constexpr std::string_view kNames[] = {"lrtf", "fifo", "round_robin", "random"};

}  // namespace

PolicyKind parse_policy(std::string_view name) {
  for (size_t i = 0; i < std::size(kNames); ++i) {
    if (name == kNames[i]) return static_cast<PolicyKind>(i);
  }
  throw std::invalid_argument("unknown scheduling policy '" + std::string(name) +
                              "'; valid policies: lrtf, fifo, round_robin, random");
}

std::string_view policy_name(PolicyKind kind) { return kNames[static_cast<size_t>(kind)]; }

Policy::Policy(PolicyKind kind, int num_tasks, int num_devices, uint64_t seed)
    : kind_(kind), num_tasks_(num_tasks), last_task_(static_cast<size_t>(num_devices), -1), rng_(seed) {
  if (num_tasks < 1) throw std::invalid_argument("Policy: num_tasks must be >= 1");
  if (num_devices < 1) throw std::invalid_argument("Policy: num_devices must be >= 1");
}

size_t Policy::choose(int device, std::span<const Candidate> candidates) const {
  if (candidates.empty()) throw std::invalid_argument("Policy::choose: no candidates");
  switch (kind_) {
    case PolicyKind::kLrtf: return choose_lrtf(candidates);
    case PolicyKind::kFifo: return choose_fifo(candidates);
    case PolicyKind::kRoundRobin: return choose_round_robin(device, candidates);
    case PolicyKind::kRandom: {
      // A copy, so choose() stays side-effect free; commit() consumes exactly this one draw.
      std::mt19937_64 engine = rng_;
      return static_cast<size_t>(engine() % candidates.size());
    }
  }
  return 0;
}

void Policy::commit(int device, int task) {
  last_task_.at(static_cast<size_t>(device)) = task;
  if (kind_ == PolicyKind::kRandom) rng_.discard(1);
}

size_t Policy::choose_lrtf(std::span<const Candidate> candidates) const {
  // Strict order: more remaining, then lower task id.
  auto better = [](const Candidate& a, const Candidate& b) {
    return a.remaining_seconds != b.remaining_seconds ? a.remaining_seconds > b.remaining_seconds : a.task < b.task;
  };
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (better(candidates[i], candidates[best])) best = i;
  }
  // Within the wider band, a task reading the base shard just used here saves that shard's copy.
  const double base_floor = candidates[best].remaining_seconds * (1.0 - kBaseAffinityBand);
  std::optional<size_t> sharing;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.reads_cached_base && c.remaining_seconds >= base_floor && (!sharing || better(c, candidates[*sharing])))
      sharing = i;
  }
  if (sharing) return *sharing;
  if (candidates[best].ran_last_here) return best;
  // Estimates are noisy at the percent level, so a 1% difference is not worth a cold shard fetch.
  const double floor = candidates[best].remaining_seconds * (1.0 - kLrtfAffinityBand);
  std::optional<size_t> resident;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (!c.ran_last_here || c.remaining_seconds < floor) continue;
    if (!resident || better(c, candidates[*resident])) resident = i;
  }
  return resident.value_or(best);
}

size_t Policy::choose_fifo(std::span<const Candidate> candidates) const {
  auto better = [](const Candidate& a, const Candidate& b) {
    if (a.ready_sequence != b.ready_sequence) return a.ready_sequence < b.ready_sequence;
    if (a.ran_last_here != b.ran_last_here) return a.ran_last_here;
    return a.task < b.task;
  };
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (better(candidates[i], candidates[best])) best = i;
  }
  return best;
}

size_t Policy::choose_round_robin(int device, std::span<const Candidate> candidates) const {
  const int last = last_task_.at(static_cast<size_t>(device));
  auto distance = [&](int task) { return ((task - last - 1) % num_tasks_ + num_tasks_) % num_tasks_; };
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (distance(candidates[i].task) < distance(candidates[best].task)) best = i;
  }
  return best;
}

}  // namespace hydra::core
