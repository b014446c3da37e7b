#include "memtier/collectives.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace strata::memtier {

// Note [Collectives on device memory]
// The engine's collectives are on host memory where its data is: gradient
// shards, the working copy's shards at rest, agreements and the pieces a
// checkpoint moves. A communicator that takes device memory only (NCCL, or
// any with comm_memory "device") runs them through a device buffer of the
// engine's own: each round copies this rank's host data in, runs the
// collective there on the communicator's stream, and copies the result out,
// then waits, so the calls stay blocking and keep their arguments and
// order. Where the data is on the device already (a unit's device block,
// whose shard this rank has put in its slot) the engine gathers in place
// instead (AllGatherInPlace), with no host copy at all: stage 3's fetches
// and stages 1 and 2's gather after the step.
// The buffer and the stream are made on first use (an agreement may come
// before Start); the buffer is taken from the device beside the arena and
// counted in its budget by the engine.

namespace {

// The host-memory call's outcome once it completed.
Status Waited(StatusOr<CommWork> work) {
  if (!work.ok()) return work.status();
  return work->Wait();
}

// Rank r's part of a round at element `at` of every part, at most `k` each.
std::vector<size_t> RoundCounts(std::span<const size_t> counts, size_t at,
                                size_t k) {
  std::vector<size_t> c(counts.size());
  for (size_t r = 0; r < counts.size(); ++r) {
    c[r] = counts[r] > at ? std::min(k, counts[r] - at) : 0;
  }
  return c;
}

std::vector<size_t> Offsets(std::span<const size_t> counts) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) off[r + 1] = off[r] + counts[r];
  return off;
}

const std::byte* At(const void* p, size_t elems, size_t es) {
  return static_cast<const std::byte*>(p) + elems * es;
}
std::byte* At(void* p, size_t elems, size_t es) {
  return static_cast<std::byte*>(p) + elems * es;
}

}  // namespace

RankCollectives::RankCollectives(Communicator* comm, Device* device,
                                 bool on_device, uint64_t buffer_bytes)
    : comm_(comm),
      device_(device),
      on_device_(on_device),
      buffer_bytes_(buffer_bytes) {}

RankCollectives::~RankCollectives() {
  MutexLock l(&mu_);
  if (stream_) device_->SynchronizeStream(*stream_).IgnoreError();
  buffer_.Reset();
}

Status RankCollectives::Resize(uint64_t bytes) {
  if (!on_device_) return Status::Ok();
  MutexLock l(&mu_);
  buffer_bytes_ = bytes;
  return PrepareLocked();
}

StatusOr<Stream*> RankCollectives::stream() {
  MutexLock l(&mu_);
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  return stream_.get();
}

Status RankCollectives::PrepareLocked() {
  if (!stream_) {
    STRATA_ASSIGN_OR_RETURN(stream_, device_->NewStream({}));
  }
  if (buffer_.size() != buffer_bytes_) {
    buffer_.Reset();  // stream-ordered: after the calls that used it
    StatusOr<DeviceMemory> b = device_->Allocate(buffer_bytes_, *stream_);
    if (!b.ok()) {
      return b.status().WithContext(
          "engine: the device buffer of the collectives over the ranks");
    }
    buffer_ = std::move(b).value();
  }
  return Status::Ok();
}

Status RankCollectives::FinishLocked(StatusOr<CommWork> work) {
  STRATA_RETURN_IF_ERROR(Waited(std::move(work)));
  // The copies after it (a stream the collective ran on is not drained
  // after a failure: it may never run again).
  return device_->SynchronizeStream(*stream_);
}

Status RankCollectives::CopyLocked(void* dst, const void* src, size_t bytes,
                                   CopyKind kind) {
  if (bytes == 0) return Status::Ok();
  return device_->CopyAsync(*stream_, dst, src, bytes, kind);
}

Status RankCollectives::AllGather(const void* send, void* recv,
                                  std::span<const size_t> counts,
                                  CommType type) {
  if (!on_device_) return Waited(comm_->AllGather(send, recv, counts, type));
  MutexLock l(&mu_);
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  const size_t es = CommTypeSize(type);
  const size_t me = static_cast<size_t>(comm_->rank());
  const size_t k = std::max<size_t>(1, buffer_bytes_ / (counts.size() * es));
  const std::vector<size_t> whole = Offsets(counts);
  const size_t most = *std::max_element(counts.begin(), counts.end());
  for (size_t at = 0; at < most; at += k) {
    const std::vector<size_t> c = RoundCounts(counts, at, k);
    const std::vector<size_t> off = Offsets(c);
    STRATA_RETURN_IF_ERROR(CopyLocked(buffer_.at(off[me] * es),
                                      At(send, at, es), c[me] * es,
                                      CopyKind::kHostToDevice));
    StatusOr<CommWork> w = comm_->AllGather(
        buffer_.at(off[me] * es), buffer_.data(), c, type, PlaceLocked());
    for (size_t r = 0; r < c.size() && w.ok(); ++r) {
      STRATA_RETURN_IF_ERROR(CopyLocked(At(recv, whole[r] + at, es),
                                        buffer_.at(off[r] * es), c[r] * es,
                                        CopyKind::kDeviceToHost));
    }
    STRATA_RETURN_IF_ERROR(FinishLocked(std::move(w)));
  }
  return Status::Ok();
}

Status RankCollectives::ReduceScatter(const void* send, void* recv,
                                      std::span<const size_t> counts,
                                      CommType type, ReduceOp op) {
  if (!on_device_) {
    return Waited(comm_->ReduceScatter(send, recv, counts, type, op));
  }
  MutexLock l(&mu_);
  return StagedReduceScatterLocked(send, recv, counts, type, op,
                                   CopyKind::kHostToDevice);
}

Status RankCollectives::ReduceScatterFromDevice(const void* send, void* recv,
                                                std::span<const size_t> counts,
                                                CommType type, ReduceOp op) {
  MutexLock l(&mu_);
  return StagedReduceScatterLocked(send, recv, counts, type, op,
                                   CopyKind::kDeviceToDevice);
}

Status RankCollectives::StagedReduceScatterLocked(
    const void* send, void* recv, std::span<const size_t> counts, CommType type,
    ReduceOp op, CopyKind in) {
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  const size_t es = CommTypeSize(type);
  const size_t me = static_cast<size_t>(comm_->rank());
  // The round's input of every rank, then this rank's output.
  const size_t k =
      std::max<size_t>(1, buffer_bytes_ / ((counts.size() + 1) * es));
  const std::vector<size_t> whole = Offsets(counts);
  const size_t most = *std::max_element(counts.begin(), counts.end());
  for (size_t at = 0; at < most; at += k) {
    const std::vector<size_t> c = RoundCounts(counts, at, k);
    const std::vector<size_t> off = Offsets(c);
    for (size_t r = 0; r < c.size(); ++r) {
      STRATA_RETURN_IF_ERROR(CopyLocked(
          buffer_.at(off[r] * es), At(send, whole[r] + at, es), c[r] * es, in));
    }
    std::byte* out = buffer_.at(off.back() * es);
    StatusOr<CommWork> w =
        comm_->ReduceScatter(buffer_.data(), out, c, type, op, PlaceLocked());
    if (w.ok()) {
      STRATA_RETURN_IF_ERROR(CopyLocked(At(recv, at, es), out, c[me] * es,
                                        CopyKind::kDeviceToHost));
    }
    STRATA_RETURN_IF_ERROR(FinishLocked(std::move(w)));
  }
  return Status::Ok();
}

Status RankCollectives::AllReduce(const void* send, void* recv, size_t count,
                                  CommType type, ReduceOp op) {
  if (!on_device_) return Waited(comm_->AllReduce(send, recv, count, type, op));
  MutexLock l(&mu_);
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  const size_t es = CommTypeSize(type);
  const size_t k = std::max<size_t>(1, buffer_bytes_ / es);
  for (size_t at = 0; at < count; at += k) {
    const size_t n = std::min(k, count - at);
    STRATA_RETURN_IF_ERROR(CopyLocked(buffer_.data(), At(send, at, es), n * es,
                                      CopyKind::kHostToDevice));
    StatusOr<CommWork> w = comm_->AllReduce(buffer_.data(), buffer_.data(), n,
                                            type, op, PlaceLocked());
    if (w.ok()) {
      STRATA_RETURN_IF_ERROR(CopyLocked(At(recv, at, es), buffer_.data(),
                                        n * es, CopyKind::kDeviceToHost));
    }
    STRATA_RETURN_IF_ERROR(FinishLocked(std::move(w)));
  }
  return Status::Ok();
}

Status RankCollectives::Broadcast(void* buffer, size_t count, CommType type,
                                  int root) {
  if (!on_device_) return Waited(comm_->Broadcast(buffer, count, type, root));
  MutexLock l(&mu_);
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  const size_t es = CommTypeSize(type);
  const size_t k = std::max<size_t>(1, buffer_bytes_ / es);
  const bool is_root = comm_->rank() == root;
  for (size_t at = 0; at < count; at += k) {
    const size_t n = std::min(k, count - at);
    if (is_root) {
      STRATA_RETURN_IF_ERROR(CopyLocked(buffer_.data(), At(buffer, at, es),
                                        n * es, CopyKind::kHostToDevice));
    }
    StatusOr<CommWork> w =
        comm_->Broadcast(buffer_.data(), n, type, root, PlaceLocked());
    if (w.ok() && !is_root) {
      STRATA_RETURN_IF_ERROR(CopyLocked(At(buffer, at, es), buffer_.data(),
                                        n * es, CopyKind::kDeviceToHost));
    }
    STRATA_RETURN_IF_ERROR(FinishLocked(std::move(w)));
  }
  return Status::Ok();
}

Status RankCollectives::AllGatherInPlace(void* recv,
                                         std::span<const size_t> counts,
                                         CommType type) {
  MutexLock l(&mu_);
  STRATA_RETURN_IF_ERROR(PrepareLocked());
  const std::vector<size_t> off = Offsets(counts);
  const size_t me = static_cast<size_t>(comm_->rank());
  return Waited(comm_->AllGather(At(recv, off[me], CommTypeSize(type)), recv,
                                 counts, type, PlaceLocked()));
}

}  // namespace strata::memtier
