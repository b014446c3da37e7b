// StreamOrderedPool: device memory under a byte budget, with stream-ordered
// reuse, shared by every backend. A backend maps one region of `budget` bytes
// (cudaMalloc, or host memory) and hands it to the pool; placement is the
// pure BlockPlanner over offsets, and reuse is ordered with the backend's own
// events through the public Device interface, so the policy below is written
// once and tested on the host-emulated device.
//
// Note [Stream-ordered reuse]
// A block freed while work that touches it is still queued must not be handed
// out again until that work is done (STYLE rule 11; PyTorch's
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
// If an event cannot be created or recorded at the free, the free falls back
// to synchronizing the streams, and if even that fails the block is leaked
// (logged) rather than risk handing out memory still being written.
//
// Thread-safe. Lock order: mu_ before any event's internal lock; no blocking
// wait is done while mu_ is held (STYLE rule 13).
#ifndef STRATA_GPU_STREAM_ORDERED_POOL_H_
#define STRATA_GPU_STREAM_ORDERED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
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
  DeviceMemoryStats stats() const STRATA_EXCLUDES(mu_);

  // OK when [p, p + bytes) lies inside the region; else kInvalidArgument
  // naming `what` ("copy destination", ...).
  Status CheckInside(const void* p, size_t bytes, std::string_view what) const;
  // OK when [p, p + bytes) does not overlap the region (host memory).
  Status CheckOutside(const void* p, size_t bytes, std::string_view what) const;
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

  struct PendingFree {
    uint64_t offset;
    uint64_t bytes;  // reserved (rounded) size
    std::vector<std::unique_ptr<Event>> events;
  };

  // Called by DeviceMemory::Reset.
  void Free(DeviceMemory& memory) noexcept STRATA_EXCLUDES(mu_);
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
};

}  // namespace strata::internal

#endif  // STRATA_GPU_STREAM_ORDERED_POOL_H_
