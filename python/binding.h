// What the parts of strata._strata share: turning a Status into the
// package's exceptions, and borrowing a DLPack array for one call.
#ifndef STRATA_PYTHON_BINDING_H_
#define STRATA_PYTHON_BINDING_H_

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "strata/cpu_adam.h"
#include "strata/status.h"

// Hidden, as pybind11's own namespace is: the types hold pybind11 objects.
#pragma GCC visibility push(hidden)
namespace strata::python {

namespace py = pybind11;

// Raises strata.InvalidArgumentError (kInvalidArgument, kOutOfRange) or
// strata.Error with the status's message and its code name in `.code`.
[[noreturn]] void ThrowStatus(const Status& s);

template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  if (!v.ok()) ThrowStatus(v.status());
  return *std::move(v);
}

inline void OkOrThrow(const Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

// "cpu", "cuda", ... for a DLPack device type.
std::string DeviceName(int32_t type);

// The element kinds an argument may have. uint8 arrays hold kBlock8 state.
enum Accept : unsigned {
  kAcceptF32 = 1u << 0,
  kAcceptF16 = 1u << 1,
  kAcceptBF16 = 1u << 2,
  kAcceptU8 = 1u << 3,
};

// One array borrowed for the length of a call.
struct Borrowed {
  py::object capsule;  // keeps the producer's memory alive
  void* data = nullptr;
  size_t numel = 0;
  size_t nbytes = 0;
  CpuDType dtype = CpuDType::kFloat32;  // kBlock8 for uint8
  int32_t device_type = 1;              // DLPack's kDLCPU
  int32_t device_id = 0;
};

// Checks one array (any object with __dlpack__, or a "dltensor" capsule):
// an accepted dtype, C-contiguous, naturally aligned, and, with
// `host_only`, host memory. `what` names it in every message: TypeError
// for what is not an array or has another dtype, ValueError otherwise.
Borrowed Borrow(py::handle obj, const std::string& what, unsigned accept,
                bool host_only = true);

// Adds strata.Engine and strata.Pin to the module (engine_binding.cc).
void BindEngine(py::module_& m);

}  // namespace strata::python
#pragma GCC visibility pop

#endif  // STRATA_PYTHON_BINDING_H_
