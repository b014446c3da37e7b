#include <cpuid.h>

#include <cstdlib>

#include "examples/finetune/model/kernels.h"

namespace finetune::cpu {
namespace scalar {
const CpuKernels& Table();
}
namespace avx2 {
const CpuKernels& Table();
}

namespace {
// F16C from CPUID leaf 1 (ECX bit 29): clang before 15 rejects
// __builtin_cpu_supports("f16c").
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             CpuHasF16c();
  }
  return false;
}

Isa BestIsa() { return IsaSupported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar; }

const CpuKernels& Kernels(Isa isa) {
  if (isa == Isa::kAvx2 && IsaSupported(isa)) return avx2::Table();
  return scalar::Table();
}

}  // namespace finetune::cpu
