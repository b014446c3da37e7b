// SwapSpace: the NVMe tier's storage. One preallocated swap file per
// directory, blocks striped over the directories, extents allocated here
// (not by the filesystem), and every block checksummed.
//
// On disk each block is a slot of header_bytes + block_bytes. The header names
// the tensor, the block's index in it, the generation of the write, the slot
// and the payload length, and carries an XXH3-64 checksum over itself and the
// payload. Every read verifies all of it, so a bit flip, a zeroed sector, a
// truncated file, a block written to the wrong place or a stale generation is
// reported as kCorruption with the file and offset, and its bytes are never
// copied to the caller.
//
// Failures on write leave the caller's data authoritative: a Write that fails
// returns no handle and every slot it took is free again (or retired, if the
// device failed it). A slot whose write fails with EIO is retired and the block
// rewritten to another slot, up to max_relocations times; kNoSpace is
// returned at once, never retried in a loop.
//
// A directory is used by one SwapSpace at a time: flock on
// <dir>/strata-swap.lock; a second user gets kBusy naming the holder's pid.
// Files are mode 0600; the swap files are removed by the destructor, and
// stale ones left by a crashed process are removed by the next Open.
//
// All staging goes through a fixed pool of queue_depth page-aligned, pinned
// bounce buffers: memory use does not grow with tensor size.
//
// Thread contract: thread-compatible (external synchronization).
#ifndef STRATA_SWAP_SPACE_H_
#define STRATA_SWAP_SPACE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/export.h"
#include "strata/io_engine.h"
#include "strata/status.h"

namespace strata {

struct SwapSpaceOptions {
  // Directories, one swap file each; blocks are striped over them in turn.
  std::vector<std::string> dirs;
  // Payload bytes the space must hold; rounded up to whole blocks.
  uint64_t capacity_bytes = 0;
  // Payload bytes per block: the unit of allocation and of I/O. A multiple
  // of 4096. Default 1 MiB.
  uint32_t block_bytes = 1u << 20;
  // Blocks in flight per Read or Write (and the number of bounce buffers).
  uint32_t queue_depth = 8;
  // Rewrites of a block to a fresh slot after the device fails a write.
  uint32_t max_relocations = 2;
  // Lock the bounce buffers in RAM (unpinned, with a warning, if refused).
  bool pin_buffers = true;
  // The I/O engine (backend, O_DIRECT); queue_depth above overrides its own.
  IoEngineOptions io;
};

// Where one write of a tensor rests. A value; owns nothing until freed with
// SwapSpace::Free (a handle that is dropped leaks its slots until the space
// is destroyed).
struct SwapHandle {
  uint64_t tensor_id = 0;
  uint64_t generation = 0;
  uint64_t bytes = 0;
  std::vector<uint32_t> slots;  // one per block, in order
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

class STRATA_EXPORT SwapSpace {
 public:
  static StatusOr<std::unique_ptr<SwapSpace>> Open(
      const SwapSpaceOptions& options);

  virtual ~SwapSpace() = default;
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Writes `data` as a new generation of tensor `tensor_id`.
  virtual StatusOr<SwapHandle> Write(uint64_t tensor_id,
                                     std::span<const std::byte> data) = 0;
  // Reads a handle's bytes into `out` (REQUIRES: out.size() == h.bytes).
  // On failure, bytes of blocks that did not verify were not copied; `out`
  // must not be used.
  virtual Status Read(const SwapHandle& h, std::span<std::byte> out) = 0;
  // Returns the handle's slots to the free list.
  virtual void Free(SwapHandle&& h) = 0;

  virtual uint64_t capacity_blocks() const = 0;
  virtual uint64_t free_blocks() const = 0;
  virtual uint32_t block_bytes() const = 0;
  // The swap files, in stripe order.
  virtual const std::vector<std::string>& files() const = 0;
  // Byte offset of a slot within its file, and that file's index.
  virtual uint64_t SlotOffset(uint32_t slot) const = 0;
  virtual size_t SlotFile(uint32_t slot) const = 0;
  virtual uint32_t header_bytes() const = 0;
  virtual std::string_view engine_name() const = 0;
  virtual SwapStats stats() const = 0;

 protected:
  SwapSpace() = default;
};

}  // namespace strata

#endif  // STRATA_SWAP_SPACE_H_
