// The host-emulated device's compute: GEMM on OpenBLAS and conversions with
// vector code, spread over a oneTBB arena. Internal to gpu/; docs/gpu.md,
// "Host compute".
//
// Threads. OpenBLAS is told once per process to use one thread per call
// (openblas_set_num_threads(1)); parallelism comes from this arena, which
// splits a GEMM into column or row panels and a long conversion into
// chunks. oneTBB shares one pool of workers among all arenas of a process,
// the CPU optimizer's included, so GEMMs and optimizer steps running at once
// do not oversubscribe the cores, and OpenBLAS's own threads (which spin
// after each call) never compete with them.
#ifndef STRATA_GPU_CPU_COMPUTE_H_
#define STRATA_GPU_CPU_COMPUTE_H_

#include <memory>

#include "strata/device.h"

namespace strata::internal {

// Thread-safe: any number of threads (stream executors) may call at once;
// their work shares the arena's threads.
class CpuCompute {
 public:
  // `threads`: the arena's concurrency, the calling thread included; 0 =
  // oneTBB's default (the CPUs in this process's affinity mask).
  // REQUIRES: threads >= 0.
  explicit CpuCompute(int threads);
  ~CpuCompute();
  CpuCompute(const CpuCompute&) = delete;
  CpuCompute& operator=(const CpuCompute&) = delete;

  // The arena's concurrency.
  int threads() const;

  // The GemmArgs contract on host memory: A and B of 16 bits are widened to
  // fp32 (exactly) in per-thread scratch, sgemm multiplies, and a 16-bit C
  // is computed in fp32 scratch and rounded once. Results differ from
  // GemmOnCpuReference only in the order of the fp32 additions.
  // REQUIRES: arguments validated by CheckGemmArgs.
  void Gemm(const GemmArgs& args);

  // ConvertOnCpu (bit for bit the reference), in parallel chunks when long.
  void Convert(const ConvertArgs& args);

  // Runs `fn` inside the arena, so that oneTBB algorithms it calls use the
  // arena's threads (and no more).
  void Run(HostFunction& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::internal

#endif  // STRATA_GPU_CPU_COMPUTE_H_
