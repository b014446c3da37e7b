// Internal interface between the optimizer driver (cpu_adam.cc) and the
// per-ISA kernel translation units. Each kernels_<isa>.cc is compiled with
// its own -m flags and exports one KernelTable; the driver picks a table at
// run time after checking the CPU, so no code compiled for an ISA the CPU
// lacks is ever called.

#ifndef STRATA_CPU_ADAM_KERNELS_H_
#define STRATA_CPU_ADAM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "strata/cpu_adam.h"

namespace strata::cpu_adam {

// Per-step scalars, formed in double by the driver and rounded once to
// float, as torch does with Python floats.
struct StepParams {
  CpuOptimizerAlgo algo;
  CpuDType grad_dtype;
  CpuDType moment_dtype;
  CpuDType working_dtype;
  bool has_working;
  float gscale;        // inv_loss_scale * clip_coef
  float beta1;         // Adam: m decay. Lion: update interpolation
  float beta2;         // Adam: v decay. Lion: momentum decay
  float omb1;          // 1 - beta1
  float omb2;          // 1 - beta2
  float eps;           // Adam, Adagrad
  float l2;            // Adam, Adagrad: weight decay added to the gradient
  float decay;         // AdamW, Lion: 1 - lr * weight_decay
  bool use_l2;         // l2 != 0
  bool use_decay;      // decay != 1
  float neg_step;      // Adam: -lr / bias_correction1. Adagrad: -lr. Lion: -lr
  float bc2_sqrt;      // Adam: sqrt(bias_correction2)
  float inv_bc2_sqrt;  // Adam, kBlock8 moments: 1 / sqrt(bias_correction2)
};

// Raw array pointers of one update (types per StepParams).
struct StepArrays {
  size_t n;  // elements of the whole update (locates kBlock8 scales)
  float* master;
  const void* grad;
  void* m;
  void* v;
  void* working;
};

struct KernelTable {
  CpuKernelVariant variant;
  // Updates elements [begin, end); with kBlock8 moments begin is a multiple
  // of kCpuBlock8Elems (the driver's tiles are). Non-temporal stores are fenced
  // before return, so completion of the call orders them for other threads.
  void (*step)(const StepParams& p, const StepArrays& a, size_t begin,
               size_t end);
  // Sum of squares (double) and whether all of [begin, end) of g * scale are
  // finite.
  void (*grad_stats)(const void* g, CpuDType dtype, size_t begin, size_t end,
                     float scale, double* sum_sq, bool* finite);
  // Converts n elements (src and dst types differ or are equal).
  void (*convert)(const void* src, CpuDType src_dtype, void* dst,
                  CpuDType dst_dtype, size_t n);
};

const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();
const KernelTable& Avx512Bf16Kernels();

// The table of a supported variant (not kAuto); the caller checked support.
const KernelTable& KernelsFor(CpuKernelVariant v);

// Bytes per element of a fp32/fp16/bf16 array (1 for kBlock8 codes).
size_t DTypeSize(CpuDType t);

// Byte offset of the scales in a kBlock8 state array of n elements.
inline size_t Block8ScaleOffset(size_t n) { return (n + 3) / 4 * 4; }

}  // namespace strata::cpu_adam

#endif  // STRATA_CPU_ADAM_KERNELS_H_
