// DeviceEngine's asynchronous paths on a CPU device: gradient regions free once copied out, copies that do
// not wait behind unrelated host jobs (nor behind another model's falling behind), copies that do wait for the
// step they read, prefetch along the plan.
// The host-step threads are held by a gate job, as a long optimizer step would hold them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "engine/device_engine.h"
#include "manual_fence.h"

namespace {

using hydra::engine::DeviceEngine;
using hydra::engine::DeviceEvent;
using hydra::engine::HostWorker;
using hydra::engine::OptimizerSpec;
using hydra::engine::ParamEntry;
using hydra::engine::ShardStore;
using hydra::engine::testing::ManualFence;
using namespace std::chrono_literals;

const c10::Device kCpu("cpu");

// `n` shards of one [rows] parameter each, distinct values.
std::shared_ptr<ShardStore> store_of(int n, int64_t rows, OptimizerSpec optimizer = OptimizerSpec{}) {
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < n; ++s) shards.push_back({at::arange(rows, at::kFloat).add(100.0 * s).set_requires_grad(true)});
  return std::make_shared<ShardStore>(shards, optimizer, /*bf16=*/false, /*pin_memory=*/false);
}

int64_t tight_budget(const ShardStore& store) { return DeviceEngine::min_spilled_bytes(store) + 2 * 512; }

// Host-step threads with every thread held until open() (or the end of the test).
struct GatedHostSteps {
  std::shared_ptr<HostWorker> worker = std::make_shared<HostWorker>(1);
  ManualFence gate;
  bool opened = false;
  GatedHostSteps() {
    worker->submit([fence = gate.fence]() -> DeviceEvent {
      fence.wait();
      return nullptr;
    });
  }
  void open() {
    if (!opened) gate.finish();
    opened = true;
  }
  ~GatedHostSteps() { open(); }
};

// Runs `call` on another thread; whether it returned within `limit` while the host steps stay held. The gate
// is opened afterwards in any case, so a test that fails does not hang.
template <typename F>
bool returns_while_held(GatedHostSteps& steps, F call, std::chrono::milliseconds limit = 10s) {
  auto done = std::async(std::launch::async, call);
  const bool in_time = done.wait_for(limit) == std::future_status::ready;
  steps.open();
  done.get();
  return in_time;
}

void fill_grads(ShardStore& store, int shard, float value) {
  for (const ParamEntry& e : store.layout(shard)) e.param.mutable_grad().fill_(value);
}

TEST(AsyncEngine, AGradientRegionIsFreeOnceCopiedOutNotAfterItsHostJob) {
  GatedHostSteps steps;
  auto store = store_of(2, 1024);
  DeviceEngine engine(kCpu, tight_budget(*store), steps.worker);  // room for one shard's weights and gradients
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  fill_grads(*store, 1, 1.5f);
  engine.backward_done(m, 1, /*step=*/false);  // its accumulation waits for the held host thread
  engine.release(m, 1);
  // Shard 0's gradients need the range shard 1's just left.
  EXPECT_TRUE(returns_while_held(steps, [&] { engine.acquire(m, 0, true); }))
      << "allocating gradients waited for the previous shard's host job";
  fill_grads(*store, 0, 2.5f);
  engine.backward_done(m, 0, false);
  engine.release(m, 0);
  engine.synchronize(m);
  EXPECT_TRUE(at::equal(store->grad(1).narrow(0, 0, 1024), at::full({1024}, 1.5f)));
  EXPECT_TRUE(at::equal(store->grad(0).narrow(0, 0, 1024), at::full({1024}, 2.5f)));
}

TEST(AsyncEngine, APrefetchDoesNotWaitBehindAnotherModelsHostJob) {
  GatedHostSteps steps;
  auto a = store_of(1, 1024), b = store_of(2, 1024);
  DeviceEngine engine(kCpu, 1 << 20, steps.worker, 0.0);
  const auto spilled = DeviceEngine::Residency::kSpilled;
  const int ma = engine.add_model(a, spilled), mb = engine.add_model(b, spilled);
  engine.plan({{ma, 0}, {mb, 0}});
  engine.acquire(ma, 0, true);
  fill_grads(*a, 0, 1.0f);
  engine.backward_done(ma, 0, false);  // model a's host job is held
  engine.release(ma, 0);
  engine.prefetch(mb, 0);
  EXPECT_TRUE(returns_while_held(steps, [&] { engine.acquire(mb, 0, false); }))
      << "model b's weights waited behind model a's host job";
  EXPECT_TRUE(at::equal(b->layout(0)[0].param.detach(), b->master(0).narrow(0, 0, 1024)));
  engine.release(mb, 0);
  engine.synchronize(ma);
}

TEST(AsyncEngine, OneModelsHostJobsFallingBehindDoNotHoldUpAnothersGradientCopies) {
  GatedHostSteps steps;
  auto a = store_of(4, 1024), b = store_of(1, 2048);  // b's landing buffer is twice the size of each of a's
  DeviceEngine engine(kCpu, 1 << 22, steps.worker);
  const auto spilled = DeviceEngine::Residency::kSpilled;
  const int ma = engine.add_model(a, spilled), mb = engine.add_model(b, spilled);
  // The arena is the whole budget: model b's regions need not reuse ones whose gradient copy-out is still queued.
  engine.expect_arrivals();
  engine.plan({{ma, 3}, {ma, 2}, {ma, 1}, {ma, 0}, {mb, 0}});
  // Model a's host jobs are held: its three landing buffers stay taken and its fourth gradient waits for one.
  for (int s : {3, 2, 1, 0}) {
    engine.acquire(ma, s, true);
    fill_grads(*a, s, 1.0f + s);
    engine.backward_done(ma, s, false);
    engine.release(ma, s);
  }
  engine.acquire(mb, 0, true);
  fill_grads(*b, 0, 7.0f);
  engine.backward_done(mb, 0, false);
  engine.release(mb, 0);
  const int64_t landed = 3 * 1024 * 4 + 2048 * 4;  // a's three buffers and b's one
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (engine.stats().staging_bytes < landed && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(engine.stats().staging_bytes, landed)
      << "model b's gradient did not land in its own buffer while model a's host jobs were held";
  steps.open();
  engine.synchronize(ma);
  engine.synchronize(mb);
  for (int s : {0, 1, 2, 3}) EXPECT_TRUE(at::equal(a->grad(s).narrow(0, 0, 1024), at::full({1024}, 1.0f + s)));
  EXPECT_TRUE(at::equal(b->grad(0).narrow(0, 0, 2048), at::full({2048}, 7.0f)));
}

TEST(AsyncEngine, ACopyWaitsForTheStepOfTheShardItReads) {
  if (!c10::Dispatcher::singleton().findSchema({"hydra::sgd_step", ""}).has_value())
    GTEST_SKIP() << "hydra::sgd_step is not registered in this build";
  GatedHostSteps steps;
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  auto store = store_of(2, 256, sgd);
  DeviceEngine engine(kCpu, 1 << 20, steps.worker);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled);
  engine.plan(m, {0, 1, 0});
  engine.acquire(m, 0, true);
  fill_grads(*store, 0, 2.0f);
  engine.backward_done(m, 0, /*step=*/true);  // held
  engine.release(m, 0);
  engine.prefetch_ahead();  // shard 1 comes in; shard 0's copy would wait for its step: skipped
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1}));
  auto acquired = std::async(std::launch::async, [&] { engine.acquire(m, 0, false); });
  EXPECT_EQ(acquired.wait_for(50ms), std::future_status::timeout) << "copied before the step it must read";
  steps.open();
  acquired.get();
  const at::Tensor stepped = at::arange(256, at::kFloat).sub(1.0);  // w - 0.5 * 2
  EXPECT_TRUE(at::equal(store->layout(0)[0].param.detach(), stepped));
  engine.release(m, 0);
  engine.synchronize(m);
}

TEST(AsyncEngine, PrefetchAheadFollowsThePlanUpToItsBytes) {
  auto store = store_of(4, 1024);
  const int64_t shard_bytes = 1024 * 4;
  DeviceEngine engine(kCpu, 1 << 20);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled);
  engine.plan(m, {0, 1, 2, 3, 2});
  engine.acquire(m, 0, false);
  engine.prefetch_ahead(0);
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 0, 0})) << "0 bytes: the next planned shard only";
  engine.prefetch_ahead(shard_bytes);  // shard 2, the first not on the device; shard 3 would pass the bytes
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 0}));
  engine.prefetch_ahead();
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 1})) << "shard 2's second visit is cached";
  engine.release(m, 0);
  for (int s : {1, 2, 3}) {
    engine.acquire(m, s, false);
    EXPECT_TRUE(at::equal(store->layout(s)[0].param.detach(), store->master(s).narrow(0, 0, 1024)));
    engine.release(m, s);
  }
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1, 1}));
}

TEST(AsyncEngine, StagingBuffersAreAFewShardsOfHostMemory) {
  auto store = store_of(6, 1024);
  DeviceEngine engine(kCpu, 1 << 20);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled);
  std::vector<int> order{5, 4, 3, 2, 1, 0};
  engine.plan(m, order);
  for (int s : order) {
    engine.acquire(m, s, true);
    fill_grads(*store, s, 1.0f);
    engine.backward_done(m, s, false);
    engine.release(m, s);
  }
  engine.synchronize(m);
  EXPECT_GT(engine.stats().staging_bytes, 0);
  EXPECT_LE(engine.stats().staging_bytes, 3 * 1024 * 4) << "the model's three landing buffers";
  engine.finish(m);
  engine.release_model(m);
  EXPECT_EQ(engine.stats().staging_bytes, 0) << "a released model keeps no landing buffer";
  // Its store is gone: waiting for it, or taking its state home, is refused, not a read of freed state.
  EXPECT_THROW(engine.synchronize(m), c10::Error);
  EXPECT_THROW(engine.snapshot(m), c10::Error);
  EXPECT_THROW(engine.discard_grads(m), c10::Error);
}

TEST(AsyncEngine, AStoreGoesWithItsEngineAfterSteps) {
  // Each store remembers its shards' last steps; a step's job captures the store. The Fence must not keep
  // the job, or every trained model's host state would outlive its run.
  if (!c10::Dispatcher::singleton().findSchema({"hydra::sgd_step", ""}).has_value())
    GTEST_SKIP() << "hydra::sgd_step is not registered in this build";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  std::weak_ptr<ShardStore> watch;
  {
    auto store = store_of(2, 64, sgd);
    watch = store;
    DeviceEngine engine(kCpu, 1 << 20);
    const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled);
    engine.plan(m, {1, 0});
    for (int s : {1, 0}) {
      engine.acquire(m, s, true);
      fill_grads(*store, s, 1.0f);
      engine.backward_done(m, s, /*step=*/true);
      engine.release(m, s);
    }
    engine.finish(m);
  }
  EXPECT_TRUE(watch.expired()) << "the store outlived its engine and every other owner";
}

TEST(AsyncEngine, AShardBorrowingATiedWeightIsReloadedAfterTheOwnersStep) {
  // Shard 1 borrows shard 0's weight (a tied embedding). Prefetched while shard 0 computes its backward, its
  // copy holds the tied weight from before shard 0's step: it must not count as current afterwards.
  if (!c10::Dispatcher::singleton().findSchema({"hydra::sgd_step", ""}).has_value())
    GTEST_SKIP() << "hydra::sgd_step is not registered in this build";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  const at::Tensor tied = at::arange(64, at::kFloat).set_requires_grad(true);
  const at::Tensor own = at::arange(64, at::kFloat).add(1000.0).set_requires_grad(true);
  auto store = std::make_shared<ShardStore>(std::vector<std::vector<at::Tensor>>{{tied}, {own, tied}}, sgd,
                                            /*bf16=*/false, /*pin_memory=*/false);
  DeviceEngine engine(kCpu, 1 << 20);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled);
  engine.plan(m, {1, 0, 1});
  engine.acquire(m, 1, true);
  fill_grads(*store, 1, 1.0f);
  engine.backward_done(m, 1, /*step=*/true);
  engine.release(m, 1);
  engine.synchronize(m);
  engine.acquire(m, 0, true);
  engine.prefetch_ahead();  // shard 1's next visit: its copy reads the tied weight before shard 0 steps
  fill_grads(*store, 0, 1.0f);
  engine.backward_done(m, 0, /*step=*/true);
  engine.release(m, 0);
  engine.synchronize(m);
  engine.acquire(m, 1, false);
  for (const ParamEntry& e : store->layout(1)) {
    const at::Tensor expected = store->transfer_source(e.owner).narrow(0, e.master_offset, e.numel).view(e.param.sizes());
    EXPECT_TRUE(at::equal(e.param.detach(), expected)) << "entry at device offset " << e.device_offset;
  }
  engine.release(m, 1);
  EXPECT_EQ(engine.shard_loads(m)[1], 3) << "loaded, prefetched, and loaded again after the owner's step";
}

}  // namespace

