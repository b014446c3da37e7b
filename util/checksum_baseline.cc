// XXH3 built for the baseline instruction set (flags in util/CMakeLists.txt).
#define STRATA_XXH3_VARIANT baseline
#include "util/checksum.h"
#include "util/checksum_impl.h"

namespace strata::checksum_internal {

const Xxh3Fns kXxh3Baseline{baseline::One, baseline::Two};

}  // namespace strata::checksum_internal
