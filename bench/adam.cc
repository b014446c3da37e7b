// strata-bench adam: throughput of the fused CPU optimizer beside the
// machine's bound measured in the same run.
//
// For each thread count T and moment dtype, each repetition times
//   bound  a streaming kernel over the same arrays with the same access
//          pattern as the optimizer (master, grad, m, v read; master, m, v
//          written in place; the 16-bit working copy written once with
//          non-temporal stores) and trivial integer arithmetic;
//   step   one CpuOptimizer::Step per variant over all N parameters;
// and the best repetition of each is kept (other jobs share the machine;
// the best run is the one least disturbed). ratio_to_bound =
// time(bound) / time(step). The separate gradient-statistics pass (squared
// norm + inf/nan) is timed too. When a python3 with torch is found, the
// same N parameters go through torch.optim.Adam for its figure.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "cpu_adam/kernels.h"
#include "strata/cpu_adam.h"
#include "strata/host_buffer.h"
#include "util/find_python.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// torch.optim.Adam on N fp32 parameters with T intra-op threads; prints
// {"params_per_s": best over reps}.
constexpr const char* kTorchScript = R"PY(
import json, sys, time
import torch
n, threads, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
p = torch.nn.Parameter(torch.full((n,), 0.5))
p.grad = torch.full((n,), 0.01)
opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
opt.step()
best = float("inf")
for _ in range(reps):
    t0 = time.perf_counter()
    opt.step()
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"params_per_s": n / best, "torch": torch.__version__}))
)PY";

// Runs the torch script; nullopt (and a note on stderr) on any failure.
std::optional<nlohmann::json> RunTorch(const std::string& py, uint64_t n,
                                       int threads, int reps) {
  char path[] = "/tmp/strata_adam_torch_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return std::nullopt;
  const size_t len = std::strlen(kTorchScript);
  const bool wrote = write(fd, kTorchScript, len) == static_cast<ssize_t>(len);
  close(fd);
  std::optional<nlohmann::json> out;
  if (wrote) {
    const std::string cmd = py + " " + path + " " + std::to_string(n) + " " +
                            std::to_string(threads) + " " +
                            std::to_string(reps);
    if (FILE* p = popen(cmd.c_str(), "r")) {
      std::string text;
      char buf[512];
      while (std::fgets(buf, sizeof(buf), p) != nullptr) text += buf;
      if (pclose(p) == 0) {
        out = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (out->is_discarded()) out.reset();
      }
    }
  }
  unlink(path);
  if (!out) std::fprintf(stderr, "adam: the torch run failed; no figure\n");
  return out;
}

struct Arrays {
  HostBuffer master, grad, m32, v32, m16, v16, working;
};

StatusOr<HostBuffer> Alloc(size_t bytes) {
  HostBufferOptions o;
  o.pin = false;  // pinning 5 GB is not the point here; THP still applies
  return HostBuffer::Allocate(bytes, o);
}

// Fills `b` with the 32- or 16-bit pattern `bits` (first-touch on the
// calling thread).
void Fill(HostBuffer& b, uint32_t bits, size_t elem_size) {
  if (elem_size == 4) {
    std::fill_n(reinterpret_cast<uint32_t*>(b.data()), b.size() / 4, bits);
  } else {
    std::fill_n(reinterpret_cast<uint16_t*>(b.data()), b.size() / 2,
                static_cast<uint16_t>(bits));
  }
}

int RunAdam(int argc, char** argv) {
  CLI::App app{"fused CPU optimizer throughput beside the in-run bound",
               "strata-bench adam"};
  std::string params_s = "256M", threads_s, variants_s, moments_s = "fp32,bf16";
  std::string algo_s = "adamw", working_s = "bf16", grad_s = "fp32";
  std::string json_path, torch_s = "auto";
  int reps = 5;
  app.add_option("--params", params_s,
                 "parameters per step, K/M/G suffixes (default 256M)");
  app.add_option("--threads", threads_s,
                 "comma-separated thread counts (default 1..all cores)");
  app.add_option("--variants", variants_s,
                 "scalar,avx2,avx512,avx512bf16 (default: all supported)");
  app.add_option("--moments", moments_s, "moment dtypes: fp32,bf16");
  app.add_option("--optimizer", algo_s, "adam, adamw, adagrad or lion");
  app.add_option("--working", working_s, "working copy: bf16, fp16 or none");
  app.add_option("--grad", grad_s, "gradient dtype: fp32, fp16 or bf16");
  app.add_option("--reps", reps, "timed repetitions; the best is kept");
  app.add_option("--json", json_path, "write results as JSON to FILE");
  app.add_option("--torch", torch_s, "torch.optim.Adam figure: auto, off");
  CLI11_PARSE(app, argc, argv);

  auto n_or = ParseSize(params_s);
  if (!n_or.ok() || *n_or == 0) {
    std::fprintf(stderr, "adam: bad --params '%s'\n", params_s.c_str());
    return 2;
  }
  const uint64_t n = *n_or;
  std::vector<int> threads;
  if (threads_s.empty()) {
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    for (int t = 1; t <= std::max(1L, cpus); ++t) threads.push_back(t);
  } else {
    for (const std::string& t : SplitList(threads_s)) {
      threads.push_back(std::max(1, std::atoi(t.c_str())));
    }
  }
  std::vector<CpuKernelVariant> variants;
  if (variants_s.empty()) {
    for (CpuKernelVariant v :
         {CpuKernelVariant::kScalar, CpuKernelVariant::kAvx2,
          CpuKernelVariant::kAvx512, CpuKernelVariant::kAvx512Bf16}) {
      if (CpuKernelVariantSupported(v)) variants.push_back(v);
    }
  } else {
    for (const std::string& s : SplitList(variants_s)) {
      auto v = ParseCpuKernelVariant(s);
      if (!v.ok() || !CpuKernelVariantSupported(*v)) {
        std::fprintf(stderr, "adam: variant '%s' unknown or unsupported\n",
                     s.c_str());
        return 2;
      }
      variants.push_back(*v);
    }
  }
  auto dtype_of = [](const std::string& s) -> std::optional<CpuDType> {
    if (s == "fp32") return CpuDType::kFloat32;
    if (s == "fp16") return CpuDType::kFloat16;
    if (s == "bf16") return CpuDType::kBFloat16;
    return std::nullopt;
  };
  std::vector<CpuDType> moments;
  for (const std::string& s : SplitList(moments_s)) {
    auto d = dtype_of(s);
    if (!d || *d == CpuDType::kFloat16) {
      std::fprintf(stderr, "adam: moments are fp32 or bf16\n");
      return 2;
    }
    moments.push_back(*d);
  }
  const auto grad_dtype = dtype_of(grad_s);
  const bool has_working = working_s != "none";
  const auto working_dtype = has_working ? dtype_of(working_s) : CpuDType{};
  if (!grad_dtype || (has_working && (!working_dtype ||
                                      *working_dtype == CpuDType::kFloat32))) {
    std::fprintf(stderr, "adam: bad --grad or --working\n");
    return 2;
  }
  CpuOptimizerAlgo algo;
  if (algo_s == "adam") {
    algo = CpuOptimizerAlgo::kAdam;
  } else if (algo_s == "adamw") {
    algo = CpuOptimizerAlgo::kAdamW;
  } else if (algo_s == "adagrad") {
    algo = CpuOptimizerAlgo::kAdagrad;
  } else if (algo_s == "lion") {
    algo = CpuOptimizerAlgo::kLion;
  } else {
    std::fprintf(stderr, "adam: unknown --optimizer '%s'\n", algo_s.c_str());
    return 2;
  }
  const bool uses_m = algo != CpuOptimizerAlgo::kAdagrad;
  const bool uses_v = algo != CpuOptimizerAlgo::kLion;
  reps = std::max(1, reps);

  // ---- Arrays -------------------------------------------------------------
  const size_t gsize = *grad_dtype == CpuDType::kFloat32 ? 4 : 2;
  Arrays a;
  for (auto [buf, bytes] :
       {std::pair{&a.master, n * 4}, std::pair{&a.grad, n * gsize},
        std::pair{&a.m32, n * 4}, std::pair{&a.v32, n * 4},
        std::pair{&a.m16, n * 2}, std::pair{&a.v16, n * 2},
        std::pair{&a.working, has_working ? n * 2 : 0}}) {
    auto b = Alloc(bytes);
    if (!b.ok()) return Fail("adam", b.status());
    *buf = std::move(b).value();
  }
  std::fprintf(
      stderr, "adam: %llu parameters, %s of arrays; filling\n",
      static_cast<unsigned long long>(n),
      FormatBytes(a.master.size() + a.grad.size() + a.m32.size() +
                  a.v32.size() + a.m16.size() + a.v16.size() + a.working.size())
          .c_str());
  Fill(a.master, 0x3f000000u, 4);                           // 0.5
  Fill(a.grad, gsize == 4 ? 0x3c23d70au : 0x3c24u, gsize);  // ~0.01
  Fill(a.m32, 0, 4);
  Fill(a.v32, 0, 4);
  Fill(a.m16, 0, 2);
  Fill(a.v16, 0, 2);
  if (has_working) Fill(a.working, 0, 2);

  // ---- Measurements -------------------------------------------------------
  nlohmann::json results = nlohmann::json::array();
  Table table({"optimizer", "variant", "threads", "moments", "Gparams/s",
               "GB/s", "bound GB/s", "ratio"});
  Progress progress(threads.size() * moments.size());
  int64_t step = 0;
  std::vector<std::pair<int, double>> best_fp32;  // threads -> params/s
  for (int t : threads) {
    std::vector<std::unique_ptr<CpuOptimizer>> opts;
    for (CpuKernelVariant v : variants) {
      CpuOptimizerOptions o;
      o.algo = algo;
      o.variant = v;
      o.threads = t;
      o.weight_decay = 0.01;
      auto opt = NewCpuOptimizer(o);
      if (!opt.ok()) return Fail("adam", opt.status());
      opts.push_back(std::move(opt).value());
    }
    // The bound runs with the fastest variant's kernel on the same threads.
    CpuOptimizerOptions bo;
    bo.threads = t;
    auto bound_opt = NewCpuOptimizer(bo);
    if (!bound_opt.ok()) return 1;
    double fp32_rate = 0;
    for (CpuDType mom : moments) {
      progress.Step("threads " + std::to_string(t));
      const bool m16 = mom == CpuDType::kBFloat16;
      const size_t msize = m16 ? 2 : 4;
      CpuOptimizerTensors tensors;
      tensors.n = n;
      tensors.master = reinterpret_cast<float*>(a.master.data());
      tensors.grad = a.grad.data();
      tensors.grad_dtype = *grad_dtype;
      tensors.exp_avg = (m16 ? a.m16 : a.m32).data();
      tensors.exp_avg_sq = (m16 ? a.v16 : a.v32).data();
      tensors.moment_dtype = mom;
      tensors.working = has_working ? a.working.data() : nullptr;
      if (has_working) tensors.working_dtype = *working_dtype;
      cpu_adam::BoundArrays ba{tensors.master,
                               tensors.grad,
                               tensors.exp_avg,
                               tensors.exp_avg_sq,
                               reinterpret_cast<uint16_t*>(tensors.working),
                               static_cast<int>(gsize),
                               static_cast<int>(msize)};
      // Bytes one parameter moves: master read+write, grad read, each used
      // moment read+write, working copy written.
      const double bytes_per_param = 8.0 + gsize + (uses_m ? 2.0 * msize : 0) +
                                     (uses_v ? 2.0 * msize : 0) +
                                     (has_working ? 2.0 : 0);
      const double bound_bytes_per_param =
          8.0 + gsize + 4.0 * msize + (has_working ? 2.0 : 0);
      CpuStepArgs args;
      args.lr = 1e-5;
      args.check_overflow = false;  // the fused pass alone; stats timed apart
      std::vector<double> best(variants.size(), 1e30);
      double best_bound = 1e30, best_stats = 1e30;
      for (int r = 0; r <= reps; ++r) {  // r == 0 warms up
        auto t0 = Clock::now();
        cpu_adam::RunBoundKernel(**bound_opt, ba, n);
        auto t1 = Clock::now();
        if (r > 0) best_bound = std::min(best_bound, Seconds(t0, t1));
        for (size_t k = 0; k < variants.size(); ++k) {
          args.step = ++step;
          t0 = Clock::now();
          auto res = opts[k]->Step(tensors, args);
          t1 = Clock::now();
          if (!res.ok() || !res->applied) {
            std::fprintf(stderr, "adam: step failed\n");
            return 1;
          }
          if (r > 0) best[k] = std::min(best[k], Seconds(t0, t1));
        }
        t0 = Clock::now();
        auto stats =
            (*bound_opt)->ComputeGradStats(tensors.grad, *grad_dtype, n, 1.0);
        t1 = Clock::now();
        if (!stats.ok()) return 1;
        if (r > 0) best_stats = std::min(best_stats, Seconds(t0, t1));
      }
      const double bound_gbps = n * bound_bytes_per_param / best_bound / 1e9;
      const char* mom_name = m16 ? "bf16" : "fp32";
      for (size_t k = 0; k < variants.size(); ++k) {
        const double pps = n / best[k];
        const double gbps = pps * bytes_per_param / 1e9;
        // The bound kernel streams both moments: it is the bound of Adam
        // and AdamW only.
        const bool bounded = uses_m && uses_v;
        const double ratio = best_bound / best[k];
        nlohmann::json row = {
            {"optimizer", algo_s},
            {"variant", std::string(CpuKernelVariantName(variants[k]))},
            {"threads", t},
            {"params", n},
            {"moment_dtype", mom_name},
            {"grad_dtype", grad_s},
            {"working_dtype", working_s},
            {"bytes_per_param", bytes_per_param},
            {"seconds", best[k]},
            {"params_per_s", pps},
            {"gbps", gbps},
            {"bound_gbps", bound_gbps},
            {"bound_seconds", best_bound},
            {"ratio_to_bound", bounded ? nlohmann::json(ratio) : nullptr}};
        if (variants[k] == BestCpuKernelVariant()) {
          if (!m16) fp32_rate = pps;
          if (m16 && fp32_rate > 0) {
            row["speedup_vs_fp32_moments"] = pps / fp32_rate;
          }
        }
        results.push_back(row);
        table.AddRow({algo_s, row["variant"], std::to_string(t), mom_name,
                      Fixed(pps / 1e9, 3), Fixed(gbps, 1), Fixed(bound_gbps, 1),
                      bounded ? Fixed(ratio, 3) : "-"});
      }
      const double stats_gbps = n * gsize / best_stats / 1e9;
      results.push_back({{"optimizer", "grad_stats"},
                         {"variant", std::string(CpuKernelVariantName(
                                         (*bound_opt)->variant()))},
                         {"threads", t},
                         {"params", n},
                         {"moment_dtype", mom_name},
                         {"params_per_s", n / best_stats},
                         {"gbps", stats_gbps},
                         {"bound_gbps", nullptr},
                         {"ratio_to_bound", nullptr}});
      table.AddRow({"grad_stats",
                    std::string(CpuKernelVariantName((*bound_opt)->variant())),
                    std::to_string(t), "-", Fixed(n / best_stats / 1e9, 3),
                    Fixed(stats_gbps, 1), "-", "-"});
    }
    best_fp32.emplace_back(t, fp32_rate);
  }

  // ---- torch ----------------------------------------------------------------
  a = Arrays{};  // give the memory back before torch allocates its own
  std::string py;
  if (torch_s != "off") py = FindPythonWith("torch");
  if (py.empty() && torch_s != "off") {
    std::fprintf(stderr, "adam: no python3 with torch; no torch figure\n");
  }
  if (!py.empty()) {
    for (auto [t, ours] : best_fp32) {
      auto out = RunTorch(py, n, t, std::min(reps, 3));
      if (!out || !out->contains("params_per_s")) continue;
      const double pps = (*out)["params_per_s"].get<double>();
      nlohmann::json row = {
          {"optimizer", "torch.optim.Adam"},
          {"variant", "torch " + (*out)["torch"].get<std::string>()},
          {"threads", t},
          {"params", n},
          {"moment_dtype", "fp32"},
          {"params_per_s", pps},
          {"gbps", pps * 28 / 1e9},
          {"bound_gbps", nullptr},
          {"ratio_to_bound", nullptr}};
      if (ours > 0) row["strata_speedup"] = ours / pps;
      results.push_back(row);
      table.AddRow({"torch.Adam", "torch", std::to_string(t), "fp32",
                    Fixed(pps / 1e9, 3), Fixed(pps * 28 / 1e9, 1), "-",
                    ours > 0 ? "x" + Fixed(ours / pps, 2) + " strata" : "-"});
    }
  }

  std::printf(
      "strata-bench adam: %llu params, grad %s, working %s, best of "
      "%d\n%s",
      static_cast<unsigned long long>(n), grad_s.c_str(), working_s.c_str(),
      reps, table.ToString().c_str());
  if (!json_path.empty()) {
    nlohmann::json j = {{"command", "adam"},
                        {"machine", MachineInfo()},
                        {"config",
                         {{"params", n},
                          {"optimizer", algo_s},
                          {"grad_dtype", grad_s},
                          {"working_dtype", working_s},
                          {"reps", reps}}},
                        {"results", results}};
    if (Status s = WriteJson(json_path, j); !s.ok()) return Fail("adam", s);
  }
  return 0;
}

}  // namespace

STRATA_BENCH_COMMAND("adam", "fused CPU optimizer vs in-run bandwidth bound",
                     RunAdam);

}  // namespace strata::bench
