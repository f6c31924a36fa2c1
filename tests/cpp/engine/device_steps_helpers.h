// The shapes and training runs the tests of device-stepped shards share (test_device_steps.cpp,
// test_device_step_ties.cpp): a model trained for three steps with some shards resident and some device-stepped,
// to be compared bit for bit with the same model stepped on the host.
#pragma once

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "device_engine_helpers.h"
#include "engine/spilled_model.h"

namespace engine_test {

// Four shards, none tied; shard 1 ends in a frozen parameter (its trainable prefix is shorter than its weights).
inline std::vector<std::vector<at::Tensor>> untied_shards() {
  std::vector<at::Tensor> second = linear_shard(1, 12);
  second.push_back(param({5}, 2.0, /*trainable=*/false));
  return {{param({10, 4}, 1.0), param({7}, 3.0)}, second, linear_shard(2, 20), {param({6}, 6.0)}};
}

using Shards = std::vector<std::vector<at::Tensor>>;

// Shard 3 borrows shard 0's first weight (a tied embedding and head).
inline Shards tied_shards() {
  const at::Tensor e = param({10, 4}, 1.0);
  return {{e, param({7}, 3.0)}, linear_shard(1, 12), linear_shard(2, 20), {param({6}, 6.0), e}};
}

// As tied_shards, with the head alone in the last shard: it has nothing of its own to train.
inline Shards tied_head_alone() {
  const at::Tensor e = param({10, 4}, 1.0);
  return {{e, param({7}, 3.0)}, linear_shard(1, 12), linear_shard(2, 20), {e}};
}

// As tied_shards, with the borrower owning the largest weight: its step's regions are the largest.
inline Shards tied_shards_large_head() {
  const at::Tensor e = param({10, 4}, 1.0);
  return {{e, param({7}, 3.0)}, linear_shard(1, 12), linear_shard(2, 20), {param({40, 8}, 6.0), e}};
}

// Each shard's `steps` steps logged once each (engine/step_log.h), numbered from 1, where the model steps the shard.
inline void expect_logged(const DeviceEngine& engine, int model, int shards, int steps,
                          const std::vector<int>& resident, const std::vector<int>& device) {
  using hydra::engine::StepPlace;
  auto holds = [](const std::vector<int>& list, int s) { return std::find(list.begin(), list.end(), s) != list.end(); };
  std::vector<std::tuple<int, int64_t, StepPlace>> logged, expected;
  for (const hydra::engine::StepRecord& r : engine.step_log()) {
    EXPECT_EQ(r.model, model);
    EXPECT_LE(r.start_ns, r.end_ns);
    logged.emplace_back(r.shard, r.step, r.place);
  }
  for (int s = 0; s < shards; ++s)
    for (int k = 1; k <= steps; ++k)
      expected.emplace_back(s, k, holds(resident, s) ? StepPlace::kResident
                                  : holds(device, s) ? StepPlace::kDevice
                                                     : StepPlace::kHost);
  std::sort(logged.begin(), logged.end());
  EXPECT_EQ(logged, expected);
  EXPECT_EQ(engine.task_of(model), -1) << "added without a task";
}

// Three steps of two micro-batches (the last clipped when `clip`), with the given shards resident and device-stepped.
inline Trained train(bool bf16, const std::vector<int>& resident, const std::vector<int>& device, bool clip,
                     Shards (*shards)() = untied_shards) {
  auto store = make_store(shards(), bf16, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, resident, -1, device);
  EXPECT_EQ(engine.device_shards(m), device);
  for (int step = 0; step < 3; ++step) {
    const bool clipped = clip && step == 2;
    run_step(engine, m, *store, 2, /*check_values=*/false, /*step=*/!clipped, 0.5, false, add_grads);
    if (clipped) engine.clip_and_step(m, 0.5, 0.5)->value();
  }
  EXPECT_EQ(engine.stats().device_steps, static_cast<int64_t>(3 * device.size()));
  Trained trained = finish_and_copy(engine, m, *store);
  expect_logged(engine, m, store->num_shards(), 3, resident, device);
  return trained;
}

// One micro-batch a step, each backward followed by its step: a device-stepped shard's gradients take an arena region
// from its backward to its step (as a host-stepped shard's do until they are copied out) when the store says so.
inline Trained train_stepping_after_each_backward(bool bf16, bool steps_after_each_backward,
                                                  const std::vector<int>& device,
                                                  Shards (*shards)() = untied_shards,
                                                  const std::vector<int>& resident = {}) {
  auto store = make_store(shards(), bf16, adamw_spec());
  store->set_steps_after_each_backward(steps_after_each_backward);
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, resident, -1, device);
  for (int step = 0; step < 3; ++step)
    run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 0.5, false, add_grads);
  EXPECT_EQ(engine.stats().device_steps, static_cast<int64_t>(3 * device.size()));
  Trained trained = finish_and_copy(engine, m, *store);
  expect_logged(engine, m, store->num_shards(), 3, resident, device);
  return trained;
}

// Per placement, its resident shards and its device-stepped ones.
using Places = std::pair<std::vector<int>, std::vector<int>>;

// That a tied model ends bit for bit as with every shard on the host under each of `accumulating` (three steps of two
// micro-batches, clipped or not) and each of `each_backward` (each backward followed by its step), for both tied
// layouts (tied_shards, tied_shards_large_head), in fp32 and bf16.
inline void expect_tied_placements_end_as_on_the_host(const std::vector<Places>& accumulating,
                                                      const std::vector<Places>& each_backward) {
  for (Shards (*shards)() : {tied_shards, tied_shards_large_head})
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      for (bool clip : {false, true}) {
        SCOPED_TRACE(clip ? "clipped" : "not clipped");
        const Trained host = train(bf16, {}, {}, clip, shards);
        for (const auto& [resident, device] : accumulating) {
          SCOPED_TRACE("resident " + ::testing::PrintToString(resident) + ", device-stepped " +
                       ::testing::PrintToString(device));
          expect_same(train(bf16, resident, device, clip, shards), host);
        }
      }
      const Trained host = train_stepping_after_each_backward(bf16, true, {}, shards);
      for (const auto& [resident, device] : each_backward) {
        SCOPED_TRACE("each backward stepped, resident " + ::testing::PrintToString(resident) + ", device-stepped " +
                     ::testing::PrintToString(device));
        expect_same(train_stepping_after_each_backward(bf16, true, device, shards, resident), host);
      }
    }
}

}  // namespace engine_test
