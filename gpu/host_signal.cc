#include "gpu/host_signal.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "strata/device.h"

namespace strata {

// ---- HostEvent (declared in strata/device.h) --------------------------------

HostEvent::HostEvent(const void* owner,
                     std::shared_ptr<internal::HostSignal> signal)
    : owner_(owner), signal_(std::move(signal)) {}

HostEvent::~HostEvent() { signal_->Abandon(); }

void HostEvent::Signal(uint64_t generation) noexcept {
  signal_->Signal(generation);
}
void HostEvent::Abandon() noexcept { signal_->Abandon(); }
uint64_t HostEvent::generation() const noexcept {
  return signal_->generation();
}
bool HostEvent::abandoned() const noexcept { return signal_->abandoned(); }

namespace internal {

void HostSignal::Signal(uint64_t generation) {
  MutexLock lock(&mu_);
  if (generation <= generation_) return;
  generation_ = generation;
  PublishLocked();
  // Under the lock: a woken waiter may let the last owner go at once.
  cv_.SignalAll();
}

void HostSignal::Abandon() {
  MutexLock lock(&mu_);
  if (abandoned_) return;
  abandoned_ = true;
  PublishLocked();
  cv_.SignalAll();
}

uint64_t HostSignal::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

bool HostSignal::abandoned() const {
  MutexLock lock(&mu_);
  return abandoned_;
}

StatusOr<bool> HostSignal::BeginWait(uint64_t generation) {
  MutexLock lock(&mu_);
  if (abandoned_ || generation <= generation_) return false;
  if (generation - generation_ >= (uint64_t{1} << 31)) {
    return Status::InvalidArgument(
        "WaitHostEvent for generation " + std::to_string(generation) +
        ", 2^31 or more above the signalled generation " +
        std::to_string(generation_) + "; wait for at most generation + " +
        std::to_string((uint64_t{1} << 31) - 1));
  }
  max_awaited_ = std::max(max_awaited_, generation);
  return true;
}

void HostSignal::WaitFor(uint64_t generation) {
  MutexLock lock(&mu_);
  while (!abandoned_ && generation_ < generation) cv_.Wait(&mu_);
}

void HostSignal::PublishLocked() {
  if (word_ == nullptr) return;
  const uint64_t g =
      abandoned_ ? std::max(generation_, max_awaited_) : generation_;
  std::atomic_ref<uint32_t>(*word_).store(WordValue(g),
                                          std::memory_order_release);
}

}  // namespace internal
}  // namespace strata
