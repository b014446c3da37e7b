#include <cstdlib>

#include "examples/finetune/model/kernels.h"

namespace finetune::cpu {
namespace scalar {
const CpuKernels& Table();
}
namespace avx2 {
const CpuKernels& Table();
}

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
  }
  return false;
}

Isa BestIsa() { return IsaSupported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar; }

const CpuKernels& Kernels(Isa isa) {
  if (isa == Isa::kAvx2 && IsaSupported(isa)) return avx2::Table();
  return scalar::Table();
}

}  // namespace finetune::cpu
