// DeviceEngine on the CPU device: sizing, parameter binding, spilled vs resident models, gradient
// accumulation and offload, optimizer steps.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "engine/device_engine.h"
#include "engine/shard_store.h"

namespace {

using hydra::engine::DeviceEngine;
using hydra::engine::OptimizerSpec;
using hydra::engine::ParamEntry;
using hydra::engine::ShardStore;

const c10::Device kCpu("cpu");

bool op_registered(const char* name) { return c10::Dispatcher::singleton().findSchema({name, ""}).has_value(); }

at::Tensor values(at::IntArrayRef sizes, double seed) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return at::arange(n, at::kDouble).mul(0.173).add(seed).sin().to(at::kFloat).reshape(sizes);
}

at::Tensor param(at::IntArrayRef sizes, double seed, bool trainable = true) {
  return values(sizes, seed).set_requires_grad(trainable);
}

// Shard s: a [rows, 8] weight and a [rows] bias.
std::vector<at::Tensor> linear_shard(int s, int64_t rows) {
  return {param({rows, 8}, 10.0 * s + 1.0), param({rows}, 10.0 * s + 2.0)};
}

std::shared_ptr<ShardStore> make_store(std::vector<std::vector<at::Tensor>> shards, bool bf16 = false,
                                       OptimizerSpec optimizer = OptimizerSpec{}) {
  return std::make_shared<ShardStore>(shards, optimizer, bf16, /*pin_memory=*/false);
}

std::shared_ptr<ShardStore> equal_shards(int n, int64_t rows = 30) {
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < n; ++s) shards.push_back(linear_shard(s, rows));
  return make_store(shards);
}

// What the engine's add_model accepts as the smallest budget for a spilled model.
int64_t tight_budget(const ShardStore& store) { return DeviceEngine::min_spilled_bytes(store) + 2 * 512; }

// Every parameter of `shard` is bound to device memory holding exactly its master value.
void expect_bound_to_master(ShardStore& store, int shard) {
  for (const ParamEntry& e : store.layout(shard)) {
    SCOPED_TRACE(testing::Message() << "shard " << shard << " entry at device offset " << e.device_offset);
    const at::Tensor expected =
        store.transfer_source(e.owner).narrow(0, e.master_offset, e.numel).view(e.param.sizes());
    ASSERT_EQ(e.param.scalar_type(), store.compute_dtype());
    ASSERT_EQ(e.param.sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(e.param.detach(), expected));
    EXPECT_NE(e.param.data_ptr(), expected.data_ptr()) << "bound to device memory, not the host master";
  }
}

// Distinct, exactly representable gradient per (shard, parameter index).
float grad_value(int shard, size_t index) { return 0.5f * static_cast<float>(shard + 1) + 0.25f * index; }

void write_grads(ShardStore& store, int shard) {
  const auto& layout = store.layout(shard);
  for (size_t i = 0; i < layout.size(); ++i) {
    const ParamEntry& e = layout[i];
    if (!e.trainable) {
      EXPECT_FALSE(e.param.grad().defined());
      continue;
    }
    at::Tensor g = e.param.grad();
    ASSERT_TRUE(g.defined()) << "acquire(with_grads) must bind a gradient view";
    ASSERT_EQ(g.sizes(), e.param.sizes());
    EXPECT_TRUE(at::equal(g, at::zeros_like(g))) << "fresh gradient buffers start at zero";
    e.param.mutable_grad().fill_(grad_value(shard, i));
  }
}

// The master gradients `micro_batches` passes of write_grads should leave: each trainable parameter gets
// the sum of the values written in every shard that lists it, in its owner's buffer.
std::vector<at::Tensor> expected_grads(ShardStore& store, int micro_batches) {
  std::vector<at::Tensor> expected;
  for (int s = 0; s < store.num_shards(); ++s) expected.push_back(at::zeros({store.owned_numel(s)}));
  for (int s = 0; s < store.num_shards(); ++s) {
    const auto& layout = store.layout(s);
    for (size_t i = 0; i < layout.size(); ++i) {
      const ParamEntry& e = layout[i];
      if (!e.trainable) continue;
      expected[e.owner].narrow(0, e.master_offset, e.numel).add_(grad_value(s, i) * micro_batches);
    }
  }
  return expected;
}

// The runner's visit sequence for one optimizer step: forward 0..n-2 without gradients, the last shard with
// gradients, backward n-2..0, prefetching the next shard at every visit.
void run_step(DeviceEngine& engine, int model, ShardStore& store, int micro_batches, bool check_values = true,
              bool step = false, double lr_scale = 1.0) {
  const int n = store.num_shards();
  std::vector<int> visits;
  for (int mb = 0; mb < micro_batches; ++mb) {
    for (int s = 0; s < n; ++s) visits.push_back(s);
    for (int s = n - 2; s >= 0; --s) visits.push_back(s);
  }
  engine.plan(model, visits);
  for (int mb = 0; mb < micro_batches; ++mb) {
    const bool last = step && mb == micro_batches - 1;
    for (int s = 0; s < n - 1; ++s) {
      engine.acquire(model, s, /*with_grads=*/false);
      engine.prefetch(model, s + 1);
      if (check_values) expect_bound_to_master(store, s);
      for (const ParamEntry& e : store.layout(s)) EXPECT_FALSE(e.param.grad().defined());
      engine.release(model, s);
    }
    for (int s = n - 1; s >= 0; --s) {
      engine.acquire(model, s, /*with_grads=*/true);
      if (s > 0) engine.prefetch(model, s - 1);
      if (check_values) expect_bound_to_master(store, s);
      write_grads(store, s);
      engine.backward_done(model, s, last, lr_scale);
      engine.release(model, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// DeviceEngine: sizing

TEST(DeviceEngine, SizingFormulas) {
  auto store = equal_shards(4);  // 272 elements per shard
  ASSERT_EQ(store->device_numel(0), 272);
  EXPECT_EQ(DeviceEngine::min_spilled_bytes(*store), 2 * 272 * 4);
  EXPECT_EQ(DeviceEngine::resident_bytes(*store), 4 * 272 * (2 * 4 + 2 * 4));  // weights+grads, Adam m and v
  auto bf16 = make_store({linear_shard(0, 30), linear_shard(1, 60)}, /*bf16=*/true);
  EXPECT_EQ(DeviceEngine::min_spilled_bytes(*bf16), 2 * bf16->device_numel(1) * 2);
  EXPECT_EQ(DeviceEngine::resident_bytes(*bf16), bf16->total_owned_numel() * (2 * 2 + 4 + 2 * 4));
}

TEST(DeviceEngine, AddModelBelowMinimumThrowsAndLeavesTheEngineUsable) {
  auto big = equal_shards(2, 60);
  auto small = equal_shards(2, 30);
  const int64_t budget = tight_budget(*small);
  ASSERT_LT(budget, tight_budget(*big));
  DeviceEngine engine(kCpu, budget);
  EXPECT_THROW(engine.add_model(big), c10::Error);
  const auto stats = engine.stats();
  EXPECT_EQ(stats.budget_bytes, budget);
  EXPECT_EQ(stats.high_water_bytes, 0);
  // Nothing was committed for the rejected model: the whole budget is still there for this one.
  const int id = engine.add_model(small);
  EXPECT_EQ(id, 0);
  EXPECT_FALSE(engine.resident(id));
  run_step(engine, id, *small, 1);
  engine.synchronize(id);
  EXPECT_LE(engine.stats().high_water_bytes, budget);
}

TEST(DeviceEngine, AModelArrivingAfterTrainingStartedIsSpilledWithinTheArena) {
  DeviceEngine engine(kCpu, 1 << 22);
  engine.expect_arrivals();
  auto first = equal_shards(2);
  const int m = engine.add_model(first);
  ASSERT_TRUE(engine.resident(m));
  engine.acquire(m, 0, false);
  engine.release(m, 0);
  EXPECT_EQ(engine.stats().capacity_bytes, 1 << 22);  // the whole budget, with arrivals expected
  auto arriving = equal_shards(2, 4);
  const int late = engine.add_model(arriving);
  EXPECT_EQ(late, 1);
  EXPECT_FALSE(engine.resident(late));  // the arena is made: newcomers are spilled
  run_step(engine, late, *arriving, 1);
  engine.synchronize(late);
  EXPECT_THROW(engine.add_model(equal_shards(1, 100000)), c10::Error);  // larger than what is left
  engine.acquire(m, 1, false);  // the first is still usable
  expect_bound_to_master(*first, 1);
  engine.release(m, 1);
}

TEST(DeviceEngine, WithoutArrivalsExpectedTheArenaFitsTheModelsAddedAndTakesNoMore) {
  DeviceEngine engine(kCpu, 1 << 22);
  const int m = engine.add_model(equal_shards(2));
  engine.acquire(m, 0, false);
  engine.release(m, 0);
  EXPECT_LT(engine.stats().capacity_bytes, 1 << 22);
  EXPECT_THROW(engine.add_model(equal_shards(1, 4)), c10::Error);
  EXPECT_THROW(engine.expect_arrivals(), c10::Error);
}

TEST(DeviceEngine, ReleasingAModelFreesItsMemoryAndBudgetForOthers) {
  auto resident = equal_shards(2);
  auto spilled = equal_shards(3);
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*resident) + DeviceEngine::spilled_need(*spilled));
  const int r = engine.add_model(resident);
  const int s = engine.add_model(spilled, /*allow_resident=*/false);
  ASSERT_TRUE(engine.resident(r));
  run_step(engine, r, *resident, 1, /*check_values=*/false, /*step=*/true);
  run_step(engine, s, *spilled, 1);
  const int64_t free_before = engine.free_bytes();
  auto large = equal_shards(2, 200);  // its working set needs the arena's room for the resident model
  EXPECT_THROW(engine.add_model(large), c10::Error);
  engine.finish(r);
  engine.release_model(r);
  EXPECT_EQ(engine.free_bytes(), free_before + DeviceEngine::resident_need(*resident));
  EXPECT_FALSE(engine.resident(r));
  EXPECT_THROW(engine.acquire(r, 0, false), c10::Error);
  EXPECT_THROW(engine.finish(r), c10::Error);
  for (const ParamEntry& e : resident->layout(0)) EXPECT_TRUE(e.param.device().is_cpu());  // written back
  engine.synchronize(s);
  engine.release_model(s);
  const int l = engine.add_model(large);  // now it fits, and trains
  run_step(engine, l, *large, 2);
  engine.synchronize(l);
  EXPECT_LE(engine.stats().high_water_bytes, engine.stats().capacity_bytes);
}

TEST(DeviceEngine, BudgetJustBelowTheSpilledMinimumIsRejected) {
  auto store = equal_shards(3);
  DeviceEngine below(kCpu, tight_budget(*store) - 1);
  EXPECT_THROW(below.add_model(store), c10::Error);
  DeviceEngine at_minimum(kCpu, tight_budget(*store));
  EXPECT_NO_THROW(at_minimum.add_model(store));
  EXPECT_THROW(DeviceEngine(kCpu, 0), c10::Error);
}

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

// shard 0 owns e (tied with shard 2) and a frozen f; shard 1 owns h and a frozen z (tied with shard 2).
struct TiedModel {
  at::Tensor e = param({10, 4}, 1.0);
  at::Tensor f = param({5}, 2.0, false);
  at::Tensor a = param({7}, 3.0);
  at::Tensor h = param({8}, 4.0);
  at::Tensor z = param({3}, 5.0, false);
  at::Tensor g = param({6}, 6.0);
  std::vector<std::vector<at::Tensor>> shards() const { return {{e, f, a}, {h, z}, {g, e, z}}; }
};

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
  // e: its own gradient from shard 0 plus the one written through shard 2's copy; frozen ones stay zero.
  const float e_grad = grad_value(0, 0) + grad_value(2, 1);
  EXPECT_TRUE(at::equal(store->grad(0).narrow(0, 0, 40), at::full({40}, e_grad)));
  EXPECT_TRUE(at::equal(store->grad(1).narrow(0, 16, 3), at::zeros({3}))) << "z is frozen";
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

// ---------------------------------------------------------------------------------------------------------
// DeviceEngine: resident models

TEST(DeviceEngine, ResidentModelLoadsEachShardOnce) {
  TiedModel t;
  auto store = make_store(t.shards());
  const int64_t budget = 1 << 24;
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{0, 0, 0})) << "nothing is uploaded before first use";
  for (int cycle = 0; cycle < 5; ++cycle) {
    for (int s = 0; s < 3; ++s) {
      engine.acquire(m, s, cycle % 2 == 1);
      expect_bound_to_master(*store, s);
      engine.prefetch(m, (s + 1) % 3);  // a no-op for resident models
      engine.release(m, s);
    }
  }
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1}));
  // One copy of the tied weight on the device: bound from shard 0 and shard 2 to the same memory.
  engine.acquire(m, 0, false);
  const void* from_owner = t.e.data_ptr();
  engine.release(m, 0);
  engine.acquire(m, 2, false);
  EXPECT_EQ(t.e.data_ptr(), from_owner);
  engine.release(m, 2);
  const auto stats = engine.stats();
  EXPECT_LE(stats.high_water_bytes, budget);
  EXPECT_LE(stats.capacity_bytes, budget);
  EXPECT_GE(stats.high_water_bytes, DeviceEngine::resident_bytes(*store));
  EXPECT_EQ(stats.host_to_device_copies, 3);
}

TEST(DeviceEngine, ResidentGradientsStayOnTheDevice) {
  TiedModel t;
  auto store = make_store(t.shards());
  DeviceEngine engine(kCpu, 1 << 24);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  engine.acquire(m, 2, true);
  // A tied parameter's gradient is the owner's gradient buffer: one accumulator for every use.
  t.e.mutable_grad().fill_(1.0f);
  engine.backward_done(m, 2, false);
  engine.release(m, 2);
  engine.acquire(m, 0, true);
  EXPECT_TRUE(at::equal(t.e.grad(), at::full({10, 4}, 1.0f)));
  t.e.mutable_grad().add_(2.0f);
  engine.backward_done(m, 0, false);
  engine.release(m, 0);
  engine.synchronize(m);
  EXPECT_TRUE(at::equal(store->grad(0), at::zeros_like(store->grad(0)))) << "the host gradients are not used";
  engine.discard_grads(m);
  engine.acquire(m, 0, true);
  EXPECT_TRUE(at::equal(t.e.grad(), at::zeros({10, 4})));
  engine.release(m, 0);
}

// ---------------------------------------------------------------------------------------------------------
// Errors of queued host work

// A host job that fails: the optimizer step of a spilled shard, while no optimizer op is registered.
// A store whose optimizer step always fails: the op rejects a negative learning rate. Python validates
// hyperparameters first, so only this test can reach the engine with one.
std::shared_ptr<ShardStore> failing_step_shards(int n) {
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < n; ++s) shards.push_back(linear_shard(s, 30));
  OptimizerSpec bad;
  bad.lr = -1.0;
  return make_store(shards, /*bf16=*/false, bad);
}

TEST(DeviceEngine, FailedHostStepSurfacesOnSynchronize) {
  auto store = failing_step_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  write_grads(*store, 1);  // a step with nothing to update would not reach the op
  engine.backward_done(m, 1, /*step=*/true);
  engine.release(m, 1);
  EXPECT_THROW(engine.synchronize(m), c10::Error);
  EXPECT_NO_THROW(engine.synchronize(m)) << "an error is reported once";
}

TEST(DeviceEngine, FailedHostStepSurvivesLaterSubmissions) {
  auto store = failing_step_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  write_grads(*store, 1);
  engine.backward_done(m, 1, /*step=*/true);  // queues a job that throws
  engine.release(m, 1);
  engine.acquire(m, 0, true);  // queues shard 0's copy and waits for it: the failed job has run by now
  engine.backward_done(m, 0, /*step=*/false);  // queues another job for the same model
  engine.release(m, 0);
  EXPECT_THROW(engine.synchronize(m), c10::Error)
      << "the failed step's error was lost: DeviceEngine::submit drops finished fences, failed ones included";
}

// ---------------------------------------------------------------------------------------------------------
// Fragmentation: the smallest accepted budget must be enough to train

TEST(DeviceEngine, SmallestAcceptedBudgetTrainsMixedShardSizes) {
  // Three small shards, then a large one: the forward pass caches the small ones below the large one's
  // weights, leaving the large shard's gradients no contiguous range although the budget was accepted.
  std::vector<std::vector<at::Tensor>> shards = {linear_shard(0, 12), linear_shard(1, 12), linear_shard(2, 12),
                                                 linear_shard(3, 112)};
  auto store = make_store(shards);
  const int64_t budget = tight_budget(*store);
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  EXPECT_NO_THROW(run_step(engine, m, *store, 1));
  engine.synchronize(m);
  EXPECT_LE(engine.stats().high_water_bytes, budget);
}

// ---------------------------------------------------------------------------------------------------------
// Optimizer steps: only when the op registrations are linked in

TEST(DeviceEngine, SpilledSgdStepUpdatesTheMasterAndReloads) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, false, sgd);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 3; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  run_step(engine, m, *store, 1, /*check_values=*/true, /*step=*/true);
  engine.synchronize(m);
  const auto grads = expected_grads(*store, 1);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(store->steps_taken(s), 1);
    EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * 0.5, 1e-6, 1e-6)) << "shard " << s;
    EXPECT_TRUE(at::equal(store->grad(s), at::zeros_like(store->grad(s))));
  }
  const auto loads = engine.shard_loads(m);
  engine.acquire(m, 1, false);  // the device copy predates the step: reloaded with the new weights
  expect_bound_to_master(*store, 1);
  engine.release(m, 1);
  EXPECT_EQ(engine.shard_loads(m)[1], loads[1] + 1);
}

TEST(DeviceEngine, ResidentSgdStepIsWrittenBackByFinish) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.25;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, sgd);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, 1 << 24);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true);
  engine.finish(m);
  const auto grads = expected_grads(*store, 1);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(store->steps_taken(s), 1);
    EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * 0.25, 1e-6, 1e-6)) << "shard " << s;
    for (const ParamEntry& e : store->layout(s))
      EXPECT_TRUE(at::equal(e.param.detach().reshape({-1}), store->master(s).narrow(0, e.master_offset, e.numel)));
  }
}

// A scheduled step (lr_scale: the task's schedule at this step) moves by the scaled rate, spilled and resident,
// through backward_done and through clip_and_step.
TEST(DeviceEngine, StepsUseTheScheduledLearningRate) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  for (const bool resident : {false, true}) {
    for (const bool clipped : {false, true}) {
      SCOPED_TRACE(testing::Message() << (resident ? "resident" : "spilled") << (clipped ? ", clipped" : ""));
      auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, sgd);
      std::vector<at::Tensor> before;
      for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
      DeviceEngine engine(kCpu, resident ? int64_t{1} << 24 : tight_budget(*store));
      const int m = engine.add_model(store);
      ASSERT_EQ(engine.resident(m), resident);
      run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/!clipped, /*lr_scale=*/0.25);
      if (clipped) engine.clip_and_step(m, /*max_norm=*/1e9, /*lr_scale=*/0.25);
      engine.finish(m);
      const auto grads = expected_grads(*store, 1);
      for (int s = 0; s < 2; ++s)
        EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * (0.5 * 0.25), 1e-6, 1e-6)) << "shard " << s;
    }
  }
}

TEST(DeviceEngine, SpilledAdamFirstStepMovesByLearningRate) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  OptimizerSpec adam;
  adam.lr = 1e-2;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, adam);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  run_step(engine, m, *store, 1, true, /*step=*/true);
  engine.synchronize(m);
  for (int s = 0; s < 2; ++s) {
    // Step 1 of bias-corrected Adam: m_hat = g, v_hat = g^2, so every trained element moves by lr * sign(g).
    const int64_t n = store->trainable_numel(s);
    const auto grads = expected_grads(*store, 1)[s].narrow(0, 0, n);
    const at::Tensor moved = before[s].narrow(0, 0, n) - grads.sign() * adam.lr;
    EXPECT_TRUE(at::allclose(store->master(s).narrow(0, 0, n), moved, 1e-5, 1e-6)) << "shard " << s;
    EXPECT_EQ(store->steps_taken(s), 1);
  }
}

// The same model and gradients trained once with every shard's step reading its one landed gradient, once
// through the fp32 accumulators (forced by accumulating a zero gradient first): the results must agree
// bit for bit, and only the owner of a borrowed parameter may have spent an accumulator.
TEST(DeviceEngine, SingleMicroBatchStepsReadTheLandedGradientWithoutAnAccumulator) {
  OptimizerSpec adam;
  adam.lr = 1e-2;
  TiedModel single, forced;
  auto direct = make_store(single.shards(), false, adam);
  auto accumulated = make_store(forced.shards(), false, adam);
  for (int s = 0; s < 3; ++s) accumulated->grad(s);  // allocated up front: the step takes the accumulator path
  const int64_t without = direct->host_bytes();
  for (auto* store : {&direct, &accumulated}) {
    DeviceEngine engine(kCpu, tight_budget(**store));
    const int m = engine.add_model(*store);
    for (int step = 0; step < 2; ++step) run_step(engine, m, **store, 1, /*check_values=*/false, /*step=*/true);
    engine.synchronize(m);
  }
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(direct->master(s), accumulated->master(s))) << "shard " << s;
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(direct->state(s, k), accumulated->state(s, k))) << s;
    EXPECT_EQ(direct->steps_taken(s), 2);
  }
  EXPECT_TRUE(direct->has_grad(0)) << "shard 0 owns e, which shard 2 borrows: its gradient is a sum";
  EXPECT_FALSE(direct->has_grad(1));
  EXPECT_FALSE(direct->has_grad(2));
  EXPECT_EQ(direct->host_bytes(), without + direct->owned_numel(0) * 4) << "only shard 0's accumulator was added";
  EXPECT_TRUE(at::equal(direct->grad(0), at::zeros_like(direct->grad(0)))) << "zeroed after its step";
}

// ---------------------------------------------------------------------------------------------------------
// Parameters that receive no gradient: left alone by the step, as torch.optim leaves a parameter whose .grad
// is None (no update, no decay, no state change, no step counted for it)

OptimizerSpec adamw_spec() {
  OptimizerSpec adamw;
  adamw.lr = 1e-2;
  adamw.weight_decay = 0.1;
  adamw.decoupled_weight_decay = true;
  return adamw;
}

// The layout entry of the shard that owns `p`.
const ParamEntry& home_entry(const ShardStore& store, const at::Tensor& p) {
  for (int s = 0; s < store.num_shards(); ++s)
    for (const ParamEntry& e : store.layout(s))
      if (e.owner == s && e.param.is_same(p)) return e;
  ADD_FAILURE() << "parameter not owned by any shard";
  static const ParamEntry none{};
  return none;
}

at::Tensor master_of(ShardStore& store, const at::Tensor& p) {
  const ParamEntry& e = home_entry(store, p);
  return store.master(e.owner).narrow(0, e.master_offset, e.numel).view(p.sizes());
}

at::Tensor state_of(ShardStore& store, const at::Tensor& p, int k) {
  const ParamEntry& e = home_entry(store, p);
  return store.state(e.owner, k).narrow(0, e.master_offset, e.numel).view(p.sizes());
}

int64_t steps_of(const ShardStore& store, const at::Tensor& p) {
  const ParamEntry& e = home_entry(store, p);
  return store.param_steps(e.owner, e.owner_index);
}

// Host state up to date: a spilled model's host jobs done, a resident model's device state brought home.
void settle(DeviceEngine& engine, int model) {
  if (engine.resident(model)) {
    engine.finish(model);
  } else {
    engine.synchronize(model);
  }
}

// One backward visit of `shard` in which exactly the listed parameters receive a gradient (`value` added to
// each, as autograd's accumulation does); the shard's other parameters receive none.
void backward_visit(DeviceEngine& engine, int model, int shard, const std::vector<at::Tensor>& receiving,
                    float value, bool step) {
  engine.acquire(model, shard, /*with_grads=*/true);
  for (const at::Tensor& p : receiving) p.mutable_grad().add_(value);
  engine.backward_done(model, shard, step);
  engine.release(model, shard);
}

std::unique_ptr<DeviceEngine> engine_for(const ShardStore& store, bool resident) {
  return std::make_unique<DeviceEngine>(kCpu, resident ? int64_t{1} << 24 : tight_budget(store));
}

class UnusedParameters : public testing::TestWithParam<bool> {
 protected:
  bool resident() const { return GetParam(); }
  void SetUp() override {
    if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  }
};

TEST_P(UnusedParameters, AutogradDecidesWhichParametersStep) {
  // u and v are reached by the first backward, u and s by the second: the middle parameter s takes its first
  // step in the shard's second, v only one.
  at::Tensor u = param({5}, 1.0), s = param({20}, 2.0), v = param({3}, 3.0);
  const at::Tensor s0 = s.detach().clone(), v0 = v.detach().clone();
  const OptimizerSpec adamw = adamw_spec();
  auto store = make_store({{u, s, v}}, false, adamw);
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, resident());
  ASSERT_EQ(engine->resident(m), resident());
  engine->acquire(m, 0, true);
  (u * u).sum().add((v * 3.0).sum()).backward();
  engine->backward_done(m, 0, /*step=*/true);
  engine->release(m, 0);
  engine->acquire(m, 0, true);
  (u * u).sum().add((s * -2.0).sum()).backward();
  engine->backward_done(m, 0, /*step=*/true);
  engine->release(m, 0);
  settle(*engine, m);

  EXPECT_EQ(store->steps_taken(0), 2);
  EXPECT_EQ(steps_of(*store, u), 2);
  EXPECT_EQ(steps_of(*store, s), 1);
  EXPECT_EQ(steps_of(*store, v), 1);
  // A first step is bias-corrected to move by lr against the gradient's sign, after the decay: s took its
  // first in the shard's second step, and v was neither decayed nor moved by the step that gave it nothing.
  const double decay = 1.0 - adamw.lr * adamw.weight_decay;
  EXPECT_TRUE(at::allclose(master_of(*store, s), s0 * decay + adamw.lr, 1e-6, 1e-7)) << master_of(*store, s);
  EXPECT_TRUE(at::allclose(master_of(*store, v), v0 * decay - adamw.lr, 1e-6, 1e-7)) << master_of(*store, v);
  EXPECT_TRUE(at::allclose(state_of(*store, v, 0), at::full({3}, (1.0 - adamw.beta1) * 3.0), 1e-6, 1e-7))
      << "v's moments are those of its one step";
  EXPECT_TRUE(at::allclose(state_of(*store, v, 1), at::full({3}, (1.0 - adamw.beta2) * 9.0), 1e-6, 1e-9));
}

TEST_P(UnusedParameters, ATiedWeightStepsThroughTheBorrowersUseAlone) {
  TiedModel t;  // shard 0 owns e (borrowed by shard 2) and a; shard 1 owns h; shard 2 owns g
  auto store = make_store(t.shards(), false, adamw_spec());
  const at::Tensor e0 = t.e.detach().clone(), a0 = t.a.detach().clone(), h0 = t.h.detach().clone(),
                   g0 = t.g.detach().clone();
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, resident());
  ASSERT_EQ(engine->resident(m), resident());
  engine->plan(m, {2, 1, 0});
  backward_visit(*engine, m, 2, {t.e}, 1.0f, /*step=*/true);  // only the borrower's use of e
  backward_visit(*engine, m, 1, {}, 1.0f, true);
  backward_visit(*engine, m, 0, {}, 1.0f, true);
  settle(*engine, m);
  EXPECT_FALSE(at::equal(master_of(*store, t.e), e0)) << "e received a gradient through shard 2";
  EXPECT_EQ(steps_of(*store, t.e), 1);
  for (const auto& [p, before] : {std::pair{t.a, a0}, std::pair{t.h, h0}, std::pair{t.g, g0}}) {
    EXPECT_TRUE(at::equal(master_of(*store, p), before));
    EXPECT_EQ(steps_of(*store, p), 0);
    EXPECT_TRUE(at::equal(state_of(*store, p, 0), at::zeros_like(p)));
  }
  for (int s = 0; s < 3; ++s) EXPECT_EQ(store->steps_taken(s), 1) << "shard " << s;
}

TEST_P(UnusedParameters, AGradientInAnyMicroBatchCountsAndDiscardedOnesDoNot) {
  at::Tensor a = param({7}, 1.0), b = param({9}, 2.0);
  auto store = make_store({{a, b}}, false, adamw_spec());
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, resident());
  backward_visit(*engine, m, 0, {a}, 1.0f, /*step=*/false);  // first micro-batch: a only
  backward_visit(*engine, m, 0, {b}, 1.0f, /*step=*/true);   // last micro-batch: b only
  // A micro-batch that failed: its gradient is discarded and must not make a step.
  backward_visit(*engine, m, 0, {a}, 1.0f, false);
  engine->discard_grads(m);
  // After the first step: a resident model's weights are the device values a is bound to, a spilled one's
  // the host master.
  const at::Tensor a1 = (resident() ? a.detach() : master_of(*store, a)).clone();
  backward_visit(*engine, m, 0, {}, 1.0f, true);
  settle(*engine, m);
  EXPECT_EQ(steps_of(*store, a), 1);
  EXPECT_EQ(steps_of(*store, b), 1);
  EXPECT_EQ(store->steps_taken(0), 2);
  EXPECT_TRUE(at::equal(master_of(*store, a), a1)) << "the second step left a alone";
}

TEST_P(UnusedParameters, ClippedStepsLeaveParametersWithoutAGradient) {
  at::Tensor x = param({5}, 1.0), a = param({6}, 2.0), y = param({4}, 3.0);
  auto store = make_store({{x}, {a, y}}, false, adamw_spec());
  const at::Tensor x0 = x.detach().clone(), a0 = a.detach().clone(), y0 = y.detach().clone();
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, resident());
  engine->plan(m, {1, 0});
  backward_visit(*engine, m, 1, {a}, 3.0f, /*step=*/false);
  backward_visit(*engine, m, 0, {}, 3.0f, false);
  EXPECT_NEAR(engine->clip_and_step(m, 1.0), std::sqrt(6.0 * 9.0), 1e-5);
  settle(*engine, m);
  EXPECT_FALSE(at::equal(master_of(*store, a), a0));
  EXPECT_TRUE(at::equal(master_of(*store, x), x0));
  EXPECT_TRUE(at::equal(master_of(*store, y), y0));
  EXPECT_EQ(steps_of(*store, a), 1);
  EXPECT_EQ(steps_of(*store, x), 0);
  EXPECT_EQ(steps_of(*store, y), 0);
}

INSTANTIATE_TEST_SUITE_P(Placement, UnusedParameters, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "Resident" : "Spilled"; });

}  // namespace
