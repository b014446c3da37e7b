// The NCCL backend where strata was built without it (no CUDA, or no
// nccl.h at configure time).
#include "comm/backend.h"

namespace strata::internal {

StatusOr<std::unique_ptr<CommBackend>> NewNcclBackend(const CommOptions&) {
  return Status::Unavailable(
      "NCCL backend unavailable: strata was built without NCCL (it needs "
      "CUDA and nccl.h at build time)");
}

}  // namespace strata::internal
