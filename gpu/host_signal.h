// HostSignal: the state behind a HostEvent (strata/device.h), shared by the
// backends. A generation counter that host threads raise, with the largest
// generation any stream was told to wait for, so that Abandon can release
// every wait; optionally mirrored into a 32-bit word that a GPU polls
// (cuStreamWaitValue32, CUDA backend).
//
// Note [Host event word]
// The word holds base + generation, truncated to 32 bits, and a stream waits
// with CUDA's cyclic comparison (int32_t)(word - target) >= 0, so the
// truncation is harmless while a target is less than 2^31 above the word
// (WaitHostEvent refuses a generation further ahead). `base` is the word's
// value when the slot was handed to this event: a slot is reused without
// being reset, so a stale wait of an earlier event (released when that event
// was abandoned at its destruction) can never be re-armed by the next one.
// The word is only ever raised. A host store (release) precedes nothing the
// GPU reads through the word except the work after the wait: host data
// written before Signal is visible to copies enqueued after the wait.
//
// Thread-safe. No blocking wait under mu_ except the CondVar wait itself.
#ifndef STRATA_GPU_HOST_SIGNAL_H_
#define STRATA_GPU_HOST_SIGNAL_H_

#include <cstdint>

#include "strata/status.h"
#include "util/mutex.h"

namespace strata::internal {

class HostSignal {
 public:
  // `word`: the device-visible mirror, or null (host-emulated); not owned.
  explicit HostSignal(uint32_t* word = nullptr, uint32_t base = 0)
      : word_(word), base_(base) {}
  HostSignal(const HostSignal&) = delete;
  HostSignal& operator=(const HostSignal&) = delete;

  void Signal(uint64_t generation) STRATA_EXCLUDES(mu_);
  void Abandon() STRATA_EXCLUDES(mu_);
  uint64_t generation() const STRATA_EXCLUDES(mu_);
  bool abandoned() const STRATA_EXCLUDES(mu_);

  // Called by WaitHostEvent before it enqueues a wait for `generation`:
  // false when there is nothing to wait for (reached or abandoned);
  // kInvalidArgument when `generation` is 2^31 or more ahead. Records the
  // generation as awaited, so that a later Abandon releases it.
  StatusOr<bool> BeginWait(uint64_t generation) STRATA_EXCLUDES(mu_);
  // Blocks the calling thread until `generation` is reached or the signal is
  // abandoned (host-emulated streams' executors).
  void WaitFor(uint64_t generation) STRATA_EXCLUDES(mu_);
  // The word's value that means `generation` (Note [Host event word]).
  uint32_t WordValue(uint64_t generation) const {
    return base_ + static_cast<uint32_t>(generation);
  }

 private:
  // Stores the word's value for the current state.
  void PublishLocked() STRATA_REQUIRES(mu_);

  uint32_t* const word_;
  const uint32_t base_;
  mutable Mutex mu_;
  CondVar cv_;  // generation_ or abandoned_ changed
  uint64_t generation_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t max_awaited_ STRATA_GUARDED_BY(mu_) = 0;
  bool abandoned_ STRATA_GUARDED_BY(mu_) = false;
};

}  // namespace strata::internal

#endif  // STRATA_GPU_HOST_SIGNAL_H_
