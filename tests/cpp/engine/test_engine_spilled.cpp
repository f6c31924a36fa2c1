// DeviceEngine on the CPU device: spilled models: binding, prefetch and eviction, visits within the budget,
// tied parameters, gradient offload, bf16 shadows and the write-back.
#include "device_engine_helpers.h"

namespace {

using namespace engine_test;

// ---------------------------------------------------------------------------------------------------------
// DeviceEngine: spilled models

TEST(DeviceEngine, SpilledAcquireBindsParametersToMasterValues) {
  auto store = equal_shards(3);
  std::vector<at::Tensor> originals;
  for (int s = 0; s < 3; ++s)
    for (const ParamEntry& e : store->layout(s)) originals.push_back(e.param.detach().clone());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  for (int round = 0; round < 2; ++round) {
    size_t k = 0;
    for (int s = 0; s < 3; ++s) {
      engine.acquire(m, s, false);
      expect_bound_to_master(*store, s);
      for (const ParamEntry& e : store->layout(s)) {
        EXPECT_TRUE(at::equal(e.param.detach(), originals[k++])) << "the values the user constructed";
        EXPECT_TRUE(e.param.requires_grad() == e.trainable);
      }
      engine.release(m, s);
    }
  }
  EXPECT_THROW(engine.release(m, 0), c10::Error) << "release without acquire";
}

TEST(DeviceEngine, AcquireWaitsForQueuedPrefetchCopies) {
  // Large shards so each copy takes a while on the worker; acquiring the last one right after queueing
  // every prefetch must still see its complete values.
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < 4; ++s) shards.push_back({param({1 << 20}, 3.0 * s + 0.5)});
  auto store = make_store(shards);
  const int64_t shard_bytes = store->device_numel(0) * 4;
  // Room to cache every shard, far below what resident training needs.
  DeviceEngine engine(kCpu, DeviceEngine::min_spilled_bytes(*store) + 2 * 512 + 4 * (shard_bytes + 512));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  engine.plan(m, {0, 1, 2, 3});
  engine.prefetch(m, 0);
  engine.prefetch(m, 1);
  engine.prefetch(m, 2);
  engine.prefetch(m, 3);
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 1}));
  engine.acquire(m, 3, false);
  expect_bound_to_master(*store, 3);
  engine.release(m, 3);
  for (int s = 0; s < 3; ++s) {
    engine.acquire(m, s, false);
    expect_bound_to_master(*store, s);
    engine.release(m, s);
  }
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 1})) << "prefetched shards are not copied again";
  const auto stats = engine.stats();
  EXPECT_EQ(stats.host_to_device_copies, 4);
  EXPECT_EQ(stats.host_to_device_bytes, 4 * shard_bytes);
}

TEST(DeviceEngine, PrefetchIsBestEffortWhenTheBudgetIsFull) {
  auto store = equal_shards(3);
  DeviceEngine engine(kCpu, tight_budget(*store));  // one shard's weights and gradients
  const int m = engine.add_model(store);
  engine.plan(m, {2, 1, 0});
  engine.acquire(m, 2, /*with_grads=*/true);  // fills the arena
  const auto before = engine.stats();
  EXPECT_NO_THROW(engine.prefetch(m, 1));
  EXPECT_NO_THROW(engine.prefetch(m, 0));
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{0, 0, 1})) << "a prefetch that does not fit does nothing";
  EXPECT_EQ(engine.stats().host_to_device_copies, before.host_to_device_copies);
  expect_bound_to_master(*store, 2);  // the pinned shard was not disturbed
  engine.backward_done(m, 2, false);
  engine.release(m, 2);
  engine.acquire(m, 1, true);
  expect_bound_to_master(*store, 1);
  engine.backward_done(m, 1, false);
  engine.release(m, 1);
  engine.synchronize(m);
  EXPECT_LE(engine.stats().high_water_bytes, engine.stats().budget_bytes);
}

TEST(DeviceEngine, PrefetchNeverDisplacesAShardNeededSooner) {
  auto store = equal_shards(3);
  DeviceEngine engine(kCpu, tight_budget(*store));  // room for two shards' weights
  const int m = engine.add_model(store);
  engine.plan(m, {0, 1, 0});
  engine.acquire(m, 0, false);
  engine.release(m, 0);
  engine.prefetch(m, 1);  // fits beside shard 0
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 0}));
  engine.prefetch(m, 2);  // not planned: evicting 0 or 1, both needed, would be a loss
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 0}));
  engine.acquire(m, 1, false);
  expect_bound_to_master(*store, 1);
  engine.release(m, 1);
  engine.acquire(m, 0, false);
  expect_bound_to_master(*store, 0);
  engine.release(m, 0);
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 0})) << "both stayed cached";
  engine.prefetch(m, 1);  // already cached: nothing to do
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 0}));
}

// With clipping, a shard's backward keeps its gradient for clip_and_step, whose step makes the shard's device
// copy stale. Kept cached past its release, that copy would hold room the next shards' copies need (a prefetch
// never displaces a shard planned sooner, and this one is planned for the next micro-batch): it goes at release.
TEST(DeviceEngine, AShardWhoseClippedStepComesNextIsNotKeptCached) {
  for (const bool keep : {false, true}) {
    SCOPED_TRACE(keep ? "clipped: kept for clip_and_step" : "stepped at its backward");
    auto store = equal_shards(3);
    DeviceEngine engine(kCpu, tight_budget(*store));  // room for two shards' weights
    const int m = engine.add_model(store);
    engine.plan(m, {1, 0, 1, 2});
    engine.acquire(m, 1, /*with_grads=*/true);
    engine.backward_done(m, 1, /*step=*/!keep, 1.0, keep);
    engine.release(m, 1);
    engine.synchronize(m);  // the gradient is out: its room is free
    engine.prefetch(m, 0);
    engine.prefetch(m, 2);
    EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1})) << "shard 1's copy went at its release";
    if (keep) engine.clip_and_step(m, /*max_norm=*/1.0, 1.0);
    engine.synchronize(m);
  }
}

TEST(DeviceEngine, SpilledFullVisitSequenceStaysWithinTheBudget) {
  auto store = equal_shards(4);
  const int64_t budget = tight_budget(*store);
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  run_step(engine, m, *store, /*micro_batches=*/2);
  engine.synchronize(m);
  const auto stats = engine.stats();
  EXPECT_LE(stats.high_water_bytes, budget);
  EXPECT_LE(stats.capacity_bytes, budget);
  EXPECT_GT(stats.high_water_bytes, 0);
  // The arena holds two shard buffers. Belady with the runner's prefetches: forward loads every shard,
  // backward reloads all but the last; the second micro-batch starts with shard 0 still cached.
  const std::vector<int64_t> loads = engine.shard_loads(m);
  EXPECT_EQ(loads, (std::vector<int64_t>{3, 4, 4, 2}));
  int64_t total = 0;
  for (int64_t l : loads) total += l;
  EXPECT_EQ(stats.host_to_device_copies, total);
  EXPECT_EQ(stats.host_to_device_bytes, total * store->device_numel(0) * 4);
  // A CPU device copies gradients out as a GPU does, so its region is free before the host job that reads them.
  EXPECT_EQ(stats.device_to_host_copies, 8);
  EXPECT_EQ(stats.device_to_host_bytes, 8 * store->device_numel(0) * 4);
  // Gradients of both micro-batches were accumulated on the host.
  const auto expected = expected_grads(*store, 2);
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(at::equal(store->grad(s), expected[s])) << "shard " << s;
}

TEST(DeviceEngine, SpilledModelWithRoomForEveryShardLoadsEachOnce) {
  auto store = equal_shards(4);
  int64_t cache = 0;
  for (int s = 0; s < 4; ++s) cache += store->device_numel(s) * 4 + 512;
  const int64_t budget = tight_budget(*store) + cache;
  ASSERT_LT(budget, DeviceEngine::resident_bytes(*store));
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  for (int i = 0; i < 3; ++i) run_step(engine, m, *store, 2);
  engine.synchronize(m);
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_LE(engine.stats().high_water_bytes, budget);
  const auto expected = expected_grads(*store, 6);
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(at::equal(store->grad(s), expected[s])) << "shard " << s;
}

TEST(DeviceEngine, SpilledTiedParameterIsCopiedIntoTheBorrower) {
  TiedModel t;
  auto store = make_store(t.shards());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  engine.acquire(m, 2, false);
  expect_bound_to_master(*store, 2);
  EXPECT_TRUE(at::equal(t.e.detach(), store->master(0).narrow(0, 0, 40).view({10, 4})));
  EXPECT_TRUE(at::equal(t.z.detach(), store->master(1).narrow(0, 16, 3)));
  engine.release(m, 2);
}

TEST(DeviceEngine, BackwardDoneAccumulatesDeviceGradientsIntoTheStore) {
  TiedModel t;
  auto store = make_store(t.shards());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  run_step(engine, m, *store, /*micro_batches=*/1);
  engine.synchronize(m);
  // e: its own gradient from shard 0 plus the one written through shard 2's copy; frozen ones have no slot.
  const float e_grad = grad_value(0, 0) + grad_value(2, 1);
  EXPECT_TRUE(at::equal(store->grad(0).narrow(0, 0, 40), at::full({40}, e_grad)));
  const auto expected = expected_grads(*store, 1);
  for (int s = 0; s < 3; ++s)
    EXPECT_TRUE(at::equal(store->grad(s), expected[s])) << "shard " << s << "\n" << store->grad(s);

  // A second step accumulates on top; discard_grads forgets everything.
  run_step(engine, m, *store, 1);
  engine.synchronize(m);
  const auto twice = expected_grads(*store, 2);
  for (int s = 0; s < 3; ++s) EXPECT_TRUE(at::equal(store->grad(s), twice[s])) << "shard " << s;
  engine.discard_grads(m);
  for (int s = 0; s < 3; ++s) EXPECT_TRUE(at::equal(store->grad(s), at::zeros_like(store->grad(s))));
  EXPECT_LE(engine.stats().high_water_bytes, engine.stats().budget_bytes);
}

TEST(DeviceEngine, BackwardDoneRequiresGradients) {
  auto store = equal_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.acquire(m, 1, /*with_grads=*/false);
  EXPECT_THROW(engine.backward_done(m, 1, false), c10::Error);
  engine.release(m, 1);
}

TEST(DeviceEngine, AShardOrModelThatDoesNotExistIsAClearErrorThatChangesNothing) {
  auto store = equal_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  auto expect_error = [](const std::function<void()>& call, const std::string& says) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one saying '" << says << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  for (const int shard : {-1, 2}) {
    const std::string says = "model 0 has 2 shards: no shard " + std::to_string(shard);
    expect_error([&] { engine.prefetch(m, shard); }, says);
    expect_error([&] { engine.acquire(m, shard, true); }, says);
    expect_error([&] { engine.release(m, shard); }, says);
    expect_error([&] { engine.backward_done(m, shard, true); }, says);
  }
  for (const int model : {-1, 1}) {
    const std::string says = "no model " + std::to_string(model) + " on this device (1 added)";
    expect_error([&] { engine.prefetch(model, 0); }, says);
    expect_error([&] { engine.acquire(model, 0, true); }, says);
    expect_error([&] { engine.release(model, 0); }, says);
    expect_error([&] { engine.backward_done(model, 0, true); }, says);
  }
  // Nothing was touched: the model trains as before.
  engine.acquire(m, 1, /*with_grads=*/false);
  engine.release(m, 1);
}

TEST(DeviceEngine, SpilledBFloat16BindsTheShadow) {
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, /*bf16=*/true);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  run_step(engine, m, *store, 1);  // binds bf16 views equal to the shadow, bf16 gradients
  engine.synchronize(m);
  const auto expected = expected_grads(*store, 1);
  for (int s = 0; s < 2; ++s) EXPECT_TRUE(at::equal(store->grad(s), expected[s])) << "shard " << s;
  EXPECT_EQ(engine.stats().host_to_device_bytes % 2, 0);
}

TEST(DeviceEngine, FinishWritesBackIndependentHostParameters) {
  TiedModel t;
  auto store = make_store(t.shards());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  run_step(engine, m, *store, 1);
  engine.finish(m);
  for (int s = 0; s < 3; ++s) {
    for (const ParamEntry& e : store->layout(s)) {
      EXPECT_FALSE(e.param.grad().defined());
      EXPECT_TRUE(at::equal(e.param.detach().reshape({-1}), store->master(e.owner).narrow(0, e.master_offset, e.numel)));
    }
  }
  // Host tensors of their own: overwriting the store's master does not reach them.
  const at::Tensor before = t.e.detach().clone();
  store->master(0).zero_();
  EXPECT_TRUE(at::equal(t.e.detach(), before));
}

}  // namespace
