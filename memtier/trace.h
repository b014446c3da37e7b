// The fetch trace: the order in which the trainer fetched units during the
// last complete step, and where the current step stands in it. The engine
// prefetches the units ahead of the cursor and evicts the resident unit whose
// next use is furthest away (Belady's choice, as PatrickStar's).
//
// Note [Order changes]
// DeepSpeed drops its trace as soon as one fetch differs from it and runs
// without prefetch until two steps have agreed again. Here a fetch that is
// not the one expected moves the cursor to the next place the trace uses that
// unit (or, failing that, its first use), so a branch, an evaluation pass or a
// mixture-of-experts layer costs the prefetches it made wrong, and prefetching
// goes on from the new position. A unit the trace never saw leaves the cursor
// where it is. The trace of the step in progress replaces the reference at
// EndStep.
//
// Pure bookkeeping; thread-compatible (the engine holds its lock).
#ifndef STRATA_MEMTIER_TRACE_H_
#define STRATA_MEMTIER_TRACE_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace strata::memtier {

class FetchTrace {
 public:
  static constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

  explicit FetchTrace(size_t num_units) : uses_(num_units) {}

  // A fetch of `unit` by the trainer (not a prefetch). Returns true when it
  // was the unit the reference expected next (or there is no reference).
  bool OnFetch(uint32_t unit);
  // Ends the step: the recorded order becomes the reference.
  void EndStep();

  bool has_reference() const { return !reference_.empty(); }
  // The reference's units from the cursor on: upcoming(0) is the next
  // expected fetch. kNever past the end.
  uint64_t upcoming(size_t k) const {
    return cursor_ + k < reference_.size() ? reference_[cursor_ + k] : kNever;
  }
  // Fetches until `unit` is next used according to the reference, counted
  // from the cursor; kNever when it is not used again this step.
  uint64_t NextUse(uint32_t unit) const;

  uint64_t order_changes() const { return order_changes_; }
  size_t cursor() const { return cursor_; }

 private:
  std::vector<uint32_t> reference_;
  std::vector<std::vector<uint32_t>> uses_;  // per unit: positions, ascending
  std::vector<uint32_t> recording_;
  size_t cursor_ = 0;
  uint64_t order_changes_ = 0;
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_TRACE_H_
