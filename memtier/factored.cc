// The factored optimizers (Adafactor, SM3) in the engine.
//
// Note [Factored optimizers in the engine]
// Adafactor and SM3 keep their second-moment statistics per row and per
// column of a matrix (a vector: per element), not per element of a unit:
//   - Roles: exp_avg_sq is not kept per element (RoleKept), and exp_avg
//     only with a first moment (Adafactor's beta1, SM3's momentum). A step
//     whose states rest on NVMe moves the master through the drive (and
//     that moment): 4 (8) bytes a parameter each way, where AdamW's fp32
//     moments move 12.
//   - The statistics rest in host memory, per tensor (FactoredTensor):
//     rows + cols floats for a matrix, 1 + n for a vector, on every rank. A
//     vector's are per element, and a rank steps only its shard's: the
//     others' are current on their owners until a save gathers them
//     (GatherFactoredVectors).
//   - Each tensor steps through a CpuFactoredPlan (Note [Factored steps in
//     ranges] in cpu_adam.cc): before the piece pipeline, Adafactor's
//     statistics and RMS passes over this rank's part of each gradient,
//     their sums reduced over the ranks between passes; in the pipeline,
//     each piece's update, tensor by tensor; after it, SM3's new maxima and
//     the weights' sums of squares, reduced likewise. Results do not depend
//     on where the states rest (the ranges are the pieces); they depend on
//     the piece size and the ranks, which cut the ranges (Adafactor's sums;
//     SM3 not).
//   - Gradients on NVMe (FactoredSpilledPass): Adafactor's passes before
//     the update read the spilled pieces back, one piece in flight while
//     the one before passes, and take a tensor's part in ranges of whole
//     rows joined from the pieces (Note [Whole rows from pieces] in
//     row_joiner.h), where gradients on the host give a rank's whole part
//     as one range. A tensor within one piece steps to the same bits
//     either way; one cut by pieces within the last bits of its sums'
//     order, as over ranks. A step reads each gradient from the drive
//     once per pass: twice (statistics with the fused RMS, then the
//     update), three times for rows wider than kCpuAdafactorFusedRowCols
//     (an RMS pass), once fewer after BeginStep on one rank; a rank's part
//     that begins or ends mid-row reads again only the pieces that hold
//     its first and last rows. SM3 has no pass before the update and reads
//     each gradient once.
//   - scale_parameter's sum of the weights' squares is carried from step to
//     step (FactoredTensor::param_sq): 0 at Start (the master is zeros), the
//     values' at SetInitialValues, the checkpoint's at LoadState. So the
//     statistics pass never reads the master, which may rest on NVMe.
//   - BeginStep: no weight moves before every statistic is in, but the
//     gradient's stats, and Adafactor's statistics pass, run during
//     backward (Note [Adafactor's statistics during backward]); with the
//     gradients on NVMe, the statistics pass alone, as the last
//     micro-batch is added.
//   - Refused: tensors of more than two dimensions (HF factors them per
//     leading index but clips by the whole tensor) and int8 moments.
//   - Checkpoints: the statistics and the sums of squares, by tensor name,
//     in the blob strata.engine.factored (FactoredBlob).
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "memtier/engine_impl.h"

namespace strata::memtier {
namespace {

// The blob's little-endian fields.
template <class T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

template <class T>
bool Take(const std::string& in, size_t& at, T* v) {
  if (in.size() - at < sizeof *v) return false;
  std::memcpy(v, in.data() + at, sizeof *v);
  at += sizeof *v;
  return true;
}

constexpr uint32_t kBlobMagic = 0x53464331;  // "SFC1"

}  // namespace

bool EngineImpl::RoleKept(int role) const {
  if (!Factored() || !IsMoment(role)) return true;
  return role == kExpAvg && CpuOptimizerUsesExpAvg(options_.optimizer.cpu);
}

Status EngineImpl::StartFactored() {
  if (!Factored()) return Status::Ok();
  // Int8 moments are refused with the options (ValidateEngineOptions).
  const std::string name(CpuOptimizerAlgoName(options_.optimizer.cpu.algo));
  factored_.assign(specs_.size(), FactoredTensor{});
  early_spilled_.assign(specs_.size(), kSpilledNone);
  early_spilled_next_.assign(specs_.size(), 0);
  for (TensorId id = 0; id < specs_.size(); ++id) {
    const std::vector<int64_t>& shape = specs_[id].shape;
    if (shape.size() > 2) {
      return Status::InvalidArgument(
          "engine: tensor " + specs_[id].name + " has shape " +
          ShapeText(shape) + ": " + name +
          " keeps statistics per row and column of a matrix or per element "
          "of a vector; register it with one or two dimensions");
    }
    FactoredTensor& f = factored_[id];
    if (shape.size() == 2) {
      f.rows = static_cast<size_t>(shape[0]);
      f.cols = static_cast<size_t>(shape[1]);
    }
    CpuStepShape sh;
    sh.n = numel_[id];
    sh.rows = f.rows;
    sh.cols = f.cols;
    sh.moment_dtype = MomentDType();
    StatusOr<CpuStepFootprint> fp =
        CpuStepFootprintOf(options_.optimizer.cpu, sh);
    if (!fp.ok()) {
      return fp.status().WithContext("engine: tensor " + specs_[id].name);
    }
    f.stats.assign(fp->exp_avg_sq_bytes / 4, 0.0f);
  }
  // Note [Adafactor's statistics during backward], gradients on NVMe on
  // one rank: room for the vectors' last sums.
  early_vector_at_.clear();
  uint64_t vector_elems = 0;
  if (options_.optimizer.cpu.algo == CpuOptimizerAlgo::kAdafactor &&
      options_.grads == Residence::kNvme && !MultiRank()) {
    for (TensorId id = 0; id < specs_.size(); ++id) {
      const bool matrix = PassesDuringBackward(id);
      early_vector_at_.push_back(matrix ? UINT64_MAX : vector_elems);
      if (!matrix) vector_elems += numel_[id];
    }
  }
  early_vectors_.assign(vector_elems, 0.0f);
  return Status::Ok();
}

Status EngineImpl::BeginFactored(TensorId id, const CpuStepArgs& args) {
  FactoredTensor& f = factored_[id];
  CpuStepShape sh;
  sh.n = numel_[id];
  sh.rows = f.rows;
  sh.cols = f.cols;
  CpuStepArgs a = args;
  a.param_sq = f.param_sq;
  return optimizer_->FactoredBegin(sh, a, &f.plan)
      .WithContext("engine: stepping " + specs_[id].name);
}

Status EngineImpl::FactoredHostPass(TensorId id) {
  const TensorPlace& place = layout_->tensor(id);
  uint64_t lo = 0, hi = 0;  // this rank's part of the tensor
  if (!ShardPart(place, &lo, &hi)) return Status::Ok();
  const auto* g = reinterpret_cast<const float*>(
      HostAt(kGrad, place.unit, lo - units_[place.unit].shard_begin));
  return FactoredGradPass(id, g, lo - place.offset, hi - lo);
}

Status EngineImpl::FactoredBeforeUpdate(
    const CpuStepArgs& args, const std::vector<uint8_t>& early_state) {
  // Note [Adafactor's statistics during backward]: the tensors whose
  // statistics pass ran then are begun and passed already (the accumulator,
  // which passed the spilled ones, is idle since the hand-overs ended).
  auto early = [&](TensorId id) {
    if (!PassesDuringBackward(id)) return false;
    if (grad_spill_) return early_spilled_[id] == kSpilledDone;
    return early_state[layout_->tensor(id).unit] == kEarlyStatistics;
  };
  // With the gradients on NVMe, a vector whose last sums the accumulator
  // set aside: its pass reads them there.
  auto copied = [&](TensorId id) {
    return grad_spill_ && !PassesDuringBackward(id) &&
           early_spilled_[id] == kSpilledDone;
  };
  for (TensorId id = 0; id < factored_.size(); ++id) {
    if (!early(id)) STRATA_RETURN_IF_ERROR(BeginFactored(id, args));
  }
  for (;;) {
    // The tensors whose next pass reads the gradient alone: every rank has
    // the same (the phases follow from the shapes).
    std::vector<TensorId> due;
    for (TensorId id = 0; id < factored_.size(); ++id) {
      const CpuFactoredPhase ph = factored_[id].plan.phase;
      if (ph == CpuFactoredPhase::kStatistics || ph == CpuFactoredPhase::kRms) {
        due.push_back(id);
      }
    }
    if (due.empty()) return Status::Ok();
    std::vector<TensorId> pass;  // those not passed during backward
    Status st;
    for (TensorId id : due) {
      const bool stats =
          factored_[id].plan.phase == CpuFactoredPhase::kStatistics;
      if (stats && copied(id)) {
        if (st.ok()) st = FactoredCopiedPass(id);
      } else if (!stats || !early(id)) {
        pass.push_back(id);
      }
    }
    if (st.ok() && grad_spill_ && !pass.empty()) {
      st = FactoredSpilledPass(pass);
    } else if (!grad_spill_) {
      for (TensorId id : pass) {
        st = FactoredHostPass(id);
        if (!st.ok()) break;
      }
    }
    STRATA_RETURN_IF_ERROR(AgreeNow(st));
    STRATA_RETURN_IF_ERROR(FactoredNextAll(due));
  }
}

// Note [Adafactor's statistics during backward]
// After BeginStep, Adafactor cannot update a unit early: every weight waits
// for the statistics of the whole gradient. Its passes before the update
// change no state, though: the statistics pass over a matrix sums into the
// tensor's plan (its row and column sums, the fused RMS's partials), and the
// moving averages are formed from them only in Step (FactoredNext). So when
// the stepper takes a unit's gradient stats during backward (Note [Updates
// during backward] in engine.cc), it also runs each matrix's statistics
// pass, begun with the step's arguments (Step's own: BeginStep pins lr, the
// loss scale and max_grad_norm 0, and the step number is the next). Step
// then begins and passes only the other tensors, so a matrix whose rows
// fuse the RMS reads its gradient once in Step, for the update, and a wider
// one twice (the RMS pass), where Step alone reads them three and four
// times. The same calls over the same ranges with the same arguments: the
// same bits as Step alone.
// - Only matrices: a vector's statistics pass writes its statistics in
//   place, which a skipped step would have to undo; vectors pass in Step.
// - Nothing to undo: a non-finite gradient stops the stepper (Step skips
//   the step, and the plans are begun again the next); an error fails the
//   step as an early update's does.
// - SM3 has no pass before its update: its units take the stats alone.
//
// Gradients on NVMe: the stepper has no gradient to read (the spill's open
// pieces belong to the accumulator, and reading the written ones back is
// the read to save), but the accumulator has each sum in its hands once: on
// one rank, a hand-over after BeginStep is cut at the pieces' bounds
// (HandOverChunk), so that each chunk is the tensor's part of one piece,
// and once a chunk's last values are added the spill shows the accumulator
// the chunk's sums in the piece's buffer, before the piece is written back
// (GradSpill::Add's visit). The accumulator passes the chunk there
// (EarlySpilledChunk) through a RowJoiner of its own: a tensor's chunks
// come front to back, piece by piece, the ranges FactoredSpilledPass would
// give it, so the plan takes the same calls in the same order: the same
// bits as Step alone. A vector's statistics pass writes in place (above),
// so its chunks are set aside instead (early_vectors_, 4 bytes an element
// of every vector, allocated at Start), and Step passes it from there in
// the same ranges (FactoredCopiedPass). A matrix passed whole and a vector
// set aside whole (kSpilledDone) are left out of Step's pass over the
// spilled pieces, so a piece that holds nothing else due is not read back:
// one read of the gradient from the drive fewer a step (the RMS pass of
// rows too wide to fuse still reads it; a model's small vectors would
// otherwise keep most pieces read, packed beside its matrices). A
// chunk out of order (a guard: a tensor's chunks come in order) leaves the
// tensor to Step, which begins its plan again; a non-finite sum makes
// sums that Step never uses, as it skips the step. The pass costs the
// accumulator a read of the chunk from memory, while the drive writes it.
// Not over ranks: there the spill takes each reduced window of the shard,
// and a window's sums are final only when every hand-over in it was its
// tensor's last, which the windows do not track; Step passes them.
Status EngineImpl::EarlyFactoredPasses(uint32_t u, const CpuStepArgs& args,
                                       uint64_t* passed) {
  for (TensorId id : layout_->unit(u).tensors) {
    if (!PassesDuringBackward(id)) continue;  // SM3, a vector: in Step
    STRATA_RETURN_IF_ERROR(BeginFactored(id, args));
    STRATA_RETURN_IF_ERROR(FactoredHostPass(id));
    ++*passed;
  }
  return Status::Ok();
}

bool EngineImpl::TakesSpilledChunks() const {
  // early_vector_at_ is laid out (at Start) only where the chunks are taken.
  return !early_vector_at_.empty();
}

Status EngineImpl::FactoredCopiedPass(TensorId id) {
  // The ranges FactoredSpilledPass gives a vector: its part of each piece,
  // as the hand-over's chunks cut it.
  const float* g = early_vectors_.data() + early_vector_at_[id];
  for (uint64_t b = 0, k = 0; b < numel_[id]; b += k) {
    k = HandOverChunk(id, b, UINT64_MAX);
    STRATA_RETURN_IF_ERROR(FactoredGradPass(id, g + b, b, k));
  }
  return Status::Ok();
}

void EngineImpl::EarlySpilledChunk(TensorId id, uint64_t begin, uint64_t n,
                                   const float* g) {
  CpuStepArgs args;
  {
    MutexLock l(&mu_);
    if (!early_armed_ || !early_error_.ok()) return;
    args = EarlyArgsLocked();
  }
  uint8_t& state = early_spilled_[id];
  if (state == kSpilledLeft || state == kSpilledDone) return;
  // Step passes a tensor's pieces front to back: a chunk that does not
  // follow the one before would change the order of the sums.
  if (begin != (state == kSpilledNone ? 0 : early_spilled_next_[id])) {
    state = kSpilledLeft;
    return;
  }
  early_spilled_next_[id] = begin + n;
  if (!PassesDuringBackward(id)) {
    // A vector: its sums set aside for Step, which passes them.
    std::memcpy(early_vectors_.data() + early_vector_at_[id] + begin, g, n * 4);
    state = begin + n == numel_[id] ? kSpilledDone : kSpilledPassing;
    return;
  }
  Status st;
  if (state == kSpilledNone) {
    st = BeginFactored(id, args);
    const FactoredTensor& f = factored_[id];
    const auto [r0, r1] = CpuFactoredFusedRows(f.plan, 0, numel_[id]);
    if (r0 < r1) early_rows_.Join(id, f.cols, r0, r1);
    state = kSpilledPassing;
  }
  if (st.ok()) st = early_rows_.Add(id, g, begin, n);
  if (!st.ok()) {
    state = kSpilledLeft;
    MutexLock l(&mu_);
    if (early_error_.ok()) early_error_ = st;
    return;
  }
  if (begin + n == numel_[id]) {
    state = early_rows_.Done(id) ? kSpilledDone : kSpilledLeft;
    if (state == kSpilledDone) {
      MutexLock l(&mu_);
      ++stats_.early_passes;
    }
  }
}

Status EngineImpl::FactoredSpilledPass(const std::vector<TensorId>& due) {
  std::vector<uint8_t> is_due(factored_.size(), 0);
  for (TensorId id : due) is_due[id] = 1;
  // The pieces of this rank's shards that hold a part of a due tensor.
  std::vector<std::pair<uint32_t, size_t>> order;
  for (uint32_t u = 0; u < units_.size(); ++u) {
    const UnitState& s = units_[u];
    for (size_t p = 0; p * piece_elems_ < s.elems; ++p) {
      const uint64_t first = s.shard_begin + p * piece_elems_;
      const uint64_t end =
          s.shard_begin + std::min(s.elems, (p + 1) * piece_elems_);
      for (uint32_t id : layout_->unit(u).tensors) {
        if (PassReads(id, first, end, is_due)) {
          order.emplace_back(u, p);
          break;
        }
      }
    }
  }
  // Note [Whole rows from pieces]: the matrices whose statistics may sum
  // the RMS.
  RowJoiner rows(
      [this](TensorId id, const float* g, uint64_t n, uint64_t begin) {
        return FactoredGradPass(id, g, begin, n);
      });
  for (TensorId id : due) {
    const FactoredTensor& f = factored_[id];
    const TensorPlace& place = layout_->tensor(id);
    uint64_t lo = 0, hi = 0;
    if (!ShardPart(place, &lo, &hi)) continue;
    const auto [r0, r1] =
        CpuFactoredFusedRows(f.plan, lo - place.offset, hi - lo);
    if (r0 < r1) rows.Join(id, f.cols, r0, r1);
  }
  // Two buffers of the spill's pool, which holds none between Flush and
  // EndStep: a piece passes while the next one is read.
  struct Ahead {
    uint32_t unit = 0;
    size_t index = 0;
    uint64_t n = 0;
    StagingLease grad;
    std::future<Status> read;
  };
  std::deque<Ahead> ahead;
  size_t next = 0;
  auto start = [&]() -> Status {
    while (ahead.size() < 2 && next < order.size()) {
      Ahead a;
      std::tie(a.unit, a.index) = order[next++];
      a.n =
          std::min(piece_elems_, units_[a.unit].elems - a.index * piece_elems_);
      STRATA_ASSIGN_OR_RETURN(a.grad, grad_pool_->Acquire());
      if (grad_spill_->written(a.unit, a.index)) {
        a.read = ReadPieceFuture(a.unit, kGrad, a.index, a.grad.span(),
                                 IoPriority::kUrgent);
      } else {
        // Not handed over in this step: zeros (Note [Gradients on NVMe]).
        std::memset(a.grad.data(), 0, a.n * 4);
        std::promise<Status> zeros;
        zeros.set_value(Status::Ok());
        a.read = zeros.get_future();
      }
      ahead.push_back(std::move(a));
    }
    return Status::Ok();
  };
  Status st;
  while (st.ok()) {
    st = start();
    if (!st.ok() || ahead.empty()) break;
    Ahead cur = std::move(ahead.front());
    ahead.pop_front();
    st = cur.read.get();
    if (!st.ok()) {
      st = std::move(st).WithContext(
          "engine: the gradients read back for " +
          std::string(CpuOptimizerAlgoName(options_.optimizer.cpu.algo)) +
          "'s passes before the update");
      break;
    }
    const UnitState& s = units_[cur.unit];
    const uint64_t first = s.shard_begin + cur.index * piece_elems_;
    const auto* g = reinterpret_cast<const float*>(cur.grad.data());
    for (uint32_t id : layout_->unit(cur.unit).tensors) {
      const TensorPlace& place = layout_->tensor(id);
      uint64_t lo = 0, hi = 0;  // the piece lies in this rank's shard
      if (!PassReads(id, first, first + cur.n, is_due, &lo, &hi)) continue;
      st = rows.Add(id, g + (lo - first), lo - place.offset, hi - lo);
      if (!st.ok()) break;
    }
  }
  // The reads still in flight end before their buffers go back.
  for (Ahead& a : ahead) {
    if (a.read.valid()) a.read.wait();
  }
  if (st.ok() && !rows.Done()) {
    return Status::Internal(
        "engine: a row of a gradient read back was never passed whole");
  }
  return st;
}

bool EngineImpl::PassReads(TensorId id, uint64_t first, uint64_t end,
                           const std::vector<uint8_t>& is_due, uint64_t* lo,
                           uint64_t* hi) const {
  uint64_t a = 0, b = 0;
  const TensorPlace& place = layout_->tensor(id);
  if (!is_due[id] || !PartIn(place, first, end, &a, &b)) return false;
  if (lo != nullptr) *lo = a;
  if (hi != nullptr) *hi = b;
  return CpuFactoredPassReads(factored_[id].plan, a - place.offset, b - a);
}

Status EngineImpl::FactoredGradPass(TensorId id, const float* grad,
                                    uint64_t begin, uint64_t n) {
  FactoredTensor& f = factored_[id];
  CpuOptimizerTensors t;
  t.n = n;
  t.rows = f.rows;
  t.cols = f.cols;
  t.grad = grad;
  t.grad_dtype = CpuDType::kFloat32;
  t.exp_avg_sq = f.stats.data();
  t.moment_dtype = MomentDType();
  return optimizer_->FactoredPass(t, begin, &f.plan)
      .WithContext("engine: stepping " + specs_[id].name);
}

Status EngineImpl::FactoredUpdate(uint32_t u, uint64_t begin,
                                  const CpuOptimizerTensors& t) {
  const UnitState& s = units_[u];
  // The piece in full-unit coordinates.
  const uint64_t first = s.shard_begin + begin, end = first + t.n;
  const size_t wsize = ElementSize(s.dtype);
  for (uint32_t id : layout_->unit(u).tensors) {
    const TensorPlace& place = layout_->tensor(id);
    uint64_t lo = 0, hi = 0;
    if (!PartIn(place, first, end, &lo, &hi)) continue;
    const uint64_t off = lo - first;
    FactoredTensor& f = factored_[id];
    CpuOptimizerTensors r = t;
    r.n = hi - lo;
    r.rows = f.rows;
    r.cols = f.cols;
    r.master = t.master + off;
    r.grad = static_cast<const float*>(t.grad) + off;
    if (t.exp_avg != nullptr) {
      r.exp_avg = static_cast<std::byte*>(t.exp_avg) +
                  CpuStateBytes(MomentDType(), off);
    }
    r.exp_avg_sq = f.stats.data();
    if (t.working != nullptr) {
      r.working = static_cast<std::byte*>(t.working) + off * wsize;
    }
    STRATA_RETURN_IF_ERROR(
        optimizer_->FactoredPass(r, lo - place.offset, &f.plan)
            .WithContext("engine: updating " + specs_[id].name));
  }
  return Status::Ok();
}

Status EngineImpl::FactoredAfterUpdate() {
  std::vector<TensorId> all(factored_.size());
  for (TensorId id = 0; id < all.size(); ++id) all[id] = id;
  STRATA_RETURN_IF_ERROR(FactoredNextAll(all));
  if (options_.optimizer.cpu.algo == CpuOptimizerAlgo::kAdafactor &&
      options_.optimizer.cpu.adafactor.scale_parameter) {
    for (FactoredTensor& f : factored_) {
      if (f.plan.param_sq >= 0) f.param_sq = f.plan.param_sq;
    }
  }
  return Status::Ok();
}

Status EngineImpl::FactoredNextAll(const std::vector<TensorId>& ids) {
  if (MultiRank()) {
    // Every rank's sums, then each reduced in rank order: the same bits on
    // every rank.
    std::vector<double> mine;
    for (TensorId id : ids) {
      const std::vector<double>& v = factored_[id].plan.sums;
      mine.insert(mine.end(), v.begin(), v.end());
    }
    const size_t ranks = static_cast<size_t>(options_.world_size);
    std::vector<double> all(mine.size() * ranks);
    const std::vector<size_t> counts(ranks, mine.size() * sizeof(double));
    STRATA_RETURN_IF_ERROR(
        coll_->AllGather(mine.data(), all.data(), counts, CommType::kByte)
            .WithContext("engine: reducing the optimizer's statistics over "
                         "the ranks"));
    size_t at = 0;
    for (TensorId id : ids) {
      CpuFactoredPlan& plan = factored_[id].plan;
      const bool max = plan.reduce == CpuFactoredReduce::kMax;
      for (size_t i = 0; i < plan.sums.size(); ++i, ++at) {
        double v = all[at];
        for (size_t r = 1; r < ranks; ++r) {
          const double x = all[r * mine.size() + at];
          v = max ? std::max(v, x) : v + x;
        }
        plan.sums[i] = v;
      }
    }
  }
  for (TensorId id : ids) {
    FactoredTensor& f = factored_[id];
    STRATA_RETURN_IF_ERROR(
        optimizer_->FactoredNext(f.stats.data(), &f.plan)
            .WithContext("engine: stepping " + specs_[id].name));
  }
  return Status::Ok();
}

Status EngineImpl::GatherFactoredVectors() {
  if (!Factored() || !MultiRank()) return Status::Ok();
  // A vector's statistics: one value, then one per element (its row
  // statistic, the same on every rank, then the elements').
  std::vector<float> mine;
  for (const FactoredTensor& f : factored_) {
    if (f.rows > 1) continue;
    mine.insert(mine.end(), f.stats.begin() + 1, f.stats.end());
  }
  const size_t ranks = static_cast<size_t>(options_.world_size);
  std::vector<float> all(mine.size() * ranks);
  const std::vector<size_t> counts(ranks, mine.size() * sizeof(float));
  STRATA_RETURN_IF_ERROR(
      coll_->AllGather(mine.data(), all.data(), counts, CommType::kByte)
          .WithContext("engine: gathering the vectors' statistics"));
  size_t at = 0;
  for (TensorId id = 0; id < factored_.size(); ++id) {
    FactoredTensor& f = factored_[id];
    if (f.rows > 1) continue;
    const TensorPlace& place = layout_->tensor(id);
    const uint64_t shard = units_[place.unit].elems;
    for (uint64_t e = 0; e < place.elems; ++e, ++at) {
      const size_t owner = static_cast<size_t>((place.offset + e) / shard);
      f.stats[1 + e] = all[owner * mine.size() + at];
    }
  }
  return Status::Ok();
}

// The blob: a magic and the tensor count, then per tensor its name, rows,
// cols, statistics count, sum of squares and statistics.
std::string EngineImpl::FactoredBlob() const {
  std::string out;
  Put(out, kBlobMagic);
  Put(out, static_cast<uint64_t>(factored_.size()));
  for (TensorId id = 0; id < factored_.size(); ++id) {
    const FactoredTensor& f = factored_[id];
    Put(out, static_cast<uint32_t>(specs_[id].name.size()));
    out += specs_[id].name;
    Put(out, static_cast<uint64_t>(f.rows));
    Put(out, static_cast<uint64_t>(f.cols));
    Put(out, static_cast<uint64_t>(f.stats.size()));
    Put(out, f.param_sq);
    out.append(reinterpret_cast<const char*>(f.stats.data()),
               f.stats.size() * sizeof(float));
  }
  return out;
}

Status EngineImpl::LoadFactoredBlob(const std::string& blob, bool apply) {
  const auto corrupt = [](const std::string& what) {
    return Status::Corruption("blob strata.engine.factored: " + what);
  };
  size_t at = 0;
  uint32_t magic = 0;
  uint64_t count = 0;
  if (!Take(blob, at, &magic) || magic != kBlobMagic ||
      !Take(blob, at, &count)) {
    return corrupt("not the optimizer statistics of Adafactor or SM3");
  }
  struct Entry {
    uint64_t rows, cols, n;
    double param_sq;
    size_t at;  // of the statistics
  };
  std::unordered_map<std::string, Entry> saved;
  for (uint64_t k = 0; k < count; ++k) {
    uint32_t len = 0;
    Entry e{};
    if (!Take(blob, at, &len) || blob.size() - at < len) {
      return corrupt("truncated");
    }
    std::string name = blob.substr(at, len);
    at += len;
    if (!Take(blob, at, &e.rows) || !Take(blob, at, &e.cols) ||
        !Take(blob, at, &e.n) || !Take(blob, at, &e.param_sq) ||
        (blob.size() - at) / sizeof(float) < e.n) {
      return corrupt("truncated");
    }
    e.at = at;
    at += e.n * sizeof(float);
    saved[name] = e;
  }
  // Everything is checked before anything changes.
  std::vector<const Entry*> found(factored_.size());
  for (TensorId id = 0; id < factored_.size(); ++id) {
    auto it = saved.find(specs_[id].name);
    if (it == saved.end()) {
      return Status::NotFound(
          "blob strata.engine.factored has no statistics "
          "of tensor " +
          specs_[id].name);
    }
    const FactoredTensor& f = factored_[id];
    if (it->second.rows != f.rows || it->second.cols != f.cols ||
        it->second.n != f.stats.size() || !std::isfinite(it->second.param_sq)) {
      return corrupt("tensor " + specs_[id].name + "'s statistics are " +
                     std::to_string(it->second.n) + " values of a " +
                     std::to_string(it->second.rows) + " x " +
                     std::to_string(it->second.cols) + " tensor; here " +
                     std::to_string(f.stats.size()) + " of " +
                     std::to_string(f.rows) + " x " + std::to_string(f.cols));
    }
    found[id] = &it->second;
  }
  if (!apply) return Status::Ok();
  for (TensorId id = 0; id < factored_.size(); ++id) {
    FactoredTensor& f = factored_[id];
    std::memcpy(f.stats.data(), blob.data() + found[id]->at,
                f.stats.size() * sizeof(float));
    f.param_sq = found[id]->param_sq;
  }
  return Status::Ok();
}

}  // namespace strata::memtier
