#include "gpu/cublas.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

namespace strata::internal {
namespace {

StatusOr<const CublasApi*> Load() {
  // The soname first (what a CUDA 13 install provides), then the dev link.
  static const char* kNames[] = {"libcublas.so.13", "libcublas.so"};
  void* lib = nullptr;
  std::string errors;
  for (const char* name : kNames) {
    lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* e = ::dlerror();
    errors += std::string(errors.empty() ? "" : "; ") + (e ? e : name);
  }
  if (lib == nullptr) {
    return Status::Unavailable("cannot load cuBLAS: " + errors);
  }
  auto* api = new CublasApi();  // process lifetime, see the header
  bool missing = false;
  std::string which;
  auto resolve = [&](auto& fn, const char* symbol, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
        ::dlsym(lib, symbol));
    if (fn == nullptr && required) {
      missing = true;
      which += std::string(which.empty() ? "" : ", ") + symbol;
    }
  };
  resolve(api->create, "cublasCreate_v2", true);
  resolve(api->destroy, "cublasDestroy_v2", true);
  resolve(api->set_stream, "cublasSetStream_v2", true);
  resolve(api->set_math_mode, "cublasSetMathMode", true);
  resolve(api->gemm_ex, "cublasGemmEx", true);
  resolve(api->status_string, "cublasGetStatusString", false);
  resolve(api->get_property, "cublasGetProperty", true);
  if (missing) {
    delete api;
    ::dlclose(lib);
    return Status::Unavailable("cuBLAS lacks " + which);
  }
  int major = -1;
  if (api->get_property(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      major != CUBLAS_VER_MAJOR) {
    delete api;
    ::dlclose(lib);
    return Status::Unavailable("cuBLAS " + std::to_string(major) +
                               ".x was found, but strata was "
                               "built against cuBLAS " +
                               std::to_string(CUBLAS_VER_MAJOR));
  }
  return static_cast<const CublasApi*>(api);
}

}  // namespace

StatusOr<const CublasApi*> CublasApi::Get() {
  static const StatusOr<const CublasApi*> api = Load();
  return api;
}

Status CublasApi::ToStatus(cublasStatus_t s, const char* context) const {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  std::string msg = std::string(context) + ": cuBLAS status " +
                    std::to_string(static_cast<int>(s));
  if (status_string != nullptr)
    msg += std::string(" (") + status_string(s) + ")";
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return Status::OutOfMemory(msg);
    case CUBLAS_STATUS_INVALID_VALUE:
      return Status::InvalidArgument(msg);
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return Status::NotSupported(msg);
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return Status::Unavailable(msg);
    default:
      return Status::Internal(msg);
  }
}

void CublasHandleTraits::Close(Handle h) {
  auto api = CublasApi::Get();
  if (api.ok()) (*api)->destroy(h);
}

}  // namespace strata::internal
