// GradSpill (memtier/grad_spill.h) over an in-memory store standing in for
// the swap space: sums, zeros, read-backs, stats and failed writes.
#include "memtier/grad_spill.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "strata/device.h"

namespace strata::memtier {
namespace {

constexpr uint64_t kPiece = 1024;  // 4 KiB of fp32: one staging buffer

std::unique_ptr<Device> HostDevice() {
  DeviceOptions o;
  o.choice = DeviceChoice::kHostEmulated;
  o.memory_budget_bytes = 1 << 20;
  return std::move(NewHostEmulatedDevice(o)).value();
}

// The pieces "on NVMe", and what was asked of them.
struct Store {
  std::map<std::pair<uint32_t, size_t>, std::vector<float>> pieces;
  int reads = 0, writes = 0;
  // A write of this piece fails (with kIoError) while set.
  std::pair<uint32_t, size_t> failing{UINT32_MAX, 0};

  GradSpill::ReadFn Read() {
    return [this](uint32_t u, size_t p, std::span<std::byte> dst) -> Status {
      ++reads;
      auto it = pieces.find({u, p});
      if (it == pieces.end()) return Status::Corruption("never written");
      // Direct I/O moves whole blocks: the spill hands whole buffers.
      EXPECT_EQ(dst.size() % 4096, 0u);
      EXPECT_EQ(dst.size(), it->second.size() * 4);
      std::memcpy(dst.data(), it->second.data(), dst.size());
      return Status::Ok();
    };
  }
  GradSpill::WriteFn Write() {
    return [this](uint32_t u, size_t p, std::span<const std::byte> src,
                  std::function<void(Status)> done) {
      ++writes;
      EXPECT_EQ(src.size() % 4096, 0u);
      if (failing == std::make_pair(u, p)) {
        done(Status::IoError("injected write error"));
        return;
      }
      std::vector<float>& v = pieces[{u, p}];
      v.resize(src.size() / 4);
      std::memcpy(v.data(), src.data(), src.size());
      done(Status::Ok());
    };
  }
};

StatusOr<GradStats> Stats(const float* g, uint64_t n) {
  GradStats s;
  for (uint64_t i = 0; i < n; ++i) {
    s.sum_sq += double{g[i]} * g[i];
    s.finite = s.finite && std::isfinite(g[i]);
  }
  return s;
}

class GradSpillTest : public ::testing::Test {
 protected:
  void Make(std::vector<uint64_t> units) {
    units_ = units;
    device_ = HostDevice();
    pool_ = std::move(StagingPool::Create(device_.get(), 3, kPiece * 4,
                                          /*pin=*/false))
                .value();
    spill_ = std::make_unique<GradSpill>(units, kPiece, pool_.get(), 2,
                                         store_.Read(), store_.Write(), Stats);
  }
  std::vector<uint64_t> units_;
  Store store_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<GradSpill> spill_;
};

TEST_F(GradSpillTest, SumsMatchADenseAccumulatorInAnyOrder) {
  Make({3000, 700, 2049});  // pieces: 3, 1, 3 (the last ones short)
  std::vector<std::vector<float>> ref;
  for (uint64_t e : units_) ref.emplace_back(e, 0.0f);
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    const uint32_t u = rng() % units_.size();
    const uint64_t b = rng() % units_[u];
    const uint64_t n = 1 + rng() % std::min<uint64_t>(units_[u] - b, 2500);
    const bool overwrite = rng() % 5 == 0;
    std::vector<float> vals(n);
    for (float& v : vals) v = static_cast<float>(rng() % 64) / 8 - 4;
    ASSERT_TRUE(spill_->Add(u, b, vals.data(), n, overwrite).ok());
    for (uint64_t k = 0; k < n; ++k) {
      ref[u][b + k] = overwrite ? vals[k] : ref[u][b + k] + vals[k];
    }
  }
  ASSERT_TRUE(spill_->Flush().ok());
  EXPECT_GT(store_.reads, 0);  // pieces were pushed out and read back
  for (uint32_t u = 0; u < units_.size(); ++u) {
    for (size_t p = 0; p * kPiece < units_[u]; ++p) {
      SCOPED_TRACE("unit " + std::to_string(u) + " piece " + std::to_string(p));
      const uint64_t b = p * kPiece;
      const uint64_t n = std::min(kPiece, units_[u] - b);
      const std::vector<float> want(ref[u].begin() + b, ref[u].begin() + b + n);
      if (!spill_->written(u, p)) {
        EXPECT_EQ(want, std::vector<float>(n, 0.0f));
        continue;
      }
      // The store holds whole buffers: the piece is their first n values.
      const std::vector<float>& got = store_.pieces[std::make_pair(u, p)];
      ASSERT_GE(got.size(), n);
      EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + n), want);
      EXPECT_EQ(spill_->stats(u, p).sum_sq, Stats(want.data(), n)->sum_sq);
    }
  }
}

TEST_F(GradSpillTest, OnePassInOrderReadsNothingAndUntouchedPiecesAreZero) {
  Make({4 * kPiece, 2 * kPiece});
  std::vector<float> ones(kPiece, 1.0f);
  // Backward's order, one hand-over per piece; unit 1's second piece none.
  for (int p = 3; p >= 0; --p) {
    ASSERT_TRUE(spill_->Add(0, p * kPiece, ones.data(), kPiece, true).ok());
  }
  ASSERT_TRUE(spill_->Add(1, 0, ones.data(), 100, true).ok());
  ASSERT_TRUE(spill_->Flush().ok());
  EXPECT_EQ(store_.reads, 0);
  EXPECT_EQ(store_.writes, 5);
  EXPECT_TRUE(spill_->written(1, 0));
  EXPECT_FALSE(spill_->written(1, 1));
  // The rest of a piece written from zeros is zero.
  const std::vector<float>& p10 = store_.pieces[std::make_pair(1u, size_t{0})];
  EXPECT_EQ(p10[99], 1.0f);
  EXPECT_EQ(p10[100], 0.0f);
  EXPECT_EQ(spill_->stats(1, 0).sum_sq, 100.0);

  // The next step starts from zeros, without reading.
  spill_->EndStep();
  EXPECT_FALSE(spill_->written(0, 0));
  ASSERT_TRUE(spill_->Add(0, 0, ones.data(), 10, false).ok());
  ASSERT_TRUE(spill_->Flush().ok());
  EXPECT_EQ(store_.reads, 0);
  EXPECT_EQ(store_.pieces[std::make_pair(0u, size_t{0})][10], 0.0f);
  EXPECT_EQ(store_.pieces[std::make_pair(0u, size_t{0})][9], 1.0f);
}

TEST_F(GradSpillTest, AFailedWriteIsReportedAndNotReadBack) {
  Make({3 * kPiece});
  std::vector<float> ones(kPiece, 1.0f);
  store_.failing = {0, 0};
  // Piece 0 is pushed out by pieces 1 and 2; its write fails.
  for (int p = 0; p < 3; ++p) {
    ASSERT_TRUE(spill_->Add(0, p * kPiece, ones.data(), kPiece, true).ok());
  }
  // Reopening it reports the failure instead of reading stale bytes.
  Status st = spill_->Add(0, 0, ones.data(), 1, false);
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
  spill_->EndStep();
  store_.failing = {UINT32_MAX, 0};

  // The same failure found at the flush fails the flush.
  store_.failing = {0, 2};
  for (int p = 0; p < 3; ++p) {
    ASSERT_TRUE(spill_->Add(0, p * kPiece, ones.data(), kPiece, true).ok());
  }
  st = spill_->Flush();
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
  spill_->EndStep();
}

// Add's visit sees the piece's sums once the range is added and before the
// piece is written back (its last element in), whether the piece was read
// back or still open; a visited range must lie in one piece.
TEST_F(GradSpillTest, VisitSeesThePiecesSumsBeforeItIsWritten) {
  Make({3000});  // pieces of 1024, 1024 and 952
  std::vector<float> a(3000), b(3000);
  for (size_t k = 0; k < a.size(); ++k) {
    a[k] = static_cast<float>(k % 7) - 3;
    b[k] = static_cast<float>(k % 5) * 0.5f;
  }
  ASSERT_TRUE(spill_->Add(0, 0, a.data(), a.size(), true).ok());
  // The second micro-batch in ranges cut at the pieces' bounds and inside.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {0, 300}, {300, 724}, {1024, 1024}, {2048, 500}, {2548, 452}};
  for (const auto& [begin, n] : ranges) {
    SCOPED_TRACE("elements " + std::to_string(begin));
    const int writes = store_.writes;
    int seen = 0;
    auto visit = [&](const float* piece) {
      ++seen;
      EXPECT_EQ(store_.writes, writes);  // not written back yet
      const uint64_t base = begin / kPiece * kPiece;
      for (uint64_t k = begin; k < begin + n; ++k) {
        ASSERT_EQ(piece[k - base], a[k] + b[k]) << k;
      }
    };
    ASSERT_TRUE(spill_->Add(0, begin, b.data() + begin, n, false, visit).ok());
    EXPECT_EQ(seen, 1);
    // A range that ends its piece is written back after the visit.
    const bool ends = (begin + n) % kPiece == 0 || begin + n == 3000;
    EXPECT_EQ(store_.writes, writes + (ends ? 1 : 0));
  }
  ASSERT_TRUE(spill_->Flush().ok());
  // A visited range that crosses a piece is refused, naming it.
  const Status st = spill_->Add(0, 1000, b.data(), 100, false,
                                [](const float*) { ADD_FAILURE(); });
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("crosses a piece"), std::string::npos)
      << st.ToString();
}

}  // namespace
}  // namespace strata::memtier
