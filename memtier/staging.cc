#include "memtier/staging.h"

#include <string>

namespace strata::memtier {

std::byte* StagingLease::data() const { return pool_->buffers_[index_].data(); }

size_t StagingLease::size() const { return pool_->bytes_; }

Status StagingLease::RecordDone(Stream& stream) {
  return pool_->device_->RecordEvent(*pool_->done_[index_], stream);
}

Status StagingLease::WaitDone() const {
  return pool_->device_->SynchronizeEvent(*pool_->done_[index_]);
}

void StagingLease::Reset() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Release(index_);
}

StatusOr<std::unique_ptr<StagingPool>> StagingPool::Create(Device* device,
                                                           size_t count,
                                                           size_t bytes,
                                                           bool pin) {
  if (count == 0 || bytes == 0 || bytes % 4096 != 0) {
    return Status::InvalidArgument(
        "staging buffers: " + std::to_string(count) + " x " +
        std::to_string(bytes) +
        " bytes; need at least one buffer of a nonzero multiple of 4096");
  }
  std::unique_ptr<StagingPool> pool(new StagingPool(device, bytes));
  HostBufferOptions o;
  o.pin = pin;
  o.prefault = true;
  for (size_t i = 0; i < count; ++i) {
    StatusOr<HostBuffer> b = pin ? device->AllocatePinnedHost(bytes, o)
                                 : HostBuffer::Allocate(bytes, o);
    if (!b.ok()) {
      return Status(b.status().code(), "staging buffer " +
                                           std::to_string(i + 1) + " of " +
                                           std::to_string(count) + ": " +
                                           std::string(b.status().message()));
    }
    pool->buffers_.push_back(std::move(b).value());
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, device->NewEvent());
    pool->done_.push_back(std::move(e));
  }
  MutexLock l(&pool->mu_);
  for (size_t i = count; i-- > 0;) pool->free_.push_back(i);
  return pool;
}

StagingPool::~StagingPool() {
  for (auto& e : done_) device_->SynchronizeEvent(*e).IgnoreError();
}

StatusOr<StagingLease> StagingPool::Acquire() {
  size_t index;
  {
    MutexLock l(&mu_);
    while (free_.empty()) cv_.Wait(&mu_);
    index = free_.back();
    free_.pop_back();
  }
  // The buffer's last copies must be done before it is written again.
  if (Status s = device_->SynchronizeEvent(*done_[index]); !s.ok()) {
    Release(index);
    return s;
  }
  return StagingLease(this, index);
}

std::vector<StagingLease> StagingPool::TryAcquire(size_t n) {
  std::vector<size_t> taken;
  {
    MutexLock l(&mu_);
    if (free_.size() < n) return {};
    taken.assign(free_.end() - static_cast<ptrdiff_t>(n), free_.end());
    free_.resize(free_.size() - n);
  }
  std::vector<StagingLease> leases;
  for (size_t index : taken) leases.push_back(StagingLease(this, index));
  for (size_t index : taken) {
    // As Acquire: the buffer's last copies must be done. On an error the
    // leases go back as they are destroyed.
    if (!device_->SynchronizeEvent(*done_[index]).ok()) return {};
  }
  return leases;
}

void StagingPool::Release(size_t index) {
  {
    MutexLock l(&mu_);
    free_.push_back(index);
  }
  cv_.Signal();
}

uint64_t StagingPool::pinned_bytes() const {
  uint64_t n = 0;
  for (const auto& b : buffers_) {
    if (b.pinned() || b.registration() != nullptr) n += b.size();
  }
  return n;
}

}  // namespace strata::memtier
