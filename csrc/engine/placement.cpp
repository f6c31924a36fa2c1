#include "engine/placement.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace hydra::engine {

std::vector<Placement> place_models(const std::vector<DeviceEngine*>& engines,
                                    const std::vector<std::shared_ptr<ShardStore>>& stores,
                                    const std::vector<std::string>& names,
                                    const std::vector<int64_t>& graph_bytes) {
  TORCH_CHECK(!engines.empty(), "place_models: no devices");
  TORCH_CHECK(names.size() == stores.size(), "place_models: ", stores.size(), " stores but ", names.size(), " names");
  TORCH_CHECK(graph_bytes.empty() || graph_bytes.size() == stores.size(), "place_models: ", stores.size(),
              " stores but ", graph_bytes.size(), " graph sizes");
  for (const int64_t bytes : graph_bytes) TORCH_CHECK(bytes >= 0, "place_models: a graph of ", bytes, " bytes");
  const size_t n = stores.size();
  std::vector<int64_t> resident(n), spilled(n), free;
  for (size_t i = 0; i < n; ++i) {
    resident[i] = DeviceEngine::resident_need(*stores[i]);
    spilled[i] = DeviceEngine::spilled_need(*stores[i]);
  }
  for (const DeviceEngine* engine : engines) free.push_back(engine->free_bytes());
  std::vector<Placement> placed(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t may_spill = 0;
    for (size_t j = 0; j < n; ++j)
      if (j != i && (j > i || placed[j].resident_device < 0)) may_spill = std::max(may_spill, spilled[j]);
    const int device = static_cast<int>(std::max_element(free.begin(), free.end()) - free.begin());
    Placement& p = placed[i];
    p.model_ids.assign(engines.size(), -1);
    const int64_t graph = graph_bytes.empty() ? 0 : graph_bytes[i];
    try {
      if (resident[i] + graph + may_spill <= free[device]) {
        // add_model's own check is implied: what it has reserved for earlier spilled models is within
        // may_spill, and what earlier resident models took is what `free` no longer counts.
        p.model_ids[device] = engines[device]->add_model(stores[i], DeviceEngine::Residency::kResident, i);
        engines[device]->keep_outside_arena(graph);
        p.resident_device = device;
        free[device] -= resident[i] + graph;
        continue;
      }
      for (size_t d = 0; d < engines.size(); ++d)
        p.model_ids[d] = engines[d]->add_model(stores[i], DeviceEngine::Residency::kSpilled, i);
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "task '", names[i], "': ", error.what_without_backtrace());
    }
  }
  return placed;
}

}  // namespace hydra::engine
