// The body of every checksum_<isa>.cc: XXH3 compiled inline with that file's
// instruction-set flags (xxhash.h picks its vector code from them), behind
// the two functions of checksum.h. Included once per variant, inside a
// variant-named namespace.
#ifndef STRATA_UTIL_CHECKSUM_IMPL_H_
#define STRATA_UTIL_CHECKSUM_IMPL_H_

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace strata::checksum_internal::STRATA_XXH3_VARIANT {

inline uint64_t One(const void* p, size_t n) { return XXH3_64bits(p, n); }

inline uint64_t Two(const void* a, size_t an, const void* b, size_t bn) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, a, an);
  XXH3_64bits_update(&state, b, bn);
  return XXH3_64bits_digest(&state);
}

}  // namespace strata::checksum_internal::STRATA_XXH3_VARIANT

#endif  // STRATA_UTIL_CHECKSUM_IMPL_H_
