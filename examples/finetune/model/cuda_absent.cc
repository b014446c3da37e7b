// A build without CUDA has no CUDA kernel set.
#include "examples/finetune/model/gpu_kernels.h"

namespace finetune {
const GpuKernels* CudaKernelTable() { return nullptr; }
}  // namespace finetune
