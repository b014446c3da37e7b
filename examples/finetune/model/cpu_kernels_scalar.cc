// The portable CPU kernels (cpu_kernels_impl.h with one-lane vectors).
#define FINETUNE_CPU_ISA scalar
#include "examples/finetune/model/cpu_kernels_impl.h"
