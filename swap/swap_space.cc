#include "strata/swap_space.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "strata/host_buffer.h"
#include "swap/swap_space_internal.h"
#include "util/log.h"
#include "util/unique_handle.h"

namespace strata::swap {
namespace {

constexpr uint32_t kMinHeaderBytes = 4096;
constexpr const char* kLockName = "strata-swap.lock";
constexpr const char* kFilePrefix = "strata-swap-";
constexpr const char* kFileSuffix = ".swp";

uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

uint64_t Checksum(const BlockHeader& h, const std::byte* payload) {
  BlockHeader copy = h;
  copy.checksum = 0;
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, &copy, sizeof copy);
  XXH3_64bits_update(&state, payload, h.payload_bytes);
  return XXH3_64bits_digest(&state);
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs s {};
  if (statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// Takes <dir>/strata-swap.lock, or says who holds it.
StatusOr<UniqueFd> LockDirectory(const std::string& dir) {
  const std::string path = dir + "/" + kLockName;
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd) return Status::FromErrno(errno, "open swap lock " + path);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      char pid[32] = {};
      (void)!::pread(fd.get(), pid, sizeof pid - 1, 0);
      return Status(StatusCode::kBusy,
                    "swap directory " + dir +
                        " is in use by another strata engine (pid " +
                        std::string(pid) + ", lock " + path +
                        "); give each job its own directory",
                    err);
    }
    return Status::FromErrno(err, "flock " + path);
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd.get(), 0) != 0 ||
      ::pwrite(fd.get(), pid.data(), pid.size(), 0) !=
          static_cast<ssize_t>(pid.size())) {
    return Status::FromErrno(errno, "write swap lock " + path);
  }
  return fd;
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

class SwapSpaceImpl final : public SwapSpace {
 public:
  SwapSpaceImpl(const SwapSpaceOptions& o, std::unique_ptr<IoEngine> engine)
      : options_(o), engine_(std::move(engine)) {}

  ~SwapSpaceImpl() override {
    for (size_t i = 0; i < file_ids_.size(); ++i) {
      engine_->Close(file_ids_[i]).IgnoreError();
      if (!memory_) ::unlink(paths_[i].c_str());
    }
    engine_.reset();  // drains before the bounce buffers go
    for (size_t i = 0; i < locks_.size(); ++i) {
      ::unlink((options_.dirs[i] + "/" + kLockName).c_str());
    }
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
    memory_ = engine_->backend() == IoBackend::kMemory;
    const bool memory = memory_;
    const uint64_t blocks = std::max<uint64_t>(
        1, RoundUp(o.capacity_bytes, o.block_bytes) / o.block_bytes);
    const uint64_t per_file = RoundUp(blocks, o.dirs.size()) / o.dirs.size();
    total_slots_ = per_file * o.dirs.size();
    if (total_slots_ > UINT32_MAX) {
      return Status::InvalidArgument("swap capacity exceeds 2^32 blocks");
    }
    // Lock every directory before touching any file in it.
    for (const auto& dir : o.dirs) {
      if (memory) continue;
      STRATA_ASSIGN_OR_RETURN(UniqueFd lock, LockDirectory(dir));
      locks_.push_back(std::move(lock));
      RemoveStaleFiles(dir);
    }
    for (const auto& dir : o.dirs) {
      const std::string path =
          dir + "/" + kFilePrefix + std::to_string(::getpid()) + kFileSuffix;
      STRATA_ASSIGN_OR_RETURN(
          FileId id,
          engine_->Open(path,
                        {.writable = true, .create = true, .truncate = true}));
      file_ids_.push_back(id);
      paths_.push_back(path);
      header_bytes_ = std::max<uint32_t>(
          header_bytes_, static_cast<uint32_t>(std::max<size_t>(
                             kMinHeaderBytes, engine_->alignment(id))));
    }
    if (o.block_bytes % header_bytes_ != 0) {
      return Status::InvalidArgument(
          "block_bytes " + std::to_string(o.block_bytes) +
          " is not a multiple of the device's direct-I/O alignment " +
          std::to_string(header_bytes_));
    }
    slot_bytes_ = uint64_t{header_bytes_} + o.block_bytes;
    const uint64_t file_bytes = per_file * slot_bytes_;
    for (size_t i = 0; i < file_ids_.size(); ++i) {
      // Out of space is found now, before training, not mid-step.
      const uint64_t free = memory ? file_bytes : FreeBytes(o.dirs[i]);
      Status s = free < file_bytes
                     ? Status::FromErrno(ENOSPC, "preallocate swap file")
                     : engine_->Allocate(file_ids_[i], file_bytes);
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
    for (uint64_t s = 0; s < total_slots_; ++s) {
      free_.insert(static_cast<uint32_t>(s));
    }
    HostBufferOptions bo;
    bo.pin = o.pin_buffers;
    auto bounce = HostBuffer::Allocate(slot_bytes_ * o.queue_depth, bo);
    if (!bounce.ok()) {
      return std::move(bounce).status().WithContext(
          "swap space bounce buffers (queue_depth " +
          std::to_string(o.queue_depth) + " x " + std::to_string(slot_bytes_) +
          "-byte slots)");
    }
    bounce_ = std::move(*bounce);
    const std::span<std::byte> whole = bounce_.span();
    STRATA_RETURN_IF_ERROR(engine_->RegisterBuffers({&whole, 1}));
    return Status::Ok();
  }

  StatusOr<SwapHandle> Write(uint64_t tensor_id,
                             std::span<const std::byte> data) override {
    SwapHandle h;
    h.tensor_id = tensor_id;
    h.generation = ++generation_;
    h.bytes = data.size();
    const uint64_t nblocks =
        RoundUp(data.size(), options_.block_bytes) / options_.block_bytes;
    if (nblocks > free_.size()) {
      return Status::NoSpace("swap space full: tensor " +
                             std::to_string(tensor_id) + " needs " +
                             std::to_string(nblocks) + " blocks of " +
                             std::to_string(options_.block_bytes) + " bytes, " +
                             std::to_string(free_.size()) + " of " +
                             std::to_string(total_slots_) + " are free");
    }
    for (uint64_t i = 0; i < nblocks; ++i) h.slots.push_back(TakeSlot());

    Status status = RunBlocks(h, nblocks, IoOp::kWrite, data.data(), &h);
    if (!status.ok()) {
      // Nothing of this write is valid; its slots are free again.
      for (uint32_t s : h.slots) {
        if (s != kNoSlot) free_.insert(s);
      }
      return status.WithContext("swap write of tensor " +
                                std::to_string(tensor_id));
    }
    return h;
  }

  Status Read(const SwapHandle& h, std::span<std::byte> out) override {
    if (out.size() != h.bytes) {
      return Status::InvalidArgument(
          "swap read of tensor " + std::to_string(h.tensor_id) + " into " +
          std::to_string(out.size()) + " bytes; it has " +
          std::to_string(h.bytes));
    }
    return RunBlocks(h, h.slots.size(), IoOp::kRead, out.data(), nullptr)
        .WithContext("swap read of tensor " + std::to_string(h.tensor_id));
  }

  void Free(SwapHandle&& h) override {
    for (uint32_t s : h.slots) free_.insert(s);
    h.slots.clear();
  }

  uint64_t capacity_blocks() const override { return total_slots_; }
  uint64_t free_blocks() const override { return free_.size(); }
  uint32_t block_bytes() const override { return options_.block_bytes; }
  const std::vector<std::string>& files() const override { return paths_; }
  uint64_t SlotOffset(uint32_t slot) const override {
    return (slot / file_ids_.size()) * slot_bytes_;
  }
  size_t SlotFile(uint32_t slot) const override {
    return slot % file_ids_.size();
  }
  uint32_t header_bytes() const override { return header_bytes_; }
  std::string_view engine_name() const override { return engine_->name(); }
  SwapStats stats() const override { return stats_; }

 private:
  static constexpr uint32_t kNoSlot = UINT32_MAX;

  uint32_t TakeSlot() {
    auto it = free_.begin();
    const uint32_t s = *it;
    free_.erase(it);
    return s;
  }

  uint64_t PayloadBytes(const SwapHandle& h, uint64_t block) const {
    const uint64_t start = block * options_.block_bytes;
    return std::min<uint64_t>(options_.block_bytes, h.bytes - start);
  }

  // Bytes of I/O for a block: header plus payload rounded to the alignment.
  uint64_t IoBytes(uint64_t payload) const {
    return header_bytes_ + RoundUp(payload, header_bytes_);
  }

  std::byte* Bounce(size_t i) { return bounce_.data() + i * slot_bytes_; }

  void FillForWrite(const SwapHandle& h, uint64_t block, const std::byte* src,
                    std::byte* dst) {
    const uint64_t payload = PayloadBytes(h, block);
    std::memcpy(dst + header_bytes_, src + block * options_.block_bytes,
                payload);
    const uint64_t pad = IoBytes(payload) - header_bytes_ - payload;
    std::memset(dst + header_bytes_ + payload, 0, pad);
    StampHeader(h, block, dst);
  }

  void StampHeader(const SwapHandle& h, uint64_t block, std::byte* dst) {
    BlockHeader hdr{};
    hdr.magic = BlockHeader::kMagic;
    hdr.version = BlockHeader::kVersion;
    hdr.header_bytes = header_bytes_;
    hdr.tensor_id = h.tensor_id;
    hdr.generation = h.generation;
    hdr.block_index = block;
    hdr.slot = h.slots[block];
    hdr.payload_bytes = PayloadBytes(h, block);
    hdr.checksum = Checksum(hdr, dst + header_bytes_);
    std::memset(dst, 0, header_bytes_);
    std::memcpy(dst, &hdr, sizeof hdr);
  }

  // Verifies a block read into `buf`; on success copies its payload out.
  Status VerifyAndCopy(const SwapHandle& h, uint64_t block,
                       const std::byte* buf, std::byte* out) {
    BlockHeader hdr;
    std::memcpy(&hdr, buf, sizeof hdr);
    const uint32_t slot = h.slots[block];
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
    } else if (hdr.checksum != Checksum(hdr, buf + header_bytes_)) {
      what = "checksum mismatch";
    } else if (hdr.tensor_id != h.tensor_id || hdr.block_index != block ||
               hdr.slot != slot) {
      what = "block belongs to tensor " + std::to_string(hdr.tensor_id) +
             " block " + std::to_string(hdr.block_index) + " slot " +
             std::to_string(hdr.slot) + " (misdirected)";
    } else if (hdr.generation != h.generation) {
      what = "stale generation " + std::to_string(hdr.generation) +
             ", expected " + std::to_string(h.generation);
    }
    if (!what.empty()) {
      ++stats_.checksum_failures;
      return Status::Corruption("block " + std::to_string(block) + " in " +
                                paths_[SlotFile(slot)] + " at offset " +
                                std::to_string(SlotOffset(slot)) + ": " + what);
    }
    std::memcpy(out + block * options_.block_bytes, buf + header_bytes_,
                payload);
    return Status::Ok();
  }

  // Runs the blocks of `h` through the bounce buffers with up to queue_depth
  // in flight. Writes relocate blocks whose slot the device failed.
  // `relocate` is the handle itself for writes (so a failed slot can be
  // replaced in it) and null for reads, which never move blocks.
  Status RunBlocks(const SwapHandle& h, uint64_t nblocks, IoOp op,
                   const void* data, SwapHandle* relocate) {
    const size_t depth = options_.queue_depth;
    std::vector<size_t> free_bounce;
    for (size_t i = depth; i-- > 0;) free_bounce.push_back(i);
    std::vector<uint64_t> bounce_block(depth);
    std::vector<uint32_t> relocations(nblocks, 0);
    std::vector<IoCompletion> done(depth);
    uint64_t next = 0;
    Status first_error;

    auto submit = [&](size_t b, uint64_t block) -> Status {
      const uint32_t slot = h.slots[block];
      const uint64_t bytes = IoBytes(PayloadBytes(h, block));
      IoRequest r{file_ids_[SlotFile(slot)],
                  SlotOffset(slot),
                  {Bounce(b), bytes},
                  op,
                  b};
      bounce_block[b] = block;
      return engine_->Submit({&r, 1});
    };

    while ((next < nblocks && first_error.ok()) || engine_->in_flight() > 0) {
      while (next < nblocks && first_error.ok() && !free_bounce.empty()) {
        const size_t b = free_bounce.back();
        free_bounce.pop_back();
        if (op == IoOp::kWrite) {
          FillForWrite(h, next, static_cast<const std::byte*>(data), Bounce(b));
        }
        Status s = submit(b, next);
        if (!s.ok()) {
          free_bounce.push_back(b);
          first_error = std::move(s);
          break;
        }
        ++next;
      }
      if (engine_->in_flight() == 0) break;
      STRATA_ASSIGN_OR_RETURN(size_t n, engine_->Reap(done, 1));
      for (size_t i = 0; i < n; ++i) {
        const size_t b = done[i].tag;
        const uint64_t block = bounce_block[b];
        Status s = std::move(done[i].status);
        if (s.ok() && op == IoOp::kRead) {
          s = VerifyAndCopy(h, block, Bounce(b),
                            static_cast<std::byte*>(const_cast<void*>(data)));
          if (s.ok()) {
            ++stats_.blocks_read;
            stats_.bytes_read += PayloadBytes(h, block);
          }
        } else if (s.ok()) {
          ++stats_.blocks_written;
          stats_.bytes_written += PayloadBytes(h, block);
        } else if (op == IoOp::kWrite && s.code() == StatusCode::kIoError &&
                   relocations[block] < options_.max_relocations &&
                   !free_.empty() && first_error.ok()) {
          // The device failed this slot: retire it and rewrite the block,
          // still in the bounce buffer, elsewhere.
          STRATA_LOG_WARN("retiring swap slot {} ({}); rewriting block",
                          h.slots[block], s.ToString());
          ++stats_.retired_slots;
          ++stats_.relocations;
          ++relocations[block];
          relocate->slots[block] = TakeSlot();
          StampHeader(h, block, Bounce(b));
          s = submit(b, block);
          if (s.ok()) continue;  // bounce buffer still busy
        } else if (op == IoOp::kWrite && s.code() == StatusCode::kIoError) {
          // Out of relocations: this slot is bad too.
          ++stats_.retired_slots;
          relocate->slots[block] = kNoSlot;
        }
        if (!s.ok() && first_error.ok()) first_error = std::move(s);
        free_bounce.push_back(b);
      }
    }
    return first_error;
  }

  SwapSpaceOptions options_;
  std::unique_ptr<IoEngine> engine_;
  bool memory_ = false;  // in-memory engine: no real files or locks
  std::vector<UniqueFd> locks_;
  std::vector<FileId> file_ids_;
  std::vector<std::string> paths_;
  uint32_t header_bytes_ = kMinHeaderBytes;
  uint64_t slot_bytes_ = 0;
  uint64_t total_slots_ = 0;
  std::set<uint32_t> free_;  // lowest first: consecutive slots alternate dirs
  uint64_t generation_ = 0;
  HostBuffer bounce_;
  SwapStats stats_;
};

}  // namespace

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceWithEngine(
    const SwapSpaceOptions& options, std::unique_ptr<IoEngine> engine) {
  auto space = std::make_unique<SwapSpaceImpl>(options, std::move(engine));
  STRATA_RETURN_IF_ERROR(space->Init());
  return std::unique_ptr<SwapSpace>(std::move(space));
}

}  // namespace strata::swap

namespace strata {

StatusOr<std::unique_ptr<SwapSpace>> SwapSpace::Open(
    const SwapSpaceOptions& options) {
  IoEngineOptions io = options.io;
  io.queue_depth = options.queue_depth;
  STRATA_ASSIGN_OR_RETURN(auto engine, NewIoEngine(io));
  return swap::OpenSwapSpaceWithEngine(options, std::move(engine));
}

}  // namespace strata
