// CheckpointFs over POSIX: data files through an AsyncIo (direct I/O where
// the filesystem allows), everything else with plain system calls.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/manifest.h"
#include "strata/async_io.h"
#include "strata/checkpoint.h"
#include "util/file_lock.h"
#include "util/mutex.h"
#include "util/unique_handle.h"

namespace strata {
namespace {

constexpr const char* kLockName = "writer.lock";
// Directory levels RemoveAll descends at most (a checkpoint has two).
constexpr int kMaxRemoveDepth = 64;
// Largest single request a data transfer is split into (bytes).
constexpr uint64_t kChunkBytes = uint64_t{64} << 20;
// The least a data file being written grows by at a time (bytes).
constexpr uint64_t kMinReserve = uint64_t{256} << 20;

class PosixFile final : public CheckpointFs::File {
 public:
  // `reserved`: the bytes the file has already (Overwrite), kept as
  // reserved space that Sync cuts to what was written.
  PosixFile(AsyncIo* io, FileId id, UniqueFd fd, std::string path,
            uint64_t reserved)
      : io_(io),
        id_(id),
        fd_(std::move(fd)),
        path_(std::move(path)),
        reserved_(reserved) {}
  ~PosixFile() override {
    {
      MutexLock lock(&mu_);
      while (in_flight_ > 0) cv_.Wait(&mu_);
    }
    io_->Close(id_).IgnoreError();  // nothing in flight: cannot fail
  }

  void Write(uint64_t offset, std::span<const std::byte> buf,
             std::function<void(Status)> done) override {
    if (Status s = Reserve(offset + buf.size()); !s.ok()) {
      done(std::move(s));
      return;
    }
    // The engine only reads a write's buffer.
    Transfer(IoOp::kWrite, offset,
             {const_cast<std::byte*>(buf.data()), buf.size()}, std::move(done));
  }
  void Read(uint64_t offset, std::span<std::byte> buf,
            std::function<void(Status)> done) override {
    Transfer(IoOp::kRead, offset, buf, std::move(done));
  }
  // The reserved tail beyond the last byte written goes first, so the size
  // that is made durable is the data's.
  Status Sync() override {
    uint64_t end, reserved;
    {
      MutexLock lock(&mu_);
      end = end_;
      reserved = reserved_;
    }
    if (reserved > end &&
        ::ftruncate(fd_.get(), static_cast<off_t>(end)) != 0) {
      return Status::FromErrno(errno, "truncate " + path_);
    }
    {
      MutexLock lock(&mu_);
      reserved_ = std::min(reserved_, end);
    }
    return io_->Sync(id_);
  }
  StatusOr<uint64_t> Size() override {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) {
      return Status::FromErrno(errno, "stat " + path_);
    }
    return static_cast<uint64_t>(st.st_size);
  }

 private:
  // Note [Reserving ahead]: a direct write that extends a file is, on ext4
  // and XFS, done under the inode's exclusive lock and waited for before
  // the size changes, so a checkpoint's data file written from empty takes
  // its extending writes one at a time, however many are in flight. The
  // file is therefore grown ahead of the writes with fallocate (at least
  // kMinReserve, doubling), which makes every write land inside the file;
  // Sync cuts the unused tail. Without fallocate support (EOPNOTSUPP) the
  // writes extend the file as before; a refusal for lack of space fails the
  // write, naming the file, before any of it is issued.
  Status Reserve(uint64_t end) STRATA_EXCLUDES(mu_) {
    uint64_t want;
    {
      MutexLock lock(&mu_);
      end_ = std::max(end_, end);
      if (end <= reserved_ || !reserve_) return Status::Ok();
      want = std::max({end, 2 * reserved_, kMinReserve});
    }
    // Outside the lock: fallocate is file-system work. Two writers may
    // both grow the file; the second's call changes nothing.
    if (::fallocate(fd_.get(), 0, 0, static_cast<off_t>(want)) != 0) {
      const int err = errno;
      if (err == EOPNOTSUPP || err == ENOSYS) {
        MutexLock lock(&mu_);
        reserve_ = false;
        return Status::Ok();
      }
      return Status::FromErrno(
          err, "reserve " + std::to_string(want) + " bytes for " + path_);
    }
    MutexLock lock(&mu_);
    reserved_ = std::max(reserved_, want);
    return Status::Ok();
  }

  void Transfer(IoOp op, uint64_t offset, std::span<std::byte> buf,
                std::function<void(Status)> done) {
    if (buf.empty()) {
      done(Status::Ok());
      return;
    }
    // One request per chunk, all in one batch (the engine caps a request).
    std::vector<IoRequest> batch;
    for (uint64_t at = 0; at < buf.size(); at += kChunkBytes) {
      IoRequest req;
      req.file = id_;
      req.offset = offset + at;
      req.buf =
          buf.subspan(at, std::min<uint64_t>(kChunkBytes, buf.size() - at));
      req.op = op;
      req.tag = at;
      batch.push_back(req);
    }
    {
      MutexLock lock(&mu_);
      ++in_flight_;
    }
    auto shared_done =
        std::make_shared<std::function<void(Status)>>(std::move(done));
    Status s =
        io_->Submit(batch, IoPriority::kBackground,
                    [this, shared_done](std::span<IoCompletion> completions) {
                      (*shared_done)(FirstError(completions));
                      Finish();
                    });
    if (!s.ok()) {
      Finish();
      (*shared_done)(std::move(s).WithContext(
          std::string(op == IoOp::kRead ? "read " : "write ") + path_ +
          " at offset " + std::to_string(offset)));
    }
  }
  void Finish() STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    --in_flight_;
    cv_.SignalAll();  // under the lock: the destructor may run right after
  }

  AsyncIo* const io_;
  const FileId id_;
  UniqueFd fd_;  // for fstat; the engine has its own descriptor
  const std::string path_;
  Mutex mu_;
  CondVar cv_;
  int64_t in_flight_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t end_ STRATA_GUARDED_BY(mu_) = 0;     // of the data written
  uint64_t reserved_ STRATA_GUARDED_BY(mu_);    // the file's allocated size
  bool reserve_ STRATA_GUARDED_BY(mu_) = true;  // fallocate works here
};

class PosixLock final : public CheckpointFs::Lock {
 public:
  explicit PosixLock(FileLock lock) : lock_(std::move(lock)) {}

 private:
  FileLock lock_;
};

// Removes `name` under the directory `parent` (a file, or a directory and
// everything in it), never following a symbolic link. `path` is for
// messages.
Status RemoveAt(int parent, const char* name, const std::string& path,
                int depth) {
  struct stat st {};
  if (::fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return Status::FromErrno(errno, "stat " + path);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlinkat(parent, name, 0) != 0 && errno != ENOENT) {
      return Status::FromErrno(errno, "remove " + path);
    }
    return Status::Ok();
  }
  if (depth >= kMaxRemoveDepth) {
    return Status::FailedPrecondition(
        "remove " + path + ": nested deeper than " +
        std::to_string(kMaxRemoveDepth) + " directories");
  }
  const int fd =
      ::openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "open directory " + path);
  DIR* d = ::fdopendir(fd);  // owns fd from here
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno(err, "open directory " + path);
  }
  std::vector<std::string> names;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  const int read_err = errno;
  Status s = read_err != 0 ? Status::FromErrno(read_err, "list " + path)
                           : Status::Ok();
  for (const std::string& n : names) {
    if (!s.ok()) break;
    s = RemoveAt(::dirfd(d), n.c_str(), path + "/" + n, depth + 1);
  }
  ::closedir(d);
  STRATA_RETURN_IF_ERROR(s);
  if (::unlinkat(parent, name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, "remove directory " + path);
  }
  return Status::Ok();
}

class PosixCheckpointFs final : public CheckpointFs {
 public:
  PosixCheckpointFs(AsyncIo* io, std::unique_ptr<AsyncIo> owned)
      : owned_(std::move(owned)), io_(io != nullptr ? io : owned_.get()) {}

  StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    UniqueFd fd(
        ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return Status::FromErrno(errno, "create " + path);
    return OpenData(path, std::move(fd), /*writable=*/true, 0);
  }

  StatusOr<std::unique_ptr<File>> Overwrite(const std::string& path) override {
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) return Status::FromErrno(errno, "open " + path + " to overwrite");
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      return Status::FromErrno(errno, "stat " + path);
    }
    if (!S_ISREG(st.st_mode)) {
      return Status::InvalidArgument(path + " is not a regular file");
    }
    return OpenData(path, std::move(fd), /*writable=*/true,
                    static_cast<uint64_t>(st.st_size));
  }

  StatusOr<std::unique_ptr<File>> Open(const std::string& path) override {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return Status::FromErrno(errno, "open " + path);
    return OpenData(path, std::move(fd), /*writable=*/false, 0);
  }

  StatusOr<std::string> ReadSmall(const std::string& path) override {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return Status::FromErrno(errno, "open " + path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      return Status::FromErrno(errno, "stat " + path);
    }
    if (!S_ISREG(st.st_mode)) {
      return Status::Corruption(path + " is not a regular file");
    }
    if (static_cast<uint64_t>(st.st_size) > ckpt::kMaxManifestBytes) {
      return Status::Corruption(
          path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
          std::to_string(ckpt::kMaxManifestBytes) + " a small file may have");
    }
    std::string out(static_cast<size_t>(st.st_size), '\0');
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno(errno, "read " + path);
      if (n == 0) break;  // shrank meanwhile
      done += static_cast<size_t>(n);
    }
    out.resize(done);
    return out;
  }

  Status WriteSmall(const std::string& path, std::string_view data) override {
    UniqueFd fd(
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) return Status::FromErrno(errno, "create " + path);
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n =
          ::write(fd.get(), data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        return Status::FromErrno(
            errno, "write " + path + " at offset " + std::to_string(done));
      }
      done += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0)
      return Status::FromErrno(errno, "fsync " + path);
    if (::close(fd.release()) != 0) {
      return Status::FromErrno(errno, "close " + path);
    }
    return Status::Ok();
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (::renameat(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str()) != 0) {
      return Status::FromErrno(errno, "rename " + from + " to " + to);
    }
    return Status::Ok();
  }

  Status SyncDir(const std::string& dir) override {
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd) return Status::FromErrno(errno, "open directory " + dir);
    if (::fsync(fd.get()) != 0) {
      return Status::FromErrno(errno, "fsync directory " + dir);
    }
    return Status::Ok();
  }

  Status MakeDir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0700) == 0) return Status::Ok();
    const int err = errno;
    struct stat st {};
    if (err == EEXIST && ::stat(path.c_str(), &st) == 0 &&
        S_ISDIR(st.st_mode)) {
      return Status::Ok();
    }
    return Status::FromErrno(err, "create directory " + path);
  }

  Status RemoveAll(const std::string& path) override {
    return RemoveAt(AT_FDCWD, path.c_str(), path, 0);
  }

  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return Status::FromErrno(errno, "list " + dir);
    std::vector<std::string> names;
    errno = 0;
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return Status::FromErrno(err, "list " + dir);
    return names;
  }

  StatusOr<std::unique_ptr<Lock>> LockDir(const std::string& dir) override {
    StatusOr<FileLock> lock = FileLock::Acquire(dir + "/" + kLockName);
    if (!lock.ok()) {
      if (lock.status().code() == StatusCode::kBusy) {
        return Status(StatusCode::kBusy,
                      "checkpoint directory " + dir +
                          " is being written by another writer (" +
                          std::string(lock.status().message()) + ")",
                      lock.status().sys_errno());
      }
      return lock.status().WithContext("checkpoint directory " + dir);
    }
    return std::unique_ptr<Lock>(new PosixLock(std::move(*lock)));
  }

 private:
  StatusOr<std::unique_ptr<File>> OpenData(const std::string& path, UniqueFd fd,
                                           bool writable, uint64_t reserved) {
    OpenOptions o;
    o.writable = writable;
    STRATA_ASSIGN_OR_RETURN(FileId id, io_->Open(path, o));
    if (io_->alignment(id) > kCheckpointAlign) {
      const size_t align = io_->alignment(id);
      io_->Close(id).IgnoreError();
      return Status::NotSupported(
          path + ": direct I/O there needs " + std::to_string(align) +
          "-byte alignment, more than the " + std::to_string(kCheckpointAlign) +
          " of checkpoint extents");
    }
    return std::unique_ptr<File>(
        new PosixFile(io_, id, std::move(fd), path, reserved));
  }

  std::unique_ptr<AsyncIo> owned_;
  AsyncIo* const io_;
};

}  // namespace

StatusOr<std::unique_ptr<CheckpointFs>> NewPosixCheckpointFs(AsyncIo* io) {
  std::unique_ptr<AsyncIo> owned;
  if (io == nullptr) {
    STRATA_ASSIGN_OR_RETURN(owned, AsyncIo::Create());
  }
  return std::unique_ptr<CheckpointFs>(
      new PosixCheckpointFs(io, std::move(owned)));
}

}  // namespace strata
