// Internal: a SwapSpace over a given engine (tests pass fault-injecting ones).
#ifndef STRATA_SWAP_SWAP_SPACE_INTERNAL_H_
#define STRATA_SWAP_SWAP_SPACE_INTERNAL_H_

#include <memory>

#include "strata/swap_space.h"

namespace strata::swap {

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceWithEngine(
    const SwapSpaceOptions& options, std::unique_ptr<IoEngine> engine);

// The on-disk block header (little-endian, the start of every slot).
struct BlockHeader {
  static constexpr uint64_t kMagic = 0x5753415441525453ull;  // "STRATASW"
  static constexpr uint32_t kVersion = 1;
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t tensor_id;
  uint64_t generation;
  uint64_t block_index;
  uint64_t slot;
  uint64_t payload_bytes;
  uint64_t checksum;  // XXH3-64 of this header (checksum = 0) and payload
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_SWAP_SPACE_INTERNAL_H_
