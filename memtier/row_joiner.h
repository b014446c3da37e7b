// Whole rows of a matrix's gradient joined from the pieces that cut it.
#ifndef STRATA_MEMTIER_ROW_JOINER_H_
#define STRATA_MEMTIER_ROW_JOINER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "strata/engine.h"
#include "strata/status.h"

namespace strata::memtier {

// Note [Whole rows from pieces]
// Adafactor's statistics pass sums the RMS with the statistics over the
// whole rows of each range (two or more of them), and what a range holds
// outside its whole rows takes an RMS pass of its own (Note [Whole rows in
// a range] in cpu_adam.cc), which with the gradients on NVMe reads it from
// the drive once more. Pieces cut rows anywhere, so the pass over spilled
// gradients joins them: RowJoiner takes a tensor's part a piece at a time
// and passes the whole rows within it (CpuFactoredFusedRows, the rows the
// plan fuses) on as ranges of at least two whole rows, in order, straight from
// the piece where they lie in one; the rows a piece leaves unfinished wait in a
// carry of the tensor, completed from the next piece's head and passed from
// there. The last range is never one row alone: a cut leaves at least two rows
// to the carry. A carry holds at most six rows (and a row at most
// kCpuAdafactorFusedRowCols elements). Where a rank's part begins or ends
// mid-row (stage 2 over ranks), the stretch before its first whole row and
// after its last pass on their own: only they take the RMS pass, and only the
// pieces that hold them are read for it (CpuFactoredPassReads). A part with
// fewer than two whole rows is passed piece by piece, as it could not fuse
// anyway. The ranges passed depend on the pieces given, so two joiners
// given a tensor's part in the same pieces pass it alike: Step's pass over
// the spilled pieces, and the accumulator's over the last micro-batch's
// sums (Note [Adafactor's statistics during backward] in factored.cc).
//
// Thread contract: thread-compatible.
class RowJoiner {
 public:
  using PassFn =
      std::function<Status(TensorId, const float*, uint64_t n, uint64_t begin)>;
  explicit RowJoiner(PassFn pass) : pass_(std::move(pass)) {}

  // Tensor `id`'s part holds whole rows of `cols` elements at [begin, end):
  // join its pieces there.
  void Join(TensorId id, uint64_t cols, uint64_t begin, uint64_t end) {
    Carry& c = carries_[id];
    c.cols = cols;
    c.rows_begin = begin;
    c.end = end;
  }

  // Elements [begin, begin + n) of tensor `id`, its part's next.
  Status Add(TensorId id, const float* g, uint64_t begin, uint64_t n) {
    auto it = carries_.find(id);
    if (it == carries_.end()) return pass_(id, g, n, begin);
    Carry& c = it->second;
    // Before the whole rows, then the rows, then after them.
    const uint64_t end = begin + n;
    const uint64_t r0 = std::clamp(c.rows_begin, begin, end);
    const uint64_t r1 = std::clamp(c.end, begin, end);
    if (begin < r0) STRATA_RETURN_IF_ERROR(pass_(id, g, r0 - begin, begin));
    if (r0 < r1) {
      STRATA_RETURN_IF_ERROR(AddRows(c, id, g + (r0 - begin), r0, r1 - r0));
    }
    if (r1 < end) return pass_(id, g + (r1 - begin), end - r1, r1);
    return Status::Ok();
  }

  // Every part passed whole: no carry is left.
  bool Done() const {
    for (const auto& [id, c] : carries_) {
      if (!c.buf.empty()) return false;
    }
    return true;
  }

  // Tensor `id`'s part passed whole so far: none of it waits in a carry.
  bool Done(TensorId id) const {
    auto it = carries_.find(id);
    return it == carries_.end() || it->second.buf.empty();
  }

  // Forgets every tensor's part and carry.
  void Clear() { carries_.clear(); }

 private:
  struct Carry {
    uint64_t cols = 0, rows_begin = 0, end = 0;  // the whole rows
    uint64_t begin = 0;      // the tensor element of buf[0], at a row
    std::vector<float> buf;  // elements [begin, begin + buf.size())
  };

  // Elements [begin, begin + n) of the part's whole rows, the next.
  Status AddRows(Carry& c, TensorId id, const float* g, uint64_t begin,
                 uint64_t n) {
    const uint64_t cols = c.cols, end = c.end;
    uint64_t a = begin;
    const uint64_t b = begin + n;
    if (!c.buf.empty()) {
      // Completed to a row and two rows at least, or to the part's end
      // when less than two rows would be left after it.
      const uint64_t have = c.begin + c.buf.size();
      uint64_t target =
          std::max((have + cols - 1) / cols * cols, c.begin + 2 * cols);
      if (target > end || end - target < 2 * cols) target = end;
      const uint64_t take = std::min(target, b) - a;
      c.buf.insert(c.buf.end(), g, g + take);
      a += take;
      g += take;
      if (a < target) return Status::Ok();  // the piece ended first
      Status st = pass_(id, c.buf.data(), c.buf.size(), c.begin);
      c.buf.clear();
      STRATA_RETURN_IF_ERROR(st);
    }
    if (a == b) return Status::Ok();
    if (b == end) return pass_(id, g, b - a, a);
    // a is at a row; the rows whole in the piece pass from it, but for
    // two left to the carry when fewer would remain after them.
    uint64_t cut = a + (b - a) / cols * cols;
    if (end - cut < 2 * cols && cut >= cols) cut -= cols;
    if (cut >= a + 2 * cols) {
      STRATA_RETURN_IF_ERROR(pass_(id, g, cut - a, a));
      g += cut - a;
      a = cut;
    }
    c.begin = a;
    c.buf.assign(g, g + (b - a));
    return Status::Ok();
  }

  PassFn pass_;
  std::unordered_map<TensorId, Carry> carries_;
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_ROW_JOINER_H_
