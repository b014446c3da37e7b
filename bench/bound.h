// The streaming bound of `strata-bench adam`: a kernel that moves the same
// bytes as one optimizer step, the same way (master, grad, m, v read; master,
// m, v written in place; the 16-bit working copy written once with
// non-temporal stores), with trivial integer arithmetic in place of the
// update, so its time is the memory system's. It is built per ISA with that
// ISA's flags (bound_<isa>.cc) and always runs the best one the CPU reports,
// whatever variant the optimizer beside it is forced to.
#ifndef STRATA_BENCH_BOUND_H_
#define STRATA_BENCH_BOUND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace strata::bench {

// The arrays of one pass; element sizes as in a Step: grad_bytes and
// moment_bytes are 4 or 2; working may be null.
struct BoundArrays {
  float* master;
  const void* grad;
  void* m;
  void* v;
  uint16_t* working;
  int grad_bytes;
  int moment_bytes;
};

enum class BoundIsa { kScalar, kAvx2, kAvx512 };

std::string_view BoundIsaName(BoundIsa isa);

// The widest ISA this CPU reports (CPUID), kScalar off x86.
BoundIsa BestBoundIsa();

// Runs elements [begin, end) of the pass with `isa`'s kernel. REQUIRES: the
// CPU supports `isa`. Non-temporal stores are fenced before return.
void RunBoundRange(BoundIsa isa, const BoundArrays& a, size_t begin,
                   size_t end);

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

  void Run(const BoundArrays& a, size_t n);
  BoundIsa isa() const { return isa_; }

 private:
  struct Arena;
  BoundIsa isa_;
  size_t tile_;
  std::unique_ptr<Arena> arena_;
};

}  // namespace strata::bench

#endif  // STRATA_BENCH_BOUND_H_
