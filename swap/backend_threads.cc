// Thread-pool backend: workers run one pread/pwrite per operation and report
// its raw result. Portable, and the last resort of the probe.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "swap/backend.h"

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
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  IoBackend kind() const override { return IoBackend::kThreads; }
  uint32_t capacity() const override { return capacity_; }

  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.insert(queue_.end(), ops.begin(), ops.end());
    }
    if (ops.size() == 1) {
      work_cv_.notify_one();
    } else {
      work_cv_.notify_all();
    }
    return ops.size();
  }

  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_.size() >= min; });
    return DrainResults(done_, out);
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      const RawOp op = queue_.front();
      queue_.pop_front();
      lock.unlock();
      const ssize_t n =
          op.op == IoOp::kRead
              ? ::pread(op.fd, op.buf, op.len, static_cast<off_t>(op.offset))
              : ::pwrite(op.fd, op.buf, op.len, static_cast<off_t>(op.offset));
      const RawResult r{op.slot, n >= 0 ? n : -errno};
      lock.lock();
      done_.push_back(r);
      done_cv_.notify_one();
    }
  }

  const uint32_t capacity_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // queue_ gained work, or stop_
  std::condition_variable done_cv_;  // done_ gained a result
  std::deque<RawOp> queue_;          // GUARDED_BY(mu_)
  std::deque<RawResult> done_;       // GUARDED_BY(mu_)
  bool stop_ = false;                // GUARDED_BY(mu_)
  std::vector<std::thread> workers_;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> NewThreadBackend(const IoEngineOptions& o) {
  const uint32_t threads = o.threads != 0 ? o.threads : o.queue_depth;
  return std::unique_ptr<Backend>(new ThreadBackend(o.queue_depth, threads));
}

}  // namespace strata::swap
