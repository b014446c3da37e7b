// Internal: a SwapSpace over a given engine (tests pass fault-injecting ones),
// the on-disk header, and the free list that handles share with the space.
#ifndef STRATA_SWAP_SWAP_SPACE_INTERNAL_H_
#define STRATA_SWAP_SWAP_SPACE_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <set>

#include "strata/swap_space.h"
#include "util/mutex.h"

namespace strata::swap {

StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceWithEngine(
    const SwapSpaceOptions& options, std::unique_ptr<IoEngine> engine);
// SwapSpace::Open.
StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpace(
    const SwapSpaceOptions& options);
// A SwapSpace over a given AsyncIo (SwapSpace::Open with options.shared_io).
StatusOr<std::unique_ptr<SwapSpace>> OpenSwapSpaceOver(
    const SwapSpaceOptions& options, std::shared_ptr<AsyncIo> io);

// The on-disk block header (little-endian), one per slot in the header
// region at the start of each swap file.
struct BlockHeader {
  static constexpr uint64_t kMagic = 0x5753415441525453ull;  // "STRATASW"
  static constexpr uint32_t kVersion = 2;  // 2: headers apart from payloads
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

// The free slots of a space, shared by the space and its handles so that a
// handle dropped after its space is harmless. Lowest free slot first:
// consecutive slots alternate directories. Thread-safe.
class SlotPool {
 public:
  explicit SlotPool(uint64_t slots) {
    for (uint64_t s = 0; s < slots; ++s) free_.insert(static_cast<uint32_t>(s));
  }
  // Takes `n` slots into `out`, all or none.
  bool Take(size_t n, std::vector<uint32_t>& out) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (free_.size() < n) return false;
    for (size_t i = 0; i < n; ++i) {
      out.push_back(*free_.begin());
      free_.erase(free_.begin());
    }
    return true;
  }
  void Give(uint32_t slot) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    free_.insert(slot);
  }
  uint64_t free() const STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return free_.size();
  }

 private:
  mutable Mutex mu_;
  std::set<uint32_t> free_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::swap

#endif  // STRATA_SWAP_SWAP_SPACE_INTERNAL_H_
