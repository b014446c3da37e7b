// The engine over a Backend: validation, request bookkeeping, and the one
// place where raw results are classified (done, short -> resubmit the rest,
// EINTR/EAGAIN/ECANCELED -> bounded retry, error -> Status with file and
// offset).
#include "strata/io_engine.h"

#include <fcntl.h>

#include <cerrno>
#include <deque>
#include <set>
#include <string>
#include <vector>

#include "swap/backend.h"
#include "util/log.h"
#include "util/mutex.h"

namespace strata {

std::string_view IoBackendName(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto:
      return "auto";
    case IoBackend::kUring:
      return "uring";
    case IoBackend::kAio:
      return "aio";
    case IoBackend::kThreads:
      return "psync";
    case IoBackend::kMemory:
      return "memory";
  }
  return "unknown";
}

StatusOr<IoBackend> ParseIoBackend(std::string_view name) {
  if (name == "auto") return IoBackend::kAuto;
  if (name == "uring" || name == "io_uring") return IoBackend::kUring;
  if (name == "aio" || name == "libaio") return IoBackend::kAio;
  if (name == "psync" || name == "threads") return IoBackend::kThreads;
  if (name == "memory") return IoBackend::kMemory;
  return Status::InvalidArgument("unknown I/O engine '" + std::string(name) +
                                 "' (expected uring, aio, psync or memory)");
}

Status IoEngine::RegisterBuffers(std::span<const std::span<std::byte>>) {
  return Status::Ok();
}

namespace {

Status TransferAndWait(IoEngine& engine, const IoRequest& req) {
  if (engine.in_flight() != 0) {
    return Status::FailedPrecondition(
        "synchronous I/O while requests are in flight");
  }
  STRATA_RETURN_IF_ERROR(engine.Submit({&req, 1}));
  IoCompletion c;
  STRATA_ASSIGN_OR_RETURN(size_t n, engine.Reap({&c, 1}, 1));
  if (n != 1) return Status::Internal("reap returned no completion");
  return std::move(c.status);
}

}  // namespace

Status IoEngine::ReadAt(FileId file, uint64_t offset,
                        std::span<std::byte> buf) {
  return TransferAndWait(*this, {file, offset, buf, IoOp::kRead, 0});
}

Status IoEngine::WriteAt(FileId file, uint64_t offset,
                         std::span<const std::byte> buf) {
  // The engine never writes into a write request's buffer.
  std::span<std::byte> mut(const_cast<std::byte*>(buf.data()), buf.size());
  return TransferAndWait(*this, {file, offset, mut, IoOp::kWrite, 0});
}

namespace swap {
namespace {

// Largest single request; io_uring and libaio lengths are 32-bit and Linux
// transfers at most 0x7ffff000 bytes per call.
constexpr uint64_t kMaxRequestBytes = uint64_t{1} << 30;

std::string_view OpName(IoOp op) {
  return op == IoOp::kRead ? "read" : "write";
}

struct FileState {
  int fd = -1;
  std::string path;
  bool direct = false;
  size_t align = 1;
  bool open = false;
};

struct Slot {
  IoRequest req;
  uint64_t done = 0;     // bytes transferred so far
  uint32_t retries = 0;  // EINTR/EAGAIN/ECANCELED retries so far
  bool active = false;
};

class EngineImpl final : public EngineCore {
 public:
  EngineImpl(std::unique_ptr<Backend> backend, const IoEngineOptions& options,
             std::string fallback_reason)
      : backend_(std::move(backend)),
        options_(options),
        fallback_reason_(std::move(fallback_reason)) {}

  ~EngineImpl() override {
    // Buffers of in-flight requests must stay valid until the kernel is done
    // with them: drain, dropping the results.
    std::vector<IoCompletion> sink(64);
    while (in_flight() > 0) {
      auto n = Reap(sink, 1);
      if (!n.ok()) {
        STRATA_LOG_ERROR("io engine shutdown: {}", n.status().ToString());
        break;
      }
    }
    for (auto& f : files_) {
      if (f.open) backend_->CloseFile(f.fd);
    }
  }

  std::string_view name() const override {
    return IoBackendName(backend_->kind());
  }
  IoBackend backend() const override { return backend_->kind(); }
  std::string_view fallback_reason() const override { return fallback_reason_; }

  StatusOr<FileId> Open(const std::string& path,
                        const OpenOptions& o) override {
    int flags = (o.writable ? O_RDWR : O_RDONLY) | O_CLOEXEC;
    if (o.create) flags |= O_CREAT;
    if (o.truncate) flags |= O_TRUNC;
    bool direct = options_.direct_io;
    int fd = backend_->OpenFile(path, flags | (direct ? O_DIRECT : 0), 0600);
    if (fd == -EINVAL && direct) {
      // Some filesystems refuse O_DIRECT (older tmpfs, some FUSE).
      STRATA_LOG_ONCE(WARN,
                      "{} does not accept O_DIRECT; using buffered I/O on "
                      "that filesystem",
                      path);
      direct = false;
      fd = backend_->OpenFile(path, flags, 0600);
    }
    if (fd < 0) return Status::FromErrno(-fd, "open " + path);
    FileState f;
    f.fd = fd;
    f.path = path;
    f.direct = direct;
    f.align = direct ? backend_->DirectAlignment(fd) : 1;
    f.open = true;
    for (FileId id = 0; id < files_.size(); ++id) {
      if (!files_[id].open) {
        files_[id] = std::move(f);
        return id;
      }
    }
    files_.push_back(std::move(f));
    return static_cast<FileId>(files_.size() - 1);
  }

  Status Close(FileId file) override {
    STRATA_ASSIGN_OR_RETURN(FileState * f, Lookup(file));
    for (const Slot& s : slots_) {
      if (s.active && s.req.file == file) {
        return Status::FailedPrecondition("close of " + f->path +
                                          " with requests in flight");
      }
    }
    backend_->CloseFile(f->fd);
    f->open = false;
    f->fd = -1;
    return Status::Ok();
  }

  Status Allocate(FileId file, uint64_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(FileState * f, Lookup(file));
    const int rc = backend_->Fallocate(f->fd, bytes);
    if (rc == 0) return Status::Ok();
    return Status::FromErrno(
        -rc, "preallocate " + std::to_string(bytes) + " bytes for " + f->path);
  }

  Status Sync(FileId file) override {
    STRATA_ASSIGN_OR_RETURN(FileState * f, Lookup(file));
    const int rc = backend_->Fsync(f->fd);
    // Never retried: after a failed writeback the kernel may have dropped
    // the dirty pages, so a second fsync could succeed falsely.
    if (rc != 0) return Status::FromErrno(-rc, "fsync " + f->path);
    return Status::Ok();
  }

  StatusOr<uint64_t> FileSize(FileId file) override {
    STRATA_ASSIGN_OR_RETURN(FileState * f, Lookup(file));
    const int64_t n = backend_->FileSize(f->fd);
    if (n < 0)
      return Status::FromErrno(static_cast<int>(-n), "stat " + f->path);
    return static_cast<uint64_t>(n);
  }

  size_t alignment(FileId file) const override {
    return file < files_.size() && files_[file].open ? files_[file].align : 0;
  }

  bool direct(FileId file) const override {
    return file < files_.size() && files_[file].open && files_[file].direct;
  }

  Status RegisterBuffers(
      std::span<const std::span<std::byte>> buffers) override {
    if (in_flight() != 0) {
      return Status::FailedPrecondition(
          "RegisterBuffers with requests in flight");
    }
    if (!options_.register_buffers) return Status::Ok();
    return backend_->RegisterBuffers(buffers);
  }

  Status Submit(std::span<const IoRequest> batch) override {
    for (const IoRequest& r : batch) STRATA_RETURN_IF_ERROR(Validate(r));
    for (const IoRequest& r : batch) {
      const uint64_t slot = AllocSlot();
      Slot& s = slots_[slot];
      s.req = r;
      s.done = 0;
      s.retries = 0;
      s.active = true;
      ++in_flight_;
      if (r.buf.empty()) {
        Complete(slot, Status::Ok());
      } else {
        pending_.push_back(slot);
      }
    }
    return Pump();
  }

  StatusOr<size_t> Reap(std::span<IoCompletion> out,
                        size_t min_complete) override {
    size_t got = 0;
    raw_.resize(backend_->capacity());
    for (;;) {
      while (got < out.size() && !completed_.empty()) {
        out[got++] = std::move(completed_.front());
        completed_.pop_front();
        --in_flight_;
      }
      if (got >= min_complete || got == out.size() || in_flight_ == 0) {
        return got;
      }
      STRATA_RETURN_IF_ERROR(Pump());
      if (in_backend_ == 0) {
        if (completed_.empty()) {
          return Status::Internal("I/O backend accepted no request");
        }
        continue;  // Pump failed some requests; hand them out
      }
      STRATA_ASSIGN_OR_RETURN(size_t n, backend_->Wait(raw_, 1));
      in_backend_ -= n;
      for (size_t i = 0; i < n; ++i) OnResult(raw_[i]);
    }
  }

  size_t in_flight() const override { return in_flight_; }

  StatusOr<size_t> Poll(std::span<IoCompletion> out) override {
    STRATA_RETURN_IF_ERROR(Pump());
    if (in_backend_ > 0) {
      raw_.resize(backend_->capacity());
      STRATA_ASSIGN_OR_RETURN(size_t n, backend_->Wait(raw_, 0));
      in_backend_ -= n;
      for (size_t i = 0; i < n; ++i) OnResult(raw_[i]);
      STRATA_RETURN_IF_ERROR(Pump());  // resubmit short or retried ones
    }
    size_t got = 0;
    while (got < out.size() && !completed_.empty()) {
      out[got++] = std::move(completed_.front());
      completed_.pop_front();
      --in_flight_;
    }
    return got;
  }

  int completion_fd() override { return backend_->CompletionFd(); }
  uint32_t capacity() const override { return backend_->capacity(); }

  int AddBuffer(std::span<std::byte> buf) override {
    return options_.register_buffers ? backend_->AddBuffer(buf) : -1;
  }

  void RemoveBuffer(int index) override { backend_->RemoveBuffer(index); }

  Status Validate(const IoRequest& r) override {
    STRATA_ASSIGN_OR_RETURN(FileState * f, Lookup(r.file));
    if (r.buf.size() > kMaxRequestBytes) {
      return Status::InvalidArgument(
          "request of " + std::to_string(r.buf.size()) + " bytes on " +
          f->path + " exceeds the largest request (" +
          std::to_string(kMaxRequestBytes) + " bytes)");
    }
    const size_t a = f->align;
    const auto addr = reinterpret_cast<uintptr_t>(r.buf.data());
    if (a > 1 && (addr % a || r.offset % a || r.buf.size() % a)) {
      return Status::InvalidArgument(
          std::string(OpName(r.op)) + " of " + f->path + " at offset " +
          std::to_string(r.offset) + " length " + std::to_string(r.buf.size()) +
          " is not aligned to " + std::to_string(a) +
          " bytes as O_DIRECT requires (buffer " +
          (addr % a ? "misaligned" : "aligned") + ")");
    }
    return Status::Ok();
  }

 private:
  StatusOr<FileState*> Lookup(FileId file) {
    if (file >= files_.size() || !files_[file].open) {
      return Status::InvalidArgument("unknown file id " + std::to_string(file));
    }
    return &files_[file];
  }

  uint64_t AllocSlot() {
    if (!free_slots_.empty()) {
      uint64_t s = free_slots_.back();
      free_slots_.pop_back();
      return s;
    }
    slots_.emplace_back();
    return slots_.size() - 1;
  }

  // Moves pending work into the backend while it has room.
  Status Pump() {
    while (!pending_.empty() && in_backend_ < backend_->capacity()) {
      const size_t room = backend_->capacity() - in_backend_;
      ops_.clear();
      for (size_t i = 0; i < pending_.size() && ops_.size() < room; ++i) {
        const Slot& s = slots_[pending_[i]];
        const FileState& f = files_[s.req.file];
        RawOp op;
        op.fd = f.fd;
        op.offset = s.req.offset + s.done;
        op.buf = s.req.buf.data() + s.done;
        op.len = static_cast<uint32_t>(s.req.buf.size() - s.done);
        op.op = s.req.op;
        op.slot = pending_[i];
        ops_.push_back(op);
      }
      auto accepted = backend_->Submit(ops_);
      if (!accepted.ok()) {
        // The backend refused the batch: fail its requests, not the engine.
        for (const RawOp& op : ops_) {
          pending_.pop_front();
          Fail(op.slot, accepted.status());
        }
        continue;
      }
      in_backend_ += *accepted;
      for (size_t i = 0; i < *accepted; ++i) pending_.pop_front();
      if (*accepted == 0) break;  // kernel pushed back; reap first
    }
    return Status::Ok();
  }

  void OnResult(const RawResult& r) {
    Slot& s = slots_[r.slot];
    const FileState& f = files_[s.req.file];
    const uint64_t want = s.req.buf.size() - s.done;
    if (r.res < 0) {
      const int err = static_cast<int>(-r.res);
      // ECANCELED: strata never cancels its own requests, so it means the
      // kernel gave up starting one (io_uring cancels work it cannot hand to
      // an io-wq worker while a signal is pending). Retried like EINTR.
      if ((err == EINTR || err == EAGAIN || err == ECANCELED) &&
          s.retries < options_.max_retries) {
        ++s.retries;
        pending_.push_front(r.slot);
        return;
      }
      Fail(r.slot, Status::FromErrno(err, Describe(s, f)));
      return;
    }
    const auto n = static_cast<uint64_t>(r.res);
    if (n >= want) {
      s.done += want;
      Complete(r.slot, Status::Ok());
      return;
    }
    if (n == 0) {
      if (s.req.op == IoOp::kRead) {
        Fail(r.slot, Status::Corruption(Describe(s, f) +
                                        ": end of file reached after " +
                                        std::to_string(s.done) + " bytes"));
        return;
      }
      if (s.retries >= options_.max_retries) {
        Fail(r.slot,
             Status::IoError(Describe(s, f) + ": write made no progress"));
        return;
      }
      ++s.retries;
    }
    // Short transfer: resubmit the rest, first in line.
    s.done += n;
    pending_.push_front(r.slot);
  }

  static std::string Describe(const Slot& s, const FileState& f) {
    return std::string(OpName(s.req.op)) + " of " +
           std::to_string(s.req.buf.size()) + " bytes at offset " +
           std::to_string(s.req.offset) + " of " + f.path;
  }

  void Fail(uint64_t slot, Status status) { Complete(slot, std::move(status)); }

  void Complete(uint64_t slot, Status status) {
    Slot& s = slots_[slot];
    IoCompletion c;
    c.tag = s.req.tag;
    c.bytes = s.done;
    c.status = std::move(status);
    completed_.push_back(std::move(c));
    s.active = false;
    free_slots_.push_back(slot);
  }

  std::unique_ptr<Backend> backend_;
  IoEngineOptions options_;
  std::string fallback_reason_;
  std::vector<FileState> files_;
  std::vector<Slot> slots_;
  std::vector<uint64_t> free_slots_;
  std::deque<uint64_t> pending_;        // slots waiting for the backend
  std::deque<IoCompletion> completed_;  // finished, not yet reaped
  std::vector<RawOp> ops_;              // scratch for Pump
  std::vector<RawResult> raw_;          // scratch for Reap
  size_t in_flight_ = 0;                // submitted, not yet reaped
  size_t in_backend_ = 0;               // handed to the backend
};

// Logs each distinct choice once per process.
void SayChoice(const std::string& message) {
  struct Said {
    Mutex mu;
    std::set<std::string> messages STRATA_GUARDED_BY(mu);
  };
  static Said said;
  MutexLock lock(&said.mu);
  if (said.messages.insert(message).second) STRATA_LOG_INFO("{}", message);
}

}  // namespace

std::unique_ptr<IoEngine> NewIoEngineWithBackend(
    std::unique_ptr<Backend> backend, const IoEngineOptions& options,
    std::string fallback_reason) {
  return std::make_unique<EngineImpl>(std::move(backend), options,
                                      std::move(fallback_reason));
}

}  // namespace swap

StatusOr<std::unique_ptr<IoEngine>> NewIoEngine(const IoEngineOptions& o) {
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return Status::InvalidArgument("queue_depth must be 1..4096, not " +
                                   std::to_string(o.queue_depth));
  }
  using swap::NewIoEngineWithBackend;
  switch (o.backend) {
    case IoBackend::kUring: {
      STRATA_ASSIGN_OR_RETURN(auto b, swap::NewUringBackend(o));
      return NewIoEngineWithBackend(std::move(b), o);
    }
    case IoBackend::kAio: {
      STRATA_ASSIGN_OR_RETURN(auto b, swap::NewAioBackend(o));
      return NewIoEngineWithBackend(std::move(b), o);
    }
    case IoBackend::kThreads: {
      STRATA_ASSIGN_OR_RETURN(auto b, swap::NewThreadBackend(o));
      return NewIoEngineWithBackend(std::move(b), o);
    }
    case IoBackend::kMemory:
      return NewIoEngineWithBackend(swap::NewMemoryBackend(o), o);
    case IoBackend::kAuto:
      break;
  }
  std::string reason;
  auto uring = swap::NewUringBackend(o);
  if (uring.ok()) {
    swap::SayChoice("strata io: using io_uring");
    return NewIoEngineWithBackend(std::move(uring).value(), o);
  }
  reason = "io_uring unavailable (" + uring.status().ToString() + ")";
  auto aio = swap::NewAioBackend(o);
  if (aio.ok()) {
    swap::SayChoice("strata io: using libaio; " + reason);
    return NewIoEngineWithBackend(std::move(aio).value(), o, reason);
  }
  reason += "; libaio unavailable (" + aio.status().ToString() + ")";
  STRATA_ASSIGN_OR_RETURN(auto threads, swap::NewThreadBackend(o));
  swap::SayChoice("strata io: using a pread/pwrite thread pool; " + reason);
  return NewIoEngineWithBackend(std::move(threads), o, reason);
}

}  // namespace strata
