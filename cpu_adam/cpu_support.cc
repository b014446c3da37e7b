// CpuKernelVariantSupported: what this CPU reports, in a file of its own so
// that a program can link another answer in its place. The tests of the
// AVX-512 kernels under emulation (tests/cpu_adam/avx512_emulated.cc) do:
// there the AVX-512 tables are built over portable code, and this check
// would keep their cases from running.
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "strata/cpu_adam.h"

namespace strata {

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
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (v) {
    case CpuKernelVariant::kAuto:
    case CpuKernelVariant::kScalar:
      return true;
    case CpuKernelVariant::kAvx2:
      return avx2;
    case CpuKernelVariant::kAvx512:
      return avx512;
    case CpuKernelVariant::kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return v == CpuKernelVariant::kAuto || v == CpuKernelVariant::kScalar;
#endif
}

}  // namespace strata
