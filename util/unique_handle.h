// UniqueHandle<Traits>: the one move-only RAII owner for OS and driver handles
// (fds, rings, io contexts, streams, events). Traits gives the handle type, the
// invalid value and how to close it:
//
//   struct FdTraits {
//     using Handle = int;
//     static constexpr int Invalid() { return -1; }
//     static void Close(int fd) { ::close(fd); }
//   };
#ifndef STRATA_UTIL_UNIQUE_HANDLE_H_
#define STRATA_UTIL_UNIQUE_HANDLE_H_

#include <unistd.h>

#include <utility>

namespace strata {

template <typename Traits>
class UniqueHandle {
 public:
  using Handle = typename Traits::Handle;

  UniqueHandle() noexcept : h_(Traits::Invalid()) {}
  explicit UniqueHandle(Handle h) noexcept : h_(h) {}
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  UniqueHandle(UniqueHandle&& o) noexcept : h_(o.release()) {}
  UniqueHandle& operator=(UniqueHandle&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  ~UniqueHandle() { reset(); }

  Handle get() const noexcept { return h_; }
  bool valid() const noexcept { return h_ != Traits::Invalid(); }
  explicit operator bool() const noexcept { return valid(); }

  Handle release() noexcept { return std::exchange(h_, Traits::Invalid()); }
  void reset(Handle h = Traits::Invalid()) noexcept {
    Handle old = std::exchange(h_, h);
    if (old != Traits::Invalid()) Traits::Close(old);
  }

 private:
  Handle h_;
};

struct FdTraits {
  using Handle = int;
  static constexpr int Invalid() { return -1; }
  static void Close(int fd) { ::close(fd); }
};
using UniqueFd = UniqueHandle<FdTraits>;

}  // namespace strata

#endif  // STRATA_UTIL_UNIQUE_HANDLE_H_
