// A tied weight whose owner is resident and whose borrower is spilled (a resident embedding, its head host- or
// device-stepped): the borrower's unit reads the weight in the owner's home and sums its gradient there, copying
// none of it either way; the model ends as with every shard stepped on the host. A resident borrower of a spilled
// owner is refused, and so is a spilled borrower with nothing of its own beside a resident owner.
#include <algorithm>
#include <string>

#include "device_steps_helpers.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

using hydra::engine::place_models;
using hydra::engine::SpilledModel;

TEST(ResidentTies, ASpilledBorrowerOfAResidentOwnerEndsAsOnTheHost) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  expect_tied_placements_end_as_on_the_host({{{0}, {}}, {{0}, {3}}, {{0}, {1, 2, 3}}, {{0, 1}, {2}}},
                                            {{{0}, {}}, {{0}, {3}}, {{0}, {2, 3}}});
}

TEST(ResidentTies, TheBorrowerCopiesInAndSendsOutOnlyWhatItOwns) {
  auto store = make_store(tied_shards(), false, adamw_spec());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
  const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {0});
  EXPECT_TRUE(store->summed_on_device(0)) << "the tie's gradient sums in the owner's home";
  EXPECT_EQ(store->host_gradient_numel(3), store->trainable_numel(3));
  run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 0.5, false, add_grads);
  engine.synchronize(m);
  int64_t in = 0, out = 0;
  for (int s = 1; s < 3; ++s) {
    in += store->device_numel(s) * 4 * engine.shard_loads(m)[s];
    out += store->gradient_numel(s) * 4;
  }
  in += store->owned_numel(3) * 4 * engine.shard_loads(m)[3];  // the head's own weights, never the tied one
  out += store->trainable_numel(3) * 4;
  const int64_t home = hydra::engine::ShardHomes::upload_bytes(*store, 0);
  EXPECT_EQ(engine.stats().host_to_device_bytes, home + in);
  EXPECT_EQ(engine.stats().device_to_host_bytes, out);
  EXPECT_FALSE(store->has_grad(0) || store->has_kept(0)) << "the host sums nothing of the tie";
  engine.finish(m);
  // Its visits hold only what they copy in: the arena caches less, and its working set counts no room for the tie.
  const int64_t own = (store->owned_numel(3) + 15) / 16 * 16;
  EXPECT_EQ(SpilledModel::visit_numel(*store, {0}, 3), own);
  EXPECT_EQ(SpilledModel::visit_numel(*store, {}, 3), store->device_numel(3));
  EXPECT_EQ(SpilledModel::visit_numel(*store, {0, 3}, 2), store->device_numel(2));
  EXPECT_EQ(SpilledModel::cached_need(*store, {}) - SpilledModel::cached_need(*store, {0}),
            store->device_numel(0) * 4 + 512 + (store->device_numel(3) - own) * 4);
  auto large_head = make_store(tied_shards_large_head(), false, adamw_spec());
  const int64_t head = SpilledModel::visit_numel(*large_head, {0}, 3);
  EXPECT_LT(head, large_head->device_numel(3));
  EXPECT_EQ(SpilledModel::spilled_need(*large_head, {0}), 2 * (head * 4 + 512)) << "the head, the largest shard";
}

TEST(ResidentTies, AResidentBorrowerOfASpilledOwnerOrAHeadAloneApartFromItsOwnerIsRefused) {
  auto tied = make_store(tied_shards(), false, adamw_spec());
  EXPECT_EQ(SpilledModel::resident_shards_error(*tied, {0}), "");
  EXPECT_EQ(SpilledModel::resident_shards_error(*tied, {0, 3}), "");
  EXPECT_EQ(SpilledModel::resident_shards_error(*tied, {3}),
            "resident shard 3 borrows a tied weight from shard 0, which is spilled: a resident borrower's owner is "
            "resident too");
  auto alone = make_store(tied_head_alone(), false, adamw_spec());
  EXPECT_EQ(SpilledModel::resident_shards_error(*alone, {0}),
            "shard 3 has nothing of its own to train and borrows a tied weight from resident shard 0: such a "
            "borrower is resident with its owner");
  EXPECT_EQ(SpilledModel::resident_shards_error(*alone, {0, 3}), "");
  // A frozen tie: the head alone would visit with nothing at all in its region.
  const at::Tensor frozen = param({10, 4}, 1.0, /*trainable=*/false);
  auto frozen_alone = make_store({{frozen, param({7}, 3.0)}, linear_shard(1, 12), linear_shard(2, 20), {frozen}},
                                 false, adamw_spec());
  EXPECT_EQ(SpilledModel::resident_shards_error(*frozen_alone, {0}),
            "shard 3 has nothing of its own to train and borrows a tied weight from resident shard 0: such a "
            "borrower is resident with its owner");
  EXPECT_EQ(SpilledModel::with_tied_owners(*frozen_alone, {0}), (std::vector<int>{0, 3}));
  EXPECT_EQ(SpilledModel::with_tied_owners(*tied, {3}), (std::vector<int>{0, 3}));
  EXPECT_EQ(SpilledModel::with_tied_owners(*tied, {0}), (std::vector<int>{0}));
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*tied) * 2);
  const int64_t free = engine.free_bytes();
  EXPECT_THROW(engine.add_model(tied, DeviceEngine::Residency::kSpilled, -1, {3}), c10::Error);
  EXPECT_THROW(engine.add_model(alone, DeviceEngine::Residency::kSpilled, -1, {0}), c10::Error);
  EXPECT_EQ(engine.free_bytes(), free) << "a refusal takes nothing";
  EXPECT_FALSE(tied->summed_on_device(0));
}

// The engine's rule keeps a tie resident whole or not at all; the lane model's wish for the owner alone is granted
// where its home fits (more_homes grows resident shards by their tied weights' owners, never by borrowers).
TEST(ResidentTies, PlacementGrantsAWishForTheOwnerAloneWhereItsHomeFits) {
  using hydra::engine::ShardWishes;
  auto store = make_store(tied_shards(), false, adamw_spec());
  const int64_t owner = SpilledModel::homes_need(*store, {0}) + SpilledModel::spilled_need(*store, {0});
  const int64_t both = SpilledModel::homes_need(*store, {0, 3}) + SpilledModel::spilled_need(*store, {0, 3});
  ASSERT_LT(owner, both);
  DeviceEngine rule(kCpu, both - 1);
  EXPECT_TRUE(place_models({&rule}, {store}, {"m"}, {}, {true})[0].resident_shards.empty()) << "the rule: a tie whole";
  DeviceEngine wished(kCpu, owner), less(kCpu, owner - 1), head(kCpu, both);
  const std::vector<ShardWishes> owner_wish{{{0}, {}}};
  EXPECT_EQ(place_models({&wished}, {store}, {"m"}, {}, {true}, {}, owner_wish)[0].resident_shards,
            (std::vector<int>{0}));
  EXPECT_EQ(wished.resident_shards(0), (std::vector<int>{0}));
  EXPECT_TRUE(place_models({&less}, {store}, {"m"}, {}, {true}, {}, owner_wish)[0].resident_shards.empty());
  const std::vector<ShardWishes> head_wish{{{3}, {}}};
  EXPECT_EQ(place_models({&head}, {store}, {"m"}, {}, {false}, {}, head_wish)[0].resident_shards,
            (std::vector<int>{0, 3}))
      << "a borrower wished resident brings its owner";
  auto alone = make_store(tied_head_alone(), false, adamw_spec());
  DeviceEngine head_alone(kCpu, SpilledModel::homes_need(*alone, {0, 3}) + SpilledModel::spilled_need(*alone, {0, 3}));
  EXPECT_EQ(place_models({&head_alone}, {alone}, {"m"}, {}, {false}, {}, owner_wish)[0].resident_shards,
            (std::vector<int>{0, 3}))
      << "a head with nothing of its own stays with its owner";
}

}  // namespace
}  // namespace engine_test
