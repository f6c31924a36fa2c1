// A spilled model's resident shards (SpilledModel, engine/shard_homes.h): their state lives on the device and
// steps there, the other shards' on the host; the model ends as it would with every shard spilled.
#include "device_engine_helpers.h"
#include "engine/clip_norm.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

using hydra::engine::ClipNorm;
using hydra::engine::closed_under_ties;
using hydra::engine::place_models;

// Four shards; shard 3 borrows shard 0's `e` (a tied embedding and head).
struct EndsTied {
  at::Tensor e = param({10, 4}, 1.0);
  std::vector<std::vector<at::Tensor>> shards() const {
    return {{e, param({7}, 3.0)}, linear_shard(1, 12), linear_shard(2, 20), {param({6}, 6.0), e}};
  }
};

// Three steps of two micro-batches (the last clipped when `clip`), with the given shards resident.
Trained train(const std::vector<int>& resident_shards, bool clip) {
  auto store = make_store(EndsTied().shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, resident_shards);
  EXPECT_EQ(engine.resident_shards(m), resident_shards);
  for (int step = 0; step < 3; ++step) {
    const bool clipped = clip && step == 2;
    run_step(engine, m, *store, 2, /*check_values=*/false, /*step=*/!clipped, 0.5, false, add_grads);
    if (clipped) engine.clip_and_step(m, 0.5, 0.5)->value();
  }
  return finish_and_copy(engine, m, *store);
}

TEST(ResidentShards, AModelWithResidentEndsEndsAsOneWithEveryShardSpilled) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  for (bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipped" : "not clipped");
    expect_same(train({0, 3}, clip), train({}, clip));
  }
}

TEST(ResidentShards, AreUploadedOnceAndNeverEvictedOrCopiedBack) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  auto store = make_store(EndsTied().shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store));
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {0, 3});
  for (int step = 0; step < 2; ++step)
    run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);
  engine.synchronize(m);
  const auto loads = engine.shard_loads(m);
  EXPECT_EQ(loads[0], 1);
  EXPECT_EQ(loads[3], 1);
  EXPECT_GT(loads[1], 1) << "a spilled shard is copied in again after its step";
  // Gradients go out for the spilled shards only.
  const int64_t spilled_grads = (store->gradient_numel(1) + store->gradient_numel(2)) * 4 * 2;
  EXPECT_EQ(engine.stats().device_to_host_bytes, spilled_grads);
  engine.finish(m);
}

TEST(ResidentShards, AfterAFailedHostJobAClippedStepTakesNoNormAndStepsNoShard) {
  // Shard 1 (spilled) steps on the host and its job fails (the op rejects a negative learning rate): the norm
  // taken for the resident shards' sake must report it, and no shard may step.
  OptimizerSpec bad;
  bad.lr = -1.0;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, false, bad);
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {0, 2});
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
  engine.finish(m);  // the resident shards' state home
  EXPECT_TRUE(at::equal(store->master(0), before)) << "a resident shard stepped after its model's failed job";
  EXPECT_EQ(store->steps_taken(0), 0);
  EXPECT_EQ(store->steps_taken(2), 0);
}

TEST(ResidentShards, ABadListOrAResidentBorrowerOfASpilledOwnerIsRefusedChangingNothing) {
  auto store = make_store(EndsTied().shards());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int64_t free = engine.free_bytes();
  for (const std::vector<int>& bad : {std::vector<int>{3}, {0, 1, 2, 3}, {0, 0, 3}, {4}}) {
    EXPECT_THROW(engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, bad), c10::Error);
  }
  EXPECT_THROW(engine.add_model(store, DeviceEngine::Residency::kAuto, -1, {0, 3}), c10::Error)
      << "resident shards are a spilled model's";
  EXPECT_EQ(engine.free_bytes(), free);
  EXPECT_EQ(closed_under_ties(*store, {0}), (std::vector<int>{0, 3}));
  EXPECT_EQ(closed_under_ties(*store, {1}), (std::vector<int>{1}));
}

TEST(ResidentShards, TheirHomesCountAgainstTheBudgetAndAreGivenBackOnRelease) {
  auto store = make_store(EndsTied().shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int64_t free = engine.free_bytes();
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {0, 3});
  const int64_t homes = hydra::engine::SpilledModel::homes_need(*store, {0, 3});
  const int64_t working_set = hydra::engine::SpilledModel::spilled_need(*store, {0, 3});
  EXPECT_EQ(engine.free_bytes(), free - homes - working_set);
  engine.finish(m);
  engine.release_model(m);
  EXPECT_EQ(engine.free_bytes(), free - working_set) << "the spilled working set stays reserved, as for any model";
}

TEST(Placement, OnOneDeviceASpilledModelKeepsItsEndsResidentWhereTheyFit) {
  auto store = make_store(EndsTied().shards(), false, adamw_spec());
  const int64_t homes = hydra::engine::SpilledModel::homes_need(*store, {0, 3});
  const int64_t working_set = hydra::engine::SpilledModel::spilled_need(*store, {0, 3});
  ASSERT_LT(homes + working_set, DeviceEngine::resident_need(*store));
  for (bool ends : {false, true}) {
    DeviceEngine engine(kCpu, homes + working_set);
    const auto placed = place_models({&engine}, {store}, {"m"}, {}, {ends});
    EXPECT_EQ(placed[0].resident_device, -1);
    EXPECT_EQ(placed[0].resident_shards, ends ? std::vector<int>({0, 3}) : std::vector<int>{});
    EXPECT_EQ(placed[0].home_device, ends ? 0 : -1);
    EXPECT_EQ(engine.resident_shards(0), placed[0].resident_shards);
  }
  DeviceEngine tight(kCpu, homes + working_set - 1);  // the ends do not fit: spilled whole
  EXPECT_TRUE(place_models({&tight}, {store}, {"m"}, {}, {true})[0].resident_shards.empty());
  DeviceEngine a(kCpu, 4 * (homes + working_set)), b(kCpu, 4 * (homes + working_set));
  auto big = make_store({linear_shard(0, 400), linear_shard(1, 400), linear_shard(2, 400)});
  const auto two = place_models({&a, &b}, {big}, {"big"}, {}, {true});
  EXPECT_TRUE(two[0].resident_shards.empty()) << "on several devices a spilled model runs anywhere";
  EXPECT_EQ(two[0].model_ids, (std::vector<int>{0, 0}));
}

TEST(Placement, BesideAnotherSpilledModelEndsAreResidentOnlyWhereEveryWeightStaysCached) {
  auto first = make_store(EndsTied().shards(), false, adamw_spec());
  auto second = make_store(EndsTied().shards(), false, adamw_spec());
  const int64_t homes = hydra::engine::SpilledModel::homes_need(*first, {0, 3});
  const int64_t working_set = DeviceEngine::spilled_need(*first);
  auto cached = [](const ShardStore& store, const std::vector<int>& shards) {  // as the arena caches them
    int64_t bytes = 0;
    for (int s : shards) bytes += store.device_numel(s) * 4 + 512;
    return bytes;
  };
  // The first model's ends, the largest working set, the second model's every shard and the first's other
  // shards cached at once.
  const int64_t cache_room = homes + working_set + cached(*second, {0, 1, 2, 3}) + cached(*first, {1, 2});
  ASSERT_LT(cache_room, DeviceEngine::resident_need(*first) + working_set) << "neither model fits whole";
  DeviceEngine tight(kCpu, cache_room - 1);
  auto placed = place_models({&tight}, {first, second}, {"a", "b"}, {}, {true, true});
  EXPECT_TRUE(placed[0].resident_shards.empty()) << "its homes would take room that caches the other's weights";
  EXPECT_TRUE(placed[1].resident_shards.empty());
  DeviceEngine roomy(kCpu, cache_room);
  placed = place_models({&roomy}, {first, second}, {"a", "b"}, {}, {true, true});
  EXPECT_EQ(placed[0].resident_shards, (std::vector<int>{0, 3}));
}

}  // namespace
}  // namespace engine_test
