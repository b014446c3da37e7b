// io_uring backend (liburing): one ring per engine, batched submission,
// registered buffers (READ_FIXED/WRITE_FIXED when a request lies inside one)
// and a registered file table.
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "swap/backend.h"
#include "util/log.h"

namespace strata::swap {
namespace {

constexpr unsigned kFileTableSize = 64;
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

  Status RegisterBuffers(std::span<const std::span<std::byte>> bufs) override {
    if (!buffers_.empty()) {
      (void)io_uring_unregister_buffers(&ring_);
      buffers_.clear();
    }
    if (bufs.empty()) return Status::Ok();
    std::vector<iovec> iov;
    for (const auto& b : bufs) iov.push_back({b.data(), b.size()});
    const int rc = io_uring_register_buffers(&ring_, iov.data(),
                                             static_cast<unsigned>(iov.size()));
    if (rc != 0) {
      // Not fatal: unregistered buffers work, a little slower.
      STRATA_LOG_ONCE(WARN,
                      "io_uring refused to register {} buffers ({}); "
                      "using unregistered buffers",
                      bufs.size(), std::strerror(-rc));
      return Status::Ok();
    }
    buffers_.assign(bufs.begin(), bufs.end());
    return Status::Ok();
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
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const auto& b = buffers_[i];
      if (p >= b.data() && p + len <= b.data() + b.size()) {
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
  std::vector<std::span<std::byte>> buffers_;
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
  return std::unique_ptr<Backend>(new UringBackend(o, ring));
}

}  // namespace strata::swap
