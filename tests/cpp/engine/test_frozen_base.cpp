// A frozen base several models share (DeviceEngine::add_base): held once, copied in once while it stays cached,
// each user's own parameters bound to its copy in the user's units.
#include "device_engine_helpers.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

// The base: two shards of frozen weights. Each user: two shards of its own, trainable.
std::shared_ptr<ShardStore> base_store() {
  return make_store({{param({6, 8}, 1.0, false)}, {param({5, 8}, 2.0, false), param({5}, 3.0, false)}});
}

struct User {
  std::shared_ptr<ShardStore> store = equal_shards(2, 4);
  // Its own copies of the base's weights, the values equal.
  std::vector<std::vector<at::Tensor>> frozen = {{param({6, 8}, 1.0, false)},
                                                 {param({5, 8}, 2.0, false), param({5}, 3.0, false)}};
};

TEST(FrozenBase, IsCopiedOnceForItsUsersAndBindsEachUsersOwnParameters) {
  auto base = base_store();
  User a, b;
  DeviceEngine engine(kCpu, 1 << 20);
  const int id = engine.add_base(base);
  const int ma = engine.add_model(a.store, DeviceEngine::Residency::kSpilled, -1, {}, id);
  const int mb = engine.add_model(b.store, DeviceEngine::Residency::kSpilled, -1, {}, id);
  engine.use_base(ma, id, a.frozen);
  engine.use_base(mb, id, b.frozen);
  for (int round = 0; round < 2; ++round) {
    for (int m : {ma, mb}) {
      User& user = m == ma ? a : b;
      engine.plan({{m, 0}, {m, 1}});
      for (int s = 0; s < 2; ++s) {
        engine.acquire(m, s, /*with_grads=*/false);
        for (size_t i = 0; i < user.frozen[s].size(); ++i) {
          const at::Tensor& p = user.frozen[s][i];
          EXPECT_TRUE(at::equal(p, base->layout(s)[i].param)) << "shard " << s << " bound to the base's copy";
          EXPECT_NE(p.data_ptr(), base->master(s).data_ptr()) << "a view of the device copy, not of the host's";
        }
        engine.release(m, s);
      }
    }
  }
  // Both users' eight visits of each base shard copied it once: the budget caches it.
  EXPECT_EQ(engine.shard_loads(id), (std::vector<int64_t>{1, 1}));
  EXPECT_THROW(engine.release_model(id), c10::Error);  // still used
  engine.release_model(ma);
  engine.release_model(mb);
  engine.release_model(id);
}

TEST(FrozenBase, RefusesWhatDoesNotMatchAndAUserWithoutItsParameters) {
  auto base = base_store();
  User a;
  DeviceEngine engine(kCpu, 1 << 20);
  EXPECT_THROW(engine.add_base(equal_shards(2)), c10::Error);  // trainable weights are not a base
  const int id = engine.add_base(base);
  EXPECT_THROW(engine.add_model(equal_shards(3), DeviceEngine::Residency::kSpilled, -1, {}, id), c10::Error);
  const int plain = engine.add_model(equal_shards(2), DeviceEngine::Residency::kSpilled);
  EXPECT_THROW(engine.use_base(plain, id, a.frozen), c10::Error);  // added without the base
  const int m = engine.add_model(a.store, DeviceEngine::Residency::kSpilled, -1, {}, id);
  EXPECT_THROW(engine.acquire(m, 0, false), c10::Error);  // its parameters were never named
  EXPECT_EQ(engine.shard_loads(id), (std::vector<int64_t>{0, 0}));
  EXPECT_THROW(engine.use_base(m, id, {{param({7, 8}, 1.0, false)}, a.frozen[1]}), c10::Error);
  EXPECT_THROW(engine.use_base(m, id, {a.frozen[0]}), c10::Error);
  engine.use_base(m, id, a.frozen);
  engine.acquire(m, 1, true);
  engine.release(m, 1);
}

TEST(FrozenBase, CountsItsShardInItsUsersWorkingSet) {
  auto base = base_store();
  User a;
  const int64_t own = hydra::engine::SpilledModel::spilled_need(*a.store, {});
  const int64_t with_base = hydra::engine::SpilledModel::spilled_need(*a.store, {}, base.get());
  // The users' shards are alike; beside shard 1 a unit holds the base's larger shard.
  EXPECT_GT(base->device_numel(1), base->device_numel(0));
  EXPECT_EQ(with_base, own + base->device_numel(1) * 4 + 512);
  DeviceEngine tight(kCpu, own);
  const int id = tight.add_base(base);
  EXPECT_THROW(tight.add_model(a.store, DeviceEngine::Residency::kSpilled, -1, {}, id), c10::Error);
  DeviceEngine enough(kCpu, with_base);
  const int id2 = enough.add_base(base);
  enough.add_model(a.store, DeviceEngine::Residency::kSpilled, -1, {}, id2);
}

TEST(FrozenBase, AUserIsResidentOnlyWhereTheWholeBaseStaysCachedBesideIt) {
  auto base = base_store();
  int64_t base_cached = 0;
  for (int s = 0; s < base->num_shards(); ++s) base_cached += base->device_numel(s) * 4 + 512;
  User a;
  const int64_t working_set = hydra::engine::SpilledModel::spilled_need(*a.store, {0, 1}, base.get());
  const int64_t tight = DeviceEngine::resident_need(*a.store) + working_set;
  for (const int64_t budget : {tight, tight + base_cached}) {
    DeviceEngine engine(kCpu, budget);
    const int id = engine.add_base(base);
    const auto placed = hydra::engine::place_models({&engine}, {a.store}, {"a"}, {}, {}, {id});
    EXPECT_EQ(placed[0].resident_device, budget == tight ? -1 : 0) << "budget " << budget;
  }
}

}  // namespace
}  // namespace engine_test
