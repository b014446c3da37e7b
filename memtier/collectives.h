// The engine's collectives over its data-parallel communicator, on host
// buffers or staged through device memory (Note [Collectives on device
// memory] in collectives.cc).
#ifndef STRATA_MEMTIER_COLLECTIVES_H_
#define STRATA_MEMTIER_COLLECTIVES_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/status.h"
#include "util/mutex.h"

namespace strata::memtier {

// Blocking collectives on host buffers over one communicator, with the
// arguments and meaning of Communicator's. Directly when `on_device` is
// false (the communicator takes host memory); otherwise each call copies
// its host data to a device buffer of its own, runs the collective there,
// stream-ordered, and copies the result back, in rounds of at most
// `buffer_bytes`. Every device-memory call of the communicator goes on
// stream() (one stream per communicator, as ranks must order them alike).
// Thread-safe (calls are serialized; their order across ranks is the
// caller's to keep).
class RankCollectives {
 public:
  // The device buffer holds buffer_bytes (made on first use), rounds of
  // several ranks' elements at least one element of each.
  // REQUIRES: comm outlives this.
  RankCollectives(Communicator* comm, Device* device, bool on_device,
                  uint64_t buffer_bytes);
  ~RankCollectives();
  RankCollectives(const RankCollectives&) = delete;
  RankCollectives& operator=(const RankCollectives&) = delete;

  Communicator& comm() const { return *comm_; }
  // Makes the device buffer (on_device) `bytes` large, now.
  Status Resize(uint64_t bytes);
  bool on_device() const { return on_device_; }
  // The stream of the communicator's device-memory calls (made on first
  // use). REQUIRES: on_device().
  StatusOr<Stream*> stream();

  Status AllGather(const void* send, void* recv, std::span<const size_t> counts,
                   CommType type);
  Status ReduceScatter(const void* send, void* recv,
                       std::span<const size_t> counts, CommType type,
                       ReduceOp op);
  // ReduceScatter whose `send` is device memory, written by work on
  // stream() (or waited for by it); `recv` is host memory.
  // REQUIRES: on_device().
  Status ReduceScatterFromDevice(const void* send, void* recv,
                                 std::span<const size_t> counts, CommType type,
                                 ReduceOp op);
  Status AllReduce(const void* send, void* recv, size_t count, CommType type,
                   ReduceOp op);
  Status Broadcast(void* buffer, size_t count, CommType type, int root);

  // Device memory `recv` holds this rank's counts[rank] elements at its
  // offset (put there by work on stream() or waited for by it); gathers
  // every other rank's part around it, in place, and returns once the
  // stream has run it. REQUIRES: on_device().
  Status AllGatherInPlace(void* recv, std::span<const size_t> counts,
                          CommType type);

 private:
  Status PrepareLocked() STRATA_REQUIRES(mu_);
  // The staged reduce-scatter; `in` says where `send` is.
  Status StagedReduceScatterLocked(const void* send, void* recv,
                                   std::span<const size_t> counts,
                                   CommType type, ReduceOp op, CopyKind in)
      STRATA_REQUIRES(mu_);
  // Waits for `work`, then for the copies queued after it.
  Status FinishLocked(StatusOr<CommWork> work) STRATA_REQUIRES(mu_);
  Status CopyLocked(void* dst, const void* src, size_t bytes, CopyKind kind)
      STRATA_REQUIRES(mu_);
  CommPlace PlaceLocked() STRATA_REQUIRES(mu_) {
    return CommPlace{device_, stream_.get()};
  }

  Communicator* const comm_;
  Device* const device_;
  const bool on_device_;
  Mutex mu_;
  uint64_t buffer_bytes_ STRATA_GUARDED_BY(mu_);
  std::unique_ptr<Stream> stream_ STRATA_GUARDED_BY(mu_);
  DeviceMemory buffer_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_COLLECTIVES_H_
