#include "strata/swap_space.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "strata/host_buffer.h"
#include "swap/swap_space_internal.h"
#include "util/align.h"
#include "util/checksum.h"
#include "util/file_lock.h"
#include "util/log.h"
#include "util/mutex.h"

namespace strata::swap {
namespace {

constexpr uint32_t kMinHeaderBytes = 4096;
constexpr const char* kLockName = "strata-swap.lock";
constexpr const char* kFilePrefix = "strata-swap-";
constexpr const char* kFileSuffix = ".swp";

uint64_t Checksum(const BlockHeader& h, const std::byte* payload) {
  BlockHeader copy = h;
  copy.checksum = 0;
  return Xxh3(std::as_bytes(std::span(&copy, 1)),
              std::span(payload, h.payload_bytes));
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs s {};
  if (statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// Removes swap files of earlier, dead owners of a directory we now hold.
void RemoveStaleFiles(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kFilePrefix, 0) == 0 && name.size() > 4 &&
        name.compare(name.size() - 4, 4, kFileSuffix) == 0) {
      const std::string path = dir + "/" + name;
      if (::unlink(path.c_str()) == 0) {
        STRATA_LOG_WARN("removed stale swap file {} left by an earlier run",
                        path);
      }
    }
  }
  ::closedir(d);
}

// Locks every directory (none for the in-memory engine) and removes stale
// swap files from each; before any ring or thread exists, so that a busy
// directory is refused cheaply.
StatusOr<std::vector<FileLock>> LockDirectories(const SwapSpaceOptions& o,
                                                bool memory) {
  std::vector<FileLock> locks;
  if (memory) return locks;
  for (const auto& dir : o.dirs) {
    StatusOr<FileLock> lock = FileLock::Acquire(dir + "/" + kLockName);
    if (!lock.ok()) {
      if (lock.status().code() == StatusCode::kBusy) {
        return Status(StatusCode::kBusy,
                      "swap directory " + dir +
                          " is in use by another strata engine (" +
                          std::string(lock.status().message()) +
                          "); give each job its own directory",
                      lock.status().sys_errno());
      }
      return lock.status().WithContext("swap directory " + dir);
    }
    locks.push_back(std::move(*lock));
    RemoveStaleFiles(dir);
  }
  return locks;
}

// Header pages (header_bytes each, aligned) for requests in flight: taken
// per block, returned when its operation finishes. Grows by chunks that are
// registered with the ring and kept; after warm-up nothing is allocated.
class HeaderPool {
 public:
  HeaderPool(AsyncIo& io, uint32_t page_bytes, bool pin)
      : io_(io), page_bytes_(page_bytes), pin_(pin) {}

  Status Take(size_t n, std::vector<std::byte*>& out) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (free_.size() < n) {
      const size_t pages = std::max<size_t>(n - free_.size(), kChunkPages);
      HostBufferOptions bo;
      bo.pin = pin_;
      auto chunk = HostBuffer::Allocate(pages * page_bytes_, bo);
      if (!chunk.ok()) {
        return std::move(chunk).status().WithContext(
            "swap space header pages (" + std::to_string(pages) + " x " +
            std::to_string(page_bytes_) + " bytes)");
      }
      auto reg = io_.RegisterBuffer(chunk->span());
      if (reg.ok()) regs_.push_back(std::move(*reg));
      for (size_t i = 0; i < pages; ++i) {
        free_.push_back(chunk->data() + i * page_bytes_);
      }
      chunks_.push_back(std::move(*chunk));
    }
    for (size_t i = 0; i < n; ++i) {
      out.push_back(free_.back());
      free_.pop_back();
    }
    return Status::Ok();
  }

  void Give(std::span<std::byte* const> pages) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    free_.insert(free_.end(), pages.begin(), pages.end());
  }

 private:
  static constexpr size_t kChunkPages = 64;
  AsyncIo& io_;
  const uint32_t page_bytes_;
  const bool pin_;
  Mutex mu_;
  std::vector<std::byte*> free_ STRATA_GUARDED_BY(mu_);
  // Registrations before their chunks: destroyed (unregistered) first.
  std::vector<HostBuffer> chunks_ STRATA_GUARDED_BY(mu_);
  std::vector<IoBufferRegistration> regs_ STRATA_GUARDED_BY(mu_);
};

}  // namespace

class SwapSpaceImpl final : public SwapSpace {
 public:
  SwapSpaceImpl(const SwapSpaceOptions& o, std::shared_ptr<AsyncIo> io,
                std::vector<FileLock> locks)
      : io_(std::move(io)), options_(o), locks_(std::move(locks)) {}

  ~SwapSpaceImpl() override {
    {
      MutexLock lock(&mu_);
      while (ops_in_flight_ > 0) ops_cv_.Wait(&mu_);
    }
    bounce_reg_ = IoBufferRegistration();
    headers_.reset();
    for (size_t i = 0; i < file_ids_.size(); ++i) {
      io_->Close(file_ids_[i]).IgnoreError();
      if (!memory_) ::unlink(paths_[i].c_str());
    }
    locks_.clear();  // after the files are gone
  }

  Status Init() {
    const auto& o = options_;
    if (o.dirs.empty()) return Status::InvalidArgument("no swap directory");
    if (o.block_bytes == 0 || o.block_bytes % 4096 != 0) {
      return Status::InvalidArgument("block_bytes must be a multiple of 4096");
    }
    if (o.queue_depth == 0) {
      return Status::InvalidArgument("queue_depth must be at least 1");
    }
    memory_ = io_->backend() == IoBackend::kMemory;
    const bool memory = memory_;
    const uint64_t blocks = std::max<uint64_t>(
        1, RoundUp(o.capacity_bytes, o.block_bytes) / o.block_bytes);
    per_file_ = RoundUp(blocks, o.dirs.size()) / o.dirs.size();
    total_slots_ = per_file_ * o.dirs.size();
    if (total_slots_ >= kNoSlot) {
      return Status::InvalidArgument("swap capacity exceeds 2^32 blocks");
    }
    // Every directory is locked before any file in it is touched.
    for (const auto& dir : o.dirs) {
      const std::string path =
          dir + "/" + kFilePrefix + std::to_string(::getpid()) + kFileSuffix;
      STRATA_ASSIGN_OR_RETURN(FileId id, io_->Open(path, {.writable = true,
                                                          .create = true,
                                                          .truncate = true}));
      file_ids_.push_back(id);
      paths_.push_back(path);
      align_ = std::max<size_t>(align_, io_->alignment(id));
    }
    header_bytes_ = static_cast<uint32_t>(std::max<size_t>(
        kMinHeaderBytes, RoundUp(sizeof(BlockHeader), align_)));
    if (o.block_bytes % header_bytes_ != 0) {
      return Status::InvalidArgument(
          "block_bytes " + std::to_string(o.block_bytes) +
          " is not a multiple of the device's direct-I/O alignment " +
          std::to_string(header_bytes_));
    }
    payload_base_ = per_file_ * header_bytes_;
    const uint64_t file_bytes = payload_base_ + per_file_ * o.block_bytes;
    for (size_t i = 0; i < file_ids_.size(); ++i) {
      // Out of space is found now, before training, not mid-step.
      const uint64_t free = memory ? file_bytes : FreeBytes(o.dirs[i]);
      Status s = free < file_bytes
                     ? Status::FromErrno(ENOSPC, "preallocate swap file")
                     : io_->Allocate(file_ids_[i], file_bytes);
      if (!s.ok()) {
        if (s.code() == StatusCode::kNoSpace) {
          return Status(StatusCode::kNoSpace,
                        "swap file " + paths_[i] + " needs " +
                            std::to_string(file_bytes) + " bytes and " +
                            o.dirs[i] + " has " +
                            std::to_string(FreeBytes(o.dirs[i])) +
                            " bytes free",
                        ENOSPC);
        }
        return s;
      }
    }
    pool_ = std::make_shared<SlotPool>(total_slots_);
    if (o.synchronous_io) {
      HostBufferOptions bo;
      bo.pin = o.pin_buffers;
      auto bounce =
          HostBuffer::Allocate(uint64_t{o.block_bytes} * o.queue_depth, bo);
      if (!bounce.ok()) {
        return std::move(bounce).status().WithContext(
            "swap space bounce buffers (queue_depth " +
            std::to_string(o.queue_depth) + " x " +
            std::to_string(o.block_bytes) + "-byte blocks)");
      }
      bounce_ = std::move(*bounce);
      STRATA_ASSIGN_OR_RETURN(bounce_reg_, io_->RegisterBuffer(bounce_.span()));
    }
    headers_ = std::make_unique<HeaderPool>(*io_, header_bytes_, o.pin_buffers);
    // The synchronous path's header pages, taken now so that it never
    // allocates later.
    std::vector<std::byte*> warm;
    STRATA_RETURN_IF_ERROR(headers_->Take(o.queue_depth, warm));
    headers_->Give(warm);
    return Status::Ok();
  }

  StatusOr<SwapHandle> Allocate(uint64_t tensor_id, uint64_t bytes) override {
    const uint64_t nblocks =
        RoundUp(bytes, options_.block_bytes) / options_.block_bytes;
    std::vector<uint32_t> slots;
    if (!pool_->Take(nblocks, slots)) {
      return Status::NoSpace("swap space full: tensor " +
                             std::to_string(tensor_id) + " needs " +
                             std::to_string(nblocks) + " blocks of " +
                             std::to_string(options_.block_bytes) + " bytes, " +
                             std::to_string(pool_->free()) + " of " +
                             std::to_string(total_slots_) + " are free");
    }
    SwapHandle h;
    h.pool_ = pool_;
    h.tensor_id_ = tensor_id;
    h.bytes_ = bytes;
    for (uint32_t s : slots) h.blocks_.push_back({s, 0});
    return h;
  }

  size_t buffer_alignment() const override { return align_; }

  uint64_t BufferBytes(const SwapHandle& h, uint64_t first,
                       uint64_t count) const override {
    if (count == 0) return 0;
    return (count - 1) * options_.block_bytes +
           RoundUp(PayloadBytes(h, first + count - 1), align_);
  }

  Status WriteAsync(SwapHandle& h, uint64_t first, uint64_t count,
                    std::span<const std::byte> src, IoPriority priority,
                    SwapCallback done) override {
    STRATA_RETURN_IF_ERROR(
        CheckRange(h, first, count, src.data(), src.size(), IoOp::kWrite));
    // Blocks whose slot an earlier failed write retired get fresh ones.
    std::vector<uint64_t> need;
    for (uint64_t b = first; b < first + count; ++b) {
      if (h.blocks_[b].slot == kNoSlot) need.push_back(b);
    }
    if (!need.empty()) {
      std::vector<uint32_t> slots;
      if (!pool_->Take(need.size(), slots)) {
        return Status::NoSpace(
            "swap write of tensor " + std::to_string(h.tensor_id_) + ": " +
            std::to_string(need.size()) + " blocks need slots and " +
            std::to_string(pool_->free()) + " are free");
      }
      for (size_t i = 0; i < need.size(); ++i) {
        h.blocks_[need[i]].slot = slots[i];
      }
    }
    auto op = std::make_unique<Op>();
    op->kind = IoOp::kWrite;
    op->wh = &h;
    op->rh = &h;
    op->first = first;
    op->count = count;
    op->buf = const_cast<std::byte*>(src.data());  // never written to
    op->priority = priority;
    op->done = std::move(done);
    op->relocations.assign(count, 0);
    STRATA_RETURN_IF_ERROR(headers_->Take(count, op->pages));
    const uint64_t generation = generation_.fetch_add(1) + 1;
    std::vector<uint64_t> blocks;
    for (uint64_t i = 0; i < count; ++i) {
      h.blocks_[first + i].generation = generation;
      StampHeader(*op, i);
      blocks.push_back(i);
    }
    return Start(std::move(op), blocks);
  }

  Status ReadAsync(const SwapHandle& h, uint64_t first, uint64_t count,
                   std::span<std::byte> dst, IoPriority priority,
                   SwapCallback done) override {
    STRATA_RETURN_IF_ERROR(
        CheckRange(h, first, count, dst.data(), dst.size(), IoOp::kRead));
    for (uint64_t b = first; b < first + count; ++b) {
      if (h.blocks_[b].slot == kNoSlot) {
        return Status::FailedPrecondition(
            "swap read of tensor " + std::to_string(h.tensor_id_) + " block " +
            std::to_string(b) + ": its last write failed");
      }
    }
    auto op = std::make_unique<Op>();
    op->kind = IoOp::kRead;
    op->rh = &h;
    op->first = first;
    op->count = count;
    op->buf = dst.data();
    op->priority = priority;
    op->done = std::move(done);
    STRATA_RETURN_IF_ERROR(headers_->Take(count, op->pages));
    std::vector<uint64_t> blocks(count);
    for (uint64_t i = 0; i < count; ++i) blocks[i] = i;
    return Start(std::move(op), blocks);
  }

  uint64_t capacity_blocks() const override { return total_slots_; }
  uint64_t free_blocks() const override { return pool_->free(); }
  uint32_t block_bytes() const override { return options_.block_bytes; }
  const std::vector<std::string>& files() const override { return paths_; }
  uint64_t SlotOffset(uint32_t slot) const override {
    return payload_base_ + (slot / file_ids_.size()) * options_.block_bytes;
  }
  uint64_t HeaderOffset(uint32_t slot) const override {
    return (slot / file_ids_.size()) * header_bytes_;
  }
  size_t SlotFile(uint32_t slot) const override {
    return slot % file_ids_.size();
  }
  uint32_t header_bytes() const override { return header_bytes_; }
  std::string_view engine_name() const override { return io_->name(); }
  SwapStats stats() const override {
    MutexLock lock(&mu_);
    return stats_;
  }
  AsyncIo& io() const override { return *io_; }

 protected:
  StatusOr<std::span<std::byte>> AcquireBounce() override {
    if (bounce_.empty()) {
      return Status::FailedPrecondition(
          "this swap space was opened without synchronous_io; use "
          "ReadAsync/WriteAsync");
    }
    if (io_->OnCompletionThread()) {
      return Status::FailedPrecondition(
          "synchronous swap I/O from an I/O completion callback would wait "
          "for itself; use ReadAsync/WriteAsync there");
    }
    MutexLock lock(&mu_);
    while (bounce_busy_) bounce_cv_.Wait(&mu_);
    bounce_busy_ = true;
    return bounce_.span();
  }

  void ReleaseBounce() override {
    {
      MutexLock lock(&mu_);
      bounce_busy_ = false;
    }
    bounce_cv_.Signal();
  }

 private:
  // One asynchronous operation over a range of blocks. After Start hands it
  // to the AsyncIo, only the completion thread touches it.
  struct Op {
    IoOp kind = IoOp::kRead;
    SwapHandle* wh = nullptr;  // writes: relocation updates the handle
    const SwapHandle* rh = nullptr;
    uint64_t first = 0, count = 0;
    std::byte* buf = nullptr;
    IoPriority priority = IoPriority::kBackground;
    SwapCallback done;
    std::vector<std::byte*> pages;      // a header page per block
    std::vector<uint32_t> relocations;  // per block (writes)
    size_t batches = 0;                 // batches in flight
    Status status;                      // the first error
  };

  Status CheckRange(const SwapHandle& h, uint64_t first, uint64_t count,
                    const std::byte* buf, size_t size, IoOp op) const {
    const std::string what = std::string(op == IoOp::kRead ? "read" : "write");
    if (h.pool_ != pool_) {
      return Status::InvalidArgument("swap " + what +
                                     " of a handle of another space (or none)");
    }
    if (first > h.blocks_.size() || count > h.blocks_.size() - first) {
      return Status::OutOfRange("swap " + what + " of blocks [" +
                                std::to_string(first) + ", " +
                                std::to_string(first + count) + ") of tensor " +
                                std::to_string(h.tensor_id_) + ", which has " +
                                std::to_string(h.blocks_.size()) + " blocks");
    }
    const uint64_t need = BufferBytes(h, first, count);
    const auto addr = reinterpret_cast<uintptr_t>(buf);
    if (count > 0 && (addr % align_ != 0 || size < need)) {
      return Status::InvalidArgument(
          "swap " + what + " of tensor " + std::to_string(h.tensor_id_) +
          ": the buffer must start at a multiple of " + std::to_string(align_) +
          " bytes (direct I/O alignment) and span at least " +
          std::to_string(need) + " bytes; it " +
          (addr % align_ != 0 ? "is misaligned" : "is aligned") +
          " and spans " + std::to_string(size));
    }
    return Status::Ok();
  }

  uint64_t PayloadBytes(const SwapHandle& h, uint64_t block) const {
    const uint64_t start = block * options_.block_bytes;
    return std::min<uint64_t>(options_.block_bytes, h.bytes_ - start);
  }

  std::byte* Payload(const Op& op, uint64_t i) const {
    return op.buf + i * options_.block_bytes;
  }

  void StampHeader(Op& op, uint64_t i) {
    const uint64_t block = op.first + i;
    const SwapHandle::Block& b = op.wh->blocks_[block];
    BlockHeader hdr{};
    hdr.magic = BlockHeader::kMagic;
    hdr.version = BlockHeader::kVersion;
    hdr.header_bytes = header_bytes_;
    hdr.tensor_id = op.wh->tensor_id_;
    hdr.generation = b.generation;
    hdr.block_index = block;
    hdr.slot = b.slot;
    hdr.payload_bytes = PayloadBytes(*op.wh, block);
    hdr.checksum = Checksum(hdr, Payload(op, i));
    std::memset(op.pages[i], 0, header_bytes_);
    std::memcpy(op.pages[i], &hdr, sizeof hdr);
  }

  // Submits the header and payload requests of blocks `blocks` (indexes into
  // the op's range) as one batch. On refusal the op is given back.
  Status Start(std::unique_ptr<Op> owned, std::span<const uint64_t> blocks) {
    {
      MutexLock lock(&mu_);
      ++ops_in_flight_;
    }
    Op* op = owned.release();
    Status s = SubmitBlocks(op, blocks);
    if (!s.ok()) {
      headers_->Give(op->pages);
      delete op;
      EndOp();
    }
    return s;
  }

  Status SubmitBlocks(Op* op, std::span<const uint64_t> blocks) {
    std::vector<IoRequest> reqs;
    reqs.reserve(2 * blocks.size());
    const SwapHandle& h = *op->rh;
    for (uint64_t i : blocks) {
      const uint32_t slot = h.blocks_[op->first + i].slot;
      const FileId file = file_ids_[SlotFile(slot)];
      const uint64_t payload = RoundUp(PayloadBytes(h, op->first + i), align_);
      reqs.push_back({file,
                      HeaderOffset(slot),
                      {op->pages[i], header_bytes_},
                      op->kind,
                      i});
      reqs.push_back(
          {file, SlotOffset(slot), {Payload(*op, i), payload}, op->kind, i});
    }
    // A batch per block (its header and payload), so each block is checked
    // as soon as it is in, while the op's later blocks are still in flight.
    op->batches += blocks.size();
    Status s = io_->SubmitGroups(
        reqs, 2, op->priority,
        [this, op](size_t, std::span<IoCompletion> c) { OnBatchDone(op, c); });
    if (!s.ok()) op->batches -= blocks.size();
    return s;
  }

  // A batch of an op finished (completion thread): verify reads, relocate
  // failed writes, and finish the op after its last batch.
  void OnBatchDone(Op* op, std::span<IoCompletion> c) {
    std::vector<uint64_t> again;
    for (size_t k = 0; k + 1 < c.size(); k += 2) {
      const uint64_t i = c[k].tag;
      Status s = !c[k].status.ok() ? std::move(c[k].status)
                                   : std::move(c[k + 1].status);
      if (op->kind == IoOp::kRead) {
        if (s.ok()) s = Verify(*op, i);
        if (s.ok()) CountRead(PayloadBytes(*op->rh, op->first + i));
      } else if (s.ok()) {
        CountWrite(PayloadBytes(*op->rh, op->first + i));
      } else if (s.code() == StatusCode::kIoError) {
        // The device failed this slot: retire it and, while relocations
        // are left, rewrite the block (still in the caller's buffer)
        // elsewhere.
        SwapHandle::Block& b = op->wh->blocks_[op->first + i];
        std::vector<uint32_t> fresh;
        const bool relocate = op->relocations[i] < options_.max_relocations &&
                              op->status.ok() && pool_->Take(1, fresh);
        STRATA_LOG_WARN("retiring swap slot {} ({}){}", b.slot, s.ToString(),
                        relocate ? "; rewriting the block" : "");
        {
          MutexLock lock(&mu_);
          ++stats_.retired_slots;
          if (relocate) ++stats_.relocations;
        }
        b.slot = relocate ? fresh[0] : kNoSlot;
        if (relocate) {
          ++op->relocations[i];
          StampHeader(*op, i);
          again.push_back(i);
          continue;
        }
      }
      if (!s.ok() && op->status.ok()) op->status = std::move(s);
    }
    if (!again.empty()) {
      Status s = SubmitBlocks(op, again);
      if (!s.ok() && op->status.ok()) op->status = std::move(s);
    }
    if (--op->batches > 0) return;
    Status status = std::move(op->status);
    if (!status.ok()) {
      status = std::move(status).WithContext(
          std::string("swap ") + (op->kind == IoOp::kRead ? "read" : "write") +
          " of tensor " + std::to_string(op->rh->tensor_id_));
    }
    headers_->Give(op->pages);
    SwapCallback done = std::move(op->done);
    delete op;
    if (done) done(std::move(status));
    EndOp();
  }

  // Signals under the lock: once it is released the destructor may run.
  void EndOp() {
    MutexLock lock(&mu_);
    --ops_in_flight_;
    ops_cv_.SignalAll();
  }

  void CountRead(uint64_t bytes) {
    MutexLock lock(&mu_);
    ++stats_.blocks_read;
    stats_.bytes_read += bytes;
  }

  void CountWrite(uint64_t bytes) {
    MutexLock lock(&mu_);
    ++stats_.blocks_written;
    stats_.bytes_written += bytes;
  }

  // Checks block i of a read: header fields and the checksum over the
  // header and the payload now in the caller's buffer.
  Status Verify(const Op& op, uint64_t i) {
    const SwapHandle& h = *op.rh;
    const uint64_t block = op.first + i;
    BlockHeader hdr;
    std::memcpy(&hdr, op.pages[i], sizeof hdr);
    const SwapHandle::Block& b = h.blocks_[block];
    const uint64_t payload = PayloadBytes(h, block);
    std::string what;
    if (hdr.magic != BlockHeader::kMagic) {
      what = "bad magic";
    } else if (hdr.version != BlockHeader::kVersion ||
               hdr.header_bytes != header_bytes_) {
      what = "unknown header version or size";
    } else if (hdr.payload_bytes != payload) {
      what = "payload length " + std::to_string(hdr.payload_bytes) +
             ", expected " + std::to_string(payload);
    } else if (hdr.checksum != Checksum(hdr, Payload(op, i))) {
      what = "checksum mismatch";
    } else if (hdr.tensor_id != h.tensor_id_ || hdr.block_index != block ||
               hdr.slot != b.slot) {
      what = "block belongs to tensor " + std::to_string(hdr.tensor_id) +
             " block " + std::to_string(hdr.block_index) + " slot " +
             std::to_string(hdr.slot) + " (misdirected)";
    } else if (hdr.generation != b.generation) {
      what = "stale generation " + std::to_string(hdr.generation) +
             ", expected " + std::to_string(b.generation);
    }
    if (what.empty()) return Status::Ok();
    {
      MutexLock lock(&mu_);
      ++stats_.checksum_failures;
    }
    return Status::Corruption(
        "block " + std::to_string(block) + " in " + paths_[SlotFile(b.slot)] +
        " at offset " + std::to_string(SlotOffset(b.slot)) + " (header at " +
        std::to_string(HeaderOffset(b.slot)) + "): " + what);
  }

  // Declared first: destroyed last, after everything that submits to it.
  std::shared_ptr<AsyncIo> io_;
  SwapSpaceOptions options_;
  bool memory_ = false;  // in-memory engine: no real files or locks
  std::vector<FileLock> locks_;
  std::vector<FileId> file_ids_;
  std::vector<std::string> paths_;
  size_t align_ = 1;
  uint32_t header_bytes_ = kMinHeaderBytes;
  uint64_t per_file_ = 0;
  uint64_t payload_base_ = 0;  // start of the payload region in each file
  uint64_t total_slots_ = 0;
  std::shared_ptr<SlotPool> pool_;
  std::atomic<uint64_t> generation_{0};
  HostBuffer bounce_;
  IoBufferRegistration bounce_reg_;
  std::unique_ptr<HeaderPool> headers_;

  mutable Mutex mu_;
  CondVar ops_cv_;     // ops_in_flight_ dropped
  CondVar bounce_cv_;  // bounce_busy_ cleared
  SwapStats stats_ STRATA_GUARDED_BY(mu_);
  size_t ops_in_flight_ STRATA_GUARDED_BY(mu_) = 0;
  bool bounce_busy_ STRATA_GUARDED_BY(mu_) = false;
};

namespace {

StatusOr<std::unique_ptr<SwapSpace>> OpenLocked(const SwapSpaceOptions& options,
                                                std::shared_ptr<AsyncIo> io,
                                                std::vector<FileLock> locks) {
  auto space =
      std::make_unique<SwapSpaceImpl>(options, std::move(io), std::move(locks));
  STRATA_RETURN_IF_ERROR(space->Init());
  return std::unique_ptr<SwapSpace>(std::move(space));
}

}  // namespace

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceWithEngine(
    const SwapSpaceOptions& options, std::unique_ptr<IoEngine> engine) {
  STRATA_ASSIGN_OR_RETURN(
      auto locks,
      LockDirectories(options, engine->backend() == IoBackend::kMemory));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<AsyncIo> io,
                          AsyncIo::Create(std::move(engine)));
  return OpenLocked(options, std::move(io), std::move(locks));
}

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceOver(
    const SwapSpaceOptions& options, std::shared_ptr<AsyncIo> io) {
  STRATA_ASSIGN_OR_RETURN(
      auto locks,
      LockDirectories(options, io->backend() == IoBackend::kMemory));
  return OpenLocked(options, std::move(io), std::move(locks));
}

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpace(
    const SwapSpaceOptions& options) {
  if (options.shared_io != nullptr) {
    return OpenSwapSpaceOver(options, options.shared_io);
  }
  IoEngineOptions eo = options.io;
  eo.queue_depth = options.queue_depth;
  STRATA_ASSIGN_OR_RETURN(
      auto locks, LockDirectories(options, eo.backend == IoBackend::kMemory));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<AsyncIo> io, AsyncIo::Create(eo));
  return OpenLocked(options, std::move(io), std::move(locks));
}

}  // namespace strata::swap

namespace strata {

SwapHandle::SwapHandle(SwapHandle&& other) noexcept
    : pool_(std::move(other.pool_)),
      tensor_id_(other.tensor_id_),
      bytes_(other.bytes_),
      blocks_(std::move(other.blocks_)) {
  other.blocks_.clear();
}

SwapHandle& SwapHandle::operator=(SwapHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::move(other.pool_);
    tensor_id_ = other.tensor_id_;
    bytes_ = other.bytes_;
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
  }
  return *this;
}

SwapHandle::~SwapHandle() { Reset(); }

void SwapHandle::Reset() {
  if (pool_ != nullptr) {
    for (const Block& b : blocks_) {
      if (b.slot != SwapSpace::kNoSlot) pool_->Give(b.slot);
    }
  }
  pool_.reset();
  blocks_.clear();
  bytes_ = 0;
}

StatusOr<SwapHandle> SwapSpace::Write(uint64_t tensor_id,
                                      std::span<const std::byte> data) {
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, Allocate(tensor_id, data.size()));
  STRATA_ASSIGN_OR_RETURN(std::span<std::byte> bounce, AcquireBounce());
  const uint64_t step = bounce.size() / block_bytes();
  Status status;
  for (uint64_t first = 0; first < h.blocks() && status.ok(); first += step) {
    const uint64_t count = std::min<uint64_t>(step, h.blocks() - first);
    const uint64_t offset = first * block_bytes();
    const uint64_t n =
        std::min<uint64_t>(count * block_bytes(), data.size() - offset);
    std::memcpy(bounce.data(), data.data() + offset, n);
    IoTicket ticket;
    status = WriteAsync(h, first, count, bounce, IoPriority::kUrgent,
                        ticket.Setter());
    if (status.ok()) status = ticket.Wait();
  }
  ReleaseBounce();
  // On failure `h` goes out of scope: its slots are free again.
  if (!status.ok()) return status;
  return h;
}

Status SwapSpace::Read(const SwapHandle& h, std::span<std::byte> out) {
  if (out.size() != h.bytes()) {
    return Status::InvalidArgument(
        "swap read of tensor " + std::to_string(h.tensor_id()) + " into " +
        std::to_string(out.size()) + " bytes; it has " +
        std::to_string(h.bytes()));
  }
  STRATA_ASSIGN_OR_RETURN(std::span<std::byte> bounce, AcquireBounce());
  const uint64_t step = bounce.size() / block_bytes();
  Status status;
  for (uint64_t first = 0; first < h.blocks() && status.ok(); first += step) {
    const uint64_t count = std::min<uint64_t>(step, h.blocks() - first);
    IoTicket ticket;
    status = ReadAsync(h, first, count, bounce, IoPriority::kUrgent,
                       ticket.Setter());
    if (status.ok()) status = ticket.Wait();
    if (!status.ok()) break;  // nothing of a failed step is copied
    const uint64_t offset = first * block_bytes();
    const uint64_t n =
        std::min<uint64_t>(count * block_bytes(), out.size() - offset);
    std::memcpy(out.data() + offset, bounce.data(), n);
  }
  ReleaseBounce();
  return status;
}

StatusOr<std::unique_ptr<SwapSpace>> SwapSpace::Open(
    const SwapSpaceOptions& options) {
  return swap::OpenSwapSpace(options);
}

}  // namespace strata
