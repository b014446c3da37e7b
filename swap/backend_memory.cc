// In-memory backend for tests: files are byte vectors keyed by path, shared by
// every memory engine of the process (so two engines see the same "disk").
// Operations complete at submission. Direct-I/O alignment is 4096, so the
// engine's alignment checks run against it too.
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "swap/backend.h"
#include "util/mutex.h"

namespace strata::swap {
namespace {

struct MemFile {
  Mutex mu;
  std::vector<std::byte> data STRATA_GUARDED_BY(mu);
};

struct MemDisk {
  Mutex mu;
  std::map<std::string, std::shared_ptr<MemFile>> files STRATA_GUARDED_BY(mu);
};

MemDisk& Disk() {
  static MemDisk* disk = new MemDisk;
  return *disk;
}

class MemoryBackend final : public Backend {
 public:
  explicit MemoryBackend(uint32_t capacity) : capacity_(capacity) {}

  IoBackend kind() const override { return IoBackend::kMemory; }
  uint32_t capacity() const override { return capacity_; }

  int OpenFile(const std::string& path, int flags, mode_t) override {
    std::shared_ptr<MemFile> f;
    {
      MemDisk& d = Disk();
      MutexLock lock(&d.mu);
      auto it = d.files.find(path);
      if (it == d.files.end()) {
        if (!(flags & O_CREAT)) return -ENOENT;
        it = d.files.emplace(path, std::make_shared<MemFile>()).first;
      }
      f = it->second;
    }
    if (flags & O_TRUNC) {
      MutexLock lock(&f->mu);
      f->data.clear();
    }
    const int fd = next_fd_++;
    open_[fd] = std::move(f);
    return fd;
  }

  void CloseFile(int fd) override { open_.erase(fd); }

  int Fallocate(int fd, uint64_t bytes) override {
    MemFile* f = Find(fd);
    if (f == nullptr) return -EBADF;
    MutexLock lock(&f->mu);
    if (f->data.size() < bytes) f->data.resize(bytes);
    return 0;
  }

  int Fsync(int fd) override { return Find(fd) ? 0 : -EBADF; }

  int64_t FileSize(int fd) override {
    MemFile* f = Find(fd);
    if (f == nullptr) return -EBADF;
    MutexLock lock(&f->mu);
    return static_cast<int64_t>(f->data.size());
  }

  size_t DirectAlignment(int) override { return 4096; }

  StatusOr<size_t> Submit(std::span<const RawOp> ops) override {
    for (const RawOp& op : ops) done_.push_back({op.slot, Execute(op)});
    if (!ops.empty()) SignalReady();
    return ops.size();
  }

  StatusOr<size_t> Wait(std::span<RawResult> out, size_t) override {
    return DrainResults(done_, out);
  }

 private:
  MemFile* Find(int fd) {
    auto it = open_.find(fd);
    return it == open_.end() ? nullptr : it->second.get();
  }

  int64_t Execute(const RawOp& op) {
    MemFile* f = Find(op.fd);
    if (f == nullptr) return -EBADF;
    MutexLock lock(&f->mu);
    if (op.op == IoOp::kWrite) {
      if (f->data.size() < op.offset + op.len) {
        f->data.resize(op.offset + op.len);
      }
      std::memcpy(f->data.data() + op.offset, op.buf, op.len);
      return op.len;
    }
    if (op.offset >= f->data.size()) return 0;
    const uint64_t n = std::min<uint64_t>(op.len, f->data.size() - op.offset);
    std::memcpy(op.buf, f->data.data() + op.offset, n);
    return static_cast<int64_t>(n);
  }

  const uint32_t capacity_;
  int next_fd_ = 1000;
  std::map<int, std::shared_ptr<MemFile>> open_;
  std::deque<RawResult> done_;
};

}  // namespace

std::unique_ptr<Backend> NewMemoryBackend(const IoEngineOptions& o) {
  return std::make_unique<MemoryBackend>(o.queue_depth);
}

}  // namespace strata::swap
