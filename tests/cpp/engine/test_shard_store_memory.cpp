// ShardStore's host memory: pinning with its fallback where none can be had, the transfer sources and the
// device-stepped states each pinned as one block, and the write-back giving each parameter a master of its own.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "engine/host_memory.h"
#include "engine/shard_store.h"
#include "shard_store_helpers.h"

namespace {

using namespace shard_store_test;

TEST(ShardStore, PinMemoryFallsBackWhenUnavailable) {
  at::Tensor w = param({5}, 1.0);
  ShardStore store({{w}}, OptimizerSpec{}, false, /*pin_memory=*/true);
  // Either the transfer buffer really is pinned, or the store says it is not.
  if (store.pinned()) EXPECT_TRUE(store.master(0).is_pinned());
  EXPECT_TRUE(at::equal(store.master(0).narrow(0, 0, 5), flat(w)));
  ShardStore unpinned({{w}}, OptimizerSpec{}, false, false);
  EXPECT_FALSE(unpinned.pinned());
}

// A device-stepped shard's master and states move to pinned memory (or stay, where there is none), values and all,
// with and without the bf16 shadow beside the master; the other shards' are left as they were.
TEST(ShardStore, PinStateKeepsTheValuesOfTheShardsMasterAndStates) {
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    ShardStore store({{param({5}, 1.0)}, {param({7}, 2.0)}}, OptimizerSpec{}, bf16, /*pin_memory=*/true);
    for (int s = 0; s < 2; ++s)
      for (int k = 0; k < 2; ++k) store.state(s, k).copy_(values({store.state(s, k).numel()}, 3.0 + s + k));
    const at::Tensor master = store.master(1).clone(), first = store.state(1, 0).clone(),
                     second = store.state(1, 1).clone(), other = store.state(0, 0);
    store.pin_states({1});
    EXPECT_TRUE(at::equal(store.master(1), master));
    EXPECT_TRUE(at::equal(store.state(1, 0), first));
    EXPECT_TRUE(at::equal(store.state(1, 1), second));
    EXPECT_TRUE(store.state(0, 0).is_same(other)) << "another shard's state is left where it was";
    if (store.pinned()) {
      EXPECT_TRUE(store.master(1).is_pinned());
      EXPECT_TRUE(store.state(1, 0).is_pinned() && store.state(1, 1).is_pinned());
      const at::Tensor pinned = store.state(1, 0);
      store.pin_states({1});  // the model added again, say
      EXPECT_TRUE(store.state(1, 0).is_same(pinned)) << "pinned once";
    }
  }
}

// Stands in for the accelerator's pinned allocator, counting what is asked of it.
struct CountingPinnedAllocator {
  static inline std::vector<int64_t> blocks;
  static at::Tensor allocate(int64_t bytes) {
    blocks.push_back(bytes);
    return at::empty({bytes}, at::kByte);
  }
  CountingPinnedAllocator() : replaced(hydra::engine::set_pinned_allocator(&allocate)) { blocks.clear(); }
  ~CountingPinnedAllocator() { hydra::engine::set_pinned_allocator(replaced); }
  hydra::engine::PinnedAllocator replaced;
};

// Pinned memory is one block per model, of the bytes it holds (each piece on a cache line): the transfer sources of
// all shards, then the device-stepped shards' masters and states; not a block per buffer rounded up to a power of
// two as the caching host allocator would.
TEST(ShardStore, PinsOneBlockOfTheTransferSourcesAndOneOfTheDeviceSteppedStates) {
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    CountingPinnedAllocator counting;
    const at::Tensor tied = param({40}, 1.0);
    ShardStore store({{tied, param({33}, 2.0)}, {param({70}, 3.0)}, {param({5}, 4.0), tied}}, OptimizerSpec{}, bf16,
                     /*pin_memory=*/true);
    ASSERT_TRUE(store.pinned());
    const int64_t element = bf16 ? 2 : 4;
    auto piece = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
    int64_t sources = 0;
    for (int s = 0; s < 3; ++s) sources += piece(store.owned_numel(s) * element);
    ASSERT_EQ(CountingPinnedAllocator::blocks, std::vector<int64_t>{sources});
    const void* block = store.transfer_source(0).storage().data();
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(store.transfer_source(s).storage().data(), block) << "shard " << s;
      EXPECT_EQ(store.transfer_source(s).numel(), store.owned_numel(s));
      EXPECT_EQ(store.transfer_source(s).storage_offset() * element % 64, 0);
      EXPECT_TRUE(at::equal(store.transfer_source(s), store.master(s).to(store.compute_dtype())));
    }
    EXPECT_TRUE(same_values(store.master(0).narrow(0, 0, 40), flat(tied)));

    for (int s = 0; s < 3; ++s)
      for (int k = 0; k < 2; ++k) store.state(s, k).copy_(values({store.state(s, k).numel()}, 5.0 + s + k));
    const at::Tensor master = store.master(2).clone(), moment = store.state(2, 1).clone();
    store.pin_states({0, 2});
    int64_t states = 0;
    for (int s : {0, 2})
      states += (bf16 ? piece(store.owned_numel(s) * 4) : 0) + 2 * piece(store.trainable_numel(s) * 4);
    ASSERT_EQ(CountingPinnedAllocator::blocks, (std::vector<int64_t>{sources, states}));
    EXPECT_EQ(store.state(0, 0).storage().data(), store.state(2, 1).storage().data());
    EXPECT_NE(store.state(1, 0).storage().data(), store.state(2, 1).storage().data()) << "shard 1 is not moved";
    EXPECT_TRUE(at::equal(store.master(2), master));
    EXPECT_TRUE(at::equal(store.state(2, 1), moment));
    store.pin_states({2});  // the model added again
    EXPECT_EQ(CountingPinnedAllocator::blocks.size(), 2u) << "a shard is moved once";
  }
}

TEST(ShardStore, WriteBackGivesEachParameterAnIndependentMasterCopy) {
  at::Tensor d = param({2, 3}, 1.0, true, at::kDouble);
  at::Tensor hf = param({4}, 2.0, true, at::kHalf);
  TiedModel m;
  std::vector<std::vector<at::Tensor>> shards = m.shards();
  shards[1].push_back(d);
  shards[1].push_back(hf);
  ShardStore store(shards, OptimizerSpec{}, false, false);
  EXPECT_EQ(entry_for(store, 1, d).original_dtype, at::kDouble);
  EXPECT_EQ(entry_for(store, 1, hf).original_dtype, at::kHalf);

  // Training changed the master; the parameters carry stale gradients.
  for (int s = 0; s < store.num_shards(); ++s) store.master(s).mul_(-2.0f).add_(0.25f);
  for (const at::Tensor& p : {m.e, m.a, m.g, m.h, d}) p.mutable_grad() = at::ones_like(p);
  const at::Tensor e_impl_holder = m.e;  // identity check: the same object survives
  store.write_back();

  std::vector<const void*> pointers;
  for (int s = 0; s < store.num_shards(); ++s) {
    for (const ParamEntry& e : store.layout(s)) {
      if (e.owner != s) continue;
      const at::Tensor& p = e.param;
      SCOPED_TRACE(testing::Message() << "shard " << s << " offset " << e.master_offset);
      EXPECT_EQ(p.scalar_type(), e.original_dtype);
      EXPECT_TRUE(p.is_contiguous());
      const at::Tensor expected = store.master(s).narrow(0, e.master_offset, e.numel).to(e.original_dtype);
      EXPECT_TRUE(at::equal(p.detach().reshape({-1}), expected));
      EXPECT_FALSE(p.grad().defined()) << "write_back drops the gradients";
      EXPECT_EQ(p.requires_grad(), e.trainable);
      // Its own storage: not a view of the master, nor shared with another parameter.
      const auto* base = static_cast<const char*>(store.master(s).data_ptr());
      const auto* ptr = static_cast<const char*>(p.data_ptr());
      EXPECT_FALSE(ptr >= base && ptr < base + store.master(s).nbytes());
      pointers.push_back(p.data_ptr());
    }
  }
  std::sort(pointers.begin(), pointers.end());
  EXPECT_EQ(std::adjacent_find(pointers.begin(), pointers.end()), pointers.end());
  EXPECT_EQ(pointers.size(), 8u);

  // The tie survives: the borrower's entry is the very same tensor object, holding the owner's value.
  EXPECT_EQ(entry_for(store, 2, m.e).param.unsafeGetTensorImpl(), e_impl_holder.unsafeGetTensorImpl());
  EXPECT_EQ(entry_for(store, 0, m.e).param.unsafeGetTensorImpl(), entry_for(store, 2, m.e).param.unsafeGetTensorImpl());
  EXPECT_TRUE(at::equal(flat(m.e), store.master(0).narrow(0, 0, 40)));
  EXPECT_EQ(m.e.sizes(), (std::vector<int64_t>{10, 4}));
  EXPECT_TRUE(same_values(d, store.master(1).narrow(0, entry_for(store, 1, d).master_offset, 6).view({2, 3})));

  // Independent: later changes to the master no longer reach the parameters.
  const at::Tensor before = m.a.detach().clone();
  store.master(0).zero_();
  EXPECT_TRUE(at::equal(m.a.detach(), before));
}

}  // namespace
