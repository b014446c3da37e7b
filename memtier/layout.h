// The engine's layout: how registered tensors become units of transfer and
// rank-local partitions. Pure arithmetic over sizes (no memory, no device),
// so that it is tested without either.
//
// Note [Units and partitions]
// A *unit* is what one Fetch moves and what one device block holds:
//   - small tensors (at most pack_limit bytes) are packed, in registration
//     order, into shared units of up to unit_bytes (as PatrickStar's and
//     Gemini's chunks), so that every transfer is large and aligned;
//   - a larger tensor is a unit of its own, however large: its transfers are
//     split into staging-buffer-sized pieces, never refused (DeepSpeed
//     asserts when a parameter exceeds its buffer).
// Every tensor starts at an offset aligned to kTensorAlign inside its unit.
// A *partition* is one rank's shard of a unit: the unit's bytes are split in
// world_size equal, aligned shards, and rank r keeps shard r on its host and
// NVMe tiers (ZeRO stage 3). With one rank a partition is the whole unit;
// the collectives that gather the shards of a unit come with comm/.
//
// The same layout serves every role: a unit of parameters (working
// precision), its fp32 gradient accumulator, its fp32 master and its
// moments all cover the same elements, in the same order; only the element
// size differs. Offsets are therefore kept in elements.
#ifndef STRATA_MEMTIER_LAYOUT_H_
#define STRATA_MEMTIER_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"
#include "util/align.h"

namespace strata::memtier {

// Alignment of every tensor inside a unit, in elements: 128 elements are
// 256 bytes of bf16 and 512 bytes of fp32, enough for any vector load and for
// the device's copy and GEMM alignment rules.
inline constexpr uint64_t kTensorAlign = 128;

struct LayoutOptions {
  // Elements per packed unit, and the largest tensor that is packed.
  uint64_t unit_elems = uint64_t{32} << 20;
  uint64_t pack_limit_elems = uint64_t{1} << 20;
  int rank = 0;
  int world_size = 1;
};

struct TensorPlace {
  uint32_t unit = 0;
  uint64_t offset = 0;  // elements from the unit's start
  uint64_t elems = 0;
};

struct UnitInfo {
  uint64_t elems = 0;             // padded to world_size * kTensorAlign
  std::vector<uint32_t> tensors;  // in offset order
  // This rank's shard: [shard_begin, shard_begin + shard_elems).
  uint64_t shard_begin = 0;
  uint64_t shard_elems = 0;
};

// Built once the tensors are known; immutable afterwards.
class Layout {
 public:
  // `tensor_elems[i]` is the element count of tensor i (> 0). Small tensors
  // are packed only with tensors of the same `groups[i]` (e.g. the working
  // dtype); an empty `groups` puts every tensor in group 0.
  static StatusOr<Layout> Build(const std::vector<uint64_t>& tensor_elems,
                                const LayoutOptions& options,
                                const std::vector<uint32_t>& groups = {});

  const TensorPlace& tensor(uint32_t id) const { return tensors_[id]; }
  const UnitInfo& unit(uint32_t id) const { return units_[id]; }
  size_t num_tensors() const { return tensors_.size(); }
  size_t num_units() const { return units_.size(); }
  // Total elements of all units (padding included).
  uint64_t total_elems() const { return total_elems_; }
  const LayoutOptions& options() const { return options_; }

 private:
  LayoutOptions options_;
  std::vector<TensorPlace> tensors_;
  std::vector<UnitInfo> units_;
  uint64_t total_elems_ = 0;
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_LAYOUT_H_
