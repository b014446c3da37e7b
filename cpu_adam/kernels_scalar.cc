// The portable reference variant: the kernels of kernel_impl.h over plain
// floats. Built without ISA flags so it runs on any x86-64 (and elsewhere).
#define STRATA_CPU_ADAM_ISA scalar
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam {

const KernelTable& ScalarKernels() {
  static const KernelTable table =
      scalar::MakeTable<scalar::Scalar>(CpuKernelVariant::kScalar);
  return table;
}

}  // namespace strata::cpu_adam
