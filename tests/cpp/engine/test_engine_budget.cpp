// DeviceEngine on the CPU device: sizing, budgets, models arriving after the start and released ones.
#include "device_engine_helpers.h"

namespace {

using namespace engine_test;

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
  const int s = engine.add_model(spilled, DeviceEngine::Residency::kSpilled);
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

}  // namespace

namespace {

using namespace engine_test;

// A device whose memory is below its budget: the arena cannot be made when the resident model is uploaded.
// The model must not count as uploaded: its gradients are discarded and its weights written back from the
// store, as if it had never been on the device (a re-plan then spills it).
TEST(DeviceEngine, AResidentUploadThatFailsLeavesTheModelAsNeverUploaded) {
  auto store = equal_shards(3);
  const at::Tensor before = store->master(1).clone();
  DeviceEngine engine(kCpu, int64_t{1} << 50);  // more than any host can allocate
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  engine.expect_arrivals();  // the arena takes the whole budget
  EXPECT_THROW(engine.acquire(m, 0, /*with_grads=*/true), c10::Error);
  EXPECT_NO_THROW(engine.discard_grads(m));
  EXPECT_NO_THROW(engine.snapshot(m));
  EXPECT_NO_THROW(engine.finish(m));
  EXPECT_TRUE(at::equal(store->master(1), before));
  EXPECT_THROW(engine.acquire(m, 0, false), c10::Error) << "still no arena: the upload is tried again, and fails";
  EXPECT_NO_THROW(engine.release_model(m));
}

}  // namespace
