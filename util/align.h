// Alignment, one definition for every module: sizes and offsets rounded to
// pages, blocks and direct-I/O sectors, and allocations that start on a
// cache line.
#ifndef STRATA_UTIL_ALIGN_H_
#define STRATA_UTIL_ALIGN_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

namespace strata {

// n rounded up to a multiple of a. REQUIRES: a > 0 and n + a - 1 fits.
constexpr uint64_t RoundUp(uint64_t n, uint64_t a) {
  return (n + a - 1) / a * a;
}

// A cache line of the CPUs strata runs on.
inline constexpr size_t kCacheLine = 64;

// An allocator whose blocks start on a multiple of kAlign bytes. A loop
// that moves an array a 64-byte register at a time splits a cache line on
// every access when the array starts off a line's boundary, as a large
// std::vector does (glibc returns 16-byte aligned blocks).
template <class T, size_t kAlign = kCacheLine>
class AlignedAllocator {
 public:
  static_assert(kAlign >= alignof(T) && (kAlign & (kAlign - 1)) == 0);
  using value_type = T;
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, kAlign>;
  };

  AlignedAllocator() noexcept = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U, kAlign>&) noexcept {}

  T* allocate(size_t n) {
    if (n > std::numeric_limits<size_t>::max() / sizeof(T)) {
      throw std::bad_array_new_length();
    }
    return static_cast<T*>(
        ::operator new (n * sizeof(T), std::align_val_t{kAlign}));
  }
  void deallocate(T* p, size_t) noexcept {
    ::operator delete (p, std::align_val_t{kAlign});
  }

  template <class U>
  bool operator==(const AlignedAllocator<U, kAlign>&) const noexcept {
    return true;
  }
};

// A std::vector whose data starts on a cache line.
template <class T>
using LineAlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace strata

#endif  // STRATA_UTIL_ALIGN_H_
