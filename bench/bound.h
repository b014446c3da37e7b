// The streaming bounds of `strata-bench adam`: kernels that move exactly the
// bytes of one optimizer step, with the same store kinds, and do no
// arithmetic at all, so their time is the memory system's.
//
// A pass is described as a list of streams, each an array the step touches:
// read only (the gradient), updated in place (master weights, moment codes,
// per-block scales: loaded and stored back unchanged), or written only with
// non-temporal stores (the 16-bit working copy). Six kernels run over it:
//
//   fused   every stream advanced together, 64 elements at a time, each
//           chunk's loads before its stores, as the optimizer's single
//           pass does;
//   fused_prefetch
//           the same, also prefetching every loaded stream about 16 KiB of
//           the pass ahead (BoundPrefetchElems), as the optimizer's loops
//           prefetch: where memory latency is high, the hardware
//           prefetchers alone leave bandwidth unused;
//   fused_prefetch_32
//           the same in chunks of 32 elements, closer to the optimizer's
//           16-element steps: over the Lion arrays with fp32 moments on two
//           Zen 4 cores it ran at 120 GB/s where the 64-element chunks ran
//           at 114 and the step at 116. Where a 1-byte stream's 32 bytes
//           are less than a register (AVX-512), it runs 64-element chunks;
//   fused_step
//           the optimizer's own loop shape: one register of 4-byte
//           elements per step (16 on AVX-512, 8 on AVX2), each stream's
//           part of it loaded, stored or streamed whole (a half register
//           for a 2-byte stream, a quarter for a 1-byte one), every loaded
//           stream prefetched kBoundStepPrefetchElems ahead, compiled for
//           the pass's shape (BoundStepShape): on one Zen 5 core over the
//           bf16-moment AdamW arrays it streamed 57-59 GB/s where the
//           64-element chunks streamed 51-53 and a loop reading the counts
//           of each kind at run time 3-6% less than the compiled one;
//   fused_lines
//           fused_step two of the optimizers' 16-lane vectors (32 elements)
//           an iteration, each stream write's whole lines stored back to
//           back after the iteration's other stores, as the optimizers
//           stream their working copy (Note [Whole lines of the working
//           copy] in cpu_adam/kernel_impl.h). On one core of an AVX-512
//           Xeon the AdamW steps had beaten the other five by 1-3% in every
//           row of two runs; over the bf16-moment AdamW arrays fused_lines
//           streamed 29.8-31.3 GB/s where fused_step streamed 29.1-30.6;
//   stream  STREAM-style: within each tile, one plain loop per stream (one
//           read-modify-write loop per updated array), so at most one array
//           is in flight at a time.
//
// All run on the optimizer's threading: the same tile size, one oneTBB
// arena of the same thread count, tiles handed out by a static partitioner
// (each thread one contiguous run of tiles). The kernels are built per ISA
// with that ISA's flags (bound_<isa>.cc); the widest one the CPU reports
// runs, whatever variant the optimizer beside it is forced to.
#ifndef STRATA_BENCH_BOUND_H_
#define STRATA_BENCH_BOUND_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace strata::bench {

enum class BoundAccess : uint8_t {
  kRead,         // loaded only
  kUpdate,       // loaded and stored back in place (regular stores)
  kStreamWrite,  // stored only, non-temporal where the address allows
};

// One array of a pass: element i occupies bytes [i * elem_bytes, (i + 1) *
// elem_bytes) of `data`, or, with per_elems > 1, one item of elem_bytes
// covers per_elems elements (a per-block scale: item i / per_elems).
struct BoundStream {
  void* data = nullptr;
  int elem_bytes = 4;  // 1, 2 or 4
  BoundAccess access = BoundAccess::kRead;
  size_t per_elems = 1;  // 1, or a block size (a multiple of 64)
};

inline constexpr int kMaxBoundStreams = 10;

struct BoundArrays {
  BoundStream streams[kMaxBoundStreams];
  int count = 0;

  void Add(void* data, int elem_bytes, BoundAccess access,
           size_t per_elems = 1) {
    streams[count++] = BoundStream{data, elem_bytes, access, per_elems};
  }
  // Bytes one element moves (reads plus writes), as the byte counts of a
  // step are given.
  double BytesPerElem() const;
  // The same streams in the same order: the same arrays, element sizes and
  // accesses, so that a bound kernel's time over one is a sample of its
  // time over the other.
  bool operator==(const BoundArrays& other) const;
};

enum class BoundKernel {
  kFused,
  kFusedPrefetch,
  kFusedPrefetch32,
  kFusedStep,
  kFusedLines,
  kStream
};

inline constexpr BoundKernel kBoundKernels[] = {
    BoundKernel::kFused,           BoundKernel::kFusedPrefetch,
    BoundKernel::kFusedPrefetch32, BoundKernel::kFusedStep,
    BoundKernel::kFusedLines,      BoundKernel::kStream};

std::string_view BoundKernelName(BoundKernel k);

enum class BoundIsa { kScalar, kAvx2, kAvx512 };

std::string_view BoundIsaName(BoundIsa isa);

// The widest ISA this CPU reports (CPUID), kScalar off x86.
BoundIsa BestBoundIsa();

// How far ahead fused_prefetch prefetches, in elements: 16 KiB of the
// pass (BytesPerElem() bytes per element), rounded up to a multiple of
// 64 and kept within [256, 4096].
size_t BoundPrefetchElems(const BoundArrays& a);

// How far ahead fused_step prefetches, in elements: the distance of the
// optimizer's update loops.
inline constexpr size_t kBoundStepPrefetchElems = 512;

// A pass's per-element streams counted by kind, as fused_step sees them:
// count[access][size], access a BoundAccess, size 0 for 4-byte elements, 1
// for 2, 2 for 1. Per-block streams (per_elems > 1) are not counted. A
// negative count (only in the kernel that reads the counts at run time)
// means "as many as the pass has".
struct BoundStepShape {
  int8_t count[3][3] = {};
  friend constexpr bool operator==(const BoundStepShape&,
                                   const BoundStepShape&) = default;
};

// The shapes fused_step is compiled for: every pass of the optimizers
// `strata-bench adam` measures. Updated streams (u4, u2, u1): fp32 master
// with two, one or no fp32, bf16 or 8-bit moments (SM3 over a vector adds a
// 4-byte accumulator); read streams: a 4- or 2-byte gradient; and an
// optional 2-byte working copy written with stream stores. Adafactor's
// read-only passes: the gradient, and the gradient with the fp32 weights.
constexpr int kBoundStepShapeCount = 36;
consteval std::array<BoundStepShape, kBoundStepShapeCount>
MakeBoundStepShapes() {
  std::array<BoundStepShape, kBoundStepShapeCount> out{};
  constexpr int8_t kUpdates[8][3] = {{3, 0, 0}, {1, 2, 0}, {1, 0, 2},
                                     {2, 0, 0}, {1, 1, 0}, {1, 0, 1},
                                     {1, 0, 0}, {2, 1, 0}};
  int k = 0;
  for (const auto& u : kUpdates) {
    for (int grad = 0; grad < 2; ++grad) {  // 4 or 2 bytes
      for (int8_t w = 0; w < 2; ++w) {
        BoundStepShape& s = out[k++];
        s.count[0][grad] = 1;
        for (int z = 0; z < 3; ++z) s.count[1][z] = u[z];
        s.count[2][1] = w;
      }
    }
  }
  constexpr int8_t kReads[4][2] = {{1, 0}, {0, 1}, {2, 0}, {1, 1}};
  for (const auto& r : kReads) {
    out[k].count[0][0] = r[0];
    out[k++].count[0][1] = r[1];
  }
  return out;
}
inline constexpr std::array<BoundStepShape, kBoundStepShapeCount>
    kBoundStepShapes = MakeBoundStepShapes();

BoundStepShape BoundStepShapeOf(const BoundArrays& a);

// The index of a's shape in kBoundStepShapes, or -1 when fused_step has no
// kernel compiled for it (it then runs one that reads the counts at run
// time).
int BoundStepShapeIndex(const BoundArrays& a);

// Runs elements [begin, end) of the pass with `isa`'s `kernel`. REQUIRES:
// the CPU supports `isa`; begin is a multiple of every per_elems (a tile
// start). Non-temporal stores are fenced before return. Updated and read
// arrays are left as they were (updates store back what they loaded);
// stream writes store zeros.
void RunBoundRange(BoundIsa isa, BoundKernel kernel, const BoundArrays& a,
                   size_t begin, size_t end);

// Runs whole passes on `threads` worker threads of its own oneTBB arena,
// split into tiles of `tile_elems` handed out statically (each thread one
// contiguous run of tiles, as the optimizer splits a Step). Not thread-safe:
// one pass at a time.
class BoundRunner {
 public:
  BoundRunner(BoundIsa isa, int threads, size_t tile_elems);
  ~BoundRunner();
  BoundRunner(const BoundRunner&) = delete;
  BoundRunner& operator=(const BoundRunner&) = delete;

  void Run(BoundKernel kernel, const BoundArrays& a, size_t n);
  BoundIsa isa() const { return isa_; }

 private:
  struct Arena;
  BoundIsa isa_;
  size_t tile_;
  std::unique_ptr<Arena> arena_;
};

}  // namespace strata::bench

#endif  // STRATA_BENCH_BOUND_H_
