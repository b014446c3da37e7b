// AsyncIo: a thread-safe, asynchronous face of one IoEngine (one ring), with
// priorities and completion callbacks. The swap space and the tier manager
// share one AsyncIo, and so one ring.
//
// Any thread may Submit a batch of requests with a priority and a callback. A
// completion thread per AsyncIo hands requests to the engine, at most
// queue_depth at a time, always taking from the urgent queue before the
// background one (so a read that compute waits on overtakes queued prefetch
// and write-back), reaps their completions, and runs the callback once per
// batch when every request of it has finished. Completions are checked by the
// engine's one classifier, as for the synchronous IoEngine (short transfers
// resubmitted, EINTR/EAGAIN/ECANCELED retried, early end of file is
// kCorruption, errors name the file, offset and length).
//
// Callback contract: it runs on the completion thread, exactly once per
// accepted batch, with no lock of AsyncIo held. It must return quickly (it
// delays every other completion) and must not wait for I/O of this AsyncIo
// (that would wait for itself); it may Submit more I/O. Requests still queued
// when the AsyncIo is destroyed complete with kAborted ("cancelled"); those
// already in the kernel complete normally, and the destructor returns only
// after every callback has run.
//
// Buffers of a request must stay valid until its callback has run. Buffers
// used often can be registered (RegisterBuffer) so that io_uring uses them as
// fixed buffers; registrations are additive (each user registers its own) and
// end with the returned handle.
//
// Thread contract: thread-safe. File calls (Open, Close, Allocate, Sync)
// hold up completion delivery while they run; do them at setup.
#ifndef STRATA_ASYNC_IO_H_
#define STRATA_ASYNC_IO_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/export.h"
#include "strata/io_engine.h"
#include "strata/status.h"

namespace strata {

enum class IoPriority : uint8_t {
  kUrgent,      // compute waits on it (a fetch that missed the prefetch)
  kBackground,  // prefetch and write-back
};

// Runs once per accepted batch; completions[i] belongs to the batch's
// request i (its tag is that request's tag).
using IoCallback = std::function<void(std::span<IoCompletion> completions)>;
// Runs once per group of a SubmitGroups batch: `group` is its index and
// completions[i] belongs to the group's request i.
using IoGroupCallback =
    std::function<void(size_t group, std::span<IoCompletion> completions)>;

// A one-shot result: a callback Sets it, any number of threads Wait for it.
// Copies share one state. Thread-safe.
class STRATA_EXPORT IoTicket {
 public:
  IoTicket();
  // The first Set wins; later ones are ignored.
  void Set(Status status) const;
  // Blocks (no polling) until Set, and returns what was set.
  Status Wait() const;
  bool ready() const;
  // A callback that Sets this ticket with its argument.
  std::function<void(Status)> Setter() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The first failed completion's status, or OK.
STRATA_EXPORT Status FirstError(std::span<const IoCompletion> completions);

class AsyncIo;

// A buffer registered with an AsyncIo's ring; unregistered when destroyed.
// REQUIRES: no request on the buffer in flight when it is destroyed, and the
// AsyncIo outlives it. Move-only.
class STRATA_EXPORT IoBufferRegistration {
 public:
  IoBufferRegistration() = default;
  IoBufferRegistration(IoBufferRegistration&& other) noexcept;
  IoBufferRegistration& operator=(IoBufferRegistration&& other) noexcept;
  IoBufferRegistration(const IoBufferRegistration&) = delete;
  IoBufferRegistration& operator=(const IoBufferRegistration&) = delete;
  ~IoBufferRegistration();
  // True when the kernel took the buffer (io_uring); false when it is used
  // unregistered (other backends, or the kernel refused; logged once).
  bool registered() const { return index_ >= 0; }

 private:
  friend class AsyncIo;
  IoBufferRegistration(AsyncIo* io, int index) : io_(io), index_(index) {}
  AsyncIo* io_ = nullptr;
  int index_ = -1;
};

class STRATA_EXPORT AsyncIo {
 public:
  // A new engine (NewIoEngine(options)) and its completion thread.
  static StatusOr<std::unique_ptr<AsyncIo>> Create(
      const IoEngineOptions& options = {});
  // Takes over an engine made by NewIoEngine (kInvalidArgument for other
  // IoEngine implementations). REQUIRES: nothing in flight on it.
  static StatusOr<std::unique_ptr<AsyncIo>> Create(
      std::unique_ptr<IoEngine> engine);

  // Cancels what is still queued (kAborted), waits for what the kernel holds,
  // runs every outstanding callback, then stops the thread. Submits made by
  // callbacks meanwhile are refused. Must not run on the completion thread.
  virtual ~AsyncIo() = default;
  AsyncIo(const AsyncIo&) = delete;
  AsyncIo& operator=(const AsyncIo&) = delete;

  // Queues `batch`; `done` runs once when all of it has finished. A request
  // the engine would refuse (unknown file, O_DIRECT misalignment, too large)
  // fails the call with kInvalidArgument before anything is queued, and then
  // `done` never runs; so does a Submit after shutdown began
  // (kFailedPrecondition). An empty batch completes at once (done runs on the
  // completion thread).
  virtual Status Submit(std::span<const IoRequest> batch, IoPriority priority,
                        IoCallback done) = 0;
  // Submit with a ticket that becomes FirstError of the batch (or the refusal).
  IoTicket Submit(std::span<const IoRequest> batch, IoPriority priority);
  // Submit of `batch` cut into consecutive groups of `group` requests (the
  // last may be shorter), each finished on its own: `done` runs once per
  // group as soon as that group's requests have finished, so a large batch's
  // results can be checked piece by piece while the rest is still in flight.
  // All or nothing, as Submit: a refusal queues no group and `done` never
  // runs. An empty batch is one empty group. kInvalidArgument when `group`
  // is 0. The default runs `done` for every group after the whole batch.
  virtual Status SubmitGroups(std::span<const IoRequest> batch, size_t group,
                              IoPriority priority, IoGroupCallback done);

  // See IoBufferRegistration.
  StatusOr<IoBufferRegistration> RegisterBuffer(std::span<std::byte> buf);

  // The engine's file calls (see IoEngine), serialized with the ring.
  virtual StatusOr<FileId> Open(const std::string& path,
                                const OpenOptions& options) = 0;
  // REQUIRES: no request on `file` queued or in flight.
  virtual Status Close(FileId file) = 0;
  virtual Status Allocate(FileId file, uint64_t bytes) = 0;
  virtual Status Sync(FileId file) = 0;
  virtual size_t alignment(FileId file) const = 0;
  virtual bool direct(FileId file) const = 0;
  virtual std::string_view name() const = 0;
  virtual IoBackend backend() const = 0;
  virtual std::string_view fallback_reason() const = 0;
  virtual uint32_t queue_depth() const = 0;
  // True on the completion thread (where callbacks run).
  virtual bool OnCompletionThread() const = 0;

 protected:
  AsyncIo() = default;

 private:
  friend class IoBufferRegistration;
  virtual int AddBuffer(std::span<std::byte> buf) = 0;
  virtual void RemoveBuffer(int index) = 0;
};

}  // namespace strata

#endif  // STRATA_ASYNC_IO_H_
