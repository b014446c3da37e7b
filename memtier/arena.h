// The device tier's arena: one allocation of the device budget, carved by the
// engine itself, with defragmentation (ZeRO-R's memory defragmentation) when
// fragmentation refuses a request that fits in total. Internal to memtier.
//
// Two layers, as ggml-alloc splits planning from memory:
//   - ArenaPlanner: offsets only (no memory, no device), so placement and
//     compaction are unit-tested on their own.
//   - DeviceArena: one DeviceMemory of the capacity, the planner under a lock,
//     stream-ordered reuse of freed ranges, and compaction executed as
//     device-to-device copies on the caller's stream.
//
// Note [Compaction plans]
// Pinned blocks never move, so they split the arena into segments; sliding
// the movable blocks of a segment toward its start merges that segment's free
// ranges. PlanCompaction looks, in every segment, for the run of consecutive
// free ranges f_i..f_j whose total holds the request and between which the
// fewest bytes of blocks lie (two pointers over the free ranges), and slides
// exactly those blocks down: the blocks between f_i and f_{i+1} move down by
// |f_i|, those between f_{i+1} and f_{i+2} by |f_i| + |f_{i+1}|, and so on,
// leaving one free range of the run's total ending where f_j ended. Among
// plans that merge neighbouring free ranges by sliding, this one moves the
// fewest bytes. A block that slides by s < its size is copied in chunks of at
// most s bytes, front to back, so no copy's source and destination overlap
// (the device refuses overlapping device-to-device copies) and no chunk
// overwrites a source that a later copy still reads; blocks are moved in
// ascending offset order for the same reason. A small slide of a large block
// thus costs many copies: ceil(size / s).
#ifndef STRATA_MEMTIER_ARENA_H_
#define STRATA_MEMTIER_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/block_planner.h"
#include "strata/device.h"
#include "strata/status.h"
#include "util/mutex.h"

namespace strata::memtier {

// Counters of an ArenaPlanner. Bytes are SUM gauges of the current state
// unless marked COUNT (over the planner's lifetime).
struct ArenaPlannerStats {
  uint64_t capacity_bytes = 0;      // usable bytes (capacity rounded down)
  uint64_t used_bytes = 0;          // held by blocks (rounded sizes)
  uint64_t free_bytes = 0;          // capacity_bytes - used_bytes
  uint64_t largest_free_bytes = 0;  // the largest free range; bounds Allocate
  uint64_t free_ranges = 0;         // COUNT of free ranges (never adjacent)
  // 1 - largest_free_bytes / free_bytes, in [0, 1): 0 when all free space is
  // one range (or none is free).
  double fragmentation = 0;
  uint64_t allocations = 0;  // COUNT of successful Allocate calls
  uint64_t frees = 0;        // COUNT of Free calls
  // COUNT of Allocate calls refused (the arena may then compact or wait for
  // pending frees and succeed on retry).
  uint64_t failures = 0;
  uint64_t compactions = 0;             // COUNT of applied non-empty plans
  uint64_t compaction_bytes_moved = 0;  // SUM of bytes of moved blocks
  uint64_t compaction_copies = 0;       // COUNT of copies of applied plans
  double fragmentation_before_last_compaction = 0;  // see fragmentation
  double fragmentation_after_last_compaction = 0;   // see fragmentation
};

// One block's relocation in a compaction plan.
struct CompactionMove {
  uint64_t tag = 0;         // the block's owner tag
  uint64_t old_offset = 0;  // bytes from the arena's start
  uint64_t new_offset = 0;  // < old_offset (blocks slide down)
  uint64_t bytes = 0;       // the block's rounded size
};

// One device-to-device copy. Its source and destination ranges never
// overlap.
struct CompactionCopy {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

struct CompactionPlan {
  std::vector<CompactionMove> moves;  // ascending old_offset
  // Executed one after another in this order, they relocate every moved
  // block with its bytes intact (Note [Compaction plans]).
  std::vector<CompactionCopy> copies;
  uint64_t bytes_moved = 0;  // SUM of moves[i].bytes
  // After the plan, [free_offset, free_offset + free_bytes) is one free
  // range holding the request.
  uint64_t free_offset = 0;
  uint64_t free_bytes = 0;
};

// Best-fit placement with owner tags, pinning and compaction planning over
// offsets [0, capacity). Sizes are rounded up to the alignment; every offset
// is a multiple of it. A request takes the smallest free range that holds it
// (ties: the lowest offset), from that range's start; a free coalesces with
// both neighbours. Placement is gpu/'s BlockPlanner, so the device pool and
// the arena share one policy.
//
// Thread-compatible.
class ArenaPlanner {
 public:
  static constexpr uint64_t kDefaultAlignment = 256;

  struct Block {
    uint64_t offset = 0;
    uint64_t bytes = 0;  // rounded size
    uint64_t tag = 0;    // the owner's tag, opaque here (need not be unique)
    bool movable = true;
  };

  // `alignment`: a multiple of 256 (default 256, what cudaMalloc gives);
  // the usable capacity is `capacity` rounded down to it. kInvalidArgument
  // for another alignment.
  static StatusOr<ArenaPlanner> Create(uint64_t capacity,
                                       uint64_t alignment = kDefaultAlignment);

  uint64_t alignment() const { return alignment_; }
  uint64_t capacity() const { return capacity_; }
  // `bytes` rounded up to the alignment; 0 when that overflows.
  uint64_t Round(uint64_t bytes) const;

  // The offset of a new block of Round(bytes). kOutOfMemory when no free
  // range holds it; the message says what was asked, the free total, the
  // largest free range and the capacity. kInvalidArgument for 0 bytes.
  StatusOr<uint64_t> Allocate(uint64_t bytes, uint64_t tag, bool movable);
  // Frees the block at `offset`; kNotFound when no block starts there.
  Status Free(uint64_t offset);
  // kNotFound when no block starts at `offset`.
  Status SetMovable(uint64_t offset, bool movable);
  // The block at `offset`, or null.
  const Block* Find(uint64_t offset) const;

  std::vector<Block> blocks() const;  // ascending offset
  // (offset, bytes) of each free range, ascending offset.
  std::vector<std::pair<uint64_t, uint64_t>> free_ranges() const;
  ArenaPlannerStats stats() const;

  // A plan after which one free range holds Round(bytes); an empty plan when
  // one already does. Moves only movable blocks (Note [Compaction plans]).
  // kOutOfMemory when no plan can: the free total is too small, or pinned
  // blocks split the free space; the message says which, with the largest
  // range that moving every movable block could make.
  StatusOr<CompactionPlan> PlanCompaction(uint64_t bytes) const;
  // Moves the blocks as `plan` says (the caller executes its copies).
  // kFailedPrecondition, changing nothing, when the plan does not fit the
  // current blocks (made before another change, or for another planner).
  Status ApplyCompaction(const CompactionPlan& plan);

 private:
  ArenaPlanner(uint64_t capacity, uint64_t alignment);
  std::string OutOfMemoryMessage(uint64_t asked) const;

  uint64_t alignment_;
  uint64_t capacity_;
  internal::BlockPlanner free_;       // the free ranges
  std::map<uint64_t, Block> blocks_;  // offset -> block
  ArenaPlannerStats counters_;        // the COUNT fields
};

class DeviceArena;

// A pin: while it lives, its block does not move and data() is its address.
// Move-only; dropping it unpins. Drop it before its block (a pin that
// outlives its block is inert and its data() dangles). Thread-compatible.
class ArenaPin {
 public:
  ArenaPin() = default;
  ArenaPin(ArenaPin&& other) noexcept;
  ArenaPin& operator=(ArenaPin&& other) noexcept;
  ArenaPin(const ArenaPin&) = delete;
  ArenaPin& operator=(const ArenaPin&) = delete;
  ~ArenaPin() { Reset(); }

  void* data() const { return data_; }
  bool empty() const { return arena_ == nullptr; }
  void Reset() noexcept;

 private:
  friend class DeviceArena;
  DeviceArena* arena_ = nullptr;
  uint64_t id_ = 0;
  void* data_ = nullptr;
};

// A block of the arena; move-only; destruction frees it in stream order. Its
// address may change while it is unpinned and movable: read it through a pin
// (ArenaBlock::Pin). Thread-compatible; must be destroyed before its arena.
//
//   STRATA_ASSIGN_OR_RETURN(ArenaBlock b, arena.Allocate(bytes, copy_stream));
//   {
//     STRATA_ASSIGN_OR_RETURN(ArenaPin pin, b.Pin(copy_stream));
//     STRATA_RETURN_IF_ERROR(device.CopyAsync(copy_stream, pin.data(), host,
//                                             bytes, CopyKind::kHostToDevice));
//   }  // unpinned once enqueued: a compaction waits for the copy
//   ...  // later, on any stream: Pin again and use the new pin.data()
class ArenaBlock {
 public:
  ArenaBlock() = default;
  ArenaBlock(ArenaBlock&& other) noexcept;
  ArenaBlock& operator=(ArenaBlock&& other) noexcept;
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;
  ~ArenaBlock() { Reset(); }

  bool empty() const { return arena_ == nullptr; }
  size_t size() const { return size_; }  // bytes asked for
  // The current offset and address: stable only while pinned or unmovable.
  uint64_t offset() const;
  void* data() const;

  // Pins the block for work on `stream`: it will not move until the pin is
  // dropped, `stream` is recorded as a user (a free or a later compaction
  // waits for its work enqueued until then), and `stream` is made to wait
  // (without blocking the host) for the compaction that last moved the block
  // or reused its range. Every stream that touches the block must pin it
  // first; the stream must outlive the block. Pins nest.
  StatusOr<ArenaPin> Pin(Stream& stream) const;
  // Whether compaction may move the block when it is unpinned.
  Status SetMovable(bool movable) const;

  // Frees the block (stream-ordered, as DeviceArena says). Becomes empty.
  void Reset() noexcept;

 private:
  friend class DeviceArena;
  DeviceArena* arena_ = nullptr;
  uint64_t id_ = 0;
  size_t size_ = 0;
};

// Counters of a DeviceArena: the planner's (where `used_bytes` includes
// pending frees), and the arena's own.
struct DeviceArenaStats {
  ArenaPlannerStats planner;
  uint64_t pending_free_bytes = 0;  // freed, waiting for their streams
  uint64_t live_blocks = 0;         // COUNT of blocks not yet freed
  uint64_t pinned_blocks = 0;       // COUNT of live blocks with a pin
  uint64_t out_of_memory = 0;       // COUNT of kOutOfMemory answers
  uint64_t reuse_waits = 0;         // COUNT of host waits on pending frees
};

struct DeviceArenaOptions {
  // Bytes of device memory the arena takes at creation (one allocation).
  // Required (> 0).
  uint64_t capacity_bytes = 0;
  // Every block's offset and size are multiples of this; a multiple of 256.
  // Default 256. Addresses are the region's (256-aligned) base plus offsets.
  uint64_t alignment = ArenaPlanner::kDefaultAlignment;
  // Names the arena in messages. Default "device arena".
  std::string name = "device arena";
  // Events made at creation for frees and compactions to take (Note [The
  // arena's events]); one more is made only when every one is in use.
  // Default 0: all are made as needed.
  uint64_t reserve_events = 0;
};

// Device memory for the device tier, compacted on demand.
//
// Stream order: each block remembers the streams that used
// it (its allocation stream and every stream that pinned it).
//   - Free: an event is recorded on each; the range is reused only after all
//     complete (as gpu/'s pool does, Note [Stream-ordered reuse]). Until
//     then it is a pinned block to the planner.
//   - Compaction, when Allocate is refused by fragmentation but the free
//     total holds the request: the allocation stream waits for events
//     recorded on the moved blocks' users and for the previous compaction,
//     then carries the copies, then records this compaction's event. Moved
//     blocks, and blocks handed out while a compaction is unfinished, carry
//     that event; Pin makes the pinning stream wait for it. Nothing blocks
//     the host. Compaction is preferred to waiting for pending frees.
//   - When neither fits, Allocate waits on the host (without the lock) for
//     the oldest pending free and retries; kOutOfMemory when nothing is
//     pending.
//
// Thread-safe. The lock is held while a compaction's copies, event records
// and waits are enqueued (and while Pin enqueues its wait): every other call
// would have to wait for the new offsets anyway, and those device calls only
// enqueue (no device synchronization happens under the lock). Lifetimes: the
// arena outlives its blocks; the creation stream and every stream a block used
// outlive the arena.
class DeviceArena {
 public:
  // Takes options.capacity_bytes from `device` with `stream` as the first
  // user. `device` must outlive the arena.
  static StatusOr<std::unique_ptr<DeviceArena>> Create(
      Device* device, Stream& stream, const DeviceArenaOptions& options);
  // Waits for pending frees and the last compaction. Logs blocks still
  // alive (they then dangle).
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A block of `bytes` (> 0) whose first user is `stream`; compaction, when
  // needed, runs on `stream`. An unmovable block never moves. kOutOfMemory
  // with what was asked, what is free and how, and why compaction could not
  // help. With wait_for_frees false, never blocks the host: kOutOfMemory
  // instead of waiting for pending frees. With compact false, kOutOfMemory
  // instead of compacting.
  StatusOr<ArenaBlock> Allocate(size_t bytes, Stream& stream,
                                bool movable = true, bool wait_for_frees = true,
                                bool compact = true) STRATA_EXCLUDES(mu_);
  // Blocks the host until every pending free is reusable, so that what the
  // next Allocate places where depends only on the calls made so far, not
  // on how far the streams have come.
  Status SettleFrees() STRATA_EXCLUDES(mu_);

  DeviceArenaStats stats() const STRATA_EXCLUDES(mu_);
  const std::string& name() const { return options_.name; }

  // The events an arena can hold at once when at most `blocks` blocks, live
  // or pending free, fit in it and at most `streams` streams use each
  // (Note [The arena's events]): reserve_events for a caller that knows both.
  static uint64_t EventsFor(uint64_t blocks, uint64_t streams) {
    return blocks * (streams + 1) + 3;
  }
  uint64_t capacity() const { return capacity_; }

 private:
  friend class ArenaBlock;
  friend class ArenaPin;

  struct Record {
    uint64_t offset = 0;
    int pins = 0;
    bool movable = true;  // the owner's wish; pinned blocks stay put anyway
    std::vector<Stream*> users;
    // The compaction this block must wait for; null when none.
    std::shared_ptr<Event> ready;
  };
  struct PendingFree {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    std::vector<std::shared_ptr<Event>> events;
  };

  DeviceArena(Device* device, DeviceMemory memory, ArenaPlanner planner,
              const DeviceArenaOptions& options);

  std::byte* base() const { return memory_.at(0); }
  uint64_t OffsetOf(uint64_t id) const STRATA_EXCLUDES(mu_);
  StatusOr<ArenaPin> Pin(uint64_t id, Stream& stream) STRATA_EXCLUDES(mu_);
  void Unpin(uint64_t id) noexcept STRATA_EXCLUDES(mu_);
  Status SetMovable(uint64_t id, bool movable) STRATA_EXCLUDES(mu_);
  void Free(uint64_t id) noexcept STRATA_EXCLUDES(mu_);

  // Whether the event's work is known to be done (a query; never waits).
  bool Complete(const Event& event) const;
  // Moves completed pending frees to the planner (queries only).
  void ReclaimLocked() STRATA_REQUIRES(mu_);
  // The planner's movable flag for a block in this state.
  Status SyncMovableLocked(const Record& r) STRATA_REQUIRES(mu_);
  // Plans, enqueues and applies a compaction making room for `bytes` on
  // `stream`.
  Status CompactLocked(uint64_t bytes, Stream& stream) STRATA_REQUIRES(mu_);
  // The event of the last compaction while it may be unfinished, else null.
  std::shared_ptr<Event> UnfinishedCompactionLocked() STRATA_REQUIRES(mu_);
  static void AddUser(Record& r, Stream* stream);
  // An event from the pool (a new one only when none is spare), returned to
  // the pool when the last reference drops: after the first uses, frees and
  // compactions make no device calls that allocate.
  StatusOr<std::shared_ptr<Event>> TakeEvent() STRATA_EXCLUDES(events_mu_);

  Device* const device_;
  // Declared before everything holding events, so destroyed after them.
  Mutex events_mu_;
  std::vector<std::unique_ptr<Event>> spare_events_
      STRATA_GUARDED_BY(events_mu_);
  const DeviceArenaOptions options_;
  DeviceMemory memory_;
  const uint64_t capacity_;

  mutable Mutex mu_;
  ArenaPlanner planner_ STRATA_GUARDED_BY(mu_);
  uint64_t next_id_ STRATA_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Record> records_ STRATA_GUARDED_BY(mu_);  // id ->
  // Oldest first; shared_ptr: Allocate waits on the front outside mu_.
  std::deque<std::shared_ptr<PendingFree>> pending_ STRATA_GUARDED_BY(mu_);
  std::shared_ptr<Event> last_compaction_ STRATA_GUARDED_BY(mu_);
  DeviceArenaStats counters_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_ARENA_H_
