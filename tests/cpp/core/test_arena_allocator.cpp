// ArenaAllocator: the offset allocator behind every device buffer, so the budget is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/arena_allocator.h"

namespace {

using hydra::core::ArenaAllocator;

TEST(ArenaAllocator, CapacityIsRoundedDownToTheAlignment) {
  EXPECT_EQ(ArenaAllocator(1000, 256).capacity(), 768);
  EXPECT_EQ(ArenaAllocator(1024, 256).capacity(), 1024);
  EXPECT_EQ(ArenaAllocator(255, 256).capacity(), 0);
  EXPECT_EQ(ArenaAllocator(0, 256).capacity(), 0);
  EXPECT_EQ(ArenaAllocator(1000, 1).capacity(), 1000);
  EXPECT_EQ(ArenaAllocator(1000).capacity(), 768);  // default alignment 256
}

TEST(ArenaAllocator, TrailingPartialUnitIsNeverHandedOut) {
  ArenaAllocator arena(1000, 256);  // 768 usable
  ASSERT_TRUE(arena.allocate(768).has_value());
  EXPECT_FALSE(arena.allocate(1).has_value());
  EXPECT_EQ(arena.in_use(), 768);
  EXPECT_LE(arena.in_use(), arena.capacity());
}

TEST(ArenaAllocator, EmptyArenaRefusesEverything) {
  ArenaAllocator arena(100, 256);
  EXPECT_EQ(arena.capacity(), 0);
  EXPECT_EQ(arena.largest_free(), 0);
  EXPECT_FALSE(arena.allocate(0).has_value());
  EXPECT_FALSE(arena.allocate(1).has_value());
}

TEST(ArenaAllocator, RejectsBadArguments) {
  EXPECT_THROW(ArenaAllocator(1024, 0), std::invalid_argument);
  EXPECT_THROW(ArenaAllocator(1024, -256), std::invalid_argument);
  EXPECT_THROW(ArenaAllocator(1024, 300), std::invalid_argument);
  EXPECT_THROW(ArenaAllocator(-1, 256), std::invalid_argument);
  ArenaAllocator arena(1024, 256);
  EXPECT_THROW(arena.allocate(-1), std::invalid_argument);
  EXPECT_EQ(arena.in_use(), 0);
}

TEST(ArenaAllocator, RoundedUpToAlignment) {
  ArenaAllocator arena(4096, 256);
  EXPECT_EQ(arena.rounded(0), 0);
  EXPECT_EQ(arena.rounded(1), 256);
  EXPECT_EQ(arena.rounded(256), 256);
  EXPECT_EQ(arena.rounded(257), 512);
  EXPECT_EQ(arena.rounded(1000), 1024);
}

TEST(ArenaAllocator, EveryOffsetIsAlignedAndSizesAreRounded) {
  ArenaAllocator arena(1 << 16, 128);
  const std::vector<int64_t> sizes = {1, 127, 128, 129, 0, 300, 5, 1000, 64, 255};
  int64_t expected_in_use = 0;
  std::vector<int64_t> offsets;
  for (int64_t s : sizes) {
    auto offset = arena.allocate(s);
    ASSERT_TRUE(offset.has_value()) << "size " << s;
    EXPECT_EQ(*offset % 128, 0) << "size " << s << " got offset " << *offset;
    offsets.push_back(*offset);
    expected_in_use += arena.rounded(s == 0 ? 1 : s);
  }
  EXPECT_EQ(arena.in_use(), expected_in_use);
  // A fresh arena hands out consecutive rounded ranges from 0.
  int64_t cursor = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(offsets[i], cursor) << "allocation " << i;
    cursor += arena.rounded(sizes[i] == 0 ? 1 : sizes[i]);
  }
}

TEST(ArenaAllocator, ZeroByteAllocationsAreDistinct) {
  ArenaAllocator arena(1024, 256);
  auto a = arena.allocate(0);
  auto b = arena.allocate(0);
  ASSERT_TRUE(a && b);
  EXPECT_NE(*a, *b);
  EXPECT_EQ(arena.in_use(), 512);
}

TEST(ArenaAllocator, InUseAndHighWaterBookkeeping) {
  ArenaAllocator arena(4096, 256);
  EXPECT_EQ(arena.in_use(), 0);
  EXPECT_EQ(arena.high_water(), 0);
  auto a = arena.allocate(300);   // 512
  auto b = arena.allocate(1024);  // 1024
  ASSERT_TRUE(a && b);
  EXPECT_EQ(arena.in_use(), 1536);
  EXPECT_EQ(arena.high_water(), 1536);
  arena.release(*a);
  EXPECT_EQ(arena.in_use(), 1024);
  EXPECT_EQ(arena.high_water(), 1536);  // a high-water mark never goes down
  auto c = arena.allocate(256);
  ASSERT_TRUE(c);
  EXPECT_EQ(arena.in_use(), 1280);
  EXPECT_EQ(arena.high_water(), 1536);
  auto d = arena.allocate(2048);
  ASSERT_TRUE(d);
  EXPECT_EQ(arena.in_use(), 3328);
  EXPECT_EQ(arena.high_water(), 3328);
  arena.release(*b);
  arena.release(*c);
  arena.release(*d);
  EXPECT_EQ(arena.in_use(), 0);
  EXPECT_EQ(arena.high_water(), 3328);
  EXPECT_EQ(arena.largest_free(), 4096);
}

TEST(ArenaAllocator, BestFitPicksTheSmallestHoleThatFits) {
  // Layout (units of 256): [A:4][x:1][B:2][y:1][C:3][z:1][tail:4]; free A, B, C -> holes of 4, 2, 3 units.
  ArenaAllocator arena(16 * 256, 256);
  auto A = arena.allocate(4 * 256);
  auto x = arena.allocate(256);
  auto B = arena.allocate(2 * 256);
  auto y = arena.allocate(256);
  auto C = arena.allocate(3 * 256);
  auto z = arena.allocate(256);
  ASSERT_TRUE(A && x && B && y && C && z);
  EXPECT_EQ(*C, 8 * 256);
  arena.release(*A);
  arena.release(*B);
  arena.release(*C);
  // Holes: A=4 units @0, B=2 @5, C=3 @8, tail=4 @12.
  EXPECT_EQ(arena.largest_free(), 4 * 256);

  auto two = arena.allocate(2 * 256);  // exact fit: B
  ASSERT_TRUE(two);
  EXPECT_EQ(*two, *B);
  auto three = arena.allocate(3 * 256 - 100);  // rounds to 3 units: exact fit C, not A or the tail
  ASSERT_TRUE(three);
  EXPECT_EQ(*three, *C);
  auto one = arena.allocate(1);  // holes left: A (4 units) and the tail (4 units): ties go to the lowest offset
  ASSERT_TRUE(one);
  EXPECT_EQ(*one, *A);
  auto four = arena.allocate(4 * 256);  // A has 3 units left, so only the tail fits
  ASSERT_TRUE(four);
  EXPECT_EQ(*four, 12 * 256);
  EXPECT_EQ(arena.largest_free(), 3 * 256);
}

TEST(ArenaAllocator, BestFitPrefersSmallHoleOverLargerLowerOne) {
  ArenaAllocator arena(10 * 256, 256);
  auto big = arena.allocate(5 * 256);    // @0
  auto sep = arena.allocate(256);        // @5
  auto small = arena.allocate(2 * 256);  // @6
  auto sep2 = arena.allocate(2 * 256);   // @8, arena now full
  ASSERT_TRUE(big && sep && small && sep2);
  EXPECT_FALSE(arena.allocate(1).has_value());
  arena.release(*big);
  arena.release(*small);
  auto got = arena.allocate(256);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, 6 * 256) << "the 2-unit hole is the best fit, not the 5-unit hole at 0";
  EXPECT_EQ(arena.largest_free(), 5 * 256);  // the large hole survived
}

TEST(ArenaAllocator, ReleaseCoalescesWithFollowingNeighbour) {
  ArenaAllocator arena(4 * 256, 256);
  auto a = arena.allocate(256);
  auto b = arena.allocate(256);
  auto c = arena.allocate(256);
  auto d = arena.allocate(256);
  ASSERT_TRUE(a && b && c && d);
  arena.release(*c);
  arena.release(*b);  // merges with c (after it)
  EXPECT_EQ(arena.largest_free(), 512);
  auto bc = arena.allocate(512);
  ASSERT_TRUE(bc);
  EXPECT_EQ(*bc, 256);
}

TEST(ArenaAllocator, ReleaseCoalescesWithPrecedingNeighbour) {
  ArenaAllocator arena(4 * 256, 256);
  auto a = arena.allocate(256);
  auto b = arena.allocate(256);
  auto c = arena.allocate(256);
  auto d = arena.allocate(256);
  ASSERT_TRUE(a && b && c && d);
  arena.release(*b);
  arena.release(*c);  // merges with b (before it)
  EXPECT_EQ(arena.largest_free(), 512);
  auto bc = arena.allocate(512);
  ASSERT_TRUE(bc);
  EXPECT_EQ(*bc, 256);
}

TEST(ArenaAllocator, ReleaseCoalescesBothSidesAtOnce) {
  ArenaAllocator arena(5 * 256, 256);
  std::vector<int64_t> r;
  for (int i = 0; i < 5; ++i) r.push_back(*arena.allocate(256));
  arena.release(r[1]);
  arena.release(r[3]);
  EXPECT_EQ(arena.largest_free(), 256);
  arena.release(r[2]);  // joins [1] and [3] into one 3-unit hole
  EXPECT_EQ(arena.largest_free(), 3 * 256);
  auto three = arena.allocate(3 * 256);
  ASSERT_TRUE(three);
  EXPECT_EQ(*three, 256);
  arena.release(*three);
  arena.release(r[0]);
  arena.release(r[4]);
  EXPECT_EQ(arena.in_use(), 0);
  EXPECT_EQ(arena.largest_free(), 5 * 256);  // everything back to one range
  auto all = arena.allocate(5 * 256);
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, 0);
}

TEST(ArenaAllocator, FragmentationFailsEvenWhenTotalFreeSuffices) {
  ArenaAllocator arena(4 * 256, 256);
  auto a = arena.allocate(256);
  auto b = arena.allocate(256);
  auto c = arena.allocate(256);
  auto d = arena.allocate(256);
  ASSERT_TRUE(a && b && c && d);
  arena.release(*a);
  arena.release(*c);
  EXPECT_EQ(arena.capacity() - arena.in_use(), 512);
  EXPECT_EQ(arena.largest_free(), 256);
  EXPECT_FALSE(arena.allocate(512).has_value());
  EXPECT_EQ(arena.in_use(), 512);  // a failed allocation changes nothing
  EXPECT_TRUE(arena.allocate(256).has_value());
}

TEST(ArenaAllocator, InvalidReleaseThrows) {
  ArenaAllocator arena(1024, 256);
  auto a = arena.allocate(256);
  ASSERT_TRUE(a);
  EXPECT_THROW(arena.release(*a + 256), std::invalid_argument);  // free space, not an allocation
  EXPECT_THROW(arena.release(*a + 1), std::invalid_argument);    // inside an allocation
  EXPECT_THROW(arena.release(-256), std::invalid_argument);
  EXPECT_EQ(arena.in_use(), 256);
  arena.release(*a);
  EXPECT_THROW(arena.release(*a), std::invalid_argument);  // double release
  EXPECT_EQ(arena.in_use(), 0);
  EXPECT_EQ(arena.largest_free(), 1024);
}

TEST(ArenaAllocator, RandomizedStressKeepsInvariants) {
  constexpr int64_t kAlign = 64;
  constexpr int64_t kCapacity = 64 * 1024 + 37;  // not a multiple: capacity rounds down
  ArenaAllocator arena(kCapacity, kAlign);
  ASSERT_EQ(arena.capacity(), 64 * 1024);
  std::mt19937_64 rng(20240607);
  std::uniform_int_distribution<int64_t> size_dist(0, 6000);
  std::map<int64_t, int64_t> live;  // offset -> rounded size
  int64_t successes = 0, failures = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const bool do_alloc = live.empty() || (rng() % 100) < 55;
    if (do_alloc) {
      const int64_t bytes = size_dist(rng);
      const int64_t size = arena.rounded(bytes == 0 ? 1 : bytes);
      const int64_t largest_before = arena.largest_free();
      auto offset = arena.allocate(bytes);
      if (!offset) {
        ++failures;
        ASSERT_LT(largest_before, size) << "allocation failed although a hole of " << largest_before << " existed";
        continue;
      }
      ++successes;
      ASSERT_EQ(*offset % kAlign, 0);
      ASSERT_GE(*offset, 0);
      ASSERT_LE(*offset + size, arena.capacity());
      // No overlap with any live range: check the neighbours in offset order.
      auto next = live.lower_bound(*offset);
      if (next != live.end()) ASSERT_LE(*offset + size, next->first) << "overlaps the following allocation";
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *offset) << "overlaps the preceding allocation";
      }
      live.emplace(*offset, size);
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<int64_t>(rng() % live.size()));
      arena.release(it->first);
      live.erase(it);
    }
    int64_t sum = 0;
    for (const auto& [o, s] : live) sum += s;
    ASSERT_EQ(arena.in_use(), sum) << "iteration " << iter;
    ASSERT_LE(arena.in_use(), arena.capacity());
    ASSERT_LE(arena.high_water(), arena.capacity());
    ASSERT_GE(arena.high_water(), arena.in_use());
    ASSERT_LE(arena.largest_free(), arena.capacity() - arena.in_use());
  }
  EXPECT_GT(successes, 1000);
  EXPECT_GT(failures, 0) << "the stress test should also exercise the full-arena path";
  for (const auto& [o, s] : live) arena.release(o);
  EXPECT_EQ(arena.in_use(), 0);
  // With everything released, coalescing must have restored a single range.
  EXPECT_EQ(arena.largest_free(), arena.capacity());
}

TEST(ArenaAllocator, AllocationAvoidsWhatThePredicateRefuses) {
  ArenaAllocator arena(4096, 256);
  const auto a = arena.allocate(1024);  // [0, 1024)
  const auto b = arena.allocate(1024);  // [1024, 2048)
  ASSERT_TRUE(a && b);
  arena.release(*a);  // free: [0, 1024) and [2048, 4096)
  auto not_first_kib = [](int64_t offset, int64_t size) { return offset >= 1024 || offset + size <= 0; };
  EXPECT_EQ(arena.allocate(1024, not_first_kib), 2048) << "best fit would take [0, 1024)";
  // [2048, 4096) is now [3072, 4096): a 512-byte request may take its end only if the start is refused.
  auto not_3072 = [](int64_t offset, int64_t) { return offset != 3072; };
  EXPECT_EQ(arena.allocate(512, [&](int64_t o, int64_t s) { return not_first_kib(o, s) && not_3072(o, s); }), 3584);
  EXPECT_FALSE(arena.allocate(256, [](int64_t, int64_t) { return false; }));
  EXPECT_EQ(arena.in_use(), 1024 + 1024 + 512);
  EXPECT_EQ(arena.allocate(1024), 0);
}

TEST(ArenaAllocator, PlacesAlsoTriedInsideAFreeRange) {
  ArenaAllocator arena(4096, 256);
  auto refuse_ends = [](int64_t offset, int64_t size) { return offset >= 1024 && offset + size <= 3072; };
  EXPECT_FALSE(arena.allocate(1024, refuse_ends)) << "only the ends are tried";
  EXPECT_FALSE(arena.allocate(1024, refuse_ends, {3072, 100, -256})) << "outside, unaligned or beyond the range";
  EXPECT_EQ(arena.allocate(1024, refuse_ends, {1024}), 1024);
  EXPECT_EQ(arena.in_use(), 1024);
}

}  // namespace

