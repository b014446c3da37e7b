// Engine: strata's tiered memory manager behind a ZeRO-3 style API.
//
// A trainer registers its parameters, starts the engine, and then, every
// micro-batch, fetches each parameter just before use (a pinned device view),
// drops the pin after use, and hands over its gradient; every step it calls
// Step(), which runs the CPU optimizer over every partition wherever its fp32
// master and moments rest. The engine keeps each role of each partition in
// the tier the options name (device, pinned host RAM or NVMe), moves it just
// in time through a fixed pool of pinned staging buffers, prefetches by the
// order recorded in the first step, and evicts the cached device copy whose
// next use is furthest away.
//
// Roles: registering a trainable parameter creates its working-precision
// parameter (fp16/bf16, what Fetch returns), its fp32 gradient accumulator,
// its fp32 master and its two Adam moments (fp32, bf16 or 8-bit:
// OptimizerOptions::moment_dtype), all over the same layout
// (memtier/layout.h, Note [Units and partitions]). Adafactor and SM3 keep
// no second moment per element (their statistics per row and column of a
// tensor of one or two dimensions rest in host memory) and a first moment
// only when they use one (docs/memtier.md, "Adafactor and SM3").
//
// Thread contract: thread-safe. Fetch, pins and AddGrad may be used from
// several threads; Step excludes them (calls made during a Step wait for it).
// Pins and tickets must be dropped before the engine is destroyed.
#ifndef STRATA_ENGINE_H_
#define STRATA_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/checkpoint.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine_options.h"
#include "strata/export.h"
#include "strata/status.h"

namespace strata {

namespace memtier {
class EngineImpl;
}  // namespace memtier

using TensorId = uint32_t;

struct TensorSpec {
  std::string name;            // unique; for messages and stats
  std::vector<int64_t> shape;  // every dimension > 0
  // Working precision: what Fetch returns. kFloat16 or kBFloat16.
  ElementType dtype = ElementType::kBFloat16;
};

// A fetched parameter: its device copy stays where it is (never evicted or
// moved) while the pin lives. Move-only; dropping it releases the parameter.
// The data may still be in flight when the pin is returned: make a stream
// wait for it with WaitOn (the host does not wait), or wait on the host.
class STRATA_EXPORT ParamPin {
 public:
  ParamPin() = default;
  ParamPin(ParamPin&& other) noexcept;
  ParamPin& operator=(ParamPin&& other) noexcept;
  ParamPin(const ParamPin&) = delete;
  ParamPin& operator=(const ParamPin&) = delete;
  ~ParamPin();

  // The tensor's device address (valid while pinned) and size.
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  ElementType dtype() const { return dtype_; }
  bool empty() const { return engine_ == nullptr; }

  // Work enqueued on `consumer` after this call runs once the data has
  // arrived. The consumer's use lasts until the pin is dropped: the device
  // copy is reused only after the work enqueued on `consumer` by then is
  // done. Does not wait for the copy to the device; while the fetch still
  // reads from NVMe it blocks the host until the read is done and the copy
  // is queued (prefetch makes that rare; docs/memtier.md says why the
  // stream cannot wait for the read instead). A failed read is returned.
  Status WaitOn(Stream& consumer);
  // Blocks the host until the data has arrived on the device.
  Status Wait();
  // Releases now (as the destructor).
  void Reset();

 private:
  friend class memtier::EngineImpl;
  memtier::EngineImpl* engine_ = nullptr;
  uint32_t unit_ = 0;
  // Streams made to wait by WaitOn: their use ends when the pin drops.
  std::vector<Stream*> consumers_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  ElementType dtype_ = ElementType::kBFloat16;
};

struct StepArgs {
  double lr = 1e-3;
  // What the gradients handed over were multiplied by; they are divided by
  // it before use. A non-finite gradient skips the step (fp16 overflow).
  // 0 (the default): the engine's own scale, Engine::LossScale(). With
  // EngineOptions::loss_scale.mode static or dynamic the engine owns the
  // scale and any other value must equal LossScale(); with mode none the
  // caller may pass its own (> 0, finite).
  double loss_scale = 0.0;
  // Clip the global L2 norm of the (unscaled) gradient to this; 0 = off.
  double max_grad_norm = 0.0;
};

struct StepResult {
  bool applied = false;     // false: an inf/nan was found; nothing changed
  double grad_norm = 0.0;   // global L2 norm of the unscaled gradient
  int64_t step = 0;         // steps applied so far
  double loss_scale = 1.0;  // the scale this step's gradients were divided by
};

// Counters per tier (bytes are SUM gauges, counts COUNT).
struct TierStats {
  uint64_t resident_bytes = 0;  // data resting here now
  uint64_t peak_bytes = 0;
};

struct EngineStats {
  TierStats device, host, nvme;
  uint64_t pinned_host_bytes = 0;  // everything the engine page-locked
  // This rank's fp32 master and moments (in their format), wherever they
  // rest: with world_size N above 1, the rank's shard, about 1/N of the
  // model's.
  uint64_t optimizer_state_bytes = 0;
  // This rank's gradient memory: the fp32 accumulator (the rank's shard with
  // world_size above 1) plus, with several ranks, what the reduction needs
  // (zero_stage 1: the full local gradient; 2: the buckets).
  uint64_t grad_bytes = 0;
  uint64_t staging_bytes = 0;  // of which staging buffers
  // Bytes moved, per direction.
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  // Fetches, how many found the unit on the device already (a cache or a
  // prefetch hit), prefetches issued, and the time fetches made the host
  // wait (stall), seconds.
  uint64_t fetches = 0, fetch_hits = 0, prefetches = 0;
  uint64_t prefetch_hits = 0;  // fetches served by a prefetch
  double stall_seconds = 0;
  uint64_t evictions = 0, order_changes = 0;
  uint64_t steps = 0, skipped_steps = 0;
  double loss_scale = 1.0;  // LossScale() now
  // Units updated while backward still ran (BeginStep), and of those the
  // ones undone because a later gradient was not finite.
  uint64_t early_units = 0, early_undone = 0;
  // Units not updated early whose gradient's norm and overflow stats (and
  // Adafactor's statistics pass over their matrices) were taken while
  // backward still ran (BeginStep), so that Step read their gradient once,
  // for the update.
  uint64_t early_statistics = 0;
  // Adafactor: matrices whose statistics pass ran while backward still ran
  // (BeginStep), so that Step read their gradient once fewer: with the
  // gradients on the host with their unit's stats (early_statistics), on
  // NVMe from the last micro-batch's sums before the pieces were written.
  uint64_t early_passes = 0;
  double step_seconds = 0;  // of the last Step
  // Of the last Step, the CPU optimizer's own time: its passes over every
  // piece it updated (CpuStepResult), those updated early during backward
  // included, which can make it exceed step_seconds. step_seconds well
  // above it means the step waited on moving states, not on the update.
  double update_seconds = 0;
  // Memory, streams and events obtained from the system (host or device)
  // after the first step: the hot path should never allocate. The device
  // arena makes at start the events its frees and compactions can hold at
  // once (for up to 4096 blocks of the smallest unit), so how far the
  // streams lag does not change this count.
  uint64_t hot_path_allocations = 0;
  // Device arena: free bytes split in pieces; 1 - largest free / free.
  double fragmentation = 0;
  uint64_t compactions = 0;
};

class STRATA_EXPORT Engine {
 public:
  // `device` is not owned and must outlive the engine. Validates the
  // options (kInvalidArgument naming the field).
  static StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                  Device* device);
  virtual ~Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Before Start: registers a trainable parameter.
  virtual StatusOr<TensorId> Register(const TensorSpec& spec) = 0;
  // Lays the tensors out, reserves every tier (kOutOfMemory or kNoSpace when
  // a budget, the host or a drive cannot hold them, saying what was asked
  // and what is free) and zero-fills every role.
  virtual Status Start() = 0;
  // After Start, before the first Step: a tensor's initial values (fp32,
  // numel elements), written to its master and working copy.
  virtual Status SetInitialValues(TensorId id,
                                  std::span<const float> values) = 0;
  // The fp32 master of a tensor (numel elements), wherever it rests. With
  // world_size above 1 a collective: every rank calls it, in the same order,
  // and gets the whole tensor gathered from the ranks' shards.
  virtual Status ReadMaster(TensorId id, std::span<float> out) = 0;

  // Returns at once: a pin whose data arrives asynchronously (NVMe -> pinned
  // host -> device). Evicts colder device copies as needed (waiting for
  // unpinned ones still arriving); kOutOfMemory when the pinned units alone
  // fill the device budget. A failed read is reported by the pin's Wait and
  // WaitOn (and by a Fetch of the same tensor while a pin holds it); the
  // copy is dropped with the last pin and the next Fetch reads again.
  // With zero_stage 3 and world_size above 1, a Fetch or prefetch that
  // misses gathers the unit from the ranks' shards (a collective): every
  // rank fetches the same tensors in the same order from one thread and
  // drops its pins in the same order; a failed gather fails the engine on
  // every rank (docs/memtier.md, "Data-parallel ranks").
  virtual StatusOr<ParamPin> Fetch(TensorId id) = 0;

  // Hands over a gradient of `id` in device memory (numel elements of
  // `dtype`, multiplied by the loss scale), produced by work enqueued on
  // `producer` so far. It is copied to the host without blocking `producer`
  // and accumulated in fp32 (micro-batches add up until the next Step).
  // `grad` must stay unchanged until WaitGrads() returns (or use the
  // DeviceMemory overload, whose memory the engine frees in stream order).
  // With world_size above 1 every rank hands over the same tensors in the
  // same order (the reductions follow it), each its own data's gradient:
  // Step averages them over the ranks (docs/memtier.md, "Data-parallel
  // ranks").
  virtual Status AddGrad(TensorId id, const void* grad, ElementType dtype,
                         Stream& producer) = 0;
  virtual Status AddGrad(TensorId id, DeviceMemory grad, ElementType dtype,
                         Stream& producer) = 0;
  // Blocks until every gradient handed over has been accumulated.
  virtual Status WaitGrads() = 0;

  // Optional, before the backward of the step's last micro-batch: the next
  // gradient handed over for each tensor is its last before Step(args). The
  // engine may then update a unit (master, moments, working copy) as soon as
  // the last gradients of all its tensors are in, while the trainer's
  // backward still runs, for up to EngineOptions::step_overlap_bytes of
  // optimizer state; Step(args) updates the rest. A non-finite gradient
  // found later undoes those updates, so the result is bit-identical to a
  // Step without BeginStep (docs/memtier.md, "Updates during backward").
  // A unit not updated early (no room in that buffer, none at all, or
  // Adafactor and SM3, whose updates wait for the whole gradient) still has
  // its gradient's norm and overflow stats taken then, and with Adafactor
  // the statistics pass over its matrices: they change no state, need no
  // buffer, and leave Step one read of that gradient, for the update, to
  // the same bits. Gradients on the host; over ranks, zero_stage 2 or 3.
  // Needs args.max_grad_norm == 0 (clipping needs the norm of the whole
  // gradient first); Step must get the same args. Until Step returns, a
  // tensor whose last gradient was handed over may be neither fetched nor
  // given another gradient (kFailedPrecondition): a tensor used twice in
  // one backward (tied weights) sums its gradients before handing them over.
  virtual Status BeginStep(const StepArgs& args) = 0;

  // The optimizer over every partition: unscale, overflow check, clip,
  // update, and the new working copy sent to where parameters rest. Waits
  // for the gradients and clears them afterwards. A Step that fails once the
  // update has begun (a read or write-back of the states) leaves them
  // partly updated: the engine then refuses every later call that touches
  // them with kFailedPrecondition quoting the error (docs/memtier.md).
  virtual StatusOr<StepResult> Step(const StepArgs& args) = 0;

  // The scale to multiply the next step's loss by (fp16 mixed precision):
  // 1 with EngineOptions::loss_scale.mode none, initial_scale with static,
  // and with dynamic the scale each Step moves: an overflow (a skipped step)
  // spends hysteresis and then halves it, `window` good steps double it.
  // Saved and loaded with the state. Thread-safe.
  virtual double LossScale() const = 0;

  // Checkpoints (include/strata/checkpoint.h, docs/checkpoints.md). Both
  // run between steps, like a Step: they exclude Fetch, AddGrad and Step
  // (kFailedPrecondition while a Step runs), and stream each role of each
  // piece from where it rests through the staging buffers, never gathering
  // the state in RAM.
  //
  // SaveState declares every tensor to `writer` and writes its fp32 master
  // and moments (and, with `params`, its working copy), plus a blob
  // "strata.engine" (the step count, the loss scale, the optimizer's
  // settings and the moment format); the caller adds its own blobs and commits.
  // Moments are stored as fp32 slots: bf16 ones widened exactly, int8 ones as
  // one code per slot with their block scales in blobs (docs/checkpoints.md).
  // Gradients accumulated since the last Step are not saved.
  virtual Status SaveState(CheckpointWriter& writer, bool params = false) = 0;
  // LoadState replaces the master, the moments, the working copy (the
  // checkpoint's when it has one, else the master rounded to the working
  // dtype), the step count and a dynamic loss scale with a checkpoint's, found
  // by tensor name: the checkpoint may come from any partition layout or tier
  // placement, but every registered tensor must be in it with the same shape
  // (kNotFound, kInvalidArgument naming it; nothing changed then). fp32 and
  // bf16 moments load into each other; int8 moments only into int8 moments of
  // the same layout (tensors, partition_bytes, piece size, world_size), else
  // kInvalidArgument naming both. Needs no pin held and
  // no gradient handed over since the last Step. A read that fails after
  // the first write (a corrupt extent) leaves the state partly loaded: the
  // engine then refuses every later call as after a failed Step; check a
  // checkpoint first with CheckpointReader::Verify where that matters.
  virtual Status LoadState(CheckpointReader& reader) = 0;

  // Several ranks (EngineOptions::world_size above 1; docs/checkpoints.md,
  // "Several ranks"). A checkpoint is the same whatever the world size: full
  // tensors by name and global shape, loadable at any world size. Saving is
  // a collective: every rank calls SaveState, each rank's shard of each
  // piece goes to rank 0 through the staging buffers, and rank 0 alone
  // writes: `writer` is rank 0's and null on every other rank (a writer
  // there, or none on rank 0, is an error). Then rank 0 adds its blobs and
  // every rank calls CommitState, which commits on rank 0. Loading: every
  // rank opens the same checkpoint and calls LoadState, which reads only
  // the rank's shard (and the whole working copy, which every rank keeps).
  // Each of these returns the same Status on every rank: a failure on any
  // rank (a write or read error, a refused option, a checkpoint that
  // differs between ranks) is every rank's, naming the rank it came from,
  // and nothing is published then. With one rank, SaveState(&writer) is
  // SaveState(writer) (null is kInvalidArgument) and CommitState is
  // writer->Commit().
  virtual Status SaveState(CheckpointWriter* writer, bool params = false) = 0;
  virtual StatusOr<std::string> CommitState(CheckpointWriter* writer) = 0;
  // Every rank's `local` status agreed over the ranks: OK when every rank's
  // is, else the first failing rank's (lowest rank), as "rank R: <message>"
  // with its code, on every rank. A collective (every rank calls it, between
  // steps, as SaveState); waits for the gradients handed over so far first.
  // With one rank it returns `local`. For the trainer's own steps of a save,
  // e.g. a CheckpointWriter::Begin that failed on rank 0.
  virtual Status Agree(const Status& local) = 0;

  virtual EngineStats stats() const = 0;
  virtual const TensorSpec& spec(TensorId id) const = 0;
  virtual size_t num_tensors() const = 0;

 protected:
  Engine() = default;
};

// The stats as a JSON object (field names as above; bytes and counts as
// integers, seconds as numbers).
STRATA_EXPORT std::string EngineStatsJson(const EngineStats& stats);

}  // namespace strata

#endif  // STRATA_ENGINE_H_
