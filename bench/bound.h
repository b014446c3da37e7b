// The streaming bounds of `strata-bench adam`: kernels that move exactly the
// bytes of one optimizer step, with the same store kinds, and do no
// arithmetic at all, so their time is the memory system's.
//
// A pass is described as a list of streams, each an array the step touches:
// read only (the gradient), updated in place (master weights, moment codes,
// per-block scales: loaded and stored back unchanged), or written only with
// non-temporal stores (the 16-bit working copy). Four kernels run over it:
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
};

enum class BoundKernel { kFused, kFusedPrefetch, kFusedPrefetch32, kStream };

inline constexpr BoundKernel kBoundKernels[] = {
    BoundKernel::kFused, BoundKernel::kFusedPrefetch,
    BoundKernel::kFusedPrefetch32, BoundKernel::kStream};

std::string_view BoundKernelName(BoundKernel k);

enum class BoundIsa { kScalar, kAvx2, kAvx512 };

std::string_view BoundIsaName(BoundIsa isa);

// The widest ISA this CPU reports (CPUID), kScalar off x86.
BoundIsa BestBoundIsa();

// How far ahead fused_prefetch prefetches, in elements: 16 KiB of the
// pass (BytesPerElem() bytes per element), rounded up to a multiple of
// 64 and kept within [256, 4096].
size_t BoundPrefetchElems(const BoundArrays& a);

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
