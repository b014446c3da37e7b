// The Communicator: argument checks, the first error, the timeout, stream
// ordering, and the single-rank backend. Backends only start collectives
// (comm/backend.h).
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "comm/backend.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "util/mutex.h"

namespace strata {
namespace internal {

using Clock = std::chrono::steady_clock;

// Backs off from yielding to 1 ms sleeps, so that a long wait costs little
// CPU (ranks may share cores) and a short one little latency.
class Backoff {
 public:
  void Pause() {
    if (++polls_ < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    sleep_us_ = std::min(sleep_us_ * 2, 1000);
  }

 private:
  int polls_ = 0;
  int sleep_us_ = 5;
};

// The first error of a communicator; every later call returns it.
class CommHealth {
 public:
  Status Check() const STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (first_.ok()) return Status::Ok();
    return Status::FailedPrecondition(
        "communicator broken by an earlier error: " +
        std::string(first_.message()));
  }
  Status status() const STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return first_;
  }
  void Fail(const Status& s) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (first_.ok()) first_ = s;
  }

 private:
  mutable Mutex mu_;
  Status first_ STRATA_GUARDED_BY(mu_);
};

// What a CommWork holds.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual Status Wait() = 0;
  virtual bool Done() = 0;
  // Whether destruction must wait (host buffers in use).
  virtual bool wait_on_destroy() const { return true; }
};

namespace {

class DoneRequest final : public CommRequest {
 public:
  explicit DoneRequest(Status s) : status_(std::move(s)) {}
  Status Wait() override { return status_; }
  bool Done() override { return true; }

 private:
  Status status_;
};

// Polls a backend request until it completes, fails or times out.
// Thread-compatible (CommWork's contract).
class PolledRequest final : public CommRequest {
 public:
  PolledRequest(std::unique_ptr<BackendRequest> request, std::string label,
                double timeout_s, std::shared_ptr<CommHealth> health)
      : request_(std::move(request)),
        label_(std::move(label)),
        timeout_s_(timeout_s),
        health_(std::move(health)) {}

  Status Wait() override {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(timeout_s_));
    Backoff backoff;
    while (!Poll()) {
      if (Clock::now() >= deadline) {
        request_->Abandon();
        Finish(Status::Unavailable(
            label_ + ": not complete after the timeout of " +
            FormatSeconds(timeout_s_) +
            " s (CommOptions::timeout_s): a peer rank died, hung or made a "
            "different call"));
        break;
      }
      backoff.Pause();
    }
    return status_;
  }
  bool Done() override { return Poll(); }

 private:
  static std::string FormatSeconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
  }
  bool Poll() {
    if (finished_) return true;
    StatusOr<bool> r = request_->Test();
    if (!r.ok()) {
      Finish(r.status().WithContext(label_));
    } else if (*r) {
      Finish(Status::Ok());
    }
    return finished_;
  }
  void Finish(Status s) {
    finished_ = true;
    if (!s.ok()) health_->Fail(s);
    status_ = std::move(s);
  }

  std::unique_ptr<BackendRequest> request_;
  std::string label_;
  double timeout_s_;
  std::shared_ptr<CommHealth> health_;
  bool finished_ = false;
  Status status_;
};

// A collective run as stream-ordered host work: the stream's thread
// publishes the result here.
class HostWorkRequest final : public CommRequest {
 public:
  HostWorkRequest(std::string label, double timeout_s)
      : label_(std::move(label)), timeout_s_(timeout_s) {}

  void Publish(Status s) STRATA_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      status_ = std::move(s);
    }
    done_.store(true, std::memory_order_release);
  }
  Status Wait() override STRATA_EXCLUDES(mu_) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(timeout_s_));
    Backoff backoff;
    while (!Done()) {
      if (Clock::now() >= deadline) {
        return Status::Unavailable(
            label_ + ": the stream did not run it within the timeout");
      }
      backoff.Pause();
    }
    MutexLock lock(&mu_);
    return status_;
  }
  bool Done() override { return done_.load(std::memory_order_acquire); }
  bool wait_on_destroy() const override { return false; }

 private:
  std::string label_;
  double timeout_s_;
  std::atomic<bool> done_{false};
  Mutex mu_;
  Status status_ STRATA_GUARDED_BY(mu_);
};

// ---- Single rank: every collective is a copy ----

class SingleBackend final : public CommBackend {
 public:
  CommBackendKind kind() const override { return CommBackendKind::kSingle; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  StatusOr<std::unique_ptr<BackendRequest>> Start(
      const CollectiveArgs& args) override {
    const size_t bytes = CopyBytes(args);
    if (bytes > 0 && args.send != args.recv) {
      std::memmove(args.recv, args.send, bytes);
    }
    return std::unique_ptr<BackendRequest>(new Complete);
  }

  StatusOr<std::unique_ptr<CommBackend>> StartDuplicate(
      std::unique_ptr<BackendRequest>* request) override {
    *request = std::make_unique<Complete>();
    return std::unique_ptr<CommBackend>(std::make_unique<SingleBackend>());
  }

  // The bytes a single rank copies from send to recv (0 for broadcast and
  // barrier, whose buffers already hold the result).
  static size_t CopyBytes(const CollectiveArgs& args) {
    if (args.kind == CommOpKind::kBroadcast ||
        args.kind == CommOpKind::kBarrier) {
      return 0;
    }
    return args.counts[0] * CommTypeSize(args.type);
  }

 private:
  struct Complete final : BackendRequest {
    StatusOr<bool> Test() override { return true; }
  };
};

// ---- The MPI plugin ----

std::string DirOfStrata() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&CommBackendName), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// Where libstrata_comm_mpi.so is looked for, in order.
std::vector<std::string> MpiLibraryCandidates(const CommOptions& options) {
  if (!options.mpi_library.empty()) return {options.mpi_library};
  if (const char* env = std::getenv("STRATA_COMM_MPI_LIBRARY");
      env != nullptr && *env != '\0') {
    return {env};
  }
  std::vector<std::string> out;
  const std::string dir = DirOfStrata();
  if (!dir.empty()) {
    const std::string beside = dir + "/" + kCommMpiLibrary;
    if (access(beside.c_str(), F_OK) == 0) out.push_back(beside);
  }
  out.push_back(kCommMpiLibrary);
  return out;
}

StatusOr<std::unique_ptr<CommBackend>> NewMpiBackend(
    const CommOptions& options) {
  std::string tried;
  void* handle = nullptr;
  for (const std::string& path : MpiLibraryCandidates(options)) {
    // Never closed: MPI stays loaded until exit (its finalizer runs then).
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (handle != nullptr) break;
    const char* err = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(err ? err : path);
  }
  if (handle == nullptr) {
    return Status::Unavailable(
        "MPI backend unavailable: cannot load " + std::string(kCommMpiLibrary) +
        " (" + tried +
        "); strata builds it when MPI is found (libopenmpi-dev), and it "
        "needs libmpi at run time; only the single-rank backend works "
        "without");
  }
  auto abi = reinterpret_cast<CommMpiAbiFn>(dlsym(handle, kCommMpiAbiSymbol));
  auto create =
      reinterpret_cast<CommMpiCreateFn>(dlsym(handle, kCommMpiCreateSymbol));
  if (abi == nullptr || create == nullptr || abi() != kCommMpiPluginAbi) {
    return Status::Unavailable(std::string(kCommMpiLibrary) +
                               " is not the MPI backend of this strata "
                               "(missing symbols or ABI version mismatch)");
  }
  Status error;
  CommBackend* backend = create(options.mpi_comm, &error);
  if (backend == nullptr) return error.WithContext("MPI backend");
  return std::unique_ptr<CommBackend>(backend);
}

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace
}  // namespace internal

using internal::CollectiveArgs;
using internal::CommOpKind;

struct Communicator::State {
  // Shared with the host work queued on streams, which may run after a
  // call returned.
  struct Core {
    std::unique_ptr<internal::CommBackend> backend;
    std::shared_ptr<internal::CommHealth> health =
        std::make_shared<internal::CommHealth>();
    double timeout_s = 300;
    // Serializes starts, so calls from several threads reach the backend
    // one at a time.
    Mutex mu;

    std::string Label(const CollectiveArgs& args) const {
      return args.Describe() + " on rank " + std::to_string(backend->rank()) +
             " of " + std::to_string(backend->size()) + " (" +
             std::string(CommBackendName(backend->kind())) + ")";
    }
    StatusOr<std::shared_ptr<internal::CommRequest>> Start(
        const CollectiveArgs& args) STRATA_EXCLUDES(mu) {
      STRATA_RETURN_IF_ERROR(health->Check());
      std::unique_ptr<internal::BackendRequest> request;
      {
        MutexLock lock(&mu);
        auto r = backend->Start(args);
        if (!r.ok()) {
          const Status s = r.status().WithContext(Label(args));
          health->Fail(s);
          return s;
        }
        request = std::move(*r);
      }
      return std::shared_ptr<internal::CommRequest>(
          std::make_shared<internal::PolledRequest>(
              std::move(request), Label(args), timeout_s, health));
    }
  };
  std::shared_ptr<Core> core = std::make_shared<Core>();

  StatusOr<CommWork> Run(const CollectiveArgs& args, const CommPlace& place);
  StatusOr<CommWork> RunOnStream(const CollectiveArgs& args,
                                 const CommPlace& place);
};

CommWork::CommWork() noexcept = default;
CommWork::CommWork(std::shared_ptr<internal::CommRequest> request)
    : request_(std::move(request)) {}
CommWork::CommWork(CommWork&& other) noexcept = default;
CommWork& CommWork::operator=(CommWork&& other) noexcept {
  if (this != &other) {
    if (request_ != nullptr && request_->wait_on_destroy()) {
      request_->Wait().IgnoreError();
    }
    request_ = std::move(other.request_);
  }
  return *this;
}
CommWork::~CommWork() {
  if (request_ != nullptr && request_->wait_on_destroy()) {
    request_->Wait().IgnoreError();
  }
}
Status CommWork::Wait() {
  return request_ == nullptr ? Status::Ok() : request_->Wait();
}
bool CommWork::Done() { return request_ == nullptr || request_->Done(); }

Communicator::Communicator(std::unique_ptr<State> state)
    : state_(std::move(state)) {}
Communicator::Communicator(Communicator&& other) noexcept = default;
Communicator& Communicator::operator=(Communicator&& other) noexcept = default;
Communicator::~Communicator() = default;

int Communicator::rank() const { return state_->core->backend->rank(); }
int Communicator::size() const { return state_->core->backend->size(); }
CommBackendKind Communicator::backend() const {
  return state_->core->backend->kind();
}
double Communicator::timeout_s() const { return state_->core->timeout_s; }
Status Communicator::status() const { return state_->core->health->status(); }

StatusOr<Communicator> Communicator::Create(const CommOptions& options) {
  if (!(options.timeout_s > 0 && options.timeout_s <= 1e6)) {
    return Status::InvalidArgument(
        "CommOptions::timeout_s: " + std::to_string(options.timeout_s) +
        " is out of range (0, 1e6] seconds");
  }
  auto state = std::make_unique<State>();
  state->core->timeout_s = options.timeout_s;
  switch (options.backend) {
    case CommBackendKind::kSingle:
      state->core->backend = std::make_unique<internal::SingleBackend>();
      break;
    case CommBackendKind::kMpi: {
      STRATA_ASSIGN_OR_RETURN(state->core->backend,
                              internal::NewMpiBackend(options));
      break;
    }
    case CommBackendKind::kNccl: {
      STRATA_ASSIGN_OR_RETURN(state->core->backend,
                              internal::NewNcclBackend(options));
      break;
    }
  }
  return Communicator(std::move(state));
}

StatusOr<CommWork> Communicator::State::RunOnStream(const CollectiveArgs& args,
                                                    const CommPlace& place) {
  STRATA_RETURN_IF_ERROR(core->health->Check());
  Device& device = *place.device;
  Stream& stream = *place.stream;
  internal::CommBackend& b = *core->backend;
  if (b.kind() == CommBackendKind::kSingle) {
    // Device to device, so it works on any device.
    const size_t bytes = internal::SingleBackend::CopyBytes(args);
    if (bytes > 0 && args.send != args.recv) {
      STRATA_RETURN_IF_ERROR(device.CopyAsync(
          stream, args.recv, args.send, bytes, CopyKind::kDeviceToDevice));
    }
    return CommWork();
  }
  if (b.native_streams()) {
    std::unique_ptr<internal::BackendRequest> request;
    {
      MutexLock lock(&core->mu);
      auto r = b.Enqueue(args, stream);
      if (!r.ok()) {
        const Status s = r.status().WithContext(core->Label(args));
        core->health->Fail(s);
        return s;
      }
      request = std::move(*r);
    }
    return CommWork(std::make_shared<internal::PolledRequest>(
        std::move(request), core->Label(args), core->timeout_s, core->health));
  }
  if (stream.device_kind() != DeviceKind::kHostEmulated) {
    return Status::NotSupported(
        core->Label(args) +
        ": device memory on a CUDA stream needs the NCCL backend (this "
        "backend reads memory from the host)");
  }
  auto done = std::make_shared<internal::HostWorkRequest>(core->Label(args),
                                                          core->timeout_s);
  STRATA_RETURN_IF_ERROR(
      device.LaunchHostWork(stream, [core = core, args, done]() {
        auto request = core->Start(args);
        done->Publish(request.ok() ? (*request)->Wait() : request.status());
      }));
  return CommWork(std::move(done));
}

StatusOr<CommWork> Communicator::State::Run(const CollectiveArgs& args,
                                            const CommPlace& place) {
  internal::CommBackend& b = *core->backend;
  const std::string what(internal::CommOpName(args.kind));
  if ((place.device == nullptr) != (place.stream == nullptr)) {
    return Status::InvalidArgument(
        what + ": CommPlace needs both device and stream, or neither");
  }
  if (place.stream != nullptr) return RunOnStream(args, place);
  if (!b.host_memory()) {
    return Status::InvalidArgument(
        what + ": the " + std::string(CommBackendName(b.kind())) +
        " backend works on device memory only: pass a CommPlace with a "
        "CUDA stream");
  }
  STRATA_ASSIGN_OR_RETURN(auto request, core->Start(args));
  return CommWork(std::move(request));
}

namespace {

constexpr size_t kMaxBytes = size_t{1} << 60;

// The checks every collective shares: the element type, the counts, and
// buffers present where there are bytes.
Status CheckArgs(const CollectiveArgs& a, bool reduces) {
  const std::string what(internal::CommOpName(a.kind));
  if (reduces && a.type == CommType::kByte) {
    return Status::InvalidArgument(
        what +
        ": type byte cannot be reduced; use float32, bfloat16 or "
        "float16");
  }
  if (static_cast<uint8_t>(a.type) > static_cast<uint8_t>(CommType::kFloat16)) {
    return Status::InvalidArgument(what + ": unknown CommType");
  }
  if (static_cast<uint8_t>(a.op) > static_cast<uint8_t>(ReduceOp::kMax)) {
    return Status::InvalidArgument(what + ": unknown ReduceOp");
  }
  size_t total = 0;
  for (size_t c : a.counts) {
    if (c > kMaxBytes || total + c > kMaxBytes / CommTypeSize(a.type)) {
      return Status::InvalidArgument(what + ": counts exceed 2^60 bytes");
    }
    total += c;
  }
  return Status::Ok();
}

Status CheckCounts(std::string_view what, std::span<const size_t> counts,
                   int size) {
  if (counts.size() != static_cast<size_t>(size)) {
    return Status::InvalidArgument(
        std::string(what) + ": counts has " + std::to_string(counts.size()) +
        " entries; the communicator has " + std::to_string(size) +
        " ranks, one count each");
  }
  return Status::Ok();
}

Status CheckBuffer(std::string_view what, std::string_view name, const void* p,
                   size_t bytes) {
  if (p == nullptr && bytes > 0) {
    return Status::InvalidArgument(std::string(what) + ": " +
                                   std::string(name) + " is null for " +
                                   std::to_string(bytes) + " bytes");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<CommWork> Communicator::AllGather(const void* send, void* recv,
                                           std::span<const size_t> counts,
                                           CommType type, CommPlace place) {
  const char* what = "all-gather";
  STRATA_RETURN_IF_ERROR(CheckCounts(what, counts, size()));
  CollectiveArgs a{CommOpKind::kAllGather, send, recv,
                   std::vector<size_t>(counts.begin(), counts.end()), type};
  STRATA_RETURN_IF_ERROR(CheckArgs(a, false));
  const size_t es = CommTypeSize(type);
  const size_t mine = counts[rank()] * es;
  const size_t offset = a.Offset(rank()) * es;
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "send", send, mine));
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "recv", recv, a.Total() * es));
  if (send != static_cast<std::byte*>(recv) + offset &&
      internal::Overlap(send, mine, recv, a.Total() * es)) {
    return Status::InvalidArgument(
        "all-gather: send overlaps recv other than at this rank's part "
        "(recv + " +
        std::to_string(offset) + " bytes, the one in-place form)");
  }
  return state_->Run(a, place);
}

StatusOr<CommWork> Communicator::ReduceScatter(const void* send, void* recv,
                                               std::span<const size_t> counts,
                                               CommType type, ReduceOp op,
                                               CommPlace place) {
  const char* what = "reduce-scatter";
  STRATA_RETURN_IF_ERROR(CheckCounts(what, counts, size()));
  CollectiveArgs a{CommOpKind::kReduceScatter,
                   send,
                   recv,
                   std::vector<size_t>(counts.begin(), counts.end()),
                   type,
                   op};
  STRATA_RETURN_IF_ERROR(CheckArgs(a, true));
  const size_t es = CommTypeSize(type);
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "send", send, a.Total() * es));
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "recv", recv, counts[rank()] * es));
  if (internal::Overlap(send, a.Total() * es, recv, counts[rank()] * es)) {
    return Status::InvalidArgument("reduce-scatter: send and recv overlap");
  }
  return state_->Run(a, place);
}

StatusOr<CommWork> Communicator::AllReduce(const void* send, void* recv,
                                           size_t count, CommType type,
                                           ReduceOp op, CommPlace place) {
  const char* what = "all-reduce";
  CollectiveArgs a{CommOpKind::kAllReduce, send, recv, {count}, type, op};
  STRATA_RETURN_IF_ERROR(CheckArgs(a, true));
  const size_t bytes = count * CommTypeSize(type);
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "send", send, bytes));
  STRATA_RETURN_IF_ERROR(CheckBuffer(what, "recv", recv, bytes));
  if (send != recv && internal::Overlap(send, bytes, recv, bytes)) {
    return Status::InvalidArgument(
        "all-reduce: send and recv overlap without being equal (in place)");
  }
  return state_->Run(a, place);
}

StatusOr<CommWork> Communicator::Broadcast(void* buffer, size_t count,
                                           CommType type, int root,
                                           CommPlace place) {
  const char* what = "broadcast";
  if (root < 0 || root >= size()) {
    return Status::InvalidArgument("broadcast: root " + std::to_string(root) +
                                   " is out of range 0.." +
                                   std::to_string(size() - 1));
  }
  CollectiveArgs a{CommOpKind::kBroadcast, buffer, buffer, {count}, type,
                   ReduceOp::kSum,         root};
  STRATA_RETURN_IF_ERROR(CheckArgs(a, false));
  STRATA_RETURN_IF_ERROR(
      CheckBuffer(what, "buffer", buffer, count * CommTypeSize(type)));
  return state_->Run(a, place);
}

StatusOr<Communicator> Communicator::Duplicate() {
  State::Core& core = *state_->core;
  STRATA_RETURN_IF_ERROR(core.health->Check());
  const std::string label = "duplicate on rank " + std::to_string(rank()) +
                            " of " + std::to_string(size()) + " (" +
                            std::string(CommBackendName(backend())) + ")";
  std::unique_ptr<internal::BackendRequest> started;
  StatusOr<std::unique_ptr<internal::CommBackend>> dup = Status::Ok();
  {
    MutexLock lock(&core.mu);
    dup = core.backend->StartDuplicate(&started);
  }
  if (!dup.ok()) {
    // Nothing was started: this communicator is still whole.
    if (dup.status().code() == StatusCode::kNotSupported) return dup.status();
    const Status s = dup.status().WithContext(label);
    core.health->Fail(s);
    return s;
  }
  internal::PolledRequest request(std::move(started), label, core.timeout_s,
                                  core.health);
  STRATA_RETURN_IF_ERROR(request.Wait());
  auto state = std::make_unique<State>();
  state->core->timeout_s = core.timeout_s;
  state->core->backend = std::move(dup).value();
  return Communicator(std::move(state));
}

Status Communicator::Barrier() {
  // Host-side on every backend (NCCL's synchronizes through its own
  // scratch buffer and stream).
  STRATA_ASSIGN_OR_RETURN(auto request,
                          state_->core->Start({CommOpKind::kBarrier}));
  return request->Wait();
}

}  // namespace strata
