// strata-bench adam: throughput of the fused CPU optimizer beside the
// machine's bound measured in the same run.
//
// For each thread count T, optimizer and moment dtype, each repetition times
//   bounds three streaming kernels over the same arrays, the same bytes and
//          store kinds as the optimizer and no arithmetic (bench/bound.h):
//          "fused" (all arrays in one pass, as a Step), "fused_prefetch"
//          (the same, prefetching ahead) and "stream" (one STREAM-style
//          loop per array), always with the widest ISA the CPU reports, on
//          T threads split as a Step splits, each pass of a multi-pass
//          step (Adafactor) timed apart and bounded by its fastest kernel;
//   step   one CpuOptimizer::Step per variant over all N parameters;
// and the best repetition of each is kept (other jobs share the machine;
// the best run is the one least disturbed); rows over the same arrays share
// the best of all their bound samples (ShareBound). ratio_to_bound =
// time(bound) / time(step), each the best of all repetitions;
// paired_ratio_to_bound is the median over the repetitions of each one's
// bound over its own step, which the host's drift from one repetition to
// the next moves less. Each row of the Adam family also runs on one thread
// over arrays that fit in L2, for its arithmetic ceiling (Note [The
// in-cache rate]). The separate gradient-statistics pass
// (squared norm + inf/nan) is timed too. When a python3 with torch is found,
// the same N parameters go through torch.optim.Adam for its figure.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/bound.h"
#include "strata/cpu_adam.h"
#include "strata/host_buffer.h"
#include "util/find_python.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCommand = "adam";
constexpr uint64_t kMaxParams = uint64_t{1} << 40;
constexpr int64_t kMaxThreads = 4096;
constexpr int64_t kMaxReps = 1000;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// torch.optim.Adam on N fp32 parameters with T intra-op threads; prints
// {"params_per_s": best over reps}. Run with `python3 -c` and its numbers
// as arguments: no file, no shell.
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

// The command line as typed.
struct AdamFlags {
  std::string params = "256M";
  std::string threads;
  std::string variants;
  std::string moments = "fp32,bf16";
  std::string optimizer = "adamw";
  std::string cols = "4096";
  std::string working = "bf16";
  std::string grad = "fp32";
  std::string scale_parameter = "on";
  std::string carry_param_sq = "on";
  std::string block8_sweeps = "auto";
  std::string reps = "5";
  std::string json;
  std::string torch = "auto";
};

struct AdamConfig {
  uint64_t n = 0;
  std::vector<int> threads;  // 0 = all CPUs the process may use
  std::vector<CpuKernelVariant> variants;
  std::vector<CpuDType> moments;
  std::vector<CpuOptimizerAlgo> algos;
  // Adafactor and SM3: the matrix is (n / cols) x cols; 0 = a vector.
  uint64_t cols = 4096;
  std::string grad_name;
  CpuDType grad = CpuDType::kFloat32;
  std::string working_name;
  bool has_working = true;
  CpuDType working = CpuDType::kBFloat16;
  // Adafactor: the step scaled by the weights' RMS (the statistics pass
  // then reads the weights too).
  bool scale_parameter = true;
  // Adafactor with scale_parameter: each step is handed the weights' sum of
  // squares the last step returned (CpuStepArgs::param_sq), as a training
  // loop that owns its weights does, and its statistics pass reads the
  // gradient alone.
  bool carry_param_sq = true;
  // int8 moments: CpuOptimizerOptions::block8_sweeps (0 = each variant's
  // own).
  int block8_sweeps = 0;
  int reps = 5;
  bool torch = true;
  std::string json;

  size_t grad_bytes() const { return grad == CpuDType::kFloat32 ? 4 : 2; }
  // Bytes of all arrays: master, grad, the moments of each dtype asked
  // for, working copy.
  uint64_t array_bytes() const {
    uint64_t b = n * (4 + grad_bytes() + (has_working ? 2 : 0));
    for (CpuDType m : moments) b += 2 * CpuStateBytes(m, n);
    return b + stats_bytes();
  }
  // Whether --optimizer asked for `a`.
  bool measures(CpuOptimizerAlgo a) const {
    return std::find(algos.begin(), algos.end(), a) != algos.end();
  }
  bool factored() const {
    return std::any_of(algos.begin(), algos.end(), CpuOptimizerIsFactored);
  }
  // Adafactor's and SM3's row and column statistics.
  uint64_t stats_bytes() const {
    if (!factored()) return 0;
    return cols == 0 ? (n + 1) * 4 : (n / cols + cols) * 4;
  }
};

struct AdamOutcome {
  nlohmann::json results = nlohmann::json::array();
  Table table{{"optimizer", "variant", "threads", "moments", "Gparams/s",
               "GB/s", "bound GB/s", "ratio", "paired", "B/param",
               "cache Gp/s"}};
  // Against fp32-moment AdamW (AddSpeedups); no rows without that row.
  Table speedups{{"optimizer", "variant", "threads", "moments", "vs fp32 adamw",
                  "bounds allow", "bytes allow"}};
  // Each pass of a multi-pass step (Adafactor) against its own bound.
  Table passes{{"optimizer", "variant", "threads", "pass", "B/param", "GB/s",
                "bound GB/s", "ratio", "paired"}};
  // Every row's and pass's ratio to its bound, for PrintAboveOneNote.
  std::vector<RatioFigure> figures;
};

// ---- Parse -----------------------------------------------------------------

void AddOptions(CLI::App& app, AdamFlags& f) {
  app.add_option("--params", f.params,
                 "parameters per step, K/M/G/T suffixes (default 256M)");
  app.add_option("--threads", f.threads,
                 "comma-separated thread counts, 0 = all CPUs (default "
                 "1..all CPUs)");
  app.add_option("--variants", f.variants,
                 "scalar,avx2,avx512,avx512bf16 (default: all supported)");
  app.add_option("--moments", f.moments,
                 "moment dtypes: fp32,bf16,int8 (int8: 8-bit block states)");
  app.add_option("--optimizer", f.optimizer,
                 "comma-separated: adam, adamw, adagrad, lion, adafactor, sm3 "
                 "(default adamw)");
  app.add_option("--cols", f.cols,
                 "adafactor and sm3: columns of the (params / cols) x cols "
                 "matrix, 0 = a vector (default 4096)");
  app.add_option("--working", f.working, "working copy: bf16, fp16 or none");
  app.add_option("--grad", f.grad, "gradient dtype: fp32, fp16 or bf16");
  app.add_option("--scale-parameter", f.scale_parameter,
                 "adafactor: scale the step by the weights' RMS, on (the "
                 "default) or off");
  app.add_option("--carry-param-sq", f.carry_param_sq,
                 "adafactor with --scale-parameter on: hand each step the "
                 "weights' sum of squares the last one returned, on (the "
                 "default) or off (the statistics pass reads the weights)");
  app.add_option(
      "--block8-sweeps", f.block8_sweeps,
      "int8 moments: the update's sweeps over each block, auto (each "
      "variant's own, the default), 1 or 2");
  app.add_option("--reps", f.reps,
                 "timed repetitions, 1..1000; the best is kept (default 5)");
  app.add_option("--json", f.json, "write results as JSON to FILE");
  app.add_option("--torch", f.torch, "torch.optim.Adam figure: auto, off");
}

CpuDType DTypeOf(const std::string& s) {
  return s == "fp32"   ? CpuDType::kFloat32
         : s == "fp16" ? CpuDType::kFloat16
         : s == "int8" ? CpuDType::kBlock8
                       : CpuDType::kBFloat16;
}

const char* MomentName(CpuDType m) {
  return m == CpuDType::kFloat32  ? "fp32"
         : m == CpuDType::kBlock8 ? "int8"
                                  : "bf16";
}

StatusOr<AdamConfig> ParseAdam(const AdamFlags& f) {
  AdamConfig cfg;
  STRATA_ASSIGN_OR_RETURN(cfg.n,
                          ParseSizeOption("--params", f.params, 1, kMaxParams));
  const int cpus = UsableCpus();
  if (f.threads.empty()) {
    for (int t = 1; t <= cpus; ++t) cfg.threads.push_back(t);
  } else {
    STRATA_ASSIGN_OR_RETURN(
        std::vector<int64_t> ts,
        ParseIntListOption("--threads", f.threads, 0, kMaxThreads));
    for (int64_t t : ts) {
      if (t > cpus) {
        return Status::InvalidArgument(
            "--threads: " + std::to_string(t) + " is more than the " +
            std::to_string(cpus) + " CPUs this process may use (accepted 0.." +
            std::to_string(cpus) + "; 0 = all of them)");
      }
      cfg.threads.push_back(static_cast<int>(t));
    }
  }
  if (f.variants.empty()) {
    for (CpuKernelVariant v :
         {CpuKernelVariant::kScalar, CpuKernelVariant::kAvx2,
          CpuKernelVariant::kAvx512, CpuKernelVariant::kAvx512Bf16}) {
      if (CpuKernelVariantSupported(v)) cfg.variants.push_back(v);
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(
        auto names,
        ParseChoiceListOption("--variants", f.variants,
                              {"scalar", "avx2", "avx512", "avx512bf16"}));
    for (const auto& s : names) {
      STRATA_ASSIGN_OR_RETURN(CpuKernelVariant v, ParseCpuKernelVariant(s));
      if (!CpuKernelVariantSupported(v)) {
        return Status::InvalidArgument("--variants: " + s +
                                       " needs instructions this CPU does not "
                                       "report");
      }
      cfg.variants.push_back(v);
    }
  }
  STRATA_ASSIGN_OR_RETURN(
      auto moments,
      ParseChoiceListOption("--moments", f.moments, {"fp32", "bf16", "int8"}));
  for (const auto& m : moments) cfg.moments.push_back(DTypeOf(m));
  std::string lower = f.optimizer;
  for (char& ch : lower) {
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  STRATA_ASSIGN_OR_RETURN(
      auto algos, ParseChoiceListOption("--optimizer", lower,
                                        {"adam", "adamw", "adagrad", "lion",
                                         "adafactor", "sm3"}));
  for (const auto& a : algos) {
    STRATA_ASSIGN_OR_RETURN(CpuOptimizerAlgo algo, ParseCpuOptimizerAlgo(a));
    cfg.algos.push_back(algo);
  }
  STRATA_ASSIGN_OR_RETURN(cfg.cols,
                          ParseSizeOption("--cols", f.cols, 0, kMaxParams));
  if (cfg.factored() && cfg.cols != 0 && cfg.n % cfg.cols != 0) {
    return Status::InvalidArgument("--cols: " + std::to_string(cfg.cols) +
                                   " does not divide --params " +
                                   std::to_string(cfg.n) +
                                   " (adafactor and sm3 need a whole matrix; 0 "
                                   "= a vector)");
  }
  if (cfg.cols == 0 && cfg.measures(CpuOptimizerAlgo::kAdafactor)) {
    // Adafactor keeps a vector's factors in its own scratch, which the
    // bound cannot stream.
    return Status::InvalidArgument(
        "--cols: 0 (a vector) is measured for sm3 only; give adafactor a "
        "matrix (accepted 1..params, dividing params)");
  }
  STRATA_ASSIGN_OR_RETURN(
      cfg.working_name,
      ParseChoiceOption("--working", f.working, {"bf16", "fp16", "none"}));
  cfg.has_working = cfg.working_name != "none";
  if (cfg.has_working) cfg.working = DTypeOf(cfg.working_name);
  STRATA_ASSIGN_OR_RETURN(
      cfg.grad_name,
      ParseChoiceOption("--grad", f.grad, {"fp32", "fp16", "bf16"}));
  cfg.grad = DTypeOf(cfg.grad_name);
  STRATA_ASSIGN_OR_RETURN(
      std::string scale,
      ParseChoiceOption("--scale-parameter", f.scale_parameter, {"on", "off"}));
  cfg.scale_parameter = scale == "on";
  STRATA_ASSIGN_OR_RETURN(
      std::string carry,
      ParseChoiceOption("--carry-param-sq", f.carry_param_sq, {"on", "off"}));
  cfg.carry_param_sq = carry == "on";
  STRATA_ASSIGN_OR_RETURN(std::string sweeps,
                          ParseChoiceOption("--block8-sweeps", f.block8_sweeps,
                                            {"auto", "1", "2"}));
  cfg.block8_sweeps = sweeps == "auto" ? 0 : std::stoi(sweeps);
  STRATA_ASSIGN_OR_RETURN(int64_t reps,
                          ParseIntOption("--reps", f.reps, 1, kMaxReps));
  cfg.reps = static_cast<int>(reps);
  STRATA_ASSIGN_OR_RETURN(
      std::string torch,
      ParseChoiceOption("--torch", f.torch, {"auto", "off"}));
  cfg.torch = torch == "auto";
  cfg.json = f.json;
  return cfg;
}

// ---- Check -----------------------------------------------------------------

// The optimizer the variant-less rows use (grad_stats): made up front, so
// that a bad STRATA_CPU_ADAM_VARIANT is reported before any work.
StatusOr<std::unique_ptr<CpuOptimizer>> DefaultOptimizer(int threads) {
  CpuOptimizerOptions o;
  o.threads = threads;
  return NewCpuOptimizer(o);
}

Status CheckAdam(const AdamConfig& cfg, JsonOutput* json) {
  if (!cfg.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(*json, JsonOutput::Prepare("--json", cfg.json));
  }
  STRATA_RETURN_IF_ERROR(DefaultOptimizer(1).status());
  return CheckMemory("adam's arrays (--params " + std::to_string(cfg.n) + ")",
                     cfg.array_bytes());
}

// ---- Run -------------------------------------------------------------------

struct Arrays {
  HostBuffer master, grad, m32, v32, m16, v16, m8, v8, working, stats;
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

StatusOr<Arrays> MakeArrays(const AdamConfig& cfg) {
  const uint64_t n = cfg.n;
  const size_t gsize = cfg.grad_bytes();
  auto state = [&](CpuDType m) -> uint64_t {
    const bool asked = std::find(cfg.moments.begin(), cfg.moments.end(), m) !=
                       cfg.moments.end();
    return asked ? CpuStateBytes(m, n) : 0;
  };
  Arrays a;
  for (auto [buf, bytes] :
       {std::pair{&a.master, n * 4}, std::pair{&a.grad, n * gsize},
        std::pair{&a.m32, state(CpuDType::kFloat32)},
        std::pair{&a.v32, state(CpuDType::kFloat32)},
        std::pair{&a.m16, state(CpuDType::kBFloat16)},
        std::pair{&a.v16, state(CpuDType::kBFloat16)},
        std::pair{&a.m8, state(CpuDType::kBlock8)},
        std::pair{&a.v8, state(CpuDType::kBlock8)},
        std::pair{&a.working, cfg.has_working ? n * 2 : 0},
        std::pair{&a.stats, cfg.stats_bytes()}}) {
    STRATA_ASSIGN_OR_RETURN(*buf, Alloc(bytes));
  }
  std::fprintf(stderr, "adam: %llu parameters, %s of arrays; filling\n",
               static_cast<unsigned long long>(n),
               FormatBytes(cfg.array_bytes()).c_str());
  Fill(a.master, 0x3f000000u, 4);                           // 0.5
  Fill(a.grad, gsize == 4 ? 0x3c23d70au : 0x3c24u, gsize);  // ~0.01
  Fill(a.m32, 0, 4);
  Fill(a.v32, 0, 4);
  Fill(a.m16, 0, 2);
  Fill(a.v16, 0, 2);
  Fill(a.m8, 0, 4);
  Fill(a.v8, 0, 4);
  if (cfg.has_working) Fill(a.working, 0, 2);
  Fill(a.stats, 0, 4);
  return a;
}

// The options every row of `algo` runs with: the library's defaults (SM3:
// momentum 0.9; Adafactor: no first moment, relative step), weight decay
// 0.01 and Adafactor's scale_parameter from --scale-parameter.
CpuOptimizerOptions OptionsFor(const AdamConfig& cfg, CpuOptimizerAlgo algo,
                               CpuKernelVariant v, int threads) {
  CpuOptimizerOptions o;
  o.algo = algo;
  o.variant = v;
  o.threads = threads;
  o.weight_decay = 0.01;
  o.block8_sweeps = cfg.block8_sweeps;
  o.adafactor.scale_parameter = cfg.scale_parameter;
  return o;
}

nlohmann::json OptionsJson(const CpuOptimizerOptions& o) {
  nlohmann::json j = {{"beta1", o.beta1},
                      {"beta2", o.beta2},
                      {"eps", o.eps},
                      {"weight_decay", o.weight_decay},
                      {"bias_correction", o.bias_correction},
                      {"tile_elems", o.tile_elems}};
  if (o.algo == CpuOptimizerAlgo::kAdafactor) {
    j["adafactor"] = nlohmann::json::parse(CpuAdafactorParamsJson(o.adafactor));
  }
  return j;
}

// The passes of one Step over `t`, each the streams its bound kernel moves:
// one pass for the Adam family and SM3; for Adafactor `count` (as its
// footprint counts them): statistics, the update's RMS when rows are too
// wide to fuse it, the update. The O(rows + cols) statistics of a matrix
// are left out; SM3's per-element accumulators of a vector are in.
std::vector<BoundArrays> PassesOf(const AdamConfig& cfg,
                                  const CpuOptimizerOptions& o,
                                  const CpuOptimizerTensors& t, int count) {
  const int g = static_cast<int>(cfg.grad_bytes());
  void* grad = const_cast<void*>(t.grad);
  std::vector<BoundArrays> passes;
  if (CpuOptimizerIsFactored(o.algo)) {
    const bool vec = t.rows == 0;
    const bool use_m = CpuOptimizerUsesExpAvg(o);
    const int msize = t.moment_dtype == CpuDType::kFloat32 ? 4 : 2;
    float* col = static_cast<float*>(t.exp_avg_sq) + 1;
    BoundArrays last;
    last.Add(t.master, 4, BoundAccess::kUpdate);
    last.Add(grad, g, BoundAccess::kRead);
    if (use_m) last.Add(t.exp_avg, msize, BoundAccess::kUpdate);
    if (t.working != nullptr) {
      last.Add(t.working, 2, BoundAccess::kStreamWrite);
    }
    if (o.algo == CpuOptimizerAlgo::kAdafactor) {
      BoundArrays p1, p2;
      p1.Add(grad, g, BoundAccess::kRead);
      if (o.adafactor.scale_parameter && !cfg.carry_param_sq) {
        p1.Add(t.master, 4, BoundAccess::kRead);
      }
      p2.Add(grad, g, BoundAccess::kRead);
      // Vectors are refused by ParseAdam.
      passes = count == 3 ? std::vector{p1, p2, last} : std::vector{p1, last};
    } else {
      if (vec) last.Add(col, 4, BoundAccess::kUpdate);
      passes = {last};
    }
    return passes;
  }
  const bool uses_m = o.algo != CpuOptimizerAlgo::kAdagrad;
  const bool uses_v = o.algo != CpuOptimizerAlgo::kLion;
  BoundArrays b;
  b.Add(t.master, 4, BoundAccess::kUpdate);
  b.Add(grad, g, BoundAccess::kRead);
  const bool q8 = t.moment_dtype == CpuDType::kBlock8;
  const int msize = t.moment_dtype == CpuDType::kFloat32 ? 4 : q8 ? 1 : 2;
  for (auto [use, arr] :
       {std::pair{uses_m, t.exp_avg}, std::pair{uses_v, t.exp_avg_sq}}) {
    if (!use) continue;
    b.Add(arr, msize, BoundAccess::kUpdate);
    if (q8) {  // the per-block scales after the codes
      b.Add(static_cast<char*>(arr) + (t.n + 3) / 4 * 4, 4,
            BoundAccess::kUpdate, kCpuBlock8Elems);
    }
  }
  if (t.working != nullptr) b.Add(t.working, 2, BoundAccess::kStreamWrite);
  return {b};
}

// The moment dtypes `algo` is measured with: int8 only for the Adam family
// and Lion; Adafactor and SM3 without a first moment need none ("none").
std::vector<std::pair<CpuDType, const char*>> MomentsFor(
    const AdamConfig& cfg, const CpuOptimizerOptions& o) {
  std::vector<std::pair<CpuDType, const char*>> out;
  const bool factored = CpuOptimizerIsFactored(o.algo);
  if (factored && !CpuOptimizerUsesExpAvg(o)) {
    return {{CpuDType::kFloat32, "none"}};
  }
  for (CpuDType m : cfg.moments) {
    if (m == CpuDType::kBlock8 &&
        (factored || o.algo == CpuOptimizerAlgo::kAdagrad)) {
      std::fprintf(stderr, "adam: no int8 states for %s; skipped\n",
                   std::string(CpuOptimizerAlgoName(o.algo)).c_str());
      continue;
    }
    out.emplace_back(m, MomentName(m));
  }
  return out;
}

// The best seconds of every bound kernel over every pass of one step, and
// what they add up to. A multi-pass step (Adafactor) is bounded by the
// fastest kernel of each pass: its read-only passes ran fastest as one plain
// loop per array and its update fused, so the fastest single kernel over
// all passes was up to 5% slower than that sum.
class BoundBest {
 public:
  explicit BoundBest(size_t passes)
      : best_(passes, std::vector<double>(std::size(kBoundKernels), 1e30)) {}

  void Note(size_t pass, size_t kernel, double seconds) {
    best_[pass][kernel] = std::min(best_[pass][kernel], seconds);
  }
  // Takes in the best times of `other` (of as many passes).
  void Merge(const BoundBest& other) {
    for (size_t p = 0; p < best_.size(); ++p) {
      for (size_t k = 0; k < best_[p].size(); ++k) {
        Note(p, k, other.best_[p][k]);
      }
    }
  }
  // Kernel k's time for the whole step: the sum of its best per pass.
  double KernelSeconds(size_t k) const {
    double sum = 0;
    for (const auto& pass : best_) sum += pass[k];
    return sum;
  }
  // The fastest kernel of pass p, indexed as kBoundKernels.
  size_t Fastest(size_t p) const {
    return static_cast<size_t>(
        std::min_element(best_[p].begin(), best_[p].end()) - best_[p].begin());
  }
  double PassSeconds(size_t p) const { return best_[p][Fastest(p)]; }
  // The bound: every pass at its fastest kernel.
  double Seconds() const {
    double sum = 0;
    for (size_t p = 0; p < best_.size(); ++p) sum += PassSeconds(p);
    return sum;
  }
  // The kernel every pass's bound came from, or "mixed".
  std::string KernelName() const {
    const size_t k = Fastest(0);
    for (size_t p = 1; p < best_.size(); ++p) {
      if (Fastest(p) != k) return "mixed";
    }
    return std::string(BoundKernelName(kBoundKernels[k]));
  }

 private:
  std::vector<std::vector<double>> best_;  // [pass][kernel]
};

// The bound's figures of one row: each kernel's GB/s over the whole step,
// and each pass's bytes, fastest kernel, GB/s, prefetch distance and
// whether fused_step ran compiled for its shape.
void AddBoundJson(const BoundBest& bb, const std::vector<BoundArrays>& passes,
                  uint64_t n, double bound_bytes, nlohmann::json& row) {
  const double gb = n * bound_bytes / 1e9;
  for (size_t k = 0; k < std::size(kBoundKernels); ++k) {
    // bound_fused_gbps, bound_fused_prefetch_gbps,
    // bound_fused_prefetch_32_gbps, bound_fused_step_gbps, bound_stream_gbps
    row["bound_" + std::string(BoundKernelName(kBoundKernels[k])) + "_gbps"] =
        gb / bb.KernelSeconds(k);
  }
  nlohmann::json bytes = nlohmann::json::array(),
                 kernel = nlohmann::json::array(),
                 gbps = nlohmann::json::array(),
                 ahead = nlohmann::json::array(),
                 compiled = nlohmann::json::array();
  for (size_t p = 0; p < passes.size(); ++p) {
    const double b = passes[p].BytesPerElem();
    bytes.push_back(b);
    kernel.push_back(
        std::string(BoundKernelName(kBoundKernels[bb.Fastest(p)])));
    gbps.push_back(n * b / 1e9 / bb.PassSeconds(p));
    ahead.push_back(BoundPrefetchElems(passes[p]));
    compiled.push_back(BoundStepShapeIndex(passes[p]) >= 0);
  }
  row["bound_kernel"] = bb.KernelName();
  row["bound_pass_bytes_per_param"] = bytes;
  row["bound_pass_kernel"] = kernel;
  row["bound_pass_gbps"] = gbps;
  row["bound_prefetch_elems"] = ahead;
  row["bound_step_prefetch_elems"] = kBoundStepPrefetchElems;
  row["bound_step_compiled"] = compiled;
}

// The name of pass `p` of `count` of a step of `optimizer`, as PassesOf
// orders them.
std::string PassName(const std::string& optimizer, size_t p, size_t count) {
  if (optimizer == "adafactor") {
    static const char* const kFused[] = {"statistics", "update"};
    static const char* const kWide[] = {"statistics", "update rms", "update"};
    if (count == std::size(kFused) && p < count) return kFused[p];
    if (count == std::size(kWide) && p < count) return kWide[p];
  }
  return p == 0 ? "step" : std::to_string(p + 1);
}

// Each pass's figures of one row, from the step's own timings of its passes
// (CpuStepResult), each pass's best over the repetitions: seconds, GB/s
// over the bytes its bound moves, the ratio to that pass's bound, and the
// median over the repetitions of each one's pass bound over its own pass
// (`paired[p]`, as the step's paired ratio). A multi-pass row also goes
// into `table`.
void AddPassJson(const BoundBest& bb, const std::vector<BoundArrays>& passes,
                 uint64_t n, const std::vector<double>& best,
                 const std::vector<std::vector<double>>& paired,
                 nlohmann::json& row, AdamOutcome& out) {
  const std::string optimizer = row["optimizer"].get<std::string>();
  nlohmann::json names = nlohmann::json::array(),
                 seconds = nlohmann::json::array(),
                 gbps = nlohmann::json::array(),
                 ratio = nlohmann::json::array(),
                 paired_ratio = nlohmann::json::array();
  for (size_t p = 0; p < passes.size(); ++p) {
    const double b = passes[p].BytesPerElem();
    names.push_back(PassName(optimizer, p, passes.size()));
    seconds.push_back(best[p]);
    gbps.push_back(n * b / 1e9 / best[p]);
    ratio.push_back(bb.PassSeconds(p) / best[p]);
    std::vector<double> reps = paired[p];  // Percentile sorts
    paired_ratio.push_back(Percentile(reps, 50));
    if (passes.size() > 1) {
      const std::string variant = row["variant"].get<std::string>();
      const std::string threads = std::to_string(row["threads"].get<int>());
      out.passes.AddRow({optimizer, variant, threads, names.back(), Fixed(b, 2),
                         Fixed(gbps.back().get<double>(), 1),
                         Fixed(n * b / 1e9 / bb.PassSeconds(p), 1),
                         Fixed(ratio.back().get<double>(), 3),
                         Fixed(paired_ratio.back().get<double>(), 3)});
      out.figures.push_back(
          {optimizer + " " + variant + " " + threads + "T " +
               names.back().get<std::string>() + " pass ratio",
           ratio.back().get<double>(), paired_ratio.back().get<double>()});
    }
  }
  row["pass_names"] = names;
  row["pass_seconds"] = seconds;
  row["pass_gbps"] = gbps;
  row["pass_ratio_to_bound"] = ratio;
  row["pass_paired_ratio_to_bound"] = paired_ratio;
}

// Adafactor's update pass alone against fp32 AdamW's whole step (`ref`):
// what an engine's Step pays when the statistics pass ran during backward
// (Engine::BeginStep, docs/memtier.md), with the same ceilings as the
// step's (the pass's bound and bytes). The pass is timed as its sweep over
// the threads (CpuStepResult), AdamW's step as the whole call.
void AddUpdatePassSpeedup(const nlohmann::json& ref, nlohmann::json& row,
                          AdamOutcome& out) {
  const nlohmann::json& seconds = row["pass_seconds"];
  if (seconds.size() < 2) return;
  const double n = row["params"].get<double>();
  const double s = seconds.back().get<double>();
  const double bound_s = row["pass_ratio_to_bound"].back().get<double>() * s;
  const double bytes = row["pass_gbps"].back().get<double>() * 1e9 * s / n;
  const double speedup = n / s / ref["params_per_s"].get<double>();
  const double by_bound = ref["bound_seconds"].get<double>() / bound_s;
  const double by_bytes = ref["bytes_per_param"].get<double>() / bytes;
  row["update_pass_speedup_vs_fp32_adamw"] = speedup;
  row["update_pass_bound_speedup_vs_fp32_adamw"] = by_bound;
  row["update_pass_bytes_speedup_vs_fp32_adamw"] = by_bytes;
  out.speedups.AddRow({"adafactor, update pass", row["variant"],
                       std::to_string(row["threads"].get<int>()),
                       row["moment_dtype"], Fixed(speedup, 2) + "x",
                       Fixed(by_bound, 2) + "x", Fixed(by_bytes, 2) + "x"});
}

// Each row of the best variant from `first` on (one thread count) against
// that run's fp32-moment AdamW row: params/s, and the ceilings on that
// figure, what the bounds allow (fp32 AdamW's bound seconds over the row's)
// and what the bytes allow (fp32 AdamW's bytes per parameter over the
// row's). A row cannot beat its bound, so a speedup above its bound's is
// the fp32 AdamW row falling short of its own. Returns fp32 AdamW's
// params/s, 0 without that row.
double AddSpeedups(AdamOutcome& out, size_t first) {
  const std::string best(CpuKernelVariantName(BestCpuKernelVariant()));
  const nlohmann::json* ref = nullptr;
  for (size_t i = first; i < out.results.size(); ++i) {
    const nlohmann::json& row = out.results[i];
    if (row["variant"] == best && row["optimizer"] == "adamw" &&
        row["moment_dtype"] == "fp32") {
      ref = &row;
    }
  }
  if (ref == nullptr) return 0;
  const double pps = (*ref)["params_per_s"].get<double>();
  const double bound_s = (*ref)["bound_seconds"].get<double>();
  const double bytes = (*ref)["bytes_per_param"].get<double>();
  for (size_t i = first; i < out.results.size(); ++i) {
    nlohmann::json& row = out.results[i];
    if (row["variant"] != best) continue;
    const double speedup = row["params_per_s"].get<double>() / pps;
    const double by_bound = bound_s / row["bound_seconds"].get<double>();
    const double by_bytes = bytes / row["bytes_per_param"].get<double>();
    row["speedup_vs_fp32_adamw"] = speedup;
    row["bound_speedup_vs_fp32_adamw"] = by_bound;
    row["bytes_speedup_vs_fp32_adamw"] = by_bytes;
    if (&row == ref) continue;
    out.speedups.AddRow({row["optimizer"], best,
                         std::to_string(row["threads"].get<int>()),
                         row["moment_dtype"], Fixed(speedup, 2) + "x",
                         Fixed(by_bound, 2) + "x", Fixed(by_bytes, 2) + "x"});
    if (row["optimizer"] == "adafactor") AddUpdatePassSpeedup(*ref, row, out);
  }
  return pps;
}

// ---- The arithmetic ceiling ------------------------------------------------
//
// Note [The in-cache rate]
// A row under its bound is held back by memory or by its arithmetic, and
// the bound alone cannot say which. So each row's step also runs, on one
// thread, over the first elements of its arrays, as many as take
// kCacheSampleBytes of them (whole 8-bit blocks): arrays that stay in a
// core's L2 (the working copy's non-temporal stores still go to memory, 2
// bytes a parameter), timed over enough steps to last kCacheSampleSeconds,
// the best of kCacheSampleRounds. That rate times the row's threads is the
// row's arithmetic ceiling (`cache Gp/s`): a row whose memory-resident
// rate comes near it is bound by its arithmetic as much as by memory, and
// only fewer instructions per element move it. The sample runs after the
// row's timed steps, over arrays of its own (SampleArrays): a copy of the
// first weights, the first gradients read in place, and zeroed states laid
// out for its own element count. A view of the row's states would not do:
// an 8-bit tensor keeps its scales after its codes, so a shorter tensor's
// scales fall on the row's codes, and in one run those bytes read as
// scales near 3.4e38 turned the sample's weights into NaN, which the next
// optimizer over the same weights (Adafactor) refused. The row's own arrays
// are left as its timed steps left them.
//
// Adafactor and SM3 have none: each of their steps also works over the
// matrix's rows and columns (Adafactor adds up to 64 bands of column
// partial sums, in double, per array), which a sample of a few rows does
// not amortize. One Zen 5 core, 4096 columns, Adafactor: 0.46, 1.73 and 2.79
// G params/s over 2, 16 and 64 rows, against 1.9 over 16 Mi parameters from
// memory; SM3 2.5, 4.8 and 4.2, against 2.1.
constexpr uint64_t kCacheSampleBytes = uint64_t{256} << 10;
constexpr double kCacheSampleSeconds = 0.02;
constexpr int kCacheSampleRounds = 3;

struct CacheRate {
  uint64_t params = 0;      // 0: not sampled (Adafactor, SM3)
  double params_per_s = 0;  // one thread
};

// Elements of the in-cache sample of a step moving `bytes_per_param` per
// element: a whole number of 8-bit blocks (of 64 elements for the other
// formats), at least one, at most n.
uint64_t CacheSampleElems(uint64_t n, double bytes_per_param, CpuDType mom) {
  const uint64_t unit = mom == CpuDType::kBlock8 ? kCpuBlock8Elems : 64;
  const auto fits = static_cast<uint64_t>(
      static_cast<double>(kCacheSampleBytes) / std::max(bytes_per_param, 1.0));
  return std::min(n, std::max<uint64_t>(1, fits / unit) * unit);
}

// The in-cache sample's own arrays (Note [The in-cache rate]).
struct SampleArrays {
  HostBuffer master, exp_avg, exp_avg_sq, working;
};

// The first `n` elements of `full` as a tensor of their own, over `a`.
StatusOr<CpuOptimizerTensors> SampleOf(const CpuOptimizerTensors& full,
                                       uint64_t n, SampleArrays& a) {
  CpuOptimizerTensors t = full;
  t.n = n;
  STRATA_ASSIGN_OR_RETURN(a.master, Alloc(n * sizeof(float)));
  std::memcpy(a.master.data(), full.master, n * sizeof(float));
  t.master = reinterpret_cast<float*>(a.master.data());
  const size_t state = CpuStateBytes(full.moment_dtype, n);
  for (auto [buf, arr] : {std::pair{&a.exp_avg, &t.exp_avg},
                          std::pair{&a.exp_avg_sq, &t.exp_avg_sq}}) {
    if (*arr == nullptr) continue;
    STRATA_ASSIGN_OR_RETURN(*buf, Alloc(state));
    Fill(*buf, 0, 2);  // every format's states are a whole number of words
    *arr = buf->data();
  }
  if (full.working != nullptr) {
    STRATA_ASSIGN_OR_RETURN(a.working, Alloc(n * 2));
    t.working = a.working.data();
  }
  return t;
}

// Note [The in-cache rate]: one thread of the row's optimizer (its variant
// and options) over the first elements of `full`.
StatusOr<CacheRate> MeasureCacheRate(const CpuOptimizerOptions& row_options,
                                     const CpuOptimizerTensors& full,
                                     double bytes_per_param) {
  if (CpuOptimizerIsFactored(row_options.algo)) return CacheRate{};
  CpuOptimizerOptions o = row_options;
  o.threads = 1;
  STRATA_ASSIGN_OR_RETURN(auto opt, NewCpuOptimizer(o));
  SampleArrays arrays;
  STRATA_ASSIGN_OR_RETURN(
      CpuOptimizerTensors t,
      SampleOf(full,
               CacheSampleElems(full.n, bytes_per_param, full.moment_dtype),
               arrays));
  CpuStepArgs args;
  args.lr = 1e-5;
  args.check_overflow = false;  // as the row's timed steps
  auto step = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(CpuStepResult res, opt->Step(t, args));
    if (!res.applied) return Status::Internal("adam: a step was skipped");
    ++args.step;
    return Status::Ok();
  };
  for (int i = 0; i < 4; ++i) STRATA_RETURN_IF_ERROR(step());  // warm-up
  double best = 1e30;
  for (int round = 0; round < kCacheSampleRounds; ++round) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    int steps = 0;
    const auto t0 = Clock::now();
    double s = 0;
    do {
      STRATA_RETURN_IF_ERROR(step());
      ++steps;
      s = Seconds(t0, Clock::now());
    } while (s < kCacheSampleSeconds);
    best = std::min(best, s / steps);
  }
  return CacheRate{t.n, static_cast<double>(t.n) / best};
}

// What one optimizer and moment dtype measured at one thread count: every
// variant beside the same bounds. Its rows are written once every optimizer
// of the thread count has run, against the bound over all their samples
// (SharedBound).
struct Measured {
  std::string algo_name, mom_name;
  CpuDType mom = CpuDType::kFloat32;
  CpuOptimizerOptions options;
  size_t rows = 0, cols = 0;
  CpuStepFootprint fp;
  std::vector<BoundArrays> passes;
  BoundBest bounds = BoundBest(0);
  std::vector<int> threads;  // [variant]: what ran
  std::vector<int> sweeps;   // [variant]: block8_sweeps, resolved
  std::vector<double> best;  // [variant]: the best step
  // [variant][pass]: each pass's best, as the step timed it.
  std::vector<std::vector<double>> pass_best;
  // [variant][pass]: each repetition's pass bound over its pass.
  std::vector<std::vector<std::vector<double>>> pass_paired;
  // [variant]: each repetition's bound over each variant's step in it.
  std::vector<std::vector<double>> paired;
  std::vector<CacheRate> cache;  // [variant]: Note [The in-cache rate]

  double bound_bytes() const {
    double b = 0;
    for (const BoundArrays& ba : passes) b += ba.BytesPerElem();
    return b;
  }
};

// Each bound kernel runs kBoundSamples times per repetition: on a shared
// host a streaming kernel's time varied more from pass to pass than the
// step's did, and with one pass per repetition the best of five bound passes
// fell 10-20% under the step's own rate in some runs (one thread, 256M: the
// bf16-moment AdamW step read 1.20 of the bound at --reps 5, 0.97 at --reps
// 15).
constexpr int kBoundSamples = 3;

// The optimizers `opts` (one per variant) with moment dtype `mom` over the
// arrays, cfg.reps times after a warm-up, each repetition with the bound
// kernels over the same arrays first; and the gradient statistics pass
// (*best_stats, its best).
StatusOr<Measured> MeasureRows(
    const AdamConfig& cfg, Arrays& a, CpuDType mom, const char* mom_name,
    const std::vector<std::unique_ptr<CpuOptimizer>>& opts, BoundRunner& bound,
    CpuOptimizer& stats_opt, int64_t* step, double* best_stats) {
  const uint64_t n = cfg.n;
  Measured m;
  const CpuOptimizerOptions& o = opts[0]->options();
  m.algo_name = CpuOptimizerAlgoName(o.algo);
  m.mom_name = mom_name;
  m.mom = mom;
  m.options = o;
  CpuOptimizerTensors tensors;
  tensors.n = n;
  tensors.master = reinterpret_cast<float*>(a.master.data());
  tensors.grad = a.grad.data();
  tensors.grad_dtype = cfg.grad;
  tensors.exp_avg = (mom == CpuDType::kFloat32  ? a.m32
                     : mom == CpuDType::kBlock8 ? a.m8
                                                : a.m16)
                        .data();
  tensors.exp_avg_sq = (mom == CpuDType::kFloat32  ? a.v32
                        : mom == CpuDType::kBlock8 ? a.v8
                                                   : a.v16)
                           .data();
  tensors.moment_dtype = mom;
  if (CpuOptimizerIsFactored(o.algo)) {
    tensors.exp_avg_sq = a.stats.data();
    tensors.rows = cfg.cols == 0 ? 0 : n / cfg.cols;
    tensors.cols = cfg.cols;
  }
  tensors.working = cfg.has_working ? a.working.data() : nullptr;
  if (cfg.has_working) tensors.working_dtype = cfg.working;
  m.rows = tensors.rows;
  m.cols = tensors.cols;
  // Bytes one parameter moves, all passes: what the bounds move, and
  // what the library predicts for an NVMe-resident step.
  CpuStepShape shape;
  shape.n = n;
  shape.rows = tensors.rows;
  shape.cols = tensors.cols;
  shape.grad_dtype = cfg.grad;
  shape.moment_dtype = mom;
  shape.has_working = cfg.has_working;
  shape.working_dtype = cfg.working;
  shape.param_sq_known = cfg.carry_param_sq;
  STRATA_ASSIGN_OR_RETURN(m.fp, CpuStepFootprintOf(o, shape));
  m.passes = PassesOf(cfg, o, tensors, m.fp.passes);
  const size_t passes = m.passes.size(), variants = opts.size();
  CpuStepArgs args;
  args.lr = 1e-5;
  args.check_overflow = false;  // the fused pass alone; stats timed apart
  m.bounds = BoundBest(passes);
  m.best.assign(variants, 1e30);
  m.pass_best.assign(variants, std::vector<double>(passes, 1e30));
  m.pass_paired.assign(variants, std::vector<std::vector<double>>(passes));
  m.paired.assign(variants, {});
  for (const auto& opt : opts) {
    m.threads.push_back(opt->threads());
    m.sweeps.push_back(opt->options().block8_sweeps);
  }
  for (int r = 0; r <= cfg.reps; ++r) {  // r == 0 warms up
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    BoundBest rep_bounds(passes);
    for (int sample = 0; sample < kBoundSamples; ++sample) {
      for (size_t k = 0; k < std::size(kBoundKernels); ++k) {
        for (size_t p = 0; p < passes; ++p) {
          const auto t0 = Clock::now();
          bound.Run(kBoundKernels[k], m.passes[p], n);
          const auto t1 = Clock::now();
          rep_bounds.Note(p, k, Seconds(t0, t1));
        }
      }
    }
    if (r > 0) m.bounds.Merge(rep_bounds);
    for (size_t k = 0; k < variants; ++k) {
      args.step = ++*step;
      const auto t0 = Clock::now();
      auto res = opts[k]->Step(tensors, args);
      const auto t1 = Clock::now();
      if (!res.ok()) return res.status();
      if (!res->applied) return Status::Internal("adam: a step was skipped");
      // Every variant's steps update the same weights in turn.
      if (cfg.carry_param_sq) args.param_sq = res->param_sq;
      if (static_cast<size_t>(res->passes) != passes) {
        return Status::Internal(
            "adam: a step ran " + std::to_string(res->passes) +
            " passes where its bound has " + std::to_string(passes));
      }
      if (r == 0) continue;
      for (size_t p = 0; p < passes; ++p) {
        m.pass_best[k][p] = std::min(m.pass_best[k][p], res->pass_seconds[p]);
        m.pass_paired[k][p].push_back(rep_bounds.PassSeconds(p) /
                                      res->pass_seconds[p]);
      }
      m.best[k] = std::min(m.best[k], Seconds(t0, t1));
      m.paired[k].push_back(rep_bounds.Seconds() / Seconds(t0, t1));
    }
    const auto t0 = Clock::now();
    auto stats = stats_opt.ComputeGradStats(tensors.grad, cfg.grad, n, 1.0);
    const auto t1 = Clock::now();
    if (!stats.ok()) return stats.status();
    if (r > 0) *best_stats = std::min(*best_stats, Seconds(t0, t1));
  }
  for (size_t k = 0; k < variants; ++k) {
    STRATA_ASSIGN_OR_RETURN(
        CacheRate c,
        MeasureCacheRate(opts[k]->options(), tensors, m.bound_bytes()));
    m.cache.push_back(c);
  }
  return m;
}

// The bound of all[i]: its own samples and those of every other entry of
// the thread count over the same arrays (Adam's and AdamW's, say), so that
// a phase in which the host's other tenants slowed the bound kernels more
// than the step cannot set one row's bound under what the same kernels
// reached over the same bytes in the same run. The JSON names the rows
// whose samples it holds (`bound_rows`) and counts them (`bound_samples`).
// Each row's bound is kBoundSamples runs of each kernel in each of
// cfg.reps repetitions.
struct SharedBound {
  BoundBest bounds = BoundBest(0);
  int samples = 0;
  nlohmann::json rows = nlohmann::json::array();
};

SharedBound ShareBound(const AdamConfig& cfg, const std::vector<Measured>& all,
                       size_t i) {
  SharedBound s;
  s.bounds = BoundBest(all[i].passes.size());
  for (const Measured& m : all) {
    if (m.passes != all[i].passes) continue;
    s.bounds.Merge(m.bounds);
    s.samples += cfg.reps * kBoundSamples;
    s.rows.push_back(m.algo_name + " " + m.mom_name);
  }
  return s;
}

// The rows of all[i], one per variant, into `out`. *fp32_rate: the best
// variant's params/s of the same optimizer with fp32 moments, when its row
// came first (0 otherwise); set here by that row.
void AddRows(const AdamConfig& cfg, const std::vector<Measured>& all, size_t i,
             const std::string& bound_isa, AdamOutcome& out,
             double* fp32_rate) {
  const uint64_t n = cfg.n;
  const Measured& m = all[i];
  const SharedBound shared = ShareBound(cfg, all, i);
  const double bound_bytes = m.bound_bytes();
  const double best_bound = shared.bounds.Seconds();
  const double bound_gbps = n * bound_bytes / 1e9 / best_bound;
  const double bytes_per_param =
      static_cast<double>(m.fp.read_bytes + m.fp.written_bytes) / n;
  for (size_t k = 0; k < cfg.variants.size(); ++k) {
    const double pps = n / m.best[k];
    const double gbps = pps * bound_bytes / 1e9;
    const double ratio = best_bound / m.best[k];
    std::vector<double> paired = m.paired[k];  // Percentile sorts
    const double paired_ratio = Percentile(paired, 50);
    const CacheRate& cache = m.cache[k];
    const double ceiling = cache.params_per_s * m.threads[k];
    nlohmann::json row = {
        {"optimizer", m.algo_name},
        {"variant", std::string(CpuKernelVariantName(cfg.variants[k]))},
        {"threads", m.threads[k]},
        {"params", n},
        {"rows", m.rows},
        {"cols", m.cols},
        {"options", OptionsJson(m.options)},
        {"moment_dtype", m.mom_name},
        {"block8_sweeps", m.mom == CpuDType::kBlock8
                              ? nlohmann::json(m.sweeps[k])
                              : nlohmann::json(nullptr)},
        {"grad_dtype", cfg.grad_name},
        {"working_dtype", cfg.working_name},
        {"passes", m.fp.passes},
        {"bytes_per_param", bytes_per_param},
        {"read_bytes_per_param", static_cast<double>(m.fp.read_bytes) / n},
        {"written_bytes_per_param",
         static_cast<double>(m.fp.written_bytes) / n},
        {"bound_bytes_per_param", bound_bytes},
        {"state_bytes_per_param",
         static_cast<double>(m.fp.exp_avg_bytes + m.fp.exp_avg_sq_bytes) / n},
        {"seconds", m.best[k]},
        {"params_per_s", pps},
        {"gbps", gbps},
        {"bound_gbps", bound_gbps},
        {"bound_isa", bound_isa},
        {"bound_seconds", best_bound},
        {"bound_samples", shared.samples},
        {"bound_rows", shared.rows},
        {"ratio_to_bound", ratio},
        {"paired_ratio_to_bound", paired_ratio},
        {"cache_sample_params", nullptr},
        {"cache_params_per_s_per_thread", nullptr},
        {"cache_ceiling_params_per_s", nullptr}};
    if (cache.params > 0) {
      row["cache_sample_params"] = cache.params;
      row["cache_params_per_s_per_thread"] = cache.params_per_s;
      row["cache_ceiling_params_per_s"] = ceiling;
    }
    AddBoundJson(shared.bounds, m.passes, n, bound_bytes, row);
    AddPassJson(shared.bounds, m.passes, n, m.pass_best[k], m.pass_paired[k],
                row, out);
    out.figures.push_back(
        {m.algo_name + " " + row["variant"].get<std::string>() + " " +
             std::to_string(m.threads[k]) + "T " + m.mom_name + " ratio",
         ratio, paired_ratio});
    if (cfg.variants[k] == BestCpuKernelVariant()) {
      if (m.mom == CpuDType::kFloat32) *fp32_rate = pps;
      if (m.mom != CpuDType::kFloat32 && *fp32_rate > 0) {
        row["speedup_vs_fp32_moments"] = pps / *fp32_rate;
      }
    }
    out.results.push_back(row);
    out.table.AddRow({m.algo_name, row["variant"], std::to_string(m.threads[k]),
                      m.mom_name, Fixed(pps / 1e9, 3), Fixed(gbps, 1),
                      Fixed(bound_gbps, 1), Fixed(ratio, 3),
                      Fixed(paired_ratio, 3), Fixed(bytes_per_param, 2),
                      cache.params > 0 ? Fixed(ceiling / 1e9, 3) : "-"});
  }
}

// One thread count: every optimizer, variant and moment dtype, beside the
// bounds and the gradient statistics. Appends rows; *adamw_fp32_rate gets
// the best variant's params/s of fp32-moment AdamW (0 if not measured).
Status MeasureThreads(const AdamConfig& cfg, Arrays& a, int t, int64_t* step,
                      Progress& progress, AdamOutcome& out, int* ran_threads,
                      double* adamw_fp32_rate) {
  const uint64_t n = cfg.n;
  const size_t gsize = cfg.grad_bytes();
  STRATA_ASSIGN_OR_RETURN(auto stats_opt, DefaultOptimizer(t));
  const int threads = stats_opt->threads();  // what ran, 0 resolved
  *ran_threads = threads;
  // The bounds: the widest ISA, whatever variant the optimizer is forced
  // to; the default tile is a whole number of kBlock8 blocks, so int8 steps
  // split the same way.
  BoundRunner bound(BestBoundIsa(), threads, stats_opt->options().tile_elems);
  const std::string bound_isa(BoundIsaName(bound.isa()));
  const size_t first_row = out.results.size();
  double best_stats = 1e30;
  std::vector<Measured> all;
  for (CpuOptimizerAlgo algo : cfg.algos) {
    std::vector<std::unique_ptr<CpuOptimizer>> opts;
    for (CpuKernelVariant v : cfg.variants) {
      STRATA_ASSIGN_OR_RETURN(auto opt,
                              NewCpuOptimizer(OptionsFor(cfg, algo, v, t)));
      opts.push_back(std::move(opt));
    }
    for (auto [mom, mom_name] : MomentsFor(cfg, opts[0]->options())) {
      STRATA_RETURN_IF_ERROR(CheckInterrupted());
      progress.Step("threads " + std::to_string(threads) + " " +
                    std::string(CpuOptimizerAlgoName(algo)));
      STRATA_ASSIGN_OR_RETURN(Measured m,
                              MeasureRows(cfg, a, mom, mom_name, opts, bound,
                                          *stats_opt, step, &best_stats));
      all.push_back(std::move(m));
    }
  }
  double fp32_rate = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i > 0 && all[i].algo_name != all[i - 1].algo_name) fp32_rate = 0;
    AddRows(cfg, all, i, bound_isa, out, &fp32_rate);
  }
  *adamw_fp32_rate = AddSpeedups(out, first_row);
  const double stats_gbps = n * gsize / best_stats / 1e9;
  const std::string stats_variant(CpuKernelVariantName(stats_opt->variant()));
  out.results.push_back({{"optimizer", "grad_stats"},
                         {"variant", stats_variant},
                         {"threads", threads},
                         {"params", n},
                         {"params_per_s", n / best_stats},
                         {"gbps", stats_gbps},
                         {"bound_gbps", nullptr},
                         {"ratio_to_bound", nullptr}});
  out.table.AddRow({"grad_stats", stats_variant, std::to_string(threads), "-",
                    Fixed(n / best_stats / 1e9, 3), Fixed(stats_gbps, 1), "-",
                    "-", "-", Fixed(static_cast<double>(gsize), 2)});
  return Status::Ok();
}

// The first candidate python that imports torch, or nullopt; kAborted when
// interrupted meanwhile (the child is killed).
StatusOr<std::optional<std::string>> FindTorchPython() {
  for (const std::string& py : PythonCandidates()) {
    auto r = RunChild({py, "-c", PythonImport("torch")});
    if (!r.ok()) {
      if (r.status().code() == StatusCode::kAborted) return r.status();
      continue;
    }
    if (r->exit_code == 0) return std::optional<std::string>(py);
  }
  return std::optional<std::string>();
}

// The torch figure for each thread count; a failed torch run is a note on
// stderr, an interrupt ends the command.
Status MeasureTorch(const AdamConfig& cfg,
                    const std::vector<std::pair<int, double>>& best_fp32,
                    AdamOutcome& out) {
  STRATA_ASSIGN_OR_RETURN(std::optional<std::string> py, FindTorchPython());
  if (!py) {
    std::fprintf(stderr, "adam: no python3 with torch; no torch figure\n");
    return Status::Ok();
  }
  const uint64_t n = cfg.n;
  for (auto [t, ours] : best_fp32) {
    auto run =
        RunChild({*py, "-c", kTorchScript, std::to_string(n), std::to_string(t),
                  std::to_string(std::min(cfg.reps, 3))});
    if (!run.ok() && run.status().code() == StatusCode::kAborted) {
      return run.status();
    }
    nlohmann::json j;
    if (run.ok() && run->exit_code == 0) {
      j = nlohmann::json::parse(run->out, nullptr, /*allow_exceptions=*/false);
    }
    if (j.is_discarded() || !j.is_object() || !j.contains("params_per_s") ||
        !j["params_per_s"].is_number() || !j.contains("torch") ||
        !j["torch"].is_string()) {
      std::fprintf(stderr, "adam: the torch run failed; no figure\n");
      continue;
    }
    const double pps = j["params_per_s"].get<double>();
    nlohmann::json row = {{"optimizer", "torch.optim.Adam"},
                          {"variant", "torch " + j["torch"].get<std::string>()},
                          {"threads", t},
                          {"params", n},
                          {"moment_dtype", "fp32"},
                          {"params_per_s", pps},
                          {"gbps", pps * 28 / 1e9},
                          {"bound_gbps", nullptr},
                          {"ratio_to_bound", nullptr}};
    if (ours > 0) row["strata_speedup"] = ours / pps;
    out.results.push_back(row);
    out.table.AddRow({"torch.Adam", "torch", std::to_string(t), "fp32",
                      Fixed(pps / 1e9, 3), Fixed(pps * 28 / 1e9, 1), "-",
                      ours > 0 ? "x" + Fixed(ours / pps, 2) + " strata" : "-"});
  }
  return Status::Ok();
}

StatusOr<AdamOutcome> RunAdam(const AdamConfig& cfg) {
  AdamOutcome out;
  std::vector<std::pair<int, double>> best_fp32;  // threads -> params/s
  {
    STRATA_ASSIGN_OR_RETURN(Arrays a, MakeArrays(cfg));
    Progress progress(cfg.threads.size() * cfg.algos.size() *
                      cfg.moments.size());
    int64_t step = 0;
    for (int t : cfg.threads) {
      int ran = t;
      double fp32_rate = 0;
      STRATA_RETURN_IF_ERROR(
          MeasureThreads(cfg, a, t, &step, progress, out, &ran, &fp32_rate));
      best_fp32.emplace_back(ran, fp32_rate);
    }
  }  // the arrays go before torch allocates its own
  if (cfg.torch) STRATA_RETURN_IF_ERROR(MeasureTorch(cfg, best_fp32, out));
  return out;
}

// ---- Report ----------------------------------------------------------------

nlohmann::json ConfigJson(const AdamConfig& cfg) {
  nlohmann::json variants = nlohmann::json::array();
  for (auto v : cfg.variants) variants.push_back(CpuKernelVariantName(v));
  nlohmann::json moments = nlohmann::json::array();
  for (auto m : cfg.moments) moments.push_back(MomentName(m));
  nlohmann::json algos = nlohmann::json::array();
  for (auto a : cfg.algos) algos.push_back(CpuOptimizerAlgoName(a));
  return {{"params", cfg.n},
          {"threads", cfg.threads},
          {"variants", variants},
          {"moments", moments},
          {"optimizers", algos},
          {"cols", cfg.cols},
          {"weight_decay", 0.01},
          {"grad_dtype", cfg.grad_name},
          {"working_dtype", cfg.working_name},
          {"scale_parameter", cfg.scale_parameter},
          {"carry_param_sq", cfg.carry_param_sq},
          {"block8_sweeps", cfg.block8_sweeps == 0
                                ? nlohmann::json("auto")
                                : nlohmann::json(cfg.block8_sweeps)},
          {"reps", cfg.reps},
          {"torch", cfg.torch ? "auto" : "off"},
          {"bound_isa", BoundIsaName(BestBoundIsa())}};
}

Status ReportAdam(const AdamConfig& cfg, const AdamOutcome& out,
                  JsonOutput& json) {
  const bool adafactor = cfg.measures(CpuOptimizerAlgo::kAdafactor);
  const bool int8 = std::find(cfg.moments.begin(), cfg.moments.end(),
                              CpuDType::kBlock8) != cfg.moments.end();
  const std::string sweeps =
      !int8 ? ""
      : cfg.block8_sweeps == 0
          ? ", int8 in each variant's own sweeps"
          : ", int8 in " + std::to_string(cfg.block8_sweeps) +
                (cfg.block8_sweeps == 1 ? " sweep" : " sweeps");
  std::printf(
      "strata-bench adam: %llu params, grad %s, working %s%s%s, best of "
      "%d, bound %s\n%s",
      static_cast<unsigned long long>(cfg.n), cfg.grad_name.c_str(),
      cfg.working_name.c_str(),
      !adafactor             ? ""
      : !cfg.scale_parameter ? ", adafactor scale_parameter off"
      : cfg.carry_param_sq ? ", adafactor scale_parameter on, param_sq carried"
                           : ", adafactor scale_parameter on, param_sq summed",
      sweeps.c_str(), cfg.reps,
      std::string(BoundIsaName(BestBoundIsa())).c_str(),
      out.table.ToString().c_str());
  if (out.speedups.HasRows()) {
    std::printf(
        "against fp32-moment AdamW of the same threads: params/s, and the "
        "ceilings the bounds and the bytes set on that figure\n%s",
        out.speedups.ToString().c_str());
  }
  if (out.passes.HasRows()) {
    std::printf(
        "each pass of a multi-pass step, as the step timed it, against its "
        "own bound\n%s",
        out.passes.ToString().c_str());
  }
  PrintAboveOneNote(out.figures,
                    "the bound (the same bytes streamed with no arithmetic)");
  if (!json.active()) return Status::Ok();
  nlohmann::json j = {{"command", kCommand},
                      {"machine", MachineInfo()},
                      {"config", ConfigJson(cfg)},
                      {"results", out.results}};
  return json.Commit(j);
}

int Main(int argc, char** argv) {
  CLI::App app{"fused CPU optimizer throughput beside the in-run bound",
               "strata-bench adam"};
  AdamFlags flags;
  AddOptions(app, flags);
  AdamConfig cfg;
  JsonOutput json;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseAdam(flags));
        return Status::Ok();
      },
      [&](RunGuard&) { return CheckAdam(cfg, &json); },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(AdamOutcome out, RunAdam(cfg));
        return ReportAdam(cfg, out, json);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("adam", "fused CPU optimizer vs in-run bandwidth bound",
                     Main);

}  // namespace strata::bench
