// Host allocation faults for tests (docs/reliability.md row 9, host OOM):
// armed, HostBuffer::Allocate counts its calls and fails the nth (once, or that
// one and every later one) exactly as a refused mmap fails, with kOutOfMemory
// and ENOMEM, before anything is mapped. The SQLite pattern: a test sweeps n
// from 1 until the operation under test succeeds, and checks at every n that
// the failure was clean. Internal; process-wide; thread-safe.
#ifndef STRATA_UTIL_HOST_ALLOC_FAULTS_H_
#define STRATA_UTIL_HOST_ALLOC_FAULTS_H_

#include <cstdint>

namespace strata::internal {

class HostAllocFaults {
 public:
  // Counting restarts at 0; the nth allocation from now (1-based) fails, and
  // with `persistent` every one after it too.
  static void Arm(uint64_t nth, bool persistent);
  static void Disarm();
  // Allocations counted since Arm, and how many of them were failed.
  static uint64_t seen();
  static uint64_t failed();
};

// Arms for one scope.
class ScopedHostAllocFaults {
 public:
  ScopedHostAllocFaults(uint64_t nth, bool persistent) {
    HostAllocFaults::Arm(nth, persistent);
  }
  ~ScopedHostAllocFaults() { HostAllocFaults::Disarm(); }
  ScopedHostAllocFaults(const ScopedHostAllocFaults&) = delete;
  ScopedHostAllocFaults& operator=(const ScopedHostAllocFaults&) = delete;
};

}  // namespace strata::internal

#endif  // STRATA_UTIL_HOST_ALLOC_FAULTS_H_
