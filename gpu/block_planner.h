// BlockPlanner: best-fit placement of blocks in one region of fixed capacity,
// over offsets only. It never touches memory, so the device memory policy is
// tested without a device.
//
// Policy: sizes are rounded up to kAlignment (256 bytes, what cudaMalloc
// guarantees, enough for every vector load the kernels use). A request takes
// the smallest free extent that holds it (ties: the lowest offset) and is
// carved from that extent's start; freeing coalesces with both neighbours,
// so free extents never touch.
//
// Thread-compatible.
#ifndef STRATA_GPU_BLOCK_PLANNER_H_
#define STRATA_GPU_BLOCK_PLANNER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace strata::internal {

class BlockPlanner {
 public:
  static constexpr uint64_t kAlignment = 256;

  // The usable capacity is `capacity` rounded down to kAlignment.
  explicit BlockPlanner(uint64_t capacity);

  static uint64_t RoundUp(uint64_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  // The offset of a new block of RoundUp(bytes), or nullopt when no free
  // extent holds it. REQUIRES: bytes > 0.
  std::optional<uint64_t> Allocate(uint64_t bytes);

  // Returns a block. REQUIRES: offset and RoundUp(bytes) are exactly what an
  // earlier Allocate gave and it was not freed since.
  void Free(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_block() const;
  size_t free_extents() const { return by_offset_.size(); }

 private:
  void Insert(uint64_t offset, uint64_t size);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (size, offset)
};

}  // namespace strata::internal

#endif  // STRATA_GPU_BLOCK_PLANNER_H_
