// Linux native AIO backend (libaio): one io_context per engine. Unlike
// DeepSpeed's aio layer, io_setup's and io_submit's results are checked and
// every io_event.res is handed to the engine.
#include <libaio.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "swap/backend.h"

namespace strata::swap {
namespace {

constexpr int kMaxSyscallRetries = 64;

class AioBackend final : public Backend {
 public:
  AioBackend(uint32_t depth, io_context_t ctx)
      : ctx_(ctx), capacity_(depth), iocbs_(depth), events_(depth) {
    free_.reserve(depth);
    for (uint32_t i = 0; i < depth; ++i) free_.push_back(&iocbs_[i]);
  }
  ~AioBackend() override { io_destroy(ctx_); }

  IoBackend kind() const override { return IoBackend::kAio; }
  uint32_t capacity() const override { return capacity_; }

  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    batch_.clear();
    for (const RawOp& op : ops) {
      if (free_.empty()) break;
      iocb* cb = free_.back();
      free_.pop_back();
      if (op.op == IoOp::kRead) {
        io_prep_pread(cb, op.fd, op.buf, op.len,
                      static_cast<long long>(op.offset));
      } else {
        io_prep_pwrite(cb, op.fd, op.buf, op.len,
                       static_cast<long long>(op.offset));
      }
      // The kernel signals the eventfd as each request completes.
      io_set_eventfd(cb, CompletionFd());
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(op.slot));
      batch_.push_back(cb);
    }
    size_t done = 0;
    int tries = 0;
    while (done < batch_.size()) {
      const int rc = io_submit(ctx_, static_cast<long>(batch_.size() - done),
                               batch_.data() + done);
      if (rc > 0) {
        done += static_cast<size_t>(rc);
        continue;
      }
      if ((rc == -EINTR || rc == -EAGAIN) && ++tries < kMaxSyscallRetries) {
        continue;
      }
      // The rest never reached the kernel: give their iocbs back.
      for (size_t i = done; i < batch_.size(); ++i) free_.push_back(batch_[i]);
      // What the kernel took is in flight and must be reported as such; the
      // engine offers the rest again later, and a lasting error then
      // surfaces with nothing in flight.
      if (done > 0 || rc == -EAGAIN) break;
      return Status::FromErrno(rc < 0 ? -rc : EIO, "io_submit");
    }
    return done;
  }

  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override {
    const long max = static_cast<long>(std::min(out.size(), events_.size()));
    long n;
    do {
      n = io_getevents(ctx_, static_cast<long>(min), max, events_.data(),
                       nullptr);
    } while (n == -EINTR);
    if (n < 0) return Status::FromErrno(static_cast<int>(-n), "io_getevents");
    for (long i = 0; i < n; ++i) {
      const io_event& e = events_[i];
      out[i].slot = reinterpret_cast<uintptr_t>(e.data);
      // res is the byte count or -errno, in an unsigned long.
      out[i].res = static_cast<long>(e.res);
      free_.push_back(e.obj);
    }
    return static_cast<size_t>(n);
  }

 private:
  io_context_t ctx_;
  uint32_t capacity_;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<iocb*> batch_;
  std::vector<io_event> events_;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewAioBackend(const IoEngineOptions& o) {
  io_context_t ctx = nullptr;
  const int rc = io_setup(static_cast<int>(o.queue_depth), &ctx);
  if (rc < 0) {
    std::string msg = "io_setup(" + std::to_string(o.queue_depth) +
                      "): " + std::strerror(-rc);
    if (rc == -EAGAIN) {
      msg +=
          " (fs.aio-max-nr is exhausted; lower the queue depth or raise "
          "the sysctl)";
    }
    return Status(StatusCode::kUnavailable, msg, -rc);
  }
  return std::unique_ptr<Backend>(new AioBackend(o.queue_depth, ctx));
}

}  // namespace strata::swap
