// CopyLane and StagingRing: copies in submission order after their fences (but for one that cannot start yet),
// the emulated link's pace, and landing buffers that bound host memory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <vector>

#include "engine/copy_lane.h"
#include "engine/staging_ring.h"
#include "manual_fence.h"

namespace {

using hydra::engine::CopyLane;
using hydra::engine::DeviceEvent;
using hydra::engine::Fence;
using hydra::engine::StagingRing;
using hydra::engine::testing::ManualFence;
using hydra::engine::testing::ready_within;
using namespace std::chrono_literals;

const c10::Device kCpu("cpu");

TEST(CopyLane, CopiesAtTheEmulatedLinksPace) {
  const double bandwidth = 1e8;  // bytes/s
  CopyLane lane(kCpu, bandwidth);
  const at::Tensor source = at::arange(1 << 20, at::kFloat);  // 4 MiB: at least 42 ms on this link
  const at::Tensor target = at::zeros_like(source);
  const auto start = std::chrono::steady_clock::now();
  Fence copied = lane.submit({}, [&]() -> DeviceEvent { return lane.copy({{target, source}}); });
  copied.wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, source.numel() * 4 / bandwidth);
  EXPECT_GE(lane.busy_seconds(), source.numel() * 4 / bandwidth);
  EXPECT_TRUE(at::equal(target, source));
}

TEST(CopyLane, RejectsANegativeBandwidth) { EXPECT_THROW(CopyLane(kCpu, -1.0), c10::Error); }

TEST(CopyLane, CopiesWaitForTheirFencesAndKeepSubmissionOrder) {
  CopyLane lane(kCpu, 0.0);
  const at::Tensor a = at::full({64}, 1.0f), b = at::full({64}, 2.0f), target = at::zeros({64});
  ManualFence gate;  // say, the host step that writes `a`
  Fence first = lane.submit({gate.fence}, [&]() -> DeviceEvent { return lane.copy({{target, a}}); });
  Fence second = lane.submit({}, [&]() -> DeviceEvent { return lane.copy({{target, b}}); });
  EXPECT_FALSE(ready_within(second, 50ms)) << "a later copy overtook one waiting for its fence";
  gate.finish();
  EXPECT_TRUE(ready_within(second, 10s));
  EXPECT_TRUE(first.ready());
  EXPECT_TRUE(at::equal(target, b)) << "the copies ran out of order";
}

TEST(CopyLane, AFailedFenceDelaysTheCopyButIsReportedByItsOwner) {
  CopyLane lane(kCpu, 0.0);
  std::promise<DeviceEvent> failing;
  Fence failed(failing.get_future().share());
  failing.set_exception(std::make_exception_ptr(std::runtime_error("step failed")));
  Fence copied = lane.submit({failed}, []() -> DeviceEvent { return nullptr; });
  EXPECT_NO_THROW(copied.wait());
  EXPECT_THROW(failed.wait(), std::runtime_error);
}

TEST(CopyLane, ACopyThatCannotStartYetLetsALaterOneThatCanGoFirst) {
  CopyLane lane(kCpu, 0.0);
  const at::Tensor a = at::full({64}, 1.0f), b = at::full({64}, 2.0f), ta = at::zeros({64}), tb = at::zeros({64});
  std::atomic<bool> room{false};  // say, a landing buffer of model a's
  Fence first = lane.submit_when({}, [&]() -> DeviceEvent { return lane.copy({{ta, a}}); }, /*chain=*/0,
                                 [&] { return room.load(); });
  Fence second = lane.submit_when({}, [&]() -> DeviceEvent { return lane.copy({{tb, b}}); }, /*chain=*/1,
                                  [] { return true; });
  EXPECT_TRUE(ready_within(second, 10s)) << "a copy that could start waited behind one that could not";
  EXPECT_FALSE(ready_within(first, 20ms)) << "taken before it could start";
  room = true;
  lane.poke();
  EXPECT_TRUE(ready_within(first, 10s)) << "the poke did not start it";
  EXPECT_TRUE(at::equal(ta, a) && at::equal(tb, b));
}

TEST(CopyLane, APlainCopyWaitsForACopyQueuedBeforeItThatCannotStartYet) {
  CopyLane lane(kCpu, 0.0);
  std::atomic<bool> room{false};
  std::vector<int> order;
  Fence first = lane.submit_when({}, [&]() -> DeviceEvent {
    order.push_back(0);
    return nullptr;
  }, 0, [&] { return room.load(); });
  Fence second = lane.submit({}, [&]() -> DeviceEvent {
    order.push_back(1);
    return nullptr;
  });
  EXPECT_FALSE(ready_within(second, 50ms)) << "a plain copy overtook the copy queued before it";
  room = true;
  lane.poke();
  EXPECT_TRUE(ready_within(second, 10s));
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(StagingRing, ACopyWaitsForAFreeBufferAndBuffersGrowToTheRequest) {
  auto ring = StagingRing::make(2, /*pinned=*/false);
  EXPECT_TRUE(ring->has_free());
  auto first = ring->acquire(64);
  auto second = ring->acquire(256);
  EXPECT_FALSE(ring->has_free());
  EXPECT_EQ(second->view(at::kFloat, 64).numel(), 64);
  EXPECT_EQ(ring->host_bytes(), 64 + 256);
  auto third = std::async(std::launch::async, [&] { return ring->acquire(128); });
  EXPECT_EQ(third.wait_for(50ms), std::future_status::timeout) << "a third lease from a ring of two";
  first.reset();
  ASSERT_EQ(third.wait_for(10s), std::future_status::ready);
  auto lease = third.get();
  EXPECT_EQ(lease->view(at::kByte, 128).numel(), 128);
  EXPECT_EQ(ring->host_bytes(), 128 + 256) << "the freed 64-byte buffer grew to 128";
}

TEST(StagingRing, ShrinkFreesTheBuffersNoLeaseHolds) {
  auto ring = StagingRing::make(2, /*pinned=*/false);
  auto held = ring->acquire(64);
  ring->acquire(256).reset();
  ring->shrink();
  EXPECT_EQ(ring->host_bytes(), 64);
  held.reset();
  ring->shrink();
  EXPECT_EQ(ring->host_bytes(), 0);
}

TEST(StagingRing, ALeaseKeepsItsRingAlive) {
  auto ring = StagingRing::make(1, /*pinned=*/false);
  auto lease = ring->acquire(64);
  std::weak_ptr<StagingRing> watch = ring;
  ring.reset();
  EXPECT_FALSE(watch.expired()) << "the ring went while a lease still held one of its buffers";
  lease.reset();
  EXPECT_TRUE(watch.expired());
}

TEST(StagingRing, RejectsAnEmptyRing) { EXPECT_THROW(StagingRing::make(0, false), c10::Error); }

}  // namespace
