// A thread that runs posted jobs in order, urgent ones first: the engine's
// NVMe mover (a read the trainer waits on overtakes prefetches and
// write-backs) and its gradient accumulator.
//
// Thread-safe. Jobs run on the worker's thread, one at a time; a job may post
// more jobs. The destructor runs every job still queued, then joins.
#ifndef STRATA_MEMTIER_WORKER_H_
#define STRATA_MEMTIER_WORKER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "util/mutex.h"

namespace strata::memtier {

enum class Priority : uint8_t { kUrgent, kBackground };

class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Post(Priority p, std::function<void()> job) STRATA_EXCLUDES(mu_) {
    {
      MutexLock l(&mu_);
      (p == Priority::kUrgent ? urgent_ : background_)
          .push_back(std::move(job));
    }
    cv_.Signal();
  }

 private:
  void Loop() STRATA_EXCLUDES(mu_) {
    for (;;) {
      std::function<void()> job;
      {
        MutexLock l(&mu_);
        while (urgent_.empty() && background_.empty() && !stop_) cv_.Wait(&mu_);
        auto& q = !urgent_.empty() ? urgent_ : background_;
        if (q.empty()) return;  // stopping, nothing left
        job = std::move(q.front());
        q.pop_front();
      }
      job();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> urgent_ STRATA_GUARDED_BY(mu_);
  std::deque<std::function<void()>> background_ STRATA_GUARDED_BY(mu_);
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the queues exist
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_WORKER_H_
