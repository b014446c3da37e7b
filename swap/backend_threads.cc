// Thread-pool backend: workers run one pread/pwrite per operation and report
// its raw result. Portable, and the last resort of the probe.
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <thread>
#include <vector>

#include "swap/backend.h"
#include "util/mutex.h"

namespace strata::swap {
namespace {

class ThreadBackend final : public Backend {
 public:
  ThreadBackend(uint32_t capacity, uint32_t threads) : capacity_(capacity) {
    for (uint32_t i = 0; i < threads; ++i) {
      workers_.emplace_back([this] { Work(); });
    }
  }

  ~ThreadBackend() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    work_cv_.SignalAll();
    for (auto& t : workers_) t.join();
  }

  IoBackend kind() const override { return IoBackend::kThreads; }
  uint32_t capacity() const override { return capacity_; }

  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    {
      MutexLock lock(&mu_);
      queue_.insert(queue_.end(), ops.begin(), ops.end());
    }
    if (ops.size() == 1) {
      work_cv_.Signal();
    } else {
      work_cv_.SignalAll();
    }
    return ops.size();
  }

  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override {
    MutexLock lock(&mu_);
    while (done_.size() < min) done_cv_.Wait(&mu_);
    return DrainResults(done_, out);
  }

 private:
  void Work() STRATA_EXCLUDES(mu_) {
    mu_.Lock();
    for (;;) {
      while (!stop_ && queue_.empty()) work_cv_.Wait(&mu_);
      if (queue_.empty()) break;  // stop_ and drained
      const RawOp op = queue_.front();
      queue_.pop_front();
      mu_.Unlock();
      const ssize_t n =
          op.op == IoOp::kRead
              ? ::pread(op.fd, op.buf, op.len, static_cast<off_t>(op.offset))
              : ::pwrite(op.fd, op.buf, op.len, static_cast<off_t>(op.offset));
      const RawResult r{op.slot, n >= 0 ? n : -errno};
      mu_.Lock();
      done_.push_back(r);
      done_cv_.Signal();
      SignalReady();
    }
    mu_.Unlock();
  }

  const uint32_t capacity_;
  Mutex mu_;
  CondVar work_cv_;  // queue_ gained work, or stop_
  CondVar done_cv_;  // done_ gained a result
  std::deque<RawOp> queue_ STRATA_GUARDED_BY(mu_);
  std::deque<RawResult> done_ STRATA_GUARDED_BY(mu_);
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewThreadBackend(const IoEngineOptions& o) {
  const uint32_t threads = o.threads != 0 ? o.threads : o.queue_depth;
  return std::unique_ptr<Backend>(new ThreadBackend(o.queue_depth, threads));
}

}  // namespace strata::swap
