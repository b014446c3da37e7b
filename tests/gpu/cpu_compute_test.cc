// The host-emulated device's compute against the scalar references: the
// vector conversions bit for bit (every type pair, every 16-bit pattern,
// rounding edges, scales, odd counts, in place, split across threads), and
// the OpenBLAS GEMM within fp32 reordering error for every type, transpose,
// padding and beta, odd and panel-splitting sizes, on one and several
// threads.
#include "gpu/cpu_compute.h"

#include <gtest/gtest.h>

#include <tbb/task_arena.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "gpu/cpu_kernels.h"
#include "tests/gpu/conversion_reference.h"

namespace strata::internal {
namespace {

constexpr ElementType kTypes[] = {ElementType::kFloat32, ElementType::kFloat16,
                                  ElementType::kBFloat16};

// Inputs of `type` as bytes: for 16-bit types every pattern (repeated so
// that the count crosses the parallel threshold); for fp32 the rounding
// edges of both 16-bit formats and random patterns.
std::vector<std::byte> ConversionInputs(ElementType type) {
  std::vector<std::byte> out;
  if (type == ElementType::kFloat32) {
    std::vector<float> v =
        strata::testing::TrickyFloats(strata::testing::kHalf);
    const std::vector<float> b =
        strata::testing::TrickyFloats(strata::testing::kBf16);
    v.insert(v.end(), b.begin(), b.end());
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  const size_t n = 5 * 65536 + 3;  // a tail after the last full vector
  out.resize(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const auto h = static_cast<uint16_t>(i * 40503u);  // odd: a permutation
    std::memcpy(&out[i * 2], &h, 2);
  }
  return out;
}

// The first byte where two buffers differ, or -1 (a whole-buffer
// EXPECT_EQ would print megabytes).
int64_t FirstDifference(const std::vector<std::byte>& a,
                        const std::vector<std::byte>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string Name(ElementType s, ElementType d, float scale) {
  return std::string(ElementTypeName(s)) + "->" +
         std::string(ElementTypeName(d)) + " scale " + std::to_string(scale);
}

TEST(CpuComputeTest, VectorConversionsEqualTheReferenceBitForBit) {
  CpuCompute compute(2);
  for (ElementType st : kTypes) {
    const std::vector<std::byte> in = ConversionInputs(st);
    const size_t count = in.size() / ElementSize(st);
    for (ElementType dt : kTypes) {
      for (float scale : {1.0f, 1.0f / 1024, 65536.0f}) {
        SCOPED_TRACE(Name(st, dt, scale));
        const size_t out_bytes = count * ElementSize(dt);
        std::vector<std::byte> want(out_bytes), fast(out_bytes),
            split(out_bytes);
        ConvertArgs a;
        a.src = in.data();
        a.src_type = st;
        a.dst_type = dt;
        a.count = count;
        a.scale = scale;
        a.dst = want.data();
        ConvertOnCpuReference(a);
        a.dst = fast.data();
        ConvertOnCpu(a);
        ASSERT_EQ(FirstDifference(fast, want), -1);
        a.dst = split.data();
        compute.Convert(a);  // in parallel chunks
        ASSERT_EQ(FirstDifference(split, want), -1) << "split";
        // Odd starts and lengths: heads and tails in the scalar code.
        for (size_t off : {size_t{1}, size_t{7}}) {
          std::vector<std::byte> part(out_bytes);
          ConvertArgs p = a;
          p.src = in.data() + off * ElementSize(st);
          p.dst = part.data();
          p.count = 13 + off;
          ConvertOnCpu(p);
          std::vector<std::byte> ref(out_bytes);
          p.dst = ref.data();
          ConvertOnCpuReference(p);
          ASSERT_EQ(FirstDifference(part, ref), -1) << "offset " << off;
        }
        // In place between types of one size.
        if (ElementSize(st) == ElementSize(dt)) {
          std::vector<std::byte> inplace = in;
          ConvertArgs p = a;
          p.src = inplace.data();
          p.dst = inplace.data();
          compute.Convert(p);
          ASSERT_EQ(FirstDifference(inplace, want), -1) << "in place";
        }
      }
    }
  }
}

TEST(CpuComputeTest, ThreadCount) {
  EXPECT_EQ(CpuCompute(3).threads(), 3);
  EXPECT_EQ(CpuCompute(0).threads(), tbb::info::default_concurrency());
}

// ---- GEMM -------------------------------------------------------------------

struct GemmCase {
  int64_t m, n, k;
  int64_t pad;  // added to every leading dimension
  float alpha, beta;
};

// Values of 1/64 steps in [-1, 1]: exact in every type, so the inputs of the
// fast and the reference GEMM agree and only the summation order differs.
float Grid(std::mt19937& rng) {
  return static_cast<float>(static_cast<int>(rng() % 129) - 64) / 64;
}

void StoreAs(std::byte* p, ElementType t, float v) {
  if (t == ElementType::kFloat32) {
    std::memcpy(p, &v, 4);
  } else {
    const uint16_t h = t == ElementType::kFloat16 ? FloatToHalfBits(v)
                                                  : FloatToBFloat16Bits(v);
    std::memcpy(p, &h, 2);
  }
}

float LoadAs(const std::byte* p, ElementType t) {
  if (t == ElementType::kFloat32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == ElementType::kFloat16 ? HalfBitsToFloat(h)
                                    : BFloat16BitsToFloat(h);
}

// Runs one GEMM on GemmOnCpuReference and on each of `computes`, and
// compares every element of C (padding included, which none may touch).
void CheckGemm(std::initializer_list<CpuCompute*> computes, const GemmCase& c,
               ElementType ab, ElementType ct, GemmOp op_a, GemmOp op_b,
               uint32_t seed) {
  SCOPED_TRACE("m " + std::to_string(c.m) + " n " + std::to_string(c.n) +
               " k " + std::to_string(c.k) + " pad " + std::to_string(c.pad) +
               " beta " + std::to_string(c.beta) + " A/B " +
               std::string(ElementTypeName(ab)) + " C " +
               std::string(ElementTypeName(ct)) + " op " +
               std::to_string(int(op_a)) + std::to_string(int(op_b)));
  const bool ta = op_a == GemmOp::kTranspose, tb = op_b == GemmOp::kTranspose;
  const int64_t ar = ta ? c.k : c.m, ac = ta ? c.m : c.k;
  const int64_t br = tb ? c.n : c.k, bc = tb ? c.k : c.n;
  GemmArgs g;
  g.op_a = op_a;
  g.op_b = op_b;
  g.m = c.m;
  g.n = c.n;
  g.k = c.k;
  g.alpha = c.alpha;
  g.beta = c.beta;
  g.ab_type = ab;
  g.c_type = ct;
  g.lda = std::max<int64_t>(ar, 1) + c.pad;
  g.ldb = std::max<int64_t>(br, 1) + c.pad;
  g.ldc = std::max<int64_t>(c.m, 1) + c.pad;
  const size_t es = ElementSize(ab), cs = ElementSize(ct);
  std::vector<std::byte> a(g.lda * ac * es), b(g.ldb * bc * es),
      c0(g.ldc * c.n * cs);
  std::mt19937 rng(seed);
  for (size_t i = 0; i < a.size() / es; ++i) StoreAs(&a[i * es], ab, Grid(rng));
  for (size_t i = 0; i < b.size() / es; ++i) StoreAs(&b[i * es], ab, Grid(rng));
  for (size_t i = 0; i < c0.size() / cs; ++i) {
    // beta == 0 must not read C: NaNs there must not reach the result.
    StoreAs(&c0[i * cs], ct, c.beta == 0 ? NAN : Grid(rng));
  }
  // The padding rows of C keep a marker neither GEMM may touch.
  if (c.pad > 0) StoreAs(&c0[c.m * cs], ct, 7.0f);
  std::vector<std::byte> want = c0;
  g.a = a.data();
  g.b = b.data();
  g.c = want.data();
  GemmOnCpuReference(g);
  // The bound: fp32 reordering error over k terms of magnitude at most
  // |alpha| (inputs lie in [-1, 1]) plus |beta|, and for a 16-bit C one
  // rounding of either result to a neighbouring value.
  const double mag =
      std::fabs(c.alpha) * static_cast<double>(c.k) + std::fabs(c.beta);
  const double ulp16 = ct == ElementType::kFloat16    ? 1.0 / 1024
                       : ct == ElementType::kBFloat16 ? 1.0 / 128
                                                      : 0.0;
  for (CpuCompute* compute : computes) {
    SCOPED_TRACE("threads " + std::to_string(compute->threads()));
    std::vector<std::byte> got = c0;
    g.c = got.data();
    compute->Gemm(g);
    for (int64_t j = 0; j < c.n; ++j) {
      for (int64_t i = 0; i < c.m; ++i) {
        const size_t ci = static_cast<size_t>(i + j * g.ldc) * cs;
        const double w = LoadAs(&want[ci], ct), v = LoadAs(&got[ci], ct);
        const double tol =
            2.0 * (c.k + 2) * 0x1p-24 * mag + ulp16 * std::fabs(w);
        ASSERT_FALSE(std::isnan(v)) << i << "," << j;
        ASSERT_LE(std::fabs(v - w), tol) << i << "," << j << " want " << w;
      }
    }
    if (c.pad > 0) {
      EXPECT_EQ(LoadAs(&got[c.m * cs], ct), 7.0f) << "padding";
    }
  }
}

TEST(CpuComputeTest, GemmMatchesTheReference) {
  // Odd and tiny shapes, k = 0, and shapes large enough to be split into
  // panels by rows (m > n) and by columns.
  const GemmCase cases[] = {
      {1, 1, 1, 0, 1.0f, 0.0f},      {7, 5, 3, 2, 0.5f, -2.0f},
      {33, 17, 65, 1, 1.0f, 1.0f},   {5, 9, 0, 1, 1.0f, 0.5f},
      {260, 120, 72, 3, 1.0f, 0.0f}, {113, 230, 88, 0, -0.25f, 1.5f},
  };
  CpuCompute one(1), three(3);
  uint32_t seed = 1;
  for (const GemmCase& c : cases) {
    for (ElementType ab : kTypes) {
      for (ElementType ct : {ElementType::kFloat32, ab}) {
        for (GemmOp op_a : {GemmOp::kNoTranspose, GemmOp::kTranspose}) {
          for (GemmOp op_b : {GemmOp::kNoTranspose, GemmOp::kTranspose}) {
            CheckGemm({&one, &three}, c, ab, ct, op_a, op_b, ++seed);
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
        if (ct == ab) break;  // fp32: one C type
      }
    }
  }
}

}  // namespace
}  // namespace strata::internal
