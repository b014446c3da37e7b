#include "bench/bound.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>

namespace strata::bench {

// Defined in bound_<isa>.cc, each compiled with its ISA's flags.
void BoundScalar(const BoundArrays& a, size_t begin, size_t end);
void BoundAvx2(const BoundArrays& a, size_t begin, size_t end);
void BoundAvx512(const BoundArrays& a, size_t begin, size_t end);

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

void RunBoundRange(BoundIsa isa, const BoundArrays& a, size_t begin,
                   size_t end) {
  switch (isa) {
    case BoundIsa::kAvx512:
      return BoundAvx512(a, begin, end);
    case BoundIsa::kAvx2:
      return BoundAvx2(a, begin, end);
    case BoundIsa::kScalar:
      break;
  }
  BoundScalar(a, begin, end);
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

void BoundRunner::Run(const BoundArrays& a, size_t n) {
  const size_t tiles = (n + tile_ - 1) / tile_;
  const BoundIsa isa = isa_;
  const size_t tile = tile_;
  arena_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) {
            RunBoundRange(isa, a, t * tile, std::min(n, (t + 1) * tile));
          }
        },
        tbb::static_partitioner());
  });
}

}  // namespace strata::bench
