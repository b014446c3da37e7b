// StreamOrderedPool: device memory under a byte budget, with stream-ordered
// reuse, shared by every backend. A backend maps one region of `budget` bytes
// (cudaMalloc, or host memory) and hands it to the pool; placement is the
// pure BlockPlanner over offsets, and reuse is ordered with the backend's own
// events through the public Device interface, so the policy below is written
// once and tested on the host-emulated device.
//
// Note [Stream-ordered reuse]
// A block freed while work that touches it is still queued must not be handed
// out again until that work is done (PyTorch's
// CUDACachingAllocator does the same with recordStream/insert_events). At the
// free, one event is recorded on every stream that used the block (the
// allocation stream and each DeviceMemory::RecordUse stream) and the block
// waits in `pending_` until all of them complete. Unlike PyTorch we do not
// hand the block back early to the allocation stream: callers may use the
// next block on any stream, so every reuse waits.
// Allocate first moves completed pending blocks to the planner (queries, no
// waiting). When the request still does not fit and blocks are pending, it
// waits, outside the lock, for the oldest pending free, and tries again; only
// when nothing is pending is the answer kOutOfMemory.
// TryAllocate is the same without the wait: kBusy when pending frees could
// make room, kOutOfMemory when even they could not.
// If an event cannot be created or recorded at the free, the free falls back
// to synchronizing the streams, and if even that fails the block is leaked
// (logged) rather than risk handing out memory still being written.
//
// The pool also keeps the registered external ranges (ExternalDeviceMemory):
// device memory outside the region that the argument checks accept as device
// memory, under the same overlap, wrap-around and alignment checks.
//
// Thread-safe. Lock order: mu_ before any event's internal lock; no blocking
// wait is done while mu_ is held. external_mu_ is a leaf.
#ifndef STRATA_GPU_STREAM_ORDERED_POOL_H_
#define STRATA_GPU_STREAM_ORDERED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/block_planner.h"
#include "strata/device.h"
#include "util/mutex.h"

namespace strata::internal {

class StreamOrderedPool {
 public:
  // `device` makes and waits for the events; `base` is the region's first
  // byte (a device address), `budget` its size. `device_name` goes into
  // error messages. None is owned.
  StreamOrderedPool(Device* device, std::byte* base, uint64_t budget,
                    std::string device_name);
  // Waits for pending frees. REQUIRES: no DeviceMemory of this pool is alive.
  ~StreamOrderedPool();
  StreamOrderedPool(const StreamOrderedPool&) = delete;
  StreamOrderedPool& operator=(const StreamOrderedPool&) = delete;

  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream)
      STRATA_EXCLUDES(mu_);
  // Allocate without waiting for pending frees (Device::TryAllocate).
  StatusOr<DeviceMemory> TryAllocate(size_t bytes, Stream& stream)
      STRATA_EXCLUDES(mu_);
  DeviceMemoryStats stats() const STRATA_EXCLUDES(mu_, external_mu_);

  // Registers an external range after the backend checked that it is device
  // memory (Device::RegisterExternalMemory's common checks).
  StatusOr<ExternalDeviceMemory> RegisterExternal(void* data, size_t bytes)
      STRATA_EXCLUDES(external_mu_);

  // OK when [p, p + bytes) lies inside the region or inside one registered
  // external range; else kInvalidArgument naming `what` ("copy
  // destination", ...).
  Status CheckInside(const void* p, size_t bytes, std::string_view what) const
      STRATA_EXCLUDES(external_mu_);
  // OK when [p, p + bytes) overlaps neither the region nor an external
  // range (host memory).
  Status CheckOutside(const void* p, size_t bytes, std::string_view what) const
      STRATA_EXCLUDES(external_mu_);
  // Checks both ends of a copy of `kind`: device ends inside the region,
  // host ends outside it.
  // Device-to-device ranges must not overlap (cudaMemcpyAsync leaves that
  // undefined, so the host-emulated device refuses it too).
  Status CheckCopy(const void* dst, const void* src, size_t bytes,
                   CopyKind kind) const;
  // A conversion's operands: both arrays inside the region and aligned to
  // their element size (a misaligned access is a sticky error that ends a
  // CUDA context), a byte size that does not overflow, and no overlap unless
  // in place with types of one size.
  Status CheckConvert(const ConvertArgs& args) const;
  // A GEMM's operands: CheckGemmArgs, then A, B and C inside the region and
  // aligned to their element size.
  Status CheckGemm(const GemmArgs& args) const;

 private:
  friend class strata::DeviceMemory;
  friend class strata::ExternalDeviceMemory;

  struct PendingFree {
    uint64_t offset;
    uint64_t bytes;  // reserved (rounded) size
    std::vector<std::unique_ptr<Event>> events;
  };

  StatusOr<DeviceMemory> AllocateImpl(size_t bytes, Stream& stream, bool wait)
      STRATA_EXCLUDES(mu_);
  // Called by DeviceMemory::Reset.
  void Free(DeviceMemory& memory) noexcept STRATA_EXCLUDES(mu_);
  // Called by ExternalDeviceMemory::Reset.
  void Unregister(const void* data) noexcept STRATA_EXCLUDES(external_mu_);
  // True when [a, a + n) overlaps a registered range. REQUIRES: no wrap.
  bool OverlapsExternalLocked(uintptr_t a, size_t n) const
      STRATA_REQUIRES(external_mu_);
  // Moves pending frees whose events completed to the planner.
  void ReclaimLocked() STRATA_REQUIRES(mu_);
  std::string OutOfMemoryMessage(size_t bytes) const STRATA_REQUIRES(mu_);

  Device* const device_;
  std::byte* const base_;
  const uint64_t budget_;
  const std::string device_name_;

  mutable Mutex mu_;
  BlockPlanner planner_ STRATA_GUARDED_BY(mu_);
  // Oldest first. shared_ptr: an allocating thread waits on an entry's
  // events outside mu_ while another may reclaim it.
  std::deque<std::shared_ptr<PendingFree>> pending_ STRATA_GUARDED_BY(mu_);
  DeviceMemoryStats stats_ STRATA_GUARDED_BY(mu_);

  mutable Mutex external_mu_;
  // Registered external ranges, start -> end; disjoint.
  std::map<uintptr_t, uintptr_t> external_ STRATA_GUARDED_BY(external_mu_);
};

}  // namespace strata::internal

#endif  // STRATA_GPU_STREAM_ORDERED_POOL_H_
