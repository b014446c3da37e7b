// Internal interface between the optimizer driver (cpu_adam.cc) and the
// per-ISA kernel translation units. Each kernels_<isa>.cc is compiled with
// its own -m flags and exports one KernelTable; the driver picks a table at
// run time after checking the CPU, so no code compiled for an ISA the CPU
// lacks is ever called.

#ifndef STRATA_CPU_ADAM_KERNELS_H_
#define STRATA_CPU_ADAM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "strata/cpu_adam.h"

namespace strata::cpu_adam {

// Per-step scalars, formed in double by the driver and rounded once to
// float, as torch does with Python floats.
struct StepParams {
  CpuOptimizerAlgo algo;
  CpuDType grad_dtype;
  CpuDType moment_dtype;
  CpuDType working_dtype;
  bool has_working;
  float gscale;        // inv_loss_scale * clip_coef
  float beta1;         // Adam: m decay. Lion: update interpolation
  float beta2;         // Adam: v decay. Lion: momentum decay
  float omb1;          // 1 - beta1
  float omb2;          // 1 - beta2
  float eps;           // Adam, Adagrad
  float l2;            // Adam, Adagrad: weight decay added to the gradient
  float decay;         // AdamW, Lion: 1 - lr * weight_decay
  bool use_l2;         // l2 != 0
  bool use_decay;      // decay != 1
  float neg_step;      // Adam: -lr / bias_correction1. Adagrad: -lr. Lion: -lr
  float bc2_sqrt;      // Adam: sqrt(bias_correction2)
  float inv_bc2_sqrt;  // Adam, kBlock8 moments: 1 / sqrt(bias_correction2)
  bool split8;         // kBlock8 moments: the update in two sweeps a block
};

// Raw array pointers of one update (types per StepParams).
struct StepArrays {
  size_t n;  // elements of the whole update (locates kBlock8 scales)
  float* master;
  const void* grad;
  void* m;
  void* v;
  void* working;
};

// ---- Factored optimizers (Adafactor, SM3) ---------------------------------
//
// A rows x cols matrix (a vector is 1 x n) is cut into a grid of tiles:
// bands of whole rows by strips of columns, fixed by the shape and the tile
// size only (never by the thread count), so that every reduction, done per
// tile and then in tile order, gives the same bits on any number of threads.

// Per-step scalars of the factored kernels (float, rounded once from double).
struct FactoredParams {
  CpuDType grad_dtype;
  CpuDType moment_dtype;  // exp_avg
  CpuDType working_dtype;
  bool has_working;
  bool use_m;       // first moment / momentum
  bool scale_p;     // Adafactor: the pass over the statistics sums p^2
  bool fuse_rms;    // Adafactor, a matrix: the statistics pass also sums
                    // rms_part (AdafactorFusesRms)
  bool sum_new_sq;  // Adafactor: the update pass sums the new weights'
                    // squares (CpuStepResult::param_sq)
  float gscale;     // inv_loss_scale * clip_coef
  float eps;        // Adafactor: eps1 (added to g^2). SM3: the denominator's
  float beta2;      // Adafactor: beta2_t
  float omb2;       // Adafactor: 1 - beta2_t
  float beta1;      // first moment / momentum
  float omb1;       // 1 - beta1
  float coef;       // Adafactor: lr / max(1, RMS(u) / d)
  float decay;      // Adafactor: -lr * weight_decay (fma into p)
  bool use_decay;
  float l2;  // SM3: weight decay added to the gradient
  bool use_l2;
  float neg_lr;  // SM3: -lr
};

struct FactoredArrays {
  size_t rows, cols;
  size_t strips;  // strips per band (row_part's stride)
  // The tensor's element that master, grad, m and working start at: 0 for
  // a whole tensor, a range's first element (Note [Factored steps in
  // ranges] in cpu_adam.cc); the fused statistics pass needs 0.
  size_t origin;
  float* master;
  const void* grad;
  void* m;
  float* row_state;  // rows
  float* col_state;  // cols
  void* working;
  // Scratch. Adafactor: row_part[rows * strips] (double) and, for rows >
  // 1, col_part[bands * cols] (double) of the sums of g^2 + eps1;
  // row_factor[rows] and col_factor[cols] for the update. SM3: the float
  // maxima in row_fpart / col_fpart.
  double* row_part;
  double* col_part;
  // Adafactor's fused RMS (fuse_rms): rms_part[bands * cols] (double) of
  // the sums over each band's rows of g^2 / R_i, R_i the row's new
  // statistic.
  double* rms_part;
  // With fuse_rms, each band's float sums of the group of rows it is adding
  // (AfGroupStride(cols) floats a band).
  float* group_part;
  float* row_fpart;
  float* col_fpart;
  const float* row_factor;
  float* col_factor;
};

// Rows [r0, r1) x columns [c0, c1); band and strip index the scratch.
struct TileRect {
  size_t r0, r1, c0, c1, band, strip;
};

// What Adafactor's statistics pass sums over a tile: the weights' squares
// (scale_p) and, for a vector, the squares of the update u = g / sqrt(v).
struct AfTileSums {
  double p_sq = 0.0;
  double u_sq = 0.0;
};

// Note [Adafactor's fused RMS]: the update u_ij = g_ij / sqrt(R_i C_j /
// mean(R)) is clipped by its RMS, which needs the new statistics of every
// row and column before any weight moves. Its square splits:
//
//   sum_ij u_ij^2 = mean(R) * sum_j (sum_i g_ij^2 / R_i) / C_j,
//
// and R_i is known once row i has been read. So the statistics pass, given
// each row whole in one tile, reads its rows again from cache right after
// their sums (each with the next row: a 2-byte gradient's, and an fp32
// gradient's of up to 1024 columns; wider fp32 rows a group of rows at a
// time: AdafactorLagsRows) and adds
// g_ij^2 / R_i into the band's rms_part (kernel_impl.h has the groups and
// what they cost); the driver
// then needs no pass of its own over the gradient for the RMS: two passes
// over it per step, not three. A vector's u is known element by element in the
// same pass. Rows wider than kCpuAdafactorFusedRowCols are cut into
// strips (for threads and caches) and keep the RMS pass.
// Where row i starts in the element arrays (master, grad, m, working),
// which begin at element `origin`: in unsigned arithmetic, so a range's
// first row, begun mid-way, wraps; its index row + j (j at least the
// range's first column) does not. Index as p + (row + j), never
// p + row + j.
inline size_t RowStart(const FactoredArrays& a, size_t i) {
  return i * a.cols - a.origin;
}

inline bool AdafactorFusesRms(size_t rows, size_t cols) {
  return rows <= 1 || cols <= kCpuAdafactorFusedRowCols;
}

// Whether the fused statistics pass reads each row again with the next one
// (into FactoredArrays::group_part) rather than a group of rows at a time:
// with gradients of 2 bytes an element at any width, and with rows of at
// most kAfLagRowBytes (1024 fp32 columns), where a row, the row before it
// and the float sums take 16 KiB, half the smallest L1 of the cores
// measured (the kernels decide on sizeof of their gradient type, the
// driver on DTypeSize, by this one rule). The kernel alone, one Zen 5
// core, 16384 x 4096, alternating runs: bf16 7.7-9.5 ms against 13.2-22.0
// (the grouped pass's slow mode on that host; 7.9-8.2 against 8.2-8.5 in
// its fast one); fp32 16-18 against 12.9-13.8, where those take 64 KiB
// and no longer fit L1. One Intel Xeon core with 48 KiB of L1 (AVX-512
// BF16), fp32, 128M parameters, the two forms in one process, best of 5,
// three or four alternating runs, ms, lagged against grouped:
//   avx512bf16, 512 columns 41.3-42.3 against 45.0-45.3; 1024 42.2-42.8
//     against 47.2-47.7; 2048 42.6-43.5 against 45.9-46.2; 4096 49.3-53.8
//     against 47.0-47.7 (slower, as on Zen 5);
//   avx2, 1024 columns 44.2-45.2 against 52.0-52.9; 2048 43.9-46.1
//     against 52.4-53.1;
//   avx512bf16 with the weights read (scale_parameter without the carried
//     sum), 1024 columns 92.8-94.5 against 115.6-118.6.
// 2048 columns gained on that core too, but their 32 KiB would fill a
// 32 KiB L1 (Zen 4, older Xeons), where nothing was measured; and up to
// 2048 columns both forms take groups of 32 rows, so the tests hold them
// to the same bits between 1025 and 2048 (Note [Groups of 32 rows]).
inline constexpr size_t kAfLagRowBytes = 4096;

constexpr bool AdafactorLagsRows(size_t grad_bytes, size_t cols) {
  return grad_bytes == 2 || cols * grad_bytes <= kAfLagRowBytes;
}

// Floats of FactoredArrays::group_part a band: two for each column, in
// blocks of 16 columns (the last one whole).
inline size_t AfGroupStride(size_t cols) { return (cols + 15) / 16 * 32; }

// A row's or a column's new Adafactor statistic from the old one and its
// sum of g^2 + eps1 over n elements: the driver's and the fused kernels'
// one expression.
inline float AdafactorStat(float old, float beta2, float omb2, double sum,
                           size_t n) {
  return old * beta2 + omb2 * static_cast<float>(sum / static_cast<double>(n));
}

struct KernelTable {
  CpuKernelVariant variant;
  // kBlock8 moments: the update's sweeps over each block that this variant
  // runs unless CpuOptimizerOptions::block8_sweeps says otherwise (Note
  // [The 8-bit update in two sweeps] in kernel_impl.h); 1 or 2.
  int block8_sweeps;
  // Updates elements [begin, end); with kBlock8 moments begin is a multiple
  // of kCpuBlock8Elems (the driver's tiles are). Non-temporal stores are fenced
  // before return, so completion of the call orders them for other threads.
  void (*step)(const StepParams& p, const StepArrays& a, size_t begin,
               size_t end);
  // Sum of squares (double) and whether all of [begin, end) of g * scale are
  // finite.
  void (*grad_stats)(const void* g, CpuDType dtype, size_t begin, size_t end,
                     float scale, double* sum_sq, bool* finite);
  // Converts n elements (src and dst types differ or are equal).
  void (*convert)(const void* src, CpuDType src_dtype, void* dst,
                  CpuDType dst_dtype, size_t n);
  // Adafactor pass 1: each row's sum over the tile of g^2 + eps1 into
  // row_part[i * strips + strip]; each column's into col_part[band * cols
  // + j] (rows > 1), or, for a vector, the column statistic's moving
  // average in place and its factor 1 / sqrt(col). With fuse_rms (whole
  // rows) each column's sum of g^2 / R_i into rms_part[band * cols + j].
  // Returns the tile's sums of master^2 (0 unless scale_p) and, for a
  // vector, of u^2.
  AfTileSums (*adafactor_stats)(const FactoredParams& p,
                                const FactoredArrays& a, const TileRect& t);
  // Adafactor's RMS pass when not fused: the tile's sum of u^2, u =
  // (row_factor * col_factor) * g.
  double (*adafactor_sumsq)(const FactoredParams& p, const FactoredArrays& a,
                            const TileRect& t);
  // Adafactor's last pass: the update of the tile's weights (and first moment,
  // working copy). Returns the tile's sum of the new weights' squares (0
  // unless sum_new_sq), in double, in the order of Note [The new weights'
  // squares] (kernel_impl.h): the same bits on every variant and address.
  double (*adafactor_apply)(const FactoredParams& p, const FactoredArrays& a,
                            const TileRect& t);
  // SM3's one pass: the weights (and momentum, working copy) of the tile,
  // the tile's row maxima into row_fpart[i * strips + strip], column maxima
  // into col_fpart[band * cols + j] (rows > 1) or, for a vector, the
  // accumulators in place.
  void (*sm3_step)(const FactoredParams& p, const FactoredArrays& a,
                   const TileRect& t);
};

const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();
const KernelTable& Avx512Bf16Kernels();

// The table of a supported variant (not kAuto); the caller checked support.
const KernelTable& KernelsFor(CpuKernelVariant v);

// What this CPU reports of AVX-512: F, BW, VL and DQ (`base`), and BF16 as
// well (`bf16`). Alone in cpu_support.cc, so that a program can link
// another answer ahead of the archive: tests/cpu_adam/avx512_emulated.cc,
// whose AVX-512 tables run on any AVX2 host. CpuKernelVariantSupported
// still requires AVX2, FMA and F16C under both.
struct CpuAvx512Report {
  bool base = false;
  bool bf16 = false;
};
CpuAvx512Report ReportCpuAvx512();

// Bytes per element of a fp32/fp16/bf16 array (1 for kBlock8 codes).
size_t DTypeSize(CpuDType t);

// The tiles of a factored update (see "Factored optimizers" above): `bands`
// bands of rb rows by `strips` strips of cb columns, numbered band-major.
struct Grid {
  size_t rows = 0, cols = 0, cb = 0, strips = 0, rb = 0, bands = 0;
  size_t tiles() const { return bands * strips; }
  TileRect Tile(size_t k) const;
};

// What a factored optimizer asks of its grid.
struct GridPolicy {
  // A matrix's rows are never cut into strips.
  bool whole_rows = false;
  // At most about this many column partial sums (bands x cols doubles, per
  // array), at least 64 bands.
  size_t partials = size_t{1} << 21;
};

// Adafactor with its RMS fused (Note [Adafactor's fused RMS], so at most
// kCpuAdafactorFusedRowCols columns): whole rows,
// and a quarter of the default partials per array, for it keeps two (its
// column sums and rms_part), and the driver adds them up on one thread
// after the pass. One Zen 5 VM, 16384 x 4096, `strata-bench adam`, two
// alternating runs: 512 bands (the default) 0.73-0.79 of the step's bound
// on one thread and 0.73-0.74 on two; 64 bands 0.81-0.85 and 0.80-0.81.
inline constexpr GridPolicy kAdafactorFusedGrid{true, size_t{1} << 18};

// The grid of a rows x cols matrix for tiles of about `tile` elements: a
// function of these and the policy only, never of the thread count.
Grid MakeGrid(size_t rows, size_t cols, size_t tile, const GridPolicy& gp);

// Factored statistics' shape: rows x cols, a vector (rows == 0) as 1 x n.
// kInvalidArgument when rows * cols != n.
Status FactoredShape(size_t n, size_t rows, size_t cols, size_t* r, size_t* c);

// Byte offset of the scales in a kBlock8 state array of n elements.
inline size_t Block8ScaleOffset(size_t n) { return (n + 3) / 4 * 4; }

}  // namespace strata::cpu_adam

#endif  // STRATA_CPU_ADAM_KERNELS_H_
