// XXH3 built for the avx512 instruction set (flags in util/CMakeLists.txt).
#define STRATA_XXH3_VARIANT avx512
// GCC 12 reports the _mm512_undefined_* values inside its own
// avx512fintrin.h, which xxhash's AVX-512 reduction inlines, as
// (maybe-)uninitialized: a false positive in the compiler's header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "util/checksum.h"
#include "util/checksum_impl.h"

namespace strata::checksum_internal {

const Xxh3Fns kXxh3Avx512{avx512::One, avx512::Two};

}  // namespace strata::checksum_internal
