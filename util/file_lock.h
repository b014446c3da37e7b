// FileLock: an exclusive, non-blocking flock on a lock file that says which
// process holds it (its pid is written in the file). Used to give one
// directory to one process at a time (the swap directories, the checkpoint
// directory).
//
// The lock counts only on the file that is at the path once it is held: the
// holder unlinks the file (while still holding it) before it lets go, so a
// process that opened the old file before that and is granted its lock
// afterwards would otherwise own the directory that a third process has
// meanwhile locked anew through a fresh file. Such a lock is dropped and the
// path opened again.
//
// Thread-compatible; move-only. An flock belongs to the open file
// description, so a second Acquire of the same path in the same process is
// refused as well (kBusy).
#ifndef STRATA_UTIL_FILE_LOCK_H_
#define STRATA_UTIL_FILE_LOCK_H_

#include <string>

#include "strata/status.h"
#include "util/unique_handle.h"

namespace strata {

class FileLock {
 public:
  // Creates (mode 0600) and locks `path`. kBusy when another holder has it:
  // the message is "held by pid <N> (lock <path>)" (<N> "(unknown)" when the
  // file names none yet), for the caller to put in its own words; also
  // kBusy when the path changed hands 100 times while we tried.
  static StatusOr<FileLock> Acquire(const std::string& path);

  FileLock() = default;
  FileLock(FileLock&&) noexcept = default;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  // Unlinks the file while still holding it, then closes it.
  ~FileLock() { Release(); }

  bool held() const { return fd_.valid(); }
  const std::string& path() const { return path_; }

 private:
  FileLock(std::string path, UniqueFd fd)
      : path_(std::move(path)), fd_(std::move(fd)) {}
  void Release();

  std::string path_;
  UniqueFd fd_;
};

}  // namespace strata

#endif  // STRATA_UTIL_FILE_LOCK_H_
