// The constant-size buffers: a fixed pool of pinned host buffers, registered
// with the device, that carries all traffic between tiers (NVMe reads and
// writes, host<->device copies of parameters and gradients, the optimizer
// step's sub-groups). Allocated once at start; count x bytes never grows with
// the model.
//
// A lease is a move-only claim on one buffer. Device copies that read or
// write a leased buffer are followed by RecordDone(stream); the next Acquire
// of that buffer waits for them (on the acquiring thread, outside the lock),
// so a buffer is never rewritten while a copy still reads it.
//
// Thread-safe.
#ifndef STRATA_MEMTIER_STAGING_H_
#define STRATA_MEMTIER_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/device.h"
#include "strata/host_buffer.h"
#include "strata/status.h"
#include "util/mutex.h"

namespace strata::memtier {

class StagingPool;

class StagingLease {
 public:
  StagingLease() = default;
  StagingLease(StagingLease&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)), index_(o.index_) {}
  StagingLease& operator=(StagingLease&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = std::exchange(o.pool_, nullptr);
      index_ = o.index_;
    }
    return *this;
  }
  ~StagingLease() { Reset(); }

  std::byte* data() const;
  size_t size() const;
  std::span<std::byte> span() const { return {data(), size()}; }
  bool empty() const { return pool_ == nullptr; }
  // Marks the end of the device work enqueued on `stream` so far that uses
  // this buffer; the buffer's next user waits for it.
  Status RecordDone(Stream& stream);
  // Blocks until the work marked by the last RecordDone has finished (e.g. a
  // device-to-host copy into this buffer, before the host reads it).
  Status WaitDone() const;
  void Reset();

 private:
  friend class StagingPool;
  StagingLease(StagingPool* pool, size_t index) : pool_(pool), index_(index) {}
  StagingPool* pool_ = nullptr;
  size_t index_ = 0;
};

class StagingPool {
 public:
  // `count` buffers of `bytes` each (a multiple of 4096), page-locked (or
  // not, with one warning, when `pin` is false or the system refuses) and
  // registered with `device`.
  static StatusOr<std::unique_ptr<StagingPool>> Create(Device* device,
                                                       size_t count,
                                                       size_t bytes, bool pin);
  // REQUIRES: no lease alive.
  ~StagingPool();

  // Blocks until a buffer is free and its last device use has finished.
  StatusOr<StagingLease> Acquire() STRATA_EXCLUDES(mu_);
  // `n` buffers at once if that many are free now (none otherwise: an empty
  // vector); waits only for their last device use.
  std::vector<StagingLease> TryAcquire(size_t n) STRATA_EXCLUDES(mu_);
  size_t count() const { return buffers_.size(); }
  size_t buffer_bytes() const { return bytes_; }
  uint64_t pinned_bytes() const;

 private:
  friend class StagingLease;
  StagingPool(Device* device, size_t bytes) : device_(device), bytes_(bytes) {}
  void Release(size_t index) STRATA_EXCLUDES(mu_);

  Device* device_;
  size_t bytes_;
  std::vector<HostBuffer> buffers_;
  std::vector<std::unique_ptr<Event>> done_;  // one per buffer
  Mutex mu_;
  CondVar cv_;
  std::vector<size_t> free_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_STAGING_H_
