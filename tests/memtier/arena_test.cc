#include "memtier/arena.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "strata/device.h"

namespace strata::memtier {
namespace {

constexpr uint64_t kU = 256;  // the default alignment

// A byte of `tag`'s pattern at index i; not periodic in 256, so a block
// copied to the wrong multiple of the alignment does not match.
uint8_t PatternByte(uint64_t tag, uint64_t i) {
  uint64_t x = ((tag + 1) << 32) ^ i;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> 56);
}

std::vector<uint8_t> Pattern(uint64_t tag, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = PatternByte(tag, i);
  return v;
}

// Holds a stream back (a host function waits on it) until opened; opens
// itself when destroyed, so a failing test does not hang its streams.
class Gate {
 public:
  Gate() : opened_(promise_.get_future().share()) {}
  ~Gate() { Open(); }
  Status Hold(Device& device, Stream& stream) {
    return device.LaunchHostFunc(stream, [f = opened_] { f.wait(); });
  }
  void Open() {
    if (!open_.exchange(true)) promise_.set_value();
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> opened_;
  std::atomic<bool> open_{false};
};

ArenaPlanner MakePlanner(uint64_t capacity, uint64_t alignment = kU) {
  auto p = ArenaPlanner::Create(capacity, alignment);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(*p);
}

// ---- ArenaPlanner: placement ------------------------------------------------

TEST(ArenaPlannerTest, RejectsAlignmentNotMultipleOf256) {
  for (uint64_t a : {uint64_t{0}, uint64_t{64}, uint64_t{300}}) {
    auto p = ArenaPlanner::Create(1 << 20, a);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("multiple of 256"), std::string::npos)
        << p.status().message();
  }
}

TEST(ArenaPlannerTest, RoundsSizesAndOffsetsToAlignment) {
  ArenaPlanner p = MakePlanner(10 * 1024 + 100, 1024);
  EXPECT_EQ(p.capacity(), 10 * 1024u);
  auto a = p.Allocate(1, 1, true);
  auto b = p.Allocate(1025, 2, true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 1024u);
  EXPECT_EQ(p.Find(*b)->bytes, 2048u);
  EXPECT_EQ(p.stats().used_bytes, 3072u);
  for (const auto& blk : p.blocks()) EXPECT_EQ(blk.offset % 1024, 0u);
  auto zero = p.Allocate(0, 3, true);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

TEST(ArenaPlannerTest, BestFitPicksSmallestRange) {
  ArenaPlanner p = MakePlanner(16 * kU);
  auto a = p.Allocate(4 * kU, 1, true);  // [0,4)
  auto b = p.Allocate(kU, 2, true);      // [4,5)
  auto c = p.Allocate(2 * kU, 3, true);  // [5,7)
  auto d = p.Allocate(kU, 4, true);      // [7,8)
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  ASSERT_TRUE(p.Free(*a).ok());
  ASSERT_TRUE(p.Free(*c).ok());  // free: 4 at 0, 2 at 5, 8 at 8
  auto e = p.Allocate(2 * kU, 5, true);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(*e, 5 * kU);  // the exact fit, not the first or the largest
  auto f = p.Allocate(3 * kU, 6, true);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, 0u);  // 4 beats the tail's 8
  EXPECT_EQ(p.Find(*f)->tag, 6u);
}

TEST(ArenaPlannerTest, FreeCoalescesNeighbours) {
  ArenaPlanner p = MakePlanner(3 * kU);
  auto a = p.Allocate(kU, 1, true);
  auto b = p.Allocate(kU, 2, true);
  auto c = p.Allocate(kU, 3, true);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE(p.Free(*a).ok());
  ASSERT_TRUE(p.Free(*c).ok());
  EXPECT_EQ(p.stats().free_ranges, 2u);
  EXPECT_DOUBLE_EQ(p.stats().fragmentation, 0.5);
  ASSERT_TRUE(p.Free(*b).ok());
  auto s = p.stats();
  EXPECT_EQ(s.free_ranges, 1u);
  EXPECT_EQ(s.largest_free_bytes, 3 * kU);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
  EXPECT_EQ(s.allocations, 3u);
  EXPECT_EQ(s.frees, 3u);
  EXPECT_EQ(p.Free(*b).code(), StatusCode::kNotFound);
}

TEST(ArenaPlannerTest, OutOfMemorySaysWhatWasAskedAndWhatIsFree) {
  ArenaPlanner p = MakePlanner(8 * kU);
  auto a = p.Allocate(2 * kU, 1, true);
  auto b = p.Allocate(2 * kU, 2, true);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(p.Free(*a).ok());  // free: 512 at 0, 1024 at 1024
  auto c = p.Allocate(5 * kU - 10, 3, true);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("asked for 1270 bytes (1280 after rounding to 256)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("1536 bytes free in 2 ranges (largest 1024 bytes"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("capacity of 2048 bytes"), std::string::npos) << msg;
  EXPECT_EQ(p.stats().failures, 1u);
  EXPECT_FALSE(p.Allocate(UINT64_MAX, 4, true).ok());  // rounding overflows
}

// ---- ArenaPlanner: compaction -----------------------------------------------

// A host stand-in for the arena's memory: blocks hold their tag's pattern,
// and a plan's copies run on it in order, each checked for overlap.
class HostArena {
 public:
  explicit HostArena(ArenaPlanner* planner)
      : planner_(planner), bytes_(planner->capacity(), 0xEE) {}

  void Fill(uint64_t offset) {
    const auto* b = planner_->Find(offset);
    ASSERT_NE(b, nullptr);
    auto p = Pattern(b->tag, b->bytes);
    std::memcpy(bytes_.data() + offset, p.data(), p.size());
  }

  // Runs the copies and applies the plan.
  void Execute(const CompactionPlan& plan) {
    for (const CompactionCopy& c : plan.copies) {
      ASSERT_GT(c.bytes, 0u);
      ASSERT_TRUE(c.dst_offset + c.bytes <= c.src_offset ||
                  c.src_offset + c.bytes <= c.dst_offset)
          << "overlapping copy " << c.src_offset << " -> " << c.dst_offset
          << " of " << c.bytes;
      std::memcpy(bytes_.data() + c.dst_offset, bytes_.data() + c.src_offset,
                  c.bytes);
    }
    ASSERT_TRUE(planner_->ApplyCompaction(plan).ok());
  }

  // Every block holds its tag's pattern.
  void ExpectIntact() const {
    for (const auto& b : planner_->blocks()) {
      auto p = Pattern(b.tag, b.bytes);
      ASSERT_EQ(std::memcmp(bytes_.data() + b.offset, p.data(), p.size()), 0)
          << "block tag " << b.tag << " at offset " << b.offset;
    }
  }

 private:
  ArenaPlanner* planner_;
  std::vector<uint8_t> bytes_;
};

// Blocks at the given unit offsets and sizes; the tag is the index.
struct Layout {
  uint64_t offset_units, size_units;
  bool movable;
};
void Build(ArenaPlanner& p, HostArena& host, const std::vector<Layout>& l) {
  // Fill everything, then free what is not in the layout.
  std::vector<uint64_t> fillers;
  uint64_t cursor = 0, tag = 0;
  for (const Layout& b : l) {
    if (b.offset_units > cursor) {
      auto f = p.Allocate((b.offset_units - cursor) * kU, 1000, true);
      ASSERT_TRUE(f.ok());
      fillers.push_back(*f);
    }
    auto o = p.Allocate(b.size_units * kU, tag++, b.movable);
    ASSERT_TRUE(o.ok());
    ASSERT_EQ(*o, b.offset_units * kU);
    host.Fill(*o);
    cursor = b.offset_units + b.size_units;
  }
  for (uint64_t f : fillers) ASSERT_TRUE(p.Free(f).ok());
}

TEST(ArenaPlannerCompactionTest, EmptyPlanWhenARangeAlreadyFits) {
  ArenaPlanner p = MakePlanner(8 * kU);
  HostArena host(&p);
  Build(p, host, {{0, 2, true}, {4, 2, true}});
  auto plan = p.PlanCompaction(2 * kU);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->moves.empty());
  EXPECT_EQ(plan->free_offset, 2 * kU);
}

TEST(ArenaPlannerCompactionTest, SlidesTheFewestBytes) {
  // free 1 | A 1 | free 1 | B 4 | free 1 | C 1 | free 1 (units).
  ArenaPlanner p = MakePlanner(10 * kU);
  HostArena host(&p);
  Build(p, host, {{1, 1, true}, {3, 4, true}, {8, 1, true}});
  // Two units: merging the first two ranges moves A (1 unit); the last two
  // would move C (1 unit) too, but the first found wins; B is never moved.
  auto plan = p.PlanCompaction(2 * kU);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->moves.size(), 1u);
  EXPECT_EQ(plan->moves[0].tag, 0u);
  EXPECT_EQ(plan->bytes_moved, kU);
  EXPECT_EQ(plan->free_offset, kU);
  EXPECT_EQ(plan->free_bytes, 2 * kU);
  host.Execute(*plan);
  host.ExpectIntact();
  EXPECT_EQ(p.Find(0)->tag, 0u);
  EXPECT_EQ(p.stats().largest_free_bytes, 2 * kU);
  // Four units need all ranges: A, B and C all slide, B in chunks.
  plan = p.PlanCompaction(4 * kU);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->bytes_moved, 5 * kU);
  EXPECT_EQ(plan->free_offset, 6 * kU);
  EXPECT_GT(plan->copies.size(), plan->moves.size());
  const double before = p.stats().fragmentation;
  host.Execute(*plan);
  host.ExpectIntact();
  auto s = p.stats();
  EXPECT_EQ(s.largest_free_bytes, 4 * kU);
  EXPECT_EQ(s.free_ranges, 1u);
  EXPECT_EQ(s.compactions, 2u);
  EXPECT_EQ(s.compaction_bytes_moved, 6 * kU);
  EXPECT_DOUBLE_EQ(s.fragmentation_before_last_compaction, before);
  EXPECT_DOUBLE_EQ(s.fragmentation_after_last_compaction, 0.0);
  EXPECT_TRUE(p.Allocate(4 * kU, 9, true).ok());
}

TEST(ArenaPlannerCompactionTest, ShortSlideIsChunkedWithoutOverlap) {
  // free 1 | B 8 | free 1: B slides by one unit, in 8 copies of one unit.
  ArenaPlanner p = MakePlanner(10 * kU);
  HostArena host(&p);
  Build(p, host, {{1, 8, true}});
  auto plan = p.PlanCompaction(2 * kU);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->copies.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(plan->copies[i].src_offset, (1 + i) * kU);
    EXPECT_EQ(plan->copies[i].dst_offset, i * kU);
    EXPECT_EQ(plan->copies[i].bytes, kU);
  }
  host.Execute(*plan);
  host.ExpectIntact();
}

TEST(ArenaPlannerCompactionTest, PinnedBlocksNeverMoveAndCanBlock) {
  // free 2 | A 2 | free 1 | P 1 (pinned) | free 2 | B 1 | free 1
  ArenaPlanner p = MakePlanner(10 * kU);
  HostArena host(&p);
  Build(p, host, {{2, 2, true}, {5, 1, false}, {8, 1, true}});
  // Four units are free, but never three together on one side of P.
  auto bad = p.PlanCompaction(4 * kU);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(bad.status().message().find("pinned blocks split the free space"),
            std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("at most 768 contiguous bytes"),
            std::string::npos)
      << bad.status().message();
  auto too_big = p.PlanCompaction(7 * kU);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("more than the free total"),
            std::string::npos);
  auto plan = p.PlanCompaction(3 * kU);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  host.Execute(*plan);
  host.ExpectIntact();
  ASSERT_NE(p.Find(5 * kU), nullptr);
  EXPECT_EQ(p.Find(5 * kU)->tag, 1u);
  EXPECT_TRUE(p.Allocate(3 * kU, 7, true).ok());
}

TEST(ArenaPlannerCompactionTest, StalePlanIsRefused) {
  ArenaPlanner p = MakePlanner(10 * kU);
  HostArena host(&p);
  Build(p, host, {{1, 2, true}, {4, 2, true}});
  auto plan = p.PlanCompaction(5 * kU);
  ASSERT_TRUE(plan.ok());
  ASSERT_FALSE(plan->moves.empty());
  ASSERT_TRUE(p.Free(plan->moves[0].old_offset).ok());
  const auto blocks = p.blocks();
  Status st = p.ApplyCompaction(*plan);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.blocks().size(), blocks.size());
  EXPECT_EQ(p.stats().compactions, 0u);
}

// The fewest bytes any slide of a run of free ranges moves, computed by brute
// force over every run in every segment between unmovable blocks; nullopt
// when no run holds `need`.
std::optional<uint64_t> OracleCost(const ArenaPlanner& p, uint64_t need) {
  struct Item {
    bool free;
    uint64_t bytes;
  };
  std::vector<std::vector<Item>> segments(1);
  uint64_t cursor = 0;
  for (const auto& b : p.blocks()) {
    if (b.offset > cursor) segments.back().push_back({true, b.offset - cursor});
    if (b.movable) {
      segments.back().push_back({false, b.bytes});
    } else {
      segments.emplace_back();
    }
    cursor = b.offset + b.bytes;
  }
  if (p.capacity() > cursor) {
    segments.back().push_back({true, p.capacity() - cursor});
  }
  std::optional<uint64_t> best;
  for (const auto& seg : segments) {
    for (size_t i = 0; i < seg.size(); ++i) {
      if (!seg[i].free) continue;
      uint64_t free = 0, moved = 0, pending = 0;
      for (size_t j = i; j < seg.size(); ++j) {
        if (seg[j].free) {
          free += seg[j].bytes;
          moved += pending;
          pending = 0;
          if (free >= need && (!best || moved < *best)) best = moved;
        } else {
          pending += seg[j].bytes;
        }
      }
    }
  }
  return best;
}

void ExpectInvariants(const ArenaPlanner& p) {
  uint64_t cursor = 0, used = 0;
  for (const auto& b : p.blocks()) {
    ASSERT_GE(b.offset, cursor) << "blocks overlap at " << b.offset;
    ASSERT_EQ(b.offset % p.alignment(), 0u);
    ASSERT_EQ(b.bytes % p.alignment(), 0u);
    used += b.bytes;
    cursor = b.offset + b.bytes;
  }
  ASSERT_LE(cursor, p.capacity());
  const auto ranges = p.free_ranges();
  uint64_t free = 0, largest = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    free += ranges[i].second;
    largest = std::max(largest, ranges[i].second);
    if (i > 0) {
      ASSERT_LT(ranges[i - 1].first + ranges[i - 1].second, ranges[i].first)
          << "free ranges not coalesced";
    }
  }
  const auto s = p.stats();
  ASSERT_EQ(used + free, p.capacity());
  ASSERT_EQ(s.used_bytes, used);
  ASSERT_EQ(s.free_bytes, free);
  ASSERT_EQ(s.largest_free_bytes, largest);
  ASSERT_EQ(s.free_ranges, ranges.size());
}

// Random allocations, frees, pin changes and compactions on small arenas:
// invariants hold after every step, plans are feasible exactly when the
// oracle says so and move the oracle's fewest bytes, bytes survive, pinned
// blocks stay.
TEST(ArenaPlannerCompactionTest, RandomSequencesKeepInvariants) {
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const uint64_t units = 8 + rng() % 40;
    ArenaPlanner p = MakePlanner(units * kU);
    HostArena host(&p);
    uint64_t next_tag = 0;
    for (int step = 0; step < 120; ++step) {
      const auto blocks = p.blocks();
      const unsigned op = rng() % 10;
      if (op < 5) {
        const uint64_t bytes = 1 + rng() % (4 * kU);
        auto o = p.Allocate(bytes, next_tag++, rng() % 4 != 0);
        if (o.ok()) host.Fill(*o);
      } else if (op < 8 && !blocks.empty()) {
        ASSERT_TRUE(p.Free(blocks[rng() % blocks.size()].offset).ok());
      } else if (op == 8 && !blocks.empty()) {
        const auto& b = blocks[rng() % blocks.size()];
        ASSERT_TRUE(p.SetMovable(b.offset, !b.movable).ok());
      } else {
        const uint64_t need = (1 + rng() % units) * kU;
        const auto oracle = OracleCost(p, need);
        auto plan = p.PlanCompaction(need);
        ASSERT_EQ(plan.ok(), oracle.has_value()) << plan.status().ToString();
        if (plan.ok()) {
          ASSERT_EQ(plan->bytes_moved, *oracle);
          std::map<uint64_t, uint64_t> pinned;  // offset -> tag
          for (const auto& b : blocks) {
            if (!b.movable) pinned[b.offset] = b.tag;
          }
          host.Execute(*plan);
          for (const auto& [offset, tag] : pinned) {
            ASSERT_NE(p.Find(offset), nullptr);
            ASSERT_EQ(p.Find(offset)->tag, tag);
          }
          bool holds = false;
          for (const auto& [offset, size] : p.free_ranges()) {
            holds |= offset == plan->free_offset && size >= need;
          }
          ASSERT_TRUE(holds);
          auto o = p.Allocate(need, next_tag++, true);
          ASSERT_TRUE(o.ok());
          host.Fill(*o);
        }
      }
      ExpectInvariants(p);
      host.ExpectIntact();
      if (HasFatalFailure()) return;
    }
  }
}

// ---- DeviceArena on the host-emulated device --------------------------------

class DeviceArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceOptions o;
    o.choice = DeviceChoice::kHostEmulated;
    o.memory_budget_bytes = 64 << 20;
    auto d = NewHostEmulatedDevice(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    device_ = std::move(*d);
    for (auto* s : {&stream_, &other_}) {
      auto st = device_->NewStream({StreamKind::kCopy});
      ASSERT_TRUE(st.ok());
      *s = std::move(*st);
    }
  }

  std::unique_ptr<DeviceArena> MakeArena(uint64_t capacity) {
    DeviceArenaOptions o;
    o.capacity_bytes = capacity;
    o.name = "test arena";
    auto a = DeviceArena::Create(device_.get(), *stream_, o);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    return a.ok() ? std::move(*a) : nullptr;
  }

  ArenaBlock Alloc(DeviceArena& arena, uint64_t bytes, bool movable = true) {
    auto b = arena.Allocate(bytes, *stream_, movable);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(*b) : ArenaBlock();
  }

  // Writes `tag`'s pattern into the block on `stream`.
  void Write(const ArenaBlock& b, uint64_t tag, Stream& stream) {
    auto pin = b.Pin(stream);
    ASSERT_TRUE(pin.ok()) << pin.status().ToString();
    auto p = Pattern(tag, b.size());
    ASSERT_TRUE(device_
                    ->CopyAsync(stream, pin->data(), p.data(), p.size(),
                                CopyKind::kHostToDevice)
                    .ok());
  }
  void ExpectHolds(const ArenaBlock& b, uint64_t tag) {
    auto pin = b.Pin(*stream_);
    ASSERT_TRUE(pin.ok()) << pin.status().ToString();
    std::vector<uint8_t> got(b.size());
    ASSERT_TRUE(device_
                    ->CopyAsync(*stream_, got.data(), pin->data(), got.size(),
                                CopyKind::kDeviceToHost)
                    .ok());
    ASSERT_TRUE(device_->SynchronizeStream(*stream_).ok());
    EXPECT_TRUE(got == Pattern(tag, b.size())) << "block of tag " << tag;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_, other_;
};

TEST_F(DeviceArenaTest, CreateChecksOptions) {
  DeviceArenaOptions o;
  auto a = DeviceArena::Create(device_.get(), *stream_, o);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  o.capacity_bytes = 1 << 20;
  o.alignment = 100;
  a = DeviceArena::Create(device_.get(), *stream_, o);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  o.alignment = 256;
  o.capacity_bytes = uint64_t{1} << 40;  // beyond the device's budget
  a = DeviceArena::Create(device_.get(), *stream_, o);
  EXPECT_EQ(a.status().code(), StatusCode::kOutOfMemory);
}

// A fetch pattern that fragments the arena: 16 partitions fetched, every
// other one released, then a partition of four slots: it succeeds by
// compaction, with every survivor's bytes intact through real D2D copies
// (which the device refuses when they overlap).
TEST_F(DeviceArenaTest, FragmentingPatternSucceedsByCompaction) {
  const uint64_t slot = 4 * kU;
  auto arena = MakeArena(16 * slot);
  ASSERT_NE(arena, nullptr);
  std::vector<ArenaBlock> blocks;
  for (uint64_t i = 0; i < 16; ++i) {
    blocks.push_back(Alloc(*arena, slot - 7));  // odd sizes, rounded up
    Write(blocks.back(), i, *stream_);
  }
  for (size_t i = 0; i < 16; i += 2) blocks[i].Reset();
  ASSERT_TRUE(device_->SynchronizeStream(*stream_).ok());
  EXPECT_EQ(arena->stats().pending_free_bytes, 8 * slot);
  std::vector<void*> old_addr;
  for (auto& b : blocks) old_addr.push_back(b.data());

  auto big = arena->Allocate(4 * slot, *stream_);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  Write(*big, 100, *stream_);
  const auto after = arena->stats();
  EXPECT_EQ(after.planner.compactions, 1u);
  EXPECT_GT(after.planner.compaction_bytes_moved, 0u);
  EXPECT_DOUBLE_EQ(after.planner.fragmentation_before_last_compaction, 0.875);
  EXPECT_LT(after.planner.fragmentation_after_last_compaction, 0.875);
  EXPECT_EQ(after.out_of_memory, 0u);
  bool moved = false;
  for (size_t i = 1; i < 16; i += 2) {
    ExpectHolds(blocks[i], i);
    moved |= blocks[i].data() != old_addr[i];
  }
  EXPECT_TRUE(moved);  // handles follow their blocks
  ExpectHolds(*big, 100);
}

// A block slid by less than its size is copied in chunks; the device refuses
// overlapping copies, so success shows that each chunk is disjoint.
TEST_F(DeviceArenaTest, ShortSlideIsChunkedOnTheDevice) {
  auto arena = MakeArena(10 * kU);
  ASSERT_NE(arena, nullptr);
  ArenaBlock head = Alloc(*arena, kU);
  ArenaBlock big = Alloc(*arena, 8 * kU);
  Write(big, 7, *stream_);
  head.Reset();  // free: 1 unit at 0, 1 at the end
  auto two = arena->Allocate(2 * kU, *stream_);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(big.offset(), 0u);
  EXPECT_EQ(arena->stats().planner.compaction_copies, 8u);
  ExpectHolds(big, 7);
}

TEST_F(DeviceArenaTest, PinnedAndUnmovableBlocksNeverMove) {
  auto arena = MakeArena(8 * kU);
  ASSERT_NE(arena, nullptr);
  ArenaBlock a = Alloc(*arena, kU);
  ArenaBlock pinned = Alloc(*arena, kU);
  ArenaBlock c = Alloc(*arena, 2 * kU);
  ArenaBlock e = Alloc(*arena, 3 * kU);
  ArenaBlock fixed = Alloc(*arena, kU, /*movable=*/false);
  Write(pinned, 1, *stream_);
  Write(fixed, 3, *stream_);
  a.Reset();
  c.Reset();
  e.Reset();
  ASSERT_TRUE(device_->SynchronizeStream(*stream_).ok());
  // Free: unit 0 and units 2-6; the pinned block sits at 1, the fixed at 7.
  auto pin = pinned.Pin(*stream_);
  ASSERT_TRUE(pin.ok());
  void* const pinned_at = pin->data();
  void* const fixed_at = fixed.data();
  auto bad = arena->Allocate(6 * kU, *stream_, true, /*wait_for_frees=*/false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfMemory);
  const std::string msg(bad.status().message());
  EXPECT_NE(msg.find("test arena: out of arena memory: asked for 1536 bytes"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("compaction cannot help: pinned blocks split the free "
                     "space, and moving every movable block would make at "
                     "most 1280 contiguous bytes"),
            std::string::npos)
      << msg;
  EXPECT_EQ(arena->stats().out_of_memory, 1u);
  EXPECT_EQ(pinned.data(), pinned_at);
  EXPECT_EQ(fixed.data(), fixed_at);
  // Unpinned, the block may move, and the request fits.
  pin->Reset();
  auto good = arena->Allocate(6 * kU, *stream_);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(fixed.data(), fixed_at);
  EXPECT_EQ(pinned.offset(), 0u);
  ExpectHolds(pinned, 1);
  ExpectHolds(fixed, 3);
}

// Work queued on another stream before the block became movable finishes
// before compaction copies it, and a later user on any stream sees the copy.
TEST_F(DeviceArenaTest, CompactionWaitsForQueuedWorkOnOtherStreams) {
  auto arena = MakeArena(4 * kU);
  ASSERT_NE(arena, nullptr);
  ArenaBlock head = Alloc(*arena, kU);
  ArenaBlock b = Alloc(*arena, kU);
  ArenaBlock tail = Alloc(*arena, 2 * kU);
  tail.Reset();
  // Hold `other_` back, then queue a write of b behind the hold.
  Gate gate;
  ASSERT_TRUE(gate.Hold(*device_, *other_).ok());
  std::vector<uint8_t> p = Pattern(5, kU);
  {
    auto pin = b.Pin(*other_);
    ASSERT_TRUE(pin.ok());
    auto pinned_host = device_->AllocatePinnedHost(kU, {});
    ASSERT_TRUE(pinned_host.ok());
    std::memcpy(pinned_host->data(), p.data(), kU);
    ASSERT_TRUE(device_
                    ->CopyAsync(*other_, pin->data(), pinned_host->data(), kU,
                                CopyKind::kHostToDevice)
                    .ok());
    head.Reset();
    // Compaction (slides b down) is queued on stream_ while other_ waits.
    auto big = arena->Allocate(3 * kU, *stream_);
    ASSERT_FALSE(big.ok());  // b is still pinned
    pin->Reset();
    big = arena->Allocate(3 * kU, *stream_);
    ASSERT_TRUE(big.ok()) << big.status().ToString();
    EXPECT_EQ(b.offset(), 0u);
    // The compaction on stream_ cannot finish while other_ is held. (Were
    // it not ordered, stream_ would drain within these yields.)
    auto after = device_->NewEvent();
    ASSERT_TRUE(after.ok());
    ASSERT_TRUE(device_->RecordEvent(**after, *stream_).ok());
    for (int i = 0; i < 200 && !*device_->QueryEvent(**after); ++i) {
      std::this_thread::yield();
    }
    EXPECT_FALSE(*device_->QueryEvent(**after));
    gate.Open();
    ASSERT_TRUE(device_->SynchronizeStream(*other_).ok());
  }
  ExpectHolds(b, 5);
}

// A freed range is reused only after the streams that used it finish; a
// non-waiting Allocate says so instead of blocking.
TEST_F(DeviceArenaTest, FreedRangeWaitsForItsStreams) {
  auto arena = MakeArena(4 * kU);
  ASSERT_NE(arena, nullptr);
  Gate gate;
  ArenaBlock b = Alloc(*arena, 4 * kU);
  {
    auto pin = b.Pin(*other_);
    ASSERT_TRUE(pin.ok());
    ASSERT_TRUE(gate.Hold(*device_, *other_).ok());
  }
  b.Reset();
  EXPECT_EQ(arena->stats().pending_free_bytes, 4 * kU);
  auto now = arena->Allocate(kU, *stream_, true, /*wait_for_frees=*/false);
  ASSERT_FALSE(now.ok());
  EXPECT_NE(now.status().message().find(
                "1024 bytes are freed but wait for their streams"),
            std::string::npos)
      << now.status().message();
  std::thread releaser([&] { gate.Open(); });
  auto later = arena->Allocate(kU, *stream_);
  releaser.join();
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  EXPECT_EQ(arena->stats().pending_free_bytes, 0u);
}

// SettleFrees makes every pending free reusable (waiting for its stream), so
// the placement that follows is the one an idle device would get: the freed
// range itself.
TEST_F(DeviceArenaTest, SettleFreesWaitsForEveryPendingFree) {
  auto arena = MakeArena(4 * kU);
  ASSERT_NE(arena, nullptr);
  Gate gate;
  ArenaBlock a = Alloc(*arena, kU);
  ArenaBlock b = Alloc(*arena, kU);
  const void* a_at = a.data();
  {
    auto pin = a.Pin(*other_);
    ASSERT_TRUE(pin.ok());
    ASSERT_TRUE(gate.Hold(*device_, *other_).ok());
  }
  a.Reset();
  EXPECT_EQ(arena->stats().pending_free_bytes, kU);
  // The gate opens once SettleFrees has begun to wait (reuse_waits counts
  // it before the wait), not after a delay the test's own thread may sleep
  // through; the deadline opens it anyway, so a SettleFrees that never
  // waits fails the count below rather than hanging.
  std::thread releaser([&] {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arena->stats().reuse_waits == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    gate.Open();
  });
  ASSERT_TRUE(arena->SettleFrees().ok());
  releaser.join();
  EXPECT_EQ(arena->stats().pending_free_bytes, 0u);
  EXPECT_GE(arena->stats().reuse_waits, 1u);
  auto c = arena->Allocate(kU, *stream_, true, /*wait_for_frees=*/false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->data(), a_at);              // best fit: the range freed first
  EXPECT_TRUE(arena->SettleFrees().ok());  // nothing pending: returns at once
}

// With compact false a request that only compaction could place is refused,
// and nothing moves; with compact true it succeeds.
TEST_F(DeviceArenaTest, AllocateWithoutCompactionRefusesInsteadOfMoving) {
  auto arena = MakeArena(4 * kU);
  ASSERT_NE(arena, nullptr);
  std::vector<ArenaBlock> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(Alloc(*arena, kU));
  blocks[0].Reset();
  blocks[2].Reset();
  ASSERT_TRUE(arena->SettleFrees().ok());
  const void* at = blocks[1].data();
  auto no = arena->Allocate(2 * kU, *stream_, true, /*wait_for_frees=*/false,
                            /*compact=*/false);
  ASSERT_FALSE(no.ok());
  EXPECT_EQ(no.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(blocks[1].data(), at);
  EXPECT_EQ(arena->stats().planner.compactions, 0u);
  auto yes = arena->Allocate(2 * kU, *stream_);
  ASSERT_TRUE(yes.ok()) << yes.status().ToString();
  EXPECT_EQ(arena->stats().planner.compactions, 1u);
}

// Counts the events the arena makes.
class EventCountingDevice : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    ++events;
    return DeviceWrapper::NewEvent();
  }
  std::atomic<uint64_t> events{0};
};

// Rounds during which both streams are held, so that frees stay pending and
// compactions unfinished, as when the streams lag far behind the host.
// Every fourth round fills the arena with its 16 smallest blocks (and is
// refused a 17th), has both streams use each, and frees them all; the rounds
// between allocate 1 to 4 units, free and pin at random, on either stream,
// and compact where the last round's frees left holes. Returns the
// events the arena made after its creation.
uint64_t EventsMadeUnderLaggingStreams(Device& device, Stream& a, Stream& b,
                                       uint64_t reserve) {
  EventCountingDevice counting(&device);
  DeviceArenaOptions o;
  o.capacity_bytes = 16 * kU;
  o.name = "test arena";
  o.reserve_events = reserve;
  auto arena = DeviceArena::Create(&counting, a, o);
  EXPECT_TRUE(arena.ok()) << arena.status().ToString();
  if (!arena.ok()) return 0;
  const uint64_t at_creation = counting.events.load();
  EXPECT_EQ(at_creation, reserve);
  std::mt19937 rng(7);
  std::vector<ArenaBlock> blocks;
  for (int round = 0; round < 40; ++round) {
    Gate gate;
    EXPECT_TRUE(gate.Hold(device, a).ok());
    EXPECT_TRUE(gate.Hold(device, b).ok());
    const bool fill = round % 4 == 0;
    for (int i = 0; i < (fill ? 17 : 8); ++i) {
      Stream& s = rng() % 2 ? a : b;
      const uint32_t op = rng() % 3;
      if (fill || op == 0 || blocks.empty()) {
        auto blk = (*arena)->Allocate((fill ? 1 : 1 + rng() % 4) * kU, s, true,
                                      /*wait_for_frees=*/false);
        if (blk.ok()) blocks.push_back(std::move(*blk));
      } else if (op == 1) {
        blocks.erase(blocks.begin() + rng() % blocks.size());
      } else {  // both streams use it
        const ArenaBlock& blk = blocks[rng() % blocks.size()];
        EXPECT_TRUE(blk.Pin(a).ok());
        EXPECT_TRUE(blk.Pin(b).ok());
      }
    }
    if (fill) {
      EXPECT_EQ(blocks.size(), 16u);
      for (const ArenaBlock& blk : blocks) {
        EXPECT_TRUE(blk.Pin(a).ok());
        EXPECT_TRUE(blk.Pin(b).ok());
      }
      blocks.clear();
    } else if (round % 4 == 3) {
      blocks.clear();  // the next round fills the whole arena
    }
    gate.Open();
    EXPECT_TRUE(device.SynchronizeStream(a).ok());
    EXPECT_TRUE(device.SynchronizeStream(b).ok());
  }
  const DeviceArenaStats st = (*arena)->stats();
  EXPECT_GT(st.planner.compactions, 0u);
  EXPECT_GT(st.out_of_memory, 0u);  // the arena was full of pending frees
  return counting.events.load() - at_creation;
}

// Note [The arena's events]: the most events in use at once (what a pool
// that starts empty makes) stays within EventsFor, and an arena that
// reserves that many makes none after its creation.
TEST_F(DeviceArenaTest, ReservedEventsServeEveryFreeAndCompaction) {
  const uint64_t bound = DeviceArena::EventsFor(16, 2);
  const uint64_t peak =
      EventsMadeUnderLaggingStreams(*device_, *stream_, *other_, 0);
  EXPECT_LE(peak, bound);
  EXPECT_GE(peak, 2 * 16u);  // a filling round's frees, two events a block
  std::printf("events in use at most %llu, bound %llu\n",
              static_cast<unsigned long long>(peak),
              static_cast<unsigned long long>(bound));
  EXPECT_EQ(EventsMadeUnderLaggingStreams(*device_, *stream_, *other_, bound),
            0u);
}

// Threads allocate, write, verify and free on their own streams while others
// compact: every block keeps its bytes (TSan and ASan run this too).
TEST_F(DeviceArenaTest, ThreadsAllocateAndFreeConcurrently) {
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int t = 0; t < kThreads; ++t) {
    auto s = device_->NewStream({StreamKind::kCompute});
    ASSERT_TRUE(s.ok());
    streams.push_back(std::move(*s));
  }
  auto arena = MakeArena(64 * kU);
  ASSERT_NE(arena, nullptr);
  std::atomic<int> failures{0};
  auto work = [&](int t) {
    Stream& s = *streams[t];
    std::mt19937 rng(1000 + t);
    std::vector<std::pair<ArenaBlock, uint64_t>> mine;
    for (int i = 0; i < 300; ++i) {
      if (mine.size() < 4 && rng() % 3 != 0) {
        const uint64_t bytes = (1 + rng() % 6) * kU - rng() % kU;
        auto b = arena->Allocate(bytes, s);
        if (!b.ok()) continue;  // the others hold the memory
        const uint64_t tag = uint64_t(t) << 20 | uint64_t(i);
        auto pin = b->Pin(s);
        auto p = Pattern(tag, bytes);
        if (!pin.ok() || !device_
                              ->CopyAsync(s, pin->data(), p.data(), bytes,
                                          CopyKind::kHostToDevice)
                              .ok()) {
          ++failures;
        }
        mine.emplace_back(std::move(*b), tag);
      } else if (!mine.empty()) {
        const size_t k = rng() % mine.size();
        auto& [b, tag] = mine[k];
        auto pin = b.Pin(s);
        std::vector<uint8_t> got(b.size());
        if (!pin.ok() ||
            !device_
                 ->CopyAsync(s, got.data(), pin->data(), got.size(),
                             CopyKind::kDeviceToHost)
                 .ok() ||
            !device_->SynchronizeStream(s).ok() ||
            got != Pattern(tag, b.size())) {
          ++failures;
        }
        if (pin.ok()) pin->Reset();
        mine.erase(mine.begin() + k);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const auto s = arena->stats();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.pinned_blocks, 0u);
  std::printf("compactions %llu, bytes moved %llu, out of memory %llu\n",
              static_cast<unsigned long long>(s.planner.compactions),
              static_cast<unsigned long long>(s.planner.compaction_bytes_moved),
              static_cast<unsigned long long>(s.out_of_memory));
}

}  // namespace
}  // namespace strata::memtier
