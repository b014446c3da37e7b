// HostBuffer: an exact-size, aligned, optionally page-locked host buffer with
// one RAII owner. It is the one kind of host memory strata stages data in:
// the same buffer serves O_DIRECT NVMe I/O (it is page aligned) and, once a
// device backend attaches a registration (cudaHostRegister), DMA to the GPU.
//
// Memory comes from mmap (so it is page aligned and returned to the OS on
// free), with transparent huge pages requested for large buffers. size() is
// exactly what was asked; unlike PyTorch's host allocator nothing is rounded
// to a power of two. A buffer of 2 MiB or more starts up to 15 pages into
// its mapping, so that successive large buffers differ in address bits
// 12-15 and arrays updated together never alias in the memory's banks
// (util/host_buffer.cc, Note [Colored large buffers]).
//
// Pinning uses mlock. When it fails (RLIMIT_MEMLOCK, see `ulimit -l`), the
// buffer is kept unpinned and one warning per process says so, unless
// Options::require_pin makes that an error.
//
// Thread-compatible.
#ifndef STRATA_HOST_BUFFER_H_
#define STRATA_HOST_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "strata/export.h"
#include "strata/status.h"

namespace strata {

// Something that must be undone before the memory is unmapped, e.g. a
// cudaHostRegister done by a device backend. Destroyed first.
class HostRegistration {
 public:
  virtual ~HostRegistration() = default;
};

struct HostBufferOptions {
  // Lock the pages in RAM (mlock). Default on.
  bool pin = true;
  // If pinning fails, fail the allocation (kOutOfMemory) instead of
  // continuing unpinned. Default off.
  bool require_pin = false;
  // Ask for transparent huge pages for buffers of 2 MiB or more.
  bool huge_pages = true;
  // Touch every page at allocation so that first use does not page-fault.
  bool prefault = false;
};

class STRATA_EXPORT HostBuffer final {
 public:
  // bytes may be 0 (an empty buffer). Alignment is the page size (4096).
  static StatusOr<HostBuffer> Allocate(size_t bytes,
                                       const HostBufferOptions& options = {});

  HostBuffer() noexcept = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  ~HostBuffer();

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  // Locked by this buffer's own mlock. A buffer with a device registration
  // is page-locked by the registration too (the CUDA backend skips the mlock
  // for that reason), so "safe for DMA" is pinned() || registration().
  bool pinned() const noexcept { return pinned_; }
  std::span<std::byte> span() const noexcept { return {data_, size_}; }

  // Attaches a registration (e.g. with a GPU) owned by this buffer and
  // released before the memory is. Replaces any earlier one.
  void AttachRegistration(std::unique_ptr<HostRegistration> registration);
  HostRegistration* registration() const noexcept {
    return registration_.get();
  }

  // Bytes of all HostBuffers of the process that are page-locked now, by
  // their own mlock or by a device registration (pinned() || registration()),
  // counted in whole pages.
  static uint64_t TotalPinnedBytes();
  // The most TotalPinnedBytes() has been since the process started or since
  // the last ResetPeakPinnedBytes(), which sets it to the current bytes.
  static uint64_t PeakPinnedBytes();
  static void ResetPeakPinnedBytes();

 private:
  void Reset() noexcept;
  bool counted() const noexcept { return pinned_ || registration_ != nullptr; }
  // The pages holding [data_, data_ + size_): what is locked and counted.
  size_t PageBytes() const noexcept;

  std::byte* base_ = nullptr;  // the mapping
  std::byte* data_ = nullptr;  // base_, or a few pages in (large buffers)
  size_t size_ = 0;            // bytes asked for
  size_t mapped_ = 0;          // bytes mapped from base_
  bool pinned_ = false;
  std::unique_ptr<HostRegistration> registration_;
};

}  // namespace strata

#endif  // STRATA_HOST_BUFFER_H_
