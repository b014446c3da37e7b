// XXH3 built for the avx2 instruction set (flags in util/CMakeLists.txt).
#define STRATA_XXH3_VARIANT avx2
#include "util/checksum.h"
#include "util/checksum_impl.h"

namespace strata::checksum_internal {

const Xxh3Fns kXxh3Avx2{avx2::One, avx2::Two};

}  // namespace strata::checksum_internal
