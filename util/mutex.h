// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// the clang thread-safety annotations (util/thread_annotations.h), so that
// -Wthread-safety can check every access to state marked
// STRATA_GUARDED_BY(mu_). Modules lock with these, not with the std types
// (tests may use either). Same shape as leveldb's port::Mutex / port::CondVar.
//
//   class Queue {
//    public:
//     void Push(int v) STRATA_EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       items_.push_back(v);
//       nonempty_.Signal();
//     }
//     int Pop() STRATA_EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       while (items_.empty()) nonempty_.Wait(&mu_);
//       ...
//     }
//    private:
//     Mutex mu_;
//     CondVar nonempty_;  // items_ gained an item
//     std::deque<int> items_ STRATA_GUARDED_BY(mu_);
//   };
//
// Waits are written as loops around CondVar::Wait, as above, rather than
// with a predicate: the analysis checks the loop condition in the function
// that holds the lock, where it could not check a lambda's body.
#ifndef STRATA_UTIL_MUTEX_H_
#define STRATA_UTIL_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "util/thread_annotations.h"

namespace strata {

// A non-recursive exclusive lock. Thread-safe.
class STRATA_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  ~Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() STRATA_ACQUIRE() { mu_.lock(); }
  void Unlock() STRATA_RELEASE() { mu_.unlock(); }
  // Returns true, holding the lock, when it was free.
  bool TryLock() STRATA_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the calling thread holds the lock, where it
  // cannot see so itself. Not checked at run time: std::mutex has no owner
  // query.
  void AssertHeld() const STRATA_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `*mu` from construction to destruction:
//
//   MutexLock lock(&mu_);
class STRATA_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) STRATA_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() STRATA_RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable waited on with a Mutex held. Wakeups may be spurious:
// wait in a loop that re-checks the condition. Every concurrent waiter must
// pass the same Mutex (std::condition_variable's rule). Thread-safe.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Atomically releases `*mu` and blocks until signalled (or spuriously
  // woken), then re-acquires `*mu` before it returns. To the analysis `*mu`
  // stays held throughout, which is what the caller's code sees.
  void Wait(Mutex* mu) STRATA_REQUIRES(mu) {
    // The std::mutex is locked on entry and on return: adopt it for the
    // wait and hand it back without unlocking.
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Wakes one waiter / all waiters. The Mutex need not be held.
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata

#endif  // STRATA_UTIL_MUTEX_H_
