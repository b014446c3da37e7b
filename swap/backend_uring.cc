// io_uring backend (liburing): one ring per engine, batched submission,
// registered buffers (READ_FIXED/WRITE_FIXED when a request lies inside one)
// and a registered file table.
#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "swap/backend.h"
#include "util/log.h"

namespace strata::swap {
namespace {

constexpr unsigned kFileTableSize = 64;
constexpr unsigned kBufferTableSize = 1024;
constexpr int kMaxSyscallRetries = 64;

class UringBackend final : public Backend {
 public:
  UringBackend(const IoEngineOptions& o, io_uring ring)
      : ring_(ring), capacity_(o.queue_depth), options_(o) {
    if (o.register_files) {
      // A sparse table that files join as they open.
      files_registered_ =
          io_uring_register_files_sparse(&ring_, kFileTableSize) == 0;
      for (int i = kFileTableSize - 1; files_registered_ && i >= 0; --i) {
        free_file_slots_.push_back(i);
      }
    }
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  int RegisterEventFd(int fd) { return io_uring_register_eventfd(&ring_, fd); }

  IoBackend kind() const override { return IoBackend::kUring; }
  uint32_t capacity() const override { return capacity_; }

  int OpenFile(const std::string& path, int flags, mode_t mode) override {
    const int fd = Backend::OpenFile(path, flags, mode);
    if (fd >= 0 && files_registered_ && !free_file_slots_.empty()) {
      const int slot = free_file_slots_.back();
      if (io_uring_register_files_update(&ring_, slot, &fd, 1) == 1) {
        free_file_slots_.pop_back();
        fixed_files_[fd] = slot;
      }
    }
    return fd;
  }

  void CloseFile(int fd) override {
    if (auto it = fixed_files_.find(fd); it != fixed_files_.end()) {
      const int none = -1;
      (void)io_uring_register_files_update(&ring_, it->second, &none, 1);
      free_file_slots_.push_back(it->second);
      fixed_files_.erase(it);
    }
    Backend::CloseFile(fd);
  }

  // A sparse table of kBufferTableSize entries, created at the first
  // AddBuffer, that buffers join and leave one at a time
  // (io_uring_register_buffers_update_tag, Linux 5.19), so that several users
  // of one ring each register their own buffers.
  int AddBuffer(std::span<std::byte> buf) override {
    if (!buffers_ready_) {
      buffers_ready_ = true;
      const int rc = io_uring_register_buffers_sparse(&ring_, kBufferTableSize);
      if (rc != 0) {
        STRATA_LOG_ONCE(WARN,
                        "io_uring refused a sparse buffer table ({}); using "
                        "unregistered buffers",
                        std::strerror(-rc));
        return -1;
      }
      buffers_.resize(kBufferTableSize);
    }
    int index = -1;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].empty()) {
        index = static_cast<int>(i);
        break;
      }
    }
    if (index < 0 || buf.empty()) return -1;
    iovec iov{buf.data(), buf.size()};
    __u64 tag = 0;
    const int rc = io_uring_register_buffers_update_tag(
        &ring_, static_cast<unsigned>(index), &iov, &tag, 1);
    if (rc != 1) {
      // Not fatal: unregistered buffers work, a little slower.
      STRATA_LOG_ONCE(WARN,
                      "io_uring refused to register a {}-byte buffer ({}); "
                      "using unregistered buffers",
                      buf.size(), std::strerror(rc < 0 ? -rc : EINVAL));
      return -1;
    }
    buffers_[static_cast<size_t>(index)] = buf;
    used_ = std::max(used_, static_cast<size_t>(index) + 1);
    return index;
  }

  void RemoveBuffer(int index) override {
    if (index < 0 || static_cast<size_t>(index) >= buffers_.size()) return;
    iovec none{nullptr, 0};
    __u64 tag = 0;
    (void)io_uring_register_buffers_update_tag(
        &ring_, static_cast<unsigned>(index), &none, &tag, 1);
    buffers_[static_cast<size_t>(index)] = {};
    while (used_ > 0 && buffers_[used_ - 1].empty()) --used_;
  }

  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    size_t queued = 0;
    for (const RawOp& op : ops) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      const int buf_index = FindBuffer(op.buf, op.len);
      int fd = op.fd;
      bool fixed_file = false;
      if (auto it = fixed_files_.find(op.fd); it != fixed_files_.end()) {
        fd = it->second;
        fixed_file = true;
      }
      if (op.op == IoOp::kRead) {
        if (buf_index >= 0) {
          io_uring_prep_read_fixed(sqe, fd, op.buf, op.len, op.offset,
                                   buf_index);
        } else {
          io_uring_prep_read(sqe, fd, op.buf, op.len, op.offset);
        }
      } else {
        if (buf_index >= 0) {
          io_uring_prep_write_fixed(sqe, fd, op.buf, op.len, op.offset,
                                    buf_index);
        } else {
          io_uring_prep_write(sqe, fd, op.buf, op.len, op.offset);
        }
      }
      if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, op.slot);
      ++queued;
    }
    // Prepared SQEs belong to the ring now: report them all as accepted. A
    // submit interrupted or pushed back by the kernel is retried here a few
    // times; what is still unsubmitted then is flushed by Wait, which
    // submits before it waits. Per-request errors arrive in CQEs.
    for (int tries = 0; io_uring_sq_ready(&ring_) > 0; ++tries) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0) continue;
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY || rc == -ENOMEM) {
        if (tries < kMaxSyscallRetries) continue;
        break;
      }
      return Status::FromErrno(-rc, "io_uring_submit");
    }
    return queued;
  }

  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override {
    size_t got = 0;
    while (got < out.size()) {
      io_uring_cqe* cqe = nullptr;
      int rc;
      if (got < min) {
        rc = io_uring_sq_ready(&ring_) > 0 ? io_uring_submit_and_wait(&ring_, 1)
                                           : 0;
        if (rc >= 0) rc = io_uring_wait_cqe(&ring_, &cqe);
        if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
      } else {
        // Flush what an interrupted Submit left in the ring.
        if (got == 0 && io_uring_sq_ready(&ring_) > 0) {
          (void)io_uring_submit(&ring_);
        }
        rc = io_uring_peek_cqe(&ring_, &cqe);
        if (rc == -EAGAIN) break;  // nothing more ready
      }
      if (rc != 0) return Status::FromErrno(-rc, "io_uring_wait_cqe");
      out[got].slot = io_uring_cqe_get_data64(cqe);
      out[got].res = cqe->res;
      ++got;
      io_uring_cqe_seen(&ring_, cqe);
    }
    return got;
  }

 private:
  int FindBuffer(const std::byte* p, size_t len) const {
    for (size_t i = 0; i < used_; ++i) {
      const auto& b = buffers_[i];
      if (!b.empty() && p >= b.data() && p + len <= b.data() + b.size()) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  io_uring ring_;
  uint32_t capacity_;
  IoEngineOptions options_;
  bool files_registered_ = false;
  std::vector<int> free_file_slots_;
  std::unordered_map<int, int> fixed_files_;  // fd -> registered index
  bool buffers_ready_ = false;
  std::vector<std::span<std::byte>> buffers_;  // empty span: free entry
  size_t used_ = 0;  // entries below this may be in use
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewUringBackend(const IoEngineOptions& o) {
  io_uring ring;
  std::memset(&ring, 0, sizeof ring);
  const int rc = io_uring_queue_init(o.queue_depth, &ring, 0);
  if (rc < 0) {
    return Status(StatusCode::kUnavailable,
                  std::string("io_uring_setup: ") + std::strerror(-rc), -rc);
  }
  // IORING_OP_READ/WRITE need Linux 5.6.
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  const bool ops_ok = probe != nullptr &&
                      io_uring_opcode_supported(probe, IORING_OP_READ) &&
                      io_uring_opcode_supported(probe, IORING_OP_WRITE);
  if (probe != nullptr) io_uring_free_probe(probe);
  if (!ops_ok) {
    io_uring_queue_exit(&ring);
    return Status::Unavailable(
        "io_uring lacks IORING_OP_READ/WRITE (Linux 5.6 or later needed)");
  }
  auto backend = std::unique_ptr<UringBackend>(new UringBackend(o, ring));
  // Completions signal the backend's eventfd (Linux 5.2), which AsyncIo's
  // completion thread sleeps on.
  const int efd = backend->CompletionFd();
  const int erc = efd < 0 ? -EMFILE : backend->RegisterEventFd(efd);
  if (erc != 0) {
    return Status::Unavailable(std::string("io_uring_register_eventfd: ") +
                               std::strerror(-erc));
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace strata::swap
