// The engine's implementation class (include/strata/engine.h is the API).
// See memtier/engine.cc, Note [Engine threads and locks].
#ifndef STRATA_MEMTIER_ENGINE_IMPL_H_
#define STRATA_MEMTIER_ENGINE_IMPL_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "memtier/arena.h"
#include "memtier/collectives.h"
#include "memtier/grad_spill.h"
#include "memtier/layout.h"
#include "memtier/loss_scale.h"
#include "memtier/row_joiner.h"
#include "memtier/staging.h"
#include "memtier/trace.h"
#include "memtier/worker.h"
#include "strata/engine.h"
#include "strata/swap_space.h"
#include "util/mutex.h"

namespace strata::memtier {

// The roles of a unit, in the order of EngineImpl's per-role arrays.
enum : int { kParam = 0, kGrad, kMaster, kExpAvg, kExpAvgSq, kRoles };

// The CPU optimizer's name of a working dtype.
inline CpuDType ToCpu(ElementType t) {
  switch (t) {
    case ElementType::kFloat32:
      return CpuDType::kFloat32;
    case ElementType::kFloat16:
      return CpuDType::kFloat16;
    case ElementType::kBFloat16:
      break;
  }
  return CpuDType::kBFloat16;
}

// Where a unit stands in an update during backward (EngineImpl's
// early_state_): kEarlyStatistics, its gradient's stats (and Adafactor's
// statistics of its matrices) taken, its update left to Step.
enum : uint8_t {
  kEarlyNone = 0,
  kEarlyUpdating,
  kEarlyUpdated,
  kEarlyStatistics
};

// Where a tensor stands in Adafactor's statistics pass during backward with
// the gradients on NVMe (EngineImpl's early_spilled_): taking its last
// micro-batch's sums chunk by chunk (a matrix's passed, a vector's set
// aside), taken whole (Step reads the spilled gradient for the update
// alone), or left to Step (a chunk came out of order).
enum : uint8_t {
  kSpilledNone = 0,
  kSpilledPassing,
  kSpilledDone,
  kSpilledLeft
};

// Counts asynchronous operations down; the last Finish runs `done` with the
// first error. Thread-safe.
class Countdown {
 public:
  Countdown(size_t n, std::function<void(Status)> done)
      : left_(n), done_(std::move(done)) {
    if (n == 0) done_(Status::Ok());
  }
  void Finish(const Status& st) STRATA_EXCLUDES(mu_) {
    Status first;
    {
      MutexLock l(&mu_);
      if (!st.ok() && first_.ok()) first_ = st;
      if (--left_ != 0) return;
      first = first_;
    }
    done_(std::move(first));
  }

 private:
  Mutex mu_;
  size_t left_ STRATA_GUARDED_BY(mu_);
  Status first_ STRATA_GUARDED_BY(mu_);
  std::function<void(Status)> done_;
};

// Asynchronous operations in flight: Add before each, Finish once each ends;
// Wait blocks until none is left and returns the first error. Thread-safe.
class Inflight {
 public:
  void Add() STRATA_EXCLUDES(mu_) {
    MutexLock l(&mu_);
    ++count_;
    ++started_;
  }
  // How many were ever added.
  uint64_t started() STRATA_EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return started_;
  }
  void Finish(const Status& st) STRATA_EXCLUDES(mu_) {
    MutexLock l(&mu_);
    if (!st.ok() && first_.ok()) first_ = st;
    if (--count_ == 0) cv_.SignalAll();
  }
  Status Wait() STRATA_EXCLUDES(mu_) {
    MutexLock l(&mu_);
    while (count_ > 0) cv_.Wait(&mu_);
    return first_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  size_t count_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t started_ STRATA_GUARDED_BY(mu_) = 0;
  Status first_ STRATA_GUARDED_BY(mu_);
};

struct UnitState {
  // This rank's shard: elements [shard_begin, shard_begin + elems) of the
  // unit's full_elems. The gradient accumulator, the master and the moments
  // cover the shard; the working copy (zero_stage 1 and 2) the whole unit.
  // One rank: the shard is the unit.
  uint64_t elems = 0;
  uint64_t shard_begin = 0;
  uint64_t full_elems = 0;
  ElementType dtype = ElementType::kBFloat16;
  uint64_t param_bytes = 0;  // of the working copy: full_elems
  // ---- Device copy of the parameters ----
  ArenaBlock dev;  // empty unless resident
  // Held while arriving or pinned by a ParamPin: the block stays put and
  // pin.data() is its address. Dropped otherwise, so compaction may move it.
  ArenaPin pin;
  void* addr = nullptr;     // the block's address when `ready` was recorded
  bool rests_here = false;  // params rest on the device: pinned for good
  std::unique_ptr<Event> ready;     // recorded after the copy that fills dev
  std::unique_ptr<Event> use_done;  // Note [Consumer streams]
  bool resident = false;            // dev holds, or is receiving, the params
  bool allocating = false;          // dev is being allocated; wait on cv_
  bool arriving = false;            // the copy is not enqueued yet (NVMe read)
  Status arrival;                   // how the last arrival ended
  bool prefetched = false;          // brought by a prefetch, not fetched since
  int pins = 0;
  uint64_t last_use = 0;  // engine clock, for LRU ties
  // ---- Host and NVMe ----
  std::array<uint64_t, kRoles> host_offset{};  // bytes into host_[role]
  uint64_t full_grad_offset = 0;  // bytes into full_grads_ (zero_stage 1)
  std::array<std::vector<SwapHandle>, kRoles> nvme;  // one per piece
};

// The device as the engine sees it: every call forwarded, and every request
// for memory, a stream or an event counted, so that the stats can say what
// the hot path asked for after the first step.
class AllocationCountingDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) override {
    ++count_;
    return DeviceWrapper::Allocate(bytes, stream);
  }
  StatusOr<HostBuffer> AllocatePinnedHost(
      size_t bytes, const HostBufferOptions& options) override {
    ++count_;
    return DeviceWrapper::AllocatePinnedHost(bytes, options);
  }
  StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) override {
    ++count_;
    return DeviceWrapper::NewStream(options);
  }
  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    ++count_;
    return DeviceWrapper::NewEvent();
  }
  uint64_t count() const { return count_.load(); }

 private:
  std::atomic<uint64_t> count_{0};
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& options, Device* device);
  ~EngineImpl() override;

  static Status CheckOptions(const EngineOptions& options,
                             const Device& device);

  StatusOr<TensorId> Register(const TensorSpec& spec) override;
  Status Start() override;
  Status SetInitialValues(TensorId id, std::span<const float> values) override;
  Status ReadMaster(TensorId id, std::span<float> out) override;
  StatusOr<ParamPin> Fetch(TensorId id) override;
  Status AddGrad(TensorId id, const void* grad, ElementType dtype,
                 Stream& producer) override;
  Status AddGrad(TensorId id, DeviceMemory grad, ElementType dtype,
                 Stream& producer) override;
  Status WaitGrads() override;
  Status BeginStep(const StepArgs& args) override;
  StatusOr<StepResult> Step(const StepArgs& args) override;
  double LossScale() const override;
  Status SaveState(CheckpointWriter& writer, bool params) override;
  Status LoadState(CheckpointReader& reader) override;
  Status SaveState(CheckpointWriter* writer, bool params) override;
  StatusOr<std::string> CommitState(CheckpointWriter* writer) override;
  Status Agree(const Status& local) override;
  EngineStats stats() const override;
  const TensorSpec& spec(TensorId id) const override { return specs_[id]; }
  size_t num_tensors() const override { return specs_.size(); }

  // For ParamPin.
  Status WaitArrival(uint32_t unit, Stream* consumer);
  void Unpin(uint32_t unit, const std::vector<Stream*>& consumers);

 private:
  struct StepPiece;
  struct StepReads;
  class ShardPieces;
  // Note [Updates during backward] (engine.cc): where the pre-update states
  // of a piece updated early are kept.
  struct EarlyPiece {
    uint32_t unit = 0;
    size_t index = 0;
    uint64_t begin = 0, n = 0;
    // Bytes into undo_: master, exp_avg, exp_avg_sq (UndoBytes in all).
    uint64_t undo_offset = 0;
  };

  Residence RoleResidence(int role) const;
  // Note [Data-parallel ranks] (engine.cc).
  bool MultiRank() const { return options_.world_size > 1; }
  // zero_stage 3 over several ranks: each rank keeps its shard of the
  // working copy, and a fetch gathers the shards (Note [Stage 3 over
  // ranks]).
  bool ShardedParams() const { return MultiRank() && options_.zero_stage == 3; }
  // zero_stage 1 and 2 over several ranks: every rank keeps the whole
  // working copy on the device, and the step gathers it (GatherParams).
  bool WholeParams() const { return MultiRank() && !ShardedParams(); }
  // Elements of role `role` this rank holds of a unit: the working copy
  // covers the whole unit unless it is sharded, the other roles this rank's
  // shard.
  uint64_t RoleElems(int role, const UnitState& s) const {
    return role == kParam && !ShardedParams() ? s.full_elems : s.elems;
  }
  // Elements per rank of one all-gather round of parameters of `es` bytes
  // through a buffer of `buffer` bytes: what the buffer holds for every
  // rank, at most allgather_bucket_bytes, at least one.
  uint64_t GatherRound(size_t es, uint64_t buffer) const {
    const uint64_t per = es * static_cast<uint64_t>(options_.world_size);
    uint64_t round = buffer / per;
    if (options_.allgather_bucket_bytes != 0) {
      round = std::min(round, options_.allgather_bucket_bytes / per);
    }
    return std::max<uint64_t>(round, 1);
  }
  // Bytes of one element of the working dtype.
  uint64_t WorkingElementBytes() const {
    return options_.working_dtype == CpuDType::kFloat32 ? 4 : 2;
  }
  // Where this rank's shard starts in its copy of the working copy.
  uint64_t WorkingBegin(const UnitState& s) const {
    return ShardedParams() ? 0 : s.shard_begin;
  }
  // "[a, b, c]", for messages.
  static std::string ShapeText(const std::vector<int64_t>& shape) {
    std::string out = "[";
    for (size_t d = 0; d < shape.size(); ++d) {
      out += (d ? ", " : "") + std::to_string(shape[d]);
    }
    return out + "]";
  }
  // The part of `t` among its unit's elements [first, end) (a shard, a
  // piece): [*lo, *hi) in full-unit elements; false when it holds none.
  static bool PartIn(const TensorPlace& t, uint64_t first, uint64_t end,
                     uint64_t* lo, uint64_t* hi) {
    *lo = std::max(t.offset, first);
    *hi = std::min(t.offset + t.elems, end);
    return *hi > *lo;
  }
  // The part of `t` in this rank's shard of its unit.
  bool ShardPart(const TensorPlace& t, uint64_t* lo, uint64_t* hi) const {
    const UnitState& s = units_[t.unit];
    return PartIn(t, s.shard_begin, s.shard_begin + s.elems, lo, hi);
  }
  // The accumulator of zero_stage 1 with several ranks: the unit's full
  // local gradient.
  float* FullGradAt(uint32_t unit, uint64_t elem) {
    return reinterpret_cast<float*>(full_grads_.data() +
                                    units_[unit].full_grad_offset) +
           elem;
  }
  // Adds n gradient values of tensor `id` at element `elem` of its unit
  // (full-unit coordinates) where this rank keeps them before the
  // reduction (`first`: the tensor's first hand-over of the step), on the
  // accumulator.
  // Where a hand-over's values are: fp32 in host memory, or the caller's
  // dtype in device memory (Note [Gradients reduced on the device]); both
  // null: zeros (a failed hand-over).
  struct GradSource {
    const float* host = nullptr;
    const std::byte* device = nullptr;
    ElementType dtype = ElementType::kFloat32;
    GradSource Advanced(uint64_t elems) const {
      GradSource g = *this;
      if (g.host != nullptr) g.host += elems;
      if (g.device != nullptr) g.device += elems * ElementSize(dtype);
      return g;
    }
  };
  // Whether stages 2 and 3 keep their buckets on the device and reduce
  // there (Note [Gradients reduced on the device]).
  bool DeviceReduce() const {
    return MultiRank() && options_.zero_stage >= 2 && CommOnDevice();
  }
  Status AccumulateRanked(TensorId id, uint64_t elem, const GradSource& src,
                          uint64_t n, bool first);
  // On the accumulator, with DeviceReduce(): a whole hand-over into the
  // device buckets (`failed`: as zeros).
  void AccumulateOnDevice(TensorId id, const void* grad, ElementType dtype,
                          bool first, bool last, Status failed);
  // The end of one accumulator job of a hand-over: its error kept, an
  // update during backward started when it was the unit's last.
  void EndHandOver(TensorId id, bool last, const Status& st)
      STRATA_EXCLUDES(mu_);
  // zero_stage 2: the part of a hand-over inside window `w` of its unit;
  // `part_begins` and `part_ends`: it starts and ends the tensor's part of
  // the window.
  Status AccumulateWindow(TensorId id, uint64_t w, uint64_t elem,
                          const GradSource& src, uint64_t n, bool part_begins,
                          bool part_ends);
  // zero_stage 2: reduce-scatters bucket b into the ranks' gradient shards.
  Status FlushBucket(size_t b);
  // zero_stage 2: the open bucket opened first; buckets_.size() if none is
  // open.
  size_t OldestOpenBucket() const;
  // How many of the unit elements [lo, hi) fall in each rank's shard of
  // `shard` elements (rank r's is [r * shard, (r + 1) * shard)), in rank
  // order: the counts of a collective over that range.
  std::vector<size_t> RankCounts(uint64_t lo, uint64_t hi,
                                 uint64_t shard) const;
  // What Step divides a gradient by: the loss scale and, with several
  // ranks, their number (the reduction sums, the gradient is averaged).
  double InvGradScale(double loss_scale) const {
    return 1.0 / (loss_scale * static_cast<double>(options_.world_size));
  }
  // Reduce-scatters window w of a unit's gradient (`data`, fp32, the
  // window's elements) and adds this rank's part into its accumulator (or
  // overwrites it, the first time in a step). `data` is a device bucket
  // when DeviceReduce() (Note [Gradients reduced on the device]).
  Status ReduceWindow(uint32_t unit, uint64_t w, const float* data);
  // zero_stage 1: reduce-scatters a unit's full gradient into the shards.
  Status ReduceUnitGrad(uint32_t unit, const float* full);
  // The gradient shards of every unit, summed over ranks, before the norm.
  Status ReduceGrads(const std::vector<uint32_t>& counts);
  // Every rank's stats summed in rank order, the same on every rank.
  StatusOr<GradStats> AgreeGradStats(const GradStats& local);
  // Every rank's updated shard of the working copy into every rank's
  // device block.
  Status GatherParams();
  // Note [Stage 3 over ranks] (engine.cc): unit u's shards gathered from
  // every rank into its device block, on the gatherer; ends its arrival.
  void GatherArrival(uint32_t u);
  Status GatherUnit(uint32_t u);
  // GatherUnit with the collectives on device memory (Note [Collectives on
  // device memory]).
  Status GatherUnitInPlace(uint32_t u, const std::string& what);
  // Waits until every hand-over so far is accumulated, keeping its error.
  void WaitGradsQuiet() STRATA_EXCLUDES(mu_);
  // Note [Moment formats] (engine.cc).
  CpuDType MomentDType() const { return options_.optimizer.moment_dtype; }
  static bool IsMoment(int role) {
    return role == kExpAvg || role == kExpAvgSq;
  }
  // Bytes of n elements of role `role` of unit `s`; for a moment, n is a
  // whole piece or the last piece of a unit (one state array each).
  uint64_t RoleBytes(int role, const UnitState& s, uint64_t n) const;
  // Bytes before element `elem` in role `role`'s copy of a unit; for a
  // kBlock8 moment, `elem` is a piece's start or the unit's end.
  uint64_t RoleOffset(int role, const UnitState& s, uint64_t elem) const;
  // Undo bytes of one piece of n elements: master and moments, rounded to
  // 64 so that each piece's saved master stays aligned.
  uint64_t UndoBytes(const UnitState& s, uint64_t n) const {
    return RoundUp(RoleBytes(kMaster, s, n) + 2 * RoleBytes(kExpAvg, s, n), 64);
  }
  // Unique per piece, so that a block read from another piece's slots
  // fails its header check.
  uint64_t SwapTensorId(uint32_t unit, int role, size_t piece) const {
    return ((uint64_t{unit} * kRoles + static_cast<uint64_t>(role)) << 24) +
           piece;
  }
  std::byte* HostAt(int role, uint32_t unit, uint64_t elem);
  // Bytes of role `role` a unit takes in its host array: whole pages, so
  // that every unit starts page-aligned there.
  uint64_t HostBlockBytes(int role, const UnitState& s) const {
    return RoundUp(RoleOffset(role, s, RoleElems(role, s)), 4096);
  }
  // The pinned device block of a unit, plus `bytes`. REQUIRES: s.pin held.
  static std::byte* DevAt(const UnitState& s, uint64_t bytes) {
    return static_cast<std::byte*>(s.pin.data()) + bytes;
  }
  uint64_t PinnedRoleBytes() const;
  Status CheckTensor(TensorId id, const char* what) const;
  // The tensors of a unit, for messages: "a, b and 3 more".
  std::string UnitNames(uint32_t unit) const;
  // Note [Engine failures] (engine.cc).
  Status FailedLocked(const char* what) const STRATA_REQUIRES(mu_);

  // Runs `job` on the mover, urgently, and waits for it.
  Status RunOnMover(std::function<Status()> job);
  // Note [Zero-copy NVMe] (engine.cc).
  void BeginIo() STRATA_EXCLUDES(io_mu_);
  void EndIo() STRATA_EXCLUDES(io_mu_);
  void SubmitRead(uint32_t unit, int role, size_t piece,
                  std::span<std::byte> dst, IoPriority priority, int retries,
                  std::function<void(Status)> done);
  Status PieceError(uint32_t unit, int role, size_t piece, const char* op,
                    const Status& st) const;
  void ReadPieceAsync(uint32_t unit, int role, size_t piece,
                      std::span<std::byte> dst, IoPriority priority,
                      std::function<void(Status)> done);
  void WritePieceAsync(uint32_t unit, int role, size_t piece,
                       std::span<const std::byte> src, IoPriority priority,
                       std::function<void(Status)> done);
  std::future<Status> ReadPieceFuture(uint32_t unit, int role, size_t piece,
                                      std::span<std::byte> dst,
                                      IoPriority priority);
  std::future<Status> WritePieceFuture(uint32_t unit, int role, size_t piece,
                                       std::span<const std::byte> src,
                                       IoPriority priority);
  // The same, waiting on the calling thread (never the completion thread).
  Status ReadPiece(uint32_t unit, int role, size_t piece,
                   std::span<std::byte> dst);
  Status WritePiece(uint32_t unit, int role, size_t piece,
                    std::span<const std::byte> src);
  // Calls fn(bytes, first element, count) over the role's copy of a tensor,
  // in pieces; with `write`, what fn left in the bytes is stored back.
  Status ForEachPieceOfTensor(
      TensorId id, int role, bool write,
      const std::function<void(std::byte*, uint64_t, uint64_t)>& fn);

  Status MakeResident(uint32_t unit, bool pin, bool prefetch, bool* hit)
      STRATA_EXCLUDES(mu_);
  StatusOr<ArenaBlock> AllocateEvicting(uint32_t unit, uint64_t need)
      STRATA_EXCLUDES(mu_);
  Status StartArrival(uint32_t unit, Priority priority) STRATA_EXCLUDES(mu_);
  void FinishArrival(uint32_t unit, const Status& st, uint64_t bytes)
      STRATA_EXCLUDES(mu_);
  std::vector<uint32_t> PrefetchCandidatesLocked() STRATA_REQUIRES(mu_);
  int64_t PickVictimLocked(uint64_t than) STRATA_REQUIRES(mu_);
  Status PinLocked(UnitState& s) STRATA_REQUIRES(mu_);
  void DropLocked(uint32_t unit, std::vector<ArenaBlock>* freed)
      STRATA_REQUIRES(mu_);
  void EvictLocked(uint32_t unit, std::vector<ArenaBlock>* freed)
      STRATA_REQUIRES(mu_);
  bool WaitForArrivalLocked() STRATA_REQUIRES(mu_);
  // Waits until no unit is arriving but those being allocated.
  void WaitArrivalsLocked() STRATA_REQUIRES(mu_);
  Status OutOfDeviceMemoryLocked(uint32_t unit) STRATA_REQUIRES(mu_);
  void InvalidateCaches() STRATA_EXCLUDES(mu_);

  Status AddGradImpl(TensorId id, const void* grad, size_t avail,
                     ElementType dtype, Stream& producer, DeviceMemory* owned);
  // `failed` set: the hand-over failed before its copy (no lease); with
  // several ranks its part goes on as zeros (Note [Data-parallel ranks]).
  void Accumulate(TensorId id, uint64_t begin, uint64_t n, ElementType dtype,
                  bool first, bool last, StagingLease lease, Status failed);

  // Note [Updates during backward] (engine.cc).
  // `args` checked, with loss_scale 0 replaced by the engine's scale
  // (kInvalidArgument naming `what`, and the engine's scale when the
  // caller's differs from the one the engine owns).
  StatusOr<StepArgs> ResolveStepArgs(const StepArgs& args, const char* what)
      STRATA_REQUIRES(mu_);
  void EarlyUpdate(uint32_t unit);
  Status EarlyUpdatePieces(uint32_t unit, const CpuStepArgs& args,
                           bool* finite);
  // A unit left to Step: its gradient's stats, and Adafactor's statistics
  // pass over its matrices, taken on the stepper.
  void EarlyStatistics(uint32_t u);
  // Unit u's pieces' gradient stats into early_stats_, in order; *finite
  // false (the rest not taken) at the first piece that is not finite.
  Status EarlyGradStats(uint32_t u, bool* finite);
  // The stepper's outcome on unit u: an error or an overflow for Step, or
  // the unit in state `done`, counted in *count.
  void EndEarlyWorkLocked(uint32_t u, const Status& st, bool finite,
                          uint8_t done, uint64_t* count) STRATA_REQUIRES(mu_);
  // Gradients on the host, on one rank or with zero_stage 2 or 3 over
  // several (a unit's shard is final once its last hand-overs are reduced;
  // stage 1 reduces at the step): BeginStep's units not updated early go to
  // the stepper for their gradient's stats.
  bool EarlyStatisticsTaken() const {
    return options_.grads != Residence::kNvme &&
           (!MultiRank() || options_.zero_stage >= 2);
  }
  // After BeginStep: whether every tensor of unit u had its last gradient
  // handed over (its next use follows Step).
  bool HandedOverLocked(uint32_t u) const STRATA_REQUIRES(mu_);
  // The arguments of the step BeginStep announced.
  CpuStepArgs EarlyArgsLocked() const STRATA_REQUIRES(mu_);
  // Whether a unit whose last gradients are all in goes to the stepper:
  // to be updated, or (Adafactor) for its statistics.
  bool EarlyWorkLocked() const STRATA_REQUIRES(mu_);
  // Runs the stepper's queued jobs and waits for them.
  void DrainStepper();
  // Puts back the states and working copies of the pieces updated early.
  Status UndoEarly();
  void EndEarlyLocked() STRATA_REQUIRES(mu_);
  // Orders the copy stream after the trainer's uses of the parameters so far
  // (the release stream waits for them: Note [Consumer streams]), before a
  // step rewrites parameters resting on the device.
  Status AfterConsumers() STRATA_EXCLUDES(mu_);

  StatusOr<StepResult> RunStep(const StepArgs& args);
  // The step after the updates during backward: the units `early_state`
  // does not mark updated, or an overflow found over all (RunStep undoes
  // the early ones then).
  StatusOr<StepResult> StepRest(const StepArgs& args,
                                const std::vector<uint8_t>& early_state);
  // Note [Gradients on NVMe]: the open pieces written back, on the
  // accumulator.
  Status FlushGrads();
  // Squared sum and finiteness of the (loss-scaled) gradient of every
  // piece, in piece order, wherever the gradients rest (after FlushGrads);
  // the stats of units updated early are those taken then.
  StatusOr<GradStats> GradientStats(const std::vector<uint8_t>& early_state);
  // The stats of piece p of unit u's gradient resting on the host.
  StatusOr<GradStats> HostGradStats(uint32_t u, size_t p);
  // Note [Step pipeline] (engine.cc).
  // Staging buffers one piece of the step holds.
  size_t StepBuffersPerPiece() const;
  // The pieces of `units` in order; at most `max_depth` read ahead.
  std::unique_ptr<StepReads> NewStepReads(const std::vector<uint32_t>& units,
                                          size_t max_depth);
  // Starts the reads of the next pieces, as many as the buffers free now
  // allow (with `wait`, waits for buffers when none is started).
  Status StartReads(StepReads& reads, bool wait);
  Status UpdateAll(StepReads& reads, const CpuStepArgs& args,
                   std::vector<EarlyPiece>* undo = nullptr);
  // With `undo`, the piece's states before the update are saved there first
  // (Note [Updates during backward]).
  Status UpdatePiece(StepPiece& piece, const CpuStepArgs& args,
                     std::vector<std::future<Status>>* writes,
                     std::vector<EarlyPiece>* undo);
  void UpdateTierStatsLocked() STRATA_REQUIRES(mu_);

  // Note [Factored optimizers in the engine] (memtier/factored.cc).
  bool Factored() const {
    return CpuOptimizerIsFactored(options_.optimizer.cpu.algo);
  }
  // Whether role `role` has a copy of every element: not the moments a
  // factored optimizer does not keep per element.
  bool RoleKept(int role) const;
  // Checks the tensors' shapes and the options, and sizes factored_.
  Status StartFactored();
  // Begins every tensor's plan and runs the passes before the update
  // (Adafactor's statistics and RMS), over the gradients on the host or,
  // resting on NVMe, read back a piece at a time (FactoredSpilledPass).
  // `early_state` is Step's copy of early_state_: the matrices of its
  // kEarlyStatistics units passed during backward
  // (PassesDuringBackward).
  Status FactoredBeforeUpdate(const CpuStepArgs& args,
                              const std::vector<uint8_t>& early_state);
  // The due plans' pass over every piece of the spilled gradients that
  // holds a part of one of `due` the pass reads, the next piece's read in
  // flight while a piece passes, a matrix's pieces joined into whole rows
  // (Note [Whole rows from pieces] in row_joiner.h).
  Status FactoredSpilledPass(const std::vector<TensorId>& due);
  // Whether tensor `id` is due (is_due[id]) and its plan's pass reads some
  // of its part in the full-unit elements [first, end) of its unit's shard
  // (CpuFactoredPassReads); that part in *lo, *hi (full-unit elements).
  bool PassReads(TensorId id, uint64_t first, uint64_t end,
                 const std::vector<uint8_t>& is_due, uint64_t* lo = nullptr,
                 uint64_t* hi = nullptr) const;
  // The update of the tensors in `t`'s piece: elements [begin, begin + t.n)
  // of unit u's shard.
  Status FactoredUpdate(uint32_t u, uint64_t begin,
                        const CpuOptimizerTensors& t);
  // Note [Adafactor's statistics during backward] (factored.cc): on the
  // stepper, Adafactor's statistics pass over unit u's matrices, those
  // PassesDuringBackward names.
  // Counts the matrices passed in *passed.
  Status EarlyFactoredPasses(uint32_t u, const CpuStepArgs& args,
                             uint64_t* passed);
  // The elements of tensor `id`'s hand-over chunk that begins at its
  // element b: at most `per` and, with the gradients on NVMe on one rank,
  // none past the end of the piece that holds element b (so that the
  // pieces' sums a chunk ends are the ranges Step would pass).
  uint64_t HandOverChunk(TensorId id, uint64_t b, uint64_t per) const;
  // Gradients on NVMe: whether the accumulator takes every tensor's last
  // chunks as the spill holds their sums (Adafactor on one rank), and the
  // taking of tensor `id`'s elements [begin, begin + n) (on the
  // accumulator), `g` the chunk's sums: a matrix's statistics pass, a
  // vector's sums set aside.
  bool TakesSpilledChunks() const;
  // Step's statistics pass over a vector's sums set aside during backward,
  // in the ranges the spilled pieces would give.
  Status FactoredCopiedPass(TensorId id);
  void EarlySpilledChunk(TensorId id, uint64_t begin, uint64_t n,
                         const float* g);
  bool PassesDuringBackward(TensorId id) const {
    return options_.optimizer.cpu.algo == CpuOptimizerAlgo::kAdafactor &&
           factored_[id].rows >= 2;  // a vector's pass writes in place
  }
  // Begins tensor `id`'s plan for the step `args`.
  Status BeginFactored(TensorId id, const CpuStepArgs& args);
  // Tensor `id`'s plan's pass over this rank's part of its gradient on the
  // host.
  Status FactoredHostPass(TensorId id);
  // Tensor `id`'s plan's pass (before the update) over its elements
  // [begin, begin + n), whose gradient is at `grad`.
  Status FactoredGradPass(TensorId id, const float* grad, uint64_t begin,
                          uint64_t n);
  // Ends every tensor's plan after the update (SM3's new accumulators, the
  // weights' sum of squares).
  Status FactoredAfterUpdate();
  // The plans in `ids` reduced over the ranks (a collective), then
  // advanced (FactoredNext).
  Status FactoredNextAll(const std::vector<TensorId>& ids);
  // Every rank's vector statistics made whole (a collective): each element
  // from the rank whose shard holds it.
  Status GatherFactoredVectors();
  // The checkpoint blob of the statistics, and its load: checked alone
  // unless `apply`.
  std::string FactoredBlob() const;
  Status LoadFactoredBlob(const std::string& blob, bool apply);

  // Checkpoints (memtier/state_io.cc, Note [Streaming the state]).
  // Takes the engine for a save or a load as Step does (stepping_), once
  // every arrival has landed; EndExclusive gives it back.
  Status BeginExclusive(const char* what, bool load);
  void EndExclusive();
  // The placements of tensors in elements [begin, begin + n) of unit u's
  // shard, for a checkpoint whose tensor i is engine tensor ckpt_of[i]
  // (identity when empty).
  std::vector<StatePlacement> PlacementsOf(
      uint32_t unit, uint64_t begin, uint64_t n,
      const std::vector<uint32_t>& index) const;
  // The number of pieces of a unit's shard.
  size_t NumPieces(uint32_t unit) const {
    return (units_[unit].elems + piece_elems_ - 1) / piece_elems_;
  }
  Status SaveRole(CheckpointWriter& writer, int role, Inflight& writes);
  // Every registered tensor declared to `writer`, numbered as the engine
  // numbers them.
  Status DeclareTensors(CheckpointWriter& writer);
  // Role r's `bytes` from element `begin` of unit u where they rest (the
  // host or the device; not NVMe) into `buf`.
  Status CopyOut(int role, uint32_t unit, uint64_t begin, size_t bytes,
                 std::byte* buf);
  // Note [Moment formats in checkpoints]: role r's n elements in `buf`, as
  // the role holds them (`raw` bytes), converted in place into an extent's
  // payload (moments as fp32 slots; int8 ones' scales appended to
  // `scales`); returns the payload's bytes.
  size_t ToExtentPayload(int role, std::byte* buf, uint64_t n, size_t raw,
                         std::vector<float>* scales) const;
  // `bytes` of payload in `lease`, zero-padded and handed to the writer as
  // one extent; the lease goes back when the write is done.
  Status WriteStaged(CheckpointWriter& writer, StateRole state,
                     std::shared_ptr<StagingLease> lease, size_t bytes,
                     std::vector<StatePlacement> places, Inflight& writes);
  // int8 moments: role r's block scales, in the blob the load reads them
  // from; nothing for other roles and formats.
  Status PutScales(CheckpointWriter& writer, int role,
                   const std::vector<float>& scales);
  // The placements of tensors in elements [lo, lo + n) of unit u (unit
  // coordinates, not the shard's).
  std::vector<StatePlacement> PlacementsInUnit(
      uint32_t unit, uint64_t lo, uint64_t n,
      const std::vector<uint32_t>& index) const;
  // The blob strata.engine: step, loss scale, optimizer, layout.
  std::string EngineBlobJson() const STRATA_EXCLUDES(mu_);
  // Note [Checkpoints over ranks] (state_io.cc).
  Status SaveStateRanked(CheckpointWriter* writer, bool params);
  // Role r of every rank's shard to rank 0, which writes it; `local` keeps
  // this rank's first error (the collectives go on after it, so that no
  // rank waits for another forever); the return is a collective's failure.
  Status SaveRoleRanked(CheckpointWriter* writer, int role, Inflight& writes,
                        Status& local);
  // Rank 0: the whole working copy of every unit, from its own.
  Status SaveWholeParams(CheckpointWriter& writer, Inflight& writes);
  // Piece p of the whole working copy of unit u from the checkpoint: its
  // stored one when `ckpt_params`, else its master rounded.
  Status LoadWholeParamPiece(CheckpointReader& reader, uint32_t unit,
                             size_t piece, const std::vector<uint32_t>& index,
                             bool ckpt_params, Inflight& writes);
  // The pieces of a unit's whole working copy.
  size_t NumWholePieces(uint32_t unit) const {
    return (units_[unit].full_elems + piece_elems_ - 1) / piece_elems_;
  }
  // Every rank has the same `mine` (hashed), else kInvalidArgument naming
  // `what` and the first rank that differs from rank 0. A collective.
  Status AgreeSame(const std::string& what, const std::string& mine);
  // Agree without waiting for the gradients.
  Status AgreeNow(const Status& local) {
    return MultiRank() ? AgreeOver(*coll_, local) : local;
  }
  // Agree over `coll` (the engine's, or the gatherer's own): every rank
  // gets OK or the lowest failing rank's status as "rank R: ...".
  Status AgreeOver(RankCollectives& coll, const Status& local);
  // Whether the collectives run on device memory (Note [Collectives on
  // device memory]).
  bool CommOnDevice() const {
    return options_.comm_memory == CommMemory::kDevice ||
           (options_.comm_memory == CommMemory::kAuto && options_.comm &&
            options_.comm->backend() == CommBackendKind::kNccl);
  }
  // Note [Moment formats in checkpoints]: the block scales of int8 moments
  // a load puts back, per moment, in piece order; `first[u]` is the index
  // of unit u's first block.
  struct Block8Scales {
    std::vector<float> exp_avg, exp_avg_sq;
    std::vector<uint64_t> first;
  };
  Status LoadPiece(CheckpointReader& reader, uint32_t unit, size_t piece,
                   const std::vector<uint32_t>& index, bool ckpt_params,
                   const Block8Scales* scales, Inflight& writes);
  // Stores `bytes` of role r's piece p of unit u (in `lease`) where the role
  // rests; the lease goes back when the data is stored.
  void StorePiece(uint32_t unit, int role, size_t piece,
                  std::shared_ptr<StagingLease> lease, Inflight& writes);

  const EngineOptions options_;
  AllocationCountingDevice counting_device_;
  Device* const device_;                                // &counting_device_
  uint64_t allocations_after_first_step_ = UINT64_MAX;  // set by Step

  // Fixed at Start (read without the lock afterwards).
  std::vector<TensorSpec> specs_;
  std::vector<uint64_t> numel_;
  std::unique_ptr<Layout> layout_;
  uint64_t piece_elems_ = 0;
  uint64_t device_budget_ = 0;
  std::unique_ptr<StagingPool> staging_;
  // Note [Data-parallel ranks]: the communicator (null with one rank), the
  // full local gradients of zero_stage 1, and zero_stage 2's buckets (each
  // one window of a unit's full gradient, one hand-over per tensor) with
  // the reduce-scatter's output. The buckets and the windows' written flags
  // are the accumulator's (and Step's, once the accumulator is idle).
  std::shared_ptr<Communicator> comm_;
  // Note [Collectives on device memory]: every collective over comm_ (made
  // with the engine: agreements may come before Start).
  std::unique_ptr<RankCollectives> coll_;
  // Note [Stage 3 over ranks]: the gathers' own communicator (a duplicate
  // of comm_) and its collectives, used by the gatherer alone.
  std::unique_ptr<Communicator> gather_comm_;
  std::unique_ptr<RankCollectives> gather_coll_;
  uint64_t gather_coll_bytes_ = 0;  // its device buffer's size
  // coll_'s stream (on the device), where DeviceReduce()'s buckets are
  // filled: AddGrad enqueues its waits there without coll_'s lock.
  Stream* comm_stream_ = nullptr;
  HostBuffer full_grads_;
  struct GradBucket {
    int64_t unit = -1;              // -1: free
    uint64_t window = 0;            // elements [window * window_elems_, ...)
    uint64_t opened = 0;            // order of opening
    std::vector<uint32_t> present;  // tensors handed over into it
    uint32_t ended = 0;             // of which whole in the window
    uint32_t expected = 0;          // tensors overlapping the window
    HostBuffer mem;                 // or, with DeviceReduce(), on the device:
    DeviceMemory dev;
  };
  std::vector<GradBucket> buckets_;
  uint64_t buckets_opened_ = 0;
  HostBuffer reduce_out_;
  uint64_t window_elems_ = 0;
  std::vector<uint64_t> window_base_;    // per unit: its first window's flag
  std::vector<uint8_t> window_written_;  // per window, this step
  // Note [Gradients on NVMe]: its own buffers, so that hand-overs waiting
  // for staging buffers never starve the accumulator.
  std::unique_ptr<StagingPool> grad_pool_;
  std::unique_ptr<GradSpill> grad_spill_;   // touched by the accumulator
  std::unique_ptr<DeviceArena> arena_;      // the device budget, one allocation
  std::unique_ptr<Stream> copy_stream_;     // host -> device
  std::unique_ptr<Stream> d2h_stream_;      // gradients, device -> host
  std::unique_ptr<Stream> release_stream_;  // Note [Consumer streams]
  std::unique_ptr<CpuOptimizer> optimizer_;
  // Note [Factored optimizers in the engine]: per tensor (empty unless
  // Factored()), touched by Step, SaveState and LoadState alone, and
  // between BeginStep and Step by the stepper (a plan, read-only stats).
  struct FactoredTensor {
    size_t rows = 0, cols = 0;  // as CpuOptimizerTensors (rows 0: a vector)
    std::vector<float> stats;   // CpuStepFootprint::exp_avg_sq_bytes
    // The sum of the squares of the tensor's master (scale_parameter): it
    // is zero-filled at Start.
    double param_sq = 0.0;
    CpuFactoredPlan plan;
  };
  std::vector<FactoredTensor> factored_;
  std::array<HostBuffer, kRoles> host_;  // roles resting on the host
  std::unique_ptr<SwapSpace> swap_;      // touched by the mover only
  std::vector<float> scratch_;           // the accumulator's conversions
  std::unique_ptr<Event> producer_event_;
  std::unique_ptr<Event> released_;  // the release stream's work so far
  std::atomic<bool> started_{false};

  mutable Mutex mu_;
  CondVar cv_;        // unit allocation and arrival
  CondVar step_cv_;   // stepping_ cleared
  CondVar grads_cv_;  // grads_pending_ lowered
  // Unit states: the residency fields are guarded by mu_; the storage
  // fields (host_offset, nvme) are fixed at Start or touched by the mover.
  std::vector<UnitState> units_;
  std::unique_ptr<FetchTrace> trace_ STRATA_GUARDED_BY(mu_);
  std::vector<uint32_t> grad_count_ STRATA_GUARDED_BY(mu_);
  uint64_t device_used_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t clock_ STRATA_GUARDED_BY(mu_) = 0;
  int64_t steps_ STRATA_GUARDED_BY(mu_) = 0;
  LossScaler loss_scaler_ STRATA_GUARDED_BY(mu_);
  bool stepping_ STRATA_GUARDED_BY(mu_) = false;
  bool started_steps_ STRATA_GUARDED_BY(mu_) = false;
  uint64_t grads_pending_ STRATA_GUARDED_BY(mu_) = 0;
  Status grad_error_ STRATA_GUARDED_BY(mu_);
  EngineStats stats_ STRATA_GUARDED_BY(mu_);
  uint64_t h2d_bytes_ STRATA_GUARDED_BY(mu_) = 0;
  // The optimizer's time in the step under way (EngineStats::update_seconds).
  double update_seconds_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t d2h_bytes_ STRATA_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> nvme_read_bytes_{0};
  std::atomic<uint64_t> nvme_write_bytes_{0};
  // A Step that failed part-way (Note [Engine failures]); OK otherwise.
  Status failed_ STRATA_GUARDED_BY(mu_);
  // What failed_ means, for FailedLocked's message.
  std::string failed_reason_ STRATA_GUARDED_BY(mu_) =
      "a Step failed part-way and left the training state partly updated";

  // Note [Updates during backward] (engine.cc).
  bool early_armed_ STRATA_GUARDED_BY(mu_) = false;
  StepArgs early_args_ STRATA_GUARDED_BY(mu_);
  // Per tensor: its last gradient was handed over; its copies not yet added.
  std::vector<uint8_t> last_handed_ STRATA_GUARDED_BY(mu_);
  std::vector<uint32_t> last_chunks_ STRATA_GUARDED_BY(mu_);
  // Per unit: tensors whose last gradient is not added yet; kEarly* state.
  std::vector<uint32_t> unit_waiting_ STRATA_GUARDED_BY(mu_);
  std::vector<uint8_t> early_state_ STRATA_GUARDED_BY(mu_);
  bool early_overflow_ STRATA_GUARDED_BY(mu_) = false;
  Status early_error_ STRATA_GUARDED_BY(mu_);
  // The stepper's, read by Step once it has drained the stepper.
  HostBuffer undo_;
  uint64_t undo_used_ = 0;
  std::vector<EarlyPiece> early_pieces_;
  // Per unit and piece: the gradient's stats taken before an early update
  // or with the early statistics.
  std::vector<std::vector<GradStats>> early_stats_;
  // Note [Adafactor's statistics during backward] (factored.cc), gradients
  // on NVMe: the accumulator's, read by Step once the hand-overs are in.
  // Per tensor: kSpilled* state, and the element its next chunk begins at.
  std::vector<uint8_t> early_spilled_;
  std::vector<uint64_t> early_spilled_next_;
  // Adafactor, gradients on NVMe on one rank (else empty): per tensor, where
  // a vector's (one-row matrix's) last sums go in early_vectors_, UINT64_MAX
  // for a matrix, whose statistics pass runs there and then.
  std::vector<uint64_t> early_vector_at_;
  std::vector<float> early_vectors_;
  RowJoiner early_rows_{
      [this](TensorId id, const float* g, uint64_t n, uint64_t begin) {
        return FactoredGradPass(id, g, begin, n);
      }};

  // LoadState's loaders: one device copy and its wait at a time on the copy
  // stream (Note [Streaming the state]).
  Mutex state_copy_mu_;

  // NVMe operations submitted and whose `done` has not returned yet: the
  // destructor waits for none before it destroys the swap space.
  Mutex io_mu_;
  CondVar io_cv_;
  uint64_t io_inflight_ STRATA_GUARDED_BY(io_mu_) = 0;

  // Last: their jobs use everything above. Reset first in the destructor.
  std::unique_ptr<Worker> mover_;        // all NVMe I/O
  std::unique_ptr<Worker> accumulator_;  // gradient accumulation
  // Updates during backward; posted to by the accumulator.
  std::unique_ptr<Worker> stepper_;
  // Note [Stage 3 over ranks]: the fetches' gathers, in the order fetches
  // decided them (one priority: first in, first out).
  std::unique_ptr<Worker> gatherer_;
};

}  // namespace strata::memtier

#endif  // STRATA_MEMTIER_ENGINE_IMPL_H_
