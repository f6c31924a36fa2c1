// A tied weight (an embedding and the head that borrows it) in a spilled model with device-stepped shards: stepped
// on the device whole, or split between the device and the host (the tied weight steps with its owner), it ends as
// with every shard stepped on the host; what placement grants, and what the lane model counts of it, follow.
#include <algorithm>
#include <string>
#include <thread>

#include "core/lanes.h"
#include "device_steps_helpers.h"
#include "engine/placement.h"
#include "engine/spilled_model.h"

namespace engine_test {
namespace {

using hydra::engine::place_models;
using hydra::engine::SpilledModel;

TEST(DeviceSteps, AnOwnerApartFromItsEmptyBorrowerARepeatedResidentOrMissingShardIsRefusedChangingNothing) {
  auto tied = make_store(tied_head_alone());
  auto untied = make_store(untied_shards());
  DeviceEngine engine(kCpu, DeviceEngine::resident_need(*tied) * 4);
  const int64_t free = engine.free_bytes();
  for (const std::vector<int>& bad : {std::vector<int>{0}, {3}, {1, 3}, {0, 1}, {1, 1}, {4}, {-1}})
    EXPECT_THROW(engine.add_model(tied, DeviceEngine::Residency::kSpilled, -1, {}, -1, bad), c10::Error);
  EXPECT_THROW(engine.add_model(untied, DeviceEngine::Residency::kSpilled, -1, {1}, -1, {1, 2}), c10::Error)
      << "a shard is resident or device-stepped, not both";
  auto frozen = make_store({linear_shard(0, 4), {param({5}, 2.0, /*trainable=*/false)}});
  EXPECT_EQ(SpilledModel::device_shards_error(*frozen, {}, {1}), "device-stepped shard 1 has nothing to train");
  EXPECT_THROW(engine.add_model(untied, DeviceEngine::Residency::kAuto, -1, {}, -1, {1}), c10::Error)
      << "device-stepped shards are a spilled model's";
  EXPECT_EQ(engine.free_bytes(), free);
  EXPECT_EQ(SpilledModel::device_shards_error(*tied, {}, {3}),
            "device-stepped shard 3 has nothing of its own to train and borrows a tied weight from shard 0, which is "
            "not device-stepped: such a borrower steps with its owner");
  EXPECT_EQ(SpilledModel::device_shards_error(*tied, {}, {0, 1}),
            "device-stepped shard 0 lends a tied weight to shard 3, which has nothing of its own to train and is not "
            "device-stepped: such a borrower steps with its owner");
  EXPECT_EQ(SpilledModel::device_shards_error(*tied, {}, {3, 0}), "") << "the whole tie";
  auto owning_head = make_store(tied_shards());
  for (const std::vector<int>& split : {std::vector<int>{0}, {3}, {1, 3}, {0, 1, 2}})
    EXPECT_EQ(SpilledModel::device_shards_error(*owning_head, {}, split), "") << "a head that trains its own weights";
  // A tied weight that is frozen has no gradient to sum: its shards step apart.
  const at::Tensor untrained = param({10, 4}, 1.0, /*trainable=*/false);
  auto frozen_tie = make_store(std::vector<std::vector<at::Tensor>>{
      {untrained, param({7}, 3.0)}, linear_shard(1, 12), {param({6}, 6.0), untrained}});
  EXPECT_EQ(SpilledModel::device_shards_error(*frozen_tie, {}, {2}), "");
}

// A tied weight device-stepped: the borrower's backward adds its gradient to the owner's buffer on the device, and
// the owner's step steps their sum, as the host sums them; the borrower steps what it owns. A head alone in its shard
// (tied_head_alone) owns nothing to train: its step is the count alone (logged on the device, as a host-stepped
// one's is on the host).
TEST(DeviceSteps, ATieSteppedOnTheDeviceEndsAsOnTheHost) {
  for (Shards (*shards)() : {tied_shards, tied_head_alone}) {
    for (bool clip : {false, true}) {
      SCOPED_TRACE(clip ? "clipped" : "not clipped");
      const Trained host = train(false, {}, {}, clip, shards);
      expect_same(train(false, {}, {0, 3}, clip, shards), host);
      expect_same(train(false, {}, {0, 1, 2, 3}, clip, shards), host);
      expect_same(train(false, {0, 3}, {1, 2}, clip, shards), host);
    }
    const Trained host = train_stepping_after_each_backward(false, true, {}, shards);
    expect_same(train_stepping_after_each_backward(false, true, {0, 3}, shards), host);
    expect_same(train_stepping_after_each_backward(false, true, {0, 1, 2, 3}, shards), host);
  }
  auto alone = make_store(tied_head_alone(), false, adamw_spec());
  EXPECT_EQ(alone->trainable_numel(3), 0);
  EXPECT_EQ(SpilledModel::device_shards_error(*alone, {}, {0, 3}), "");
  EXPECT_FALSE(SpilledModel::keeps_gradient_buffer(*alone, {0, 3}, 3)) << "nothing of its own to hold";
  EXPECT_EQ(SpilledModel::held_grads_need(*alone, {0, 3}), alone->trainable_numel(0) * 4 + 512);
}

// A tie split between the device and the host: the tied weight steps with its owner. A host-stepped borrower's
// backward adds its share to a device-stepped owner's buffer and sends out only what it owns; a device-stepped
// borrower sends its share to a host-stepped owner after each backward, where it is summed as a host-stepped
// borrower's is. Either ends bit for bit as with every shard on the host.
TEST(DeviceSteps, ATieSplitBetweenTheDeviceAndTheHostEndsAsOnTheHost) {
  expect_tied_placements_end_as_on_the_host({{{}, {0}}, {{}, {0, 1, 2}}, {{}, {3}}, {{}, {1, 2, 3}}},
                                            {{{}, {0}}, {{}, {0, 1}}, {{}, {3}}, {{}, {2, 3}}});
}

TEST(DeviceSteps, OfASplitTieTheHostSumsOnlyWhatItSteps) {
  for (const std::vector<int>& device : {std::vector<int>{0, 1, 2}, {3}}) {
    SCOPED_TRACE("device-stepped: " + ::testing::PrintToString(device));
    auto store = make_store(tied_shards(), false, adamw_spec());
    store->set_steps_after_each_backward(true);
    DeviceEngine engine(kCpu, DeviceEngine::resident_need(*store) * 2);
    const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, device);
    const bool owner_on_device = device.front() == 0;
    EXPECT_EQ(store->summed_on_device(0), owner_on_device);
    EXPECT_EQ(store->host_gradient_numel(3), owner_on_device ? store->trainable_numel(3) : store->gradient_numel(3))
        << "the head's copy out leaves the tied weight's gradient behind where its owner sums it on the device";
    const int64_t out_before = engine.stats().device_to_host_bytes;
    run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true, 0.5, false, add_grads);
    engine.synchronize(m);
    const int64_t out = engine.stats().device_to_host_bytes - out_before;
    // Shard 3's trip out: what it owns where the owner is on the device, its share of the tie where it is.
    const int64_t head_out = (owner_on_device ? store->trainable_numel(3)
                                              : store->gradient_numel(3) - store->owned_numel(3)) * 4;
    int64_t host_out = 0;
    for (int s = 0; s < store->num_shards(); ++s)
      if (std::find(device.begin(), device.end(), s) == device.end() && s != 3)
        host_out += store->gradient_numel(s) * 4;
    int64_t state_out = 0;  // each device step's master and moments home
    for (int s : device) state_out += store->trainable_numel(s) * 4 * 3;
    EXPECT_EQ(out, head_out + host_out + state_out);
    if (owner_on_device) EXPECT_FALSE(store->has_grad(0) || store->has_kept(0)) << "the tie sums on the device";
    EXPECT_FALSE(store->has_grad(3)) << "the head's own gradient is stepped where it is";
    engine.finish(m);
  }
  auto store = make_store(tied_shards(), false, adamw_spec());
  store->set_steps_after_each_backward(true);
  EXPECT_TRUE(SpilledModel::keeps_gradient_buffer(*store, {0}, 0)) << "the host-stepped head adds its share there";
  EXPECT_TRUE(SpilledModel::keeps_gradient_buffer(*store, {3}, 3)) << "its unit's region holds the share going out";
  EXPECT_TRUE(SpilledModel::sends_borrowed_grads(*store, {3}, 3));
  EXPECT_FALSE(SpilledModel::sends_borrowed_grads(*store, {0, 3}, 3));
  EXPECT_FALSE(SpilledModel::sends_borrowed_grads(*store, {0}, 3)) << "not device-stepped";
  const int64_t weights = store->device_numel(3) * 4 + 512;
  EXPECT_GE(SpilledModel::spilled_need(*store, {}, nullptr, {3}),
            2 * weights + SpilledModel::device_step_need(*store, 3))
      << "the head's unit holds its weights, the region its share goes out from, and its step's";
}

TEST(DeviceSteps, ATiesOwnerKeepsAGradientBufferForTheRunItsBorrowerNone) {
  auto store = make_store(tied_shards(), false, adamw_spec());
  store->set_steps_after_each_backward(true);
  EXPECT_TRUE(SpilledModel::keeps_gradient_buffer(*store, {0, 3}, 0)) << "the borrower's gradient waits there";
  EXPECT_FALSE(SpilledModel::keeps_gradient_buffer(*store, {0, 3}, 3));
  EXPECT_FALSE(SpilledModel::keeps_gradient_buffer(*store, {1, 2}, 1));
  EXPECT_FALSE(SpilledModel::keeps_gradient_buffer(*store, {1, 2}, 0)) << "not device-stepped";
  EXPECT_EQ(SpilledModel::held_grads_need(*store, {0, 3}), store->trainable_numel(0) * 4 + 512);
  store->set_steps_after_each_backward(false);
  // Summing backwards, every device-stepped shard keeps one, of what it owns: the borrowed gradient is the owner's.
  EXPECT_EQ(SpilledModel::held_grads_need(*store, {0, 3}),
            store->trainable_numel(0) * 4 + 512 + store->trainable_numel(3) * 4 + 512);
  EXPECT_LT(store->trainable_numel(3), store->gradient_numel(3));
}

TEST(Placement, ATiesShardsStepOnTheDeviceAsWishedAnEmptyBorrowerWithItsOwnerGrantedAsOneOnOneDeviceOnly) {
  auto tied = make_store(tied_shards(), false, adamw_spec());  // shards 0 and 3 share a tied weight
  const std::vector<int> every{0, 1, 2, 3};
  const int64_t all =
      SpilledModel::held_grads_need(*tied, every) + SpilledModel::spilled_need(*tied, {}, nullptr, every);
  ASSERT_LT(all, DeviceEngine::resident_need(*tied)) << "the model must not fit whole";
  DeviceEngine roomy(kCpu, all);
  auto placed = place_models({&roomy}, {tied}, {"t"}, {}, {}, {}, {{{}, every}});
  EXPECT_EQ(placed[0].device_shards, every);
  EXPECT_EQ(roomy.device_shards(0), every);
  DeviceEngine half(kCpu, all);
  placed = place_models({&half}, {tied}, {"t"}, {}, {}, {}, {{{}, {1, 3}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{1, 3})) << "shard 3 wished without its tie's owner";
  EXPECT_EQ(half.device_shards(0), placed[0].device_shards);
  DeviceEngine tight(kCpu, all - 1);  // the tie comes first, with its first shard; the last untied shard goes
  placed = place_models({&tight}, {tied}, {"t"}, {}, {}, {}, {{{}, every}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 3}));
  DeviceEngine owner_only(kCpu, all);
  placed = place_models({&owner_only}, {tied}, {"t"}, {}, {}, {}, {{{}, {0, 1}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1})) << "the tie split as wished";
  // A head with nothing of its own to train steps with its owner, wished or not.
  auto alone = make_store(tied_head_alone(), false, adamw_spec());
  const int64_t alone_all =
      SpilledModel::held_grads_need(*alone, every) + SpilledModel::spilled_need(*alone, {}, nullptr, every);
  DeviceEngine with_owner(kCpu, alone_all), without_owner(kCpu, alone_all), short_of_room(kCpu, alone_all - 1);
  placed = place_models({&with_owner}, {alone}, {"h"}, {}, {}, {}, {{{}, {0, 1}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 3}));
  placed = place_models({&without_owner}, {alone}, {"h"}, {}, {}, {}, {{{}, {1, 3}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{1}));
  placed = place_models({&short_of_room}, {alone}, {"h"}, {}, {}, {}, {{{}, every}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 1, 3})) << "the tie stays with its first shard";
  // On several devices a tie's gradient would sum in one device's buffer while its units run on either.
  tied->set_steps_after_each_backward(true);
  DeviceEngine a(kCpu, all), b(kCpu, all);
  placed = place_models({&a, &b}, {tied}, {"t"}, {}, {}, {}, {{{}, every}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{1, 2}));
}

// GPT-2's shape under placement "device": the tied embedding and head are smaller than each block, and a budget that
// holds the tie's step holds no block's. The tie is granted; the blocks that do not fit are passed over.
TEST(Placement, ATieSmallerThanTheBlocksStepsOnTheDeviceWhereNoBlockFits) {
  const at::Tensor e = param({4, 4}, 1.0);
  auto store = make_store({{e}, linear_shard(1, 40), linear_shard(2, 40), {param({3}, 6.0), e}}, false, adamw_spec());
  auto need = [&](const std::vector<int>& stepped) {
    return SpilledModel::held_grads_need(*store, stepped) + SpilledModel::spilled_need(*store, {}, nullptr, stepped);
  };
  const int64_t tie = need({0, 3});
  ASSERT_GT(need({1}), tie) << "a block's step must need more room than the tie's";
  ASSERT_LT(tie, DeviceEngine::resident_need(*store)) << "the model must not fit whole";
  DeviceEngine engine(kCpu, tie);
  const auto placed = place_models({&engine}, {store}, {"m"}, {}, {}, {}, {{{}, {0, 1, 2, 3}}});
  EXPECT_EQ(placed[0].device_shards, (std::vector<int>{0, 3}));
  EXPECT_EQ(engine.device_shards(0), placed[0].device_shards);
}

// What the lane model (core/lanes.h) asks of the room for a split tie is what the engine's budget asks, up to the
// regions' alignment: a device-stepped owner keeps its buffer for a host-stepped borrower's share; a device-stepped
// borrower of a host-stepped owner keeps its own, and its unit holds a full gradient region beside its step's.
TEST(DeviceSteps, TheLaneModelCountsTheRoomOfASplitTieAsTheEngineDoes) {
  using hydra::core::StepPlace;
  for (bool bf16 : {false, true})
    for (bool steps_after_each_backward : {false, true}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + (steps_after_each_backward ? ", one backward a step" : ""));
      const at::Tensor e = param({1000}, 1.0);
      auto store = make_store({{e, param({7}, 3.0)}, linear_shard(1, 12), {param({8000}, 6.0), e}}, bf16, adamw_spec());
      store->set_steps_after_each_backward(steps_after_each_backward);
      hydra::core::TaskShape task;
      for (int s = 0; s < store->num_shards(); ++s)
        task.shards.push_back({0.0, 0.0, store->device_numel(s), store->gradient_numel(s), store->trainable_numel(s),
                               s == 2 ? 0 : -1});
      task.clipped = !steps_after_each_backward;
      const double weight = bf16 ? 2.0 : 4.0;
      const hydra::core::StepBytes bytes{weight, 8.0 + (bf16 ? 4.0 : 0.0)};
      const int64_t host_working_set = DeviceEngine::spilled_need(*store);
      for (const std::vector<int>& device : {std::vector<int>{0}, {2}}) {
        SCOPED_TRACE("device-stepped: " + ::testing::PrintToString(device));
        std::vector<StepPlace> places(3, StepPlace::kHost);
        for (int s : device) places[static_cast<size_t>(s)] = StepPlace::kDevice;
        const int64_t engine = SpilledModel::held_grads_need(*store, device) +
                               SpilledModel::spilled_need(*store, {}, nullptr, device) - host_working_set;
        // The head is the largest shard: beside the host's working set only the owner's buffer is asked, where the
        // owner steps on the device; the head's step room and its own buffer, where the head does.
        const int64_t lanes = hydra::core::placement_bytes({task}, {places}, bytes, {}, device.front() == 0 ? 0 : 1);
        EXPECT_NEAR(static_cast<double>(engine), static_cast<double>(lanes), 6 * 512.0);
      }
      const hydra::core::Placement split{{StepPlace::kDevice, StepPlace::kHost, StepPlace::kHost}};
      EXPECT_TRUE(hydra::core::tie_apart(task, split[0], 2));
      EXPECT_FALSE(hydra::core::tie_apart(task, split[0], 0)) << "the owner borrows nothing";
    }
}

// The engines of several devices add a task at once, each on its own worker's thread (run/moving.py's put_back): each
// marks the store's owners summed on the device (none on several devices) while host jobs may read the marks.
TEST(DeviceSteps, EnginesAddingAModelAtOnceMarkItsStoreAlike) {
  auto store = make_store(tied_shards(), false, adamw_spec());
  store->set_steps_after_each_backward(true);
  DeviceEngine a(kCpu, DeviceEngine::resident_need(*store) * 2), b(kCpu, DeviceEngine::resident_need(*store) * 2);
  int on_a = -1, on_b = -1;
  std::thread adding_a([&] { on_a = a.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1, 2}); });
  std::thread adding_b([&] { on_b = b.add_model(store, DeviceEngine::Residency::kSpilled, -1, {}, -1, {1, 2}); });
  adding_a.join();
  adding_b.join();
  EXPECT_FALSE(store->summed_on_device(0));
  EXPECT_EQ(store->host_gradient_numel(3), store->gradient_numel(3));
  a.finish(on_a);
  b.release_model(on_b);
}

}  // namespace
}  // namespace engine_test
