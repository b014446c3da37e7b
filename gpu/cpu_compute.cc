#include "gpu/cpu_compute.h"

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "gpu/cpu_kernels.h"
#include "util/tsan_annotations.h"

namespace strata::internal {
namespace {

// Below this many flops a GEMM runs on the calling thread: splitting would
// cost more than it saves (2^22 flops is about 0.1 ms on one AVX2 core).
constexpr double kParallelGemmFlops = 1 << 22;
// Conversions shorter than this run on the calling thread; longer ones in
// chunks of kConvertChunk elements (a multiple of the vector width).
constexpr size_t kParallelConvertElements = size_t{1} << 18;
constexpr size_t kConvertChunk = size_t{1} << 16;
// Panel widths are multiples of these, so that OpenBLAS's micro-kernels
// (16 x 4 and 8 x 8 tiles on AVX2) see whole tiles except at the end.
constexpr int64_t kRowAlign = 16;
constexpr int64_t kColAlign = 8;

// Per-thread scratch for widened operands and a 16-bit C, grown as needed
// and kept (a stream's executor reuses it GEMM after GEMM, so large GEMMs do
// not map and fault in fresh pages each time).
struct Scratch {
  std::vector<float> a, b, c;
};
thread_local Scratch t_scratch;

float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Addresses for the TSan annotations only (util/tsan_annotations.h): the
// caller releases g_fork_sync before oneTBB hands out work and every piece
// acquires it; every piece releases g_join_sync and the caller acquires it
// after the join.
char g_fork_sync = 0;
char g_join_sync = 0;

// One parallel call, type-erased: fn(begin, end) over pieces of [0, n).
struct RangeJob {
  const void* fn;
  void (*call)(const void* fn, int64_t begin, int64_t end);
};

void RunRange(const RangeJob* job, int64_t begin, int64_t end) {
  STRATA_TSAN_ACQUIRE(&g_fork_sync);
  job->call(job->fn, begin, end);
  STRATA_TSAN_RELEASE(&g_join_sync);
}

// The parallel_for body. oneTBB copies it into its tasks after the caller's
// release, so reading its one field must stay uninstrumented; what RunRange
// touches is ordered by the annotations.
struct RangeBody {
  const RangeJob* job;
  __attribute__((no_sanitize_thread)) void operator()(
      const tbb::blocked_range<int64_t>& r) const {
    RunRange(job, r.begin(), r.end());
  }
};

// A rows x cols matrix view: element (i, j) at data + (i + j * ld) * elem.
struct Matrix {
  const void* data;
  ElementType type;
  int64_t ld;
};

}  // namespace

struct CpuCompute::Impl {
  explicit Impl(int threads) : arena(threads) {}

  // fn(begin, end) over [0, n), split evenly over the arena's threads (the
  // caller's included) in pieces of at least `grain` indices; returns when
  // all are done. The static partitioner is also the one whose oneTBB
  // internals the tests' TSan suppressions cover.
  template <class Fn>
  void ParallelFor(int64_t n, int64_t grain, const Fn& fn) {
    RangeJob job{&fn, [](const void* f, int64_t begin, int64_t end) {
                   (*static_cast<const Fn*>(f))(begin, end);
                 }};
    Execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                        RangeBody{&job}, tbb::static_partitioner());
    });
  }

  // fn() inside the arena. When no slot is free, oneTBB runs it on another
  // thread of the arena, hence the annotations here too.
  template <class Fn>
  void Execute(const Fn& fn) {
    STRATA_TSAN_RELEASE(&g_fork_sync);
    arena.execute([&fn] {
      STRATA_TSAN_ACQUIRE(&g_fork_sync);
      fn();
      STRATA_TSAN_RELEASE(&g_join_sync);
    });
    STRATA_TSAN_ACQUIRE(&g_join_sync);
  }

  // For each column j of a rows x cols matrix, dst(:, j) = src(:, j)
  // converted, in chunks of about kConvertChunk elements.
  void ConvertColumns(Matrix src, void* dst, ElementType dst_type,
                      int64_t dst_ld, int64_t rows, int64_t cols) {
    const size_t ss = ElementSize(src.type), ds = ElementSize(dst_type);
    auto column = [&](int64_t j) {
      ConvertArgs c;
      c.src = static_cast<const std::byte*>(src.data) + j * src.ld * ss;
      c.src_type = src.type;
      c.dst = static_cast<std::byte*>(dst) + j * dst_ld * ds;
      c.dst_type = dst_type;
      c.count = static_cast<size_t>(rows);
      ConvertOnCpu(c);
    };
    if (src.ld == rows && dst_ld == rows) {  // contiguous: one long run
      ConvertArgs c;
      c.src = src.data;
      c.src_type = src.type;
      c.dst = dst;
      c.dst_type = dst_type;
      c.count = static_cast<size_t>(rows * cols);
      Convert(c);
      return;
    }
    const auto elems = static_cast<size_t>(rows * cols);
    if (elems < kParallelConvertElements) {
      for (int64_t j = 0; j < cols; ++j) column(j);
      return;
    }
    const int64_t grain = std::max<int64_t>(
        1, static_cast<int64_t>(kConvertChunk) / std::max<int64_t>(rows, 1));
    ParallelFor(cols, grain, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) column(j);
    });
  }

  void Convert(const ConvertArgs& args) {
    if (args.count < kParallelConvertElements) {
      ConvertOnCpu(args);
      return;
    }
    const size_t ss = ElementSize(args.src_type);
    const size_t ds = ElementSize(args.dst_type);
    const auto chunks =
        static_cast<int64_t>((args.count + kConvertChunk - 1) / kConvertChunk);
    ParallelFor(chunks, 1, [&](int64_t first_chunk, int64_t last_chunk) {
      ConvertArgs part = args;
      const size_t first = static_cast<size_t>(first_chunk) * kConvertChunk;
      const size_t last =
          std::min(args.count, static_cast<size_t>(last_chunk) * kConvertChunk);
      part.src = static_cast<const std::byte*>(args.src) + first * ss;
      part.dst = static_cast<std::byte*>(args.dst) + first * ds;
      part.count = last - first;
      ConvertOnCpu(part);
    });
  }

  // C = alpha op(A) op(B) + beta C on fp32 operands, split into panels of
  // C's columns (or rows, when C is taller than wide), one sgemm each.
  void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
             const float* a, int64_t lda, const float* b, int64_t ldb,
             float beta, float* c, int64_t ldc) {
    const CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans;
    const CBLAS_TRANSPOSE opb = tb ? CblasTrans : CblasNoTrans;
    auto call = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
      const float* pa = ta ? a + i0 * lda : a + i0;
      const float* pb = tb ? b + j0 : b + j0 * ldb;
      cblas_sgemm(CblasColMajor, opa, opb, static_cast<blasint>(i1 - i0),
                  static_cast<blasint>(j1 - j0), static_cast<blasint>(k), alpha,
                  pa, static_cast<blasint>(lda), pb, static_cast<blasint>(ldb),
                  beta, c + i0 + j0 * ldc, static_cast<blasint>(ldc));
    };
    const int threads = arena.max_concurrency();
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) *
                         static_cast<double>(k);
    const bool by_rows = m > n;
    const int64_t dim = by_rows ? m : n;
    const int64_t align = by_rows ? kRowAlign : kColAlign;
    const int64_t step =
        (dim / threads + align - 1) / align * align;  // panel width
    if (threads <= 1 || flops < kParallelGemmFlops || step == 0 ||
        step >= dim) {
      call(0, m, 0, n);
      return;
    }
    const int64_t panels = (dim + step - 1) / step;
    ParallelFor(panels, 1, [&](int64_t first, int64_t last) {
      const int64_t lo = first * step, hi = std::min(dim, last * step);
      if (by_rows) {
        call(lo, hi, 0, n);
      } else {
        call(0, m, lo, hi);
      }
    });
  }

  tbb::task_arena arena;
};

CpuCompute::CpuCompute(int threads)
    : impl_(std::make_unique<Impl>(
          threads > 0 ? threads : tbb::info::default_concurrency())) {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

CpuCompute::~CpuCompute() = default;

int CpuCompute::threads() const { return impl_->arena.max_concurrency(); }

void CpuCompute::Convert(const ConvertArgs& args) { impl_->Convert(args); }

void CpuCompute::Run(HostFunction& fn) {
  impl_->Execute([&fn] { fn(); });
}

void CpuCompute::Gemm(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  const bool ta = g.op_a == GemmOp::kTranspose;
  const bool tb = g.op_b == GemmOp::kTranspose;
  // Scratch is this thread's; the panels running on other threads only read
  // and write through the pointers taken here.
  Scratch& scratch = t_scratch;
  const float* a = static_cast<const float*>(g.a);
  const float* b = static_cast<const float*>(g.b);
  int64_t lda = g.lda, ldb = g.ldb;
  if (g.ab_type != ElementType::kFloat32) {
    const int64_t ar = ta ? g.k : g.m, ac = ta ? g.m : g.k;
    const int64_t br = tb ? g.n : g.k, bc = tb ? g.k : g.n;
    float* wa = Grow(scratch.a, static_cast<size_t>(ar * ac));
    float* wb = Grow(scratch.b, static_cast<size_t>(br * bc));
    impl_->ConvertColumns({g.a, g.ab_type, g.lda}, wa, ElementType::kFloat32,
                          ar, ar, ac);
    impl_->ConvertColumns({g.b, g.ab_type, g.ldb}, wb, ElementType::kFloat32,
                          br, br, bc);
    a = wa;
    b = wb;
    lda = std::max<int64_t>(ar, 1);
    ldb = std::max<int64_t>(br, 1);
  }
  if (g.c_type == ElementType::kFloat32) {
    impl_->Sgemm(ta, tb, g.m, g.n, g.k, g.alpha, a, lda, b, ldb, g.beta,
                 static_cast<float*>(g.c), g.ldc);
    return;
  }
  // A 16-bit C: computed in fp32 and rounded once, as the contract says.
  float* wc = Grow(scratch.c, static_cast<size_t>(g.m * g.n));
  if (g.beta != 0) {
    impl_->ConvertColumns({g.c, g.c_type, g.ldc}, wc, ElementType::kFloat32,
                          g.m, g.m, g.n);
  }
  impl_->Sgemm(ta, tb, g.m, g.n, g.k, g.alpha, a, lda, b, ldb, g.beta, wc, g.m);
  impl_->ConvertColumns({wc, ElementType::kFloat32, g.m}, g.c, g.c_type, g.ldc,
                        g.m, g.n);
}

}  // namespace strata::internal
