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
// Note [Colored large buffers]. The fused CPU optimizer reads and writes
// several arrays at the same index at once (master weights and moments).
// When those arrays lie a large power of two apart, which is where mmap puts
// equal-sized mappings next to each other, the lines the update reads and
// writes back fall (as far as a VM without hardware counters can tell) in
// the same DRAM banks on different rows: on a Zen 4 VM with 2 MiB pages
// that made the AdamW step 3x slower for 64M-element arrays (0.6 against
// 1.8 G params/s on one core), while offsetting the arrays by different
// multiples of 4 KiB restored it. So a buffer of 2 MiB or more
// starts a few pages into its mapping, chosen so that bits 12-15 of its
// address (its color) take the next value of a rotating counter: any 16
// large buffers allocated one after another have distinct colors, wherever
// mmap put them. A large mapping has kColors - 1 spare pages for that, never
// touched, locked or counted.
constexpr size_t kColors = 16;
std::atomic<uint64_t> g_next_color{0};
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
  const size_t pages = RoundUp(bytes, kPage);  // what is locked and counted
  const bool large = pages >= kHugePage;
  const size_t mapped = pages + (large ? (kColors - 1) * kPage : 0);
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
  buf.base_ = static_cast<std::byte*>(p);
  buf.data_ = buf.base_;
  if (large) {  // Note [Colored large buffers]
    const uint64_t color =
        g_next_color.fetch_add(1, std::memory_order_relaxed) % kColors;
    const uint64_t page = reinterpret_cast<uintptr_t>(p) / kPage;
    buf.data_ += (color + kColors - page % kColors) % kColors * kPage;
  }
  buf.size_ = bytes;
  buf.mapped_ = mapped;
  if (options.huge_pages && mapped >= kHugePage) {
    // Advisory only: a kernel without THP simply ignores it.
    (void)::madvise(p, mapped, MADV_HUGEPAGE);
  }
  if (options.pin) {
    if (::mlock(buf.data_, pages) == 0) {
      buf.pinned_ = true;
      AddPinned(pages);
    } else {
      const int err = errno;
      if (options.require_pin) {
        return Status(StatusCode::kOutOfMemory,
                      "cannot page-lock " + std::to_string(pages) +
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
    for (size_t off = 0; off < pages; off += kPage) {
      buf.data_[off] = std::byte{0};
    }
  }
  return buf;
}

size_t HostBuffer::PageBytes() const noexcept { return RoundUp(size_, kPage); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      pinned_(std::exchange(other.pinned_, false)),
      registration_(std::move(other.registration_)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    base_ = std::exchange(other.base_, nullptr);
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
    AddPinned(PageBytes());
  } else {
    g_pinned_bytes.fetch_sub(PageBytes(), std::memory_order_relaxed);
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
    g_pinned_bytes.fetch_sub(PageBytes(), std::memory_order_relaxed);
  }
  registration_.reset();  // unregister before the memory goes away
  if (data_ != nullptr) {
    ::munmap(base_, mapped_);  // also unlocks
  }
  base_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  mapped_ = 0;
  pinned_ = false;
}

}  // namespace strata
