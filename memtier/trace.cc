#include "memtier/trace.h"

#include <algorithm>

namespace strata::memtier {

bool FetchTrace::OnFetch(uint32_t unit) {
  recording_.push_back(unit);
  if (reference_.empty() || unit >= uses_.size()) return true;
  if (cursor_ < reference_.size() && reference_[cursor_] == unit) {
    ++cursor_;
    return true;
  }
  const auto& pos = uses_[unit];
  if (pos.empty()) return false;  // never seen: the cursor stays
  ++order_changes_;
  auto it = std::lower_bound(pos.begin(), pos.end(), cursor_);
  cursor_ = (it != pos.end() ? *it : pos.front()) + 1;
  return false;
}

void FetchTrace::EndStep() {
  if (!recording_.empty()) {
    reference_ = std::move(recording_);
    for (auto& u : uses_) u.clear();
    for (uint32_t i = 0; i < reference_.size(); ++i) {
      if (reference_[i] < uses_.size()) uses_[reference_[i]].push_back(i);
    }
  }
  recording_.clear();
  cursor_ = 0;
}

uint64_t FetchTrace::NextUse(uint32_t unit) const {
  if (unit >= uses_.size()) return kNever;
  const auto& pos = uses_[unit];
  auto it = std::lower_bound(pos.begin(), pos.end(), cursor_);
  return it == pos.end() ? kNever : *it - cursor_;
}

}  // namespace strata::memtier
