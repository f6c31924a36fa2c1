// The lane model's view of tied weights: see lane_ties.h and lanes.h.
#include "core/lane_ties.h"

#include <algorithm>
#include <cmath>

namespace hydra::core {

bool tie_apart(const TaskShape& task, const std::vector<StepPlace>& places, int s) {
  const ShardShape& shard = task.shards.at(static_cast<size_t>(s));
  // A resident owner's gradient sums in its home, on the device, as a kDevice owner's does in its buffer.
  auto on_host = [&](int shard_index) { return places.at(static_cast<size_t>(shard_index)) == StepPlace::kHost; };
  return shard.tied_to >= 0 && shard.grads > shard.params && on_host(shard.tied_to) != on_host(s);
}

ShardShape as_placed(const TaskShape& task, const std::vector<StepPlace>& places, int s) {
  ShardShape shard = task.shards.at(static_cast<size_t>(s));
  if (shard.tied_to >= 0 && places.at(static_cast<size_t>(shard.tied_to)) == StepPlace::kResident &&
      places.at(static_cast<size_t>(s)) != StepPlace::kResident)
    shard.weights -= shard.borrowed_weights();
  return shard;
}

std::vector<int> tie_group(const TaskShape& task, int s) {
  const int n = static_cast<int>(task.shards.size());
  std::vector<bool> in(static_cast<size_t>(n));
  in[static_cast<size_t>(s)] = true;
  for (bool grew = true; grew;) {
    grew = false;
    for (int i = 0; i < n; ++i) {
      const int tied = task.shards[static_cast<size_t>(i)].tied_to;
      if (tied >= 0 && in[static_cast<size_t>(i)] != in[static_cast<size_t>(tied)]) {
        in[static_cast<size_t>(i)] = in[static_cast<size_t>(tied)] = true;
        grew = true;
      }
    }
  }
  std::vector<int> group;
  for (int i = 0; i < n; ++i)
    if (in[static_cast<size_t>(i)]) group.push_back(i);
  return group;
}

// Where each backward is followed by its step, the gradient buffers a task's device-stepped ties keep for the run
// all the same (held_bytes counts them where a step sums backwards): each kDevice owner's, where its borrowers'
// gradients wait for its own backward, and each kDevice borrower's of a kHost owner, whose unit's region holds only
// the gradient that goes out.
int64_t tie_buffer_bytes(const TaskShape& task, const std::vector<StepPlace>& places, const StepBytes& bytes) {
  if (task.sums_backwards()) return 0;
  std::vector<bool> keeps(task.shards.size());
  for (size_t s = 0; s < task.shards.size(); ++s) {
    const int tied = task.shards[s].tied_to;
    if (tied >= 0 && places[static_cast<size_t>(tied)] == StepPlace::kDevice) keeps[static_cast<size_t>(tied)] = true;
    if (places[s] == StepPlace::kDevice && tie_apart(task, places, static_cast<int>(s))) keeps[s] = true;
  }
  int64_t held = 0;
  for (size_t s = 0; s < task.shards.size(); ++s)
    if (keeps[s]) held += static_cast<int64_t>(std::ceil(task.shards[s].params * bytes.weight));
  return held;
}

// A resident owner's borrower with nothing of its own to train would be refused (lane_checks::validate_placement),
// and an owner that borrows too moves with its tie.
std::vector<int> owners_alone(const TaskShape& task, const std::vector<int>& group) {
  std::vector<int> owners;
  for (int g : group) {
    const ShardShape& shard = task.shards[static_cast<size_t>(g)];
    if (shard.tied_to < 0) continue;
    if (shard.params == 0) return {};
    if (std::find(owners.begin(), owners.end(), shard.tied_to) == owners.end()) owners.push_back(shard.tied_to);
  }
  for (int owner : owners)
    if (task.shards[static_cast<size_t>(owner)].tied_to >= 0) return {};  // an owner that borrows too: moved whole
  std::sort(owners.begin(), owners.end());
  return owners;
}

}  // namespace hydra::core
