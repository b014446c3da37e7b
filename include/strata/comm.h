// Collectives across ranks: all-gather, reduce-scatter, all-reduce,
// broadcast and barrier, on pinned host memory or on device memory, over one
// of three backends (docs/comm.md):
//   - single rank (the default): no dependency; every collective is a copy.
//   - MPI: Open MPI or any MPI, in its own shared object
//     (libstrata_comm_mpi.so) that libstrata loads on request, so libstrata
//     never names libmpi and loads where MPI is absent.
//   - NCCL: GPU memory on CUDA streams; libnccl.so.2 is opened at run time.
// Asking for MPI or NCCL where they cannot be loaded is kUnavailable with
// the reason; nothing else changes.
//
// This header includes no MPI, NCCL or CUDA header: their handles are
// opaque pointers (see CommOptions).
#ifndef STRATA_COMM_H_
#define STRATA_COMM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/export.h"
#include "strata/status.h"

namespace strata {

class Communicator;
class Device;
class Stream;
namespace internal {
class CommBackend;
class CommRequest;
}  // namespace internal

enum class CommBackendKind : uint8_t { kSingle, kMpi, kNccl };
// "single", "mpi" or "nccl".
STRATA_EXPORT std::string_view CommBackendName(CommBackendKind kind);

// Element types. kByte moves bytes (all-gather and broadcast only); the
// reductions of kBFloat16 and kFloat16 add (or compare) in fp32 and round
// back once per step of the backend's reduction, so the order of the ranks
// can change the last bit.
enum class CommType : uint8_t { kByte, kFloat32, kBFloat16, kFloat16 };
STRATA_EXPORT std::string_view CommTypeName(CommType type);  // "float32"...
STRATA_EXPORT size_t CommTypeSize(CommType type);            // 1, 4, 2, 2

// kMax serves overflow agreement: an all-reduce of a 0/1 flag (or of a norm,
// where NaN and inf propagate) tells every rank that one of them overflowed.
enum class ReduceOp : uint8_t { kSum, kMax };
STRATA_EXPORT std::string_view ReduceOpName(ReduceOp op);  // "sum", "max"

// Where a call's buffers are and how it is ordered.
//   Host (the default, stream null): pinned or ordinary host memory. The
//   call starts the collective and returns at once where the backend allows
//   (MPI: a non-blocking MPI_I* call); CommWork::Wait completes it. NCCL
//   refuses host memory (kInvalidArgument).
//   Device (stream set): device memory of `stream`'s device; the collective
//   is stream-ordered: it starts after the work enqueued on `stream` before
//   the call, and work enqueued after it waits for it. NCCL enqueues on the
//   CUDA stream itself; MPI and single rank run it as stream-ordered host
//   work (Device::LaunchHostWork) on the host-emulated device, whose memory
//   is host memory; MPI on a CUDA stream is kNotSupported (use NCCL). Other
//   streams wait for it through an Event recorded on `stream` after the call.
struct CommPlace {
  Device* device = nullptr;  // the device of `stream`; both or neither
  Stream* stream = nullptr;
};

// How a Communicator is made. Fields other than the chosen backend's are
// ignored.
struct CommOptions {
  CommBackendKind backend = CommBackendKind::kSingle;
  // Seconds a collective (or Barrier, or the NCCL bootstrap) may wait for
  // the other ranks before it fails with kUnavailable naming the operation,
  // this rank and the timeout. (0, 1e6]; default 300.
  double timeout_s = 300;

  // ---- MPI ----
  // Null: MPI_COMM_WORLD; MPI is initialized (MPI_Init_thread, asking for
  // MPI_THREAD_MULTIPLE) when the process has not done so, and finalized at
  // exit unless a collective failed. Otherwise a pointer to the caller's
  // MPI_Comm (an `MPI_Comm*`, read once; the communicator is duplicated with
  // MPI_Comm_dup, so the caller may free its own afterwards), MPI already
  // initialized by the caller at MPI_THREAD_SERIALIZED or above.
  void* mpi_comm = nullptr;
  // The MPI backend's shared object. Empty: libstrata_comm_mpi.so beside the
  // library (or program) holding strata, then the dynamic loader's search.
  std::string mpi_library;

  // ---- NCCL ----
  // The CUDA device the communicator runs on (cudaSetDevice before init).
  int cuda_ordinal = 0;
  // An existing ncclComm_t (the caller's, not owned, not destroyed), with
  // nccl_ranks: the global ranks of its members in the order of their NCCL
  // ranks (for error messages; empty: 0..size-1). When set, nothing below
  // is used.
  void* nccl_comm = nullptr;
  std::vector<int> nccl_ranks;
  // Bootstrap over a host-capable communicator (MPI): its rank 0 makes the
  // NCCL unique id and broadcasts it; the NCCL communicator has its ranks
  // and size. Not owned; used only during Create.
  Communicator* nccl_bootstrap = nullptr;
  // Or bootstrap through a file, for launchers without MPI: rank 0 writes
  // the unique id to this path (atomically, by rename), the others wait for
  // it up to timeout_s. With nccl_rank and nccl_size (0 <= rank < size).
  // Remove the file between runs.
  std::string nccl_id_file;
  int nccl_rank = 0;
  int nccl_size = 1;
};

// Element counts of `size` shards of `total` elements as the engine cuts
// them: ceil(total / size) each, the last ones shorter (possibly 0).
// REQUIRES: size >= 1.
STRATA_EXPORT std::vector<size_t> ShardCounts(size_t total, int size);

// The completion of one collective. Move-only.
//   Host calls: Wait blocks until the collective completes, fails, or the
//   communicator's timeout passes. Destruction waits likewise when Wait was
//   not called, since the buffers are in use until then.
//   Device calls: Wait blocks the host until the stream has run the
//   collective (with the same timeout); destruction does not wait (the
//   stream keeps the order). An error of a stream-ordered collective is
//   also kept by the communicator: its later calls return it.
// After a failure or a timeout the buffers may still be written by the
// backend; a process whose collective failed should stop using them and end
// (docs/comm.md, "Failures"). Thread-compatible.
class STRATA_EXPORT CommWork {
 public:
  CommWork() noexcept;  // done, OK
  CommWork(CommWork&& other) noexcept;
  CommWork& operator=(CommWork&& other) noexcept;
  CommWork(const CommWork&) = delete;
  CommWork& operator=(const CommWork&) = delete;
  ~CommWork();

  // The collective's result; later calls return the same.
  Status Wait();
  // True once complete (or failed: Wait then says how). Never blocks long.
  bool Done();

 private:
  friend class Communicator;
  explicit CommWork(std::shared_ptr<internal::CommRequest> request);
  std::shared_ptr<internal::CommRequest> request_;
};

// A group of ranks running collectives. Every rank must make the same calls
// in the same order with matching arguments (counts, type, op, root); a rank
// that stops calling makes the others fail after CommOptions::timeout_s.
// Stream-ordered calls of one communicator go on one stream (the order of
// work on different streams is not defined, and ranks would disagree).
//
// Counts are in elements of `type`. Buffers must not overlap except where a
// call says so. After any failure the communicator is broken: every later
// call returns kFailedPrecondition quoting the first error.
//
// Thread-safe: calls from several threads are serialized (their order is
// then the order of the ranks' calls, which the caller must keep the same).
class STRATA_EXPORT Communicator {
 public:
  // The single-rank communicator, or the backend `options` asks for.
  // kUnavailable with the reason when the backend cannot be loaded (no
  // libmpi, no libnccl.so.2, strata built without it); kInvalidArgument for
  // options out of range.
  static StatusOr<Communicator> Create(const CommOptions& options = {});

  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  // Waits for nothing: complete every CommWork (and drain the streams used)
  // first.
  ~Communicator();

  int rank() const;
  int size() const;
  CommBackendKind backend() const;
  double timeout_s() const;
  // OK, or the first error that broke the communicator.
  Status status() const;

  // Rank r contributes counts[r] elements from `send`; `recv` receives all
  // of them, rank r's at element offset counts[0] + ... + counts[r-1].
  // counts.size() == size(). In place when send == recv + this rank's offset.
  StatusOr<CommWork> AllGather(const void* send, void* recv,
                               std::span<const size_t> counts, CommType type,
                               CommPlace place = {});
  // `send` holds counts[0] + ... + counts[size()-1] elements on every rank;
  // `recv` receives this rank's part of their element-wise reduction over
  // ranks (counts[rank()] elements, from offset counts[0] + ... +
  // counts[rank()-1]). Floating types only.
  StatusOr<CommWork> ReduceScatter(const void* send, void* recv,
                                   std::span<const size_t> counts,
                                   CommType type, ReduceOp op,
                                   CommPlace place = {});
  // recv = the element-wise reduction of every rank's send. In place when
  // send == recv. Floating types only.
  StatusOr<CommWork> AllReduce(const void* send, void* recv, size_t count,
                               CommType type, ReduceOp op,
                               CommPlace place = {});
  // Every rank's `buffer` receives root's.
  StatusOr<CommWork> Broadcast(void* buffer, size_t count, CommType type,
                               int root, CommPlace place = {});
  // Returns once every rank has called it, or fails after the timeout.
  Status Barrier();
  // A new communicator over the same ranks with the same timeout, whose
  // collectives never match this one's (MPI_Comm_idup; NCCL:
  // ncclCommSplit, kNotSupported before NCCL 2.18): two threads may then
  // each keep their own order of calls. A collective (bounded by the
  // timeout; a failure breaks this communicator). A duplicate of a
  // caller's NCCL communicator is strata's, destroyed with it.
  StatusOr<Communicator> Duplicate();

 private:
  struct State;
  explicit Communicator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace strata

#endif  // STRATA_COMM_H_
