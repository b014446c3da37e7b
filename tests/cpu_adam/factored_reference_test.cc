// Adafactor and SM3 against tests/cpu_adam/factored_reference.py, an
// independent NumPy implementation of the published algorithms (Adafactor
// as HF transformers implements it): the same random initial weights and
// 60 steps of the same random gradients, on matrices of one and several
// tiles and on vectors. Skips without a python3 that imports numpy.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "strata/cpu_adam.h"
#include "tests/cpu_adam/test_util.h"
#include "util/find_python.h"

#ifndef STRATA_FACTORED_SCRIPT
#error "STRATA_FACTORED_SCRIPT must name factored_reference.py"
#endif

namespace strata {
namespace {

using cpu_adam_test::ReadFloats;
using cpu_adam_test::WriteFloats;

struct Case {
  const char* name;
  CpuOptimizerAlgo algo;
  size_t rows, cols;  // rows 0: a vector of cols elements
  // Options as the script's KEY=VALUE arguments, and applied to `o`.
  std::vector<std::pair<std::string, double>> kw;
};

CpuOptimizerOptions OptionsOf(const Case& c, double* lr) {
  CpuOptimizerOptions o;
  o.algo = c.algo;
  o.threads = 2;
  o.tile_elems = 2048;  // several bands and strips
  o.beta1 = 0.0;
  *lr = c.algo == CpuOptimizerAlgo::kSm3 ? 0.1 : 1e-2;
  for (const auto& [k, v] : c.kw) {
    if (k == "beta1") o.adafactor.beta1 = v;
    if (k == "weight_decay") o.weight_decay = v;
    if (k == "relative_step") o.adafactor.relative_step = v != 0;
    if (k == "scale_parameter") o.adafactor.scale_parameter = v != 0;
    if (k == "clip_threshold") o.adafactor.clip_threshold = v;
    if (k == "lr") *lr = v;
    if (k == "momentum") o.beta1 = v;
    if (k == "eps") o.eps = v;
  }
  return o;
}

class FactoredReferenceTest : public ::testing::TestWithParam<Case> {};

// Per element |ours - numpy| <= 2e-5 |numpy| (weights; statistics where
// numpy's value is a normal float; the first moment relative to
// max(|numpy|, its RMS)). Both do the
// element-wise arithmetic in float32 and reductions in float64, but in
// different orders and with a few different roundings (strata multiplies
// by lr / clip once where HF divides and multiplies), so the weights drift
// apart by float rounding only: measured about 1e-6 after 60 steps.
TEST_P(FactoredReferenceTest, SixtySteps) {
  const std::string py = FindPythonWith("numpy");
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy found";
  const Case& c = GetParam();
  constexpr int kSteps = 60;
  const size_t r = c.rows == 0 ? 1 : c.rows;
  const size_t n = r * c.cols;
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> init(n), grads(n * kSteps);
  for (float& w : init) {
    const float x = normal(rng);
    w = x >= 0 ? x + 0.5f : x - 0.5f;
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    // Rows and columns of different scales, so factoring matters.
    const size_t e = i % n, row = e / c.cols, col = e % c.cols;
    grads[i] = normal(rng) * (1.0f + static_cast<float>(row % 3)) *
               (col % 4 == 0 ? 0.1f : 1.0f);
  }
  char tmpl[] = "/tmp/strata_factored_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir(tmpl);
  WriteFloats(dir / "init.f32", init);
  WriteFloats(dir / "grads.f32", grads);
  std::string cmd = py + " " + STRATA_FACTORED_SCRIPT + " " + dir.string() +
                    " " + std::string(CpuOptimizerAlgoName(c.algo)) + " " +
                    std::to_string(c.rows) + " " + std::to_string(c.cols) +
                    " " + std::to_string(kSteps);
  for (const auto& [k, v] : c.kw) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s=%.17g", k.c_str(), v);
    cmd += buf;
  }
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const size_t nstats = r + c.cols;
  const std::vector<float> rp = ReadFloats(dir / "param.f32", n);
  const std::vector<float> rs = ReadFloats(dir / "stats.f32", nstats);
  const std::vector<float> rm = ReadFloats(dir / "exp_avg.f32", n);
  std::filesystem::remove_all(dir);

  double lr = 0;
  const CpuOptimizerOptions o = OptionsOf(c, &lr);
  auto opt = NewCpuOptimizer(o);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  std::vector<float> p = init, m(n, 0.0f), stats(nstats, 0.0f);
  for (int s = 0; s < kSteps; ++s) {
    CpuOptimizerTensors t;
    t.n = n;
    t.rows = c.rows;
    t.cols = c.cols;
    t.master = p.data();
    t.grad = grads.data() + s * n;
    t.exp_avg = m.data();
    t.exp_avg_sq = stats.data();
    CpuStepArgs args;
    args.step = s + 1;
    args.lr = lr;
    auto res = (*opt)->Step(t, args);
    ASSERT_TRUE(res.ok() && res->applied) << res.status().ToString();
  }
  // The first moment sums updates of both signs: an element near zero
  // has no meaningful relative error, so its floor is the array's RMS.
  double m_rms = 0;
  for (float x : rm) m_rms += static_cast<double>(x) * x;
  m_rms = std::sqrt(m_rms / static_cast<double>(n));
  auto rel = [](float ours, float want, double floor) {
    return std::fabs(static_cast<double>(ours) - want) /
           std::max<double>(std::fabs(want), floor);
  };
  double ep = 0, es = 0, em = 0;
  for (size_t i = 0; i < n; ++i) {
    ep = std::max(ep, rel(p[i], rp[i], 0.0));
    em = std::max(em, rel(m[i], rm[i], m_rms + 1e-30));
  }
  for (size_t i = 0; i < nstats; ++i) {
    if (std::isnormal(rs[i])) es = std::max(es, rel(stats[i], rs[i], 0.0));
  }
  std::printf("%s: max rel err param %.3g stats %.3g exp_avg %.3g\n", c.name,
              ep, es, em);
  EXPECT_LE(ep, 2e-5);
  EXPECT_LE(es, 2e-5);
  EXPECT_LE(em, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    AdafactorAndSm3, FactoredReferenceTest,
    ::testing::Values(
        Case{"adafactor_defaults_matrix",
             CpuOptimizerAlgo::kAdafactor,
             67,
             300,
             {}},
        Case{"adafactor_beta1_wd_fixed_lr",
             CpuOptimizerAlgo::kAdafactor,
             3,
             5000,
             {{"beta1", 0.9},
              {"weight_decay", 0.01},
              {"relative_step", 0},
              {"scale_parameter", 0},
              {"lr", 1e-2}}},
        Case{"adafactor_vector", CpuOptimizerAlgo::kAdafactor, 0, 3001, {}},
        Case{"adafactor_clip_0.5",
             CpuOptimizerAlgo::kAdafactor,
             40,
             41,
             {{"clip_threshold", 0.5}}},
        // Rows too wide for the fused RMS: the RMS pass of its own.
        Case{"adafactor_wide_rows_clip_0.5",
             CpuOptimizerAlgo::kAdafactor,
             2,
             kCpuAdafactorFusedRowCols + 7,
             {{"clip_threshold", 0.5}}},
        Case{"sm3_matrix", CpuOptimizerAlgo::kSm3, 67, 300, {}},
        Case{"sm3_momentum_wd",
             CpuOptimizerAlgo::kSm3,
             3,
             5000,
             {{"momentum", 0.9}, {"weight_decay", 0.01}}},
        Case{"sm3_vector", CpuOptimizerAlgo::kSm3, 0, 3001, {{"eps", 1e-6}}}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string s = param_info.param.name;
      for (char& ch : s) {
        if (ch == '.') ch = '_';
      }
      return s;
    });

}  // namespace
}  // namespace strata
