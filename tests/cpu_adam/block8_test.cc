// 8-bit block states (CpuDType::kBlock8): every variant against the scalar
// reference bit for bit over every length up to two blocks and more,
// special values, thread and tile independence, the documented format's
// round-trip error (decoded here from docs/cpu_adam.md's definition, not
// with cpu_adam's code). Training against fp32 AdamW is in factored_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/cpu_adam.h"
#include "tests/cpu_adam/test_util.h"

namespace strata {
namespace {

using cpu_adam_test::Bits;
using cpu_adam_test::FromBits;

constexpr size_t kBlock = kCpuBlock8Elems;
constexpr CpuOptimizerAlgo kAlgos8[] = {
    CpuOptimizerAlgo::kAdam, CpuOptimizerAlgo::kAdamW, CpuOptimizerAlgo::kLion};

std::unique_ptr<CpuOptimizer> MakeOpt(CpuOptimizerAlgo algo, CpuKernelVariant v,
                                      int threads = 1,
                                      size_t tile = size_t{1} << 16,
                                      double wd = 0.01, int sweeps = 0) {
  CpuOptimizerOptions o;
  o.algo = algo;
  o.variant = v;
  o.threads = threads;
  o.tile_elems = tile;
  o.weight_decay = wd;
  o.block8_sweeps = sweeps;
  auto opt = NewCpuOptimizer(o);
  EXPECT_TRUE(opt.ok()) << opt.status().ToString();
  return opt.ok() ? std::move(opt).value() : nullptr;
}

// One update's arrays; the states are flat kBlock8 byte arrays (kept in
// uint32_t storage for the scales' alignment).
struct Problem8 {
  size_t n;
  CpuDType grad_dtype;
  bool has_working;
  std::vector<float> master;
  std::vector<uint32_t> grad;  // fp32 words, or 16-bit halves
  std::vector<uint32_t> m, v;
  std::vector<uint16_t> working;

  Problem8(size_t n_in, CpuDType g, bool work, uint32_t seed,
           bool special = false)
      : n(n_in), grad_dtype(g), has_working(work) {
    const size_t words = (CpuStateBytes(CpuDType::kBlock8, n) + 3) / 4;
    master.resize(n);
    grad.assign(n, 0);
    m.assign(words, 0);
    v.assign(words, 0);
    working.assign(n, 0x5555);
    std::mt19937 rng(seed);
    // Cheap spread values: the length sweep makes millions of them.
    auto uniform = [&rng] {
      return static_cast<float>(static_cast<int>(rng() % 4001) - 2000) /
             1000.0f;
    };
    std::vector<float> g32(n);
    for (size_t i = 0; i < n; ++i) {
      master[i] = uniform();
      float& gi = g32[i];
      gi = uniform() * 1e-2f;
      if (special) {
        switch (rng() % 10) {
          case 0:
            gi = 0.0f;
            break;
          case 1:
            gi = -0.0f;
            break;
          case 2:
            gi = 1e-40f;  // fp32 denormal
            break;
          case 3:
            gi = 3e30f;
            break;
          case 4:
            gi = std::numeric_limits<float>::infinity();
            break;
          case 5:
            gi = std::numeric_limits<float>::quiet_NaN();
            break;
          default:
            break;
        }
      }
    }
    // One conversion call: each call checks the CPU (CPUID), slow in a VM.
    EXPECT_TRUE(ConvertCpuArray(g32.data(), CpuDType::kFloat32, grad.data(),
                                grad_dtype, n)
                    .ok());
    // Random codes and positive scales: step 1 already dequantizes. The
    // scales are not powers of two, as in states written before the
    // encoders chose powers of two: decoding takes any scale.
    auto* mb = reinterpret_cast<uint8_t*>(m.data());
    auto* vb = reinterpret_cast<uint8_t*>(v.data());
    for (size_t i = 0; i < n; ++i) {
      mb[i] = static_cast<uint8_t>(rng());
      vb[i] = static_cast<uint8_t>(rng());
    }
    const size_t off = (n + 3) / 4 * 4;
    for (size_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
      const float sm =
          std::ldexp(1.0f + static_cast<float>(rng() % 1024) / 1024,
                     -static_cast<int>(rng() % 12));
      const float sv =
          std::ldexp(1.0f + static_cast<float>(rng() % 1024) / 1024,
                     -static_cast<int>(rng() % 12));
      std::memcpy(mb + off + 4 * b, &sm, 4);
      std::memcpy(vb + off + 4 * b, &sv, 4);
    }
  }

  void SetGrad(size_t i, float x) {  // fp32 gradients only
    ASSERT_EQ(grad_dtype, CpuDType::kFloat32);
    grad[i] = Bits(x);
  }

  CpuOptimizerTensors Tensors() {
    CpuOptimizerTensors t;
    t.n = n;
    t.master = master.data();
    t.grad = grad.data();
    t.grad_dtype = grad_dtype;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.moment_dtype = CpuDType::kBlock8;
    t.working = has_working ? working.data() : nullptr;
    t.working_dtype = CpuDType::kBFloat16;
    return t;
  }
};

// Bitwise, any NaN equal to any NaN.
bool SameFloat(float a, float b) {
  return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b));
}

void ExpectSame(const Problem8& a, const Problem8& b, const char* what) {
  for (size_t i = 0; i < a.n; ++i) {
    ASSERT_TRUE(SameFloat(a.master[i], b.master[i]))
        << what << " master[" << i << "] " << a.master[i] << " vs "
        << b.master[i];
  }
  // Codes and scales: NaN scales compare as NaN.
  const size_t off = (a.n + 3) / 4 * 4;
  for (auto [x, y] : {std::pair{&a.m, &b.m}, std::pair{&a.v, &b.v}}) {
    const auto* xb = reinterpret_cast<const uint8_t*>(x->data());
    const auto* yb = reinterpret_cast<const uint8_t*>(y->data());
    // memcmp of empty arrays would pass null pointers.
    if (a.n > 0) {
      ASSERT_EQ(0, std::memcmp(xb, yb, a.n)) << what << " codes";
    }
    for (size_t k = off; k + 4 <= x->size() * 4; k += 4) {
      float fx, fy;
      std::memcpy(&fx, xb + k, 4);
      std::memcpy(&fy, yb + k, 4);
      ASSERT_TRUE(SameFloat(fx, fy)) << what << " scale at byte " << k;
    }
  }
  ASSERT_EQ(a.working, b.working) << what << " working copy";
}

// The second step clips: a gradient scale other than 1 (Note [The
// gradient's scale in the 8-bit update] in cpu_adam/kernel_impl.h).
void TwoSteps(CpuOptimizer& opt, Problem8& p) {
  CpuStepArgs args;
  args.lr = 1e-2;
  args.check_overflow = false;
  for (int s = 1; s <= 2; ++s) {
    args.step = s;
    args.clip_coef = s == 1 ? 1.0 : 0.6;
    auto r = opt.Step(p.Tensors(), args);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->applied);
  }
}

TEST(Block8Test, StateBytesFollowTheLayout) {
  EXPECT_EQ(CpuStateBytes(CpuDType::kBlock8, 0), 0u);
  EXPECT_EQ(CpuStateBytes(CpuDType::kBlock8, 1), 4u + 4u);
  EXPECT_EQ(CpuStateBytes(CpuDType::kBlock8, kBlock), kBlock + 4);
  EXPECT_EQ(CpuStateBytes(CpuDType::kBlock8, kBlock + 1), kBlock + 4 + 2 * 4);
  EXPECT_EQ(CpuStateBytes(CpuDType::kFloat32, 10), 40u);
  EXPECT_EQ(CpuStateBytes(CpuDType::kBFloat16, 10), 20u);
}

// Both forms of the update (CpuOptimizerOptions::block8_sweeps) on every
// variant against the scalar reference in its own form (one sweep).
TEST(Block8Test, VariantsMatchScalarOnEveryLength) {
  const auto variants = cpu_adam_test::SupportedVariants();
  for (CpuOptimizerAlgo algo : kAlgos8) {
    auto ref = MakeOpt(algo, CpuKernelVariant::kScalar);
    ASSERT_EQ(ref->options().block8_sweeps, 1);
    for (CpuKernelVariant v : variants) {
      const int own = MakeOpt(algo, v)->options().block8_sweeps;
      for (int sweeps : {1, 2}) {
        if (v == CpuKernelVariant::kScalar && sweeps == 1) continue;
        SCOPED_TRACE(std::string(CpuKernelVariantName(v)) + ", " +
                     std::to_string(sweeps) + " sweeps");
        auto opt = MakeOpt(algo, v, 1, size_t{1} << 16, 0.01, sweeps);
        // Every length 0 .. 2 blocks + 70 with the fp32 gradient and the
        // working copy in the variant's own form; the other cases, and the
        // other form, every length to 70 and on a stride after.
        for (size_t n = 0; n <= 2 * kBlock + 70; ++n) {
          for (CpuDType g :
               {CpuDType::kFloat32, CpuDType::kBFloat16, CpuDType::kFloat16}) {
            for (bool work : {true, false}) {
              const bool full =
                  g == CpuDType::kFloat32 && work && sweeps == own;
              if (!full && n % 97 != 0 && n > 70) continue;
              Problem8 a(n, g, work, static_cast<uint32_t>(n * 7 + 1));
              Problem8 b = a;
              TwoSteps(*ref, a);
              TwoSteps(*opt, b);
              ExpectSame(a, b, CpuKernelVariantName(v).data());
              if (HasFatalFailure()) {
                FAIL() << "algo " << static_cast<int>(algo) << " n " << n
                       << " grad " << static_cast<int>(g) << " work " << work;
              }
            }
          }
        }
      }
    }
  }
}

TEST(Block8Test, SpecialValuesMatchScalar) {
  for (CpuOptimizerAlgo algo : kAlgos8) {
    auto ref = MakeOpt(algo, CpuKernelVariant::kScalar, 2);
    for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
      for (int sweeps : {1, 2}) {
        auto opt = MakeOpt(algo, v, 2, size_t{1} << 16, 0.01, sweeps);
        Problem8 a(5 * kBlock + 333, CpuDType::kFloat32, true, 99, true);
        Problem8 b = a;
        TwoSteps(*ref, a);
        TwoSteps(*opt, b);
        ExpectSame(a, b,
                   (std::string(CpuKernelVariantName(v)) + ", " +
                    std::to_string(sweeps) + " sweeps")
                       .c_str());
      }
    }
  }
}

// A gradient stored 2^k times larger with a loss scale of 2^k steps as the
// unscaled gradient, bit for bit: Adam(W) takes the scale into its
// coefficients (exact for a power of two) while they stay normal floats,
// and on the gradient itself past that (2^-70: (1 - b2) 2^-140 would be
// 0 in fp32; 2^70: inf) and for Adam's L2 term. **It can fail:** folding
// at every scale loses the second moment's gradient term at 2^70.
TEST(Block8Test, PowerOfTwoLossScalesStepAsTheUnscaledGradient) {
  const size_t n = 2 * kBlock + 77;
  for (CpuOptimizerAlgo algo : kAlgos8) {
    for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
      auto opt = MakeOpt(algo, v);
      const Problem8 base(n, CpuDType::kFloat32, true, 31);
      Problem8 want = base;
      CpuStepArgs args;
      args.lr = 1e-2;
      args.check_overflow = false;
      ASSERT_TRUE(opt->Step(want.Tensors(), args).ok());
      for (int k : {-70, -12, 12, 70}) {
        SCOPED_TRACE("algo " + std::to_string(static_cast<int>(algo)) + " " +
                     std::string(CpuKernelVariantName(v)) + " 2^" +
                     std::to_string(k));
        Problem8 got = base;
        for (size_t i = 0; i < n; ++i) {
          got.SetGrad(i, std::ldexp(cpu_adam_test::FromBits(base.grad[i]), k));
        }
        CpuStepArgs scaled = args;
        scaled.inv_loss_scale = std::ldexp(1.0, -k);
        auto r = opt->Step(got.Tensors(), scaled);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        ExpectSame(want, got, "scaled");
      }
    }
  }
}

// 0 takes the variant's own form (two sweeps on AVX2, one elsewhere), which
// options() reports; 1 and 2 are kept; anything else is refused by name.
TEST(Block8Test, SweepsResolveToTheVariantsOwn) {
  for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
    auto opt = MakeOpt(CpuOptimizerAlgo::kAdamW, v);
    EXPECT_EQ(opt->options().block8_sweeps,
              v == CpuKernelVariant::kAvx2 ? 2 : 1)
        << CpuKernelVariantName(v);
    for (int sweeps : {1, 2}) {
      auto chosen = MakeOpt(CpuOptimizerAlgo::kAdamW, v, 1, size_t{1} << 16,
                            0.01, sweeps);
      EXPECT_EQ(chosen->options().block8_sweeps, sweeps);
    }
  }
  for (int bad : {-1, 3}) {
    CpuOptimizerOptions o;
    o.block8_sweeps = bad;
    auto opt = NewCpuOptimizer(o);
    ASSERT_FALSE(opt.ok()) << bad;
    EXPECT_EQ(opt.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(opt.status().message().find("block8_sweeps"), std::string::npos)
        << opt.status().ToString();
  }
}

TEST(Block8Test, ResultDoesNotDependOnThreadsOrTiles) {
  const size_t n = 3 * (size_t{1} << 16) + 1234;
  for (CpuOptimizerAlgo algo : kAlgos8) {
    Problem8 base(n, CpuDType::kBFloat16, true, 5);
    Problem8 one = base;
    auto opt1 = MakeOpt(algo, CpuKernelVariant::kAuto, 1);
    TwoSteps(*opt1, one);
    // Tiles of 1000 elements round up to whole blocks for kBlock8.
    for (auto [threads, tile] :
         {std::pair{2, size_t{1} << 16}, std::pair{2, size_t{1000}},
          std::pair{1, size_t{4096}}}) {
      Problem8 p = base;
      auto opt = MakeOpt(algo, CpuKernelVariant::kAuto, threads, tile);
      TwoSteps(*opt, p);
      ExpectSame(one, p, "threads/tiles");
    }
  }
}

// The documented format, decoded from its definition: m is sign + E4M3 with
// exponent bias 15 (code magnitude e*8+f: 2^(e-15) (1 + f/8)) times
// s_m; v's code is E4M4 of sqrt(v) (2^(e-15) (1 + f/16)) times s_v. Code 0
// is zero.
double DecodeM(uint8_t c, float s) {
  const int mag = c & 0x7f;
  if (mag == 0) return 0.0;
  const double x = std::ldexp(1.0 + (mag & 7) / 8.0, (mag >> 3) - 15) * s;
  return (c & 0x80) ? -x : x;
}
double DecodeR(uint8_t c, float s) {
  if (c == 0) return 0.0;
  return std::ldexp(1.0 + (c & 15) / 16.0, (c >> 4) - 15) * s;
}

// The documented scale rule: s is the smallest power of two with
// trunc(absmax) <= top * s, trunc keeping the top 16 bits of absmax's fp32
// value (sign, exponent, 7 mantissa bits). `slack` widens both sides for an
// absmax computed here in double, not from the kernel's fp32 moments.
void ExpectScaleFits(double amax, float s, double top, double slack) {
  const double t = cpu_adam_test::FromBits(
      cpu_adam_test::Bits(static_cast<float>(amax * (1 - slack))) &
      0xffff0000u);
  EXPECT_LE(t, s * top);
  EXPECT_GT(amax * (1 + slack), s * top / 2);
}

// AdamW with beta1 = beta2 = 0 on one thread: after one step from zero
// states m = g and v = g^2 exactly, so the codes are the quantized gradient.
std::unique_ptr<CpuOptimizer> QuantizingAdamW() {
  CpuOptimizerOptions o;
  o.algo = CpuOptimizerAlgo::kAdamW;
  o.beta1 = 0.0;
  o.beta2 = 0.0;
  o.threads = 1;
  auto opt = NewCpuOptimizer(o);
  EXPECT_TRUE(opt.ok()) << opt.status().ToString();
  return opt.ok() ? std::move(opt).value() : nullptr;
}

// That step, with lr 0 (the weights stay).
void StepFromZeroStates(CpuOptimizer& opt, Problem8& p) {
  std::fill(p.m.begin(), p.m.end(), 0u);
  std::fill(p.v.begin(), p.v.end(), 0u);
  CpuStepArgs args;
  args.lr = 0.0;
  auto r = opt.Step(p.Tensors(), args);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->applied);
}

TEST(Block8Test, RoundTripWithinTheStatedError) {
  auto opt = QuantizingAdamW();
  ASSERT_NE(opt, nullptr);
  const size_t n = 3 * kBlock + 17;
  Problem8 p(n, CpuDType::kFloat32, false, 3);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> expo(-18.0f, 0.0f);
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = std::exp2(expo(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    if (i % 500 == 0) g[i] = 0.0f;
    p.SetGrad(i, g[i]);
  }
  StepFromZeroStates(*opt, p);
  if (HasFatalFailure()) return;
  const auto* mb = reinterpret_cast<const uint8_t*>(p.m.data());
  const auto* vb = reinterpret_cast<const uint8_t*>(p.v.data());
  const size_t off = (n + 3) / 4 * 4;
  size_t checked = 0;
  for (size_t b = 0; b * kBlock < n; ++b) {
    float sm, sv;
    std::memcpy(&sm, mb + off + 4 * b, 4);
    std::memcpy(&sv, vb + off + 4 * b, 4);
    double amax = 0;
    for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      amax = std::max(amax, std::fabs(static_cast<double>(g[i])));
    }
    // The scales are the smallest powers of two that fit the absmax (its
    // top 16 bits) under the largest code.
    int e = 0;
    EXPECT_EQ(std::frexp(sm, &e), 0.5f) << b;
    EXPECT_EQ(std::frexp(sv, &e), 0.5f) << b;
    {
      SCOPED_TRACE(b);
      ExpectScaleFits(amax, sm, 1.875, 0.0);
      ExpectScaleFits(amax, sv, 1.9375, 0.0);
    }
    for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      const double x = g[i];
      const double dm = DecodeM(mb[i], sm);
      const double dr = DecodeR(vb[i], sv);
      if (x == 0.0) {
        EXPECT_EQ(dm, 0.0) << i;
        EXPECT_EQ(dr, 0.0) << i;
        continue;
      }
      // r never rounds to zero: at least the smallest code.
      EXPECT_GT(dr, 0.0) << i;
      if (std::fabs(x) >= amax * std::ldexp(1.0, -14)) {
        EXPECT_LE(std::fabs(dm - x), std::fabs(x) / 16 * (1 + 1e-6)) << i;
        EXPECT_LE(std::fabs(dr - std::fabs(x)), std::fabs(x) / 32 * (1 + 1e-6))
            << i;
        EXPECT_EQ(dm < 0, x < 0) << i;
        ++checked;
      } else {
        // Below the stated range: flushed, or coded no larger than the
        // range's edge rounded up.
        EXPECT_LE(std::fabs(dm), amax * std::ldexp(1.0, -14) * (1 + 1.0 / 16))
            << i;
      }
    }
  }
  EXPECT_GT(checked, n / 2);
}

// Step after step, on every variant: each step's codes decode, with that
// step's scales, to the moments the documented update gives from the
// previous step's decoded codes, within the format's stated error, and
// each scale is the smallest power of two that fits. The gradients of
// every other block jump by 4x on alternate steps, so some blocks' scales
// move and the others' stay (the update then writes its codes against the
// old scale and skips the encoding pass): both happen, and both are
// checked.
TEST(Block8Test, StepAfterStepStaysWithinTheStatedError) {
  const double b1 = 0.9, b2 = 0.999;
  const size_t n = 6 * kBlock + 17;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  const size_t off = (n + 3) / 4 * 4;
  for (CpuKernelVariant variant : cpu_adam_test::SupportedVariants()) {
    SCOPED_TRACE(CpuKernelVariantName(variant).data());
    CpuOptimizerOptions o;
    o.algo = CpuOptimizerAlgo::kAdamW;
    o.beta1 = b1;
    o.beta2 = b2;
    o.threads = 1;
    o.variant = variant;
    auto opt = NewCpuOptimizer(o);
    ASSERT_TRUE(opt.ok()) << opt.status().ToString();
    Problem8 p(n, CpuDType::kFloat32, false, 21);
    std::fill(p.m.begin(), p.m.end(), 0u);
    std::fill(p.v.begin(), p.v.end(), 0u);
    const auto* mb = reinterpret_cast<const uint8_t*>(p.m.data());
    const auto* vb = reinterpret_cast<const uint8_t*>(p.v.data());
    auto scale = [&](const uint8_t* bytes, size_t b) {
      float s;
      std::memcpy(&s, bytes + off + 4 * b, 4);
      return s;
    };
    std::vector<double> dm(n, 0.0), dr(n, 0.0);  // decoded previous states
    std::vector<float> old_sm(blocks, 0.0f);
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> mag(0.25, 1.0);
    size_t kept = 0, moved = 0;
    for (int step = 1; step <= 8; ++step) {
      std::vector<double> g(n);
      for (size_t i = 0; i < n; ++i) {
        const size_t b = i / kBlock;
        const double amp = std::ldexp(1.0, -static_cast<int>(b % 3) - 4) *
                           ((b % 2 == 0 && step % 2 == 0) ? 4.0 : 1.0);
        g[i] = static_cast<float>(amp * mag(rng) * ((rng() & 1) ? 1 : -1));
        p.SetGrad(i, static_cast<float>(g[i]));
      }
      CpuStepArgs args;
      args.lr = 0.0;
      args.step = step;
      args.check_overflow = false;
      auto r = (*opt)->Step(p.Tensors(), args);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      for (size_t b = 0; b < blocks; ++b) {
        const size_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
        std::vector<double> m(hi - lo), rt(hi - lo);
        double amax_m = 0, amax_r = 0;
        for (size_t i = lo; i < hi; ++i) {
          m[i - lo] = b1 * dm[i] + (1 - b1) * g[i];
          rt[i - lo] = std::sqrt(b2 * dr[i] * dr[i] + (1 - b2) * g[i] * g[i]);
          amax_m = std::max(amax_m, std::fabs(m[i - lo]));
          amax_r = std::max(amax_r, rt[i - lo]);
        }
        const float sm = scale(mb, b), sv = scale(vb, b);
        int e = 0;
        ASSERT_EQ(std::frexp(sm, &e), 0.5f)
            << "step " << step << " block " << b;
        ASSERT_EQ(std::frexp(sv, &e), 0.5f)
            << "step " << step << " block " << b;
        {
          SCOPED_TRACE(testing::Message() << "step " << step << " block " << b);
          ExpectScaleFits(amax_m, sm, 1.875, 1e-6);
          ExpectScaleFits(amax_r, sv, 1.9375, 1e-6);
        }
        if (step > 1) (sm == old_sm[b] ? kept : moved) += 1;
        old_sm[b] = sm;
        for (size_t i = lo; i < hi; ++i) {
          const double x = m[i - lo], y = rt[i - lo];
          dm[i] = DecodeM(mb[i], sm);
          dr[i] = DecodeR(vb[i], sv);
          if (std::fabs(x) >= amax_m * std::ldexp(1.0, -14)) {
            ASSERT_LE(std::fabs(dm[i] - x), std::fabs(x) / 16 * (1 + 1e-5))
                << "step " << step << " m[" << i << "]";
          }
          if (y >= amax_r * std::ldexp(1.0, -14)) {
            ASSERT_LE(std::fabs(dr[i] - y), y / 32 * (1 + 1e-5))
                << "step " << step << " r[" << i << "]";
          }
        }
      }
    }
    EXPECT_GT(kept, blocks);
    EXPECT_GT(moved, blocks);
  }
}

// The scales' exponents stop at 2^-111 (below, the encoders' bias would
// leave its 16 bits) and at 2^127 (2^128 is not a fp32): a block of tiny
// first moments is coded against 2^-111, one of huge ones clamps to the
// largest code.
TEST(Block8Test, ScalesClampAtTheEndsOfTheExponentRange) {
  auto opt = QuantizingAdamW();
  ASSERT_NE(opt, nullptr);
  const size_t n = 2 * kBlock;
  Problem8 p(n, CpuDType::kFloat32, false, 5);
  for (size_t i = 0; i < kBlock; ++i) {
    p.SetGrad(i, i % 2 ? 1e-36f : -3e-37f);  // block 0: tiny
  }
  p.SetGrad(kBlock / 2, 1e-40f);  // a denormal: flushes to 0
  for (size_t i = kBlock; i < n; ++i) {
    p.SetGrad(i, i % 2 ? 3.3e38f : -1e38f);  // block 1: huge
  }
  StepFromZeroStates(*opt, p);
  if (HasFatalFailure()) return;
  const auto* mb = reinterpret_cast<const uint8_t*>(p.m.data());
  const size_t off = (n + 3) / 4 * 4;
  float s0, s1;
  std::memcpy(&s0, mb + off, 4);
  std::memcpy(&s1, mb + off + 4, 4);
  EXPECT_EQ(s0, std::ldexp(1.0f, -111));
  EXPECT_EQ(s1, std::ldexp(1.0f, 127));
  EXPECT_NEAR(DecodeM(mb[1], s0), 1e-36, 1e-36 / 16);
  EXPECT_NEAR(DecodeM(mb[0], s0), -3e-37, 3e-37 / 16);
  EXPECT_EQ(DecodeM(mb[kBlock / 2], s0), 0.0);
  EXPECT_EQ(mb[kBlock + 1], 0x7f);  // 3.3e38 / 2^127 > 1.875: the largest
  EXPECT_NEAR(DecodeM(mb[kBlock], s1), -1e38, 1e38 / 16);
}

TEST(Block8Test, RejectsAdagradAndNonStateUses) {
  auto opt = MakeOpt(CpuOptimizerAlgo::kAdagrad, CpuKernelVariant::kAuto);
  Problem8 p(100, CpuDType::kFloat32, false, 1);
  CpuStepArgs args;
  EXPECT_EQ(opt->Step(p.Tensors(), args).status().code(),
            StatusCode::kInvalidArgument);
  auto adamw = MakeOpt(CpuOptimizerAlgo::kAdamW, CpuKernelVariant::kAuto);
  CpuOptimizerTensors t = p.Tensors();
  t.grad_dtype = CpuDType::kBlock8;
  EXPECT_EQ(adamw->Step(t, args).status().code(), StatusCode::kInvalidArgument);
  float x = 1.0f;
  uint8_t y = 0;
  EXPECT_EQ(
      ConvertCpuArray(&x, CpuDType::kFloat32, &y, CpuDType::kBlock8, 1).code(),
      StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
