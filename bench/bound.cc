#include "bench/bound.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>

namespace strata::bench {

// Defined in bound_<isa>.cc, each compiled with its ISA's flags.
// `ahead`: prefetch distance in elements, 0 for none; `chunk`: elements per
// step of the fused kernel, 32 or 64 (FusedChunk in bound_impl.h).
void BoundScalarFused(const BoundArrays& a, size_t begin, size_t end,
                      size_t ahead, size_t chunk);
void BoundScalarStream(const BoundArrays& a, size_t begin, size_t end);
void BoundAvx2Fused(const BoundArrays& a, size_t begin, size_t end,
                    size_t ahead, size_t chunk);
void BoundAvx2Stream(const BoundArrays& a, size_t begin, size_t end);
void BoundAvx512Fused(const BoundArrays& a, size_t begin, size_t end,
                      size_t ahead, size_t chunk);
void BoundAvx512Stream(const BoundArrays& a, size_t begin, size_t end);
// `shape`: the index of a's shape in kBoundStepShapes, or -1; `lines`:
// fused_lines, else fused_step.
void BoundScalarStep(const BoundArrays& a, size_t begin, size_t end, int shape,
                     bool lines);
void BoundAvx2Step(const BoundArrays& a, size_t begin, size_t end, int shape,
                   bool lines);
void BoundAvx512Step(const BoundArrays& a, size_t begin, size_t end, int shape,
                     bool lines);

double BoundArrays::BytesPerElem() const {
  double bytes = 0;
  for (int s = 0; s < count; ++s) {
    const BoundStream& st = streams[s];
    const double b =
        static_cast<double>(st.elem_bytes) / static_cast<double>(st.per_elems);
    bytes += st.access == BoundAccess::kUpdate ? 2 * b : b;
  }
  return bytes;
}

bool BoundArrays::operator==(const BoundArrays& other) const {
  if (count != other.count) return false;
  for (int s = 0; s < count; ++s) {
    const BoundStream& a = streams[s];
    const BoundStream& b = other.streams[s];
    if (a.data != b.data || a.elem_bytes != b.elem_bytes ||
        a.access != b.access || a.per_elems != b.per_elems) {
      return false;
    }
  }
  return true;
}

std::string_view BoundKernelName(BoundKernel k) {
  switch (k) {
    case BoundKernel::kFused:
      return "fused";
    case BoundKernel::kFusedPrefetch:
      return "fused_prefetch";
    case BoundKernel::kFusedPrefetch32:
      return "fused_prefetch_32";
    case BoundKernel::kFusedStep:
      return "fused_step";
    case BoundKernel::kFusedLines:
      return "fused_lines";
    case BoundKernel::kStream:
      break;
  }
  return "stream";
}

size_t BoundPrefetchElems(const BoundArrays& a) {
  const double bytes = std::max(1.0, a.BytesPerElem());
  const size_t elems = static_cast<size_t>(16384.0 / bytes);
  return std::clamp<size_t>((elems + 63) / 64 * 64, 256, 4096);
}

BoundStepShape BoundStepShapeOf(const BoundArrays& a) {
  BoundStepShape shape;
  for (int s = 0; s < a.count; ++s) {
    const BoundStream& st = a.streams[s];
    if (st.per_elems > 1) continue;
    const int size = st.elem_bytes == 4 ? 0 : st.elem_bytes == 2 ? 1 : 2;
    ++shape.count[static_cast<int>(st.access)][size];
  }
  return shape;
}

int BoundStepShapeIndex(const BoundArrays& a) {
  const BoundStepShape shape = BoundStepShapeOf(a);
  for (int k = 0; k < kBoundStepShapeCount; ++k) {
    if (kBoundStepShapes[k] == shape) return k;
  }
  return -1;
}

std::string_view BoundIsaName(BoundIsa isa) {
  switch (isa) {
    case BoundIsa::kAvx2:
      return "avx2";
    case BoundIsa::kAvx512:
      return "avx512";
    case BoundIsa::kScalar:
      break;
  }
  return "scalar";
}

BoundIsa BestBoundIsa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return BoundIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2")) return BoundIsa::kAvx2;
#endif
  return BoundIsa::kScalar;
}

void RunBoundRange(BoundIsa isa, BoundKernel kernel, const BoundArrays& a,
                   size_t begin, size_t end) {
  if (kernel == BoundKernel::kFusedStep || kernel == BoundKernel::kFusedLines) {
    const int shape = BoundStepShapeIndex(a);
    const bool lines = kernel == BoundKernel::kFusedLines;
    switch (isa) {
      case BoundIsa::kAvx512:
        return BoundAvx512Step(a, begin, end, shape, lines);
      case BoundIsa::kAvx2:
        return BoundAvx2Step(a, begin, end, shape, lines);
      case BoundIsa::kScalar:
        break;
    }
    return BoundScalarStep(a, begin, end, shape, lines);
  }
  const bool fused = kernel != BoundKernel::kStream;
  const size_t ahead = kernel == BoundKernel::kFusedPrefetch ||
                               kernel == BoundKernel::kFusedPrefetch32
                           ? BoundPrefetchElems(a)
                           : 0;
  const size_t chunk = kernel == BoundKernel::kFusedPrefetch32 ? 32 : 64;
  switch (isa) {
    case BoundIsa::kAvx512:
      return fused ? BoundAvx512Fused(a, begin, end, ahead, chunk)
                   : BoundAvx512Stream(a, begin, end);
    case BoundIsa::kAvx2:
      return fused ? BoundAvx2Fused(a, begin, end, ahead, chunk)
                   : BoundAvx2Stream(a, begin, end);
    case BoundIsa::kScalar:
      break;
  }
  return fused ? BoundScalarFused(a, begin, end, ahead, chunk)
               : BoundScalarStream(a, begin, end);
}

struct BoundRunner::Arena {
  explicit Arena(int threads) : arena(threads) {}
  tbb::task_arena arena;
};

BoundRunner::BoundRunner(BoundIsa isa, int threads, size_t tile_elems)
    : isa_(isa),
      tile_(std::max<size_t>(64, (tile_elems + 63) / 64 * 64)),
      arena_(std::make_unique<Arena>(std::max(1, threads))) {}

BoundRunner::~BoundRunner() = default;

void BoundRunner::Run(BoundKernel kernel, const BoundArrays& a, size_t n) {
  const size_t tiles = (n + tile_ - 1) / tile_;
  const BoundIsa isa = isa_;
  const size_t tile = tile_;
  arena_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) {
            RunBoundRange(isa, kernel, a, t * tile,
                          std::min(n, (t + 1) * tile));
          }
        },
        tbb::static_partitioner());
  });
}

}  // namespace strata::bench
