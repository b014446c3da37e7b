#include "gpu/block_planner.h"

#include <cassert>
#include <iterator>

namespace strata::internal {

BlockPlanner::BlockPlanner(uint64_t capacity)
    : capacity_(capacity / kAlignment * kAlignment), free_bytes_(0) {
  if (capacity_ > 0) Insert(0, capacity_);
}

uint64_t BlockPlanner::largest_free_block() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

std::optional<uint64_t> BlockPlanner::Allocate(uint64_t bytes) {
  assert(bytes > 0);
  const uint64_t size = RoundUp(bytes);
  if (size < bytes) return std::nullopt;  // RoundUp overflowed
  auto fit = by_size_.lower_bound({size, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const uint64_t extent_size = fit->first;
  const uint64_t offset = fit->second;
  Erase(by_offset_.find(offset));
  if (extent_size > size) Insert(offset + size, extent_size - size);
  return offset;
}

void BlockPlanner::Free(uint64_t offset, uint64_t bytes) {
  uint64_t size = RoundUp(bytes);
  assert(offset % kAlignment == 0 && offset + size <= capacity_);
  auto next = by_offset_.lower_bound(offset);
  // The block must lie between two free extents, overlapping neither.
  assert(next == by_offset_.end() || next->first >= offset + size);
  if (next != by_offset_.end() && next->first == offset + size) {
    size += next->second;
    auto after = std::next(next);
    Erase(next);
    next = after;
  }
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= offset);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      Erase(prev);
    }
  }
  Insert(offset, size);
}

void BlockPlanner::Insert(uint64_t offset, uint64_t size) {
  by_offset_.emplace(offset, size);
  by_size_.emplace(size, offset);
  free_bytes_ += size;
}

void BlockPlanner::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

}  // namespace strata::internal
