#include "memtier/arena.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <iterator>
#include <utility>

#include "util/log.h"

namespace strata::memtier {
namespace {

double Fragmentation(uint64_t free_bytes, uint64_t largest) {
  if (free_bytes == 0) return 0;
  return 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes);
}

std::string Percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", fraction * 100);
  return buf;
}

}  // namespace

// ---- ArenaPlanner -----------------------------------------------------------

ArenaPlanner::ArenaPlanner(uint64_t capacity, uint64_t alignment)
    : alignment_(alignment),
      capacity_(capacity / alignment * alignment),
      free_(capacity_) {}

StatusOr<ArenaPlanner> ArenaPlanner::Create(uint64_t capacity,
                                            uint64_t alignment) {
  // Sizes that are multiples of the alignment keep every free range of the
  // underlying 256-byte BlockPlanner on multiples of it.
  if (alignment == 0 || alignment % internal::BlockPlanner::kAlignment != 0) {
    return Status::InvalidArgument("arena alignment " +
                                   std::to_string(alignment) +
                                   " is not a positive multiple of 256 bytes");
  }
  return ArenaPlanner(capacity, alignment);
}

uint64_t ArenaPlanner::Round(uint64_t bytes) const {
  if (bytes > UINT64_MAX - (alignment_ - 1)) return 0;
  return (bytes + alignment_ - 1) / alignment_ * alignment_;
}

std::string ArenaPlanner::OutOfMemoryMessage(uint64_t asked) const {
  const ArenaPlannerStats s = stats();
  return "asked for " + std::to_string(asked) + " bytes (" +
         std::to_string(Round(asked)) + " after rounding to " +
         std::to_string(alignment_) + "); " + std::to_string(s.free_bytes) +
         " bytes free in " + std::to_string(s.free_ranges) +
         " ranges (largest " + std::to_string(s.largest_free_bytes) +
         " bytes, fragmentation " + Percent(s.fragmentation) +
         ") of a capacity of " + std::to_string(capacity_) + " bytes";
}

StatusOr<uint64_t> ArenaPlanner::Allocate(uint64_t bytes, uint64_t tag,
                                          bool movable) {
  if (bytes == 0) {
    return Status::InvalidArgument("arena allocation of 0 bytes");
  }
  const uint64_t size = Round(bytes);
  std::optional<uint64_t> offset;
  if (size != 0) offset = free_.Allocate(size);
  if (!offset) {
    ++counters_.failures;
    return Status::OutOfMemory("out of arena memory: " +
                               OutOfMemoryMessage(bytes));
  }
  blocks_.emplace(*offset, Block{*offset, size, tag, movable});
  ++counters_.allocations;
  return *offset;
}

Status ArenaPlanner::Free(uint64_t offset) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end()) {
    return Status::NotFound("no arena block starts at offset " +
                            std::to_string(offset));
  }
  free_.Free(offset, it->second.bytes);
  blocks_.erase(it);
  ++counters_.frees;
  return Status::Ok();
}

Status ArenaPlanner::SetMovable(uint64_t offset, bool movable) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end()) {
    return Status::NotFound("no arena block starts at offset " +
                            std::to_string(offset));
  }
  it->second.movable = movable;
  return Status::Ok();
}

const ArenaPlanner::Block* ArenaPlanner::Find(uint64_t offset) const {
  auto it = blocks_.find(offset);
  return it == blocks_.end() ? nullptr : &it->second;
}

std::vector<ArenaPlanner::Block> ArenaPlanner::blocks() const {
  std::vector<Block> out;
  out.reserve(blocks_.size());
  for (const auto& [offset, b] : blocks_) out.push_back(b);
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> ArenaPlanner::free_ranges() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t cursor = 0;
  for (const auto& [offset, b] : blocks_) {
    if (offset > cursor) out.emplace_back(cursor, offset - cursor);
    cursor = offset + b.bytes;
  }
  if (capacity_ > cursor) out.emplace_back(cursor, capacity_ - cursor);
  return out;
}

ArenaPlannerStats ArenaPlanner::stats() const {
  ArenaPlannerStats s = counters_;
  s.capacity_bytes = capacity_;
  s.free_bytes = free_.free_bytes();
  s.used_bytes = capacity_ - s.free_bytes;
  s.largest_free_bytes = free_.largest_free_block();
  s.free_ranges = free_.free_extents();
  s.fragmentation = Fragmentation(s.free_bytes, s.largest_free_bytes);
  return s;
}

StatusOr<CompactionPlan> ArenaPlanner::PlanCompaction(uint64_t bytes) const {
  const uint64_t need = Round(bytes);
  const uint64_t free_total = free_.free_bytes();
  if (bytes == 0 || need == 0 || need > free_total) {
    return Status::OutOfMemory(
        "compaction cannot make room: " + OutOfMemoryMessage(bytes) +
        "; more than the free total");
  }
  CompactionPlan plan;
  if (free_.largest_free_block() >= need) {
    for (const auto& [offset, size] : free_ranges()) {
      if (size >= need) {
        plan.free_offset = offset;
        plan.free_bytes = size;
        return plan;
      }
    }
  }

  // Note [Compaction plans]: per segment between pinned blocks, the free
  // ranges in order and the bytes of (movable) blocks before each since the
  // previous range of the segment; a two-pointer scan finds the run of
  // ranges holding `need` with the fewest block bytes inside it.
  struct Gap {
    uint64_t offset;
    uint64_t bytes;
    uint64_t blocks_before;  // block bytes between the previous gap and this
  };
  bool found = false;
  uint64_t best_cost = UINT64_MAX;
  uint64_t best_start = 0, best_end = 0;  // the run's span
  uint64_t reachable = 0;                 // the largest segment's free total
  std::vector<Gap> gaps;
  uint64_t between = 0;
  auto close_segment = [&] {
    uint64_t seg_free = 0;
    for (const Gap& g : gaps) seg_free += g.bytes;
    reachable = std::max(reachable, seg_free);
    uint64_t sum = 0, cost = 0;
    size_t j = 0;  // gaps [i, j) are in the run
    for (size_t i = 0; i < gaps.size(); ++i) {
      while (j < gaps.size() && sum < need) {
        if (j > i) cost += gaps[j].blocks_before;
        sum += gaps[j].bytes;
        ++j;
      }
      if (sum < need) break;
      if (cost < best_cost) {
        found = true;
        best_cost = cost;
        best_start = gaps[i].offset;
        best_end = gaps[j - 1].offset + gaps[j - 1].bytes;
      }
      sum -= gaps[i].bytes;
      if (i + 1 < j) cost -= gaps[i + 1].blocks_before;
    }
    gaps.clear();
    between = 0;
  };
  uint64_t cursor = 0;
  for (const auto& [offset, b] : blocks_) {
    if (offset > cursor) {
      gaps.push_back({cursor, offset - cursor, between});
      between = 0;
    }
    if (b.movable) {
      between += b.bytes;
    } else {
      close_segment();
    }
    cursor = offset + b.bytes;
  }
  if (capacity_ > cursor) gaps.push_back({cursor, capacity_ - cursor, between});
  close_segment();

  if (!found) {
    return Status::OutOfMemory(
        "compaction cannot make room: " + OutOfMemoryMessage(bytes) +
        "; pinned blocks split the free space, and moving every movable "
        "block would make at most " +
        std::to_string(reachable) + " contiguous bytes");
  }
  // Slide the blocks inside [best_start, best_end) down, in ascending order.
  uint64_t dst = best_start;
  for (auto it = blocks_.lower_bound(best_start);
       it != blocks_.end() && it->first < best_end; ++it) {
    const Block& b = it->second;
    assert(b.movable);
    plan.moves.push_back({b.tag, b.offset, dst, b.bytes});
    const uint64_t slide = b.offset - dst;
    for (uint64_t done = 0; done < b.bytes; done += slide) {
      plan.copies.push_back(
          {b.offset + done, dst + done, std::min(slide, b.bytes - done)});
    }
    plan.bytes_moved += b.bytes;
    dst += b.bytes;
  }
  plan.free_offset = dst;
  plan.free_bytes = best_end - dst;
  return plan;
}

Status ArenaPlanner::ApplyCompaction(const CompactionPlan& plan) {
  if (plan.moves.empty()) return Status::Ok();
  std::map<uint64_t, Block> next = blocks_;
  for (const CompactionMove& m : plan.moves) {
    auto it = next.find(m.old_offset);
    if (it == next.end() || it->second.tag != m.tag ||
        it->second.bytes != m.bytes || !it->second.movable ||
        m.new_offset % alignment_ != 0) {
      return Status::FailedPrecondition(
          "compaction plan does not fit the arena: no movable block of " +
          std::to_string(m.bytes) + " bytes with tag " + std::to_string(m.tag) +
          " at offset " + std::to_string(m.old_offset));
    }
    next.erase(it);
  }
  for (const CompactionMove& m : plan.moves) {
    const Block& old = blocks_.at(m.old_offset);
    if (!next.emplace(m.new_offset,
                      Block{m.new_offset, m.bytes, old.tag, old.movable})
             .second) {
      return Status::FailedPrecondition(
          "compaction plan moves two blocks to offset " +
          std::to_string(m.new_offset));
    }
  }
  uint64_t end = 0;
  for (const auto& [offset, b] : next) {
    if (offset < end || b.bytes > capacity_ - offset) {
      return Status::FailedPrecondition(
          "compaction plan overlaps blocks at offset " +
          std::to_string(offset));
    }
    end = offset + b.bytes;
  }

  const ArenaPlannerStats before = stats();
  // Rebuild the free ranges by carving the new layout in offset order from a
  // fresh planner (while only its tail is free, best fit is the next offset),
  // then returning the gaps, which coalesce as any free does.
  internal::BlockPlanner fresh(capacity_);
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  uint64_t cursor = 0;
  for (const auto& [offset, b] : next) {
    if (offset > cursor) {
      [[maybe_unused]] auto gap = fresh.Allocate(offset - cursor);
      assert(gap && *gap == cursor);
      gaps.emplace_back(cursor, offset - cursor);
    }
    [[maybe_unused]] auto at = fresh.Allocate(b.bytes);
    assert(at && *at == offset);
    cursor = offset + b.bytes;
  }
  for (const auto& [offset, size] : gaps) fresh.Free(offset, size);
  blocks_ = std::move(next);
  free_ = std::move(fresh);

  ++counters_.compactions;
  counters_.compaction_bytes_moved += plan.bytes_moved;
  counters_.compaction_copies += plan.copies.size();
  counters_.fragmentation_before_last_compaction = before.fragmentation;
  counters_.fragmentation_after_last_compaction = stats().fragmentation;
  return Status::Ok();
}

// ---- ArenaPin and ArenaBlock ------------------------------------------------

ArenaPin::ArenaPin(ArenaPin&& other) noexcept
    : arena_(std::exchange(other.arena_, nullptr)),
      id_(std::exchange(other.id_, 0)),
      data_(std::exchange(other.data_, nullptr)) {}

ArenaPin& ArenaPin::operator=(ArenaPin&& other) noexcept {
  if (this != &other) {
    Reset();
    arena_ = std::exchange(other.arena_, nullptr);
    id_ = std::exchange(other.id_, 0);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

void ArenaPin::Reset() noexcept {
  if (arena_ != nullptr) arena_->Unpin(id_);
  arena_ = nullptr;
  id_ = 0;
  data_ = nullptr;
}

ArenaBlock::ArenaBlock(ArenaBlock&& other) noexcept
    : arena_(std::exchange(other.arena_, nullptr)),
      id_(std::exchange(other.id_, 0)),
      size_(std::exchange(other.size_, 0)) {}

ArenaBlock& ArenaBlock::operator=(ArenaBlock&& other) noexcept {
  if (this != &other) {
    Reset();
    arena_ = std::exchange(other.arena_, nullptr);
    id_ = std::exchange(other.id_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void ArenaBlock::Reset() noexcept {
  if (arena_ != nullptr) arena_->Free(id_);
  arena_ = nullptr;
  id_ = 0;
  size_ = 0;
}

uint64_t ArenaBlock::offset() const {
  assert(arena_ != nullptr);
  return arena_->OffsetOf(id_);
}

void* ArenaBlock::data() const {
  if (arena_ == nullptr) return nullptr;
  return arena_->base() + arena_->OffsetOf(id_);
}

StatusOr<ArenaPin> ArenaBlock::Pin(Stream& stream) const {
  if (arena_ == nullptr) {
    return Status::FailedPrecondition("pinning an empty arena block");
  }
  return arena_->Pin(id_, stream);
}

Status ArenaBlock::SetMovable(bool movable) const {
  if (arena_ == nullptr) {
    return Status::FailedPrecondition("SetMovable on an empty arena block");
  }
  return arena_->SetMovable(id_, movable);
}

// ---- DeviceArena ------------------------------------------------------------

DeviceArena::DeviceArena(Device* device, DeviceMemory memory,
                         ArenaPlanner planner,
                         const DeviceArenaOptions& options)
    : device_(device),
      options_(options),
      memory_(std::move(memory)),
      capacity_(planner.capacity()),
      planner_(std::move(planner)) {}

StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(
    Device* device, Stream& stream, const DeviceArenaOptions& options) {
  if (options.capacity_bytes == 0) {
    return Status::InvalidArgument(options.name +
                                   ": capacity_bytes must be > 0");
  }
  STRATA_ASSIGN_OR_RETURN(
      ArenaPlanner planner,
      ArenaPlanner::Create(options.capacity_bytes, options.alignment));
  if (planner.capacity() == 0) {
    return Status::InvalidArgument(options.name + ": capacity_bytes " +
                                   std::to_string(options.capacity_bytes) +
                                   " is smaller than one alignment unit of " +
                                   std::to_string(options.alignment) +
                                   " bytes");
  }
  StatusOr<DeviceMemory> memory = device->Allocate(planner.capacity(), stream);
  if (!memory.ok()) {
    return memory.status().WithContext(options.name + ": taking " +
                                       std::to_string(planner.capacity()) +
                                       " bytes of device memory");
  }
  std::unique_ptr<DeviceArena> arena(
      new DeviceArena(device, std::move(*memory), std::move(planner), options));
  MutexLock lock(&arena->events_mu_);
  arena->spare_events_.reserve(options.reserve_events);
  for (uint64_t i = 0; i < options.reserve_events; ++i) {
    StatusOr<std::unique_ptr<Event>> e = device->NewEvent();
    if (!e.ok()) {
      return e.status().WithContext(
          options.name + ": making event " + std::to_string(i + 1) + " of " +
          std::to_string(options.reserve_events) + " (reserve_events)");
    }
    arena->spare_events_.push_back(std::move(e).value());
  }
  return arena;
}

DeviceArena::~DeviceArena() {
  std::deque<std::shared_ptr<PendingFree>> pending;
  std::shared_ptr<Event> compaction;
  {
    MutexLock lock(&mu_);
    if (!records_.empty()) {
      STRATA_LOG_ERROR("{}: destroyed with {} blocks still alive; they dangle",
                       options_.name, records_.size());
    }
    pending.swap(pending_);
    compaction = std::move(last_compaction_);
  }
  // Keep the memory until queued work that touches it is done.
  for (auto& p : pending) {
    for (auto& e : p->events) device_->SynchronizeEvent(*e).IgnoreError();
  }
  if (compaction) device_->SynchronizeEvent(*compaction).IgnoreError();
}

void DeviceArena::AddUser(Record& r, Stream* stream) {
  if (std::find(r.users.begin(), r.users.end(), stream) == r.users.end()) {
    r.users.push_back(stream);
  }
}

Status DeviceArena::SyncMovableLocked(const Record& r) {
  return planner_.SetMovable(r.offset, r.movable && r.pins == 0);
}

bool DeviceArena::Complete(const Event& event) const {
  auto done = device_->QueryEvent(event);
  // An error (a failed CUDA context) counts as unfinished: the work is not
  // known to be done, and the error surfaces on the next synchronization.
  return done.ok() && *done;
}

std::shared_ptr<Event> DeviceArena::UnfinishedCompactionLocked() {
  if (last_compaction_ && Complete(*last_compaction_)) {
    last_compaction_.reset();
  }
  return last_compaction_;
}

void DeviceArena::ReclaimLocked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    const PendingFree& p = **it;
    if (!std::all_of(p.events.begin(), p.events.end(),
                     [this](const auto& e) { return Complete(*e); })) {
      ++it;
      continue;
    }
    Status st = planner_.Free(p.offset);
    assert(st.ok());
    st.IgnoreError();
    counters_.pending_free_bytes -= p.bytes;
    it = pending_.erase(it);
  }
}

Status DeviceArena::CompactLocked(uint64_t bytes, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CompactionPlan plan, planner_.PlanCompaction(bytes));
  if (plan.moves.empty()) return Status::Ok();
  // Everything that can fail without side effects comes first.
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, TakeEvent());
  // The copies wait for the work already queued on the moved blocks and for
  // the previous compaction (which may still read a range now free).
  std::vector<Stream*> waited;
  for (const CompactionMove& m : plan.moves) {
    for (Stream* user : records_.at(m.tag).users) {
      if (user == &stream ||
          std::find(waited.begin(), waited.end(), user) != waited.end()) {
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> e, TakeEvent());
      STRATA_RETURN_IF_ERROR(device_->RecordEvent(*e, *user));
      STRATA_RETURN_IF_ERROR(device_->WaitEvent(stream, *e));
      waited.push_back(user);
    }
  }
  if (auto previous = UnfinishedCompactionLocked()) {
    STRATA_RETURN_IF_ERROR(device_->WaitEvent(stream, *previous));
  }
  for (size_t i = 0; i < plan.copies.size(); ++i) {
    const CompactionCopy& c = plan.copies[i];
    Status st =
        device_->CopyAsync(stream, base() + c.dst_offset, base() + c.src_offset,
                           c.bytes, CopyKind::kDeviceToDevice);
    if (!st.ok()) {
      // Earlier copies may have overwritten moved blocks' old bytes.
      return st.WithContext(options_.name + ": compaction failed after " +
                            std::to_string(i) + " of " +
                            std::to_string(plan.copies.size()) +
                            " copies; the moved blocks' contents are lost");
    }
  }
  STRATA_RETURN_IF_ERROR(device_->RecordEvent(*done, stream));
  STRATA_RETURN_IF_ERROR(planner_.ApplyCompaction(plan));
  for (const CompactionMove& m : plan.moves) {
    Record& r = records_.at(m.tag);
    r.offset = m.new_offset;
    r.ready = done;
    AddUser(r, &stream);
  }
  last_compaction_ = std::move(done);
  return Status::Ok();
}

Status DeviceArena::SettleFrees() {
  for (;;) {
    std::shared_ptr<PendingFree> oldest;
    {
      MutexLock lock(&mu_);
      ReclaimLocked();
      if (pending_.empty()) return Status::Ok();
      oldest = pending_.front();
      ++counters_.reuse_waits;
    }
    // Outside mu_: blocks until the streams reach the free.
    for (auto& e : oldest->events) {
      STRATA_RETURN_IF_ERROR(device_->SynchronizeEvent(*e).WithContext(
          options_.name + ": waiting for freed memory to become reusable"));
    }
  }
}

StatusOr<ArenaBlock> DeviceArena::Allocate(size_t bytes, Stream& stream,
                                           bool movable, bool wait_for_frees,
                                           bool compact) {
  if (bytes == 0) {
    return Status::InvalidArgument(options_.name + ": allocation of 0 bytes");
  }
  for (;;) {
    std::shared_ptr<PendingFree> oldest;
    {
      MutexLock lock(&mu_);
      ReclaimLocked();
      const uint64_t id = next_id_;
      StatusOr<uint64_t> offset = planner_.Allocate(bytes, id, movable);
      Status compaction;
      if (!offset.ok() && compact &&
          planner_.stats().free_bytes >= planner_.Round(bytes)) {
        compaction = CompactLocked(bytes, stream);
        if (compaction.ok()) {
          offset = planner_.Allocate(bytes, id, movable);
        } else if (compaction.code() != StatusCode::kOutOfMemory) {
          return compaction;
        }
      }
      if (offset.ok()) {
        ++next_id_;
        Record& r = records_[id];
        r.offset = *offset;
        r.movable = movable;
        r.users.push_back(&stream);
        r.ready = UnfinishedCompactionLocked();
        ArenaBlock block;
        block.arena_ = this;
        block.id_ = id;
        block.size_ = bytes;
        return block;
      }
      if (pending_.empty() || !wait_for_frees) {
        ++counters_.out_of_memory;
        std::string msg =
            options_.name + ": " + std::string(offset.status().message());
        if (!compaction.ok()) {
          // The planner's description is already in the message.
          std::string_view why = compaction.message();
          const size_t cut = why.rfind("; ");
          msg += "; compaction cannot help: " +
                 std::string(
                     why.substr(cut == std::string_view::npos ? 0 : cut + 2));
        }
        msg += "; " + std::to_string(counters_.pending_free_bytes) +
               " bytes are freed but wait for their streams";
        return Status::OutOfMemory(msg);
      }
      oldest = pending_.front();
      ++counters_.reuse_waits;
    }
    // Outside mu_: blocks until the streams reach the free.
    for (auto& e : oldest->events) {
      STRATA_RETURN_IF_ERROR(device_->SynchronizeEvent(*e).WithContext(
          options_.name + ": waiting for freed memory to become reusable"));
    }
  }
}

uint64_t DeviceArena::OffsetOf(uint64_t id) const {
  MutexLock lock(&mu_);
  return records_.at(id).offset;
}

StatusOr<ArenaPin> DeviceArena::Pin(uint64_t id, Stream& stream) {
  MutexLock lock(&mu_);
  Record& r = records_.at(id);
  if (r.ready && Complete(*r.ready)) r.ready.reset();
  if (r.ready) STRATA_RETURN_IF_ERROR(device_->WaitEvent(stream, *r.ready));
  AddUser(r, &stream);
  if (++r.pins == 1) {
    ++counters_.pinned_blocks;
    STRATA_RETURN_IF_ERROR(SyncMovableLocked(r));
  }
  ArenaPin pin;
  pin.arena_ = this;
  pin.id_ = id;
  pin.data_ = base() + r.offset;
  return pin;
}

void DeviceArena::Unpin(uint64_t id) noexcept {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;  // the block went first (see ArenaPin)
  Record& r = it->second;
  assert(r.pins > 0);
  if (--r.pins == 0) {
    --counters_.pinned_blocks;
    SyncMovableLocked(r).IgnoreError();
  }
}

Status DeviceArena::SetMovable(uint64_t id, bool movable) {
  MutexLock lock(&mu_);
  Record& r = records_.at(id);
  r.movable = movable;
  return SyncMovableLocked(r);
}

void DeviceArena::Free(uint64_t id) noexcept {
  auto pending = std::make_shared<PendingFree>();
  Record r;
  {
    MutexLock lock(&mu_);
    auto it = records_.find(id);
    assert(it != records_.end());
    r = std::move(it->second);
    records_.erase(it);
    if (r.pins > 0) --counters_.pinned_blocks;
    // A pending free holds its range, unmovable, until its streams finish.
    planner_.SetMovable(r.offset, false).IgnoreError();
    pending->offset = r.offset;
    pending->bytes = planner_.Find(r.offset)->bytes;
  }
  // Outside mu_: only enqueues. The offset cannot change: the block is
  // unmovable now.
  for (Stream* s : r.users) {
    auto event = TakeEvent();
    Status st = event.ok() ? device_->RecordEvent(**event, *s) : event.status();
    if (!st.ok()) {
      STRATA_LOG_ERROR(
          "{}: cannot order the free of {} bytes at offset {} after its "
          "streams ({}); the range stays unusable",
          options_.name, pending->bytes, pending->offset, st.ToString());
      return;
    }
    pending->events.push_back(std::move(*event));
  }
  if (r.ready) pending->events.push_back(std::move(r.ready));
  MutexLock lock(&mu_);
  counters_.pending_free_bytes += pending->bytes;
  pending_.push_back(std::move(pending));
}

// Note [The arena's events]: frees and compactions take their events from a
// pool and give them back when the last holder lets go, so the device makes
// one only when every event is in use. How many are in use depends on how far
// the streams lag the host: a pending free holds one event per stream that
// used its block until the next Allocate finds them complete. So a pool that
// only grows can grow on any step, whenever the streams fall further behind
// than before. A caller that must make nothing after its first step (the
// engine) reserves the most that can be in use at once:
//   - a pending free holds one event per stream that used the block;
//   - a block, live or pending, holds at most one compaction's event (ready);
//   - the last compaction's event, the event of the compaction being planned,
//     and one of its waits are held apart from any block.
// Pending frees hold their ranges, so live and pending blocks together are at
// most the blocks that fit in the capacity: EventsFor(blocks, streams).
StatusOr<std::shared_ptr<Event>> DeviceArena::TakeEvent() {
  std::unique_ptr<Event> e;
  {
    MutexLock lock(&events_mu_);
    if (!spare_events_.empty()) {
      e = std::move(spare_events_.back());
      spare_events_.pop_back();
    }
  }
  if (!e) {
    STRATA_ASSIGN_OR_RETURN(e, device_->NewEvent());
  }
  return std::shared_ptr<Event>(e.release(), [this](Event* ev) {
    MutexLock lock(&events_mu_);
    spare_events_.emplace_back(ev);
  });
}

DeviceArenaStats DeviceArena::stats() const {
  MutexLock lock(&mu_);
  DeviceArenaStats s = counters_;
  s.planner = planner_.stats();
  s.live_blocks = records_.size();
  return s;
}

}  // namespace strata::memtier
