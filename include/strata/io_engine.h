// IoEngine: asynchronous block I/O for the NVMe tier.
//
// One interface over several backends, chosen at start by probing in the order
// io_uring (liburing: batched submission, registered buffers and files),
// libaio, a thread pool over pread/pwrite; plus an in-memory backend for
// tests. The choice, and why each better backend was left, is logged once and
// kept in fallback_reason().
//
// Every completion is checked, whatever the backend (the logic lives once, in
// the engine, not in the backends):
//   - a negative result becomes a Status naming the file, offset and length;
//   - a short transfer is resubmitted for the rest; a read that reaches end of
//     file early is kCorruption (the data that should be there is not);
//   - EINTR, EAGAIN and ECANCELED (which io_uring returns when a signal
//     keeps it from starting a request; strata never cancels requests) are
//     retried a bounded number of times (Options::max_retries), then
//     reported.
// Files opened with direct I/O (O_DIRECT) require buffer address, offset and
// length aligned to alignment(file); misaligned requests are refused with
// kInvalidArgument before anything is submitted. Where the filesystem refuses
// O_DIRECT at open (EINVAL), the file is opened buffered and that is logged
// once.
//
// Thread contract: thread-compatible. One thread at a time may call Submit,
// Reap and the other methods of one engine (external synchronization); use
// one engine per submitting thread for parallel submitters. The destructor
// waits for requests still in flight (their buffers must outlive it).
#ifndef STRATA_IO_ENGINE_H_
#define STRATA_IO_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/export.h"
#include "strata/status.h"

namespace strata {

enum class IoOp : uint8_t { kRead, kWrite };

enum class IoBackend : uint8_t {
  kAuto,     // probe: io_uring, then libaio, then threads
  kUring,    // io_uring through liburing
  kAio,      // Linux native AIO (libaio)
  kThreads,  // a pool of threads over pread/pwrite
  kMemory,   // in-memory files, for tests
};

// "uring", "aio", "psync", "memory", "auto".
STRATA_EXPORT std::string_view IoBackendName(IoBackend backend);
// Parses the names above ("threads" is accepted for "psync").
STRATA_EXPORT StatusOr<IoBackend> ParseIoBackend(std::string_view name);

// An open file of one engine.
using FileId = uint32_t;

struct IoRequest {
  FileId file = 0;
  uint64_t offset = 0;       // bytes
  std::span<std::byte> buf;  // read: destination; write: source
  IoOp op = IoOp::kRead;
  uint64_t tag = 0;  // returned in the completion; not interpreted
};

struct IoCompletion {
  uint64_t tag = 0;
  Status status;       // OK: all buf.size() bytes were transferred
  uint64_t bytes = 0;  // bytes transferred (== buf.size() when OK)
};

struct IoEngineOptions {
  IoBackend backend = IoBackend::kAuto;
  // Requests in flight in the kernel at most; more may be submitted and wait
  // in the engine. Default 32.
  uint32_t queue_depth = 32;
  // Open files with O_DIRECT (bypass the page cache). Default on.
  bool direct_io = true;
  // io_uring: register buffers passed to RegisterBuffers, and open files, with
  // the ring (fewer page pins and fd lookups per request). Falls back quietly
  // where the kernel refuses. Default on.
  bool register_buffers = true;
  bool register_files = true;
  // Thread-pool backend: worker threads. 0 means queue_depth.
  uint32_t threads = 0;
  // Bounded retries of a request failing with EINTR, EAGAIN or ECANCELED.
  uint32_t max_retries = 16;
};

struct OpenOptions {
  bool writable = true;
  bool create = false;  // create if missing (mode 0600)
  bool truncate = false;
};

class STRATA_EXPORT IoEngine {
 public:
  virtual ~IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // The backend in use: "uring", "aio", "psync" or "memory".
  virtual std::string_view name() const = 0;
  virtual IoBackend backend() const = 0;
  // Why the probe left better backends ("" when the first choice worked).
  virtual std::string_view fallback_reason() const = 0;

  virtual StatusOr<FileId> Open(const std::string& path,
                                const OpenOptions& options) = 0;
  // REQUIRES: no request on `file` in flight.
  virtual Status Close(FileId file) = 0;
  // Reserves `bytes` of disk for the file (fallocate). kNoSpace says how many
  // bytes were needed and how many are free.
  virtual Status Allocate(FileId file, uint64_t bytes) = 0;
  virtual Status Sync(FileId file) = 0;
  virtual StatusOr<uint64_t> FileSize(FileId file) = 0;
  // Required alignment of buffer address, offset and length for `file` (1 for
  // buffered files): statx(STATX_DIOALIGN), or the device's logical block
  // size, or 4096.
  virtual size_t alignment(FileId file) const = 0;
  // True if `file` was opened with O_DIRECT.
  virtual bool direct(FileId file) const = 0;

  // Optional: buffers that requests will use, registered with the kernel
  // where the backend can (io_uring). Requests may use any part of them.
  // Replaces earlier registrations. REQUIRES: nothing in flight. Default: OK
  // and nothing registered.
  virtual Status RegisterBuffers(std::span<const std::span<std::byte>> buffers);

  // Queues requests; never waits on the device. A request that is refused
  // (unknown file, misalignment) fails the whole call and queues nothing.
  virtual Status Submit(std::span<const IoRequest> batch) = 0;
  // Fills `out` with finished requests; blocks until at least
  // min(min_complete, in_flight()) have finished (0 polls). Returns how many.
  virtual StatusOr<size_t> Reap(std::span<IoCompletion> out,
                                size_t min_complete) = 0;
  // Requests submitted and not yet reaped.
  virtual size_t in_flight() const = 0;

  // Reads or writes all of `buf` at `offset` and waits. REQUIRES: nothing else
  // in flight.
  Status ReadAt(FileId file, uint64_t offset, std::span<std::byte> buf);
  Status WriteAt(FileId file, uint64_t offset, std::span<const std::byte> buf);

 protected:
  IoEngine() = default;
};

// Creates an engine with options.backend, or probes (kAuto).
STRATA_EXPORT StatusOr<std::unique_ptr<IoEngine>> NewIoEngine(
    const IoEngineOptions& options = {});

}  // namespace strata

#endif  // STRATA_IO_ENGINE_H_
