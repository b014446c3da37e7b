// Rounding sizes and offsets to alignments (pages, blocks, direct-I/O
// sectors): one definition for every module.
#ifndef STRATA_UTIL_ALIGN_H_
#define STRATA_UTIL_ALIGN_H_

#include <cstdint>

namespace strata {

// n rounded up to a multiple of a. REQUIRES: a > 0 and n + a - 1 fits.
constexpr uint64_t RoundUp(uint64_t n, uint64_t a) {
  return (n + a - 1) / a * a;
}

}  // namespace strata

#endif  // STRATA_UTIL_ALIGN_H_
