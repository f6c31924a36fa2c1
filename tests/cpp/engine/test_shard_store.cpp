// ShardStore: host-side packing of a model's parameters into per-shard flat buffers, ties, steps and bad input
// (test_shard_store_memory.cpp: pinned memory and the write-back).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "engine/shard_store.h"
#include "shard_store_helpers.h"

namespace {

using namespace shard_store_test;

constexpr int64_t kAlign = ShardStore::kAlignElements;

TEST(ShardStore, PacksTrainableFirstAtAlignedOffsetsWithZeroPadding) {
  at::Tensor frozen = param({4}, 1.0, /*trainable=*/false);
  at::Tensor w = param({3, 5}, 2.0);
  at::Tensor b = param({7}, 3.0);
  at::Tensor c = param({16}, 4.0);
  ShardStore store({{frozen, w, b, c}}, OptimizerSpec{}, /*bf16=*/false, /*pin_memory=*/false);

  ASSERT_EQ(store.num_shards(), 1);
  const auto& layout = store.layout(0);
  ASSERT_EQ(layout.size(), 4u);
  // Trainable first, in listing order (stable), then the frozen one.
  EXPECT_TRUE(layout[0].param.is_same(w));
  EXPECT_TRUE(layout[1].param.is_same(b));
  EXPECT_TRUE(layout[2].param.is_same(c));
  EXPECT_TRUE(layout[3].param.is_same(frozen));
  const std::vector<int64_t> expected_offsets = {0, 16, 32, 48};
  for (size_t i = 0; i < layout.size(); ++i) {
    const ParamEntry& e = layout[i];
    EXPECT_EQ(e.master_offset, expected_offsets[i]) << "entry " << i;
    EXPECT_EQ(e.device_offset, e.master_offset) << "owned entries share the master layout";
    EXPECT_EQ(e.master_offset % kAlign, 0);
    EXPECT_EQ(e.owner, 0);
    EXPECT_EQ(e.numel, e.param.numel());
    EXPECT_EQ(e.original_dtype, at::kFloat);
  }
  EXPECT_TRUE(layout[0].trainable && layout[1].trainable && layout[2].trainable);
  EXPECT_FALSE(layout[3].trainable);
  EXPECT_EQ(store.trainable_numel(0), 48);
  EXPECT_EQ(store.owned_numel(0), 64);  // 48 + 4, aligned up
  EXPECT_EQ(store.device_numel(0), 64);
  EXPECT_EQ(store.total_owned_numel(), 64);

  at::Tensor master = store.master(0);
  ASSERT_EQ(master.scalar_type(), at::kFloat);
  ASSERT_EQ(master.numel(), 64);
  at::Tensor expected = at::zeros({64}, at::kFloat);
  expected.narrow(0, 0, 15).copy_(flat(w));
  expected.narrow(0, 16, 7).copy_(flat(b));
  expected.narrow(0, 32, 16).copy_(flat(c));
  expected.narrow(0, 48, 4).copy_(flat(frozen));
  EXPECT_TRUE(at::equal(master, expected)) << "master:\n" << master << "\nexpected:\n" << expected;
  // Padding is exactly zero.
  EXPECT_EQ(master.narrow(0, 15, 1).item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(master.narrow(0, 23, 9), at::zeros({9})));
  EXPECT_TRUE(at::equal(master.narrow(0, 52, 12), at::zeros({12})));

  // Gradients and optimizer state: zeroed fp32 buffers of the trainable range (Adam keeps two): the frozen
  // parameter after it has none.
  EXPECT_TRUE(at::equal(store.grad(0), at::zeros({48})));
  EXPECT_EQ(store.optimizer().num_states(), 2);
  EXPECT_TRUE(at::equal(store.state(0, 0), at::zeros({48})));
  EXPECT_TRUE(at::equal(store.state(0, 1), at::zeros({48})));
  EXPECT_EQ(store.steps_taken(0), 0);
}

TEST(ShardStore, CopiesValuesAndLeavesParametersUntouched) {
  at::Tensor w = param({6}, 1.0);
  at::Tensor original = w.detach().clone();
  void* data = w.data_ptr();
  ShardStore store({{w}}, OptimizerSpec{}, false, false);
  EXPECT_EQ(w.data_ptr(), data) << "construction must not rebind the parameter";
  EXPECT_NE(store.master(0).data_ptr(), data);
  w.detach().add_(100.0f);  // the store holds a copy
  EXPECT_TRUE(at::equal(store.master(0).narrow(0, 0, 6), original));
}

TEST(ShardStore, NumberOfStatesFollowsTheOptimizer) {
  at::Tensor w = param({5}, 1.0);
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  ShardStore plain({{w}}, sgd, false, false);
  EXPECT_EQ(plain.optimizer().num_states(), 0);
  EXPECT_THROW(plain.state(0, 0), std::out_of_range);
  sgd.momentum = 0.9;
  ShardStore momentum({{w}}, sgd, false, false);
  ASSERT_EQ(momentum.optimizer().num_states(), 1);
  EXPECT_EQ(momentum.state(0, 0).numel(), momentum.owned_numel(0));
}

TEST(ShardStore, DuplicateWithinOneShardIsStoredOnce) {
  at::Tensor w = param({5}, 1.0);
  at::Tensor b = param({3}, 2.0);
  ShardStore store({{w, b, w}}, OptimizerSpec{}, false, false);
  ASSERT_EQ(store.layout(0).size(), 2u);
  EXPECT_EQ(store.owned_numel(0), 32);
  EXPECT_EQ(store.device_numel(0), 32);
}

TEST(ShardStore, TiedParameterIsOwnedByTheLowestShard) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);
  ASSERT_EQ(store.num_shards(), 3);

  // Shard 0 owns e (sorted before the frozen f0), a, f0.
  const ParamEntry& e0 = entry_for(store, 0, m.e);
  EXPECT_EQ(e0.owner, 0);
  EXPECT_EQ(e0.master_offset, 0);
  EXPECT_EQ(entry_for(store, 0, m.a).master_offset, 48);
  EXPECT_EQ(entry_for(store, 0, m.f0).master_offset, 64);
  EXPECT_EQ(store.owned_numel(0), 80);
  EXPECT_EQ(store.trainable_numel(0), 64);
  EXPECT_EQ(store.layout(0).size(), 3u);

  EXPECT_EQ(entry_for(store, 1, m.h).master_offset, 0);
  EXPECT_EQ(entry_for(store, 1, m.z).master_offset, 16);
  EXPECT_EQ(store.owned_numel(1), 32);
  EXPECT_EQ(store.trainable_numel(1), 16);

  // Shard 2 owns only g; e and z are borrowed, appended after the owned part of its device layout.
  ASSERT_EQ(store.layout(2).size(), 3u);
  EXPECT_TRUE(store.layout(2)[0].param.is_same(m.g)) << "owned entries come first";
  const ParamEntry& g2 = entry_for(store, 2, m.g);
  EXPECT_EQ(g2.owner, 2);
  EXPECT_EQ(g2.master_offset, 0);
  EXPECT_EQ(store.owned_numel(2), 16);
  EXPECT_EQ(store.master(2).numel(), 16) << "borrowed parameters have no master storage in the borrower";

  const ParamEntry& e2 = entry_for(store, 2, m.e);
  EXPECT_EQ(e2.owner, 0);
  EXPECT_EQ(e2.master_offset, e0.master_offset) << "the borrower points at the owner's final (sorted) offset";
  EXPECT_EQ(e2.device_offset, 16);
  EXPECT_TRUE(e2.trainable);
  const ParamEntry& z2 = entry_for(store, 2, m.z);
  EXPECT_EQ(z2.owner, 1);
  EXPECT_EQ(z2.master_offset, 16);
  EXPECT_EQ(z2.device_offset, 64);  // 16 + 40, aligned
  EXPECT_FALSE(z2.trainable);
  EXPECT_EQ(store.device_numel(2), 80);  // 64 + 3, aligned
  EXPECT_EQ(store.total_owned_numel(), 80 + 32 + 16);
  // What a copy of each shard reads: its own buffers, then its borrowed parameters' owners', each once.
  EXPECT_EQ(store.sources(0), (std::vector<int>{0}));
  EXPECT_EQ(store.sources(1), (std::vector<int>{1}));
  EXPECT_EQ(store.sources(2), (std::vector<int>{2, 0, 1}));

  // The owner's master holds the tied values once.
  EXPECT_TRUE(at::equal(store.master(0).narrow(0, 0, 40), flat(m.e)));
  EXPECT_TRUE(at::equal(store.master(1).narrow(0, 16, 3), flat(m.z)));
}

TEST(ShardStore, FrozenParametersHoldTheirMasterAloneAndSendNoGradient) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);  // Adam: two states
  for (int s = 0; s < store.num_shards(); ++s)
    for (int k = 0; k < 2; ++k) EXPECT_EQ(store.state(s, k).numel(), store.trainable_numel(s)) << "shard " << s;
  // Masters of all owned parameters, states of the trainable ones only.
  EXPECT_EQ(store.host_bytes(), 4 * (80 + 32 + 16) + 4 * 2 * (64 + 16 + 16));
  // The accumulator spans the trainable range too: f0 and z have no slot.
  EXPECT_EQ(store.grad(0).numel(), 64);
  EXPECT_EQ(store.grad(1).numel(), 16);
  // What a gradient copy moves: the prefix holding every trainable gradient. Shard 1's frozen z is its tail;
  // shard 2's trainable borrowed e sits after its owned g, its frozen borrowed z after e.
  EXPECT_EQ(store.gradient_numel(0), 64);
  EXPECT_EQ(store.gradient_numel(1), 16);
  EXPECT_EQ(store.gradient_numel(2), 64);
  EXPECT_EQ(store.device_numel(2), 80);
}

TEST(ShardStore, AShardOfFrozenParametersSendsNoGradient) {
  const at::Tensor frozen = param({40}, 1.0, false), trained = param({8}, 2.0);
  ShardStore store({{frozen}, {trained, frozen}}, OptimizerSpec{}, true, false);
  EXPECT_EQ(store.gradient_numel(0), 0);
  EXPECT_EQ(store.state(0, 0).numel(), 0);
  EXPECT_EQ(store.gradient_numel(1), 16) << "the borrowed frozen weight after it is not sent";
  EXPECT_EQ(store.host_bytes(), (4 + 2) * (48 + 16) + 4 * 2 * 16) << "bf16: master and shadow, states of 16";
}

TEST(ShardStore, BorrowedEntriesKnowTheirIndexInTheOwnersLayout) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);
  for (int s = 0; s < store.num_shards(); ++s) {
    for (const ParamEntry& e : store.layout(s)) {
      const ParamEntry& home = store.layout(e.owner).at(e.owner_index);
      EXPECT_TRUE(home.param.is_same(e.param)) << "shard " << s << " offset " << e.device_offset;
      EXPECT_EQ(home.owner, e.owner);
    }
  }
  EXPECT_EQ(entry_for(store, 2, m.e).owner_index, 0);
  EXPECT_EQ(entry_for(store, 2, m.z).owner_index, 1);
}

TEST(ShardStore, AStepCoversOnlyTheParametersThatReceivedAGradient) {
  at::Tensor x = param({5}, 1.0), y = param({20}, 2.0), w = param({3}, 3.0), frozen = param({4}, 4.0, false);
  ShardStore store({{x, frozen, y, w}}, OptimizerSpec{}, false, false);  // x at 0, y at 16, w at 48, frozen after
  ASSERT_EQ(store.trainable_numel(0), 64);
  auto note = [&](std::initializer_list<int> entries) {
    for (int i : entries) store.note_gradient(0, i);
  };
  auto ranges = [](std::vector<hydra::engine::StepRange> taken) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& r : taken) out.push_back({r.begin, r.end, r.step});
    return out;
  };
  using Ranges = std::vector<std::vector<int64_t>>;

  note({0, 1, 2, 3});  // every parameter, and a note for the frozen one that nothing steps
  EXPECT_EQ(ranges(store.take_step(0)), (Ranges{{0, 64, 1}})) << "the usual step: one pass over the trainable buffer";
  note({0, 1, 2});
  EXPECT_EQ(ranges(store.take_step(0)), (Ranges{{0, 64, 2}}));
  note({0, 2});  // y (entry 1) received nothing: x and w step around it
  EXPECT_EQ(ranges(store.take_step(0)), (Ranges{{0, 16, 3}, {48, 64, 3}}));
  EXPECT_EQ(store.param_steps(0, 1), 2) << "y's own count stands still";
  note({0, 1, 2});  // neighbours at different counts are stepped apart, each with its own step number
  EXPECT_EQ(ranges(store.take_step(0)), (Ranges{{0, 16, 4}, {16, 48, 3}, {48, 64, 4}}));
  EXPECT_EQ(ranges(store.take_step(0)), Ranges{}) << "notes are reset by a step";
  note({1});
  store.forget_gradients();
  EXPECT_EQ(ranges(store.take_step(0)), Ranges{}) << "forgotten gradients step nothing";
  EXPECT_EQ(store.steps_taken(0), 6) << "every step counts for the shard";
  EXPECT_EQ(store.param_steps(0, 0), 4);
  EXPECT_EQ(store.param_steps(0, 1), 3);
  EXPECT_EQ(store.param_steps(0, 2), 4);
  EXPECT_EQ(store.param_steps(0, 3), 0) << "frozen";
}

TEST(ShardStore, ParametersOfAnotherGroupAreSteppedApartWithTheirOwnRateAndDecay) {
  at::Tensor x = param({5}, 1.0), y = param({20}, 2.0), w = param({3}, 3.0);
  OptimizerSpec adamw;
  adamw.lr = 0.1;
  adamw.weight_decay = 0.01;
  ShardStore store({{x, y, w}}, adamw, false, false);  // x at 0, y at 16, w at 48
  store.set_param_options(y, 0.1, 0.0);  // y: no weight decay
  for (int i = 0; i < 3; ++i) store.note_gradient(0, i);
  const auto ranges = store.take_step(0);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].end, 16);
  EXPECT_DOUBLE_EQ(ranges[0].weight_decay, 0.01);
  EXPECT_EQ(ranges[1].begin, 16);
  EXPECT_DOUBLE_EQ(ranges[1].weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(ranges[1].lr, 0.1);
  EXPECT_DOUBLE_EQ(ranges[2].weight_decay, 0.01);
  store.set_param_options(y, 0.1, 0.01);  // the same options again: one range
  for (int i = 0; i < 3; ++i) store.note_gradient(0, i);
  EXPECT_EQ(store.take_step(0).size(), 1u);
  EXPECT_THROW(store.set_param_options(param({2}, 5.0), 0.1, 0.0), c10::Error) << "not in the store";
}

TEST(ShardStore, ATiedParameterStepsWithItsOwnerWhenOnlyABorrowerUsedIt) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);
  const ParamEntry& borrowed = entry_for(store, 2, m.e);
  store.note_gradient(borrowed.owner, borrowed.owner_index);
  const auto borrower = store.take_step(2);
  EXPECT_TRUE(borrower.empty()) << "g received nothing; e is not the borrower's to step";
  const auto owner = store.take_step(0);
  ASSERT_EQ(owner.size(), 1u);
  EXPECT_EQ(owner[0].begin, 0);
  EXPECT_EQ(owner[0].end, 48) << "e and its padding, not a";
  EXPECT_EQ(owner[0].step, 1);
}

TEST(ShardStore, AccumulateGradsAddsOwnedAndRoutesBorrowedToTheOwner) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);
  const at::Tensor g2 = at::arange(1, 81, at::kFloat);  // device layout of shard 2: 80 elements
  store.accumulate_grads(2, g2);

  // Owned part of shard 2 in one pass (padding included: it is zero on the device).
  EXPECT_TRUE(at::equal(store.grad(2), g2.narrow(0, 0, 16)));
  // The borrowed trainable e lands in shard 0 at e's master offset.
  at::Tensor expected0 = at::zeros({64});  // e and a: the frozen f0 has no slot
  expected0.narrow(0, 0, 40).copy_(g2.narrow(0, 16, 40));
  EXPECT_TRUE(at::equal(store.grad(0), expected0));
  // The borrowed frozen z is not routed: the owner's gradient (h alone) stays zero.
  EXPECT_TRUE(at::equal(store.grad(1), at::zeros({16})));

  // Contributions sum, from the owner's own pass and from a second micro-batch.
  const at::Tensor g0 = at::full({80}, 0.5f);
  store.accumulate_grads(0, g0);
  store.accumulate_grads(2, g2);
  EXPECT_TRUE(at::allclose(store.grad(2), g2.narrow(0, 0, 16) * 2));
  expected0.mul_(2).add_(0.5f);
  EXPECT_TRUE(at::allclose(store.grad(0), expected0));
}

TEST(ShardStore, AccumulateGradsRejectsWrongShapes) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, false, false);
  EXPECT_THROW(store.accumulate_grads(2, at::zeros({16})), c10::Error) << "owned size is not the device size";
  EXPECT_THROW(store.accumulate_grads(2, at::zeros({81})), c10::Error);
  EXPECT_THROW(store.accumulate_grads(2, at::empty({80}, at::TensorOptions().device(at::kMeta))), c10::Error);
  EXPECT_TRUE(at::equal(store.grad(2), at::zeros({16})));
}

TEST(ShardStore, BFloat16ShadowIsTheRoundedMaster) {
  TiedModel m;
  ShardStore store(m.shards(), OptimizerSpec{}, /*bf16=*/true, false);
  EXPECT_TRUE(store.bf16());
  EXPECT_EQ(store.compute_dtype(), at::kBFloat16);
  for (int s = 0; s < store.num_shards(); ++s) {
    const at::Tensor shadow = store.shadow(s);
    ASSERT_EQ(shadow.scalar_type(), at::kBFloat16);
    ASSERT_EQ(shadow.numel(), store.owned_numel(s));
    EXPECT_TRUE(at::equal(shadow, store.master(s).to(at::kBFloat16))) << "shard " << s;
    EXPECT_TRUE(store.transfer_source(s).is_same(store.shadow(s)));
    EXPECT_EQ(store.master(s).scalar_type(), at::kFloat) << "the master stays fp32";
  }
  // The rounding is real: these values are not exactly representable in bf16.
  EXPECT_FALSE(at::equal(store.shadow(0).to(at::kFloat), store.master(0)));

  ShardStore fp32(m.shards(), OptimizerSpec{}, false, false);
  EXPECT_EQ(fp32.compute_dtype(), at::kFloat);
  EXPECT_TRUE(fp32.transfer_source(0).is_same(fp32.master(0)));
}

TEST(ShardStore, RejectsInvalidParameters) {
  const OptimizerSpec adam;
  EXPECT_THROW(ShardStore({}, adam, false, false), c10::Error);
  EXPECT_THROW(ShardStore({{at::Tensor()}}, adam, false, false), c10::Error);
  at::Tensor meta = at::empty({4}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  EXPECT_THROW(ShardStore({{param({3}, 1.0)}, {meta}}, adam, false, false), c10::Error);
  EXPECT_THROW(ShardStore({{at::arange(4, at::kLong)}}, adam, false, false), c10::Error);
  EXPECT_THROW(ShardStore({{at::zeros({4}, at::kInt)}}, adam, false, false), c10::Error);
  EXPECT_THROW(ShardStore({{at::zeros({4}, at::kBool)}}, adam, false, false), c10::Error);
  EXPECT_THROW(ShardStore({{at::zeros({4}, at::kComplexFloat)}}, adam, false, false), c10::Error);
  // Every floating dtype is accepted.
  for (at::ScalarType t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
    EXPECT_NO_THROW(ShardStore({{at::zeros({4}, t)}}, adam, false, false)) << t;
}

TEST(ShardStore, EmptyShardHasNoElements) {
  at::Tensor w = param({5}, 1.0);
  ShardStore store({{w}, {}}, OptimizerSpec{}, false, false);
  EXPECT_EQ(store.owned_numel(1), 0);
  EXPECT_EQ(store.device_numel(1), 0);
  EXPECT_EQ(store.master(1).numel(), 0);
  store.accumulate_grads(1, at::zeros({0}));
}

}  // namespace
