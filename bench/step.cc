// strata-bench step: one offloaded optimizer step over N parameters through
// the engine (include/strata/engine.h), with the fp32 master and the moments
// (fp32, bf16 or int8: --moments) of each optimizer (--optimizer) resting on
// NVMe (case `nvme`) and in host RAM (case `host`), beside its bound
// measured in the same run:
//
//   bound = max(I/O time, update time)
//   I/O time    = the step's NVMe bytes (it reads and writes the master's 4
//                 bytes per parameter and the moments the optimizer keeps
//                 per element, CpuStateBytes each: 12 in all with fp32
//                 moments, 8 with bf16, about 6 with int8; Adafactor 4, its
//                 statistics per row and column resting on the host) at
//                 the rate of the same I/O engine moving as many reads as
//                 writes at once, on the same directory;
//   update time = N at the CPU optimizer's own rate (the gradient-norm pass
//                 and the fused update, the work the step does per
//                 parameter) on arrays in RAM, same threads, measured
//                 while the case's engine holds its memory (see RunCase).
//   efficiency  = bound / step time (1 would be perfect overlap).
//
// The rates are sampled before the first timed step and again right after
// each, so each step also has a bound of its own, the faster of the samples
// around it (Note [Bracketed samples]): `efficiency` compares the fastest
// step with the fastest rates seen, and `paired_efficiency` is the median
// of the steps' ratios to their own bounds, which the machine's drift from
// minute to minute moves less (on a virtual machine the drive's mixed rate and
// the memory's moved by 20-40% between runs).
//
// The working copy rests on the host, so no device traffic is timed. The
// gradients are handed over (outside the timing) before every step; with
// --grads nvme they rest on NVMe (written at the hand-over) and each case's
// step also reads them back: once for the update and once more for
// Adafactor's statistics. The I/O time then counts those reads, at the rate
// of the same engine moving the case's own share of reads and writes.
//
// --begin-step on calls BeginStep before the hand-overs and waits, outside
// the timing, until the engine has taken each tensor's gradient stats, and
// Adafactor's statistics pass over it (EngineStats::early_statistics, with
// the gradients on the host; on NVMe the accumulator passes each tensor as
// it adds it, EngineStats::early_passes), as a trainer's backward long
// enough to hide them would: the timed Step reads each gradient once, for
// the update (the case's engine has no undo buffer, so nothing is updated
// early). Its update time is then the optimizer's update alone: the
// gradient-norm pass and Adafactor's statistics pass (CpuStepResult's passes
// before the last) left out.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/engine_config.h"
#include "strata/host_buffer.h"
#include "strata/io_engine.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCommand = "step";
constexpr const char* kLockName = "strata-bench-step.lock";
constexpr const char* kScratchName = "strata-bench-step-io.dat";
constexpr uint64_t kMaxParams = uint64_t{1} << 40;
constexpr uint64_t kTensorElems = uint64_t{16} << 20;  // 64 MiB of fp32

struct StepFlags {
  std::string params = "1G";
  std::string cases = "nvme,host";
  std::string moments = "fp32";
  std::string optimizers = "adamw";
  std::string grads = "host";
  std::string begin_step = "off";
  std::string dir = ".";
  SwapIoFlags io;
  std::string threads = "0";
  std::string reps = "2";
  std::string json;
};

struct StepConfig {
  uint64_t params = 0;
  std::vector<std::string> cases;
  std::vector<CpuDType> moments;
  std::vector<CpuOptimizerAlgo> optimizers;
  bool nvme_grads = false;
  bool begin_step = false;
  std::string dir;
  IoBackend engine = IoBackend::kAuto;
  uint32_t queue_depth = 32;
  uint64_t block_size = 1 << 20;
  int threads = 0;
  int reps = 2;
  std::string json;

  bool has(const char* c) const {
    return std::find(cases.begin(), cases.end(), c) != cases.end();
  }
  // Whether a case moves bytes through --dir.
  bool uses_dir() const { return has("nvme") || nvme_grads; }
  // Whether a case moves as many reads as writes (the nvme case, its
  // gradients on the host): the run's even-split rate bounds it.
  bool even_io() const { return has("nvme") && !nvme_grads; }
};

void AddOptions(CLI::App& app, StepFlags& f) {
  app.add_option("--params", f.params,
                 "parameters, K/M/G/T suffixes (default 1G)");
  app.add_option("--cases", f.cases,
                 "where master and moments rest: nvme,host (default both)");
  app.add_option("--moments", f.moments,
                 "moment formats, each a run of the cases: fp32,bf16,int8 "
                 "(default fp32)");
  app.add_option("--optimizer", f.optimizers,
                 "optimizers, each a run of the cases: adam, adamw, adagrad, "
                 "lion, adafactor, sm3 (default adamw)");
  app.add_option("--grads", f.grads,
                 "where the gradients rest in every case: host or nvme "
                 "(default host)");
  app.add_option("--begin-step", f.begin_step,
                 "on: BeginStep before the hand-overs, the gradient's stats "
                 "(and Adafactor's statistics) taken before the timed step "
                 "(--grads host; default off)");
  app.add_option("--dir", f.dir, "directory for the NVMe tier (default .)");
  AddSwapIoOptions(app, f.io);
  app.add_option("--threads", f.threads,
                 "optimizer threads, 0 = all CPUs (default 0)");
  app.add_option("--reps", f.reps, "timed steps, 1..100; the best is kept");
  app.add_option("--json", f.json, "write results as JSON to FILE");
}

StatusOr<StepConfig> ParseStep(const StepFlags& f) {
  StepConfig c;
  STRATA_ASSIGN_OR_RETURN(c.params,
                          ParseSizeOption("--params", f.params, 1, kMaxParams));
  STRATA_ASSIGN_OR_RETURN(
      c.cases, ParseChoiceListOption("--cases", f.cases, {"nvme", "host"}));
  STRATA_ASSIGN_OR_RETURN(
      std::vector<std::string> moments,
      ParseChoiceListOption("--moments", f.moments, {"fp32", "bf16", "int8"}));
  for (const std::string& m : moments) {
    STRATA_ASSIGN_OR_RETURN(CpuDType d, ParseMomentDType(m));
    c.moments.push_back(d);
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> optimizers,
                          ParseChoiceListOption("--optimizer", f.optimizers,
                                                {"adam", "adamw", "adagrad",
                                                 "lion", "adafactor", "sm3"}));
  for (const std::string& name : optimizers) {
    STRATA_ASSIGN_OR_RETURN(CpuOptimizerAlgo a, ParseCpuOptimizerAlgo(name));
    c.optimizers.push_back(a);
    // The engine's own check of the pair, named by these options.
    EngineOptions o;
    o.optimizer.cpu.algo = a;
    for (CpuDType m : c.moments) {
      o.optimizer.moment_dtype = m;
      if (!ValidateEngineOptions(o).ok()) {
        return Status::InvalidArgument(
            "--moments " + std::string(MomentDTypeName(m)) +
            " with --optimizer " + name +
            ": bf16 holds the moments of adam, adamw, lion, adafactor and sm3, "
            "int8 those of adam, adamw and lion");
      }
    }
  }
  STRATA_ASSIGN_OR_RETURN(
      std::string grads,
      ParseChoiceOption("--grads", f.grads, {"host", "nvme"}));
  c.nvme_grads = grads == "nvme";
  STRATA_ASSIGN_OR_RETURN(
      std::string begin,
      ParseChoiceOption("--begin-step", f.begin_step, {"off", "on"}));
  c.begin_step = begin == "on";
  c.dir = f.dir;
  STRATA_ASSIGN_OR_RETURN(SwapIoConfig io, ParseSwapIoFlags(f.io));
  c.engine = io.engine;
  c.queue_depth = io.queue_depth;
  c.block_size = io.block_size;
  STRATA_ASSIGN_OR_RETURN(int64_t threads,
                          ParseIntOption("--threads", f.threads, 0, 4096));
  c.threads = static_cast<int>(threads);
  STRATA_ASSIGN_OR_RETURN(int64_t reps,
                          ParseIntOption("--reps", f.reps, 1, 100));
  c.reps = static_cast<int>(reps);
  c.json = f.json;
  return c;
}

SwapIoConfig IoOf(const StepConfig& c) {
  return {c.engine, c.queue_depth, c.block_size};
}

// One run of the cases: an optimizer and its moment format.
struct Run {
  CpuOptimizerAlgo algo = CpuOptimizerAlgo::kAdamW;
  CpuDType moments = CpuDType::kFloat32;
};

std::vector<Run> Runs(const StepConfig& c) {
  std::vector<Run> out;
  for (CpuOptimizerAlgo a : c.optimizers) {
    for (CpuDType m : c.moments) out.push_back({a, m});
  }
  return out;
}

// The lr of every step (Adafactor's relative step, its default, ignores it).
constexpr double kStepLr = 1e-4;

// The optimizer of a run: the library's defaults (Adafactor's are HF
// transformers'), SM3 without momentum.
CpuOptimizerOptions OptimizerOf(const StepConfig& c, CpuOptimizerAlgo a) {
  CpuOptimizerOptions o;
  o.algo = a;
  o.threads = c.threads;
  if (a == CpuOptimizerAlgo::kSm3) o.beta1 = 0.0;
  return o;
}

// A tensor of n parameters: rows of 4096 (a matrix for Adafactor and SM3,
// the same elements for the others) when they divide it, else a vector.
constexpr uint64_t kCols = 4096;
CpuStepShape ShapeOf(uint64_t n, const Run& run) {
  CpuStepShape s;
  s.n = n;
  if (n % kCols == 0) {
    s.rows = n / kCols;
    s.cols = kCols;
  }
  s.moment_dtype = run.moments;
  return s;
}

// The bytes of one tensor's master and moments per element: what the nvme
// case reads, and writes, of it per step. Adam's family keeps both moment
// roles (Note [Moment formats] in memtier/engine.cc); Adafactor and SM3
// only a first moment, if any, their statistics resting on the host.
uint64_t TensorStateBytes(const StepConfig& c, const Run& run, uint64_t n) {
  if (!CpuOptimizerIsFactored(run.algo)) {
    return n * 4 + 2 * CpuStateBytes(run.moments, n);
  }
  const StatusOr<CpuStepFootprint> fp =
      CpuStepFootprintOf(OptimizerOf(c, run.algo), ShapeOf(n, run));
  return n * 4 + (fp.ok() ? fp->exp_avg_bytes : 0);
}

// The bytes of every tensor's: the engine's pieces are its tensors here
// (kTensorElems of fp32 fill the automatic staging buffer), so the moments
// are counted per tensor.
uint64_t StateBytes(const StepConfig& c, const Run& run) {
  uint64_t bytes = 0;
  for (uint64_t done = 0; done < c.params; done += kTensorElems) {
    bytes += TensorStateBytes(c, run, std::min(kTensorElems, c.params - done));
  }
  return bytes;
}

// Bytes each case keeps in RAM: the host gradient (4 per parameter, unless
// it rests on NVMe) and working copy (2), plus master and moments when they
// rest there.
uint64_t HostBytes(const StepConfig& c, bool nvme, const Run& run) {
  return c.params * (c.nvme_grads ? 2 : 6) + (nvme ? 0 : StateBytes(c, run));
}

// The bytes a case's step moves through the drive: the master and moments
// read and written (the nvme case), and the gradients read back when they
// rest there, once for the update and once more for Adafactor's statistics
// (its rows of kCols sum the RMS with them: Note [Whole rows from pieces]
// in memtier/factored.cc).
struct CaseIo {
  uint64_t read = 0, write = 0;
  uint64_t total() const { return read + write; }
  bool even() const { return total() > 0 && read == write; }
  double read_share() const {
    return total() == 0
               ? 0.0
               : static_cast<double>(read) / static_cast<double>(total());
  }
};

CaseIo IoOfCase(const StepConfig& c, bool nvme, const Run& run) {
  CaseIo io;
  if (nvme) io.read = io.write = StateBytes(c, run);
  if (c.nvme_grads) {
    // Adafactor's statistics pass reads them once more, unless it ran
    // during the hand-overs (--begin-step on).
    const uint64_t reads =
        run.algo == CpuOptimizerAlgo::kAdafactor && !c.begin_step ? 2 : 1;
    io.read += reads * c.params * 4;
  }
  return io;
}

Status CheckStep(const StepConfig& c, RunGuard& guard, JsonOutput* json) {
  if (!c.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(*json, JsonOutput::Prepare("--json", c.json));
  }
  if (c.uses_dir()) {
    STRATA_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(c.dir, kLockName));
    guard.AdoptLock(std::move(lock));
    STRATA_ASSIGN_OR_RETURN(uint64_t free_bytes, FreeBytes(c.dir));
    // The swap space (the widest format's states when the nvme case runs,
    // the gradients with --grads nvme, plus slack) and the scratch file of
    // the I/O measurement.
    uint64_t states = 0;
    if (c.has("nvme")) {
      for (const Run& r : Runs(c)) states = std::max(states, StateBytes(c, r));
    }
    const uint64_t need =
        states + (c.nvme_grads ? c.params * 4 : 0) + (uint64_t{2} << 30);
    if (need > free_bytes) {
      return Status::NoSpace("--dir " + c.dir + ": the run needs " +
                             FormatBytes(need) + ", " +
                             FormatBytes(free_bytes) + " are free");
    }
  }
  uint64_t most = 0;
  for (const std::string& k : c.cases) {
    for (const Run& r : Runs(c)) {
      most = std::max(most, HostBytes(c, k == "nvme", r));
    }
  }
  return CheckMemory(
      "step's host arrays (--params " + std::to_string(c.params) + ")",
      most + (uint64_t{1} << 30));
}

// ---- The limits ---------------------------------------------------------

// Parameters the update-rate sample runs on: as many as the step when
// `share` of MemAvailable holds their arrays, else as many as it holds, at
// least one piece. At 64 Mi parameters against a step of 256 Mi the
// sample's rate moved by a third between runs while the step's did not,
// and int8 moments ran faster in the step than in the sample: the bound
// must run on arrays of the step's size to be one.
uint64_t SampleParams(const StepConfig& c, const Run& run, double share) {
  const uint64_t per_param =
      4 + 4 + 2 + 2 * CpuStateBytes(run.moments, kTensorElems) / kTensorElems +
      1;
  const auto avail = static_cast<uint64_t>(
      static_cast<double>(MemAvailableBytes().value_or(0)) * share);
  const uint64_t fits = avail / per_param / kTensorElems * kTensorElems;
  return std::min(c.params, std::max(fits, kTensorElems));
}

// The optimizer's own rate, params/s: the gradient-norm pass plus the fused
// update, on unpinned arrays in RAM, in the engine's pieces and moment
// format, best of five: a bound must not be measured less favourably than
// the step it bounds.
//
// Note [The update sample]
// Where the sample runs decides what it measures:
// - Beside the engine, around every step, when arrays of the step's size fit
//   in half of MemAvailable with the engine's held: each step then has a
//   rate of its own (`paired`). On a virtual machine the same kernel ran up
//   to 3x slower on small arrays once the process held a gigabyte more, and
//   one sample's rate moved by 20% from run to run, so a bound sampled
//   fewer times than the step it bounds was beaten.
// - Otherwise after the steps, once the engine is destroyed, on the memory
//   it freed (as many parameters as 80% of MemAvailable holds, the step's
//   when they fit), measured --reps times. A smaller sample beside the
//   engine is no bound: the host case at 1G parameters sampled 117 Mi of
//   them beside its engine at 2.6-2.9 Gparams/s, over twice the step's own
//   rate, where a sample of the step's size ran at 1.0-1.6.
// Even so, on a virtual machine the memory's rate is not the machine's
// alone: a plain two-thread read of a fresh 16 GiB allocation ran at 34 GB/s
// over its first 4 GiB and 57 GB/s over the rest, and at 32-34 GB/s over all
// of it minutes later, and one sample of 1 Gi parameters took 0.36-1.02 s
// from one pass to the next. Such swings move the efficiency either way:
// the sample's pages can be slower than the engine's as well as faster.
// The sample is allocated once per case and measured again in place:
// allocating and freeing gigabytes between steps set the kernel's page
// zeroing and reclaim on the steps that followed (one host step in three
// took 2-4x its time).
// Note [Settling]
// On a virtual machine whose freed memory goes back to the host (free page
// reporting, as Firecracker guests have), memory the process has just
// allocated is slow until the host has backed it again: one sample of 1 Gi
// parameters took 0.75, 0.65, 0.64, 0.74, 0.48 and then 0.36-0.40 s per
// pass. So the engine's warm-up steps and the sample's first passes repeat
// until two in a row agree within kSettled, at most kSettlePasses times,
// before anything is timed.
constexpr int kSettlePasses = 8;
constexpr double kSettled = 0.05;

// Runs `pass` (seconds per pass) until two passes in a row agree within
// kSettled, at most kSettlePasses times.
Status Settle(const std::function<StatusOr<double>()>& pass) {
  double last = 0;
  for (int r = 0; r < kSettlePasses; ++r) {
    STRATA_ASSIGN_OR_RETURN(double s, pass());
    if (last > 0 && std::abs(s - last) <= kSettled * last) break;
    last = s;
  }
  return Status::Ok();
}

class UpdateSample {
 public:
  static StatusOr<UpdateSample> Create(const StepConfig& c, const Run& run,
                                       uint64_t params) {
    UpdateSample s;
    s.run_ = run;
    s.n_ = params;
    s.update_only_ = c.begin_step;
    // Each piece's moments are one state array of the format.
    s.piece_state_ = CpuStateBytes(run.moments, kTensorElems);
    const uint64_t pieces = (s.n_ + kTensorElems - 1) / kTensorElems;
    HostBufferOptions o;
    o.prefault = true;
    o.pin = false;  // the CPU alone touches them; the pinned peak is the
                    // engine's
    STRATA_ASSIGN_OR_RETURN(s.master_, HostBuffer::Allocate(s.n_ * 4, o));
    STRATA_ASSIGN_OR_RETURN(s.grad_, HostBuffer::Allocate(s.n_ * 4, o));
    STRATA_ASSIGN_OR_RETURN(s.m_,
                            HostBuffer::Allocate(pieces * s.piece_state_, o));
    STRATA_ASSIGN_OR_RETURN(s.v_,
                            HostBuffer::Allocate(pieces * s.piece_state_, o));
    STRATA_ASSIGN_OR_RETURN(s.w_, HostBuffer::Allocate(s.n_ * 2, o));
    std::fill_n(reinterpret_cast<float*>(s.grad_.data()), s.n_, 0.01f);
    const CpuOptimizerOptions oo = OptimizerOf(c, run.algo);
    STRATA_ASSIGN_OR_RETURN(s.opt_, NewCpuOptimizer(oo));
    if (CpuOptimizerIsFactored(run.algo)) {
      // Each piece a tensor of the engine's shape, with its statistics and
      // its carried sum of squares, as the engine keeps them.
      for (uint64_t b = 0; b < s.n_; b += kTensorElems) {
        STRATA_ASSIGN_OR_RETURN(
            CpuStepFootprint fp,
            CpuStepFootprintOf(oo,
                               ShapeOf(std::min(kTensorElems, s.n_ - b), run)));
        s.stats_.emplace_back(fp.exp_avg_sq_bytes / 4, 0.0f);
        s.param_sq_.push_back(-1.0);
      }
    }
    return s;
  }

  // Note [Settling].
  Status Settle() {
    return strata::bench::Settle([this] { return Pass(); });
  }

  // The best of five passes, in params/s.
  StatusOr<double> Measure() {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      STRATA_ASSIGN_OR_RETURN(double s, Pass());
      best = std::min(best, s);
    }
    return static_cast<double>(n_) / best;
  }

  uint64_t params() const { return n_; }

 private:
  // One pass over the sample, in seconds.
  StatusOr<double> Pass() {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    CpuStepArgs a;
    a.check_overflow = false;
    a.step = ++steps_;
    const auto t0 = Clock::now();
    // --begin-step on: what the engine took during backward is left out:
    // the norm pass and Adafactor's statistics pass over each matrix.
    double early_s = 0;
    for (uint64_t b = 0; !update_only_ && b < n_; b += kTensorElems) {
      const uint64_t k = std::min(kTensorElems, n_ - b);
      STRATA_RETURN_IF_ERROR(
          opt_->ComputeGradStats(grad_.data() + b * 4, CpuDType::kFloat32, k)
              .status());
    }
    for (uint64_t b = 0; b < n_; b += kTensorElems) {
      const size_t piece = b / kTensorElems;
      CpuOptimizerTensors t;
      t.n = std::min(kTensorElems, n_ - b);
      t.master = reinterpret_cast<float*>(master_.data()) + b;
      t.grad = grad_.data() + b * 4;
      t.exp_avg = m_.data() + piece * piece_state_;
      t.exp_avg_sq = v_.data() + piece * piece_state_;
      t.moment_dtype = run_.moments;
      t.working = w_.data() + b * 2;
      if (CpuOptimizerIsFactored(run_.algo)) {
        const CpuStepShape shape = ShapeOf(t.n, run_);
        t.rows = shape.rows;
        t.cols = shape.cols;
        t.exp_avg_sq = stats_[piece].data();
        a.param_sq = param_sq_[piece];
      }
      STRATA_ASSIGN_OR_RETURN(CpuStepResult r, opt_->Step(t, a));
      if (CpuOptimizerIsFactored(run_.algo)) param_sq_[piece] = r.param_sq;
      if (update_only_ && t.rows > 1) {
        for (int p = 0; p + 1 < r.passes; ++p) early_s += r.pass_seconds[p];
      }
    }
    return SecondsSince(t0) - early_s;
  }

  Run run_;
  bool update_only_ = false;
  uint64_t n_ = 0, piece_state_ = 0;
  int64_t steps_ = 0;
  HostBuffer master_, grad_, m_, v_, w_;
  // Adafactor and SM3: each piece's statistics and sum of squares.
  std::vector<std::vector<float>> stats_;
  std::vector<double> param_sq_;
  std::unique_ptr<CpuOptimizer> opt_;
};

// ---- The step -------------------------------------------------------------

// --begin-step on: waits until the engine has taken the gradient stats of
// `want` units in all (EngineStats::early_statistics), as a backward that
// hides them would.
Status WaitEarlyStatistics(Engine& engine, uint64_t want) {
  const auto t0 = Clock::now();
  while (engine.stats().early_statistics < want) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    if (SecondsSince(t0) > 600) {
      return Status::Internal("step: the engine took the gradient stats of " +
                              std::to_string(engine.stats().early_statistics) +
                              " of " + std::to_string(want) +
                              " units during backward in 600 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Status::Ok();
}

// Note [Bracketed samples]
// Each timed step is bounded by the faster of the rates sampled just before
// it and just after it (the samples after one step are those before the
// next). On a virtual machine (2 vCPUs of an EPYC, 24 GiB) the memory's
// rate moved within a second: over 20 host steps of 256 Mi parameters the
// step took 0.165 to 0.289 s and the update sample 0.164 to 0.255 s. With
// the samples after each step alone, 2 of those 20 steps beat their own
// bound, by 11% and 18%, and each came right after samples at least as fast
// as it was; in a run of 4 steps the fastest beat the fastest sample by 3%.
// Bracketed, runs of 6 steps gave figures of 0.92-0.96 (best) and
// 0.79-0.90 (paired), one step of 18 at 1.007 of its own bound.
//
// One timed step and the rates that bound it.
struct RepSample {
  double step_s = 0;
  double update_rate = 0;  // params/s
  double io_rate = 0;      // bytes/s; 0 where nothing moves through the drive
};

struct CaseResult {
  std::string name;
  Run run;
  double step_s = 0, io_s = 0, update_s = 0;
  CaseIo io;                    // bytes through the drive a step
  double io_rate = 0;           // bytes/s at the case's share of reads
  double update_rate = 0;       // params/s: Note [The update sample]
  uint64_t sample_params = 0;   // the update-rate sample's size
  bool sample_beside = true;    // sampled beside the engine, around each step
  std::vector<RepSample> reps;  // each step, with the rates that bound it
  // The rates as sampled: before the first timed step, then after each (the
  // update rate 0 where the case samples it after the engine).
  std::vector<RepSample> rate_samples;
  std::vector<double> paired;  // each rep's bound / its step time
  // The process's page-locked bytes at their most, from the engine's
  // creation through every step (HostBuffer::PeakPinnedBytes, read before
  // the bench's own measurements allocate), and what the configuration
  // asks for: the host-resident roles and the staging buffers.
  uint64_t pinned_peak = 0, pinned_asked = 0;
  EngineStats stats;
  double bound_s() const { return std::max(io_s, update_s); }
};

// The case's bound at these rates (io_rate is ignored by a case that moves
// nothing through the drive).
double BoundSeconds(const StepConfig& c, const CaseResult& r,
                    double update_rate, double io_rate) {
  const double update_s = static_cast<double>(c.params) / update_rate;
  if (r.io.total() == 0) return update_s;
  return std::max(update_s, static_cast<double>(r.io.total()) / io_rate);
}

StatusOr<CaseResult> RunCase(const StepConfig& c, bool nvme, const Run& run,
                             RunGuard& guard) {
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  const uint64_t tensor = std::min(c.params, kTensorElems);
  dopt.memory_budget_bytes = tensor * 4 + (uint64_t{128} << 20);
  HostBuffer::ResetPeakPinnedBytes();
  const uint64_t pinned_before = HostBuffer::TotalPinnedBytes();
  STRATA_ASSIGN_OR_RETURN(auto device, NewHostEmulatedDevice(dopt));
  EngineOptions o;
  o.params = Residence::kHost;
  o.optimizer_states = nvme ? Residence::kNvme : Residence::kHost;
  o.grads = c.nvme_grads ? Residence::kNvme : Residence::kHost;
  if (nvme || c.nvme_grads) o.nvme_paths = {c.dir};
  o.io.backend = c.engine;
  o.io.queue_depth = c.queue_depth;
  o.io_block_bytes = c.block_size;
  o.device_budget_bytes = uint64_t{64} << 20;
  o.optimizer.cpu = OptimizerOf(c, run.algo);
  o.optimizer.moment_dtype = run.moments;
  STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(o, device.get()));
  std::vector<TensorId> ids;
  for (uint64_t done = 0; done < c.params; done += tensor) {
    const CpuStepShape shape = ShapeOf(std::min(tensor, c.params - done), run);
    TensorSpec s;
    s.name = "p" + std::to_string(ids.size());
    s.shape = {static_cast<int64_t>(shape.n)};
    if (shape.rows > 0) {
      s.shape = {static_cast<int64_t>(shape.rows),
                 static_cast<int64_t>(shape.cols)};
    }
    STRATA_ASSIGN_OR_RETURN(TensorId id, engine->Register(s));
    ids.push_back(id);
  }
  std::fprintf(stderr,
               "step: %s case, %s, %s moments, %zu tensors; laying out\n",
               nvme ? "nvme" : "host",
               std::string(CpuOptimizerAlgoName(run.algo)).c_str(),
               std::string(MomentDTypeName(run.moments)).c_str(), ids.size());
  STRATA_RETURN_IF_ERROR(engine->Start());
  STRATA_ASSIGN_OR_RETURN(auto stream, device->NewStream({}));
  STRATA_ASSIGN_OR_RETURN(DeviceMemory grad,
                          device->Allocate(tensor * 4, *stream));
  STRATA_RETURN_IF_ERROR(device->MemsetAsync(*stream, grad.data(), 0x3c,
                                             tensor * 4));  // ~0.0115
  CaseResult r;
  r.name = nvme ? "nvme" : "host";
  r.run = run;
  r.io = IoOfCase(c, nvme, run);
  r.step_s = 1e30;
  std::optional<UpdateSample> update_sample;
  // One step with every gradient handed over first (outside the timing), in
  // seconds; the pinned peak is taken over it.
  auto one_step = [&]() -> StatusOr<double> {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    StepArgs a;
    a.lr = kStepLr;
    const EngineStats before = engine->stats();
    if (c.begin_step) STRATA_RETURN_IF_ERROR(engine->BeginStep(a));
    for (TensorId id : ids) {
      STRATA_RETURN_IF_ERROR(
          engine->AddGrad(id, grad.data(), ElementType::kFloat32, *stream));
    }
    STRATA_RETURN_IF_ERROR(engine->WaitGrads());
    if (c.begin_step && !c.nvme_grads) {
      // Each tensor is a unit of its own.
      STRATA_RETURN_IF_ERROR(
          WaitEarlyStatistics(*engine, before.early_statistics + ids.size()));
    } else if (c.begin_step && run.algo == CpuOptimizerAlgo::kAdafactor) {
      // On NVMe the accumulator passed each matrix as it added it.
      const uint64_t passed =
          engine->stats().early_passes - before.early_passes;
      if (passed != ids.size()) {
        return Status::Internal(
            "step: the engine passed " + std::to_string(passed) + " of " +
            std::to_string(ids.size()) +
            " gradients during the hand-overs (--begin-step on)");
      }
    }
    const auto t0 = Clock::now();
    STRATA_ASSIGN_OR_RETURN(StepResult sr, engine->Step(a));
    const double s = SecondsSince(t0);
    if (!sr.applied) return Status::Internal("step: the step was skipped");
    r.pinned_peak =
        std::max(r.pinned_peak, HostBuffer::PeakPinnedBytes() - pinned_before);
    return s;
  };
  // Note [Settling]: warm-up steps (the first one's pinned peak covers
  // Start), then the sample's first passes.
  STRATA_RETURN_IF_ERROR(Settle(one_step));
  // Note [The update sample]: beside the engine when one of the step's
  // size fits beside it, else once after the engine is gone. Decided after
  // the warm-up steps, so that SampleParams sees the memory the engine holds.
  const uint64_t beside_params = SampleParams(c, run, 0.5);
  const bool beside = beside_params == c.params;
  if (beside) {
    STRATA_ASSIGN_OR_RETURN(UpdateSample u,
                            UpdateSample::Create(c, run, beside_params));
    update_sample.emplace(std::move(u));
    STRATA_RETURN_IF_ERROR(update_sample->Settle());
  }
  // Note [Bracketed samples]: the rates once before the first step, then
  // after each.
  auto sample_rates = [&]() -> StatusOr<RepSample> {
    RepSample x;
    if (beside) {
      STRATA_ASSIGN_OR_RETURN(x.update_rate, update_sample->Measure());
    }
    if (r.io.total() > 0) {
      STRATA_ASSIGN_OR_RETURN(
          x.io_rate, MeasureIo(c.dir, kScratchName, IoOf(c), r.io.read_share(),
                               c.params * 24, guard));
    }
    return x;
  };
  STRATA_ASSIGN_OR_RETURN(RepSample first, sample_rates());
  r.rate_samples.push_back(first);
  for (int rep = 1; rep <= c.reps; ++rep) {
    HostBuffer::ResetPeakPinnedBytes();
    RepSample sample;
    STRATA_ASSIGN_OR_RETURN(sample.step_s, one_step());
    STRATA_ASSIGN_OR_RETURN(RepSample after, sample_rates());
    const RepSample& before = r.rate_samples.back();
    sample.update_rate = std::max(before.update_rate, after.update_rate);
    sample.io_rate = std::max(before.io_rate, after.io_rate);
    r.update_rate = std::max(r.update_rate, sample.update_rate);
    r.step_s = std::min(r.step_s, sample.step_s);
    r.reps.push_back(sample);
    r.rate_samples.push_back(after);
  }
  r.stats = engine->stats();
  r.pinned_asked = HostBytes(c, nvme, run) + r.stats.staging_bytes;
  if (!beside) {
    // The engine's memory back to the system first, so that the sample
    // runs on what the step's arrays occupied.
    engine.reset();
    grad = DeviceMemory();
    stream.reset();
    device.reset();
    const uint64_t n = SampleParams(c, run, 0.8);
    std::fprintf(stderr,
                 "step: sampling the optimizer's rate on %llu parameters "
                 "after the engine\n",
                 static_cast<unsigned long long>(n));
    STRATA_ASSIGN_OR_RETURN(UpdateSample u, UpdateSample::Create(c, run, n));
    update_sample.emplace(std::move(u));
    STRATA_RETURN_IF_ERROR(update_sample->Settle());
    for (int rep = 0; rep < c.reps; ++rep) {
      STRATA_ASSIGN_OR_RETURN(double rate, update_sample->Measure());
      r.update_rate = std::max(r.update_rate, rate);
    }
    for (RepSample& x : r.reps) x.update_rate = r.update_rate;
  }
  r.sample_params = update_sample->params();
  r.sample_beside = beside;
  return r;
}

struct StepOutcome {
  double io_rate = 0, update_rate = 0;
  std::vector<CaseResult> cases;
};

StatusOr<StepOutcome> RunStep(const StepConfig& c, RunGuard& guard) {
  StepOutcome out;
  if (c.even_io()) {
    std::fprintf(stderr, "step: measuring the I/O engine's rate\n");
    STRATA_ASSIGN_OR_RETURN(
        out.io_rate,
        MeasureMixedIo(c.dir, kScratchName, IoOf(c), c.params * 24, guard));
  }
  for (const Run& run : Runs(c)) {
    for (const std::string& k : c.cases) {
      STRATA_ASSIGN_OR_RETURN(CaseResult r,
                              RunCase(c, k == "nvme", run, guard));
      if (r.io.even()) {
        for (const RepSample& s : r.reps) {
          out.io_rate = std::max(out.io_rate, s.io_rate);
        }
      }
      out.cases.push_back(std::move(r));
    }
  }
  // Measured again after the cases, the best kept: the machine may have
  // been slower while the first sample ran.
  if (c.even_io()) {
    STRATA_ASSIGN_OR_RETURN(
        double io_again,
        MeasureMixedIo(c.dir, kScratchName, IoOf(c), c.params * 24, guard));
    out.io_rate = std::max(out.io_rate, io_again);
  }
  for (CaseResult& r : out.cases) {
    out.update_rate = std::max(out.update_rate, r.update_rate);
    r.update_s = static_cast<double>(c.params) / r.update_rate;
    if (r.io.total() > 0) {
      // The best of the case's samples at its share, and of the run's own
      // rate when that share is even (measured before and after the cases
      // too).
      r.io_rate = r.io.even() ? out.io_rate : 0;
      for (const RepSample& s : r.reps) {
        r.io_rate = std::max(r.io_rate, s.io_rate);
      }
      r.io_s = static_cast<double>(r.io.total()) / r.io_rate;
    }
    for (const RepSample& s : r.reps) {
      r.paired.push_back(BoundSeconds(c, r, s.update_rate, s.io_rate) /
                         s.step_s);
    }
  }
  return out;
}

Status ReportStep(const StepConfig& c, const StepOutcome& out,
                  JsonOutput& json) {
  Table table({"case", "optimizer", "moments", "state B/param", "params",
               "step s", "I/O s", "update s", "bound s", "efficiency", "paired",
               "NVMe GB read", "NVMe GB written", "pinned peak/asked",
               "hot allocs"});
  nlohmann::json results = nlohmann::json::array();
  std::vector<RatioFigure> figures;
  for (const CaseResult& r : out.cases) {
    const double eff = r.bound_s() / r.step_s;
    const double pinned_ratio = static_cast<double>(r.pinned_peak) /
                                static_cast<double>(r.pinned_asked);
    std::vector<double> paired = r.paired;
    const double paired_eff = Percentile(paired, 50);
    nlohmann::json reps = nlohmann::json::array();
    for (const RepSample& x : r.reps) {
      nlohmann::json one = {
          {"step_s", x.step_s},
          {"bound_s", BoundSeconds(c, r, x.update_rate, x.io_rate)},
          {"update_params_per_s", x.update_rate}};
      if (r.io.total() > 0) one["io_bytes_per_s"] = x.io_rate;
      reps.push_back(one);
    }
    nlohmann::json rate_samples = nlohmann::json::array();
    for (const RepSample& x : r.rate_samples) {
      nlohmann::json one = nlohmann::json::object();
      if (r.sample_beside) one["update_params_per_s"] = x.update_rate;
      if (r.io.total() > 0) one["io_bytes_per_s"] = x.io_rate;
      rate_samples.push_back(one);
    }
    const double per_param = static_cast<double>(StateBytes(c, r.run)) /
                             static_cast<double>(c.params);
    const std::string moments(MomentDTypeName(r.run.moments));
    const std::string optimizer(CpuOptimizerAlgoName(r.run.algo));
    figures.push_back({r.name + " " + optimizer + " " + moments + " efficiency",
                       eff, paired_eff});
    table.AddRow({r.name, optimizer, moments, Fixed(per_param, 3),
                  std::to_string(c.params), Fixed(r.step_s, 3),
                  r.io.total() > 0 ? Fixed(r.io_s, 3) : "-",
                  Fixed(r.update_s, 3), Fixed(r.bound_s(), 3), Fixed(eff, 3),
                  Fixed(paired_eff, 3), Fixed(r.stats.nvme_read_bytes / 1e9, 2),
                  Fixed(r.stats.nvme_write_bytes / 1e9, 2),
                  Fixed(pinned_ratio, 3),
                  std::to_string(r.stats.hot_path_allocations)});
    results.push_back(
        {{"case", r.name},
         {"optimizer", optimizer},
         // Its hyper-parameters, as a DeepSpeed optimizer section.
         {"optimizer_config", nlohmann::json::parse(CpuOptimizerConfigJson(
                                  {OptimizerOf(c, r.run.algo), kStepLr}))},
         {"moments", moments},
         {"state_bytes_per_param", per_param},
         {"params", c.params},
         {"step_s", r.step_s},
         {"bound_s", r.bound_s()},
         {"io_s", r.io_s},
         {"io_read_bytes", r.io.read},
         {"io_write_bytes", r.io.write},
         {"io_read_share", r.io.read_share()},
         {"io_bytes_per_s", r.io_rate},
         {"update_s", r.update_s},
         {"update_params_per_s", r.update_rate},
         {"update_sample_params", r.sample_params},
         {"update_sampled", r.sample_beside ? "beside_engine" : "after_engine"},
         {"efficiency", eff},
         {"paired_efficiency", paired_eff},
         {"pinned_peak_bytes", r.pinned_peak},
         {"pinned_asked_bytes", r.pinned_asked},
         {"pinned_peak_to_asked", pinned_ratio},
         {"hot_path_allocations", r.stats.hot_path_allocations},
         {"reps", reps},
         {"rate_samples", rate_samples},
         {"engine_stats", nlohmann::json::parse(EngineStatsJson(r.stats))}});
  }
  std::printf(
      "strata-bench step: %llu params, gradients on %s, optimizer %.3f "
      "Gparams/s%s, best of %d (paired: the median of each step's bound "
      "sampled beside it / its time)\n%s",
      static_cast<unsigned long long>(c.params), c.nvme_grads ? "nvme" : "host",
      out.update_rate / 1e9,
      c.even_io() ? (", I/O (as many reads as writes at once) " +
                     Fixed(out.io_rate / 1e9, 2) + " GB/s")
                        .c_str()
                  : "",
      c.reps, table.ToString().c_str());
  PrintAboveOneNote(figures,
                    "the bound (the update alone on arrays in RAM, and the "
                    "drive alone)");
  if (!json.active()) return Status::Ok();
  std::vector<std::string> moment_names, optimizer_names;
  for (CpuDType m : c.moments) {
    moment_names.emplace_back(MomentDTypeName(m));
  }
  for (CpuOptimizerAlgo a : c.optimizers) {
    optimizer_names.emplace_back(CpuOptimizerAlgoName(a));
  }
  nlohmann::json j = {{"command", kCommand},
                      {"machine", MachineInfo()},
                      {"config",
                       {{"params", c.params},
                        {"cases", c.cases},
                        {"moments", moment_names},
                        {"optimizers", optimizer_names},
                        {"grads", c.nvme_grads ? "nvme" : "host"},
                        {"begin_step", c.begin_step},
                        // Adafactor as HF transformers' defaults, SM3
                        // without momentum; rows of this many columns.
                        {"sm3_momentum", 0.0},
                        {"tensor_cols", kCols},
                        {"dir", c.dir},
                        {"engine", std::string(IoBackendName(c.engine))},
                        {"queue_depth", c.queue_depth},
                        {"block_size", c.block_size},
                        {"threads", c.threads},
                        {"reps", c.reps},
                        {"tensor_elems", std::min(c.params, kTensorElems)},
                        {"working_rests_on", "host"}}},
                      {"limits", {{"update_params_per_s", out.update_rate}}},
                      {"results", results}};
  if (c.even_io()) j["limits"]["io_mixed_bytes_per_s"] = out.io_rate;
  if (c.uses_dir()) j["filesystem"] = FilesystemInfo(c.dir);
  return json.Commit(j);
}

int Main(int argc, char** argv) {
  CLI::App app{"an offloaded optimizer step beside its bound",
               "strata-bench step"};
  StepFlags flags;
  AddOptions(app, flags);
  StepConfig cfg;
  JsonOutput json;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseStep(flags));
        return Status::Ok();
      },
      [&](RunGuard& guard) { return CheckStep(cfg, guard, &json); },
      [&](RunGuard& guard) -> Status {
        STRATA_ASSIGN_OR_RETURN(StepOutcome out, RunStep(cfg, guard));
        return ReportStep(cfg, out, json);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("step",
                     "an offloaded optimizer step vs its I/O and "
                     "update bound",
                     Main);

}  // namespace strata::bench
