#include "engine/placement.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

#include "engine/spilled_model.h"

namespace hydra::engine {

std::vector<int> closed_under_ties(const ShardStore& store, std::vector<int> shards) {
  const int n = store.num_shards();
  std::vector<bool> in(n);
  for (int s : shards) in.at(s) = true;
  for (bool grew = true; grew;) {  // a tie links a borrower to its owner: follow links both ways to a fixed point
    grew = false;
    for (int s = 0; s < n; ++s)
      for (int source : store.sources(s))
        if (in[s] != in[source]) in[s] = in[source] = grew = true;
  }
  std::vector<int> closed;
  for (int s = 0; s < n; ++s)
    if (in[s]) closed.push_back(s);
  return closed;
}

namespace {

// The resident shards "auto" tries for a spilled model, best first: both ends, the first, the last, each closed
// under ties. A tied embedding resident without its head is the lane model's call (its wishes, more_homes): where
// the head's shard holds blocks, the room it would take may serve device steps better (benchmarks/RESULTS.md).
std::vector<std::vector<int>> resident_end_choices(const ShardStore& store) {
  const int last = store.num_shards() - 1;
  std::vector<std::vector<int>> choices;
  for (const std::vector<int>& ends : {std::vector<int>{0, last}, {0}, {last}}) {
    std::vector<int> shards = closed_under_ties(store, ends);
    if (static_cast<int>(shards.size()) < store.num_shards() &&
        std::find(choices.begin(), choices.end(), shards) == choices.end())
      choices.push_back(std::move(shards));
  }
  return choices;
}

// Arena bytes that cache every spilled shard's weights at once: the other models' (`others_cached`) and this one's
// beside its resident `homed` shards.
int64_t cache_need(const ShardStore& store, const std::vector<int>& homed, int64_t others_cached) {
  return others_cached + SpilledModel::cached_need(store, homed);
}

// The shards a spilled model steps on the device beside its resident `homed` ones: every shard of `wanted` that is
// not resident and has something of its own to train (a tie's owner and borrowers each as wished: the tied weight
// steps with its owner), and each borrower with nothing of its own whose tied weights' owners are among them (it
// steps with them); on several devices (`ties` false) none that shares a tied weight (its gradient would sum in a
// buffer of one device). Granted first shards first, each with the shards it shares a tied weight with, while their
// gradient buffers and the model's working set fit in `room` beside the other models' working set `may_spill` (the
// first shards' steps are the ones the next step's first units wait for); one that does not fit is passed over, as a
// later one may be smaller. Dropping the last ones instead dropped a tied embedding with the head after it, then
// every block, each larger than the tie. A tie at the budget's edge goes as one: the split that kept the
// embedding's step on the device ran 4% longer (benchmarks/RESULTS.md).
std::vector<int> device_step_choice(const ShardStore& store, const std::vector<int>& wanted,
                                    const std::vector<int>& homed, const ShardStore* base, int64_t may_spill,
                                    int64_t room, bool ties) {
  auto in = [](const std::vector<int>& list, int s) { return std::find(list.begin(), list.end(), s) != list.end(); };
  auto tied = [&](int s) { return closed_under_ties(store, {s}).size() > 1; };
  std::vector<int> shards;
  for (int s = 0; s < store.num_shards(); ++s)
    if (in(wanted, s) && !in(homed, s) && store.trainable_numel(s) > 0 && (ties || !tied(s))) shards.push_back(s);
  // A borrower with nothing of its own steps where its owners do, wanted or not.
  const std::vector<int> chosen = shards;
  for (int b = 0; b < store.num_shards(); ++b) {
    if (store.trainable_numel(b) > 0 || in(homed, b)) continue;
    const std::vector<int> owners = SpilledModel::borrowed_grad_owners(store, b);
    if (!owners.empty() && std::all_of(owners.begin(), owners.end(), [&](int o) { return in(chosen, o); }))
      shards.push_back(b);
  }
  std::sort(shards.begin(), shards.end());
  auto fits = [&](const std::vector<int>& stepped) {
    return SpilledModel::held_grads_need(store, stepped, homed) +
               std::max(may_spill, SpilledModel::spilled_need(store, homed, base, stepped)) <=
           room;
  };
  std::vector<int> granted;
  std::vector<bool> weighed(store.num_shards());
  for (int s : shards) {
    if (weighed[s]) continue;
    std::vector<int> tried = granted;
    for (int t : closed_under_ties(store, {s}))
      if (in(shards, t)) {
        weighed[t] = true;
        tried.push_back(t);
      }
    std::sort(tried.begin(), tried.end());
    if (fits(tried) && SpilledModel::device_shards_error(store, homed, tried).empty()) granted = std::move(tried);
  }
  return granted;
}

// The resident `homed` shards grown by `wanted` ones (each SpilledModel::with_tied_owners), first shards first,
// while the homes and the model's working set fit in `room` beside the other models' working set `may_spill`; never
// the whole model (whether a model is resident is the rule's call).
std::vector<int> more_homes(const ShardStore& store, std::vector<int> homed, const std::vector<int>& wanted,
                            const ShardStore* base, int64_t may_spill, int64_t room) {
  for (int s : wanted) {
    if (s < 0 || s >= store.num_shards() || std::find(homed.begin(), homed.end(), s) != homed.end()) continue;
    std::vector<int> grown = homed;
    grown.push_back(s);
    grown = SpilledModel::with_tied_owners(store, grown);
    if (static_cast<int>(grown.size()) == store.num_shards() ||
        SpilledModel::homes_need(store, grown) + std::max(may_spill, SpilledModel::spilled_need(store, grown, base)) >
            room)
      continue;
    homed = std::move(grown);
  }
  return homed;
}

// place_models, which registers each model as it is placed, and decide_placement (`registers` false), which
// only decides.
std::vector<Placement> placed_models(const std::vector<DeviceEngine*>& engines,
                                     const std::vector<std::shared_ptr<ShardStore>>& stores,
                                     const std::vector<std::string>& names, const std::vector<int64_t>& graph_bytes,
                                     const std::vector<bool>& resident_ends, const std::vector<int>& bases,
                                     const std::vector<ShardWishes>& wishes, bool registers,
                                     std::vector<int64_t>* free_left) {
  TORCH_CHECK(!engines.empty(), "place_models: no devices");
  TORCH_CHECK(names.size() == stores.size(), "place_models: ", stores.size(), " stores but ", names.size(), " names");
  TORCH_CHECK(graph_bytes.empty() || graph_bytes.size() == stores.size(), "place_models: ", stores.size(),
              " stores but ", graph_bytes.size(), " graph sizes");
  for (const int64_t bytes : graph_bytes) TORCH_CHECK(bytes >= 0, "place_models: a graph of ", bytes, " bytes");
  TORCH_CHECK(resident_ends.empty() || resident_ends.size() == stores.size(), "place_models: ", stores.size(),
              " stores but ", resident_ends.size(), " resident_ends");
  TORCH_CHECK(bases.empty() || bases.size() == stores.size(), "place_models: ", stores.size(), " stores but ",
              bases.size(), " bases");
  TORCH_CHECK(wishes.empty() || wishes.size() == stores.size(), "place_models: ", stores.size(), " stores but ",
              wishes.size(), " wishes");
  const size_t n = stores.size();
  std::vector<const ShardStore*> base(n);
  for (size_t i = 0; i < n; ++i)
    if (!bases.empty() && bases[i] >= 0) base[i] = &engines[0]->base_store(bases[i]);
  auto base_id = [&](size_t i) { return bases.empty() ? -1 : bases[i]; };
  std::vector<int64_t> resident(n), spilled(n), held(n), free;
  std::vector<std::set<int>> kept(engines.size());  // per device: the bases a resident model keeps cached
  for (size_t i = 0; i < n; ++i) {
    resident[i] = DeviceEngine::resident_need(*stores[i]);
    spilled[i] = SpilledModel::spilled_need(*stores[i], {}, base[i]);
    held[i] = SpilledModel::base_shard_need(base[i]);  // resident, its units hold their base shards
  }
  for (const DeviceEngine* engine : engines) free.push_back(engine->free_bytes());
  std::vector<Placement> placed(n);
  for (size_t i = 0; i < n; ++i) {
    // The working sets of the other models that may spill to a device: the later ones (not placed yet) and
    // the earlier ones that spilled (their spilled shards' only); and what caching all their weights takes.
    int64_t may_spill = 0, others_cached = 0;
    bool alone = true;  // no other model may spill
    for (size_t j = 0; j < n; ++j) {
      if (j == i || (j < i && placed[j].resident_device >= 0)) continue;
      alone = false;
      const std::vector<int> homed = j < i ? placed[j].resident_shards : std::vector<int>{};
      may_spill = std::max(may_spill, j > i ? spilled[j]
                                            : SpilledModel::spilled_need(*stores[j], homed, base[j],
                                                                         placed[j].device_shards));
      others_cached += SpilledModel::cached_need(*stores[j], homed);
    }
    const int device = static_cast<int>(std::max_element(free.begin(), free.end()) - free.begin());
    Placement& p = placed[i];
    p.model_ids.assign(engines.size(), -1);
    const int64_t graph = graph_bytes.empty() ? 0 : graph_bytes[i];
    try {
      // A model of a frozen base is resident only where the whole base still fits cached beside it: the base's
      // copies, once for every model that uses it, are worth more than the model's own (its adapters, say).
      const int64_t base_cached = base[i] ? SpilledModel::cached_need(*base[i]) : 0;
      // The first resident model of a base on a device commits the base's cache there (DeviceEngine::add_model).
      const bool base_kept = base[i] && kept[device].count(bases[i]);
      if (resident[i] + graph + std::max(may_spill, held[i]) + base_cached <= free[device]) {
        // add_model's own check is implied: what it has reserved for earlier spilled models is within
        // may_spill, and what earlier resident models took is what `free` no longer counts.
        if (registers) {
          p.model_ids[device] =
              engines[device]->add_model(stores[i], DeviceEngine::Residency::kResident, i, {}, base_id(i));
          engines[device]->keep_outside_arena(graph);
        }
        p.resident_device = p.home_device = device;
        free[device] -= resident[i] + graph + (base[i] && !base_kept ? base_cached : 0);
        if (base[i]) kept[device].insert(bases[i]);
        continue;
      }
      std::vector<int> homed;  // the resident ends chosen
      if (!resident_ends.empty() && resident_ends[i] && engines.size() == 1) {
        for (const std::vector<int>& shards : resident_end_choices(*stores[i])) {
          const int64_t homes = SpilledModel::homes_need(*stores[i], shards);
          const int64_t own = SpilledModel::spilled_need(*stores[i], shards, base[i]);
          const int64_t working_set = std::max(may_spill, own);
          if (homes + working_set > free[device]) continue;
          // Homes take arena room that caches weights. Alone, the model's step boundary is exposed (nothing
          // else runs meanwhile) and worth that room; among other spilled models, which run while its step goes
          // round, only where every spilled shard's weights stay cached beside them (measured:
          // bench_link_bound.py, four models at copy / forward 2 took 16% longer with one model's ends resident).
          const bool room_to_cache =
              homes + working_set + cache_need(*stores[i], shards, others_cached + base_cached) <= free[device];
          if (!alone && !room_to_cache) continue;
          homed = shards;
          break;
        }
      }
      std::vector<int> stepped;
      if (!wishes.empty() && engines.size() > 1 && stores[i]->steps_after_each_backward()) {
        // On several devices: no home (the model runs on any device), and its device-stepped shards step on the
        // device that ran their backward, as many as every device holds (those the device with the least room
        // holds). Only where each backward is followed by its step: a step summing backwards would sum them in a
        // buffer of one device, and they may run on several.
        if (!wishes[i].device.empty())
          stepped = device_step_choice(*stores[i], wishes[i].device, {}, base[i], may_spill,
                                       *std::min_element(free.begin(), free.end()), /*ties=*/false);
        p.device_shards = stepped;
        for (size_t d = 0; d < engines.size() && registers; ++d)
          p.model_ids[d] =
              engines[d]->add_model(stores[i], DeviceEngine::Residency::kSpilled, i, {}, base_id(i), stepped);
        continue;
      }
      if (!wishes.empty() && engines.size() == 1) {
        homed = more_homes(*stores[i], std::move(homed), wishes[i].resident, base[i], may_spill, free[device]);
        if (!wishes[i].device.empty())
          stepped = device_step_choice(*stores[i], wishes[i].device, homed, base[i], may_spill,
                                       free[device] - SpilledModel::homes_need(*stores[i], homed),
                                       /*ties=*/true);
      }
      if (!homed.empty() || !stepped.empty()) {
        if (registers)
          p.model_ids[device] = engines[device]->add_model(stores[i], DeviceEngine::Residency::kSpilled,
                                                           static_cast<int>(i), homed, base_id(i), stepped);
        p.home_device = device;
        free[device] -=
            SpilledModel::homes_need(*stores[i], homed) + SpilledModel::held_grads_need(*stores[i], stepped, homed);
        p.resident_shards = std::move(homed);
        p.device_shards = std::move(stepped);
        continue;
      }
      for (size_t d = 0; d < engines.size() && registers; ++d)
        p.model_ids[d] = engines[d]->add_model(stores[i], DeviceEngine::Residency::kSpilled, i, {}, base_id(i));
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "task '", names[i], "': ", error.what_without_backtrace());
    }
  }
  if (free_left) *free_left = free;
  return placed;
}

}  // namespace

std::vector<Placement> place_models(const std::vector<DeviceEngine*>& engines,
                                    const std::vector<std::shared_ptr<ShardStore>>& stores,
                                    const std::vector<std::string>& names,
                                    const std::vector<int64_t>& graph_bytes, const std::vector<bool>& resident_ends,
                                    const std::vector<int>& bases,
                                    const std::vector<ShardWishes>& wishes) {
  return placed_models(engines, stores, names, graph_bytes, resident_ends, bases, wishes, true, nullptr);
}

std::vector<Placement> decide_placement(const std::vector<DeviceEngine*>& engines,
                                        const std::vector<std::shared_ptr<ShardStore>>& stores,
                                        const std::vector<std::string>& names,
                                        const std::vector<int64_t>& graph_bytes,
                                        const std::vector<bool>& resident_ends, const std::vector<int>& bases,
                                        const std::vector<ShardWishes>& wishes, std::vector<int64_t>& free_left) {
  return placed_models(engines, stores, names, graph_bytes, resident_ends, bases, wishes, false, &free_left);
}

}  // namespace hydra::engine
