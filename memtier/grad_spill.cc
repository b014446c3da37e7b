#include "memtier/grad_spill.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

namespace strata::memtier {

GradSpill::GradSpill(std::vector<uint64_t> unit_elems, uint64_t piece_elems,
                     StagingPool* pool, size_t open_pieces, ReadFn read,
                     WriteFn write, StatsFn stats)
    : unit_elems_(std::move(unit_elems)),
      piece_elems_(piece_elems),
      pool_(pool),
      max_open_(std::max<size_t>(1, open_pieces)),
      read_(std::move(read)),
      write_(std::move(write)),
      stats_fn_(std::move(stats)) {
  size_t n = 0;
  for (uint64_t e : unit_elems_) {
    first_piece_.push_back(n);
    n += (e + piece_elems_ - 1) / piece_elems_;
  }
  written_.assign(n, 0);
  stats_.assign(n, GradStats{});
  pending_.resize(n);
}

GradSpill::~GradSpill() {
  for (size_t i : pending_list_) {
    if (pending_[i].valid()) pending_[i].wait();
  }
}

uint64_t GradSpill::PieceElems(uint32_t unit, size_t piece) const {
  return std::min(piece_elems_, unit_elems_[unit] - piece * piece_elems_);
}

Status GradSpill::WaitPending(size_t index) {
  if (!pending_[index].valid()) return Status::Ok();
  return pending_[index].get();
}

Status GradSpill::WriteBack(Open o) {
  const uint64_t n = PieceElems(o.unit, o.piece);
  StatusOr<GradStats> st =
      stats_fn_(reinterpret_cast<const float*>(o.lease.data()), n);
  if (!st.ok()) return st.status();
  stats_[o.index] = *st;
  written_[o.index] = 1;
  auto promise = std::make_shared<std::promise<Status>>();
  pending_[o.index] = promise->get_future();
  pending_list_.push_back(o.index);
  auto lease = std::make_shared<StagingLease>(std::move(o.lease));
  // The whole buffer, not the piece's n * 4 bytes: direct I/O moves whole
  // blocks, so the swap space needs the piece's bytes rounded up to them.
  const std::span<const std::byte> bytes = lease->span();
  write_(o.unit, o.piece, bytes, [lease, promise](Status s) mutable {
    lease.reset();  // back to the pool before the waiter wakes
    promise->set_value(std::move(s));
  });
  return Status::Ok();
}

StatusOr<GradSpill::Open*> GradSpill::OpenPiece(uint32_t unit, size_t piece,
                                                bool whole) {
  const size_t index = Index(unit, piece);
  for (Open& o : open_) {
    if (o.index == index) return &o;
  }
  if (open_.size() == max_open_) {
    auto lru = std::min_element(
        open_.begin(), open_.end(),
        [](const Open& a, const Open& b) { return a.use < b.use; });
    Open victim = std::move(*lru);
    open_.erase(lru);
    STRATA_RETURN_IF_ERROR(WriteBack(std::move(victim)));
  }
  // The piece's last write must have landed before it is read back or
  // rewritten.
  STRATA_RETURN_IF_ERROR(WaitPending(index));
  STRATA_ASSIGN_OR_RETURN(StagingLease lease, pool_->Acquire());
  const uint64_t n = PieceElems(unit, piece);
  if (written_[index] && !whole) {
    STRATA_RETURN_IF_ERROR(read_(unit, piece, lease.span()));
  } else if (!whole) {
    std::memset(lease.data(), 0, n * 4);
  }
  Open o;
  o.index = index;
  o.unit = unit;
  o.piece = piece;
  o.lease = std::move(lease);
  open_.push_back(std::move(o));
  return &open_.back();
}

Status GradSpill::Add(uint32_t unit, uint64_t elem, const float* vals,
                      uint64_t n, bool overwrite, const VisitFn& visit) {
  if (visit && n > 0 && elem / piece_elems_ != (elem + n - 1) / piece_elems_) {
    return Status::Internal(
        "grad spill: a visited range of unit " + std::to_string(unit) +
        " crosses a piece (elements " + std::to_string(elem) + ".." +
        std::to_string(elem + n) + ")");
  }
  while (n > 0) {
    const size_t piece = elem / piece_elems_;
    const uint64_t at = elem - piece * piece_elems_;
    const uint64_t len = PieceElems(unit, piece);
    const uint64_t cnt = std::min(n, len - at);
    // Overwritten whole, a piece needs neither its old bytes nor zeros.
    const bool whole = overwrite && at == 0 && cnt == len;
    STRATA_ASSIGN_OR_RETURN(Open * o, OpenPiece(unit, piece, whole));
    o->use = ++clock_;
    float* acc = reinterpret_cast<float*>(o->lease.data()) + at;
    if (overwrite) {
      std::memcpy(acc, vals, cnt * 4);
    } else {
      for (uint64_t i = 0; i < cnt; ++i) acc[i] += vals[i];
    }
    if (visit) visit(reinterpret_cast<const float*>(o->lease.data()));
    if (at + cnt == len) {
      // Its last element is in: in backward's order the piece is done for
      // this micro-batch, so its write starts now rather than when another
      // piece pushes it out.
      auto it = open_.begin() + (o - open_.data());
      Open done = std::move(*it);
      open_.erase(it);
      STRATA_RETURN_IF_ERROR(WriteBack(std::move(done)));
    }
    elem += cnt;
    vals += cnt;
    n -= cnt;
  }
  return Status::Ok();
}

Status GradSpill::Flush() {
  Status first;
  while (!open_.empty()) {
    Open o = std::move(open_.back());
    open_.pop_back();
    Status st = WriteBack(std::move(o));
    if (!st.ok() && first.ok()) first = st;
  }
  for (size_t i : pending_list_) {
    Status st = WaitPending(i);
    if (!st.ok() && first.ok()) first = st;
  }
  pending_list_.clear();
  return first;
}

void GradSpill::EndStep() {
  // After a failed step: what is still open or in flight is dropped; the
  // errors were reported by the step (or the hand-over) already.
  open_.clear();
  for (size_t i : pending_list_) WaitPending(i).IgnoreError();
  pending_list_.clear();
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(stats_.begin(), stats_.end(), GradStats{});
}

}  // namespace strata::memtier
