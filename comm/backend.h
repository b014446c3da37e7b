// The interface every collectives backend implements (single rank, MPI in
// libstrata_comm_mpi.so, NCCL), below include/strata/comm.h. The
// Communicator checks arguments, keeps the first error, applies the timeout
// and runs stream ordering; a backend only starts collectives and reports
// their progress without blocking.
#ifndef STRATA_COMM_BACKEND_H_
#define STRATA_COMM_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/comm.h"
#include "strata/status.h"

namespace strata::internal {

enum class CommOpKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier
};
// "all-gather", "reduce-scatter", "all-reduce", "broadcast", "barrier".
std::string_view CommOpName(CommOpKind kind);

// One collective, already checked by the Communicator.
struct CollectiveArgs {
  CommOpKind kind = CommOpKind::kBarrier;
  const void* send = nullptr;  // broadcast: unused
  void* recv = nullptr;        // broadcast: the buffer
  // All-gather and reduce-scatter: elements per rank (size() entries);
  // all-reduce and broadcast: one entry, the count; barrier: empty.
  std::vector<size_t> counts;
  CommType type = CommType::kByte;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;

  // "all-reduce (sum, bfloat16, 1024 elements)".
  std::string Describe() const;
  // counts[0] + ... + counts[i-1].
  size_t Offset(size_t i) const;
  size_t Total() const { return Offset(counts.size()); }
};

// One started collective. Test and Abandon are called by one thread at a
// time; neither blocks.
class BackendRequest {
 public:
  virtual ~BackendRequest() = default;
  // True once complete; an error when it failed.
  virtual StatusOr<bool> Test() = 0;
  // The timeout passed: give up on it (NCCL aborts its communicator; MPI
  // leaves the request and skips MPI_Finalize at exit).
  virtual void Abandon() {}
};

// Thread contract: Start and Enqueue are serialized by the Communicator.
class CommBackend {
 public:
  virtual ~CommBackend() = default;
  virtual CommBackendKind kind() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Whether Start takes host memory (NCCL: no).
  virtual bool host_memory() const { return true; }
  // Starts a collective on host memory. Returns at once.
  virtual StatusOr<std::unique_ptr<BackendRequest>> Start(
      const CollectiveArgs& args) = 0;
  // Enqueues a collective on device memory on a native stream (NCCL).
  // Default: kNotSupported; the Communicator then runs Start as
  // stream-ordered host work where the device allows.
  virtual StatusOr<std::unique_ptr<BackendRequest>> Enqueue(
      const CollectiveArgs& args, Stream& stream);
  virtual bool native_streams() const { return false; }
  // Starts making a new backend over the same ranks, independent of this
  // one (its collectives never match this one's): a collective. The new
  // backend may be used once `*request` completes. Default: kNotSupported.
  virtual StatusOr<std::unique_ptr<CommBackend>> StartDuplicate(
      std::unique_ptr<BackendRequest>* request);
};

// The ABI between libstrata and libstrata_comm_mpi.so: both are built from
// one tree, and the version guards against a stale plugin.
inline constexpr int kCommMpiPluginAbi = 2;
using CommMpiAbiFn = int (*)();
// `mpi_comm`: as CommOptions::mpi_comm. On failure returns null and sets
// *error.
using CommMpiCreateFn = CommBackend* (*)(void* mpi_comm, Status* error);
inline constexpr const char* kCommMpiAbiSymbol = "strata_comm_mpi_abi";
inline constexpr const char* kCommMpiCreateSymbol = "strata_comm_mpi_create";
inline constexpr const char* kCommMpiLibrary = "libstrata_comm_mpi.so";

// The NCCL backend (comm/nccl_backend.cc); kUnavailable when strata was
// built without NCCL or libnccl.so.2 cannot be loaded.
StatusOr<std::unique_ptr<CommBackend>> NewNcclBackend(
    const CommOptions& options);

// Element-wise reductions of host arrays, inout[i] = op(inout[i], in[i]),
// for the floating types; 16-bit types compute in fp32 and round to nearest
// even; max propagates NaN.
void ReduceHost(const void* in, void* inout, size_t count, CommType type,
                ReduceOp op);

}  // namespace strata::internal

#endif  // STRATA_COMM_BACKEND_H_
