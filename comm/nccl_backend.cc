// The NCCL backend: collectives on device memory, enqueued on the caller's
// CUDA stream. libnccl.so.2 is opened with dlopen and its C entry points
// resolved by name (nccl.h gives only the types), so libstrata loads where
// NCCL is absent. Completion is a CUDA event recorded after the collective,
// polled with ncclCommGetAsyncError; at the timeout the NCCL communicator is
// aborted.
//
// Uneven counts: NCCL's all-gather and reduce-scatter take one count for
// every rank, so unequal counts become one grouped ncclBroadcast (or
// ncclReduce) per rank, rooted at the rank that owns the part.
//
// Duplicate splits the communicator (ncclCommSplit, NCCL 2.18 and newer).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "strata/device.h"

namespace strata::internal {
namespace {

// clang-format off (it does not settle on one layout of this list)
#define STRATA_NCCL_FUNCTIONS(X) \
  X(ncclGetUniqueId)             \
  X(ncclCommInitRank)            \
  X(ncclCommDestroy)             \
  X(ncclCommAbort)               \
  X(ncclCommGetAsyncError)       \
  X(ncclCommCount)               \
  X(ncclCommUserRank)            \
  X(ncclGetErrorString)          \
  X(ncclAllGather)               \
  X(ncclReduceScatter)           \
  X(ncclAllReduce)               \
  X(ncclBroadcast)               \
  X(ncclReduce)                  \
  X(ncclGroupStart)              \
  X(ncclGroupEnd)
// clang-format on

struct Nccl {
#define STRATA_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  STRATA_NCCL_FUNCTIONS(STRATA_NCCL_MEMBER)
#undef STRATA_NCCL_MEMBER
  // NCCL 2.18 and newer; null before (Duplicate is then kNotSupported).
  decltype(&::ncclCommSplit) ncclCommSplit = nullptr;
};

// Loaded once; never unloaded.
StatusOr<const Nccl*> LoadNccl() {
  static const StatusOr<const Nccl*> loaded = []() -> StatusOr<const Nccl*> {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      return Status::Unavailable(
          std::string("NCCL backend unavailable: cannot load libnccl.so.2 (") +
          (e ? e : "?") + ")");
    }
    auto* n = new Nccl;
#define STRATA_NCCL_RESOLVE(name)                                  \
  n->name = reinterpret_cast<decltype(&::name)>(dlsym(h, #name));  \
  if (n->name == nullptr) {                                        \
    return Status::Unavailable("libnccl.so.2 lacks " #name         \
                               " (NCCL 2.10 or newer is needed)"); \
  }
    STRATA_NCCL_FUNCTIONS(STRATA_NCCL_RESOLVE)
#undef STRATA_NCCL_RESOLVE
    n->ncclCommSplit =
        reinterpret_cast<decltype(&::ncclCommSplit)>(dlsym(h, "ncclCommSplit"));
    return static_cast<const Nccl*>(n);
  }();
  return loaded;
}

Status NcclError(const Nccl& n, std::string_view call, ncclResult_t r) {
  return Status::Unavailable(std::string(call) +
                             " failed: " + n.ncclGetErrorString(r));
}
Status CudaError(std::string_view call, cudaError_t e) {
  return Status::Unavailable(std::string(call) +
                             " failed: " + cudaGetErrorString(e));
}

ncclDataType_t TypeOf(CommType t) {
  switch (t) {
    case CommType::kByte:
      return ncclUint8;
    case CommType::kFloat32:
      return ncclFloat32;
    case CommType::kBFloat16:
      return ncclBfloat16;
    case CommType::kFloat16:
      return ncclFloat16;
  }
  return ncclUint8;
}

class NcclRequest final : public BackendRequest {
 public:
  NcclRequest(const Nccl& n, ncclComm_t comm, cudaEvent_t event)
      : n_(n), comm_(comm), event_(event) {}
  ~NcclRequest() override { cudaEventDestroy(event_); }
  StatusOr<bool> Test() override {
    ncclResult_t async = ncclSuccess;
    n_.ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return NcclError(n_, "NCCL (asynchronous)", async);
    }
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return CudaError("cudaEventQuery", e);
  }
  // The peers are gone or stuck: aborting frees the stream of the kernels
  // that wait for them.
  void Abandon() override { n_.ncclCommAbort(comm_); }

 private:
  const Nccl& n_;
  ncclComm_t comm_;
  cudaEvent_t event_;
};

// Duplicate: ncclCommSplit, a blocking collective, runs on a thread of its
// own so that the Communicator can poll it under its timeout. The thread
// owns the result with the request; after a timeout it is left to end (or
// not) with the process, which must end anyway (docs/comm.md, "Failures").
struct SplitResult {
  std::atomic<bool> done{false};
  ncclResult_t result = ncclSuccess;
  ncclComm_t comm = nullptr;
};

class NcclSplitRequest final : public BackendRequest {
 public:
  NcclSplitRequest(const Nccl& n, ncclComm_t parent,
                   std::shared_ptr<SplitResult> split, ncclComm_t* out)
      : n_(n), parent_(parent), split_(std::move(split)), out_(out) {}
  StatusOr<bool> Test() override {
    if (!split_->done.load(std::memory_order_acquire)) return false;
    if (split_->result != ncclSuccess) {
      return NcclError(n_, "ncclCommSplit", split_->result);
    }
    *out_ = split_->comm;
    return true;
  }
  void Abandon() override { n_.ncclCommAbort(parent_); }

 private:
  const Nccl& n_;
  ncclComm_t parent_;
  std::shared_ptr<SplitResult> split_;
  ncclComm_t* out_;
};

class NcclBackend final : public CommBackend {
 public:
  NcclBackend(const Nccl& n, ncclComm_t comm, bool owned, int rank, int size,
              int device)
      : n_(n),
        comm_(comm),
        owned_(owned),
        rank_(rank),
        size_(size),
        device_(device) {}
  ~NcclBackend() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (owned_ && comm_ != nullptr) n_.ncclCommDestroy(comm_);
  }

  CommBackendKind kind() const override { return CommBackendKind::kNccl; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool host_memory() const override { return false; }
  bool native_streams() const override { return true; }

  // Only the barrier comes here: an all-reduce of one float on a scratch
  // buffer and a stream of our own.
  StatusOr<std::unique_ptr<BackendRequest>> Start(
      const CollectiveArgs& args) override {
    if (args.kind != CommOpKind::kBarrier) {
      return Status::InvalidArgument("NCCL takes device memory only");
    }
    cudaSetDevice(device_);
    if (stream_ == nullptr) {
      cudaError_t e =
          cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
      if (e != cudaSuccess) return CudaError("cudaStreamCreate", e);
      e = cudaMalloc(&scratch_, sizeof(float));
      if (e != cudaSuccess) return CudaError("cudaMalloc", e);
    }
    CollectiveArgs a{
        CommOpKind::kAllReduce, scratch_, scratch_, {1}, CommType::kFloat32};
    return EnqueueOn(a, stream_);
  }

  // ncclCommSplit with one color: the same ranks, in the same order.
  StatusOr<std::unique_ptr<CommBackend>> StartDuplicate(
      std::unique_ptr<BackendRequest>* request) override {
    if (n_.ncclCommSplit == nullptr) {
      return Status::NotSupported(
          "duplicating an NCCL communicator needs ncclCommSplit (NCCL 2.18 or "
          "newer); libnccl.so.2 lacks it");
    }
    auto dup =
        std::make_unique<NcclBackend>(n_, nullptr, true, rank_, size_, device_);
    auto split = std::make_shared<SplitResult>();
    std::thread([n = &n_, parent = comm_, rank = rank_, device = device_,
                 split] {
      cudaSetDevice(device);
      split->result = n->ncclCommSplit(parent, 0, rank, &split->comm, nullptr);
      split->done.store(true, std::memory_order_release);
    }).detach();
    *request = std::make_unique<NcclSplitRequest>(n_, comm_, std::move(split),
                                                  &dup->comm_);
    return std::unique_ptr<CommBackend>(std::move(dup));
  }

  StatusOr<std::unique_ptr<BackendRequest>> Enqueue(const CollectiveArgs& args,
                                                    Stream& stream) override {
    if (stream.device_kind() != DeviceKind::kCuda) {
      return Status::InvalidArgument(
          "the NCCL backend needs a CUDA stream, not a host-emulated one");
    }
    return EnqueueOn(args, static_cast<cudaStream_t>(stream.native_handle()));
  }

 private:
  Status Launch(const CollectiveArgs& a, cudaStream_t s) {
    const ncclDataType_t dt = TypeOf(a.type);
    const ncclRedOp_t op = a.op == ReduceOp::kSum ? ncclSum : ncclMax;
    const size_t es = CommTypeSize(a.type);
    auto at = [&](const void* p, size_t elems) {
      return static_cast<const std::byte*>(p) + elems * es;
    };
    bool equal = true;
    for (size_t c : a.counts) equal = equal && c == a.counts[0];
    ncclResult_t r = ncclSuccess;
    switch (a.kind) {
      case CommOpKind::kAllGather:
        if (equal) {
          r = n_.ncclAllGather(a.send, a.recv, a.counts[0], dt, comm_, s);
          break;
        }
        n_.ncclGroupStart();
        for (int i = 0; i < size_ && r == ncclSuccess; ++i) {
          void* part = const_cast<std::byte*>(at(a.recv, a.Offset(i)));
          r = n_.ncclBroadcast(i == rank_ ? a.send : part, part, a.counts[i],
                               dt, i, comm_, s);
        }
        if (const ncclResult_t e = n_.ncclGroupEnd(); r == ncclSuccess) r = e;
        break;
      case CommOpKind::kReduceScatter:
        if (equal) {
          r = n_.ncclReduceScatter(a.send, a.recv, a.counts[0], dt, op, comm_,
                                   s);
          break;
        }
        n_.ncclGroupStart();
        for (int i = 0; i < size_ && r == ncclSuccess; ++i) {
          r = n_.ncclReduce(at(a.send, a.Offset(i)), a.recv, a.counts[i], dt,
                            op, i, comm_, s);
        }
        if (const ncclResult_t e = n_.ncclGroupEnd(); r == ncclSuccess) r = e;
        break;
      case CommOpKind::kAllReduce:
        r = n_.ncclAllReduce(a.send, a.recv, a.counts[0], dt, op, comm_, s);
        break;
      case CommOpKind::kBroadcast:
        r = n_.ncclBroadcast(a.recv, a.recv, a.counts[0], dt, a.root, comm_, s);
        break;
      case CommOpKind::kBarrier:
        break;
    }
    return r == ncclSuccess ? Status::Ok() : NcclError(n_, "NCCL enqueue", r);
  }

  StatusOr<std::unique_ptr<BackendRequest>> EnqueueOn(const CollectiveArgs& a,
                                                      cudaStream_t s) {
    STRATA_RETURN_IF_ERROR(Launch(a, s));
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e != cudaSuccess) return CudaError("cudaEventCreate", e);
    e = cudaEventRecord(event, s);
    if (e != cudaSuccess) {
      cudaEventDestroy(event);
      return CudaError("cudaEventRecord", e);
    }
    return std::unique_ptr<BackendRequest>(new NcclRequest(n_, comm_, event));
  }

  const Nccl& n_;
  ncclComm_t comm_;
  bool owned_;
  int rank_;
  int size_;
  int device_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
};

// Rank 0 writes the id beside `path` and renames it into place; the others
// wait for it until the timeout.
Status ExchangeIdByFile(const Nccl& n, const CommOptions& o, ncclUniqueId* id) {
  if (o.nccl_rank == 0) {
    ncclResult_t r = n.ncclGetUniqueId(id);
    if (r != ncclSuccess) return NcclError(n, "ncclGetUniqueId", r);
    const std::string tmp = o.nccl_id_file + ".tmp." + std::to_string(getpid());
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return Status::FromErrno(errno, "creating " + tmp);
    const bool ok = std::fwrite(id, sizeof *id, 1, f) == 1;
    if (std::fclose(f) != 0 || !ok) {
      return Status::IoError("writing the NCCL id to " + tmp);
    }
    if (std::rename(tmp.c_str(), o.nccl_id_file.c_str()) != 0) {
      return Status::FromErrno(errno, "renaming " + tmp);
    }
    return Status::Ok();
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(o.timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (FILE* f = std::fopen(o.nccl_id_file.c_str(), "rb"); f != nullptr) {
      const bool ok = std::fread(id, sizeof *id, 1, f) == 1;
      std::fclose(f);
      if (ok) return Status::Ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status::Unavailable("NCCL bootstrap: " + o.nccl_id_file +
                             " did not appear within the timeout");
}

}  // namespace

StatusOr<std::unique_ptr<CommBackend>> NewNcclBackend(const CommOptions& o) {
  STRATA_ASSIGN_OR_RETURN(const Nccl* n, LoadNccl());
  cudaError_t e = cudaSetDevice(o.cuda_ordinal);
  if (e != cudaSuccess) return CudaError("cudaSetDevice", e);
  if (o.nccl_comm != nullptr) {
    auto comm = static_cast<ncclComm_t>(o.nccl_comm);
    int rank = 0, size = 0;
    n->ncclCommUserRank(comm, &rank);
    n->ncclCommCount(comm, &size);
    if (!o.nccl_ranks.empty() && o.nccl_ranks.size() != size_t(size)) {
      return Status::InvalidArgument(
          "CommOptions::nccl_ranks has " + std::to_string(o.nccl_ranks.size()) +
          " entries; the NCCL communicator has " + std::to_string(size));
    }
    return std::unique_ptr<CommBackend>(
        new NcclBackend(*n, comm, false, rank, size, o.cuda_ordinal));
  }
  ncclUniqueId id{};
  int rank = o.nccl_rank, size = o.nccl_size;
  if (o.nccl_bootstrap != nullptr) {
    rank = o.nccl_bootstrap->rank();
    size = o.nccl_bootstrap->size();
    if (rank == 0) {
      ncclResult_t r = n->ncclGetUniqueId(&id);
      if (r != ncclSuccess) return NcclError(*n, "ncclGetUniqueId", r);
    }
    STRATA_ASSIGN_OR_RETURN(
        CommWork w,
        o.nccl_bootstrap->Broadcast(&id, sizeof id, CommType::kByte, 0));
    STRATA_RETURN_IF_ERROR(w.Wait().WithContext("NCCL bootstrap"));
  } else if (!o.nccl_id_file.empty()) {
    if (size < 1 || rank < 0 || rank >= size) {
      return Status::InvalidArgument(
          "CommOptions::nccl_rank " + std::to_string(rank) +
          " is out of range 0..nccl_size-1 (nccl_size " + std::to_string(size) +
          ")");
    }
    STRATA_RETURN_IF_ERROR(ExchangeIdByFile(*n, o, &id));
  } else {
    return Status::InvalidArgument(
        "the NCCL backend needs CommOptions::nccl_comm, nccl_bootstrap or "
        "nccl_id_file");
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t r = n->ncclCommInitRank(&comm, size, id, rank);
  if (r != ncclSuccess) return NcclError(*n, "ncclCommInitRank", r);
  return std::unique_ptr<CommBackend>(
      new NcclBackend(*n, comm, true, rank, size, o.cuda_ordinal));
}

}  // namespace strata::internal
