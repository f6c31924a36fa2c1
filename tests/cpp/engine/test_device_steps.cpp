// A spilled model's device-stepped shards (SpilledModel, engine/spilled_model_device_steps.cpp): their gradients
// stay on the device, their master and optimizer states come in for the step and go home with the new weights;
// the model ends as it would with every shard stepped on the host.
#include <algorithm>
#include <tuple>

#include "device_steps_helpers.h"
#include "engine/clip_norm.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

using hydra::engine::ClipNorm;
using hydra::engine::place_models;
using hydra::engine::SpilledModel;

TEST(DeviceSteps, AModelWithDeviceSteppedShardsEndsAsOneWithEveryShardOnTheHost) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipped" : "not clipped");
    const Trained host = train(false, {}, {}, clip);
    expect_same(train(false, {}, {1, 2}, clip), host);
    expect_same(train(false, {0}, {1, 2, 3}, clip), host);
    expect_same(train(false, {}, {0, 1, 2, 3}, clip), host);
  }
}

TEST(DeviceSteps, WhereEachBackwardIsFollowedByItsStepTheirGradientsComeAndGoWithTheUnit) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const Trained held = train_stepping_after_each_backward(bf16, false, {1, 2});
    expect_same(train_stepping_after_each_backward(bf16, true, {1, 2}), held);
    expect_same(train_stepping_after_each_backward(bf16, true, {0, 1, 2, 3}),
                train_stepping_after_each_backward(bf16, false, {0, 1, 2, 3}));
  }
  auto store = make_store(untied_shards(), false, adamw_spec());
  const int64_t held = SpilledModel::held_grads_need(*store, {1, 2});
  const int64_t working_set = SpilledModel::spilled_need(*store, {}, nullptr, {1, 2});
  EXPECT_GT(held, 0);
  store->set_steps_after_each_backward(true);
  EXPECT_EQ(SpilledModel::held_grads_need(*store, {1, 2}), 0) << "no buffer for the run";
  // The unit's gradients come into its working set instead: at most the largest shard's, aligned.
  EXPECT_GT(SpilledModel::spilled_need(*store, {}, nullptr, {1, 2}), working_set);
  EXPECT_LE(SpilledModel::spilled_need(*store, {}, nullptr, {1, 2}), working_set + held);
  // A backward not followed by its step would leave its gradients in a region given back at release: refused.
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1});
  engine.acquire(m, 1, /*with_grads=*/true);
  add_grads(*store, 1);
  EXPECT_THROW(engine.backward_done(m, 1, /*step=*/false), c10::Error);
  engine.release(m, 1);
  engine.finish(m);
  // A model keeps what its store said when it was added (its budget counted that): held gradients stay held.
  auto later = make_store(untied_shards(), false, adamw_spec());
  DeviceEngine held_engine(kCpu, DeviceEngine::resident_need(*later) * 2);
  const int h = held_engine.add_model(later, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1});
  later->set_steps_after_each_backward(true);
  run_step(held_engine, h, *later, 2, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);
  held_engine.synchronize(h);
  EXPECT_EQ(held_engine.stats().device_steps, 1);
  held_engine.finish(h);
}

// One model spilled on two devices, each backward followed by its step: a device-stepped shard steps on whichever
// device ran its backward, its state coming from and going home to the one store, and the other device's cached
// copy of its weights is stale until it copies the new ones in. The units alternate devices, differently each step.
// `roomy`: a budget that caches every shard's weights on both devices, else one with room for a unit and its step
// (twice the working set: the arena's regions are placed first fit, and the step's must not find it fragmented).
Trained train_on_two_devices(bool bf16, const std::vector<int>& device, bool roomy) {
  auto store = make_store(untied_shards(), bf16, adamw_spec());
  store->set_steps_after_each_backward(true);
  const int64_t budget = roomy ? DeviceEngine::resident_need(*store) - 1
                               : 2 * SpilledModel::spilled_need(*store, {}, nullptr, device);
  DeviceEngine a(kCpu, budget), b(kCpu, budget);
  const auto placed = place_models({&a, &b}, {store}, {"m"}, {}, {}, {}, {{{}, device}});
  EXPECT_EQ(placed[0].device_shards, device);
  EXPECT_EQ(placed[0].home_device, -1) << "it runs on either device";
  EXPECT_EQ(a.device_shards(placed[0].model_ids[0]), device);
  EXPECT_EQ(b.device_shards(placed[0].model_ids[1]), device);
  DeviceEngine* engines[] = {&a, &b};
  const int n = store->num_shards();
  for (int step = 0; step < 3; ++step) {
    int unit = step;
    auto next = [&] {
      const int d = unit++ % 2;
      return std::pair<DeviceEngine*, int>{engines[d], placed[0].model_ids[d]};
    };
    // Each unit computes with the shard's latest weights, whichever device stepped it last (its steps' copies home
    // waited for, so that the host's master is the latest to compare with).
    auto acquire = [&](DeviceEngine* engine, int m, int s, bool with_grads) {
      engine->acquire(m, s, with_grads);
      engine->synchronize(m);
      expect_bound_to_master(*store, s);
    };
    for (int s = 0; s < n - 1; ++s) {
      auto [engine, m] = next();
      acquire(engine, m, s, /*with_grads=*/false);
      engine->release(m, s);
    }
    for (int s = n - 1; s >= 0; --s) {
      auto [engine, m] = next();
      acquire(engine, m, s, /*with_grads=*/true);
      add_grads(*store, s);
      engine->backward_done(m, s, /*step=*/true, 0.5);
      engine->release(m, s);
    }
  }
  EXPECT_EQ(a.stats().device_steps + b.stats().device_steps, static_cast<int64_t>(3 * device.size()));
  EXPECT_TRUE(a.stats().device_steps > 0 && b.stats().device_steps > 0) << "both devices stepped";
  b.synchronize(placed[0].model_ids[1]);
  return finish_and_copy(a, placed[0].model_ids[0], *store);
}

TEST(DeviceSteps, OnTwoDevicesEachShardStepsWhereItsBackwardRanAndTheModelEndsAsOnTheHost) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const Trained host = train_stepping_after_each_backward(bf16, true, {});
    for (bool roomy : {false, true}) {
      SCOPED_TRACE(roomy ? "every shard's weights cached" : "the working set alone");
      expect_same(train_on_two_devices(bf16, {0, 1, 2, 3}, roomy), host);
      expect_same(train_on_two_devices(bf16, {1, 3}, roomy), host);
    }
  }
}

// At a budget of exactly the working set add_model counts for a unit and its device step, the first-fit arena can be
// fragmented by the unit's own weights where the step's regions come in: that step runs on the host instead (its
// gradients go home as a host-stepped shard's do), and the model still ends as with every shard on the host.
// Of a tie, the borrower's step may fall back so (its gradient of the tied weight is in the owner's buffer, which
// keeps it for the owner's step on the device); the owner's buffer is held apart, and its step never does.
TEST(DeviceSteps, AStepWhoseRegionsDoNotFitRunsOnTheHostAndTheModelEndsAsOnTheHost) {
  for (bool tied : {false, true})
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + (tied ? ", tied" : ""));
      Shards (*shards)() = tied ? tied_shards_large_head : untied_shards;
      const Trained host = train_stepping_after_each_backward(bf16, true, {}, shards);
      auto store = make_store(shards(), bf16, adamw_spec());
      store->set_steps_after_each_backward(true);
      const std::vector<int> device{0, 1, 2, 3};
      DeviceEngine engine(kCpu, SpilledModel::held_grads_need(*store, device) +
                                    SpilledModel::spilled_need(*store, {}, nullptr, device));
      const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, device);
      for (int step = 0; step < 3; ++step)
        run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 0.5, false, add_grads);
      engine.synchronize(m);  // every step done and logged
      const int64_t on_device = engine.stats().device_steps;
      std::vector<int> on_host;
      for (const hydra::engine::StepRecord& r : engine.step_log())
        if (r.place == hydra::engine::StepPlace::kHost) on_host.push_back(r.shard);
      EXPECT_EQ(on_device + static_cast<int64_t>(on_host.size()), 3 * store->num_shards())
          << "every step once, on the device or the host";
      EXPECT_FALSE(on_host.empty()) << "the exact budget fragments: some step fell back on the host";
      if (tied) {
        EXPECT_NE(std::find(on_host.begin(), on_host.end(), 3), on_host.end()) << "the borrower's among them";
        EXPECT_EQ(std::find(on_host.begin(), on_host.end(), 0), on_host.end()) << "never the owner's";
        EXPECT_FALSE(store->has_grad(0) || store->has_kept(0)) << "the tie's gradient is not summed on the host";
      }
      EXPECT_GT(on_device, 0);
      expect_same(finish_and_copy(engine, m, *store), host);
    }
}

// A checkpoint taken on one device reads the store after that device's synchronize (DeviceEngine::snapshot): a step
// another device queued sends its shard home on that device's lane, and must be home by then too.
TEST(DeviceSteps, SynchronizingOneDeviceWaitsForTheStepsAnotherDeviceSendsHome) {
  auto store = make_store(untied_shards(), false, adamw_spec());
  store->set_steps_after_each_backward(true);
  const std::vector<int> device{0, 1, 2, 3};
  const int64_t budget = 2 * SpilledModel::spilled_need(*store, {}, nullptr, device);
  DeviceEngine a(kCpu, budget), b(kCpu, budget, nullptr, /*link_bytes_per_second=*/2e4);  // b's copies crawl
  const auto placed = place_models({&a, &b}, {store}, {"m"}, {}, {}, {}, {{{}, device}});
  ASSERT_EQ(placed[0].device_shards, device);
  const int on_a = placed[0].model_ids[0], on_b = placed[0].model_ids[1];
  const at::Tensor before = store->master(0).clone();
  run_step(b, on_b, *store, 1, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);  // every unit on b
  a.synchronize(on_a);
  std::vector<at::Tensor> seen;
  for (int s = 0; s < store->num_shards(); ++s) seen.push_back(store->master(s).clone());
  b.synchronize(on_b);
  EXPECT_FALSE(at::equal(before, store->master(0))) << "the step changed the master";
  for (int s = 0; s < store->num_shards(); ++s)
    EXPECT_TRUE(at::equal(seen[s], store->master(s))) << "shard " << s << " was still on its way home";
  EXPECT_EQ(b.stats().device_steps, 4);
  b.finish(on_b);
}

TEST(DeviceSteps, InBf16TheirStepMatchesAResidentShards) {
  // A host-stepped shard sums two micro-batches in fp32, a device-stepped one in its bf16 buffer as a resident one.
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipped" : "not clipped");
    expect_same(train(true, {}, {1, 2}, clip), train(true, {1, 2}, {}, clip));
  }
}

TEST(DeviceSteps, TheirGradientsNeverLeaveTheirStateGoesRoundOncePerStepAndTheirWeightsStay) {
  auto store = make_store(untied_shards(), /*bf16=*/true, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1});
  for (int step = 0; step < 2; ++step)
    run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);
  engine.synchronize(m);
  const hydra::engine::EngineStats stats = engine.stats();
  EXPECT_EQ(stats.device_steps, 2);
  EXPECT_EQ(stats.host_steps, 2 * 3) << "every other shard steps on the host";
  // Out per step: the other shards' bf16 gradients, and shard 1's master and two moments (fp32) and the new bf16
  // weights of its trainable prefix.
  const int64_t trainable = store->trainable_numel(1);
  ASSERT_LT(trainable, store->device_numel(1)) << "shard 1 ends in a frozen parameter";
  int64_t out = trainable * (3 * 4 + 2);
  for (int s : {0, 2, 3}) out += store->gradient_numel(s) * 2;
  EXPECT_EQ(stats.device_to_host_bytes, 2 * out);
  EXPECT_EQ(engine.shard_loads(m)[1], 1) << "its cached weights took each step's result on the device";
  EXPECT_GT(engine.shard_loads(m)[2], 1) << "a host-stepped shard's are copied in again after its step";
  EXPECT_EQ(store->steps_taken(1), 2);
  engine.acquire(m, 1, false);  // the copy it computes with is the one the host got back
  expect_bound_to_master(*store, 1);
  engine.release(m, 1);
  engine.finish(m);
}

// One step of one micro-batch as the runner drives it when the step follows each backward: the device-stepped
// shards' state is prefetched as the backward's unit begins. `step`: whether the backward then reports the step.
void step_with_prefetch(DeviceEngine& engine, int m, ShardStore& store, bool step) {
  const int n = store.num_shards();
  for (int s = 0; s < n - 1; ++s) {
    engine.acquire(m, s, false);
    engine.release(m, s);
  }
  for (int s = n - 1; s >= 0; --s) {
    engine.prefetch_step(m, s);  // as DeviceLoop::begin: before the shard's weights take their room
    engine.acquire(m, s, true);
    engine.issue_step_prefetch(m, s);  // and its copy after the weights'
    add_grads(store, s);
    engine.backward_done(m, s, step);
    engine.release(m, s);
  }
}

TEST(DeviceSteps, StatePrefetchedAtTheBackwardStepsAsStateBroughtByTheStep) {
  Trained got[2];
  for (bool prefetch : {false, true}) {
    auto store = make_store(untied_shards(), /*bf16=*/true, adamw_spec());
    DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
    const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {0, 1, 2});
    for (int step = 0; step < 3; ++step) {
      if (prefetch) {
        step_with_prefetch(engine, m, *store, true);
      } else {
        run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);
      }
    }
    EXPECT_EQ(engine.stats().device_steps, 9);
    got[prefetch] = finish_and_copy(engine, m, *store);
  }
  expect_same(got[1], got[0]);
}

// The state a backward's step needs is several times its weights (12 bytes a parameter against 4 in fp32) and is needed
// only once the backward is done: prefetch_step takes its room, and its copy goes on the link only at
// issue_step_prefetch, after the weights the unit and the next one need (DeviceLoop::begin's order). On a link of
// 400 kB/s a shard's weights take 0.18 s and its state 0.54 s: the two acquires wait for the weights alone (0.36 s);
// with the state copied first they would wait for it too (0.9 s).
TEST(DeviceSteps, AStepsStateGoesOnTheLinkAfterTheWeightsTheComputeNeeds) {
  auto store = equal_shards(4, /*rows=*/2000);
  store->set_steps_after_each_backward(true);
  const double link = 400e3;
  const double weights_seconds = static_cast<double>(store->device_numel(2)) * 4 / link;
  const double state_seconds = static_cast<double>(store->trainable_numel(2)) * 12 / link;
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2, nullptr, link);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {0, 1, 2, 3});
  engine.plan(m, {2, 1});
  engine.prefetch_step(m, 2);
  engine.acquire(m, 2, true);
  engine.prefetch_ahead();  // shard 1's weights
  engine.issue_step_prefetch(m, 2);
  add_grads(*store, 2);
  engine.backward_done(m, 2, /*step=*/true);
  engine.release(m, 2);
  engine.acquire(m, 1, true);
  const double waited = engine.stats().acquire_wait_seconds;
  EXPECT_LT(waited, 2 * weights_seconds + state_seconds / 2) << "the weights queued behind the state";
  EXPECT_GE(waited, 2 * weights_seconds * 0.9);
  add_grads(*store, 1);
  engine.backward_done(m, 1, /*step=*/true);
  engine.release(m, 1);
  engine.synchronize(m);
  EXPECT_EQ(engine.stats().device_steps, 2);
  engine.finish(m);
}

TEST(DeviceSteps, StatePrefetchedForAStepThatDoesNotComeIsGivenBack) {
  // Each shard's prefetched state is given back at its release when no step used it (its loss gate closed): the
  // arena holds no step's regions between units, and the next backward's prefetch brings the state in afresh.
  auto store = make_store(untied_shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);  // every shard's weights stay cached
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {0, 1, 2});
  const at::Tensor before = store->master(1).clone();
  step_with_prefetch(engine, m, *store, /*step=*/false);
  const int64_t first = engine.stats().host_to_device_bytes;
  step_with_prefetch(engine, m, *store, /*step=*/false);
  engine.synchronize(m);
  int64_t state_bytes = 0;  // fp32 master and two moments of each device-stepped shard
  for (int s : {0, 1, 2}) state_bytes += store->trainable_numel(s) * 3 * 4;
  EXPECT_EQ(engine.stats().host_to_device_bytes - first, state_bytes) << "the weights cached, the state again";
  EXPECT_EQ(engine.stats().device_steps, 0);
  EXPECT_TRUE(at::equal(store->master(1), before));
  engine.discard_grads(m);
  step_with_prefetch(engine, m, *store, /*step=*/true);
  engine.synchronize(m);
  EXPECT_EQ(engine.stats().device_steps, 3);
  EXPECT_EQ(store->steps_taken(1), 1);
  engine.finish(m);
}

TEST(DeviceSteps, TheirGradientBuffersCountAgainstTheBudgetAndAreGivenBackOnRelease) {
  auto store = make_store(untied_shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int64_t free = engine.free_bytes();
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1, 2});
  const int64_t held = SpilledModel::held_grads_need(*store, {1, 2});
  const int64_t working_set = SpilledModel::spilled_need(*store, {}, nullptr, {1, 2});
  EXPECT_GT(working_set, SpilledModel::spilled_need(*store, {})) << "a device step's regions exceed a gradient's";
  EXPECT_EQ(engine.free_bytes(), free - held - working_set);
  engine.finish(m);
  engine.release_model(m);
  EXPECT_EQ(engine.free_bytes(), free - working_set);
}

TEST(DeviceSteps, AfterAFailedHostJobAClippedStepStepsNoDeviceShard) {
  // Shard 1 steps on the host and its job fails (the op rejects a negative learning rate): the norm must report
  // it, and the device-stepped shards must not step.
  OptimizerSpec bad;
  bad.lr = -1.0;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, false, bad);
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {0, 2});
  engine.plan(m, {2, 1, 0});
  for (int s : {2, 1, 0}) {
    engine.acquire(m, s, true);
    write_grads(*store, s);
    engine.backward_done(m, s, /*step=*/s == 1);  // shard 1's job throws
    engine.release(m, s);
  }
  const at::Tensor before = store->master(0).clone();
  const std::shared_ptr<ClipNorm> norm = engine.clip_and_step(m, /*max_norm=*/1.0);
  EXPECT_THROW(norm->value(), c10::Error);
  EXPECT_THROW(engine.synchronize(m), c10::Error) << "the failed job is reported again";
  engine.finish(m);
  EXPECT_TRUE(at::equal(store->master(0), before)) << "a device-stepped shard stepped after its model's failed job";
  EXPECT_EQ(store->steps_taken(0), 0);
  EXPECT_EQ(store->steps_taken(2), 0);
  EXPECT_EQ(engine.stats().device_steps, 0);
}

}  // namespace
}  // namespace engine_test
