// The AVX2 + FMA + F16C CPU kernels; cpu_kernels.cc calls them only after
// __builtin_cpu_supports says the CPU has all three.
#define FINETUNE_CPU_ISA avx2
#define FINETUNE_CPU_AVX2 1
#include "examples/finetune/model/cpu_kernels_impl.h"
