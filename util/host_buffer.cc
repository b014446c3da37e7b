#include "strata/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "util/align.h"
#include "util/host_alloc_faults.h"
#include "util/log.h"

namespace strata {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
std::atomic<uint64_t> g_pinned_bytes{0};
std::atomic<uint64_t> g_pinned_peak{0};

void AddPinned(uint64_t bytes) {
  const uint64_t now =
      g_pinned_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  uint64_t peak = g_pinned_peak.load(std::memory_order_relaxed);
  while (peak < now && !g_pinned_peak.compare_exchange_weak(
                           peak, now, std::memory_order_relaxed)) {
  }
}

// What an out-of-memory message adds: what the system has free and what
// strata holds pinned.
std::string HostMemorySummary() {
  std::string available = "unknown";
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
        available = std::to_string(kib * 1024) + " bytes";
        break;
      }
    }
    std::fclose(f);
  }
  return available + " available (MemAvailable), " +
         std::to_string(g_pinned_bytes.load(std::memory_order_relaxed)) +
         " bytes pinned by strata";
}

// util/host_alloc_faults.h. `g_fault_armed` keeps the unarmed path to one
// relaxed load.
std::atomic<bool> g_fault_armed{false};
std::atomic<uint64_t> g_fault_nth{0};
std::atomic<bool> g_fault_persistent{false};
std::atomic<uint64_t> g_fault_seen{0};
std::atomic<uint64_t> g_fault_failed{0};

bool InjectAllocationFault() {
  if (!g_fault_armed.load(std::memory_order_acquire)) return false;
  const uint64_t n = g_fault_seen.fetch_add(1) + 1;
  const uint64_t nth = g_fault_nth.load();
  const bool fail = n == nth || (n > nth && g_fault_persistent.load());
  if (fail) g_fault_failed.fetch_add(1);
  return fail;
}

}  // namespace

namespace internal {

void HostAllocFaults::Arm(uint64_t nth, bool persistent) {
  g_fault_armed.store(false, std::memory_order_release);
  g_fault_nth.store(nth);
  g_fault_persistent.store(persistent);
  g_fault_seen.store(0);
  g_fault_failed.store(0);
  g_fault_armed.store(true, std::memory_order_release);
}
void HostAllocFaults::Disarm() {
  g_fault_armed.store(false, std::memory_order_release);
}
uint64_t HostAllocFaults::seen() { return g_fault_seen.load(); }
uint64_t HostAllocFaults::failed() { return g_fault_failed.load(); }

}  // namespace internal

StatusOr<HostBuffer> HostBuffer::Allocate(size_t bytes,
                                          const HostBufferOptions& options) {
  HostBuffer buf;
  if (bytes == 0) return buf;
  const size_t mapped = RoundUp(bytes, kPage);
  void* p = InjectAllocationFault()
                ? (errno = ENOMEM, MAP_FAILED)
                : ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return Status(StatusCode::kOutOfMemory,
                  "mmap of " + std::to_string(bytes) +
                      " bytes of host memory failed: " + std::strerror(err) +
                      "; " + HostMemorySummary(),
                  err);
  }
  buf.data_ = static_cast<std::byte*>(p);
  buf.size_ = bytes;
  buf.mapped_ = mapped;
  if (options.huge_pages && mapped >= kHugePage) {
    // Advisory only: a kernel without THP simply ignores it.
    (void)::madvise(p, mapped, MADV_HUGEPAGE);
  }
  if (options.pin) {
    if (::mlock(p, mapped) == 0) {
      buf.pinned_ = true;
      AddPinned(mapped);
    } else {
      const int err = errno;
      if (options.require_pin) {
        return Status(StatusCode::kOutOfMemory,
                      "cannot page-lock " + std::to_string(mapped) +
                          " bytes of host memory (" + std::strerror(err) +
                          "); " + std::to_string(TotalPinnedBytes()) +
                          " bytes are locked already; raise `ulimit -l` "
                          "(RLIMIT_MEMLOCK)",
                      err);
      }
      STRATA_LOG_ONCE(WARN,
                      "cannot page-lock host buffers ({}); continuing with "
                      "unpinned memory, which is slower for GPU copies. "
                      "Raise the limit with `ulimit -l` (RLIMIT_MEMLOCK).",
                      std::strerror(err));
    }
  }
  if (options.prefault && !buf.pinned_) {
    // mlock already faulted the pages in.
    for (size_t off = 0; off < mapped; off += kPage) {
      buf.data_[off] = std::byte{0};
    }
  }
  return buf;
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      pinned_(std::exchange(other.pinned_, false)),
      registration_(std::move(other.registration_)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    pinned_ = std::exchange(other.pinned_, false);
    registration_ = std::move(other.registration_);
  }
  return *this;
}

HostBuffer::~HostBuffer() { Reset(); }

void HostBuffer::AttachRegistration(
    std::unique_ptr<HostRegistration> registration) {
  const bool before = counted();
  registration_ = std::move(registration);
  if (data_ == nullptr || before == counted()) return;
  if (counted()) {
    AddPinned(mapped_);
  } else {
    g_pinned_bytes.fetch_sub(mapped_, std::memory_order_relaxed);
  }
}

uint64_t HostBuffer::TotalPinnedBytes() {
  return g_pinned_bytes.load(std::memory_order_relaxed);
}

uint64_t HostBuffer::PeakPinnedBytes() {
  return g_pinned_peak.load(std::memory_order_relaxed);
}

void HostBuffer::ResetPeakPinnedBytes() {
  g_pinned_peak.store(g_pinned_bytes.load(std::memory_order_relaxed),
                      std::memory_order_relaxed);
}

void HostBuffer::Reset() noexcept {
  if (data_ != nullptr && counted()) {
    g_pinned_bytes.fetch_sub(mapped_, std::memory_order_relaxed);
  }
  registration_.reset();  // unregister before the memory goes away
  if (data_ != nullptr) {
    ::munmap(data_, mapped_);  // also unlocks
  }
  data_ = nullptr;
  size_ = 0;
  mapped_ = 0;
  pinned_ = false;
}

}  // namespace strata
