// POSIX defaults of Backend's file calls, and direct-I/O alignment probing.
#include <fcntl.h>
#include <linux/stat.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "swap/backend.h"

namespace strata::swap {
namespace {

constexpr size_t kDefaultAlignment = 4096;

// statx(STATX_DIOALIGN) through the raw syscall: glibc 2.36's struct statx
// predates the field (Linux 6.1).
size_t StatxDioAlign(int fd) {
  struct statx stx {};
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) {
    return 0;
  }
  if (!(stx.stx_mask & STATX_DIOALIGN)) return 0;
  const size_t mem = stx.stx_dio_mem_align;
  const size_t off = stx.stx_dio_offset_align;
  return mem > off ? mem : off;
}

size_t LogicalBlockSize(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  const std::string path =
      "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
      std::to_string(minor(st.st_dev)) + "/queue/logical_block_size";
  std::ifstream in(path);
  size_t v = 0;
  if (in >> v) return v;
  // A partition's queue/ lives in its parent's directory.
  std::ifstream in2("/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                    std::to_string(minor(st.st_dev)) +
                    "/../queue/logical_block_size");
  if (in2 >> v) return v;
  return 0;
}

}  // namespace

int Backend::OpenFile(const std::string& path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd >= 0 ? fd : -errno;
}

void Backend::CloseFile(int fd) { ::close(fd); }

int Backend::Fallocate(int fd, uint64_t bytes) {
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return 0;
  if (errno != EOPNOTSUPP) return -errno;
  // Filesystems without fallocate: posix_fallocate writes zeros.
  rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  return -rc;
}

int Backend::Fsync(int fd) { return ::fsync(fd) == 0 ? 0 : -errno; }

int64_t Backend::FileSize(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return -errno;
  return st.st_size;
}

size_t Backend::DirectAlignment(int fd) {
  if (size_t a = StatxDioAlign(fd); a > 0) return a;
  if (size_t a = LogicalBlockSize(fd); a > 0) return a;
  return kDefaultAlignment;
}

int Backend::AddBuffer(std::span<std::byte>) { return -1; }

void Backend::RemoveBuffer(int) {}

Status Backend::RegisterBuffers(std::span<const std::span<std::byte>> bufs) {
  for (int index : registered_) RemoveBuffer(index);
  registered_.clear();
  for (const auto& b : bufs) {
    if (int index = AddBuffer(b); index >= 0) registered_.push_back(index);
  }
  return Status::Ok();
}

void SignalEventFd(int fd) { (void)!::eventfd_write(fd, 1); }

int NewEventFd() { return ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

Backend::Backend() : event_fd_(NewEventFd()) {}

}  // namespace strata::swap
