// The streaming bounds of `strata-bench adam` (bench/bound.h): whatever the
// ISA and kernel, a pass leaves the arrays it reads and updates as they
// were, and its stream writes cover exactly [begin, end) of their array.
#include "bench/bound.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace strata::bench {
namespace {

constexpr size_t kBlock = 2048;  // per-block items, as 8-bit states' scales

std::vector<BoundIsa> SupportedIsas() {
  std::vector<BoundIsa> out = {BoundIsa::kScalar};
  const BoundIsa best = BestBoundIsa();
  if (best == BoundIsa::kAvx2 || best == BoundIsa::kAvx512) {
    out.push_back(BoundIsa::kAvx2);
  }
  if (best == BoundIsa::kAvx512) out.push_back(BoundIsa::kAvx512);
  return out;
}

// The arrays of an 8-bit AdamW step with every kind of stream: fp32 master
// (updated), bf16 gradient (read), two 1-byte code arrays and their
// per-block scales (updated), and a 2-byte working copy (stream write)
// that starts `wshift` elements after a 64-byte boundary of its buffer, so
// that every ISA's non-temporal stores are allowed (0) or none are (1).
// Without `codes`, the 16-bit-moment arrays' shape: no 1-byte stream, so
// fused_prefetch_32 runs 32-element chunks on every ISA.
struct Pass {
  Pass(size_t elems, size_t wshift, uint32_t seed, bool codes = true)
      : master(elems),
        grad(elems),
        m(elems),
        v(elems),
        ms(elems / kBlock + 1),
        vs(elems / kBlock + 1),
        working(elems + 96, 0xa5a5) {
    std::mt19937 rng(seed);
    for (float& x : master) x = static_cast<float>(rng());
    for (uint16_t& x : grad) x = static_cast<uint16_t>(rng());
    for (uint8_t& x : m) x = static_cast<uint8_t>(rng());
    for (uint8_t& x : v) x = static_cast<uint8_t>(rng());
    for (float& x : ms) x = static_cast<float>(rng());
    for (float& x : vs) x = static_cast<float>(rng());
    const uintptr_t addr = reinterpret_cast<uintptr_t>(working.data());
    w = working.data() + (64 - addr % 64) % 64 / 2 + wshift;
    arrays.Add(master.data(), 4, BoundAccess::kUpdate);
    arrays.Add(grad.data(), 2, BoundAccess::kRead);
    if (codes) {
      arrays.Add(m.data(), 1, BoundAccess::kUpdate);
      arrays.Add(ms.data(), 4, BoundAccess::kUpdate, kBlock);
      arrays.Add(v.data(), 1, BoundAccess::kUpdate);
      arrays.Add(vs.data(), 4, BoundAccess::kUpdate, kBlock);
    }
    arrays.Add(w, 2, BoundAccess::kStreamWrite);
  }
  // The bytes of every array but the working copy.
  std::string Snapshot() const {
    std::string s;
    auto add = [&](const void* p, size_t bytes) {
      s.append(static_cast<const char*>(p), bytes);
    };
    add(master.data(), master.size() * 4);
    add(grad.data(), grad.size() * 2);
    add(m.data(), m.size());
    add(v.data(), v.size());
    add(ms.data(), ms.size() * 4);
    add(vs.data(), vs.size() * 4);
    return s;
  }
  // Elements [begin, end) of the working copy are zero, the rest of its
  // buffer untouched.
  void ExpectWritten(size_t begin, size_t end) const {
    const size_t lo = static_cast<size_t>(w - working.data()) + begin;
    const size_t hi = lo + (end - begin);
    for (size_t k = 0; k < working.size(); ++k) {
      const uint16_t want = k >= lo && k < hi ? 0 : 0xa5a5;
      ASSERT_EQ(working[k], want) << "working copy slot " << k;
    }
  }

  std::vector<float> master;
  std::vector<uint16_t> grad;
  std::vector<uint8_t> m, v;
  std::vector<float> ms, vs;
  std::vector<uint16_t> working;
  uint16_t* w = nullptr;
  BoundArrays arrays;
};

TEST(BoundTest, RangesLeaveReadAndUpdatedArraysAndWriteExactlyTheirSpan) {
  const size_t n = 3 * kBlock + 100;
  for (BoundIsa isa : SupportedIsas()) {
    for (BoundKernel kernel : kBoundKernels) {
      for (auto [wshift, codes] : {std::pair<size_t, bool>{0, true},
                                   {1, true},
                                   {0, false},
                                   {1, false}}) {
        // Starts at block boundaries; ends inside a chunk of 32 or 64, at a
        // chunk boundary, at a block boundary and at n.
        for (auto [begin, end] : {std::pair<size_t, size_t>{0, 0},
                                  {0, 1},
                                  {0, 31},
                                  {0, 32},
                                  {0, 33},
                                  {0, 63},
                                  {0, 64},
                                  {0, 65},
                                  {0, 97},
                                  {kBlock, kBlock + 1000},
                                  {kBlock, 2 * kBlock},
                                  {kBlock, n},
                                  {0, n}}) {
          SCOPED_TRACE(std::string(BoundIsaName(isa)) + " " +
                       std::string(BoundKernelName(kernel)) + " shift " +
                       std::to_string(wshift) + (codes ? " codes" : "") + " [" +
                       std::to_string(begin) + ", " + std::to_string(end) +
                       ")");
          Pass p(n, wshift, static_cast<uint32_t>(begin + end), codes);
          const std::string before = p.Snapshot();
          RunBoundRange(isa, kernel, p.arrays, begin, end);
          EXPECT_TRUE(p.Snapshot() == before);
          p.ExpectWritten(begin, end);
        }
      }
    }
  }
}

TEST(BoundTest, RunnerCoversTheWholePassOnEveryThreadCount) {
  const size_t n = 5 * kBlock + 7;
  for (int threads : {1, 2, 3}) {
    for (BoundKernel kernel : kBoundKernels) {
      SCOPED_TRACE(std::to_string(threads) + " threads, " +
                   std::string(BoundKernelName(kernel)));
      Pass p(n, 0, 7);
      const std::string before = p.Snapshot();
      BoundRunner runner(BestBoundIsa(), threads, kBlock);
      runner.Run(kernel, p.arrays, n);
      EXPECT_TRUE(p.Snapshot() == before);
      p.ExpectWritten(0, n);
    }
  }
}

TEST(BoundTest, BytesPerElementCountUpdatesTwiceAndItemsPerBlock) {
  Pass p(kBlock, 0, 1);
  // master 8, gradient 2, codes 2 x 2, scales 2 x 8 / 2048, working copy 2.
  EXPECT_DOUBLE_EQ(p.arrays.BytesPerElem(), 16.0 + 16.0 / kBlock);
}

}  // namespace
TEST(BoundTest, PrefetchDistanceIsAbout16KiBOfThePass) {
  float f[1];
  uint8_t b[1];
  BoundArrays fp32_adamw;  // 30 bytes per element
  fp32_adamw.Add(f, 4, BoundAccess::kUpdate);
  fp32_adamw.Add(f, 4, BoundAccess::kRead);
  fp32_adamw.Add(f, 4, BoundAccess::kUpdate);
  fp32_adamw.Add(f, 4, BoundAccess::kUpdate);
  fp32_adamw.Add(f, 2, BoundAccess::kStreamWrite);
  EXPECT_EQ(576u, BoundPrefetchElems(fp32_adamw));  // 546, rounded up
  BoundArrays bytes;  // 1 byte per element: capped
  bytes.Add(b, 1, BoundAccess::kRead);
  EXPECT_EQ(4096u, BoundPrefetchElems(bytes));
  BoundArrays wide;  // 80 bytes per element: floored
  for (int k = 0; k < 10; ++k) wide.Add(f, 4, BoundAccess::kUpdate);
  EXPECT_EQ(256u, BoundPrefetchElems(wide));
  EXPECT_EQ(4096u, BoundPrefetchElems(BoundArrays{}));  // no streams
  EXPECT_EQ("fused_prefetch", BoundKernelName(BoundKernel::kFusedPrefetch));
  EXPECT_EQ("fused_prefetch_32",
            BoundKernelName(BoundKernel::kFusedPrefetch32));
}

}  // namespace strata::bench
