// The DLPack structures a "dltensor" capsule carries (DLPack 0.x ABI, which
// every producer of the unversioned capsule shares: torch >= 1.10,
// NumPy >= 1.22, CuPy, JAX). Only the fields the binding reads; declared
// here so that the package needs no DLPack headers to build.
#ifndef STRATA_PYTHON_DLPACK_H_
#define STRATA_PYTHON_DLPACK_H_

#include <cstdint>

namespace strata::python {

// DLDeviceType values the binding names in its messages.
enum DLDeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // pinned host memory: host-addressable
  kDLROCM = 10,
  kDLROCMHost = 11,  // pinned host memory: host-addressable
};

// DLDataTypeCode values.
enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// The capsule names of the protocol: a producer's capsule is "dltensor"; a
// consumer that takes ownership renames it "used_dltensor". The binding only
// borrows (it never renames), so the capsule's own destructor frees it.
inline constexpr const char* kDLTensorCapsuleName = "dltensor";

}  // namespace strata::python

#endif  // STRATA_PYTHON_DLPACK_H_
