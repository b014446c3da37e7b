#include "memtier/layout.h"

#include <map>
#include <string>

namespace strata::memtier {
namespace {

// Pads a unit so that it splits into world_size aligned shards.
void Finish(UnitInfo& u, const LayoutOptions& o) {
  const uint64_t quantum = kTensorAlign * static_cast<uint64_t>(o.world_size);
  u.elems = RoundUp(u.elems, quantum);
  u.shard_elems = u.elems / static_cast<uint64_t>(o.world_size);
  u.shard_begin = u.shard_elems * static_cast<uint64_t>(o.rank);
}

}  // namespace

StatusOr<Layout> Layout::Build(const std::vector<uint64_t>& tensor_elems,
                               const LayoutOptions& o,
                               const std::vector<uint32_t>& groups) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return Status::InvalidArgument(
        "layout: rank " + std::to_string(o.rank) + " is not in 0.." +
        std::to_string(o.world_size - 1) + " (world size " +
        std::to_string(o.world_size) + ")");
  }
  if (o.unit_elems < kTensorAlign || o.pack_limit_elems > o.unit_elems) {
    return Status::InvalidArgument(
        "layout: unit size " + std::to_string(o.unit_elems) +
        " elements must be at least " + std::to_string(kTensorAlign) +
        " and at least the packing limit " +
        std::to_string(o.pack_limit_elems));
  }
  Layout l;
  l.options_ = o;
  l.tensors_.resize(tensor_elems.size());
  if (!groups.empty() && groups.size() != tensor_elems.size()) {
    return Status::InvalidArgument("layout: one group per tensor");
  }
  std::map<uint32_t, int64_t> open_of;  // group -> packed unit taking tensors
  for (uint32_t i = 0; i < tensor_elems.size(); ++i) {
    const uint64_t n = tensor_elems[i];
    if (n == 0) {
      return Status::InvalidArgument("layout: tensor " + std::to_string(i) +
                                     " has no elements");
    }
    const uint64_t padded = RoundUp(n, kTensorAlign);
    if (n > o.pack_limit_elems) {
      UnitInfo u;
      u.elems = padded;
      u.tensors.push_back(i);
      l.tensors_[i] = {static_cast<uint32_t>(l.units_.size()), 0, n};
      l.units_.push_back(std::move(u));
      continue;
    }
    int64_t& open =
        open_of.try_emplace(groups.empty() ? 0 : groups[i], -1).first->second;
    if (open >= 0 && l.units_[open].elems + padded > o.unit_elems) open = -1;
    if (open < 0) {
      open = static_cast<int64_t>(l.units_.size());
      l.units_.emplace_back();
    }
    UnitInfo& u = l.units_[open];
    l.tensors_[i] = {static_cast<uint32_t>(open), u.elems, n};
    u.tensors.push_back(i);
    u.elems += padded;
  }
  for (UnitInfo& u : l.units_) {
    Finish(u, o);
    l.total_elems_ += u.elems;
  }
  return l;
}

}  // namespace strata::memtier
