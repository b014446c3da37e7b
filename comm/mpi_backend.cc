// The MPI backend, built as its own shared object (libstrata_comm_mpi.so)
// that libstrata opens on request, so that libstrata never depends on
// libmpi (docs/comm.md, "Why a plugin").
//
// Every collective is a non-blocking MPI call (MPI_Iallgatherv,
// MPI_Ireduce_scatter, MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier) that the
// Communicator polls with MPI_Test until a deadline, on a duplicate of the
// caller's communicator with MPI_ERRORS_RETURN, so that neither a dead peer
// nor an MPI error aborts or hangs the process. All MPI calls of the process
// made here are serialized by one mutex, so MPI_THREAD_SERIALIZED suffices.
#include <mpi.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "strata/export.h"
#include "util/mutex.h"

namespace strata::internal {
namespace {

Mutex& MpiMutex() {
  static Mutex mu;
  return mu;
}

// Set once a collective failed or was abandoned: MPI_Finalize would then
// wait for it (and for dead peers), so the exit handler skips it.
std::atomic<bool> g_broken{false};
bool g_we_initialized = false;  // under MpiMutex()

void FinalizeAtExit() {
  if (g_broken.load()) return;
  MutexLock lock(&MpiMutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Status MpiError(std::string_view call, int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return Status::Unavailable(std::string(call) + " failed: " +
                             std::string(text, static_cast<size_t>(len)));
}

// User-defined reductions: MPI has no bf16 or fp16, and its MPI_MAX does not
// propagate NaN. `len` elements of uint16_t (or float) at a time.
template <CommType T, ReduceOp O>
void UserOp(void* in, void* inout, int* len, MPI_Datatype*) {
  ReduceHost(in, inout, static_cast<size_t>(*len), T, O);
}

struct Ops {
  MPI_Op f32_max, bf16_sum, bf16_max, f16_sum, f16_max;
};

// Created once per process (REQUIRES: MpiMutex held).
Ops& UserOps() {
  static Ops ops = [] {
    Ops o;
    MPI_Op_create(&UserOp<CommType::kFloat32, ReduceOp::kMax>, 1, &o.f32_max);
    MPI_Op_create(&UserOp<CommType::kBFloat16, ReduceOp::kSum>, 1, &o.bf16_sum);
    MPI_Op_create(&UserOp<CommType::kBFloat16, ReduceOp::kMax>, 1, &o.bf16_max);
    MPI_Op_create(&UserOp<CommType::kFloat16, ReduceOp::kSum>, 1, &o.f16_sum);
    MPI_Op_create(&UserOp<CommType::kFloat16, ReduceOp::kMax>, 1, &o.f16_max);
    return o;
  }();
  return ops;
}

MPI_Datatype TypeOf(CommType t) {
  switch (t) {
    case CommType::kByte:
      return MPI_BYTE;
    case CommType::kFloat32:
      return MPI_FLOAT;
    case CommType::kBFloat16:
    case CommType::kFloat16:
      return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

MPI_Op OpOf(CommType t, ReduceOp op) {
  Ops& o = UserOps();
  const bool sum = op == ReduceOp::kSum;
  switch (t) {
    case CommType::kFloat32:
      return sum ? MPI_SUM : o.f32_max;
    case CommType::kBFloat16:
      return sum ? o.bf16_sum : o.bf16_max;
    case CommType::kFloat16:
      return sum ? o.f16_sum : o.f16_max;
    case CommType::kByte:
      break;
  }
  return MPI_OP_NULL;
}

// A started collective and what MPI reads until it completes.
class MpiRequest final : public BackendRequest {
 public:
  StatusOr<bool> Test() override {
    MutexLock lock(&MpiMutex());
    if (request == MPI_REQUEST_NULL) return true;
    int flag = 0;
    const int rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      g_broken = true;
      return MpiError("MPI_Test", rc);
    }
    return flag != 0;
  }
  // The request stays active (a collective cannot be cancelled); its
  // buffers and counts are leaked with it.
  void Abandon() override {
    g_broken = true;
    abandoned = true;
  }
  ~MpiRequest() override {
    if (abandoned) {
      (void)new std::vector<int>(std::move(counts));
      (void)new std::vector<int>(std::move(displs));
    }
  }

  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> counts;
  std::vector<int> displs;
  bool abandoned = false;
};

// MPI_Comm_idup in flight: once complete, the new communicator returns
// errors instead of aborting, like every communicator strata makes.
class MpiDupRequest final : public BackendRequest {
 public:
  explicit MpiDupRequest(MPI_Comm* comm) : comm_(comm) {}
  StatusOr<bool> Test() override {
    MutexLock lock(&MpiMutex());
    if (request == MPI_REQUEST_NULL) return true;
    int flag = 0;
    int rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && flag != 0) {
      rc = MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN);
    }
    if (rc != MPI_SUCCESS) {
      g_broken = true;
      return MpiError("MPI_Comm_idup", rc);
    }
    return flag != 0;
  }
  void Abandon() override { g_broken = true; }

  MPI_Request request = MPI_REQUEST_NULL;

 private:
  MPI_Comm* comm_;  // the new backend's, written by MPI on completion
};

class MpiBackend final : public CommBackend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size)
      : comm_(comm), rank_(rank), size_(size) {}
  ~MpiBackend() override {
    if (g_broken.load()) return;  // freeing could wait for dead peers
    MutexLock lock(&MpiMutex());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  CommBackendKind kind() const override { return CommBackendKind::kMpi; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  StatusOr<std::unique_ptr<BackendRequest>> Start(
      const CollectiveArgs& a) override {
    if (a.kind != CommOpKind::kBarrier && a.Total() > INT_MAX) {
      return Status::InvalidArgument(
          "the MPI backend counts elements in int: " +
          std::to_string(a.Total()) + " elements is above 2^31-1; split it");
    }
    auto r = std::make_unique<MpiRequest>();
    MutexLock lock(&MpiMutex());
    const MPI_Datatype dt = TypeOf(a.type);
    int rc = MPI_SUCCESS;
    switch (a.kind) {
      case CommOpKind::kAllGather: {
        for (size_t i = 0; i < a.counts.size(); ++i) {
          r->counts.push_back(static_cast<int>(a.counts[i]));
          r->displs.push_back(static_cast<int>(a.Offset(i)));
        }
        const auto* mine = static_cast<const std::byte*>(a.recv) +
                           a.Offset(rank_) * CommTypeSize(a.type);
        const void* send = a.send == mine ? MPI_IN_PLACE : a.send;
        rc = MPI_Iallgatherv(send, r->counts[rank_], dt, a.recv,
                             r->counts.data(), r->displs.data(), dt, comm_,
                             &r->request);
        break;
      }
      case CommOpKind::kReduceScatter:
        for (size_t c : a.counts) r->counts.push_back(static_cast<int>(c));
        rc = MPI_Ireduce_scatter(a.send, a.recv, r->counts.data(), dt,
                                 OpOf(a.type, a.op), comm_, &r->request);
        break;
      case CommOpKind::kAllReduce:
        rc = MPI_Iallreduce(a.send == a.recv ? MPI_IN_PLACE : a.send, a.recv,
                            static_cast<int>(a.counts[0]), dt,
                            OpOf(a.type, a.op), comm_, &r->request);
        break;
      case CommOpKind::kBroadcast:
        rc = MPI_Ibcast(a.recv, static_cast<int>(a.counts[0]), dt, a.root,
                        comm_, &r->request);
        break;
      case CommOpKind::kBarrier:
        rc = MPI_Ibarrier(comm_, &r->request);
        break;
    }
    if (rc != MPI_SUCCESS) {
      g_broken = true;
      return MpiError("starting the MPI collective", rc);
    }
    return std::unique_ptr<BackendRequest>(std::move(r));
  }

  StatusOr<std::unique_ptr<CommBackend>> StartDuplicate(
      std::unique_ptr<BackendRequest>* request) override {
    auto dup = std::make_unique<MpiBackend>(MPI_COMM_NULL, rank_, size_);
    auto r = std::make_unique<MpiDupRequest>(&dup->comm_);
    MutexLock lock(&MpiMutex());
    const int rc = MPI_Comm_idup(comm_, &dup->comm_, &r->request);
    if (rc != MPI_SUCCESS) {
      g_broken = true;
      return MpiError("MPI_Comm_idup", rc);
    }
    *request = std::move(r);
    return std::unique_ptr<CommBackend>(std::move(dup));
  }

 private:
  MPI_Comm comm_;
  int rank_;
  int size_;
};

StatusOr<MPI_Comm> BaseComm(void* mpi_comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    if (mpi_comm != nullptr) {
      return Status::FailedPrecondition(
          "CommOptions::mpi_comm is set but MPI is not initialized");
    }
    const int rc =
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Init_thread", rc);
    g_we_initialized = true;
    std::atexit(FinalizeAtExit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return Status::FailedPrecondition(
        "MPI was initialized below MPI_THREAD_SERIALIZED (" +
        std::to_string(provided) +
        "); strata calls MPI from stream threads too: initialize with "
        "MPI_Init_thread(..., MPI_THREAD_SERIALIZED or MULTIPLE, ...)");
  }
  return mpi_comm == nullptr ? MPI_COMM_WORLD
                             : *static_cast<MPI_Comm*>(mpi_comm);
}

StatusOr<CommBackend*> Create(void* mpi_comm) {
  MutexLock lock(&MpiMutex());
  STRATA_ASSIGN_OR_RETURN(MPI_Comm base, BaseComm(mpi_comm));
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(base, &comm);
  if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_dup", rc);
  rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_set_errhandler", rc);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  UserOps();
  return new MpiBackend(comm, rank, size);
}

}  // namespace
}  // namespace strata::internal

extern "C" STRATA_EXPORT int strata_comm_mpi_abi() {
  return strata::internal::kCommMpiPluginAbi;
}

extern "C" STRATA_EXPORT strata::internal::CommBackend* strata_comm_mpi_create(
    void* mpi_comm, strata::Status* error) {
  auto r = strata::internal::Create(mpi_comm);
  if (!r.ok()) {
    *error = r.status();
    return nullptr;
  }
  return *r;
}
