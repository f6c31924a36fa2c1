// The device memory a spilled model asks of a device's budget, and which resident shards it may have: what
// DeviceEngine::add_model, placement and the arena's sizing read before any state is touched. Kept apart from the
// model's copies and steps (spilled_model.cpp) because it reads the store alone.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "engine/shard_homes.h"
#include "engine/spilled_model.h"

namespace hydra::engine {

namespace {

// The shard the resident set `in` lacks first, by the ties' rule, and why (none: it lacks none). A tied weight lives
// where its owner does: a resident owner's is in its home, where a spilled borrower reads it and sums its gradient; a
// spilled owner's is on the host, and a resident borrower's home would hold a second copy, so a resident borrower's
// owner is resident too. A borrower with nothing of its own to train steps the count alone (its gradient, if any,
// all its owners'), and its visit would hold nothing: it is resident with a resident owner.
struct TieNeed {
  int missing;       // the shard `in` must hold too
  int resident;      // the resident shard that needs it: its borrower, or its owner
  bool owner_of_it;  // `missing` is the owner of the tied weight `resident` borrows (else a borrower of it)
};

std::optional<TieNeed> first_tie_need(const ShardStore& store, const std::vector<bool>& in) {
  const int n = store.num_shards();
  for (int s = 0; s < n; ++s)
    for (int source : store.sources(s))
      if (in[s] && !in[source]) return TieNeed{source, s, true};
  for (int b = 0; b < n; ++b) {
    if (in[b] || store.trainable_numel(b) > 0) continue;
    for (int owner : store.sources(b))
      if (in[owner]) return TieNeed{b, owner, false};
  }
  return std::nullopt;
}

}  // namespace

std::string SpilledModel::resident_shards_error(const ShardStore& store, const std::vector<int>& shards) {
  const int n = store.num_shards();
  std::vector<bool> in(n);
  for (int s : shards) {
    if (s < 0 || s >= n) return "resident shard " + std::to_string(s) + " of a model of " + std::to_string(n) + " shards";
    if (in[s]) return "resident shard " + std::to_string(s) + " named twice";
    in[s] = true;
  }
  if (!shards.empty() && static_cast<int>(shards.size()) == n)
    return "every shard resident: the model is resident, not spilled";
  const std::optional<TieNeed> need = first_tie_need(store, in);
  if (!need) return {};
  const std::string missing = std::to_string(need->missing), resident = std::to_string(need->resident);
  if (need->owner_of_it)
    return "resident shard " + resident + " borrows a tied weight from shard " + missing +
           ", which is spilled: a resident borrower's owner is resident too";
  return "shard " + missing + " has nothing of its own to train and borrows a tied weight from resident shard " +
         resident + ": such a borrower is resident with its owner";
}

std::vector<int> SpilledModel::with_tied_owners(const ShardStore& store, const std::vector<int>& shards) {
  std::vector<bool> in(store.num_shards());
  for (int s : shards) in.at(s) = true;
  while (const std::optional<TieNeed> need = first_tie_need(store, in)) in[need->missing] = true;
  std::vector<int> closed;
  for (int s = 0; s < store.num_shards(); ++s)
    if (in[s]) closed.push_back(s);
  return closed;
}

int64_t SpilledModel::visit_numel(const ShardStore& store, const std::vector<int>& resident_shards, int shard) {
  auto resident = [&](int s) {
    return std::find(resident_shards.begin(), resident_shards.end(), s) != resident_shards.end();
  };
  int64_t end = store.owned_numel(shard);
  for (const ParamEntry& e : store.layout(shard))
    if (e.owner == shard || !resident(e.owner)) end = std::max(end, e.device_offset + e.numel);
  const int64_t align = ShardStore::kAlignElements;
  return std::min(store.device_numel(shard), (end + align - 1) / align * align);
}

int64_t SpilledModel::homes_need(const ShardStore& store, const std::vector<int>& shards) {
  int64_t need = 0;
  for (int s : shards) need += ShardHomes::need(store, s);
  return need;
}

int64_t SpilledModel::spilled_need(const ShardStore& store, const std::vector<int>& resident_shards,
                                   const ShardStore* base, const std::vector<int>& device_shards) {
  auto in = [](const std::vector<int>& shards, int s) {
    return std::find(shards.begin(), shards.end(), s) != shards.end();
  };
  int64_t need = 0;
  for (int s = 0; s < store.num_shards(); ++s) {
    const int64_t numel = in(resident_shards, s) ? 0 : visit_numel(store, resident_shards, s);
    const int64_t weights = numel * store.element_bytes() + 512;
    // Weights and gradients; a device-stepped shard's step's regions come in, and its gradients are held apart
    // where it keeps a gradient buffer, unless its unit's region takes those of the tied weights it sends out.
    const bool apart = keeps_gradient_buffer(store, device_shards, s, resident_shards) &&
                       !sends_borrowed_grads(store, device_shards, s, resident_shards);
    const int64_t held_apart = apart ? weights : 0;
    const int64_t own = numel == 0             ? 0
                        : in(device_shards, s) ? 2 * weights - held_apart + device_step_need(store, s)
                                               : 2 * weights;
    const int64_t base_numel = base ? base->device_numel(s) : 0;
    const int64_t held = base_numel > 0 ? base_numel * base->element_bytes() + 512 : 0;  // the base's weights
    need = std::max(need, own + held);
  }
  return need;
}

int64_t SpilledModel::base_shard_need(const ShardStore* base) {
  int64_t need = 0;
  if (base)
    for (int s = 0; s < base->num_shards(); ++s)
      if (base->device_numel(s) > 0) need = std::max(need, base->device_numel(s) * base->element_bytes() + 512);
  return need;
}

int64_t SpilledModel::cached_need(const ShardStore& store, const std::vector<int>& resident_shards) {
  int64_t bytes = 0;
  for (int s = 0; s < store.num_shards(); ++s)
    if (std::find(resident_shards.begin(), resident_shards.end(), s) == resident_shards.end())
      bytes += visit_numel(store, resident_shards, s) * store.element_bytes() + 512;
  return bytes;
}

}  // namespace hydra::engine
