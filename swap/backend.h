// The backend layer under IoEngine (internal).
//
// A Backend moves bytes and nothing more: it submits raw operations and hands
// back each one's raw result (bytes transferred, or -errno). It does not
// retry, resubmit short transfers, or build messages: the engine above does
// that once for every backend (swap/io_engine.cc). File-level calls default to
// POSIX so that only the in-memory backend overrides them.
//
// BackendWrapper forwards every call to another backend; test doubles such as
// FaultInjectingBackend derive from it and override only what they change.
//
// Every backend owns an eventfd (CompletionFd) that it signals whenever a
// result becomes ready to Wait for, so that AsyncIo's completion thread can
// sleep in poll() on it and be woken by submitters too (they write to it).
//
// Thread contract: REQUIRES external synchronization (the engine's), except
// that any thread may write to CompletionFd().
#ifndef STRATA_SWAP_BACKEND_H_
#define STRATA_SWAP_BACKEND_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/io_engine.h"
#include "strata/status.h"
#include "util/unique_handle.h"

namespace strata::swap {

struct RawOp {
  int fd = -1;
  uint64_t offset = 0;
  std::byte* buf = nullptr;
  uint32_t len = 0;
  IoOp op = IoOp::kRead;
  uint64_t slot = 0;  // the engine's id, returned in RawResult
};

struct RawResult {
  uint64_t slot = 0;
  int64_t res = 0;  // bytes transferred (>= 0) or -errno
};

// Writes 1 to an eventfd (wakes a poll() on it); ignores failures, which can
// only be a counter overflow that leaves it readable anyway.
void SignalEventFd(int fd);
// Creates a non-blocking, close-on-exec eventfd, or returns -1 (errno set).
int NewEventFd();

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual IoBackend kind() const = 0;
  // Operations that may be in flight at once.
  virtual uint32_t capacity() const = 0;

  // File calls. Each returns -errno on failure. Defaults: POSIX.
  virtual int OpenFile(const std::string& path, int flags, mode_t mode);
  virtual void CloseFile(int fd);
  virtual int Fallocate(int fd, uint64_t bytes);
  virtual int Fsync(int fd);
  virtual int64_t FileSize(int fd);
  // Direct-I/O alignment of an open file: statx(STATX_DIOALIGN), else the
  // block device's logical block size, else 4096.
  virtual size_t DirectAlignment(int fd);

  // Buffers registered with the kernel where the backend can (io_uring's
  // fixed buffers). AddBuffer returns the registration's index, or -1 when
  // the buffer stays unregistered (still usable, a little slower; the reason
  // is logged once). RemoveBuffer(index) undoes one AddBuffer. Defaults:
  // nothing registered.
  virtual int AddBuffer(std::span<std::byte> buf);
  virtual void RemoveBuffer(int index);
  // Replaces the buffers added by earlier RegisterBuffers calls (not those of
  // AddBuffer) with `bufs`. Built on AddBuffer/RemoveBuffer.
  Status RegisterBuffers(std::span<const std::span<std::byte>> bufs);

  // The eventfd signalled when results become ready (see above); -1 when
  // the process could not create one. Wrappers forward their target's.
  virtual int CompletionFd() { return event_fd_.get(); }

  // Starts ops. Returns how many were accepted, a prefix of `ops` (possibly 0
  // when the kernel pushes back); an error means none of the rest were.
  virtual StatusOr<size_t> Submit(std::span<const RawOp> ops) = 0;
  // Waits for at least `min` results (REQUIRES: min <= ops in flight) and
  // returns how many were written to `out`.
  virtual StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) = 0;

 protected:
  Backend();
  // Signals CompletionFd(): a result is ready.
  void SignalReady() { SignalEventFd(CompletionFd()); }

 private:
  UniqueFd event_fd_;
  std::vector<int> registered_;  // indexes added by RegisterBuffers
};

class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(std::unique_ptr<Backend> target)
      : target_(std::move(target)) {}
  IoBackend kind() const override { return target_->kind(); }
  uint32_t capacity() const override { return target_->capacity(); }
  int OpenFile(const std::string& path, int flags, mode_t mode) override {
    return target_->OpenFile(path, flags, mode);
  }
  void CloseFile(int fd) override { target_->CloseFile(fd); }
  int Fallocate(int fd, uint64_t bytes) override {
    return target_->Fallocate(fd, bytes);
  }
  int Fsync(int fd) override { return target_->Fsync(fd); }
  int64_t FileSize(int fd) override { return target_->FileSize(fd); }
  size_t DirectAlignment(int fd) override {
    return target_->DirectAlignment(fd);
  }
  int AddBuffer(std::span<std::byte> buf) override {
    return target_->AddBuffer(buf);
  }
  void RemoveBuffer(int index) override { target_->RemoveBuffer(index); }
  int CompletionFd() override { return target_->CompletionFd(); }
  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    return target_->Submit(ops);
  }
  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override {
    return target_->Wait(out, min);
  }

 protected:
  Backend& target() { return *target_; }

 private:
  std::unique_ptr<Backend> target_;
};

// Moves results from the front of `queue` into `out` until either runs out;
// returns how many moved. The backends that complete in user space share it.
inline size_t DrainResults(std::deque<RawResult>& queue,
                           std::span<RawResult> out) {
  size_t n = 0;
  while (n < out.size() && !queue.empty()) {
    out[n++] = queue.front();
    queue.pop_front();
  }
  return n;
}

// Factories. Each returns kUnavailable with the reason when the kernel or the
// process's sandbox refuses the interface.
StatusOr<std::unique_ptr<Backend>> NewUringBackend(const IoEngineOptions& o);
StatusOr<std::unique_ptr<Backend>> NewAioBackend(const IoEngineOptions& o);
StatusOr<std::unique_ptr<Backend>> NewThreadBackend(const IoEngineOptions& o);
std::unique_ptr<Backend> NewMemoryBackend(const IoEngineOptions& o);

// The engine's internal face, for AsyncIo: every IoEngine made by NewIoEngine
// or NewIoEngineWithBackend is one. REQUIRES external synchronization, like
// the engine.
class EngineCore : public IoEngine {
 public:
  // Checks a request as Submit would (known file, size, O_DIRECT alignment).
  virtual Status Validate(const IoRequest& request) = 0;
  // Makes progress without blocking: hands pending work to the backend,
  // classifies whatever results are ready (resubmitting short or retried
  // transfers) and moves finished requests to `out`. Returns how many.
  virtual StatusOr<size_t> Poll(std::span<IoCompletion> out) = 0;
  // The backend's eventfd: readable when Poll may find results.
  virtual int completion_fd() = 0;
  // Requests the backend takes at once (the queue depth).
  virtual uint32_t capacity() const = 0;
  // Additive buffer registration (see Backend::AddBuffer).
  virtual int AddBuffer(std::span<std::byte> buf) = 0;
  virtual void RemoveBuffer(int index) = 0;
};

// An engine over a given backend (tests use it with wrappers).
std::unique_ptr<IoEngine> NewIoEngineWithBackend(
    std::unique_ptr<Backend> backend, const IoEngineOptions& options,
    std::string fallback_reason = "");

}  // namespace strata::swap

#endif  // STRATA_SWAP_BACKEND_H_
