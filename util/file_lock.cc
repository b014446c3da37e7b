#include "util/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace strata {

StatusOr<FileLock> FileLock::Acquire(const std::string& path) {
  // Bounded: a path that changes hands this often is not going to settle.
  for (int attempt = 0; attempt < 100; ++attempt) {
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!fd) return Status::FromErrno(errno, "open lock " + path);
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        char pid[32] = {};
        (void)!::pread(fd.get(), pid, sizeof pid - 1, 0);
        return Status(StatusCode::kBusy,
                      "held by pid " +
                          (pid[0] != '\0' ? std::string(pid) : "(unknown)") +
                          " (lock " + path + ")",
                      err);
      }
      return Status::FromErrno(err, "flock " + path);
    }
    struct stat held {
    }, named{};
    if (::fstat(fd.get(), &held) != 0) {
      return Status::FromErrno(errno, "stat lock " + path);
    }
    if (::stat(path.c_str(), &named) != 0 || named.st_dev != held.st_dev ||
        named.st_ino != held.st_ino) {
      continue;  // locked a file its owner had already removed
    }
    const std::string pid = std::to_string(::getpid());
    if (::ftruncate(fd.get(), 0) != 0 ||
        ::pwrite(fd.get(), pid.data(), pid.size(), 0) !=
            static_cast<ssize_t>(pid.size())) {
      const int err = errno;
      ::unlink(path.c_str());  // ours: nothing is left behind
      return Status::FromErrno(err, "write lock " + path);
    }
    return FileLock(path, std::move(fd));
  }
  return Status(StatusCode::kBusy, "lock " + path + " keeps changing hands");
}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    fd_ = std::move(other.fd_);
  }
  return *this;
}

void FileLock::Release() {
  if (fd_) ::unlink(path_.c_str());
  fd_.reset();
}

}  // namespace strata
