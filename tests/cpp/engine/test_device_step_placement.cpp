// Where a spilled model's shards are stepped on the device, and what the lane model counts of them: the placement
// grants wished device steps and resident shards within the budget (engine/placement.h), and the lane model
// (core/lanes.h) prices a device step's room and copies as the engine takes them (test_device_steps.cpp has the steps).
#include <string>
#include <vector>

#include "core/lanes.h"
#include "device_steps_helpers.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

using namespace hydra::engine;

// What the lane model (core/lanes.h) asks of the room for a device-stepped shard, beyond the working set every room
// leaves out, is what the engine's budget asks, up to the regions' alignment: else it plans steps the engine refuses.
TEST(DeviceSteps, TheLaneModelCountsTheRoomOfADeviceStepAsTheEngineDoes) {
  for (bool bf16 : {false, true})
    for (bool steps_after_each_backward : {false, true}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + (steps_after_each_backward ? ", one backward a step" : ""));
      auto store = make_store({{param({4000}, 1.0)}, linear_shard(1, 12)}, bf16, adamw_spec());
      store->set_steps_after_each_backward(steps_after_each_backward);
      const int64_t engine = SpilledModel::held_grads_need(*store, {0}) +
                             SpilledModel::spilled_need(*store, {}, nullptr, {0}) - DeviceEngine::spilled_need(*store);
      const hydra::core::ShardShape shard{0.0, 0.0, store->device_numel(0), store->gradient_numel(0),
                                          store->trainable_numel(0)};
      const double weight = bf16 ? 2.0 : 4.0;
      const hydra::core::StepBytes bytes{weight, 8.0 + (bf16 ? 4.0 : 0.0)};
      const bool sums = !steps_after_each_backward;
      const int64_t lanes = hydra::core::held_bytes(shard, hydra::core::StepPlace::kDevice, bytes, sums) +
                            hydra::core::step_room(shard, hydra::core::StepPlace::kDevice, bytes, sums);
      EXPECT_NEAR(static_cast<double>(engine), static_cast<double>(lanes), 4 * 512.0);
    }
}

// What the lane model forecasts a device step copies in and out is what the engine copies: in fp32 too, where the
// master is the weight and comes in beside the moments.
TEST(DeviceSteps, TheLaneModelCountsTheCopiesOfADeviceStepAsTheEngineDoes) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    auto store = make_store(untied_shards(), bf16, adamw_spec());
    DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
    const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1});
    const int steps = 2;
    for (int step = 0; step < steps; ++step)
      run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 1.0, false, add_grads);
    engine.synchronize(m);
    const hydra::engine::EngineStats stats = engine.stats();
    // Beside the state, weights come in at each load and the host-stepped shards' gradients go out.
    int64_t state_in = stats.host_to_device_bytes, state_out = stats.device_to_host_bytes;
    for (int s = 0; s < store->num_shards(); ++s) {
      state_in -= engine.shard_loads(m)[s] * store->device_numel(s) * store->element_bytes();
      if (s != 1) state_out -= steps * store->gradient_numel(s) * store->element_bytes();
    }
    const hydra::core::ShardShape shard{0.0, 0.0, store->device_numel(1), store->gradient_numel(1),
                                        store->trainable_numel(1)};
    const double weight = bf16 ? 2.0 : 4.0;
    const hydra::core::StepBytes bytes{weight, 8.0 + (bf16 ? 4.0 : 0.0)};
    const hydra::core::LaneRates unit_rates{1.0, 1.0, 1.0, 1.0};
    const hydra::core::ShardLanes lanes =
        hydra::core::shard_lanes(shard, hydra::core::StepPlace::kDevice, false, unit_rates, bytes);
    EXPECT_DOUBLE_EQ(steps * lanes.state_in, static_cast<double>(state_in));
    EXPECT_DOUBLE_EQ(steps * lanes.state_out, static_cast<double>(state_out));
    engine.finish(m);
  }
}

TEST(Placement, DeviceStepsTakeEveryWantedUntiedShardThatFitsFirstShardsFirst) {
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30), linear_shard(3, 30)},
                          false, adamw_spec());
  const int64_t working_set = SpilledModel::spilled_need(*store, {}, nullptr, {0, 1, 2, 3});
  const int64_t all = SpilledModel::held_grads_need(*store, {0, 1, 2, 3}) + working_set;
  ASSERT_LT(all, DeviceEngine::resident_need(*store)) << "the model must not fit whole";
  DeviceEngine roomy(kCpu, all);
  const std::vector<ShardWishes> every{{{}, {0, 1, 2, 3}}};
  auto placed = place_models({&roomy}, {store}, {"m"}, {}, {}, {}, every);
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(placed[0].home_device, 0);
  EXPECT_EQ(roomy.device_shards(0), placed[0].device_shards);
  DeviceEngine tight(kCpu, all - 1);  // one gradient buffer less: the last shard steps on the host
  placed = place_models({&tight}, {store}, {"m"}, {}, {}, {}, every);
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 2}));
  DeviceEngine some(kCpu, all);
  placed = place_models({&some}, {store}, {"m"}, {}, {}, {}, {{{}, {1, 3}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{1, 3})) << "only the shards asked for";
  DeviceEngine none(kCpu, all);
  placed = place_models({&none}, {store}, {"m"}, {}, {}, {}, {{{}, {}}});
  EXPECT_TRUE(placed[0].device_shards.empty());
  EXPECT_EQ(placed[0].home_device, -1) << "a model with no shard on the device spills on every device";
  DeviceEngine a(kCpu, 2 * all), b(kCpu, 2 * all);
  placed = place_models({&a, &b}, {store}, {"m"}, {}, {}, {}, every);
  EXPECT_TRUE(placed[0].device_shards.empty()) << "on several devices, a step summing backwards would sum them apart";
  EXPECT_EQ(placed[0].model_ids, (std::vector<int>{0, 0}));
  // Each backward followed by its step: stepped on whichever device ran the backward, as many as every device holds.
  auto growing = make_store({linear_shard(0, 10), linear_shard(1, 20), linear_shard(2, 30), linear_shard(3, 40)},
                            false, adamw_spec());
  growing->set_steps_after_each_backward(true);
  const int64_t each = SpilledModel::spilled_need(*growing, {}, nullptr, {0, 1, 2, 3});
  const int64_t three = SpilledModel::spilled_need(*growing, {}, nullptr, {0, 1, 2});
  ASSERT_LT(three, each) << "the last shard's step regions are the largest";
  ASSERT_LT(each, DeviceEngine::resident_need(*growing)) << "the model must not fit whole";
  DeviceEngine c(kCpu, each), d(kCpu, each), roomy_one(kCpu, each), tight_one(kCpu, three);
  placed = place_models({&c, &d}, {growing}, {"m"}, {}, {}, {}, every);
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(placed[0].home_device, -1);
  EXPECT_TRUE(placed[0].resident_shards.empty());
  EXPECT_EQ(c.device_shards(placed[0].model_ids[0]), placed[0].device_shards);
  EXPECT_EQ(d.device_shards(placed[0].model_ids[1]), placed[0].device_shards);
  placed = place_models({&roomy_one, &tight_one}, {growing}, {"m"}, {}, {true}, {}, {{{0, 3}, {0, 1, 2, 3}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 2})) << "what the device with the least room holds";
  EXPECT_TRUE(placed[0].resident_shards.empty()) << "no home on several devices";
  EXPECT_EQ(roomy_one.device_shards(placed[0].model_ids[0]), placed[0].device_shards);
  EXPECT_EQ(tight_one.device_shards(placed[0].model_ids[1]), placed[0].device_shards);
  // Deciding registers nothing, and says what place_models then does and leaves.
  DeviceEngine decided(kCpu, all), placed_alike(kCpu, all);
  std::vector<int64_t> free_left;
  const auto decision =
      hydra::engine::decide_placement({&decided}, {store}, {"m"}, {}, {true}, {}, {{{}, {1, 2, 3}}}, free_left);
  EXPECT_EQ(decided.model_of(0), -1);
  EXPECT_EQ(decided.free_bytes(), all);
  placed = place_models({&placed_alike}, {store}, {"m"}, {}, {true}, {}, {{{}, {1, 2, 3}}});
  EXPECT_EQ(decision[0].resident_shards, placed[0].resident_shards);
  EXPECT_EQ(decision[0].device_shards, placed[0].device_shards);
  EXPECT_EQ(decision[0].model_ids, (std::vector<int>{-1}));
  // What the resident shards and gradient buffers leave; the engine also keeps the model's working set from it.
  ASSERT_EQ(free_left.size(), 1u);
  const int64_t placed_working_set =
      SpilledModel::spilled_need(*store, placed[0].resident_shards, nullptr, placed[0].device_shards);
  EXPECT_EQ(free_left[0] - placed_working_set, placed_alike.free_bytes());
}

TEST(Placement, WishedResidentShardsAreKeptWhereTheyFitNeverTheWholeModel) {
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30), linear_shard(3, 30)},
                          false, adamw_spec());
  const int64_t roomy = DeviceEngine::resident_need(*store) - 1;
  DeviceEngine a(kCpu, roomy);
  auto placed = place_models({&a}, {store}, {"m"}, {}, {}, {}, {{{2, 1}, {0, 3}}});
  EXPECT_EQ(placed[0].resident_shards, (std::vector<int>{1, 2}));
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 3}));
  EXPECT_EQ(a.resident_shards(0), placed[0].resident_shards);
  DeviceEngine b(kCpu, roomy);
  placed = place_models({&b}, {store}, {"m"}, {}, {}, {}, {{{0, 1, 2, 3}, {}}});
  EXPECT_EQ(placed[0].resident_shards, (std::vector<int>{0, 1, 2})) << "never every shard: that is a resident model";
  const int64_t one_home = SpilledModel::homes_need(*store, {0}) + SpilledModel::spilled_need(*store, {0}, nullptr);
  DeviceEngine tight(kCpu, one_home);
  placed = place_models({&tight}, {store}, {"m"}, {}, {}, {}, {{{0, 1}, {}}});
  EXPECT_EQ(placed[0].resident_shards, (std::vector<int>{0})) << "the first shards first, as far as they fit";
  auto tied = make_store(tied_shards(), false, adamw_spec());
  DeviceEngine c(kCpu, DeviceEngine::resident_need(*tied) - 1);
  placed = place_models({&c}, {tied}, {"t"}, {}, {}, {}, {{{3}, {}}});
  EXPECT_EQ(placed[0].resident_shards, (std::vector<int>{0, 3})) << "with the shard it shares a tied weight with";
  DeviceEngine d(kCpu, roomy), e(kCpu, roomy);
  placed = place_models({&d, &e}, {store}, {"m"}, {}, {}, {}, {{{1}, {2}}});
  EXPECT_TRUE(placed[0].resident_shards.empty() && placed[0].device_shards.empty()) << "one device only";
}

// Beside another spilled model, a wish is granted as far as the budget holds its gradient buffer and the working sets:
// not held to every spilled shard's weights staying cached, as the resident ends are (the lane model that asks has
// weighed what the step's regions cost the weights the arena keeps).
TEST(Placement, WishesBesideOtherSpilledModelsAreGrantedWhereTheWorkingSetsFit) {
  auto first = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30), linear_shard(3, 30)},
                          false, adamw_spec());
  auto second = make_store({linear_shard(4, 30), linear_shard(5, 30), linear_shard(6, 30), linear_shard(7, 30)},
                           false, adamw_spec());
  const int64_t working_set = SpilledModel::spilled_need(*first, {}, nullptr, {1});
  const int64_t step_room = SpilledModel::held_grads_need(*first, {1}) + working_set;
  ASSERT_LT(step_room, working_set + 2 * SpilledModel::cached_need(*first)) << "no room to cache every weight";
  DeviceEngine tight(kCpu, step_room);
  auto placed = place_models({&tight}, {first, second}, {"a", "b"}, {}, {}, {}, {{{}, {1}}, {{}, {}}});
  EXPECT_EQ(placed[0].device_shards, std::vector<int>{1});
  EXPECT_EQ(placed[0].resident_device, -1) << "spilled";
  EXPECT_EQ(placed[1].resident_device, -1) << "spilled";
  DeviceEngine tighter(kCpu, step_room - 1);
  placed = place_models({&tighter}, {first, second}, {"a", "b"}, {}, {}, {}, {{{}, {1}}, {{}, {}}});
  EXPECT_TRUE(placed[0].device_shards.empty());
}

}  // namespace
}  // namespace engine_test
