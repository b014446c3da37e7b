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
// that every ISA's non-temporal stores are allowed (0), none are (1), or
// only those of 32 bytes and less (16) or of 16 bytes (8): a kernel that
// streamed a whole register from there would fault.
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
                                   {8, true},
                                   {16, true},
                                   {0, false},
                                   {1, false},
                                   {8, false},
                                   {16, false}}) {
        // Starts at block boundaries; ends inside a chunk of 8, 16, 32 or
        // 64, at a chunk boundary, at a block boundary and at n.
        for (auto [begin, end] : {std::pair<size_t, size_t>{0, 0},
                                  {0, 1},
                                  {0, 7},
                                  {0, 9},
                                  {0, 15},
                                  {0, 17},
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
// fused_step and fused_lines over a shape they have no compiled kernel for
// (a 1-byte read, a 4-byte and a 1-byte stream write, three 2-byte
// updates): the kernel that reads the counts at run time moves the same
// bytes.
TEST(BoundTest, StepOverAnUncompiledShapeLeavesAndWritesTheSameBytes) {
  const size_t n = 1000;
  for (BoundIsa isa : SupportedIsas()) {
    for (BoundKernel kernel :
         {BoundKernel::kFusedStep, BoundKernel::kFusedLines}) {
      for (auto [begin, end] : {std::pair<size_t, size_t>{0, 0},
                                {0, 1},
                                {0, 7},
                                {0, 8},
                                {0, 15},
                                {0, 16},
                                {0, 17},
                                {0, 31},
                                {0, 32},
                                {0, 33},
                                {64, 999},
                                {0, n}}) {
        SCOPED_TRACE(std::string(BoundIsaName(isa)) + " " +
                     std::string(BoundKernelName(kernel)) + " [" +
                     std::to_string(begin) + ", " + std::to_string(end) + ")");
        std::mt19937 rng(static_cast<uint32_t>(begin + end));
        std::vector<uint8_t> r1(n);
        std::vector<uint16_t> u2[3];
        for (uint8_t& x : r1) x = static_cast<uint8_t>(rng());
        for (auto& u : u2) {
          u.resize(n);
          for (uint16_t& x : u) x = static_cast<uint16_t>(rng());
        }
        // 64-byte aligned starts inside larger buffers, so that non-temporal
        // stores are allowed; a sentinel around.
        std::vector<float> w4buf(n + 32, 7.0f);
        std::vector<uint8_t> w1buf(n + 128, 0x5a);
        float* w4 =
            w4buf.data() +
            (64 - reinterpret_cast<uintptr_t>(w4buf.data()) % 64) % 64 / 4;
        uint8_t* w1 =
            w1buf.data() +
            (64 - reinterpret_cast<uintptr_t>(w1buf.data()) % 64) % 64;
        BoundArrays a;
        a.Add(r1.data(), 1, BoundAccess::kRead);
        for (auto& u : u2) a.Add(u.data(), 2, BoundAccess::kUpdate);
        a.Add(w4, 4, BoundAccess::kStreamWrite);
        a.Add(w1, 1, BoundAccess::kStreamWrite);
        ASSERT_EQ(BoundStepShapeIndex(a), -1);
        const std::vector<uint8_t> r1_before = r1;
        const std::vector<uint16_t> u0_before = u2[0], u2_before = u2[2];
        RunBoundRange(isa, kernel, a, begin, end);
        EXPECT_TRUE(r1 == r1_before);
        EXPECT_TRUE(u2[0] == u0_before);
        EXPECT_TRUE(u2[2] == u2_before);
        const size_t off4 = static_cast<size_t>(w4 - w4buf.data());
        for (size_t k = 0; k < w4buf.size(); ++k) {
          const bool in = k >= off4 + begin && k < off4 + end;
          ASSERT_EQ(w4buf[k], in ? 0.0f : 7.0f) << "4-byte write slot " << k;
        }
        const size_t off1 = static_cast<size_t>(w1 - w1buf.data());
        for (size_t k = 0; k < w1buf.size(); ++k) {
          const bool in = k >= off1 + begin && k < off1 + end;
          ASSERT_EQ(w1buf[k], in ? 0 : 0x5a) << "1-byte write slot " << k;
        }
      }
    }
  }
}

// The optimizers' passes have compiled shapes; the shape counts every
// per-element stream by access and size and leaves per-block ones out.
TEST(BoundTest, StepShapesOfTheOptimizersPassesAreCompiled) {
  float f[1];
  uint16_t h[1];
  uint8_t b[1];
  BoundArrays adamw;  // fp32 moments, bf16 gradient, bf16 working copy
  adamw.Add(f, 4, BoundAccess::kUpdate);
  adamw.Add(h, 2, BoundAccess::kRead);
  adamw.Add(f, 4, BoundAccess::kUpdate);
  adamw.Add(f, 4, BoundAccess::kUpdate);
  adamw.Add(h, 2, BoundAccess::kStreamWrite);
  const BoundStepShape shape = BoundStepShapeOf(adamw);
  EXPECT_EQ(shape.count[0][1], 1);  // read, 2 bytes
  EXPECT_EQ(shape.count[1][0], 3);  // updated, 4 bytes
  EXPECT_EQ(shape.count[2][1], 1);  // stream write, 2 bytes
  EXPECT_GE(BoundStepShapeIndex(adamw), 0);
  BoundArrays lion8;  // 8-bit Lion: codes and their per-block scales
  lion8.Add(f, 4, BoundAccess::kUpdate);
  lion8.Add(f, 4, BoundAccess::kRead);
  lion8.Add(b, 1, BoundAccess::kUpdate);
  lion8.Add(f, 4, BoundAccess::kUpdate, kBlock);
  EXPECT_EQ(BoundStepShapeOf(lion8).count[1][0], 1);
  EXPECT_GE(BoundStepShapeIndex(lion8), 0);
  BoundArrays stats;  // Adafactor's statistics pass
  stats.Add(h, 2, BoundAccess::kRead);
  stats.Add(f, 4, BoundAccess::kRead);
  EXPECT_GE(BoundStepShapeIndex(stats), 0);
  BoundArrays other;  // nothing updated, a 4-byte write: not an optimizer's
  other.Add(f, 4, BoundAccess::kRead);
  other.Add(f, 4, BoundAccess::kStreamWrite);
  EXPECT_EQ(BoundStepShapeIndex(other), -1);
  // Every compiled shape is distinct.
  for (int i = 0; i < kBoundStepShapeCount; ++i) {
    for (int k = i + 1; k < kBoundStepShapeCount; ++k) {
      EXPECT_FALSE(kBoundStepShapes[i] == kBoundStepShapes[k]) << i << " " << k;
    }
  }
}

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
  EXPECT_EQ("fused_step", BoundKernelName(BoundKernel::kFusedStep));
  EXPECT_EQ("fused_lines", BoundKernelName(BoundKernel::kFusedLines));
}

}  // namespace strata::bench
