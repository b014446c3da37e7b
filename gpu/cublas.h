// cuBLAS, opened at run time with dlopen so that libstrata.so has no hard
// dependency on libcublas (docs/reliability.md row 11): without it, GEMM
// reports kUnavailable and everything else works.
//
// The library is opened once per process and never closed: handles created
// from it may live as long as any device, and unloading cuBLAS under live
// handles is undefined. Thread-safe.
#ifndef STRATA_GPU_CUBLAS_H_
#define STRATA_GPU_CUBLAS_H_

#include <cublas_v2.h>

#include "strata/status.h"
#include "util/unique_handle.h"

namespace strata::internal {

// The entry points strata uses, resolved with dlsym. decltype of the
// declarations in cublas_v2.h keeps the signatures exact without linking.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  // cublas_api.h overloads cublasGemmEx in C++ (a cudaDataType compute
  // type), so the C entry point's type is spelled out.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t,
                            cublasOperation_t, int m, int n, int k,
                            const void* alpha, const void* a, cudaDataType,
                            int lda, const void* b, cudaDataType, int ldb,
                            const void* beta, void* c, cudaDataType, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&cublasGetStatusString) status_string;  // may be null
  decltype(&cublasGetProperty) get_property;

  // Loads libcublas.so.13 (or libcublas.so) on first call; later calls
  // return the same result. A library of another major version than the
  // headers strata was built with is kUnavailable (its ABI may differ).
  static StatusOr<const CublasApi*> Get();

  // "<context>: cuBLAS <status name/text>" with a fitting code.
  Status ToStatus(cublasStatus_t s, const char* context) const;
};

struct CublasHandleTraits {
  using Handle = cublasHandle_t;
  static Handle Invalid() { return nullptr; }
  // Only handles made through a loaded CublasApi exist, so Get() is cached.
  static void Close(Handle h);
};
using UniqueCublasHandle = UniqueHandle<CublasHandleTraits>;

}  // namespace strata::internal

#endif  // STRATA_GPU_CUBLAS_H_
