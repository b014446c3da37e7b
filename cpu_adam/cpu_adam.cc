// The optimizer driver: variant choice, argument checks, the per-step
// scalars, and the parallel split of an update into tiles over oneTBB.
//
// Parallel policy: the n elements are cut into tiles of tile_elems; a
// static_partitioner gives each arena thread one contiguous run of tiles, so
// each thread streams its own region (good for the hardware prefetchers and
// for NUMA locality) and the split is the same on every call. With more than
// one NUMA node (and tbbbind present), there is one arena per node, each
// constrained to its node's cores, and the element range is split between
// nodes in proportion to their threads; PlaceOnNumaNodes binds the pages of
// each node's share there.
#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cpu_adam/kernels.h"
#include "strata/cpu_adam.h"
#include "util/align.h"
#include "util/log.h"
#include "util/tsan_annotations.h"

// Note [TSan and oneTBB]: the distribution's libtbb is not built with
// ThreadSanitizer, so TSan cannot see the happens-before edges of a fork and
// join that happen inside it, and reports every access to the arrays as a
// race between the caller and the workers. ParallelTiles states those edges
// itself: the caller releases g_fork_sync before handing out tiles and each
// run of tiles acquires it; each run releases g_join_sync when done and the
// caller acquires it after the join. Races in oneTBB's own inline code are
// suppressed in tests/cpu_adam/tsan_suppressions.cc. The macros are
// util/tsan_annotations.h.

namespace strata {
namespace cpu_adam {

size_t DTypeSize(CpuDType t) {
  switch (t) {
    case CpuDType::kFloat32:
      return 4;
    case CpuDType::kFloat16:
    case CpuDType::kBFloat16:
      return 2;
    case CpuDType::kBlock8:
      break;
  }
  return 1;
}

const KernelTable& KernelsFor(CpuKernelVariant v) {
  switch (v) {
    case CpuKernelVariant::kAvx2:
      return Avx2Kernels();
    case CpuKernelVariant::kAvx512:
      return Avx512Kernels();
    case CpuKernelVariant::kAvx512Bf16:
      return Avx512Bf16Kernels();
    case CpuKernelVariant::kAuto:
    case CpuKernelVariant::kScalar:
      break;
  }
  return ScalarKernels();
}

Status FactoredShape(size_t n, size_t rows, size_t cols, size_t* r, size_t* c) {
  if (rows == 0) {
    *r = 1;
    *c = n;
    return Status::Ok();
  }
  if (cols == 0 || n / rows != cols || n % rows != 0) {
    return Status::InvalidArgument(
        "Step: rows x cols (" + std::to_string(rows) + " x " +
        std::to_string(cols) + ") must equal n (" + std::to_string(n) +
        "), or rows = 0 for a vector");
  }
  *r = rows;
  *c = cols;
  return Status::Ok();
}

Grid MakeGrid(size_t rows, size_t cols, size_t tile, const GridPolicy& gp) {
  Grid g;
  g.rows = rows;
  g.cols = cols;
  // Strips of at least 4096 columns (16 KiB of fp32 per row segment, long
  // enough for the prefetchers), wider when few rows make a tile.
  size_t cb = std::max<size_t>(4096, (tile + rows - 1) / rows);
  if (rows > 1 && gp.whole_rows) cb = cols;
  g.cb = cb < cols ? (cb + 15) / 16 * 16 : cols;
  g.strips = (cols + g.cb - 1) / g.cb;
  // At most bmax bands: their column partial sums (bands x cols doubles)
  // stay a small fraction of the matrix.
  const size_t bmax = std::min<size_t>(
      1024, std::max<size_t>(64, gp.partials / std::max<size_t>(1, cols)));
  size_t rb = std::max((tile + g.cb - 1) / g.cb, (rows + bmax - 1) / bmax);
  g.rb = std::max<size_t>(1, std::min(rb, rows));
  g.bands = (rows + g.rb - 1) / g.rb;
  return g;
}

TileRect Grid::Tile(size_t k) const {
  TileRect t;
  t.band = k / strips;
  t.strip = k % strips;
  t.r0 = t.band * rb;
  t.r1 = std::min(rows, t.r0 + rb);
  t.c0 = t.strip * cb;
  t.c1 = std::min(cols, t.c0 + cb);
  return t;
}

namespace {

bool IsAligned(const void* p, size_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// Calls emit(a, b) for each stretch [a, b) of [begin, end) that no span of
// `fused` (sorted by begin, disjoint) covers, in order.
template <class Emit>
void ForEachUnfused(const std::vector<std::pair<size_t, size_t>>& fused,
                    size_t begin, size_t end, Emit emit) {
  auto it = std::upper_bound(
      fused.begin(), fused.end(), begin,
      [](size_t v, const std::pair<size_t, size_t>& s) { return v < s.first; });
  if (it != fused.begin() && std::prev(it)->second > begin) --it;
  size_t at = begin;
  for (; it != fused.end() && it->first < end; ++it) {
    if (it->first > at) emit(at, it->first);
    at = std::max(at, it->second);
  }
  if (at < end) emit(at, end);
}

// Resolves kAuto (and STRATA_CPU_ADAM_VARIANT) and checks support.
StatusOr<CpuKernelVariant> ResolveVariant(CpuKernelVariant requested) {
  if (requested == CpuKernelVariant::kAuto) {
    const char* env = std::getenv("STRATA_CPU_ADAM_VARIANT");
    if (env != nullptr && *env != '\0') {
      auto parsed = ParseCpuKernelVariant(env);
      if (!parsed.ok()) {
        return parsed.status().WithContext("STRATA_CPU_ADAM_VARIANT");
      }
      requested = *parsed;
    }
  }
  if (requested == CpuKernelVariant::kAuto) return BestCpuKernelVariant();
  if (!CpuKernelVariantSupported(requested)) {
    return Status::NotSupported(
        std::string("CPU optimizer variant '") +
        std::string(CpuKernelVariantName(requested)) +
        "' needs instructions this CPU does not report (avx2: AVX2+FMA+F16C; "
        "avx512: AVX-512 F/BW/VL/DQ; avx512bf16: also AVX512-BF16)");
  }
  return requested;
}

// Addresses for the TSan annotations only (Note [TSan and oneTBB]).
char g_fork_sync = 0;
char g_join_sync = 0;

// One parallel call: fn(tile, begin, end) for the tiles of [0, n).
struct TileJob {
  const void* fn;
  void (*call)(const void* fn, size_t tile, size_t begin, size_t end);
  size_t n;
  size_t tile;
};

void RunTiles(const TileJob* job, size_t first, size_t last) {
  STRATA_TSAN_ACQUIRE(&g_fork_sync);
  for (size_t tile = first; tile != last; ++tile) {
    job->call(job->fn, tile, tile * job->tile,
              std::min(job->n, (tile + 1) * job->tile));
  }
  STRATA_TSAN_RELEASE(&g_join_sync);
}

// The parallel_for body. oneTBB copies it into its task after the caller's
// release, so reading its one field must stay uninstrumented; everything
// RunTiles touches is ordered by the annotations.
struct TileBody {
  const TileJob* job;
  __attribute__((no_sanitize_thread)) void operator()(
      const tbb::blocked_range<size_t>& r) const {
    RunTiles(job, r.begin(), r.end());
  }
};

// One arena per NUMA node in use (one in all on a single-node machine).
struct NodeArena {
  int threads = 0;
  int hwloc_node = -1;  // logical index of the NUMA node, -1 = unbound
  std::unique_ptr<tbb::task_arena> arena;
  tbb::task_group group;
};

class CpuOptimizerImpl final : public CpuOptimizer {
 public:
  CpuOptimizerImpl(const CpuOptimizerOptions& options, CpuKernelVariant variant)
      : options_(options), kernels_(&KernelsFor(variant)) {
    options_.variant = variant;
    if (options_.block8_sweeps == 0) {
      options_.block8_sweeps = kernels_->block8_sweeps;
    }
    tile_ = std::max<size_t>(64, (options_.tile_elems + 63) / 64 * 64);
    options_.tile_elems = tile_;
  }

  ~CpuOptimizerImpl() override {
    if (topology_ != nullptr) hwloc_topology_destroy(topology_);
  }

  Status Init() {
    threads_ = options_.threads > 0 ? options_.threads
                                    : tbb::info::default_concurrency();
    options_.threads = threads_;
    int hw_nodes = 1;
    if (hwloc_topology_init(&topology_) == 0 &&
        hwloc_topology_load(topology_) == 0) {
      hw_nodes =
          std::max(1, hwloc_get_nbobjs_by_type(topology_, HWLOC_OBJ_NUMANODE));
    } else if (topology_ != nullptr) {
      hwloc_topology_destroy(topology_);
      topology_ = nullptr;
    }
    // tbb::info::numa_nodes() loads tbbbind (with RTLD_DEEPBIND, which the
    // sanitizer runtimes refuse); only multi-node machines need it.
    std::vector<tbb::numa_node_id> tbb_nodes;
    if (hw_nodes > 1) tbb_nodes = tbb::info::numa_nodes();
    const bool per_node = hw_nodes > 1 && threads_ >= hw_nodes &&
                          static_cast<int>(tbb_nodes.size()) == hw_nodes &&
                          tbb_nodes[0] >= 0;
    if (hw_nodes > 1 && !per_node) {
      STRATA_LOG_ONCE(WARN,
                      "cpu_adam: {} NUMA nodes but oneTBB sees {} (tbbbind "
                      "missing?) or only {} threads; running one arena "
                      "without NUMA placement",
                      hw_nodes, tbb_nodes.size(), threads_);
    }
    const int nodes = per_node ? hw_nodes : 1;
    for (int k = 0; k < nodes; ++k) {
      arenas_.push_back(std::make_unique<NodeArena>());
      NodeArena& a = *arenas_.back();
      a.threads = threads_ / nodes + (k < threads_ % nodes ? 1 : 0);
      if (per_node) {
        a.hwloc_node = k;
        tbb::task_arena::constraints c;
        c.numa_id = tbb_nodes[k];
        c.max_concurrency = a.threads;
        a.arena = std::make_unique<tbb::task_arena>(c);
      } else {
        a.arena = std::make_unique<tbb::task_arena>(a.threads);
      }
    }
    return Status::Ok();
  }

  StatusOr<CpuStepResult> Step(const CpuOptimizerTensors& t,
                               const CpuStepArgs& args) override {
    if (CpuOptimizerIsFactored(options_.algo)) return FactoredStep(t, args);
    STRATA_RETURN_IF_ERROR(Validate(t, args));
    CpuStepResult result;
    if (t.n == 0) {
      result.applied = true;
      return result;
    }
    const cpu_adam::StepParams p = MakeParams(t, args);
    if (!CheckOverflow(t, args, p.gscale, result)) return result;
    const cpu_adam::StepArrays arrays{t.n,       t.master,     t.grad,
                                      t.exp_avg, t.exp_avg_sq, t.working};
    const auto step = kernels_->step;
    // kBlock8 blocks must not straddle tiles: a tile owns its blocks' scales.
    const size_t tile =
        t.moment_dtype == CpuDType::kBlock8
            ? (tile_ + kCpuBlock8Elems - 1) / kCpuBlock8Elems * kCpuBlock8Elems
            : tile_;
    TimePass(result, [&] {
      ParallelTiles(t.n, tile,
                    [&](size_t, size_t b, size_t e) { step(p, arrays, b, e); });
    });
    result.applied = true;
    return result;
  }

  StatusOr<GradStats> ComputeGradStats(const void* grad, CpuDType dtype,
                                       size_t n, double scale) override {
    if (n > 0 && grad == nullptr) {
      return Status::InvalidArgument("ComputeGradStats: null gradient");
    }
    if (dtype == CpuDType::kBlock8) {
      return Status::InvalidArgument(
          "ComputeGradStats: the gradient is kFloat32, kFloat16 or kBFloat16");
    }
    if (!IsAligned(grad, cpu_adam::DTypeSize(dtype))) {
      return Status::InvalidArgument("ComputeGradStats: misaligned gradient");
    }
    if (!std::isfinite(scale)) {
      return Status::InvalidArgument("ComputeGradStats: non-finite scale");
    }
    return GradStatsOf(grad, dtype, n, static_cast<float>(scale));
  }

  // Note [Factored steps in ranges]
  // A range [b, e) of a rows x cols tensor is cut into rectangles: the
  // tail of its first row when it begins mid-row, a grid of the whole rows
  // between (bands of rows by strips of columns, as Step's), the head of
  // its last row when it ends mid-row; a single row's segment (a vector's
  // range) into strips. The kernels index the range's arrays from its first
  // element (FactoredArrays::origin). Each rectangle writes its rows'
  // partials at row_part[i * strips + strip] (strips: the most strips any
  // row of the range has) and its columns' into its band of col_part (the
  // first row's rectangles share band 0, the last row's the last band:
  // they cover distinct columns). After the sweep the pass adds the
  // partials into the plan's sums rectangle by rectangle, in order (SM3:
  // their maxima), so a range gives the same bits on any thread count.
  // Adafactor's RMS takes a pass of its own over such rectangles; the whole
  // rows of a range fuse it (Note [Whole rows in a range]).
  struct RangeRects {
    std::vector<cpu_adam::TileRect> rects;
    size_t strips = 1;
    size_t bands = 0;
  };

  RangeRects CutRange(size_t cols, size_t b, size_t e) const {
    RangeRects out;
    const size_t seg = (std::max<size_t>(4096, tile_) + 15) / 16 * 16;
    // One row's segment [c0, c1), in strips of `seg` columns.
    auto segment = [&](size_t r, size_t c0, size_t c1, size_t band) {
      size_t strip = 0;
      for (size_t c = c0; c < c1; c += seg, ++strip) {
        out.rects.push_back({r, r + 1, c, std::min(c1, c + seg), band, strip});
      }
      out.strips = std::max(out.strips, strip);
    };
    const size_t first = b / cols, last = (e - 1) / cols;
    if (first == last) {
      segment(first, b % cols, (e - 1) % cols + 1, 0);
      out.bands = 1;
      return out;
    }
    size_t body0 = first, body1 = last + 1;
    if (b % cols != 0) {
      segment(first, b % cols, cols, 0);
      body0 = first + 1;
      out.bands = 1;
    }
    const bool tail = e % cols != 0;
    if (tail) body1 = last;
    if (body1 > body0) {
      const cpu_adam::Grid g =
          cpu_adam::MakeGrid(body1 - body0, cols, tile_, {});
      for (size_t k = 0; k < g.tiles(); ++k) {
        cpu_adam::TileRect t = g.Tile(k);
        t.r0 += body0;
        t.r1 += body0;
        t.band += out.bands;
        out.rects.push_back(t);
      }
      out.bands += g.bands;
      out.strips = std::max(out.strips, g.strips);
    }
    if (tail) {
      segment(last, 0, e % cols, out.bands);
      ++out.bands;
    }
    return out;
  }

  Status FactoredBegin(const CpuStepShape& shape, const CpuStepArgs& args,
                       CpuFactoredPlan* plan) override {
    if (plan == nullptr) {
      return Status::InvalidArgument("FactoredBegin: null plan");
    }
    if (!CpuOptimizerIsFactored(options_.algo)) {
      return Status::InvalidArgument(
          "FactoredBegin: " + std::string(CpuOptimizerAlgoName(options_.algo)) +
          " steps each range with Step; only Adafactor and SM3 step in "
          "passes");
    }
    STRATA_RETURN_IF_ERROR(
        ValidateFactoredArgs(args).WithContext("FactoredBegin"));
    size_t rows = 1, cols = shape.n;
    if (shape.n > 0) {
      STRATA_RETURN_IF_ERROR(
          cpu_adam::FactoredShape(shape.n, shape.rows, shape.cols, &rows, &cols)
              .WithContext("FactoredBegin"));
    }
    CpuFactoredPlan& p = *plan;
    p = CpuFactoredPlan{};
    p.n = shape.n;
    p.rows = rows;
    p.cols = cols;
    p.args = args;
    if (shape.n == 0) return Status::Ok();
    const size_t lines = rows + (rows > 1 ? cols : 0);
    if (options_.algo == CpuOptimizerAlgo::kAdafactor) {
      p.phase = CpuFactoredPhase::kStatistics;
      // Then the weights' and u's squares; a matrix's fused RMS partials
      // and the counts of the passes that did not fuse and that did (Note
      // [Whole rows in a range]).
      p.sums.assign(lines + 2 + (rows > 1 ? cols + 2 : 0), 0.0);
      p.row_factor.resize(rows);
      p.col_factor.resize(cols);
    } else {
      p.phase = CpuFactoredPhase::kUpdate;
      p.reduce = CpuFactoredReduce::kMax;
      p.sums.assign(lines, 0.0);
    }
    return Status::Ok();
  }

  Status FactoredPass(const CpuOptimizerTensors& t, size_t begin,
                      CpuFactoredPlan* plan) override {
    if (plan == nullptr || plan->phase == CpuFactoredPhase::kDone) {
      return Status::InvalidArgument(
          "FactoredPass: no pass is due (a null plan, one not begun, or "
          "done)");
    }
    CpuFactoredPlan& plan_ref = *plan;
    if (t.n == 0) return Status::Ok();
    if (begin > plan_ref.n || t.n > plan_ref.n - begin) {
      return Status::InvalidArgument(
          "FactoredPass: elements [" + std::to_string(begin) + ", " +
          std::to_string(begin + t.n) + ") are outside the tensor's " +
          std::to_string(plan_ref.n));
    }
    size_t rows = 0, cols = 0;
    STRATA_RETURN_IF_ERROR(
        cpu_adam::FactoredShape(plan_ref.n, t.rows, t.cols, &rows, &cols)
            .WithContext("FactoredPass"));
    if (rows != plan_ref.rows || cols != plan_ref.cols) {
      return Status::InvalidArgument(
          "FactoredPass: the range's rows x cols differ from the plan's");
    }
    // Adafactor's first passes read the weights only for their squares.
    const bool weights =
        plan_ref.phase == CpuFactoredPhase::kUpdate ||
        (plan_ref.phase == CpuFactoredPhase::kStatistics &&
         options_.adafactor.scale_parameter && plan_ref.args.param_sq < 0.0);
    STRATA_RETURN_IF_ERROR(
        ValidateFactoredArrays(t, weights).WithContext("FactoredPass"));
    const size_t end = begin + t.n;
    plan_ref.pass_seconds += SecondsOf([&] {
      if (plan_ref.phase == CpuFactoredPhase::kRms) {
        // Note [Whole rows in a range]: only what the statistics did not
        // fuse.
        ForEachUnfused(plan_ref.fused, begin, end, [&](size_t a, size_t b) {
          SegmentPass(t, begin, a, b, plan_ref);
        });
        return;
      }
      const auto [b0, b1] = CpuFactoredFusedRows(plan_ref, begin, t.n);
      if (b0 == b1) {
        SegmentPass(t, begin, begin, end, plan_ref);
        return;
      }
      if (begin < b0) SegmentPass(t, begin, begin, b0, plan_ref);
      FusedRangeStats(SubRange(t, b0 - begin, b1 - b0), b0, plan_ref);
      auto at = std::upper_bound(plan_ref.fused.begin(), plan_ref.fused.end(),
                                 std::make_pair(b0, b1));
      plan_ref.fused.insert(at, {b0, b1});
      if (b1 < end) SegmentPass(t, begin, b1, end, plan_ref);
    });
    return Status::Ok();
  }

  // Elements [off, off + n) of a range's arrays.
  static CpuOptimizerTensors SubRange(const CpuOptimizerTensors& t, size_t off,
                                      size_t n) {
    CpuOptimizerTensors s = t;
    s.n = n;
    if (s.master != nullptr) s.master += off;
    s.grad = static_cast<const std::byte*>(t.grad) +
             off * cpu_adam::DTypeSize(t.grad_dtype);
    if (s.exp_avg != nullptr) {
      s.exp_avg = static_cast<std::byte*>(t.exp_avg) +
                  off * cpu_adam::DTypeSize(t.moment_dtype);
    }
    if (s.working != nullptr) {
      s.working = static_cast<std::byte*>(t.working) +
                  off * cpu_adam::DTypeSize(t.working_dtype);
    }
    return s;
  }

  // The plan's pass over elements [a, b) of the range `t` (which begins at
  // the tensor's element `begin`), cut into rectangles (Note [Factored
  // steps in ranges]).
  void SegmentPass(const CpuOptimizerTensors& t, size_t begin, size_t a,
                   size_t b, CpuFactoredPlan& plan) {
    const CpuOptimizerTensors s = SubRange(t, a - begin, b - a);
    cpu_adam::FactoredParams p = FactoredParamsOf(s, plan.args);
    const RangeRects rr = CutRange(plan.cols, a, b);
    cpu_adam::FactoredArrays arrays =
        FactoredArraysOf(s, plan.rows, plan.cols, a);
    arrays.strips = rr.strips;
    RangePass(p, arrays, rr, plan);
  }

  // Note [Whole rows in a range]: Adafactor's statistics pass over the
  // whole rows of a range, when there are two or more of them (of at most
  // kCpuAdafactorFusedRowCols columns), sums what the update's RMS needs as
  // Step does (Note [Adafactor's fused RMS] in kernels.h), each column's
  // sum of g^2 / R_i into the plan, and records them in plan.fused. What
  // the range holds before its first whole row and after its last (a
  // rank's shard that begins or ends mid-row) passes on its own; the plan
  // counts such passes, and when no range of any rank took one the RMS
  // pass is skipped. Otherwise the RMS pass sums the update's squares over
  // what was not fused alone, and adds them to what the fused rows give
  // (CpuFactoredPassReads tells a caller which ranges it needs): a rank's
  // shard cut mid-row costs its first and last rows again, not the whole
  // shard. One rank's range of a whole tensor is its whole rows: over the
  // same grid and in the same order as Step, so that range gives Step's
  // statistics and update bit for bit (its weights' sum of squares, summed
  // over other tiles in the update, may differ in the last bits). Which
  // rows fuse is CpuFactoredFusedRows' rule, which callers share.

  // Where a matrix's plan keeps, after its lines and the two squares' sums,
  // the columns' fused RMS partials, then the count of the passes that did
  // not fuse and of those that did.
  static size_t RmsAt(const CpuFactoredPlan& plan) {
    return plan.rows + plan.cols + 2;
  }

  void FusedRangeStats(const CpuOptimizerTensors& t, size_t begin,
                       CpuFactoredPlan& plan) {
    cpu_adam::FactoredParams p = FactoredParamsOf(t, plan.args);
    const size_t rows = plan.rows, cols = plan.cols;
    const size_t r0 = begin / cols, nrows = t.n / cols;
    // The range as a matrix of its own rows, over the tensor's columns.
    const cpu_adam::Grid grid =
        cpu_adam::MakeGrid(nrows, cols, tile_, cpu_adam::kAdafactorFusedGrid);
    AdafactorParams(plan.args, p);
    p.fuse_rms = true;
    cpu_adam::FactoredArrays a = FactoredArraysOf(t, nrows, cols, 0);
    a.strips = grid.strips;
    a.row_state = static_cast<float*>(t.exp_avg_sq) + r0;
    a.col_state = static_cast<float*>(t.exp_avg_sq) + rows;
    BindStatsScratch(p, a, grid);
    SweepStats(p, a, grid);
    double* sums = plan.sums.data();
    for (size_t i = 0; i < nrows; ++i) {
      sums[r0 + i] += RowPartSum(i, grid.strips);
    }
    double* rms = sums + RmsAt(plan);
    for (size_t b = 0; b < grid.bands; ++b) {
      const double* col = col_part_.data() + b * cols;
      const double* r = rms_part_.data() + b * cols;
      for (size_t j = 0; j < cols; ++j) {
        sums[rows + j] += col[j];
        rms[j] += r[j];
      }
    }
    for (const cpu_adam::AfTileSums& k : tile_sums_) {
      sums[rows + cols] += k.p_sq;
    }
    rms[cols + 1] += 1;  // a pass that fused
  }

  Status FactoredNext(float* stats, CpuFactoredPlan* plan) override {
    if (plan == nullptr || plan->phase == CpuFactoredPhase::kDone) {
      return Status::InvalidArgument(
          "FactoredNext: no pass is due (a null plan, one not begun, or "
          "done)");
    }
    if (stats == nullptr) {
      return Status::InvalidArgument("FactoredNext: null statistics");
    }
    CpuFactoredPlan& p = *plan;
    const size_t rows = p.rows, cols = p.cols;
    float* row_state = stats;
    float* col_state = stats + rows;
    const bool adafactor = options_.algo == CpuOptimizerAlgo::kAdafactor;
    if (!adafactor) {  // SM3's maxima are its new accumulators
      for (size_t i = 0; i < rows; ++i) {
        row_state[i] = static_cast<float>(p.sums[i]);
      }
      if (rows > 1) {
        for (size_t j = 0; j < cols; ++j) {
          col_state[j] = static_cast<float>(p.sums[rows + j]);
        }
      }
      p.phase = CpuFactoredPhase::kDone;
      return Status::Ok();
    }
    switch (p.phase) {
      case CpuFactoredPhase::kStatistics: {
        cpu_adam::FactoredParams fp{};
        AdafactorParams(p.args, fp);
        const size_t lines = rows + (rows > 1 ? cols : 0);
        for (size_t i = 0; i < rows; ++i) {
          row_state[i] = cpu_adam::AdafactorStat(row_state[i], fp.beta2,
                                                 fp.omb2, p.sums[i], cols);
        }
        if (rows > 1) {
          AdafactorColumns(fp, p.sums.data() + rows, rows, cols, col_state,
                           p.col_factor.data());
        }
        const float row_mean =
            AdafactorRowFactors(row_state, rows, p.row_factor.data());
        p.lr = AdafactorLr(p.args, fp.scale_p ? p.sums[lines] : p.args.param_sq,
                           p.n);
        if (rows == 1) {  // a vector's came with its statistics
          p.clip = AdafactorClipOf(p.sums[lines + 1], p.n);
          p.phase = CpuFactoredPhase::kUpdate;
        } else if (p.sums[RmsAt(p) + cols] == 0) {
          // Every range fused it, and it is formed as Step forms it.
          p.clip = AdafactorClipOf(FusedUpdateSq(p.sums.data() + RmsAt(p),
                                                 col_state, cols, row_mean),
                                   p.n);
          p.phase = CpuFactoredPhase::kUpdate;
        } else {
          // The fused rows' part, and the RMS pass's for the rest.
          p.fused_sq = p.sums[RmsAt(p) + cols + 1] == 0
                           ? 0.0
                           : FusedUpdateSq(p.sums.data() + RmsAt(p), col_state,
                                           cols, row_mean);
          p.phase = CpuFactoredPhase::kRms;
        }
        break;
      }
      case CpuFactoredPhase::kRms:
        p.clip = AdafactorClipOf(p.fused_sq + p.sums[0], p.n);
        p.phase = CpuFactoredPhase::kUpdate;
        break;
      default:  // kUpdate
        if (options_.adafactor.scale_parameter) p.param_sq = p.sums[0];
        p.phase = CpuFactoredPhase::kDone;
        return Status::Ok();
    }
    p.sums.assign(1, 0.0);
    return Status::Ok();
  }

  Status PlaceOnNumaNodes(void* ptr, size_t elem_size, size_t n) override {
    if (arenas_.size() < 2 || n == 0) return Status::Ok();
    if (ptr == nullptr || elem_size == 0) {
      return Status::InvalidArgument("PlaceOnNumaNodes: null or empty array");
    }
    const std::vector<size_t> cuts = NodeCuts(n, tile_);
    char* base = static_cast<char*>(ptr);
    for (size_t k = 0; k < arenas_.size(); ++k) {
      hwloc_obj_t node = hwloc_get_obj_by_type(topology_, HWLOC_OBJ_NUMANODE,
                                               arenas_[k]->hwloc_node);
      if (node == nullptr) continue;
      const size_t bytes = (cuts[k + 1] - cuts[k]) * elem_size;
      if (bytes == 0) continue;
      if (hwloc_set_area_membind(
              topology_, base + cuts[k] * elem_size, bytes, node->nodeset,
              HWLOC_MEMBIND_BIND,
              HWLOC_MEMBIND_MIGRATE | HWLOC_MEMBIND_BYNODESET) != 0) {
        return Status::FromErrno(
            errno, "PlaceOnNumaNodes: hwloc_set_area_membind of " +
                       std::to_string(bytes) + " bytes to node " +
                       std::to_string(k));
      }
    }
    return Status::Ok();
  }

  CpuKernelVariant variant() const override { return kernels_->variant; }
  int threads() const override { return threads_; }
  int numa_nodes() const override { return static_cast<int>(arenas_.size()); }
  const CpuOptimizerOptions& options() const override { return options_; }

 private:
  static Status ValidateArgs(const CpuStepArgs& args) {
    if (!std::isfinite(args.lr) || args.lr < 0) {
      return Status::InvalidArgument("Step: lr must be finite and >= 0");
    }
    if (!std::isfinite(args.inv_loss_scale) || args.inv_loss_scale <= 0 ||
        !std::isfinite(args.clip_coef) || args.clip_coef <= 0) {
      return Status::InvalidArgument(
          "Step: inv_loss_scale and clip_coef must be finite and > 0");
    }
    if (!std::isfinite(args.param_sq)) {
      return Status::InvalidArgument(
          "Step: param_sq must be finite (negative: not known)");
    }
    return Status::Ok();
  }

  static Status ValidateGradAndWorking(const CpuOptimizerTensors& t) {
    if (t.grad_dtype == CpuDType::kBlock8) {
      return Status::InvalidArgument(
          "Step: the gradient is kFloat32, kFloat16 or kBFloat16");
    }
    if (t.working != nullptr && (t.working_dtype == CpuDType::kFloat32 ||
                                 t.working_dtype == CpuDType::kBlock8)) {
      return Status::InvalidArgument(
          "Step: the working copy is kFloat16 or kBFloat16");
    }
    return Status::Ok();
  }

  Status Validate(const CpuOptimizerTensors& t, const CpuStepArgs& args) const {
    STRATA_RETURN_IF_ERROR(ValidateArgs(args));
    const CpuOptimizerAlgo algo = options_.algo;
    const bool adam =
        algo == CpuOptimizerAlgo::kAdam || algo == CpuOptimizerAlgo::kAdamW;
    if (adam && options_.bias_correction && args.step < 1) {
      return Status::InvalidArgument("Step: step counts from 1");
    }
    if (t.n == 0) return Status::Ok();
    const bool need_m = adam || algo == CpuOptimizerAlgo::kLion;
    const bool need_v = adam || algo == CpuOptimizerAlgo::kAdagrad;
    if (t.master == nullptr || t.grad == nullptr ||
        (need_m && t.exp_avg == nullptr) ||
        (need_v && t.exp_avg_sq == nullptr)) {
      return Status::InvalidArgument(
          "Step: null master, gradient or optimizer state array");
    }
    if (t.moment_dtype == CpuDType::kFloat16) {
      return Status::InvalidArgument(
          "Step: moments are kFloat32, kBFloat16 or kBlock8 (fp16 lacks the "
          "range for the second moment)");
    }
    if (t.moment_dtype == CpuDType::kBlock8 &&
        algo == CpuOptimizerAlgo::kAdagrad) {
      return Status::InvalidArgument(
          "Step: kBlock8 states are for Adam, AdamW and Lion (Adagrad's sum "
          "of squares only grows; keep it kFloat32 or kBFloat16)");
    }
    STRATA_RETURN_IF_ERROR(ValidateGradAndWorking(t));
    // kBlock8: codes, then fp32 scales at a 4-byte offset of the start.
    const size_t msize = t.moment_dtype == CpuDType::kBlock8
                             ? 4
                             : cpu_adam::DTypeSize(t.moment_dtype);
    if (!IsAligned(t.master, 4) ||
        !IsAligned(t.grad, cpu_adam::DTypeSize(t.grad_dtype)) ||
        !IsAligned(t.exp_avg, msize) || !IsAligned(t.exp_avg_sq, msize) ||
        !IsAligned(t.working, 2)) {
      return Status::InvalidArgument(
          "Step: arrays must be naturally aligned for their types");
    }
    return Status::Ok();
  }

  // ---- Adafactor and SM3 ----

  Status ValidateFactoredArgs(const CpuStepArgs& args) const {
    STRATA_RETURN_IF_ERROR(ValidateArgs(args));
    if (options_.algo == CpuOptimizerAlgo::kAdafactor && args.step < 1) {
      return Status::InvalidArgument("Step: step counts from 1");
    }
    return Status::Ok();
  }

  Status ValidateFactored(const CpuOptimizerTensors& t,
                          const CpuStepArgs& args) const {
    STRATA_RETURN_IF_ERROR(ValidateFactoredArgs(args));
    if (t.n == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(ValidateFactoredArrays(t));
    size_t r = 0, c = 0;
    return cpu_adam::FactoredShape(t.n, t.rows, t.cols, &r, &c);
  }

  // The arrays of a whole tensor or of a range (t.n > 0).
  // `weights`: the pass reads master (and exp_avg); Adafactor's statistics
  // and RMS passes over a range may not (FactoredPass).
  Status ValidateFactoredArrays(const CpuOptimizerTensors& t,
                                bool weights = true) const {
    const bool need_m = weights && CpuOptimizerUsesExpAvg(options_);
    if ((weights && t.master == nullptr) || t.grad == nullptr ||
        t.exp_avg_sq == nullptr || (need_m && t.exp_avg == nullptr)) {
      return Status::InvalidArgument(
          "Step: null master, gradient or optimizer state array");
    }
    if (t.moment_dtype != CpuDType::kFloat32 &&
        t.moment_dtype != CpuDType::kBFloat16) {
      return Status::InvalidArgument(
          "Step: Adafactor's and SM3's exp_avg is kFloat32 or kBFloat16");
    }
    STRATA_RETURN_IF_ERROR(ValidateGradAndWorking(t));
    if (!IsAligned(t.master, 4) ||
        !IsAligned(t.grad, cpu_adam::DTypeSize(t.grad_dtype)) ||
        !IsAligned(t.exp_avg, cpu_adam::DTypeSize(t.moment_dtype)) ||
        !IsAligned(t.exp_avg_sq, 4) || !IsAligned(t.working, 2)) {
      return Status::InvalidArgument(
          "Step: arrays must be naturally aligned for their types");
    }
    return Status::Ok();
  }

  StatusOr<CpuStepResult> FactoredStep(const CpuOptimizerTensors& t,
                                       const CpuStepArgs& args) {
    STRATA_RETURN_IF_ERROR(ValidateFactored(t, args));
    CpuStepResult result;
    if (t.n == 0) {
      result.applied = true;
      return result;
    }
    const float gscale =
        static_cast<float>(args.inv_loss_scale * args.clip_coef);
    if (!CheckOverflow(t, args, gscale, result)) return result;
    size_t rows = 0, cols = 0;
    STRATA_RETURN_IF_ERROR(
        cpu_adam::FactoredShape(t.n, t.rows, t.cols, &rows, &cols));
    const bool adafactor = options_.algo == CpuOptimizerAlgo::kAdafactor;
    const cpu_adam::Grid grid =
        cpu_adam::MakeGrid(rows, cols, tile_,
                           adafactor && cpu_adam::AdafactorFusesRms(rows, cols)
                               ? cpu_adam::kAdafactorFusedGrid
                               : cpu_adam::GridPolicy{});
    cpu_adam::FactoredParams p = FactoredParamsOf(t, args);
    cpu_adam::FactoredArrays a = FactoredArraysOf(t, rows, cols, 0);
    a.strips = grid.strips;
    if (adafactor) {
      AdafactorStep(t, args, grid, p, a, result);
    } else {
      Sm3Step(args, grid, p, a, result);
    }
    result.applied = true;
    return result;
  }

  // The wall seconds `fn` takes.
  template <class Fn>
  static double SecondsOf(Fn&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
        .count();
  }

  // Runs `sweep` (one pass over the threads) and notes its time in `r`.
  template <class Fn>
  static void TimePass(CpuStepResult& r, Fn&& sweep) {
    r.pass_seconds[r.passes++] = SecondsOf(sweep);
  }

  // The inf/nan check when asked for (timed into `r`): false when the
  // scaled gradient is not finite, and nothing may be written.
  bool CheckOverflow(const CpuOptimizerTensors& t, const CpuStepArgs& args,
                     float gscale, CpuStepResult& r) {
    if (!args.check_overflow) return true;
    GradStats stats;
    r.check_seconds = SecondsOf(
        [&] { stats = GradStatsOf(t.grad, t.grad_dtype, t.n, gscale); });
    return stats.finite;
  }

  void AdafactorStep(const CpuOptimizerTensors& t, const CpuStepArgs& args,
                     const cpu_adam::Grid& grid, cpu_adam::FactoredParams& p,
                     cpu_adam::FactoredArrays& a, CpuStepResult& result) {
    const CpuAdafactorOptions& o = options_.adafactor;
    const size_t rows = a.rows, cols = a.cols, tiles = grid.tiles();
    // Note [Adafactor's fused RMS] in kernels.h: a vector's or a matrix's
    // whole rows need no pass of their own for the update's RMS.
    const bool fused = cpu_adam::AdafactorFusesRms(rows, cols);
    AdafactorParams(args, p);
    const bool carried = !p.scale_p && o.scale_parameter;
    p.fuse_rms = fused && rows > 1;
    col_factor_.resize(cols);
    row_factor_.resize(rows);
    a.col_factor = col_factor_.data();
    a.row_factor = row_factor_.data();
    const auto& k = *kernels_;
    // Pass 1: g^2 + eps1 summed per row and column, p^2 per tile (and, fused,
    // what the update's RMS needs).
    BindStatsScratch(p, a, grid);
    TimePass(result, [&] { SweepStats(p, a, grid); });
    // The statistics' moving averages; each sum in a fixed order.
    for (size_t i = 0; i < rows; ++i) {
      a.row_state[i] = cpu_adam::AdafactorStat(
          a.row_state[i], p.beta2, p.omb2, RowPartSum(i, grid.strips), cols);
    }
    if (rows > 1) {
      SumBands(col_part_, grid.bands, cols);
      AdafactorColumns(p, col_sum_.data(), rows, cols, a.col_state,
                       col_factor_.data());
    }
    const float row_mean =
        AdafactorRowFactors(a.row_state, rows, row_factor_.data());
    double p_sum = 0.0, u_sum = 0.0;
    for (size_t i = 0; i < tiles; ++i) {
      p_sum += tile_sums_[i].p_sq;
      u_sum += tile_sums_[i].u_sq;
    }
    const double lr = AdafactorLr(args, carried ? args.param_sq : p_sum, t.n);
    if (p.fuse_rms) {  // (the tiles' u_sq are zero for a matrix)
      SumBands(rms_part_, grid.bands, cols);
      u_sum += FusedUpdateSq(col_sum_.data(), a.col_state, cols, row_mean);
    } else if (!fused) {  // (a vector's came with the tile sums)
      // The RMS pass: the update's squares, for clipping.
      TimePass(result, [&] {
        ParallelTiles(tiles, 1, [&](size_t tile, size_t, size_t) {
          tile_sums_[tile].u_sq = k.adafactor_sumsq(p, a, grid.Tile(tile));
        });
      });
      for (size_t i = 0; i < tiles; ++i) u_sum += tile_sums_[i].u_sq;
    }
    AdafactorUpdateParams(lr, AdafactorClipOf(u_sum, t.n), p);
    // The last pass: the update (and the new weights' squares, per tile).
    TimePass(result, [&] {
      ParallelTiles(tiles, 1, [&](size_t tile, size_t, size_t) {
        tile_sums_[tile].p_sq = k.adafactor_apply(p, a, grid.Tile(tile));
      });
    });
    if (o.scale_parameter) {
      double new_sq = 0.0;
      for (size_t i = 0; i < tiles; ++i) new_sq += tile_sums_[i].p_sq;
      result.param_sq = new_sq;
    }
  }

  // What every factored pass shares: the types, the first moment and the
  // gradient's scale.
  cpu_adam::FactoredParams FactoredParamsOf(const CpuOptimizerTensors& t,
                                            const CpuStepArgs& args) const {
    cpu_adam::FactoredParams p{};
    p.grad_dtype = t.grad_dtype;
    p.moment_dtype = t.moment_dtype;
    p.working_dtype = t.working_dtype;
    p.has_working = t.working != nullptr;
    p.use_m = CpuOptimizerUsesExpAvg(options_);
    p.gscale = static_cast<float>(args.inv_loss_scale * args.clip_coef);
    return p;
  }

  // `t`'s arrays, from the tensor's element `origin`, over its statistics.
  static cpu_adam::FactoredArrays FactoredArraysOf(const CpuOptimizerTensors& t,
                                                   size_t rows, size_t cols,
                                                   size_t origin) {
    cpu_adam::FactoredArrays a{};
    a.rows = rows;
    a.cols = cols;
    a.origin = origin;
    a.master = t.master;
    a.grad = t.grad;
    a.m = t.exp_avg;
    a.row_state = static_cast<float*>(t.exp_avg_sq);
    a.col_state = a.row_state + rows;
    a.working = t.working;
    return a;
  }

  // Adafactor's scalars of the step's statistics; scale_p unless the
  // weights' sum of squares is carried (CpuStepArgs::param_sq), which
  // spares the statistics pass its read of them.
  void AdafactorParams(const CpuStepArgs& args,
                       cpu_adam::FactoredParams& p) const {
    const CpuAdafactorOptions& o = options_.adafactor;
    const double beta2t =
        1.0 - std::pow(static_cast<double>(args.step), o.decay_rate);
    p.eps = static_cast<float>(o.eps1);
    p.beta2 = static_cast<float>(beta2t);
    p.omb2 = static_cast<float>(1.0 - beta2t);
    p.beta1 = static_cast<float>(o.beta1);
    p.omb1 = static_cast<float>(1.0 - o.beta1);
    p.scale_p = o.scale_parameter && args.param_sq < 0.0;
    p.sum_new_sq = o.scale_parameter;
  }

  // The column statistics' moving averages from their sums, and their
  // factors 1 / sqrt(col).
  static void AdafactorColumns(const cpu_adam::FactoredParams& p,
                               const double* sums, size_t rows, size_t cols,
                               float* col_state, float* col_factor) {
    for (size_t j = 0; j < cols; ++j) {
      const float col =
          cpu_adam::AdafactorStat(col_state[j], p.beta2, p.omb2, sums[j], rows);
      col_state[j] = col;
      col_factor[j] = 1.0f / std::sqrt(col);
    }
  }

  // The rows' factors 1 / sqrt(R_i / mean(R)); returns mean(R).
  static float AdafactorRowFactors(const float* row_state, size_t rows,
                                   float* row_factor) {
    double row_sum = 0.0;
    for (size_t i = 0; i < rows; ++i) row_sum += row_state[i];
    const float row_mean =
        static_cast<float>(row_sum / static_cast<double>(rows));
    for (size_t i = 0; i < rows; ++i) {
      row_factor[i] = 1.0f / std::sqrt(row_state[i] / row_mean);
    }
    return row_mean;
  }

  // The step's lr: relative (or the caller's), times the weights' RMS with
  // scale_parameter (`param_sq` their sum of squares, of n weights).
  double AdafactorLr(const CpuStepArgs& args, double param_sq, size_t n) const {
    const CpuAdafactorOptions& o = options_.adafactor;
    const double step = static_cast<double>(args.step);
    double lr = args.lr;
    if (o.relative_step) {
      lr = std::min(o.warmup_init ? 1e-6 * step : 1e-2, 1.0 / std::sqrt(step));
    }
    if (o.scale_parameter) {
      lr *= std::max(o.eps2, std::sqrt(param_sq / static_cast<double>(n)));
    }
    return lr;
  }

  // max(1, RMS(u) / d), `u_sum` the sum of u^2 over n elements.
  double AdafactorClipOf(double u_sum, size_t n) const {
    const double rms_u = std::sqrt(u_sum / static_cast<double>(n));
    return std::max(1.0, rms_u / options_.adafactor.clip_threshold);
  }

  // The update's coefficient lr / clip and the weight decay.
  void AdafactorUpdateParams(double lr, double clip,
                             cpu_adam::FactoredParams& p) const {
    p.coef = static_cast<float>(lr / clip);
    p.decay = static_cast<float>(-options_.weight_decay * lr);
    p.use_decay = options_.weight_decay != 0.0;
  }

  void Sm3Params(const CpuStepArgs& args, cpu_adam::FactoredParams& p) const {
    p.eps = static_cast<float>(options_.eps);
    p.beta1 = static_cast<float>(options_.beta1);
    p.omb1 = static_cast<float>(1.0 - options_.beta1);
    p.l2 = static_cast<float>(options_.weight_decay);
    p.use_l2 = options_.weight_decay != 0.0;
    p.neg_lr = static_cast<float>(-args.lr);
  }

  // One pass of a plan over a range's rectangles (Note [Factored steps in
  // ranges]), its partials added into plan.sums.
  void RangePass(cpu_adam::FactoredParams& p, cpu_adam::FactoredArrays& a,
                 const RangeRects& rr, CpuFactoredPlan& plan) {
    const size_t rows = a.rows, cols = a.cols, nr = rr.rects.size();
    const size_t lines = rows + (rows > 1 ? cols : 0);
    const auto& k = *kernels_;
    const auto& rects = rr.rects;
    a.row_factor = plan.row_factor.data();
    a.col_factor = plan.col_factor.data();
    tile_sums_.assign(nr, cpu_adam::AfTileSums{});
    double* sums = plan.sums.data();
    if (options_.algo == CpuOptimizerAlgo::kSm3) {
      Sm3Params(plan.args, p);
      row_fpart_.resize(rows * rr.strips);
      col_fpart_.resize(rows > 1 ? rr.bands * cols : 0);
      a.row_fpart = row_fpart_.data();
      a.col_fpart = col_fpart_.data();
      ParallelTiles(
          nr, 1, [&](size_t r, size_t, size_t) { k.sm3_step(p, a, rects[r]); });
      for (const cpu_adam::TileRect& t : rects) {
        for (size_t i = t.r0; i < t.r1; ++i) {
          const double m = row_fpart_[i * rr.strips + t.strip];
          sums[i] = std::max(sums[i], m);
        }
        if (rows == 1) continue;
        const float* part = col_fpart_.data() + t.band * cols;
        for (size_t j = t.c0; j < t.c1; ++j) {
          sums[rows + j] = std::max(sums[rows + j], double{part[j]});
        }
      }
      return;
    }
    AdafactorParams(plan.args, p);
    switch (plan.phase) {
      case CpuFactoredPhase::kStatistics:
        row_part_.resize(rows * rr.strips);
        col_part_.resize(rows > 1 ? rr.bands * cols : 0);
        a.row_part = row_part_.data();
        a.col_part = col_part_.data();
        ParallelTiles(nr, 1, [&](size_t r, size_t, size_t) {
          tile_sums_[r] = k.adafactor_stats(p, a, rects[r]);
        });
        for (size_t r = 0; r < nr; ++r) {
          const cpu_adam::TileRect& t = rects[r];
          for (size_t i = t.r0; i < t.r1; ++i) {
            sums[i] += row_part_[i * rr.strips + t.strip];
          }
          if (rows > 1) {
            const double* part = col_part_.data() + t.band * cols;
            for (size_t j = t.c0; j < t.c1; ++j) sums[rows + j] += part[j];
          }
          sums[lines] += tile_sums_[r].p_sq;
          sums[lines + 1] += tile_sums_[r].u_sq;
        }
        if (rows > 1) sums[RmsAt(plan) + cols] += 1;  // a range not fused
        return;
      case CpuFactoredPhase::kRms:
        ParallelTiles(nr, 1, [&](size_t r, size_t, size_t) {
          tile_sums_[r].u_sq = k.adafactor_sumsq(p, a, rects[r]);
        });
        for (size_t r = 0; r < nr; ++r) sums[0] += tile_sums_[r].u_sq;
        return;
      default:  // kUpdate
        AdafactorUpdateParams(plan.lr, plan.clip, p);
        ParallelTiles(nr, 1, [&](size_t r, size_t, size_t) {
          tile_sums_[r].p_sq = k.adafactor_apply(p, a, rects[r]);
        });
        for (size_t r = 0; r < nr; ++r) sums[0] += tile_sums_[r].p_sq;
        return;
    }
  }

  // Adafactor's statistics scratch for a sweep over `grid` (a's rows and
  // columns), bound to `a`: the rows' partials, the bands' column sums and,
  // with fuse_rms, their RMS partials (and the lagged rows' group sums).
  void BindStatsScratch(const cpu_adam::FactoredParams& p,
                        cpu_adam::FactoredArrays& a,
                        const cpu_adam::Grid& grid) {
    const size_t rows = a.rows, cols = a.cols;
    row_part_.assign(rows * grid.strips, 0.0);
    col_part_.resize(rows > 1 ? grid.bands * cols : 0);
    rms_part_.resize(p.fuse_rms ? grid.bands * cols : 0);
    group_part_.resize(p.fuse_rms &&
                               cpu_adam::AdafactorLagsRows(
                                   cpu_adam::DTypeSize(p.grad_dtype), cols)
                           ? grid.bands * cpu_adam::AfGroupStride(cols)
                           : 0);
    tile_sums_.assign(grid.tiles(), cpu_adam::AfTileSums{});
    a.row_part = row_part_.data();
    a.col_part = col_part_.data();
    a.rms_part = rms_part_.data();
    a.group_part = group_part_.data();
  }

  // Adafactor's statistics pass over every tile of `grid`, each tile's sums
  // in tile_sums_.
  void SweepStats(const cpu_adam::FactoredParams& p,
                  const cpu_adam::FactoredArrays& a,
                  const cpu_adam::Grid& grid) {
    const auto stats = kernels_->adafactor_stats;
    ParallelTiles(grid.tiles(), 1, [&](size_t tile, size_t, size_t) {
      tile_sums_[tile] = stats(p, a, grid.Tile(tile));
    });
  }

  // Row i's sum over its `strips` partials, in strip order.
  double RowPartSum(size_t i, size_t strips) const {
    double sum = 0.0;
    for (size_t s = 0; s < strips; ++s) sum += row_part_[i * strips + s];
    return sum;
  }

  // The sum of u^2 from the fused statistics: mean(R) * sum_j (sum_i
  // g_ij^2 / R_i) / C_j, `rms` the columns' inner sums.
  static double FusedUpdateSq(const double* rms, const float* col_state,
                              size_t cols, float row_mean) {
    double u_sum = 0.0;
    for (size_t j = 0; j < cols; ++j) {
      u_sum += rms[j] / static_cast<double>(col_state[j]);
    }
    return u_sum * static_cast<double>(row_mean);
  }

  // col_sum_[j] = the sum over bands of part[band * cols + j], in band
  // order, band by band over contiguous rows of the partials (a column at a
  // time would stride through bands x cols doubles a line per addition).
  void SumBands(const LineAlignedVector<double>& part, size_t bands,
                size_t cols) {
    col_sum_.assign(cols, 0.0);
    for (size_t b = 0; b < bands; ++b) {
      const double* row = part.data() + b * cols;
      for (size_t j = 0; j < cols; ++j) col_sum_[j] += row[j];
    }
  }

  void Sm3Step(const CpuStepArgs& args, const cpu_adam::Grid& grid,
               cpu_adam::FactoredParams& p, cpu_adam::FactoredArrays& a,
               CpuStepResult& result) {
    const size_t rows = a.rows, cols = a.cols;
    Sm3Params(args, p);
    row_fpart_.resize(rows * grid.strips);
    col_fpart_.resize(rows > 1 ? grid.bands * cols : 0);
    a.row_fpart = row_fpart_.data();
    a.col_fpart = col_fpart_.data();
    const auto sm3 = kernels_->sm3_step;
    TimePass(result, [&] {
      ParallelTiles(grid.tiles(), 1, [&](size_t tile, size_t, size_t) {
        sm3(p, a, grid.Tile(tile));
      });
    });
    // The new accumulators: maxima, exact in any order.
    for (size_t i = 0; i < rows; ++i) {
      float m = 0.0f;
      for (size_t s = 0; s < grid.strips; ++s) {
        m = std::max(m, row_fpart_[i * grid.strips + s]);
      }
      a.row_state[i] = m;
    }
    if (rows > 1) {  // band by band, as Adafactor's column sums
      float* col = a.col_state;
      std::fill_n(col, cols, 0.0f);
      for (size_t b = 0; b < grid.bands; ++b) {
        const float* part = col_fpart_.data() + b * cols;
        for (size_t j = 0; j < cols; ++j) col[j] = std::max(col[j], part[j]);
      }
    }
  }

  cpu_adam::StepParams MakeParams(const CpuOptimizerTensors& t,
                                  const CpuStepArgs& args) const {
    const CpuOptimizerOptions& o = options_;
    cpu_adam::StepParams p{};
    p.algo = o.algo;
    p.grad_dtype = t.grad_dtype;
    p.moment_dtype = t.moment_dtype;
    p.working_dtype = t.working_dtype;
    p.has_working = t.working != nullptr;
    p.gscale = static_cast<float>(args.inv_loss_scale * args.clip_coef);
    p.beta1 = static_cast<float>(o.beta1);
    p.beta2 = static_cast<float>(o.beta2);
    p.omb1 = static_cast<float>(1.0 - o.beta1);
    p.omb2 = static_cast<float>(1.0 - o.beta2);
    p.eps = static_cast<float>(o.eps);
    p.l2 = static_cast<float>(o.weight_decay);
    p.use_l2 = o.weight_decay != 0.0;
    p.decay = static_cast<float>(1.0 - args.lr * o.weight_decay);
    p.use_decay = p.decay != 1.0f;
    p.bc2_sqrt = 1.0f;
    p.inv_bc2_sqrt = 1.0f;
    p.split8 = o.block8_sweeps == 2;
    switch (o.algo) {
      case CpuOptimizerAlgo::kAdam:
      case CpuOptimizerAlgo::kAdamW: {
        double bc1 = 1.0, bc2 = 1.0;
        if (o.bias_correction) {
          const double step = static_cast<double>(args.step);
          bc1 = 1.0 - std::pow(o.beta1, step);
          bc2 = 1.0 - std::pow(o.beta2, step);
        }
        p.neg_step = static_cast<float>(-(args.lr / bc1));
        p.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
        p.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
        break;
      }
      case CpuOptimizerAlgo::kAdagrad:
      case CpuOptimizerAlgo::kLion:
      case CpuOptimizerAlgo::kAdafactor:  // not through this path
      case CpuOptimizerAlgo::kSm3:
        p.neg_step = static_cast<float>(-args.lr);
        break;
    }
    return p;
  }

  GradStats GradStatsOf(const void* grad, CpuDType dtype, size_t n,
                        float scale) {
    const size_t tiles = (n + tile_ - 1) / tile_;
    partial_sum_.assign(tiles, 0.0);
    partial_finite_.assign(tiles, 1);
    const auto stats = kernels_->grad_stats;
    ParallelTiles(n, tile_, [&](size_t tile, size_t b, size_t e) {
      bool finite = true;
      stats(grad, dtype, b, e, scale, &partial_sum_[tile], &finite);
      partial_finite_[tile] = finite ? 1 : 0;
    });
    GradStats s;
    for (size_t k = 0; k < tiles; ++k) {  // fixed order: deterministic
      s.sum_sq += partial_sum_[k];
      s.finite = s.finite && partial_finite_[k] != 0;
    }
    return s;
  }

  // Element boundaries between node arenas: proportional to their threads,
  // rounded to whole tiles of `tile` elements.
  std::vector<size_t> NodeCuts(size_t n, size_t tile) const {
    std::vector<size_t> cuts(arenas_.size() + 1, 0);
    const size_t tiles = (n + tile - 1) / tile;
    int before = 0;
    for (size_t k = 0; k < arenas_.size(); ++k) {
      before += arenas_[k]->threads;
      const size_t t =
          tiles * static_cast<size_t>(before) / static_cast<size_t>(threads_);
      cuts[k + 1] = std::min(n, t * tile);
    }
    cuts.back() = n;
    return cuts;
  }

  // Calls fn(tile_index, begin, end) for every tile of `tile` elements of
  // [0, n) on the arenas' threads and returns when all are done. The arena
  // execute/wait returns after every task's writes are visible to the
  // caller.
  template <class Fn>
  void ParallelTiles(size_t n, size_t tile, const Fn& fn) {
    const std::vector<size_t> cuts = NodeCuts(n, tile);
    TileJob job;
    job.fn = &fn;
    job.call = [](const void* f, size_t index, size_t b, size_t e) {
      (*static_cast<const Fn*>(f))(index, b, e);
    };
    job.n = n;
    job.tile = tile;
    auto run_part = [&](size_t k) {
      const size_t first = cuts[k] / tile;
      const size_t last = (cuts[k + 1] + tile - 1) / tile;
      tbb::parallel_for(tbb::blocked_range<size_t>(first, last, 1),
                        TileBody{&job}, tbb::static_partitioner());
    };
    STRATA_TSAN_RELEASE(&g_fork_sync);
    if (arenas_.size() == 1) {
      arenas_[0]->arena->execute([&] { run_part(0); });
      STRATA_TSAN_ACQUIRE(&g_join_sync);
      return;
    }
    for (size_t k = 0; k < arenas_.size(); ++k) {
      NodeArena& a = *arenas_[k];
      a.arena->execute([&, k] { a.group.run([&, k] { run_part(k); }); });
    }
    for (auto& a : arenas_) {
      a->arena->execute([&] { a->group.wait(); });
    }
    STRATA_TSAN_ACQUIRE(&g_join_sync);
  }

  CpuOptimizerOptions options_;
  const cpu_adam::KernelTable* kernels_;
  size_t tile_ = 0;
  int threads_ = 1;
  hwloc_topology_t topology_ = nullptr;
  std::vector<std::unique_ptr<NodeArena>> arenas_;
  std::vector<double> partial_sum_;  // per tile, reused across calls
  std::vector<uint8_t> partial_finite_;
  // Scratch of the factored optimizers (kernels.h, FactoredArrays). The
  // kernels walk the per-column arrays a register at a time, once per row:
  // on cache lines, or every access splits two (the bf16 statistics pass
  // took 11-12% longer with them 16 bytes off a line, one Zen 5 core).
  LineAlignedVector<double> row_part_, col_part_, rms_part_, col_sum_;
  std::vector<cpu_adam::AfTileSums> tile_sums_;
  LineAlignedVector<float> row_factor_, col_factor_, row_fpart_, col_fpart_,
      group_part_;
};

}  // namespace

}  // namespace cpu_adam

std::string_view CpuKernelVariantName(CpuKernelVariant v) {
  switch (v) {
    case CpuKernelVariant::kAuto:
      return "auto";
    case CpuKernelVariant::kScalar:
      return "scalar";
    case CpuKernelVariant::kAvx2:
      return "avx2";
    case CpuKernelVariant::kAvx512:
      return "avx512";
    case CpuKernelVariant::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

StatusOr<CpuKernelVariant> ParseCpuKernelVariant(std::string_view name) {
  for (CpuKernelVariant v : {CpuKernelVariant::kAuto, CpuKernelVariant::kScalar,
                             CpuKernelVariant::kAvx2, CpuKernelVariant::kAvx512,
                             CpuKernelVariant::kAvx512Bf16}) {
    if (name == CpuKernelVariantName(v)) return v;
  }
  return Status::InvalidArgument(
      "unknown CPU optimizer variant '" + std::string(name) +
      "' (expected auto, scalar, avx2, avx512 or avx512bf16)");
}

#if defined(__x86_64__) || defined(__i386__)
namespace {
// F16C from CPUID leaf 1 (ECX bit 29): clang before 15 rejects
// __builtin_cpu_supports("f16c"). That the OS saves the AVX state is already
// established by the avx2 check that comes with it.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace
#endif

bool CpuKernelVariantSupported(CpuKernelVariant v) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") &&
                    __builtin_cpu_supports("fma") && CpuHasF16c();
  const cpu_adam::CpuAvx512Report avx512 = cpu_adam::ReportCpuAvx512();
  switch (v) {
    case CpuKernelVariant::kAuto:
    case CpuKernelVariant::kScalar:
      return true;
    case CpuKernelVariant::kAvx2:
      return avx2;
    case CpuKernelVariant::kAvx512:
      return avx2 && avx512.base;
    case CpuKernelVariant::kAvx512Bf16:
      return avx2 && avx512.bf16;
  }
  return false;
#else
  return v == CpuKernelVariant::kAuto || v == CpuKernelVariant::kScalar;
#endif
}

CpuKernelVariant BestCpuKernelVariant() {
  for (CpuKernelVariant v :
       {CpuKernelVariant::kAvx512Bf16, CpuKernelVariant::kAvx512,
        CpuKernelVariant::kAvx2}) {
    if (CpuKernelVariantSupported(v)) return v;
  }
  return CpuKernelVariant::kScalar;
}

std::pair<size_t, size_t> CpuFactoredFusedRows(const CpuFactoredPlan& plan,
                                               size_t begin, size_t n) {
  const size_t cols = plan.cols;
  if (plan.phase != CpuFactoredPhase::kStatistics || plan.rows < 2 ||
      !cpu_adam::AdafactorFusesRms(plan.rows, cols)) {
    return {begin, begin};
  }
  const size_t b0 = (begin + cols - 1) / cols * cols;
  const size_t b1 = (begin + n) / cols * cols;
  if (b1 < b0 + 2 * cols) return {begin, begin};
  return {b0, b1};
}

bool CpuFactoredPassReads(const CpuFactoredPlan& plan, size_t begin, size_t n) {
  if (n == 0 || plan.phase == CpuFactoredPhase::kDone) return false;
  if (plan.phase != CpuFactoredPhase::kRms) return true;
  bool reads = false;
  cpu_adam::ForEachUnfused(plan.fused, begin, begin + n,
                           [&](size_t, size_t) { reads = true; });
  return reads;
}

StatusOr<std::unique_ptr<CpuOptimizer>> NewCpuOptimizer(
    const CpuOptimizerOptions& options) {
  const bool betas_ok = options.beta1 >= 0 && options.beta1 < 1 &&
                        options.beta2 >= 0 && options.beta2 < 1;
  if (!betas_ok) {
    return Status::InvalidArgument("NewCpuOptimizer: betas must be in [0, 1)");
  }
  if (!(options.eps >= 0) || !std::isfinite(options.eps) ||
      !(options.weight_decay >= 0) || !std::isfinite(options.weight_decay)) {
    return Status::InvalidArgument(
        "NewCpuOptimizer: eps and weight_decay must be finite and >= 0");
  }
  if (options.threads < 0) {
    return Status::InvalidArgument("NewCpuOptimizer: threads must be >= 0");
  }
  if (options.block8_sweeps < 0 || options.block8_sweeps > 2) {
    return Status::InvalidArgument(
        "NewCpuOptimizer: block8_sweeps must be 0 (the variant's own), 1 or 2");
  }
  if (options.algo == CpuOptimizerAlgo::kAdafactor) {
    const CpuAdafactorOptions& a = options.adafactor;
    if (!(a.eps1 >= 0) || !std::isfinite(a.eps1) || !(a.eps2 >= 0) ||
        !std::isfinite(a.eps2)) {
      return Status::InvalidArgument(
          "NewCpuOptimizer: adafactor.eps1 and eps2 must be finite and >= 0");
    }
    if (!(a.clip_threshold > 0) || !std::isfinite(a.clip_threshold)) {
      return Status::InvalidArgument(
          "NewCpuOptimizer: adafactor.clip_threshold must be finite and > 0");
    }
    if (!(a.decay_rate >= -1.0 && a.decay_rate < 0.0)) {
      return Status::InvalidArgument(
          "NewCpuOptimizer: adafactor.decay_rate must be in [-1, 0)");
    }
    if (!(a.beta1 >= 0 && a.beta1 < 1)) {
      return Status::InvalidArgument(
          "NewCpuOptimizer: adafactor.beta1 must be in [0, 1) (0 = no first "
          "moment)");
    }
    if (a.warmup_init && !a.relative_step) {
      return Status::InvalidArgument(
          "NewCpuOptimizer: adafactor.warmup_init needs relative_step");
    }
  }
  STRATA_ASSIGN_OR_RETURN(CpuKernelVariant variant,
                          cpu_adam::ResolveVariant(options.variant));
  auto opt = std::make_unique<cpu_adam::CpuOptimizerImpl>(options, variant);
  STRATA_RETURN_IF_ERROR(opt->Init());
  return std::unique_ptr<CpuOptimizer>(std::move(opt));
}

StatusOr<CpuStepFootprint> CpuStepFootprintOf(const CpuOptimizerOptions& o,
                                              const CpuStepShape& shape) {
  const uint64_t n = shape.n;
  if (shape.grad_dtype == CpuDType::kBlock8 ||
      (shape.has_working && (shape.working_dtype == CpuDType::kFloat32 ||
                             shape.working_dtype == CpuDType::kBlock8))) {
    return Status::InvalidArgument(
        "CpuStepFootprintOf: gradient fp32/fp16/bf16, working copy fp16/bf16");
  }
  const uint64_t g = cpu_adam::DTypeSize(shape.grad_dtype);
  const uint64_t w = shape.has_working ? 2 : 0;
  const bool use_m = CpuOptimizerUsesExpAvg(o);
  CpuStepFootprint f;
  if (!CpuOptimizerIsFactored(o.algo)) {
    if (shape.moment_dtype == CpuDType::kFloat16 ||
        (shape.moment_dtype == CpuDType::kBlock8 &&
         o.algo == CpuOptimizerAlgo::kAdagrad)) {
      return Status::InvalidArgument(
          "CpuStepFootprintOf: moments kFloat32, kBFloat16 or kBlock8 (not "
          "for Adagrad)");
    }
    const bool use_v = o.algo != CpuOptimizerAlgo::kLion;
    f.exp_avg_bytes = use_m ? CpuStateBytes(shape.moment_dtype, n) : 0;
    f.exp_avg_sq_bytes = use_v ? CpuStateBytes(shape.moment_dtype, n) : 0;
    const uint64_t state = f.exp_avg_bytes + f.exp_avg_sq_bytes;
    f.read_bytes = n * (4 + g) + state;
    f.written_bytes = n * (4 + w) + state;
    f.passes = 1;
    return f;
  }
  if (shape.moment_dtype != CpuDType::kFloat32 &&
      shape.moment_dtype != CpuDType::kBFloat16) {
    return Status::InvalidArgument(
        "CpuStepFootprintOf: Adafactor's and SM3's exp_avg is kFloat32 or "
        "kBFloat16");
  }
  size_t rows = 0, cols = 0;
  STRATA_RETURN_IF_ERROR(
      cpu_adam::FactoredShape(n, shape.rows, shape.cols, &rows, &cols));
  const uint64_t m = use_m ? n * cpu_adam::DTypeSize(shape.moment_dtype) : 0;
  const uint64_t stats = (uint64_t{rows} + cols) * 4;
  f.exp_avg_bytes = m;
  f.exp_avg_sq_bytes = stats;
  const bool vec = rows == 1;
  if (o.algo == CpuOptimizerAlgo::kSm3) {
    f.read_bytes = n * (4 + g) + m + stats;
    f.written_bytes = n * (4 + w) + m + stats;
    f.passes = 1;
    return f;
  }
  // Adafactor. Pass 1: gradient (and master for its RMS); a vector's
  // statistics updated in place and its factors 1/sqrt(v) written. Then,
  // for rows too wide to fuse the update's RMS into pass 1 (kernels.h), a
  // pass over the gradient. Last: gradient, master, first moment (and a
  // vector's factors); master, moment, working copy written.
  const bool fused = cpu_adam::AdafactorFusesRms(rows, cols);
  const uint64_t p1_master =
      o.adafactor.scale_parameter && !shape.param_sq_known ? 4 : 0;
  const uint64_t factors = vec ? n * 4 : 0;
  f.read_bytes = n * (g + p1_master) + (fused ? 0 : n * g) + n * (g + 4) + m +
                 stats + factors;
  f.written_bytes = n * (4 + w) + m + stats + factors;
  f.passes = fused ? 2 : 3;
  return f;
}

bool CpuOptimizerIsFactored(CpuOptimizerAlgo a) {
  return a == CpuOptimizerAlgo::kAdafactor || a == CpuOptimizerAlgo::kSm3;
}

bool CpuOptimizerUsesExpAvg(const CpuOptimizerOptions& o) {
  switch (o.algo) {
    case CpuOptimizerAlgo::kAdagrad:
      return false;
    case CpuOptimizerAlgo::kAdafactor:
      return o.adafactor.beta1 > 0;
    case CpuOptimizerAlgo::kSm3:
      return o.beta1 > 0;
    default:
      return true;
  }
}

std::string_view CpuOptimizerAlgoName(CpuOptimizerAlgo a) {
  switch (a) {
    case CpuOptimizerAlgo::kAdam:
      return "adam";
    case CpuOptimizerAlgo::kAdamW:
      return "adamw";
    case CpuOptimizerAlgo::kAdagrad:
      return "adagrad";
    case CpuOptimizerAlgo::kLion:
      return "lion";
    case CpuOptimizerAlgo::kAdafactor:
      return "adafactor";
    case CpuOptimizerAlgo::kSm3:
      return "sm3";
  }
  return "unknown";
}

StatusOr<CpuOptimizerAlgo> ParseCpuOptimizerAlgo(std::string_view name) {
  std::string lower(name);
  for (char& ch : lower) {
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  for (CpuOptimizerAlgo a :
       {CpuOptimizerAlgo::kAdam, CpuOptimizerAlgo::kAdamW,
        CpuOptimizerAlgo::kAdagrad, CpuOptimizerAlgo::kLion,
        CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kSm3}) {
    if (lower == CpuOptimizerAlgoName(a)) return a;
  }
  return Status::InvalidArgument(
      "unknown optimizer '" + std::string(name) +
      "' (expected adam, adamw, adagrad, lion, adafactor or sm3; any case)");
}

size_t CpuStateBytes(CpuDType dtype, size_t n) {
  if (dtype != CpuDType::kBlock8) return n * cpu_adam::DTypeSize(dtype);
  const size_t blocks = (n + kCpuBlock8Elems - 1) / kCpuBlock8Elems;
  return cpu_adam::Block8ScaleOffset(n) + blocks * sizeof(float);
}

Status ConvertCpuArray(const void* src, CpuDType src_dtype, void* dst,
                       CpuDType dst_dtype, size_t n, CpuKernelVariant variant) {
  if (src_dtype == CpuDType::kBlock8 || dst_dtype == CpuDType::kBlock8) {
    return Status::InvalidArgument(
        "ConvertCpuArray: kBlock8 is a state format, not an element type "
        "(accepted: kFloat32, kFloat16, kBFloat16)");
  }
  if (n == 0) return Status::Ok();
  if (src == nullptr || dst == nullptr) {
    return Status::InvalidArgument("ConvertCpuArray: null array");
  }
  if (!cpu_adam::IsAligned(src, cpu_adam::DTypeSize(src_dtype)) ||
      !cpu_adam::IsAligned(dst, cpu_adam::DTypeSize(dst_dtype))) {
    return Status::InvalidArgument("ConvertCpuArray: misaligned array");
  }
  STRATA_ASSIGN_OR_RETURN(CpuKernelVariant v,
                          cpu_adam::ResolveVariant(variant));
  cpu_adam::KernelsFor(v).convert(src, src_dtype, dst, dst_dtype, n);
  return Status::Ok();
}

}  // namespace strata
