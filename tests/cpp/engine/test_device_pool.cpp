// DevicePool on the CPU device: the budget held by construction, typed views, fenced deferred reuse.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <vector>

#include "engine/device_pool.h"
#include "engine/fence.h"
#include "manual_fence.h"

namespace {

using hydra::engine::DevicePool;
using hydra::engine::Fence;
using hydra::engine::Region;
using hydra::engine::testing::ManualFence;

const c10::Device kCpu("cpu");

TEST(DevicePool, RejectsNonPositiveBudget) {
  EXPECT_THROW(DevicePool(kCpu, 0), c10::Error);
  EXPECT_THROW(DevicePool(kCpu, -512), c10::Error);
}

TEST(DevicePool, AllocationsNeverExceedTheBudget) {
  DevicePool pool(kCpu, 5000);  // 9 units of 512 usable
  EXPECT_EQ(pool.budget(), 5000);
  std::vector<Region> regions;
  for (int i = 0; i < 4; ++i) {
    auto a = pool.allocate(1000);
    ASSERT_TRUE(a.has_value()) << i;
    EXPECT_EQ(a->region.bytes, 1024);
    EXPECT_EQ(a->region.offset % 512, 0);
    EXPECT_TRUE(a->after.empty());
    regions.push_back(a->region);
  }
  EXPECT_EQ(pool.capacity(), 4608);
  EXPECT_FALSE(pool.allocate(1000).has_value()) << "only 512 bytes are left";
  auto last = pool.allocate(1);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->region.bytes, 512);
  EXPECT_FALSE(pool.allocate(1).has_value());
  EXPECT_EQ(pool.in_use(), 4608);
  EXPECT_LE(pool.in_use(), pool.budget());
  EXPECT_LE(pool.high_water(), pool.budget());
  for (size_t i = 0; i < regions.size(); ++i)
    for (size_t j = i + 1; j < regions.size(); ++j)
      EXPECT_TRUE(regions[i].offset + regions[i].bytes <= regions[j].offset ||
                  regions[j].offset + regions[j].bytes <= regions[i].offset);
}

TEST(DevicePool, DemandCapsTheArenaAndIsFixedAfterFirstUse) {
  DevicePool pool(kCpu, 1 << 20);
  pool.set_demand(3000);
  EXPECT_EQ(pool.capacity(), 3000);  // not allocated yet: min(budget, demand)
  auto a = pool.allocate(2048);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(pool.capacity(), 2560);  // rounded down to the 512-byte alignment
  EXPECT_FALSE(pool.allocate(1024).has_value());
  EXPECT_THROW(pool.set_demand(1 << 20), c10::Error);
  EXPECT_EQ(pool.capacity(), 2560);
}

TEST(DevicePool, ViewsAreTypedAndDisjoint) {
  DevicePool pool(kCpu, 4096);
  auto a = pool.allocate(64 * 4);
  auto b = pool.allocate(64 * 4);
  ASSERT_TRUE(a && b);
  at::Tensor va = pool.view(a->region, at::kFloat, 64);
  at::Tensor vb = pool.view(b->region, at::kFloat, 64);
  EXPECT_EQ(va.scalar_type(), at::kFloat);
  EXPECT_EQ(va.numel(), 64);
  EXPECT_EQ(va.device(), kCpu);
  va.fill_(1.5f);
  vb.fill_(-2.0f);
  EXPECT_TRUE(at::equal(va, at::full({64}, 1.5f)));
  EXPECT_TRUE(at::equal(pool.view(a->region, at::kFloat, 64), va)) << "a second view sees the same memory";
  // A view starts at its region's offset in the arena, which is as aligned as the allocator's tensors.
  const auto* base = static_cast<const char*>(pool.view(Region{0, 512}, at::kByte, 1).data_ptr());
  EXPECT_EQ(static_cast<const char*>(va.data_ptr()) - base, a->region.offset);
  EXPECT_EQ(static_cast<const char*>(vb.data_ptr()) - base, b->region.offset);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(vb.data_ptr()) % c10::gAlignment, 0u);
  EXPECT_EQ(pool.view(a->region, at::kBFloat16, 256).numel(), 256);  // a region holds 512 bytes
  EXPECT_THROW(pool.view(a->region, at::kFloat, 129), c10::Error);
}

TEST(DevicePool, IdleMemoryIsPreferredAndReusedMemoryCarriesTheFenceOfItsLastUser) {
  DevicePool pool(kCpu, 3 * 1024);
  auto a = pool.allocate(1024);
  auto b = pool.allocate(1024);
  ASSERT_TRUE(a && b);
  ManualFence fa;
  pool.release(a->region, fa.fence);
  EXPECT_EQ(pool.in_use(), 1024) << "a released range is free at once";
  // a's hole fits exactly, but its last user still runs: the range nobody used is taken, with no ordering.
  auto c = pool.allocate(1024);
  ASSERT_TRUE(c);
  EXPECT_NE(c->region.offset, a->region.offset);
  EXPECT_TRUE(c->after.empty());
  // Only a's hole is left: it is handed out, ordered after a's last user.
  auto d = pool.allocate(1024);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->region.offset, a->region.offset);
  ASSERT_EQ(d->after.size(), 1u);
  EXPECT_FALSE(d->after[0].ready());
  fa.finish();
  EXPECT_TRUE(d->after[0].ready());
  EXPECT_LE(pool.high_water(), pool.budget());
}

TEST(DevicePool, IdleMemoryBetweenRangesStillInUseAtBothEndsOfTheFreeSpaceIsFound) {
  DevicePool pool(kCpu, 8 * 1024);
  auto a = pool.allocate(1024);  // [0, 1024): the start of the free space once released
  auto rest = pool.allocate(6 * 1024);
  auto b = pool.allocate(1024);  // [7168, 8192): its end
  ASSERT_TRUE(a && rest && b);
  ManualFence fa, fb;  // say, two models' gradient copies still queued
  pool.release(rest->region, Fence());
  pool.release(a->region, fa.fence);
  pool.release(b->region, fb.fence);
  // One free range, both of whose ends a copy still reads: the idle middle is taken, with no ordering.
  auto c = pool.allocate(2048);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->after.empty()) << "placed at " << c->region.offset << " over memory a copy still reads";
  EXPECT_GE(c->region.offset, 1024);
  EXPECT_LE(c->region.offset + c->region.bytes, 7168);
  fa.finish();
  fb.finish();
}

TEST(DevicePool, FinishedReleaseIsReusedWithoutOrdering) {
  DevicePool pool(kCpu, 1024);
  auto a = pool.allocate(1024);
  ASSERT_TRUE(a);
  ManualFence fa;
  pool.release(a->region, fa.fence);
  fa.finish();
  auto b = pool.allocate(1024);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->region.offset, 0);
  EXPECT_TRUE(b->after.empty()) << "a finished release needs no ordering";
  pool.release(b->region, Fence());  // a default Fence is already done
  auto c = pool.allocate(512);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->after.empty());
}

TEST(DevicePool, PendingReleasesAreReclaimedOldestFirst) {
  DevicePool pool(kCpu, 2048);
  auto a = pool.allocate(1024);
  auto b = pool.allocate(1024);
  ASSERT_TRUE(a && b);
  ManualFence fa, fb;
  pool.release(a->region, fa.fence);
  pool.release(b->region, fb.fence);
  auto c = pool.allocate(1024);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->region.offset, a->region.offset) << "the oldest release goes first";
  ASSERT_EQ(c->after.size(), 1u) << "only the reclaimed range's fence orders the new user";
  fa.finish();
  EXPECT_TRUE(c->after[0].ready());
  auto d = pool.allocate(1024);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->region.offset, b->region.offset);
  ASSERT_EQ(d->after.size(), 1u);
  EXPECT_FALSE(d->after[0].ready());
  fb.finish();
  EXPECT_TRUE(d->after[0].ready());
}

TEST(DevicePool, FencesOfReclaimedRangesCarryOverAfterAFailedAllocation) {
  DevicePool pool(kCpu, 2048);
  auto a = pool.allocate(1024);
  auto b = pool.allocate(1024);
  ASSERT_TRUE(a && b);
  ManualFence fa;
  pool.release(a->region, fa.fence);
  // Reclaiming a is not enough for 2048 bytes while b is held: nothing is returned...
  EXPECT_FALSE(pool.allocate(2048).has_value());
  // ...but whoever gets a's range next must still be ordered after a's last user.
  auto c = pool.allocate(1024);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->region.offset, a->region.offset);
  ASSERT_EQ(c->after.size(), 1u);
  EXPECT_FALSE(c->after[0].ready());
  fa.finish();
  EXPECT_TRUE(c->after[0].ready());
  EXPECT_THROW(pool.release(Region{}, Fence()), c10::Error);
}

}  // namespace
