// SwapSpace: the NVMe tier's storage. One preallocated swap file per
// directory, blocks striped over the directories, extents allocated here
// (not by the filesystem), and every block checksummed.
//
// On disk each file is a header region (one header_bytes() header per slot)
// followed by the payload region (one block_bytes slot per slot, aligned), so
// payloads move straight between the disk and the caller's buffer. The header
// names the tensor, the block's index in it, the generation of the write, the
// slot and the payload length, and carries an XXH3-64 checksum over itself
// and the payload. Every read verifies all of it once both the header and the
// payload have arrived, so a bit flip, a zeroed sector, a truncated file, a
// block written to the wrong place or a stale generation is reported as
// kCorruption with the file and offset.
//
// Asynchronous I/O (ReadAsync, WriteAsync) moves blocks between a handle and
// a caller-owned buffer with no copy; the synchronous Read and Write are
// wrappers that stage through a fixed pool of queue_depth bounce blocks.
// After a failed read, the caller's buffer holds unspecified bytes and must
// not be used (the synchronous Read copies nothing of a failed range).
//
// Failures on write leave the caller's data authoritative: the blocks written
// are not valid (a read of them fails) and the handle still owns its slots. A
// slot whose write fails with EIO is retired and the block rewritten to
// another slot, up to max_relocations times; kNoSpace is returned at once,
// never retried in a loop.
//
// A directory is used by one SwapSpace at a time: flock on
// <dir>/strata-swap.lock; a second user gets kBusy naming the holder's pid.
// The lock is taken only on a file that is still the one at that path
// (checked after flock), and is removed only while held, so two jobs never
// both own a directory. Files are mode 0600; the swap files are removed by
// the destructor, and stale ones left by a crashed process are removed by the
// next Open.
//
// I/O goes through an AsyncIo (one ring and its completion thread): the
// space's own, or one shared with other users (SwapSpaceOptions::io).
//
// Thread contract: thread-safe. Callbacks run on the AsyncIo's completion
// thread (see async_io.h: they must return quickly and may submit more I/O);
// the synchronous calls must not be made from there. A SwapHandle is
// thread-compatible and must not be used while a write to it is in flight.
// The destructor waits for the space's I/O in flight and must not run on the
// completion thread.
#ifndef STRATA_SWAP_SPACE_H_
#define STRATA_SWAP_SPACE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/async_io.h"
#include "strata/export.h"
#include "strata/io_engine.h"
#include "strata/status.h"

namespace strata {

namespace swap {
class SlotPool;
class SwapSpaceImpl;
}  // namespace swap

struct SwapSpaceOptions {
  // Directories, one swap file each; blocks are striped over them in turn.
  std::vector<std::string> dirs;
  // Payload bytes the space must hold; rounded up to whole blocks.
  uint64_t capacity_bytes = 0;
  // Payload bytes per block: the unit of allocation and of I/O. A multiple
  // of 4096. Default 1 MiB.
  uint32_t block_bytes = 1u << 20;
  // Blocks per synchronous Read or Write step (the bounce blocks), and the
  // queue depth of the space's own AsyncIo.
  uint32_t queue_depth = 8;
  // Rewrites of a block to a fresh slot after the device fails a write.
  uint32_t max_relocations = 2;
  // Lock the bounce and header buffers in RAM (unpinned, with a warning, if
  // refused).
  bool pin_buffers = true;
  // Allocate the bounce blocks of the synchronous Read and Write
  // (queue_depth x block_bytes). Off, only the asynchronous calls work and
  // Read and Write fail with kFailedPrecondition: a user that moves every
  // byte through buffers of its own saves that pinned memory. Default on.
  bool synchronous_io = true;
  // The space's own I/O engine (backend, O_DIRECT); queue_depth above
  // overrides its own. Ignored when `shared_io` is set.
  IoEngineOptions io;
  // An AsyncIo shared with other users (the tier manager's), kept alive by
  // the space. Default: the space creates its own.
  std::shared_ptr<AsyncIo> shared_io;
};

// Where one tensor rests: the slots of its blocks, owned. Move-only; the
// destructor (or Reset) returns the slots to the space's free list. A handle
// may outlive its space (it holds the free list by a shared reference).
// Thread-compatible; not to be touched while a write to it is in flight.
class STRATA_EXPORT SwapHandle {
 public:
  SwapHandle() = default;
  SwapHandle(SwapHandle&& other) noexcept;
  SwapHandle& operator=(SwapHandle&& other) noexcept;
  SwapHandle(const SwapHandle&) = delete;
  SwapHandle& operator=(const SwapHandle&) = delete;
  ~SwapHandle();

  uint64_t tensor_id() const { return tensor_id_; }
  uint64_t bytes() const { return bytes_; }
  size_t blocks() const { return blocks_.size(); }
  // The slot of block `block` (SwapSpace::kNoSlot after a failed write
  // retired it; the next write of the block takes a fresh one).
  uint32_t slot(size_t block) const { return blocks_[block].slot; }
  // False for a default-constructed or moved-from handle.
  bool valid() const { return pool_ != nullptr; }
  // Frees the slots now.
  void Reset();

 private:
  friend class swap::SwapSpaceImpl;
  struct Block {
    uint32_t slot;
    uint64_t generation;  // of the last write submitted
  };
  std::shared_ptr<swap::SlotPool> pool_;
  uint64_t tensor_id_ = 0;
  uint64_t bytes_ = 0;
  std::vector<Block> blocks_;
};

struct SwapStats {
  uint64_t blocks_written = 0;
  uint64_t blocks_read = 0;
  uint64_t bytes_written = 0;  // payload
  uint64_t bytes_read = 0;     // payload
  uint64_t relocations = 0;    // blocks rewritten after a write error
  uint64_t retired_slots = 0;  // slots taken out of use
  uint64_t checksum_failures = 0;
};

// Runs once per accepted asynchronous operation, on the completion thread.
using SwapCallback = std::function<void(Status)>;

class STRATA_EXPORT SwapSpace {
 public:
  static constexpr uint32_t kNoSlot = UINT32_MAX;

  static StatusOr<std::unique_ptr<SwapSpace>> Open(
      const SwapSpaceOptions& options);

  virtual ~SwapSpace() = default;
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // ---- Asynchronous, zero-copy --------------------------------------------
  // Takes slots for `bytes` of tensor `tensor_id` (nothing written yet; a
  // read before a write fails verification). kNoSpace names what was asked
  // and what is free.
  virtual StatusOr<SwapHandle> Allocate(uint64_t tensor_id, uint64_t bytes) = 0;

  // Buffers for blocks [first_block, first_block + count) of a handle: block
  // first_block + i is at buffer offset i * block_bytes(). The buffer's
  // address must be a multiple of buffer_alignment() and its size at least
  // BufferBytes() (the payload, its tail rounded up to the alignment; the
  // bytes past the payload are scratch). Anything else is refused with
  // kInvalidArgument naming the requirement, before any I/O.
  virtual size_t buffer_alignment() const = 0;
  virtual uint64_t BufferBytes(const SwapHandle& h, uint64_t first_block,
                               uint64_t count) const = 0;

  // Writes the blocks from `src` as a new generation (the checksums are
  // computed on the calling thread). `h` must stay alive and untouched until
  // `done` runs; a block whose slot the device fails moves to another slot
  // (the handle is updated). On failure the range is not valid; `src` is
  // never written to. Returns an error, and never runs `done`, if the request
  // is refused before any I/O.
  virtual Status WriteAsync(SwapHandle& h, uint64_t first_block, uint64_t count,
                            std::span<const std::byte> src, IoPriority priority,
                            SwapCallback done) = 0;
  // Reads the blocks into `dst` and verifies every header and checksum.
  // `done` gets OK only if all of them verified; otherwise kCorruption (or
  // the I/O error) naming the tensor, block, file and offset, and `dst` holds
  // unspecified bytes that must not be used. `h` must stay alive until
  // `done` runs. Same refusal rule as WriteAsync.
  virtual Status ReadAsync(const SwapHandle& h, uint64_t first_block,
                           uint64_t count, std::span<std::byte> dst,
                           IoPriority priority, SwapCallback done) = 0;

  // ---- Synchronous, through the bounce blocks -----------------------------
  // Writes `data` as a new tensor. On failure no handle is returned and its
  // slots are free again (or retired, if the device failed them).
  StatusOr<SwapHandle> Write(uint64_t tensor_id,
                             std::span<const std::byte> data);
  // Reads a handle's bytes into `out` (REQUIRES: out.size() == h.bytes()).
  // On failure nothing of the failed step's blocks was copied; `out` must not
  // be used.
  Status Read(const SwapHandle& h, std::span<std::byte> out);
  // Returns the handle's slots to the free list (as dropping it does).
  void Free(SwapHandle&& h) { h.Reset(); }

  virtual uint64_t capacity_blocks() const = 0;
  virtual uint64_t free_blocks() const = 0;
  virtual uint32_t block_bytes() const = 0;
  // The swap files, in stripe order.
  virtual const std::vector<std::string>& files() const = 0;
  // Byte offset of a slot's payload and of its header within its file, and
  // that file's index.
  virtual uint64_t SlotOffset(uint32_t slot) const = 0;
  virtual uint64_t HeaderOffset(uint32_t slot) const = 0;
  virtual size_t SlotFile(uint32_t slot) const = 0;
  virtual uint32_t header_bytes() const = 0;
  virtual std::string_view engine_name() const = 0;
  virtual SwapStats stats() const = 0;
  // The AsyncIo the space submits to.
  virtual AsyncIo& io() const = 0;

 protected:
  SwapSpace() = default;
  // One step of the synchronous wrappers: `bounce` blocks staged.
  virtual StatusOr<std::span<std::byte>> AcquireBounce() = 0;
  virtual void ReleaseBounce() = 0;
};

}  // namespace strata

#endif  // STRATA_SWAP_SPACE_H_
