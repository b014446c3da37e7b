#include "gpu/block_planner.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

namespace strata::internal {
namespace {

constexpr uint64_t kA = BlockPlanner::kAlignment;

TEST(BlockPlannerTest, RoundsToAlignmentAndFillsExactly) {
  BlockPlanner p(4 * kA + 100);  // the ragged tail is unusable
  EXPECT_EQ(p.capacity(), 4 * kA);
  auto a = p.Allocate(1);
  auto b = p.Allocate(kA + 1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, kA);
  EXPECT_EQ(p.free_bytes(), kA);
  EXPECT_FALSE(p.Allocate(kA + 1));
  auto c = p.Allocate(kA);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, 3 * kA);
  EXPECT_EQ(p.free_bytes(), 0u);
  EXPECT_FALSE(p.Allocate(1));
}

TEST(BlockPlannerTest, BestFitPicksSmallestHole) {
  BlockPlanner p(16 * kA);
  auto a = p.Allocate(4 * kA);  // [0,4)
  auto b = p.Allocate(kA);      // [4,5)
  auto c = p.Allocate(2 * kA);  // [5,7)
  auto d = p.Allocate(kA);      // [7,8)
  ASSERT_TRUE(a && b && c && d);
  p.Free(*a, 4 * kA);  // hole of 4 at 0
  p.Free(*c, 2 * kA);  // hole of 2 at 5; tail hole of 8 at 8
  auto e = p.Allocate(2 * kA);
  ASSERT_TRUE(e);
  EXPECT_EQ(*e, 5 * kA);  // exact fit, not the first or the largest hole
  auto f = p.Allocate(3 * kA);
  ASSERT_TRUE(f);
  EXPECT_EQ(*f, 0u);  // 4-block hole beats the 8-block tail
}

TEST(BlockPlannerTest, FreeCoalescesBothNeighbours) {
  BlockPlanner p(3 * kA);
  auto a = p.Allocate(kA), b = p.Allocate(kA), c = p.Allocate(kA);
  ASSERT_TRUE(a && b && c);
  p.Free(*a, kA);
  p.Free(*c, kA);
  EXPECT_EQ(p.free_extents(), 2u);
  EXPECT_EQ(p.largest_free_block(), kA);
  p.Free(*b, kA);
  EXPECT_EQ(p.free_extents(), 1u);
  EXPECT_EQ(p.largest_free_block(), 3 * kA);
  auto all = p.Allocate(3 * kA);
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, 0u);
}

TEST(BlockPlannerTest, HugeRequestDoesNotOverflow) {
  BlockPlanner p(1 << 20);
  EXPECT_FALSE(p.Allocate(UINT64_MAX));
  EXPECT_FALSE(p.Allocate(UINT64_MAX - kA));
  EXPECT_EQ(p.free_bytes(), uint64_t{1} << 20);
}

// Random allocate/free against a byte map: blocks never overlap, stay in
// bounds, and accounting matches.
TEST(BlockPlannerTest, RandomOperationsKeepInvariants) {
  const uint32_t seed = 12345;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const uint64_t cap = 1024 * kA;
  BlockPlanner p(cap);
  std::vector<uint8_t> owner(cap / kA, 0);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded bytes
  uint64_t used = 0;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t bytes = 1 + rng() % (24 * kA);
      auto off = p.Allocate(bytes);
      const uint64_t r = BlockPlanner::RoundUp(bytes);
      if (!off) {
        EXPECT_LT(p.largest_free_block(), r);
        continue;
      }
      ASSERT_EQ(*off % kA, 0u);
      ASSERT_LE(*off + r, cap);
      for (uint64_t i = *off / kA; i < (*off + r) / kA; ++i) {
        ASSERT_EQ(owner[i], 0) << "overlap at block " << i;
        owner[i] = 1;
      }
      live[*off] = r;
      used += r;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      p.Free(it->first, it->second);
      for (uint64_t i = it->first / kA; i < (it->first + it->second) / kA;
           ++i) {
        owner[i] = 0;
      }
      used -= it->second;
      live.erase(it);
    }
    ASSERT_EQ(p.free_bytes(), cap - used);
  }
  for (auto& [off, bytes] : live) p.Free(off, bytes);
  EXPECT_EQ(p.free_extents(), 1u);
  EXPECT_EQ(p.largest_free_block(), cap);
}

}  // namespace
}  // namespace strata::internal
