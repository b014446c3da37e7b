// Gradient accumulators that rest on NVMe (EngineOptions::grads = kNvme).
//
// Note [Gradients on NVMe]
// The fp32 accumulator of every piece (a staging buffer's worth of one
// unit's elements, as the optimizer step reads it) rests in the swap space.
// Hand-overs arrive as element ranges of one tensor; they are added into a
// few *open* pieces held in host buffers of the spill's own small pool, and
// a piece is written back as soon as its last element is added (backward
// hands a tensor over front to back), when another pushes it out (least
// recently used), or at the step's Flush. The pool's other buffers carry the
// writes in flight. A piece written earlier in the same step is
// read back before more is added to it; a piece not written yet in this
// step starts from zeros, so the regions of tensors that got no gradient are
// zero without any zero-filling I/O, and nothing is read at all when each
// piece is handed over once per step (backward's order with one micro-batch,
// or with several when the pieces fit the open set).
//
// The global norm and the overflow check need every element of the final
// sum: each write of a piece also records its squared sum and finiteness,
// so the step adds up the last record of every piece instead of reading the
// gradients twice. Adafactor's statistics pass needs them too: Add shows the
// caller a piece's sums as they are added (`visit`), so that the last
// micro-batch's are passed before the piece is written, not read back.
//
// Thread contract: thread-compatible; the engine calls it from its
// accumulator thread, and from Step while no gradient is being handed over.
// The write callbacks run on the swap space's completion thread.
#ifndef STRATA_MEMTIER_GRAD_SPILL_H_
#define STRATA_MEMTIER_GRAD_SPILL_H_

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <vector>

#include "memtier/staging.h"
#include "strata/cpu_adam.h"
#include "strata/status.h"

namespace strata::memtier {

class GradSpill {
 public:
  // Blocks the calling thread until the piece's bytes are in `dst`.
  using ReadFn =
      std::function<Status(uint32_t unit, size_t piece, std::span<std::byte>)>;
  // Starts a write; `done` runs once, from any thread, when it ends.
  using WriteFn = std::function<void(uint32_t unit, size_t piece,
                                     std::span<const std::byte>,
                                     std::function<void(Status)> done)>;
  // Squared sum and finiteness of n fp32 values.
  using StatsFn = std::function<StatusOr<GradStats>(const float*, uint64_t)>;

  // `unit_elems[u]` is unit u's element count; pieces are `piece_elems`
  // long (the last of a unit shorter). `pool` has at least open_pieces + 1
  // buffers of piece_elems * 4 bytes (the rest carry writes in flight) and
  // is used by nothing else, except between Flush and the next Add or
  // EndStep: the spill holds none of its buffers then, and the step may
  // read the gradients back with them.
  GradSpill(std::vector<uint64_t> unit_elems, uint64_t piece_elems,
            StagingPool* pool, size_t open_pieces, ReadFn read, WriteFn write,
            StatsFn stats);
  // Waits for the writes in flight.
  ~GradSpill();
  GradSpill(const GradSpill&) = delete;
  GradSpill& operator=(const GradSpill&) = delete;

  // Sees a piece's buffer: its sums so far, element 0 the piece's first.
  using VisitFn = std::function<void(const float* piece)>;

  // Adds (or, with `overwrite`, stores) vals[0, n) at elements
  // [elem, elem + n) of unit `unit`. With `visit`, those elements lie in one
  // piece, and visit sees its buffer once they are added, before the piece
  // is written back (Note [Adafactor's statistics during backward] in
  // memtier/factored.cc reads the last micro-batch's sums there).
  Status Add(uint32_t unit, uint64_t elem, const float* vals, uint64_t n,
             bool overwrite, const VisitFn& visit = nullptr);
  // Writes every open piece back and waits for every write: afterwards each
  // piece written in this step is on NVMe with its stats recorded.
  Status Flush();
  // After Flush: whether the piece was written in this step (if not, its
  // gradient is zero), and the stats of its last write.
  bool written(uint32_t unit, size_t piece) const {
    return written_[Index(unit, piece)] != 0;
  }
  const GradStats& stats(uint32_t unit, size_t piece) const {
    return stats_[Index(unit, piece)];
  }
  // The step consumed the gradients (or failed): every piece is zero again,
  // and what was open is dropped.
  void EndStep();

 private:
  struct Open {
    size_t index = 0;  // global piece index
    uint32_t unit = 0;
    size_t piece = 0;
    uint64_t use = 0;  // clock of the last Add, for LRU
    StagingLease lease;
  };
  size_t Index(uint32_t unit, size_t piece) const {
    return first_piece_[unit] + piece;
  }
  uint64_t PieceElems(uint32_t unit, size_t piece) const;
  // `whole`: the caller overwrites every element, so nothing is read or
  // zeroed.
  StatusOr<Open*> OpenPiece(uint32_t unit, size_t piece, bool whole);
  // Records the stats of `o` and starts its write; the lease goes back to
  // the pool when the write ends.
  Status WriteBack(Open o);
  Status WaitPending(size_t index);

  const std::vector<uint64_t> unit_elems_;
  const uint64_t piece_elems_;
  StagingPool* const pool_;
  const size_t max_open_;
  const ReadFn read_;
  const WriteFn write_;
  const StatsFn stats_fn_;
  std::vector<size_t> first_piece_;  // per unit
  std::vector<uint8_t> written_;     // per piece, this step
  std::vector<GradStats> stats_;     // per piece, of its last write
  std::vector<Open> open_;
  // Writes in flight, per piece (invalid when none).
  std::vector<std::future<Status>> pending_;
  std::vector<size_t> pending_list_;
  uint64_t clock_ = 0;
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_GRAD_SPILL_H_
