// ReportCpuAvx512 (cpu_adam/kernels.h), in a file of its own so that a
// program can link another answer in its place: the tests of the AVX-512
// kernels under emulation (tests/cpu_adam/avx512_emulated.cc) do, since
// there the AVX-512 tables are built over portable code.
#include "cpu_adam/kernels.h"

namespace strata::cpu_adam {

CpuAvx512Report ReportCpuAvx512() {
  CpuAvx512Report r;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  r.base =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  r.bf16 = r.base && __builtin_cpu_supports("avx512bf16");
#endif
  return r;
}

}  // namespace strata::cpu_adam
