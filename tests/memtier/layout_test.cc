// The engine's pure bookkeeping: layout of tensors into units and shards, and
// the fetch trace that drives prefetch and eviction.
#include <gtest/gtest.h>

#include <random>

#include "memtier/layout.h"
#include "memtier/trace.h"

namespace strata::memtier {
namespace {

TEST(LayoutTest, PacksSmallTensorsAndGivesLargeOnesTheirOwnUnit) {
  LayoutOptions o;
  o.unit_elems = 4096;
  o.pack_limit_elems = 1024;
  // 100 and 200 pack; 5000 is alone (larger than a unit: never an error);
  // 1000 joins the open packed unit; 3000 > pack limit is alone.
  auto l = Layout::Build({100, 200, 5000, 1000, 3000}, o);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->num_units(), 3u);
  EXPECT_EQ(l->tensor(0).unit, 0u);
  EXPECT_EQ(l->tensor(0).offset, 0u);
  EXPECT_EQ(l->tensor(1).unit, 0u);
  EXPECT_EQ(l->tensor(1).offset, 128u);  // 100 rounded to kTensorAlign
  EXPECT_EQ(l->tensor(2).unit, 1u);
  EXPECT_EQ(l->unit(1).elems, 5120u);
  EXPECT_EQ(l->tensor(3).unit, 0u);
  EXPECT_EQ(l->tensor(3).offset, 384u);
  EXPECT_EQ(l->tensor(4).unit, 2u);
  EXPECT_EQ(l->unit(0).tensors, (std::vector<uint32_t>{0, 1, 3}));
}

TEST(LayoutTest, GroupsPackApart) {
  LayoutOptions o;
  o.unit_elems = 4096;
  o.pack_limit_elems = 1024;
  auto l = Layout::Build({10, 10, 10}, o, {0, 1, 0});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->num_units(), 2u);
  EXPECT_EQ(l->tensor(0).unit, l->tensor(2).unit);
  EXPECT_NE(l->tensor(0).unit, l->tensor(1).unit);
}

TEST(LayoutTest, PackedUnitsRespectTheirSize) {
  LayoutOptions o;
  o.unit_elems = 1024;
  o.pack_limit_elems = 512;
  std::mt19937 rng(3);
  std::vector<uint64_t> sizes;
  for (int i = 0; i < 500; ++i) sizes.push_back(1 + rng() % 2000);
  auto l = Layout::Build(sizes, o);
  ASSERT_TRUE(l.ok());
  for (size_t u = 0; u < l->num_units(); ++u) {
    const UnitInfo& info = l->unit(u);
    uint64_t end = 0;
    for (uint32_t t : info.tensors) {
      const TensorPlace& p = l->tensor(t);
      EXPECT_EQ(p.unit, u);
      EXPECT_EQ(p.offset % kTensorAlign, 0u);
      EXPECT_GE(p.offset, end) << "tensors overlap in unit " << u;
      end = p.offset + p.elems;
    }
    EXPECT_LE(end, info.elems);
    if (info.tensors.size() > 1) {
      EXPECT_LE(info.elems, o.unit_elems);
    }
  }
}

TEST(LayoutTest, ShardsSplitEveryUnitOverTheRanks) {
  for (int world : {1, 2, 3, 8}) {
    for (int rank = 0; rank < world; ++rank) {
      LayoutOptions o;
      o.unit_elems = 1 << 14;
      o.pack_limit_elems = 1 << 12;
      o.rank = rank;
      o.world_size = world;
      auto l = Layout::Build({7, 5000, 20000}, o);
      ASSERT_TRUE(l.ok());
      for (size_t u = 0; u < l->num_units(); ++u) {
        const UnitInfo& info = l->unit(u);
        EXPECT_EQ(info.shard_elems * world, info.elems);
        EXPECT_EQ(info.shard_begin, info.shard_elems * rank);
        EXPECT_EQ(info.shard_elems % kTensorAlign, 0u);
      }
    }
  }
}

TEST(LayoutTest, RefusesBadInput) {
  LayoutOptions o;
  o.rank = 2;
  o.world_size = 2;
  EXPECT_EQ(Layout::Build({1}, o).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Layout::Build({0}, LayoutOptions{}).status().code(),
            StatusCode::kInvalidArgument);
  LayoutOptions small;
  small.unit_elems = 64;
  EXPECT_FALSE(Layout::Build({1}, small).ok());
}

TEST(FetchTraceTest, FollowsTheRecordedOrderAndPredictsNextUse) {
  FetchTrace t(4);
  for (uint32_t u : {0, 1, 2, 3, 2, 1}) EXPECT_TRUE(t.OnFetch(u));
  t.EndStep();
  EXPECT_EQ(t.upcoming(0), 0u);
  EXPECT_EQ(t.NextUse(3), 3u);
  EXPECT_TRUE(t.OnFetch(0));
  EXPECT_TRUE(t.OnFetch(1));
  EXPECT_EQ(t.upcoming(0), 2u);
  EXPECT_EQ(t.NextUse(1), 3u);  // positions 2,3,4 come first
  EXPECT_EQ(t.NextUse(0), FetchTrace::kNever);
  EXPECT_EQ(t.order_changes(), 0u);
}

TEST(FetchTraceTest, AnOrderChangeMovesTheCursorInsteadOfDroppingTheTrace) {
  FetchTrace t(6);
  for (uint32_t u : {0, 1, 2, 3, 4}) t.OnFetch(u);
  t.EndStep();
  t.OnFetch(0);
  EXPECT_FALSE(t.OnFetch(3));  // skipped 1 and 2 (a branch)
  EXPECT_EQ(t.order_changes(), 1u);
  EXPECT_EQ(t.upcoming(0), 4u);  // prefetch goes on from after 3
  EXPECT_FALSE(t.OnFetch(5));    // never seen: the cursor stays
  EXPECT_EQ(t.upcoming(0), 4u);
  EXPECT_TRUE(t.OnFetch(4));
  t.EndStep();  // the new order is the reference now
  EXPECT_EQ(t.upcoming(1), 3u);
  EXPECT_EQ(t.upcoming(2), 5u);
}

}  // namespace
}  // namespace strata::memtier
