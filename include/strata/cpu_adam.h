// CPU optimizers for offloaded training: Adam, AdamW, Adagrad and Lion over
// fp32 master weights, in one fused, vectorized, multi-threaded pass that is
// bound by memory bandwidth, not by arithmetic; and Adafactor and SM3, whose
// second-moment statistics are one value per row and per column of a
// matrix (the caller gives its shape), in two passes (Adafactor: the
// statistics with the update's RMS for clipping, then the update; rows wider
// than 32768 columns take a third, for the RMS alone) or one (SM3).
//
// One Step() reads the master weights, the gradient and the optimizer state,
// writes the master weights and the state back in place and, optionally, a
// fp16/bf16 working copy of the updated weights into a caller buffer (e.g. a
// pinned staging buffer on its way to the GPU). Gradient unscaling
// (1/loss_scale) and a clip coefficient are applied in the same pass.
// The moments may be fp32, bf16, or 8-bit block-quantized (kBlock8: about
// 2 bytes per parameter for both, dequantized and requantized in the same
// pass). ComputeGradStats() is the separate read-only pass that gives the
// squared norm (for clipping) and detects inf/nan (for loss-scale overflow).
//
// Overflow contract: Step() returns a CpuStepResult with applied == false,
// and writes nothing at all, when the scaled gradient holds an inf or nan.
// An overflow is an expected event of fp16 training, so it is reported in the
// result, not as an error Status; a non-OK Status means a caller bug
// (null pointers, bad hyper-parameters, an unsupported variant).
//
// Numerics follow torch.optim (1.13) operation by operation: hyper-parameter
// scalars are formed in double and rounded once to float, and every kernel
// variant produces bit-identical results to the scalar reference
// (docs/cpu_adam.md).
//
// Kernel variants (scalar, AVX2+FMA+F16C, AVX-512, AVX-512 with the
// AVX512-BF16 conversion instructions) are chosen at run time from what the
// CPU supports. Options::variant or the environment variable
// STRATA_CPU_ADAM_VARIANT (scalar, avx2, avx512, avx512bf16) forces one.
#ifndef STRATA_CPU_ADAM_H_
#define STRATA_CPU_ADAM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/export.h"
#include "strata/status.h"

namespace strata {

// Element types of the arrays a CPU optimizer reads and writes.
enum class CpuDType : uint8_t {
  kFloat32,
  kFloat16,   // IEEE binary16
  kBFloat16,  // the upper 16 bits of a binary32
  // Optimizer state only (moment_dtype): 8-bit codes, one per element, with
  // one fp32 scale per block of kCpuBlock8Elems elements, in one flat array
  // of CpuStateBytes(kBlock8, n) bytes (docs/cpu_adam.md, "8-bit states").
  // Its update is not torch's operation order (it multiplies by
  // 1/sqrt(bias_correction2)), but every variant still matches scalar.
  kBlock8,
};

// Elements per scale of a kBlock8 state array.
inline constexpr size_t kCpuBlock8Elems = 2048;

// Bytes of one optimizer-state array of n elements: n * 4 (kFloat32),
// n * 2 (kFloat16, kBFloat16); for kBlock8 the n codes, padded to a multiple
// of 4 bytes, then ceil(n / kCpuBlock8Elems) fp32 scales. All zero bytes is
// the zero state.
STRATA_EXPORT size_t CpuStateBytes(CpuDType dtype, size_t n);

enum class CpuOptimizerAlgo : uint8_t {
  kAdam,     // torch.optim.Adam: L2 weight decay added to the gradient
  kAdamW,    // torch.optim.AdamW: decoupled weight decay on the weights
  kAdagrad,  // torch.optim.Adagrad (lr_decay 0): uses exp_avg_sq as the sum
  kLion,     // Lion (Chen et al. 2023), decoupled weight decay: uses exp_avg
  // Adafactor (Shazeer & Stern 2018) as HF transformers' Adafactor:
  // factored second moment (CpuAdafactorOptions; docs/cpu_adam.md).
  kAdafactor,
  // SM3-II (Anil et al. 2019), cover sets = the rows and the columns of a
  // matrix (one element each for a vector); momentum beta1 (0 = none).
  kSm3,
};

// "adam", "adamw", "adagrad", "lion", "adafactor", "sm3".
STRATA_EXPORT std::string_view CpuOptimizerAlgoName(CpuOptimizerAlgo a);
// Adafactor and SM3: statistics per row and column of a matrix (per
// element of a vector), no second moment per element; their Step needs the
// shape (CpuOptimizerTensors::rows, cols).
STRATA_EXPORT bool CpuOptimizerIsFactored(CpuOptimizerAlgo a);
// The inverse of CpuOptimizerAlgoName, case-insensitive; kInvalidArgument
// naming the accepted names otherwise.
STRATA_EXPORT StatusOr<CpuOptimizerAlgo> ParseCpuOptimizerAlgo(
    std::string_view name);

// Adafactor's hyper-parameters, with HF transformers' names and defaults.
struct CpuAdafactorOptions {
  double eps1 = 1e-30;  // added to g^2 before the statistics; >= 0
  double eps2 = 1e-3;   // lower bound of the parameter scale; >= 0
  // d: the update is divided by max(1, RMS(update) / d). > 0.
  double clip_threshold = 1.0;
  // beta2_t = 1 - t^decay_rate. In [-1, 0).
  double decay_rate = -0.8;
  // First-moment decay; 0 = no first moment (exp_avg unused). In [0, 1).
  double beta1 = 0.0;
  // On: lr = min(1e-2, 1 / sqrt(t)) (CpuStepArgs::lr ignored); off: the
  // step's lr.
  bool relative_step = true;
  // On: lr is multiplied by max(eps2, RMS(master before the step)).
  bool scale_parameter = true;
  // With relative_step: min(1e-6 * t, 1 / sqrt(t)) instead.
  bool warmup_init = false;
};

enum class CpuKernelVariant : uint8_t {
  kAuto,        // the best the CPU supports (or STRATA_CPU_ADAM_VARIANT)
  kScalar,      // portable reference; every other variant matches it bitwise
  kAvx2,        // AVX2 + FMA + F16C
  kAvx512,      // AVX-512 F/BW/VL/DQ, bf16 conversion in integer arithmetic
  kAvx512Bf16,  // kAvx512 plus AVX512-BF16 conversion instructions
};

// "auto", "scalar", "avx2", "avx512", "avx512bf16".
STRATA_EXPORT std::string_view CpuKernelVariantName(CpuKernelVariant v);
// The inverse of CpuKernelVariantName; kInvalidArgument otherwise.
STRATA_EXPORT StatusOr<CpuKernelVariant> ParseCpuKernelVariant(
    std::string_view name);
// Whether this CPU (and OS) can run `v`. kAuto and kScalar always can.
STRATA_EXPORT bool CpuKernelVariantSupported(CpuKernelVariant v);
// The fastest supported variant, ignoring the environment.
STRATA_EXPORT CpuKernelVariant BestCpuKernelVariant();

struct CpuOptimizerOptions {
  CpuOptimizerAlgo algo = CpuOptimizerAlgo::kAdamW;
  // Adam/AdamW: moment decay rates. Lion: beta1 interpolates the update
  // direction, beta2 decays the momentum. SM3: beta1 is the momentum (0 =
  // none; exp_avg unused). Unused by Adagrad and Adafactor.
  // Hyper-parameters are double, like the Python floats torch takes: the
  // derived scalars (1 - beta, lr / (1 - beta^t), ...) are formed in double
  // and rounded to float once, which is what makes results match torch.
  double beta1 = 0.9;
  double beta2 = 0.999;
  // Added to the denominator (Adam, AdamW, Adagrad, SM3). Must be >= 0.
  double eps = 1e-8;
  // L2 coefficient (Adam, Adagrad, SM3) or decoupled decay (AdamW, Lion,
  // Adafactor: p -= p * wd * lr of the step); >= 0.
  double weight_decay = 0.0;
  // Adam/AdamW: divide by (1 - beta^step). torch always does; off gives
  // DeepSpeed's bias_correction=False.
  bool bias_correction = true;
  // Kernel variant; kNotSupported from NewCpuOptimizer if the CPU lacks it.
  CpuKernelVariant variant = CpuKernelVariant::kAuto;
  // Worker threads of the optimizer's own oneTBB arena, including the
  // calling thread. 0 = all cores the process may use. The engine lowers it
  // to leave cores to I/O threads.
  int threads = 0;
  // Elements per parallel tile (rounded up to a multiple of 64). A tile is
  // the unit of work a thread streams through; 64 Ki elements keep the
  // per-tile arrays (about 2 MiB) near the L2 size while leaving hundreds
  // of tiles for load balance at the sizes where bandwidth matters.
  size_t tile_elems = size_t{1} << 16;
  // kBlock8 moments: how many sweeps the update makes over each block of
  // kCpuBlock8Elems elements. 1: one, the codecs, the moments and the
  // weights together. 2: the codecs and the moments first, each element's
  // step kept in an 8 KiB scratch, then the weights: shorter iterations
  // around the square root and the division, which a core with a small
  // out-of-order window overlaps better. 0 = the variant's own (2 on avx2,
  // 1 elsewhere; options() reports the one chosen). The same bits either
  // way: a tuning knob for a CPU the default was not measured on.
  int block8_sweeps = 0;
  CpuAdafactorOptions adafactor;  // kAdafactor only
};

// Whether `o` keeps exp_avg per element: Adam, AdamW and Lion; Adafactor
// with beta1 > 0 and SM3 with momentum (beta1) > 0; never Adagrad.
STRATA_EXPORT bool CpuOptimizerUsesExpAvg(const CpuOptimizerOptions& o);

// The arrays of one update: views the caller owns, all of length n,
// naturally aligned for their type. They must not overlap.
struct CpuOptimizerTensors {
  size_t n = 0;
  float* master = nullptr;  // fp32 master weights, updated in place
  const void* grad = nullptr;
  CpuDType grad_dtype = CpuDType::kFloat32;
  // Adam/AdamW: first and second moment. Adagrad: exp_avg_sq is the sum of
  // squares, exp_avg unused (may be null). Lion: exp_avg, exp_avg_sq unused.
  // Adafactor and SM3: exp_avg is the first moment / momentum (when beta1 >
  // 0), exp_avg_sq the fp32 row and column statistics (CpuStepFootprint
  // gives the sizes). Zero-initialized by the caller before step 1
  // (Adagrad: its initial accumulator value). Each holds
  // CpuStateBytes(moment_dtype, n) bytes (Adafactor, SM3: the footprint's).
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  // kFloat32, kBFloat16, or kBlock8 (Adam, AdamW and Lion only; 4-byte
  // aligned arrays). Adafactor and SM3: the type of exp_avg (kFloat32 or
  // kBFloat16); their statistics are always fp32.
  CpuDType moment_dtype = CpuDType::kFloat32;
  // Adafactor and SM3 only: the tensor is a row-major rows x cols matrix
  // (rows * cols == n), its statistics one per row and one per column.
  // rows == 0: a vector (cols ignored), statistics per element.
  size_t rows = 0;
  size_t cols = 0;
  // Optional working copy of the updated master (null: not written),
  // written with round-to-nearest-even. Written with non-temporal stores:
  // it is write-only here and read next by another device (DMA).
  void* working = nullptr;
  CpuDType working_dtype = CpuDType::kBFloat16;  // kFloat16 or kBFloat16
};

// Per-step values (they change over training).
struct CpuStepArgs {
  // The 1-based number of this step (bias correction; Adafactor's decay
  // and relative step; Adagrad, Lion and SM3 ignore it). The caller counts:
  // a skipped step does not count.
  int64_t step = 1;
  double lr = 1e-3;  // >= 0; Adafactor with relative_step ignores it
  // The gradient is multiplied by inv_loss_scale * clip_coef (rounded to
  // float) before use: 1/loss_scale of mixed precision and the
  // global-norm clip coefficient min(1, max_norm / norm). Finite, > 0.
  double inv_loss_scale = 1.0;
  double clip_coef = 1.0;
  // Run the inf/nan check (a read of the gradient) before updating. A
  // caller that already ran ComputeGradStats on the same gradient with the
  // same scale (it needs the norm for clipping anyway) may set this false to
  // save that read; an inf/nan then reaches the weights.
  bool check_overflow = true;
  // Adafactor with scale_parameter: the sum of the squares of `master` as
  // it is at this call, the CpuStepResult::param_sq of the Step that last
  // wrote it. The statistics pass then reads the gradient alone, not master
  // too: 4 bytes a parameter fewer each step. Pass it only while nothing
  // else has written master since that Step (a checkpoint load, another
  // optimizer); negative: not known, and the statistics pass sums it. NaN
  // and infinities are refused on every algorithm; the others ignore its
  // value.
  double param_sq = -1.0;
};

// What a Step moves, for predicting a step whose state rests on NVMe.
struct CpuStepShape {
  size_t n = 0;
  size_t rows = 0;  // as CpuOptimizerTensors
  size_t cols = 0;
  CpuDType grad_dtype = CpuDType::kFloat32;
  CpuDType moment_dtype = CpuDType::kFloat32;
  bool has_working = true;
  CpuDType working_dtype = CpuDType::kBFloat16;
  // Adafactor with scale_parameter: the step is given CpuStepArgs::param_sq,
  // so its statistics pass does not read master.
  bool param_sq_known = false;
};

struct CpuStepFootprint {
  // Bytes of the caller's state arrays (0: unused, may be null).
  size_t exp_avg_bytes = 0;
  size_t exp_avg_sq_bytes = 0;
  // Bytes read and written by one Step with check_overflow off (on adds
  // one read of the gradient), over all its passes: master, gradient,
  // state, working copy. The optimizer's own scratch (O(rows + cols), the
  // tiles' partial sums) is not counted.
  uint64_t read_bytes = 0;
  uint64_t written_bytes = 0;
  int passes = 0;  // passes over the gradient
};

// kInvalidArgument for a shape that does not match n, or a moment dtype the
// algorithm refuses.
STRATA_EXPORT StatusOr<CpuStepFootprint> CpuStepFootprintOf(
    const CpuOptimizerOptions& options, const CpuStepShape& shape);

// Adafactor sums the squares of its update (for clipping) in its statistics
// pass on matrices of up to this many columns and on vectors: two passes
// over the gradient per step. Wider rows take a third pass for them.
inline constexpr size_t kCpuAdafactorFusedRowCols = 32768;

// The most passes over the arrays one Step makes (Adafactor's three, on rows
// wider than kCpuAdafactorFusedRowCols).
inline constexpr int kCpuMaxStepPasses = 3;

struct CpuStepResult {
  // false: the scaled gradient held an inf or nan and nothing was written
  // (master, moments and working copy are as before the call).
  bool applied = false;
  // Where the call's time went, in wall seconds, so that a caller can hold
  // each pass against what its bytes allow: the inf/nan check (0 when not
  // run), then each pass that ran, in order (`passes` of them, as
  // CpuStepFootprint counts them: the Adam family and SM3 one; Adafactor
  // its statistics and the update, with the RMS of its update between them
  // on rows wider than kCpuAdafactorFusedRowCols). A pass is its
  // sweep over the threads alone: the O(rows + cols) reductions between
  // Adafactor's passes, validation and the rest of the call are in none of
  // them. Entries from `passes` on are 0; an overflow leaves passes 0.
  double check_seconds = 0.0;
  int passes = 0;
  double pass_seconds[kCpuMaxStepPasses] = {};
  // Adafactor with scale_parameter, when applied: the sum of the squares of
  // the updated master, summed in the update pass in double, the same bits
  // on every variant and thread count; for the next Step's
  // CpuStepArgs::param_sq. Negative otherwise; a step not applied left
  // master as it was, so the param_sq passed to it still holds.
  double param_sq = -1.0;
};

// Adafactor's and SM3's step over a tensor held in element ranges (an
// engine's pieces, one rank's shard of it): both need statistics of the
// whole tensor before any weight moves, so the step is cut into passes over
// every range, with the plan's `sums` reduced over the ranks between them.
// The passes in order, as `phase` names the next one:
//   Adafactor: kStatistics (the gradient's row and column sums; a vector's
//     statistics in place), kRms (a matrix: the sum of the update's
//     squares, for clipping), kUpdate (the weights);
//   SM3: kUpdate (the weights, and the new accumulators' row and column
//     maxima).
// A step of one tensor:
//   CpuFactoredPlan plan;
//   opt->FactoredBegin(shape, args, &plan);
//   while (plan.phase != CpuFactoredPhase::kDone) {
//     for each range: opt->FactoredPass(range, begin, &plan);
//     (ranks: plan.sums reduced element-wise, by plan.reduce, in rank order)
//     opt->FactoredNext(stats, &plan);
//   }
// A range's arrays (CpuOptimizerTensors master, grad, exp_avg, working)
// hold its t.n elements from the tensor's element `begin`; its rows and
// cols are the whole tensor's, and exp_avg_sq is the whole tensor's
// statistics (CpuStepFootprintOf's exp_avg_sq_bytes), the same array on
// every pass and FactoredNext. Adafactor's statistics and RMS passes read
// the gradient alone (and master for its squares when param_sq is not
// carried): master, exp_avg and working may be null there. The ranges of a
// pass must cover the tensor
// once, in any order and split (a rank covers its shard and the reduction
// the rest). The result matches Step over the whole tensor: SM3's bit for
// bit, Adafactor's up to the order of its sums (a few ulps; the same bits
// for the same ranges whatever the thread count). Adafactor reads its
// gradient in two passes, statistics and update, where every range is
// whole rows; the fused RMS needs whole rows, so the elements of a range
// before its first whole row and after its last take an RMS pass between
// the two (CpuFactoredPassReads says which ranges it reads; a range of
// fewer than two whole rows, or rows wider than kCpuAdafactorFusedRowCols,
// takes it whole). check_overflow is not run: check the gradient first
// (ComputeGradStats over every range).
enum class CpuFactoredPhase : uint8_t { kStatistics, kRms, kUpdate, kDone };
enum class CpuFactoredReduce : uint8_t { kSum, kMax };

struct CpuFactoredPlan {
  CpuFactoredPhase phase = CpuFactoredPhase::kDone;
  // What the ranges of the pass add up, to be reduced element-wise over the
  // ranks (with `reduce`) before FactoredNext. The optimizer's business
  // otherwise.
  std::vector<double> sums;
  CpuFactoredReduce reduce = CpuFactoredReduce::kSum;
  // Adafactor with scale_parameter, once kDone: the sum of the squares of
  // the updated weights (as CpuStepResult::param_sq, for the next step's
  // CpuStepArgs::param_sq); negative otherwise.
  double param_sq = -1.0;
  // Seconds spent in FactoredPass, all passes and ranges.
  double pass_seconds = 0.0;

  // The optimizer's, from FactoredBegin: the tensor, the step, the scalars
  // and factors formed between passes.
  size_t n = 0, rows = 0, cols = 0;
  CpuStepArgs args;
  double lr = 0.0, clip = 1.0;
  std::vector<float> row_factor, col_factor;
  // Adafactor: the elements [begin, end) whose RMS this rank's statistics
  // pass fused (sorted, disjoint), and, in kRms, the fused rows' sum of
  // the update's squares over every rank.
  std::vector<std::pair<size_t, size_t>> fused;
  double fused_sq = 0.0;
};

// The whole rows of the tensor's elements [begin, begin + n) whose RMS a
// FactoredPass over them fuses in Adafactor's statistics phase, as elements
// [b0, b1): two or more whole rows of at most kCpuAdafactorFusedRowCols
// columns; b0 == b1 when none do (another phase, a vector, wide rows, fewer
// than two whole rows). A caller that cuts a rank's part into pieces joins
// them into these rows, so that they fuse wherever the pieces cut them.
STRATA_EXPORT std::pair<size_t, size_t> CpuFactoredFusedRows(
    const CpuFactoredPlan& plan, size_t begin, size_t n);

// Whether FactoredPass over the tensor's elements [begin, begin + n) would
// read any of them in the plan's current phase: false in Adafactor's RMS
// pass for elements whose RMS this rank's statistics pass already fused
// (their whole rows), so that a caller whose gradients rest on a drive
// reads back only the rest. Passing such a range anyway is harmless.
STRATA_EXPORT bool CpuFactoredPassReads(const CpuFactoredPlan& plan,
                                        size_t begin, size_t n);

struct GradStats {
  // Sum of (g * scale)^2 over the elements, accumulated in double; inf or
  // nan when finite is false.
  double sum_sq = 0.0;
  // No element of g * scale is inf or nan.
  bool finite = true;
};

// A CPU optimizer with its own thread arena. Thread-compatible: calls on one
// object must not overlap (Step uses all of the arena's threads); distinct
// objects may be used concurrently.
class STRATA_EXPORT CpuOptimizer {
 public:
  virtual ~CpuOptimizer() = default;
  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  // One fused update of `t`. kInvalidArgument for null or mismatched
  // arrays, or non-finite lr/scale; see CpuStepResult for overflow.
  virtual StatusOr<CpuStepResult> Step(const CpuOptimizerTensors& t,
                                       const CpuStepArgs& args) = 0;

  // The read-only pass over `grad` (n elements of `dtype`), scaled by
  // `scale` (e.g. 1/loss_scale). Deterministic for a given n, tile size and
  // variant (partial sums are combined in a fixed order).
  virtual StatusOr<GradStats> ComputeGradStats(const void* grad, CpuDType dtype,
                                               size_t n,
                                               double scale = 1.0) = 0;

  // Adafactor's and SM3's step in ranges (CpuFactoredPlan). FactoredBegin
  // checks the step's arguments and the shape (n with rows and cols as
  // CpuOptimizerTensors) and starts the plan; kInvalidArgument for another
  // algorithm. FactoredPass runs the plan's phase over one range (`t`
  // holds elements [begin, begin + t.n) of the tensor); kInvalidArgument
  // for a range outside the tensor or arrays that do not match the plan.
  // FactoredNext, once every range has passed and `sums` is reduced,
  // forms what the next pass needs (and writes `stats`, the tensor's
  // statistics: Adafactor's row and column moving averages after
  // kStatistics, SM3's new accumulators after kUpdate).
  virtual Status FactoredBegin(const CpuStepShape& shape,
                               const CpuStepArgs& args,
                               CpuFactoredPlan* plan) = 0;
  virtual Status FactoredPass(const CpuOptimizerTensors& t, size_t begin,
                              CpuFactoredPlan* plan) = 0;
  virtual Status FactoredNext(float* stats, CpuFactoredPlan* plan) = 0;

  // Binds the pages of [ptr, ptr + n * elem_size) to the NUMA nodes whose
  // threads will update them (the same split of n that Step uses), so that
  // every thread streams node-local memory. Call it once per array before
  // the first step. A no-op on one-node machines.
  virtual Status PlaceOnNumaNodes(void* ptr, size_t elem_size, size_t n) = 0;

  virtual CpuKernelVariant variant() const = 0;
  virtual int threads() const = 0;
  virtual int numa_nodes() const = 0;
  virtual const CpuOptimizerOptions& options() const = 0;

 protected:
  CpuOptimizer() = default;
};

// kInvalidArgument for out-of-range hyper-parameters (betas outside [0, 1),
// negative eps or weight decay, threads < 0), kNotSupported when the forced
// variant is not supported by this CPU.
STRATA_EXPORT StatusOr<std::unique_ptr<CpuOptimizer>> NewCpuOptimizer(
    const CpuOptimizerOptions& options);

// Converts n elements from `src` to `dst` (any pair of CpuDType) on the
// calling thread: exact up-conversions, round-to-nearest-even
// down-conversions. fp32 -> bf16 flushes fp32 denormals to signed zero, as
// the AVX512-BF16 instruction does, and quiets NaNs; fp32 -> fp16 is IEEE
// (denormals kept, overflow to inf).
STRATA_EXPORT Status ConvertCpuArray(
    const void* src, CpuDType src_dtype, void* dst, CpuDType dst_dtype,
    size_t n, CpuKernelVariant variant = CpuKernelVariant::kAuto);

// An optimizer chosen by name, with the learning rate a config gives.
struct CpuOptimizerConfig {
  CpuOptimizerOptions options;
  double lr = 1e-3;  // CpuStepArgs::lr of a constant schedule
};

// Parses an optimizer section as DeepSpeed writes it (JSON text):
//   {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999],
//    "eps": 1e-8, "weight_decay": 0.01}}
// type: adam, adamw, adagrad, lion, adafactor or sm3, case-insensitive.
// DeepSpeed's "Adam" is AdamW unless params.adam_w_mode is false. params
// per type (others are refused): Adam/AdamW lr, betas, eps, weight_decay,
// bias_correction, adam_w_mode, amsgrad (false only); Lion lr, betas,
// weight_decay; Adagrad lr, eps, weight_decay; Adafactor lr, eps ([eps1,
// eps2]), clip_threshold, decay_rate, beta1 (null = none), weight_decay,
// scale_parameter, relative_step, warmup_init (HF transformers' names);
// SM3 lr, momentum, eps, weight_decay. Options not named keep `base`'s
// values (variant, threads, tiles). kInvalidArgument names the JSON path
// (`path`.params.betas[1], ...) and what it accepts.
STRATA_EXPORT StatusOr<CpuOptimizerConfig> ParseCpuOptimizerConfig(
    std::string_view json, std::string_view path = "optimizer",
    const CpuOptimizerOptions& base = {});

// Adafactor's options as a JSON object of the section's params keys above
// (eps as [eps1, eps2]; beta1 0 for none), for records of a run.
STRATA_EXPORT std::string CpuAdafactorParamsJson(const CpuAdafactorOptions& a);

// The optimizer section of `c` as ParseCpuOptimizerConfig reads it: its type
// and every params key of that type (Adam with adam_w_mode false; Adafactor's
// lr null with relative_step), so that a run's record names its whole
// optimizer and parsing it back gives the same algorithm, hyper-parameters
// and lr. The kernel variant, threads and tiles are not part of it.
STRATA_EXPORT std::string CpuOptimizerConfigJson(const CpuOptimizerConfig& c);

}  // namespace strata

#endif  // STRATA_CPU_ADAM_H_
