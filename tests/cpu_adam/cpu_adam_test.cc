// The optimizer against its scalar reference (bit for bit, every tail
// length, large multi-tile arrays, special values), the overflow contract,
// gradient statistics, thread-count independence, closed-form first steps,
// and argument checking.
#include "strata/cpu_adam.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/cpu_adam/test_util.h"

namespace strata {
namespace {

using cpu_adam_test::Bits;

constexpr CpuOptimizerAlgo kAlgos[] = {
    CpuOptimizerAlgo::kAdam, CpuOptimizerAlgo::kAdamW,
    CpuOptimizerAlgo::kAdagrad, CpuOptimizerAlgo::kLion};
constexpr CpuDType kDTypes[] = {CpuDType::kFloat32, CpuDType::kFloat16,
                                CpuDType::kBFloat16};

std::unique_ptr<CpuOptimizer> MakeOpt(CpuOptimizerAlgo algo, CpuKernelVariant v,
                                      int threads = 1,
                                      size_t tile = size_t{1} << 16) {
  CpuOptimizerOptions o;
  o.algo = algo;
  o.variant = v;
  o.threads = threads;
  o.tile_elems = tile;
  o.weight_decay = 0.01;
  o.beta1 = algo == CpuOptimizerAlgo::kLion ? 0.95 : 0.9;
  o.beta2 = algo == CpuOptimizerAlgo::kLion ? 0.98 : 0.999;
  auto opt = NewCpuOptimizer(o);
  EXPECT_TRUE(opt.ok()) << opt.status().ToString();
  return opt.ok() ? std::move(opt).value() : nullptr;
}

// Kinds of gradient values a problem is filled with.
enum class GradMix { kNormal, kSpecial };

// The arrays of one update, stored as raw bytes so one type serves every
// dtype combination; `offset` elements of slack in front move the start off
// any vector alignment.
struct Problem {
  size_t n = 0, offset = 0;
  CpuDType grad_dtype = CpuDType::kFloat32;
  CpuDType moment_dtype = CpuDType::kFloat32;
  bool has_working = false;
  CpuDType working_dtype = CpuDType::kBFloat16;
  std::vector<float> master;
  std::vector<uint32_t> grad, m, v;  // 32-bit words; 16-bit types use half
  std::vector<uint16_t> working;

  static size_t Size(CpuDType t) { return t == CpuDType::kFloat32 ? 4 : 2; }

  Problem(size_t n_in, size_t off, CpuDType g, CpuDType mom, bool work,
          CpuDType wd, uint32_t seed, GradMix mix = GradMix::kNormal)
      : n(n_in),
        offset(off),
        grad_dtype(g),
        moment_dtype(mom),
        has_working(work),
        working_dtype(wd) {
    const size_t total = n + off;
    master.resize(total);
    grad.resize(total);
    m.resize(total);
    v.resize(total);
    working.assign(total, 0x5555);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> gf(total), mf(total), vf(total);
    for (size_t i = 0; i < total; ++i) {
      master[i] = normal(rng);
      mf[i] = 0.1f * normal(rng);
      vf[i] = 0.01f * std::fabs(normal(rng));
      gf[i] = normal(rng) * (i % 5 == 0 ? 1e-3f : 1.0f);
      if (mix == GradMix::kSpecial) {
        switch (rng() % 12) {
          case 0:
            gf[i] = 0.0f;
            break;
          case 1:
            gf[i] = -0.0f;
            break;
          case 2:
            gf[i] = 1e-40f;
            break;  // fp32 denormal
          case 3:
            gf[i] = -3e-39f;
            break;
          case 4:
            gf[i] = 6e4f;
            break;
          case 5:
            vf[i] = 0.0f;
            mf[i] = 0.0f;
            break;
          case 6:
            gf[i] = std::numeric_limits<float>::infinity();
            break;
          case 7:
            gf[i] = std::numeric_limits<float>::quiet_NaN();
            break;
          case 8:
            master[i] = 1e-41f;
            break;
          default:
            break;
        }
      }
    }
    Fill(gf, grad.data(), g);
    Fill(mf, m.data(), mom);
    Fill(vf, v.data(), mom);
  }

  static void Fill(const std::vector<float>& src, uint32_t* dst, CpuDType t) {
    ASSERT_TRUE(ConvertCpuArray(src.data(), CpuDType::kFloat32, dst, t,
                                src.size(), CpuKernelVariant::kScalar)
                    .ok());
  }

  void* At(std::vector<uint32_t>& a, CpuDType t) {
    return reinterpret_cast<char*>(a.data()) + offset * Size(t);
  }

  CpuOptimizerTensors View() {
    CpuOptimizerTensors t;
    t.n = n;
    t.master = master.data() + offset;
    t.grad = At(grad, grad_dtype);
    t.grad_dtype = grad_dtype;
    t.exp_avg = At(m, moment_dtype);
    t.exp_avg_sq = At(v, moment_dtype);
    t.moment_dtype = moment_dtype;
    t.working = has_working ? working.data() + offset : nullptr;
    t.working_dtype = working_dtype;
    return t;
  }
};

bool SameBits(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

// Equal bit for bit, except that any two NaNs (fp32 or 16-bit) compare
// equal: NaN payloads may legitimately depend on operand order.
::testing::AssertionResult SameValues(const Problem& a, const Problem& b) {
  const size_t total = a.n + a.offset;
  for (size_t i = 0; i < total; ++i) {
    const float x = a.master[i], y = b.master[i];
    if (Bits(x) != Bits(y) && !(std::isnan(x) && std::isnan(y))) {
      return ::testing::AssertionFailure()
             << "master[" << i << "] " << x << " vs " << y;
    }
  }
  auto same16 = [](uint16_t x, uint16_t y) {
    auto nan16 = [](uint16_t h, bool half) {
      return half ? (h & 0x7c00) == 0x7c00 && (h & 0x3ff)
                  : (h & 0x7f80) == 0x7f80 && (h & 0x7f);
    };
    return x == y || (nan16(x, false) && nan16(y, false));
  };
  for (const auto* arr : {&a.m, &a.v}) {
    const auto& other = arr == &a.m ? b.m : b.v;
    if (a.moment_dtype == CpuDType::kFloat32) {
      for (size_t i = 0; i < total; ++i) {
        const float x = cpu_adam_test::FromBits((*arr)[i]);
        const float y = cpu_adam_test::FromBits(other[i]);
        if ((*arr)[i] != other[i] && !(std::isnan(x) && std::isnan(y))) {
          return ::testing::AssertionFailure() << "moment[" << i << "]";
        }
      }
    } else {
      const auto* x = reinterpret_cast<const uint16_t*>(arr->data());
      const auto* y = reinterpret_cast<const uint16_t*>(other.data());
      for (size_t i = 0; i < total; ++i) {
        if (!same16(x[i], y[i])) {
          return ::testing::AssertionFailure() << "bf16 moment[" << i << "]";
        }
      }
    }
  }
  for (size_t i = 0; i < total; ++i) {
    const uint16_t x = a.working[i], y = b.working[i];
    const bool half = a.working_dtype == CpuDType::kFloat16;
    const bool both_nan = half ? ((x & 0x7c00) == 0x7c00 && (x & 0x3ff) &&
                                  (y & 0x7c00) == 0x7c00 && (y & 0x3ff))
                               : same16(x, y);
    if (x != y && !both_nan) {
      return ::testing::AssertionFailure() << "working[" << i << "]";
    }
  }
  return ::testing::AssertionSuccess();
}

CpuStepArgs Args(int64_t step) {
  CpuStepArgs a;
  a.step = step;
  a.lr = 1e-3;
  a.inv_loss_scale = 1.0 / 1024;
  a.clip_coef = 0.75;
  return a;
}

std::string Label(CpuKernelVariant v, CpuOptimizerAlgo algo, CpuDType g,
                  CpuDType mom, int work) {
  return std::string(CpuKernelVariantName(v)) + " algo " +
         std::to_string(static_cast<int>(algo)) + " grad " +
         std::to_string(static_cast<int>(g)) + " moment " +
         std::to_string(static_cast<int>(mom)) + " working " +
         std::to_string(work);
}

// Every variant, optimizer and dtype combination, every length 0..63 and
// three longer ones, at shifting offsets (so the non-temporal head peel,
// the plain stores of a short segment off its alignment and the tails are
// all hit: Note [Partial lines of the working copy] in
// cpu_adam/kernel_impl.h), two steps: identical to the scalar reference bit
// for bit.
TEST(CpuAdamTest, VariantsMatchScalarOnEveryTail) {
  for (CpuKernelVariant variant : cpu_adam_test::SupportedVariants()) {
    if (variant == CpuKernelVariant::kScalar) continue;
    for (CpuOptimizerAlgo algo : kAlgos) {
      auto ref = MakeOpt(algo, CpuKernelVariant::kScalar);
      auto opt = MakeOpt(algo, variant);
      ASSERT_TRUE(ref && opt);
      for (CpuDType g : kDTypes) {
        for (CpuDType mom : {CpuDType::kFloat32, CpuDType::kBFloat16}) {
          for (int work = 0; work < 3; ++work) {
            SCOPED_TRACE(Label(variant, algo, g, mom, work));
            const CpuDType wd =
                work == 1 ? CpuDType::kFloat16 : CpuDType::kBFloat16;
            std::vector<size_t> lengths(64);
            std::iota(lengths.begin(), lengths.end(), size_t{0});
            // Offsets 1, 4 and 10: below and above kStreamHeadMinElems.
            for (size_t n : {2047, 2085, 12293}) lengths.push_back(n);
            for (size_t n : lengths) {
              const size_t off = (n * 5) % 17;
              Problem a(n, off, g, mom, work != 0, wd, 100 + n);
              Problem b = a;
              for (int64_t step : {1, 7}) {
                auto ra = ref->Step(a.View(), Args(step));
                auto rb = opt->Step(b.View(), Args(step));
                ASSERT_TRUE(ra.ok() && rb.ok());
                ASSERT_TRUE(ra->applied && rb->applied);
              }
              ASSERT_TRUE(SameValues(a, b)) << "n=" << n << " off=" << off;
            }
          }
        }
      }
    }
  }
}

// Large multi-tile arrays on two threads with zeros, denormals, large
// values, inf and nan in the gradient (overflow check off, so the kernels
// themselves meet them).
TEST(CpuAdamTest, LargeArraysWithSpecialValuesMatchScalar) {
  const size_t n = 3 * 65536 + 37;
  for (CpuKernelVariant variant : cpu_adam_test::SupportedVariants()) {
    if (variant == CpuKernelVariant::kScalar) continue;
    for (CpuOptimizerAlgo algo : kAlgos) {
      for (CpuDType mom : {CpuDType::kFloat32, CpuDType::kBFloat16}) {
        SCOPED_TRACE(Label(variant, algo, CpuDType::kFloat32, mom, 2));
        auto ref = MakeOpt(algo, CpuKernelVariant::kScalar, 2);
        auto opt = MakeOpt(algo, variant, 2);
        ASSERT_TRUE(ref && opt);
        Problem a(n, 3, CpuDType::kFloat32, mom, true, CpuDType::kBFloat16, 5,
                  GradMix::kSpecial);
        Problem b = a;
        CpuStepArgs args = Args(3);
        args.check_overflow = false;
        ASSERT_TRUE(ref->Step(a.View(), args).ok());
        ASSERT_TRUE(opt->Step(b.View(), args).ok());
        EXPECT_TRUE(SameValues(a, b));
      }
    }
  }
}

// An inf or nan anywhere (including the scalar tail and the first element),
// or a finite gradient that overflows once scaled: nothing is written.
TEST(CpuAdamTest, OverflowLeavesMasterMomentsAndWorkingCopyUnchanged) {
  const size_t n = 2 * 65536 + 13;
  for (CpuKernelVariant variant : cpu_adam_test::SupportedVariants()) {
    auto opt = MakeOpt(CpuOptimizerAlgo::kAdamW, variant, 2);
    ASSERT_TRUE(opt);
    for (CpuDType g : kDTypes) {
      for (CpuDType mom : {CpuDType::kFloat32, CpuDType::kBFloat16}) {
        for (size_t bad_at : {size_t{0}, size_t{70000}, n - 1}) {
          for (int kind = 0; kind < 3; ++kind) {
            SCOPED_TRACE(Label(variant, CpuOptimizerAlgo::kAdamW, g, mom, 2) +
                         " at " + std::to_string(bad_at) + " kind " +
                         std::to_string(kind));
            Problem p(n, 0, g, mom, true, CpuDType::kBFloat16, 9);
            const float bad = kind == 0 ? std::numeric_limits<float>::infinity()
                              : kind == 1
                                  ? -std::numeric_limits<float>::quiet_NaN()
                                  : 6e4f;  // finite, overflows once scaled
            std::vector<float> one = {bad};
            uint32_t word[1];
            Problem::Fill(one, word, g);
            std::memcpy(
                static_cast<char*>(p.At(p.grad, g)) + bad_at * Problem::Size(g),
                word, Problem::Size(g));
            const Problem before = p;
            CpuStepArgs args = Args(4);
            if (kind == 2) {
              args.inv_loss_scale = 1e35;  // 6e4 * 1e35 > FLT_MAX
              args.clip_coef = 1.0;
            }
            auto r = opt->Step(p.View(), args);
            ASSERT_TRUE(r.ok());
            EXPECT_FALSE(r->applied);
            EXPECT_TRUE(SameBits(p.master.data(), before.master.data(),
                                 p.master.size() * 4));
            EXPECT_TRUE(SameBits(p.m.data(), before.m.data(), p.m.size() * 4));
            EXPECT_TRUE(SameBits(p.v.data(), before.v.data(), p.v.size() * 4));
            EXPECT_TRUE(SameBits(p.working.data(), before.working.data(),
                                 p.working.size() * 2));
          }
        }
      }
    }
  }
}

TEST(CpuAdamTest, ResultDoesNotDependOnThreadsOrTiles) {
  const size_t n = 5 * 4096 + 29;
  Problem base(n, 1, CpuDType::kBFloat16, CpuDType::kFloat32, true,
               CpuDType::kBFloat16, 21);
  Problem want = base;
  auto ref = MakeOpt(CpuOptimizerAlgo::kAdamW, CpuKernelVariant::kAuto, 1);
  ASSERT_TRUE(ref->Step(want.View(), Args(2)).ok());
  for (int threads : {1, 2}) {
    for (size_t tile : {size_t{1}, size_t{100}, size_t{4096}}) {
      Problem p = base;
      auto opt = MakeOpt(CpuOptimizerAlgo::kAdamW, CpuKernelVariant::kAuto,
                         threads, tile);
      ASSERT_EQ(opt->threads(), threads);
      ASSERT_EQ(opt->options().tile_elems % 64, 0u);
      ASSERT_TRUE(opt->Step(p.View(), Args(2)).ok());
      EXPECT_TRUE(SameValues(p, want)) << threads << " " << tile;
    }
  }
}

TEST(CpuAdamTest, GradStatsSumOfSquaresAndNonFinite) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const size_t n = 3 * 65536 + 45;
  std::vector<float> g(n);
  for (float& x : g) x = normal(rng);
  for (CpuDType t : kDTypes) {
    std::vector<uint32_t> raw(n);
    Problem::Fill(g, raw.data(), t);
    std::vector<float> back(n);  // the values actually stored
    ASSERT_TRUE(ConvertCpuArray(raw.data(), t, back.data(), CpuDType::kFloat32,
                                n, CpuKernelVariant::kScalar)
                    .ok());
    const double scale = 0.5;
    long double want = 0;
    for (float x : back) {
      const double y = static_cast<double>(x * 0.5f);
      want += static_cast<long double>(y) * y;
    }
    double first = -1;
    for (CpuKernelVariant variant : cpu_adam_test::SupportedVariants()) {
      for (int threads : {1, 2}) {
        auto opt = MakeOpt(CpuOptimizerAlgo::kAdamW, variant, threads);
        auto s = opt->ComputeGradStats(raw.data(), t, n, scale);
        ASSERT_TRUE(s.ok());
        EXPECT_TRUE(s->finite);
        EXPECT_NEAR(s->sum_sq, static_cast<double>(want),
                    1e-12 * static_cast<double>(want));
        if (variant == CpuKernelVariant::kScalar) {
          if (first < 0) first = s->sum_sq;
          EXPECT_EQ(s->sum_sq, first);  // deterministic across threads
        }
      }
      // Non-finite anywhere, including the tail, is seen.
      auto opt = MakeOpt(CpuOptimizerAlgo::kAdamW, variant, 2);
      for (size_t at : {size_t{0}, size_t{65535}, n - 1}) {
        std::vector<uint32_t> bad = raw;
        std::vector<float> nan = {std::numeric_limits<float>::quiet_NaN()};
        uint32_t word[1];
        Problem::Fill(nan, word, t);
        std::memcpy(reinterpret_cast<char*>(bad.data()) + at * Problem::Size(t),
                    word, Problem::Size(t));
        auto s = opt->ComputeGradStats(bad.data(), t, n, scale);
        ASSERT_TRUE(s.ok());
        EXPECT_FALSE(s->finite) << at;
      }
    }
  }
}

// Step 1 from zero moments has a closed form: Adam and AdamW move each
// weight by lr * g / (|g| + eps') ~ lr * sign(g); Adagrad by
// lr * g / (|g| + eps); Lion by lr * sign(g). The working copy is the
// rounded master, and bf16 moments track fp32 ones to bf16 precision. From
// zero moments the bf16-moment step is the fp32-moment one, but for Adam's
// denominator, which multiplies by 1 / sqrt(bc2) where the fp32 path divides
// by sqrt(bc2) (Note [The bf16-moment denominator] in
// cpu_adam/kernel_impl.h): within two ulps of the step and one of the
// weight.
TEST(CpuAdamTest, FirstStepClosedFormAndBf16Moments) {
  const size_t n = 1000;
  for (CpuOptimizerAlgo algo : kAlgos) {
    SCOPED_TRACE(static_cast<int>(algo));
    CpuOptimizerOptions o;
    o.algo = algo;
    o.weight_decay = 0.0;
    auto opt = NewCpuOptimizer(o);
    ASSERT_TRUE(opt.ok());
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f), p0(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = p0[i] = normal(rng);
      g[i] = normal(rng);
    }
    std::vector<uint16_t> mb(n, 0), vb(n, 0), w(n);
    std::vector<float> pb = p;
    CpuOptimizerTensors t;
    t.n = n;
    t.master = p.data();
    t.grad = g.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.working = w.data();
    t.working_dtype = CpuDType::kFloat16;
    CpuStepArgs args;
    args.lr = 0.01;
    auto r = (*opt)->Step(t, args);
    ASSERT_TRUE(r.ok() && r->applied);
    for (size_t i = 0; i < n; ++i) {
      const double want = p0[i] - 0.01 * g[i] / (std::fabs(g[i]) + 1e-8);
      const double lion = p0[i] - 0.01 * ((g[i] > 0) - (g[i] < 0));
      ASSERT_NEAR(p[i], algo == CpuOptimizerAlgo::kLion ? lion : want, 1e-6)
          << i;
    }
    std::vector<uint16_t> want_w(n);
    ASSERT_TRUE(ConvertCpuArray(p.data(), CpuDType::kFloat32, want_w.data(),
                                CpuDType::kFloat16, n)
                    .ok());
    EXPECT_EQ(w, want_w);

    t.master = pb.data();
    t.exp_avg = mb.data();
    t.exp_avg_sq = vb.data();
    t.moment_dtype = CpuDType::kBFloat16;
    t.working = nullptr;
    ASSERT_TRUE((*opt)->Step(t, args).ok());
    std::vector<float> mf(n), vf(n);
    ASSERT_TRUE(ConvertCpuArray(mb.data(), CpuDType::kBFloat16, mf.data(),
                                CpuDType::kFloat32, n)
                    .ok());
    ASSERT_TRUE(ConvertCpuArray(vb.data(), CpuDType::kBFloat16, vf.data(),
                                CpuDType::kFloat32, n)
                    .ok());
    for (size_t i = 0; i < n; ++i) {
      if (algo == CpuOptimizerAlgo::kAdam || algo == CpuOptimizerAlgo::kAdamW) {
        // The step moves by an ulp or two of itself, and the weight's
        // rounding by at most one of its own.
        const auto ulp = [](float x) {
          return std::nextafter(std::fabs(x), INFINITY) - std::fabs(x);
        };
        EXPECT_LE(std::fabs(pb[i] - p[i]), 2 * ulp(p[i] - p0[i]) + ulp(p[i]))
            << i;
      } else {
        EXPECT_EQ(pb[i], p[i]);
      }
      if (algo != CpuOptimizerAlgo::kAdagrad) {
        EXPECT_NEAR(mf[i], m[i], 1e-2 * std::fabs(m[i]));
      }
      if (algo != CpuOptimizerAlgo::kLion) {
        EXPECT_NEAR(vf[i], v[i], 1e-2 * std::fabs(v[i]));
      }
    }
  }
}

TEST(CpuAdamTest, RejectsBadArgumentsAndUnsupportedVariants) {
  CpuOptimizerOptions o;
  o.beta1 = 1.0;
  EXPECT_EQ(NewCpuOptimizer(o).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.eps = -1;
  EXPECT_EQ(NewCpuOptimizer(o).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.threads = -1;
  EXPECT_EQ(NewCpuOptimizer(o).status().code(), StatusCode::kInvalidArgument);
  for (CpuKernelVariant v : {CpuKernelVariant::kAvx2, CpuKernelVariant::kAvx512,
                             CpuKernelVariant::kAvx512Bf16}) {
    o = {};
    o.variant = v;
    auto opt = NewCpuOptimizer(o);
    if (CpuKernelVariantSupported(v)) {
      ASSERT_TRUE(opt.ok());
      EXPECT_EQ((*opt)->variant(), v);
    } else {
      EXPECT_EQ(opt.status().code(), StatusCode::kNotSupported);
    }
  }

  auto opt = NewCpuOptimizer({});
  ASSERT_TRUE(opt.ok());
  Problem p(16, 0, CpuDType::kFloat32, CpuDType::kFloat32, false,
            CpuDType::kBFloat16, 1);
  CpuOptimizerTensors t = p.View();
  t.exp_avg_sq = nullptr;
  EXPECT_EQ((*opt)->Step(t, {}).status().code(), StatusCode::kInvalidArgument);
  t = p.View();
  t.moment_dtype = CpuDType::kFloat16;
  EXPECT_EQ((*opt)->Step(t, {}).status().code(), StatusCode::kInvalidArgument);
  t = p.View();
  CpuStepArgs args;
  args.step = 0;
  EXPECT_EQ((*opt)->Step(t, args).status().code(),
            StatusCode::kInvalidArgument);
  args = {};
  args.lr = std::nan("");
  EXPECT_EQ((*opt)->Step(t, args).status().code(),
            StatusCode::kInvalidArgument);
  args = {};
  args.inv_loss_scale = 0;
  EXPECT_EQ((*opt)->Step(t, args).status().code(),
            StatusCode::kInvalidArgument);
  t.master = reinterpret_cast<float*>(reinterpret_cast<char*>(t.master) + 1);
  EXPECT_EQ((*opt)->Step(t, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->PlaceOnNumaNodes(p.master.data(), 4, 16).code(),
            StatusCode::kOk);
}

TEST(CpuAdamTest, EnvironmentForcesTheVariant) {
  ASSERT_EQ(setenv("STRATA_CPU_ADAM_VARIANT", "scalar", 1), 0);
  auto opt = NewCpuOptimizer({});
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->variant(), CpuKernelVariant::kScalar);
  CpuOptimizerOptions explicit_choice;
  explicit_choice.variant = BestCpuKernelVariant();
  auto opt2 = NewCpuOptimizer(explicit_choice);  // Options win over the env
  ASSERT_TRUE(opt2.ok());
  EXPECT_EQ((*opt2)->variant(), BestCpuKernelVariant());
  ASSERT_EQ(setenv("STRATA_CPU_ADAM_VARIANT", "avx9000", 1), 0);
  EXPECT_EQ(NewCpuOptimizer({}).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(unsetenv("STRATA_CPU_ADAM_VARIANT"), 0);
  auto opt3 = NewCpuOptimizer({});
  ASSERT_TRUE(opt3.ok());
  EXPECT_EQ((*opt3)->variant(), BestCpuKernelVariant());
  EXPECT_EQ(ParseCpuKernelVariant("avx512bf16").value(),
            CpuKernelVariant::kAvx512Bf16);
}

}  // namespace
}  // namespace strata
