// The engine: registry, residency, fetch/release with prefetch and eviction,
// gradient hand-over and the pipelined optimizer step.
//
// Note [Engine threads and locks]
// - mu_ guards every unit's residency and pins, the trace and the stats. No
//   I/O, device allocation or device synchronization is done while holding
//   it: Fetch decides under the lock (victims, bytes reserved), then frees,
//   allocates and enqueues outside it, then records the outcome under it.
// - NVMe requests go to the swap space's asynchronous I/O (Note [Zero-copy
//   NVMe]); their callbacks run on its completion thread, never block, and
//   take mu_ only briefly. The mover (a Worker) starts fetches, urgent ones
//   first (a fetch the trainer waits on before prefetches), since it may
//   wait for a free staging buffer; the step submits its own reads and
//   writes.
// - The accumulator (a Worker) adds copied gradients into the fp32
//   accumulators, in hand-over order, so the sums are deterministic.
// - Step excludes Fetch and AddGrad (stepping_), drains both workers, and
//   runs the optimizer on the calling thread, with the reads of the next
//   piece and the writes of the last one in flight meanwhile.
#include "memtier/engine_impl.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <numeric>
#include <string>

#include <nlohmann/json.hpp>

#include "util/log.h"

namespace strata::memtier {
namespace {

using Clock = std::chrono::steady_clock;

std::string Bytes(uint64_t b) { return std::to_string(b) + " bytes"; }

// Note [Collectives on device memory]: the device buffer of the gatherer's
// communicator, which moves only agreements through it.
constexpr uint64_t kGatherCollBytes = 64 << 10;

// The most arena blocks whose events the engine makes up front (Note [The
// arena's events]): at most 12291 events.
constexpr uint64_t kArenaEventBlocks = 4096;

}  // namespace

// ---- EngineImpl: set-up -----------------------------------------------------

Status EngineImpl::CheckOptions(const EngineOptions& o, const Device& device) {
  // Note [Data-parallel ranks]: the communicator and what runs over it.
  if (o.comm != nullptr) {
    const Communicator& c = *o.comm;
    STRATA_RETURN_IF_ERROR(
        c.status().WithContext("engine: comm is broken already"));
    if (c.size() != o.world_size || c.rank() != o.rank) {
      return Status::InvalidArgument(
          "engine: comm has rank " + std::to_string(c.rank()) + " of " +
          std::to_string(c.size()) + " but the options say rank " +
          std::to_string(o.rank) + " of world_size " +
          std::to_string(o.world_size) + "; they must agree");
    }
    // Note [Collectives on device memory] (memtier/collectives.cc).
    const bool nccl = c.backend() == CommBackendKind::kNccl;
    const bool cuda = device.kind() == DeviceKind::kCuda;
    if (nccl && o.comm_memory == CommMemory::kHost) {
      return Status::InvalidArgument(
          "engine: comm_memory host with an NCCL communicator, which works on "
          "device memory only; set comm_memory to device or auto");
    }
    if (nccl && !cuda) {
      return Status::NotSupported(
          "engine: comm is an NCCL communicator, which runs on CUDA streams; "
          "the engine's device is " +
          device.name() +
          " (give it an MPI communicator, with comm_memory device to run the "
          "engine's device-memory path there)");
    }
    if (!nccl && cuda && o.comm_memory == CommMemory::kDevice) {
      return Status::NotSupported(
          "engine: comm_memory device with a " +
          std::string(CommBackendName(c.backend())) +
          " communicator on a CUDA device: only NCCL runs collectives on CUDA "
          "streams; set comm_memory to host or auto");
    }
  }
  if (o.world_size > 1) {
    const std::string ws = "engine: world_size " + std::to_string(o.world_size);
    if (o.comm == nullptr) {
      return Status::InvalidArgument(
          ws +
          " needs comm, the trainer's data-parallel communicator (the "
          "engine never makes one)");
    }
    if (o.zero_stage == 0) {
      return Status::NotSupported(
          ws +
          " with zero_stage 0: several ranks run zero_stage 1 (optimizer "
          "states partitioned), 2 (gradients too) or 3 (parameters too); "
          "stage 0 (every rank updating everything) is not offered");
    }
    // Stages 1 and 2 keep the parameters on the device
    // (ValidateEngineOptions), where the step gathers them; stage 3 keeps
    // each rank's shard on the host or NVMe (Note [Stage 3 over ranks]).
    if (o.zero_stage == 3 && o.params == Residence::kDevice) {
      return Status::NotSupported(
          ws +
          " with zero_stage 3 and params on the device: each rank keeps its "
          "shard of the parameters on host or nvme and Fetch gathers the "
          "shards in host memory (the engine's collectives are on host "
          "memory); rest params on host or nvme, or use zero_stage 2 to keep "
          "whole parameters on every device");
    }
    if (o.zero_stage == 3 && o.step_overlap_bytes > 0) {
      return Status::NotSupported(
          ws + ": step_overlap_bytes " + std::to_string(o.step_overlap_bytes) +
          " with zero_stage 3: updates during backward would make a rank's "
          "prefetches depend on its timing, and the ranks' gathers must "
          "match; set it to 0");
    }
    if (o.grads == Residence::kNvme && o.zero_stage == 1) {
      return Status::NotSupported(
          ws +
          ": grads on nvme with zero_stage 1, which keeps every rank's "
          "full gradient in host memory; use zero_stage 2 (each rank's "
          "gradient shard rests on nvme) or grads on host");
    }
    if (o.step_overlap_bytes > 0 && o.zero_stage == 1) {
      return Status::NotSupported(
          ws + ": step_overlap_bytes " + std::to_string(o.step_overlap_bytes) +
          " with zero_stage 1, which reduces the gradients only at the step: "
          "updates during backward need zero_stage 2 (or set it to 0)");
    }
  }
  if (o.optimizer_states == Residence::kDevice) {
    return Status::NotSupported(
        "engine: optimizer_states on the device needs a GPU optimizer; rest "
        "them on host or nvme");
  }
  if (o.grads == Residence::kDevice) {
    return Status::NotSupported(
        "engine: grads rest on host or nvme (the CPU optimizer reads them), "
        "not on the device");
  }
  const bool nvme = o.params == Residence::kNvme ||
                    o.optimizer_states == Residence::kNvme ||
                    o.grads == Residence::kNvme;
  if (nvme && o.nvme_paths.empty()) {
    return Status::InvalidArgument(
        "engine: nvme_paths is empty but params, optimizer_states or grads "
        "rest on nvme");
  }
  if (o.partition_bytes < (1u << 16) || o.partition_bytes % 4096 != 0) {
    return Status::InvalidArgument(
        "engine: partition_bytes " + std::to_string(o.partition_bytes) +
        " must be a multiple of 4096 and at least 65536");
  }
  if (o.staging_buffer_bytes % 4096 != 0) {
    return Status::InvalidArgument(
        "engine: staging_buffer_bytes " +
        std::to_string(o.staging_buffer_bytes) +
        " must be a multiple of 4096 (0 = automatic)");
  }
  return Status::Ok();
}

EngineImpl::EngineImpl(const EngineOptions& o, Device* device)
    : options_(o),
      counting_device_(device),
      device_(&counting_device_),
      loss_scaler_(o.loss_scale) {
  if (MultiRank()) {
    // Start sizes the buffer to a staging buffer's; until then only
    // agreements use it.
    coll_ = std::make_unique<RankCollectives>(options_.comm.get(), device_,
                                              CommOnDevice(), 64 << 10);
  }
}

EngineImpl::~EngineImpl() {
  // Workers first: their jobs use everything below (the mover's queued
  // fetches run and submit their reads). Then the engine's NVMe operations
  // are waited for: their callbacks use the units, the staging buffers and
  // the streams, and a failed read resubmits through swap_, which must stay
  // set until the last callback has returned. Then the swap space. The
  // accumulator posts to the stepper, whose queued updates then return at
  // once.
  {
    MutexLock l(&mu_);
    early_armed_ = false;
  }
  cv_.SignalAll();
  // Its queued gathers run: every rank has queued the same ones.
  gatherer_.reset();
  mover_.reset();
  accumulator_.reset();
  stepper_.reset();
  {
    MutexLock l(&io_mu_);
    while (io_inflight_ > 0) io_cv_.Wait(&io_mu_);
  }
  swap_.reset();
  if (copy_stream_) device_->SynchronizeStream(*copy_stream_).IgnoreError();
  if (d2h_stream_) device_->SynchronizeStream(*d2h_stream_).IgnoreError();
  if (release_stream_) {
    device_->SynchronizeStream(*release_stream_).IgnoreError();
  }
  {
    MutexLock l(&mu_);
    for (UnitState& s : units_) {
      s.pin.Reset();
      s.dev.Reset();
      for (auto& handles : s.nvme) handles.clear();  // slots back to the space
    }
  }
  arena_.reset();  // before the streams its blocks used
}

StatusOr<TensorId> EngineImpl::Register(const TensorSpec& spec) {
  MutexLock l(&mu_);
  if (started_) {
    return Status::FailedPrecondition("engine: Register after Start (" +
                                      spec.name + ")");
  }
  if (spec.dtype == ElementType::kFloat32) {
    return Status::InvalidArgument("engine: tensor " + spec.name +
                                   ": working dtype must be fp16 or bf16");
  }
  uint64_t n = 1;
  for (int64_t d : spec.shape) {
    if (d <= 0 || n > (uint64_t{1} << 48) / static_cast<uint64_t>(d)) {
      return Status::InvalidArgument("engine: tensor " + spec.name +
                                     " has a bad shape");
    }
    n *= static_cast<uint64_t>(d);
  }
  if (spec.shape.empty()) {
    return Status::InvalidArgument("engine: tensor " + spec.name +
                                   " has no shape");
  }
  for (const TensorSpec& t : specs_) {
    if (t.name == spec.name) {
      return Status::AlreadyExists("engine: tensor " + spec.name +
                                   " is registered already");
    }
  }
  specs_.push_back(spec);
  numel_.push_back(n);
  return static_cast<TensorId>(specs_.size() - 1);
}

Residence EngineImpl::RoleResidence(int role) const {
  if (role == kParam) return options_.params;
  if (role == kGrad) return options_.grads;
  return options_.optimizer_states;
}

// Note [Moment formats]
// The two moments rest in optimizer.moment_dtype: fp32, bf16, or kBlock8
// (8-bit codes plus one fp32 scale per kCpuBlock8Elems, CpuStateBytes
// bytes). A piece's moments are one state array of the CPU optimizer (a
// kBlock8 array keeps its scales after its codes), so a unit's copy of a
// moment is its pieces' arrays back to back, and pieces (piece_elems_) are
// whole kBlock8 blocks. Everything that sizes or addresses a moment (host
// arrays, swap slots, staging, the undo buffer, checkpoints) goes through
// RoleBytes and RoleOffset, so the bytes moved and resting are the
// format's. Results do not depend on where a piece rests (the same arrays,
// the same calls), but with kBlock8 they do depend on piece_elems_: a block
// is quantized with its own scale.
uint64_t EngineImpl::RoleBytes(int role, const UnitState& s, uint64_t n) const {
  if (!RoleKept(role)) return 0;  // Note [Factored optimizers in the engine]
  if (IsMoment(role)) return CpuStateBytes(MomentDType(), n);
  return n * (role == kParam ? ElementSize(s.dtype) : 4);
}

uint64_t EngineImpl::RoleOffset(int role, const UnitState& s,
                                uint64_t elem) const {
  if (!IsMoment(role)) return RoleBytes(role, s, elem);
  const uint64_t rem = elem % piece_elems_;
  assert(rem == 0 || elem == s.elems || MomentDType() != CpuDType::kBlock8);
  return elem / piece_elems_ * RoleBytes(role, s, piece_elems_) +
         RoleBytes(role, s, rem);
}

Status EngineImpl::Start() {
  {
    MutexLock l(&mu_);
    if (started_) return Status::FailedPrecondition("engine: started already");
    if (specs_.empty()) {
      return Status::FailedPrecondition("engine: no tensor registered");
    }
  }
  // Layout: units of partition_bytes of fp32 (the widest role), small
  // tensors packed with tensors of their dtype.
  LayoutOptions lo;
  lo.unit_elems = options_.partition_bytes / 4;
  lo.pack_limit_elems = std::max<uint64_t>(kTensorAlign, lo.unit_elems / 4);
  lo.rank = options_.rank;
  lo.world_size = options_.world_size;
  std::vector<uint32_t> groups;
  for (const TensorSpec& t : specs_) {
    groups.push_back(static_cast<uint32_t>(t.dtype));
  }
  STRATA_ASSIGN_OR_RETURN(Layout layout, Layout::Build(numel_, lo, groups));
  layout_ = std::make_unique<Layout>(std::move(layout));
  units_ = std::vector<UnitState>(layout_->num_units());
  {
    MutexLock l(&mu_);
    trace_ = std::make_unique<FetchTrace>(units_.size());
    grad_count_.assign(specs_.size(), 0);
    last_handed_.assign(specs_.size(), 0);
    last_chunks_.assign(specs_.size(), 0);
    unit_waiting_.assign(layout_->num_units(), 0);
    early_state_.assign(layout_->num_units(), 0);
  }

  uint64_t max_unit_elems = 0;  // of a shard
  uint64_t max_full_elems = 0;  // of a whole unit
  for (uint32_t u = 0; u < units_.size(); ++u) {
    UnitState& s = units_[u];
    const UnitInfo& info = layout_->unit(u);
    s.elems = info.shard_elems;
    s.shard_begin = info.shard_begin;
    s.full_elems = info.elems;
    s.dtype = specs_[info.tensors.front()].dtype;
    s.param_bytes = s.full_elems * ElementSize(s.dtype);
    max_unit_elems = std::max(max_unit_elems, s.elems);
    max_full_elems = std::max(max_full_elems, s.full_elems);
  }

  // Staging: buffers of a piece of fp32 (4 MiB..64 MiB by default), enough of
  // them for the step's pipeline (read ahead, update, write behind).
  const bool nvme_states = options_.optimizer_states == Residence::kNvme;
  const bool nvme_params = options_.params == Residence::kNvme;
  const bool nvme_grads = options_.grads == Residence::kNvme;
  uint64_t staging_bytes = options_.staging_buffer_bytes;
  if (staging_bytes == 0) {
    staging_bytes = std::clamp<uint64_t>(RoundUp(max_unit_elems * 4, 4096),
                                         4u << 20, 64u << 20);
  }
  uint32_t staging_count = options_.staging_buffer_count;
  // A piece of the step holds up to five buffers (master, moments, working
  // copy, gradient); two pieces are held at once, and more are writing.
  // With states on NVMe the automatic count is 24, eight pieces of the
  // step's three reads: its reads and write-backs share the drive, and a
  // step that can only read two pieces ahead leaves it idle while writes
  // hold the buffers (256 Mi parameters on a virtio drive: 0.75-0.82 of the
  // mixed I/O bound with 12 buffers, 0.81-0.92 with 24 in the same minutes;
  // 32 gave no more).
  const uint32_t min_count = (nvme_states ? 8 : 4) + (nvme_grads ? 2 : 0);
  if (staging_count == 0) staging_count = min_count + (nvme_states ? 16 : 2);
  if (staging_count < min_count) {
    return Status::InvalidArgument(
        "engine: staging_buffer_count " + std::to_string(staging_count) +
        " is below " + std::to_string(min_count) +
        ", what one piece of the optimizer step holds at once");
  }
  // Note [Moment formats]: kBlock8 pieces are whole blocks.
  piece_elems_ = staging_bytes / 4;
  if (MomentDType() == CpuDType::kBlock8) {
    piece_elems_ = piece_elems_ / kCpuBlock8Elems * kCpuBlock8Elems;
    if (piece_elems_ == 0) {
      return Status::InvalidArgument(
          "engine: staging_buffer_bytes " + std::to_string(staging_bytes) +
          " holds less than one block of int8 moments "
          "(optimizer.moment_dtype): at least " +
          std::to_string(kCpuBlock8Elems * 4) + " bytes");
    }
  }
  if (MultiRank() &&
      staging_bytes < 2 * static_cast<uint64_t>(options_.world_size)) {
    // Note [Data-parallel ranks]: a gather round holds an element of every
    // rank.
    return Status::InvalidArgument(
        "engine: staging_buffer_bytes " + std::to_string(staging_bytes) +
        " cannot hold one working-precision element of each of world_size " +
        std::to_string(options_.world_size) + " ranks");
  }
  STRATA_ASSIGN_OR_RETURN(
      staging_, StagingPool::Create(device_, staging_count, staging_bytes,
                                    options_.pin_memory));
  if (nvme_grads) {
    // Two pieces open, three writing back; at the step, after the spill's
    // Flush, two of them carry Adafactor's reads of the gradients before
    // the update (FactoredSpilledPass).
    STRATA_ASSIGN_OR_RETURN(
        grad_pool_,
        StagingPool::Create(device_, 5, staging_bytes, options_.pin_memory));
  }

  // Streams, events and the optimizer.
  STRATA_ASSIGN_OR_RETURN(copy_stream_,
                          device_->NewStream({StreamKind::kCopy}));
  STRATA_ASSIGN_OR_RETURN(d2h_stream_, device_->NewStream({StreamKind::kCopy}));
  STRATA_ASSIGN_OR_RETURN(release_stream_, device_->NewStream({}));
  STRATA_ASSIGN_OR_RETURN(producer_event_, device_->NewEvent());
  STRATA_ASSIGN_OR_RETURN(released_, device_->NewEvent());
  for (UnitState& s : units_) {
    STRATA_ASSIGN_OR_RETURN(s.ready, device_->NewEvent());
    STRATA_ASSIGN_OR_RETURN(s.use_done, device_->NewEvent());
  }
  CpuOptimizerOptions oo = options_.optimizer.cpu;
  STRATA_ASSIGN_OR_RETURN(optimizer_, NewCpuOptimizer(oo));
  STRATA_RETURN_IF_ERROR(StartFactored());

  // Host tier: one pinned array per role resting on the host.
  uint64_t host_bytes = 0;
  for (int r = 0; r < kRoles; ++r) {
    if (RoleResidence(r) != Residence::kHost || !RoleKept(r)) continue;
    uint64_t off = 0;
    for (UnitState& s : units_) {
      s.host_offset[r] = off;
      off += HostBlockBytes(r, s);
    }
    host_bytes += off;
  }
  if (options_.host_budget_bytes != 0 &&
      host_bytes > options_.host_budget_bytes) {
    return Status::OutOfMemory(
        "engine: the host-resident roles need " + Bytes(host_bytes) +
        " of pinned host memory; host_budget_bytes is " +
        Bytes(options_.host_budget_bytes) +
        " (rest params or optimizer_states on nvme, or raise the budget)");
  }
  for (int r = 0; r < kRoles; ++r) {
    if (RoleResidence(r) != Residence::kHost || !RoleKept(r)) continue;
    const uint64_t bytes =
        units_.back().host_offset[r] + HostBlockBytes(r, units_.back());
    HostBufferOptions ho;
    ho.pin = options_.pin_memory;
    ho.prefault = true;  // zero-filled by the kernel, and no first-use faults
    StatusOr<HostBuffer> b = r == kParam && options_.pin_memory
                                 ? device_->AllocatePinnedHost(bytes, ho)
                                 : HostBuffer::Allocate(bytes, ho);
    if (!b.ok()) return b.status();
    host_[r] = std::move(b).value();
  }

  // Note [Data-parallel ranks]: what the gradients' reduction needs.
  comm_ = options_.comm;
  if (MultiRank()) {
    HostBufferOptions ho;
    ho.pin = false;  // only the CPU and the communicator touch them
    ho.prefault = true;
    if (options_.zero_stage == 1) {
      uint64_t off = 0;
      for (UnitState& s : units_) {
        s.full_grad_offset = off;
        off += RoundUp(s.full_elems * 4, 4096);
      }
      STRATA_ASSIGN_OR_RETURN(full_grads_, HostBuffer::Allocate(off, ho));
    } else {
      // Two buckets of one window each: backward hands a unit's tensors over
      // together, and the second lets the next window begin while the first
      // waits for a tensor. A window is a packed unit's size, or
      // reduce_bucket_bytes of working-precision gradient (rounded to whole
      // shard blocks), so a large tensor's unit spans several and the
      // buckets never grow with the model.
      const uint64_t bucket =
          options_.reduce_bucket_bytes == 0
              ? lo.unit_elems
              : std::max<uint64_t>(
                    1, options_.reduce_bucket_bytes / WorkingElementBytes());
      window_elems_ = RoundUp(
          bucket, kTensorAlign * static_cast<uint64_t>(options_.world_size));
      const uint64_t window = std::min(window_elems_, max_full_elems);
      buckets_.resize(2);
      // Note [Gradients reduced on the device]: there, below.
      for (GradBucket& b : buckets_) {
        if (DeviceReduce()) continue;
        STRATA_ASSIGN_OR_RETURN(b.mem, HostBuffer::Allocate(window * 4, ho));
      }
      STRATA_ASSIGN_OR_RETURN(
          reduce_out_,
          HostBuffer::Allocate(std::min(window, max_unit_elems) * 4, ho));
      uint64_t windows = 0;
      for (const UnitState& s : units_) {
        window_base_.push_back(windows);
        windows += (s.full_elems + window_elems_ - 1) / window_elems_;
      }
      window_written_.assign(windows, 0);
    }
  }

  // Device tier: the budget, and the parameters that rest there.
  device_budget_ = options_.device_budget_bytes;
  if (device_budget_ == 0) {
    // Automatic: half of what the device has free, the rest left to the
    // trainer's activations and workspaces.
    device_budget_ = device_->memory_stats().free_bytes / 2 / 4096 * 4096;
  }
  if (MultiRank() && CommOnDevice()) {
    // Note [Collectives on device memory]: their buffers come out of the
    // budget: a staging buffer's size, at most an eighth of the budget (a
    // sixteenth for the gatherer's).
    const uint64_t coll_bytes = std::clamp<uint64_t>(
        device_budget_ / 8 / 4096 * 4096, 4096, staging_bytes);
    gather_coll_bytes_ = std::clamp<uint64_t>(device_budget_ / 16 / 4096 * 4096,
                                              4096, kGatherCollBytes);
    // Note [Gradients reduced on the device]: and the two buckets.
    const uint64_t bucket_bytes =
        DeviceReduce()
            ? RoundUp(std::min(window_elems_, max_full_elems) * 4, 256)
            : 0;
    const uint64_t all = coll_bytes +
                         (ShardedParams() ? gather_coll_bytes_ : 0) +
                         2 * bucket_bytes;
    if (all >= device_budget_) {
      return Status::OutOfMemory(
          "engine: the device budget (" + Bytes(device_budget_) +
          ") cannot hold the collectives' device buffers (" + Bytes(all) +
          ", comm_memory device" +
          (bucket_bytes > 0
               ? ", two reduction buckets of " + Bytes(bucket_bytes) +
                     ": lower reduce_bucket_bytes"
               : std::string()) +
          ")");
    }
    device_budget_ -= all;
    STRATA_RETURN_IF_ERROR(coll_->Resize(coll_bytes));
    STRATA_ASSIGN_OR_RETURN(comm_stream_, coll_->stream());
    for (GradBucket& b : buckets_) {
      if (bucket_bytes == 0) break;
      STRATA_ASSIGN_OR_RETURN(b.dev,
                              device_->Allocate(bucket_bytes, *comm_stream_));
    }
  }
  DeviceArenaOptions ao;
  ao.capacity_bytes = device_budget_;
  ao.name = "engine device arena";
  {
    // Note [The arena's events]: the copy and release streams use the
    // blocks, and at most the budget over the smallest unit's block fit at
    // once. Past kArenaEventBlocks the pool grows as needed instead, and
    // hot_path_allocations counts what a step made. Parameters resting on
    // the device are never freed before the end: no event then.
    uint64_t smallest = 0;
    for (const UnitState& s : units_) {
      const uint64_t b = RoundUp(s.param_bytes, ao.alignment);
      if (b > 0 && (smallest == 0 || b < smallest)) smallest = b;
    }
    const uint64_t blocks =
        smallest == 0 || options_.params == Residence::kDevice
            ? 0
            : std::min(device_budget_ / smallest, kArenaEventBlocks);
    ao.reserve_events = DeviceArena::EventsFor(blocks, /*streams=*/2);
  }
  STRATA_ASSIGN_OR_RETURN(arena_,
                          DeviceArena::Create(device_, *copy_stream_, ao));
  if (options_.params == Residence::kDevice) {
    uint64_t resting = 0;
    for (UnitState& s : units_) resting += RoundUp(s.param_bytes, 256);
    if (resting > device_budget_) {
      return Status::OutOfMemory("engine: params resting on the device need " +
                                 Bytes(resting) + "; the device budget is " +
                                 Bytes(device_budget_) +
                                 " (rest params on host or nvme)");
    }
    {
      MutexLock l(&mu_);
      device_used_ = resting;
    }
    for (UnitState& s : units_) {
      // Resting here for good: unmovable, and pinned for the engine's life.
      STRATA_ASSIGN_OR_RETURN(s.dev,
                              arena_->Allocate(s.param_bytes, *copy_stream_,
                                               /*movable=*/false));
      STRATA_ASSIGN_OR_RETURN(s.pin, s.dev.Pin(*copy_stream_));
      { STRATA_ASSIGN_OR_RETURN(ArenaPin user, s.dev.Pin(*release_stream_)); }
      s.addr = s.pin.data();
      s.rests_here = true;
      STRATA_RETURN_IF_ERROR(
          device_->MemsetAsync(*copy_stream_, s.pin.data(), 0, s.param_bytes));
      STRATA_RETURN_IF_ERROR(device_->RecordEvent(*s.ready, *copy_stream_));
      s.resident = true;
    }
  }

  // NVMe tier: a swap space holding every nvme role, plus room to write a
  // new generation of the pieces in flight before the old is freed.
  if (nvme_states || nvme_params || nvme_grads) {
    SwapSpaceOptions so;
    so.dirs = options_.nvme_paths;
    so.block_bytes = options_.io_block_bytes;
    so.io = options_.io;
    so.shared_io = options_.shared_io;
    so.queue_depth = std::max<uint32_t>(1, options_.io.queue_depth);
    so.pin_buffers = options_.pin_memory;
    so.synchronous_io = false;  // every byte moves through staging buffers
    uint64_t cap = 0;
    for (int r = 0; r < kRoles; ++r) {
      if (RoleResidence(r) != Residence::kNvme || !RoleKept(r)) continue;
      for (UnitState& s : units_) {
        const uint64_t elems = RoleElems(r, s);
        for (uint64_t b = 0; b < elems; b += piece_elems_) {
          const uint64_t n = std::min(piece_elems_, elems - b);
          cap += RoundUp(RoleBytes(r, s, n), so.block_bytes);
        }
      }
    }
    cap += uint64_t{staging_count} * RoundUp(staging_bytes, so.block_bytes);
    so.capacity_bytes = cap;
    STRATA_ASSIGN_OR_RETURN(swap_, SwapSpace::Open(so));
  }

  // Note [Updates during backward]: the undo buffer (not page-locked: only
  // the CPU touches it). Gradients on NVMe are read by the step itself.
  if (options_.step_overlap_bytes > 0 && !nvme_grads) {
    HostBufferOptions ho;
    ho.pin = false;
    STRATA_ASSIGN_OR_RETURN(
        undo_, HostBuffer::Allocate(options_.step_overlap_bytes, ho));
  }
  if (!undo_.empty() || EarlyStatisticsTaken()) {
    early_stats_.resize(units_.size());
    for (uint32_t u = 0; u < units_.size(); ++u) {
      early_stats_[u].resize((units_[u].elems + piece_elems_ - 1) /
                             piece_elems_);
    }
  }

  if (ShardedParams()) {
    // Note [Stage 3 over ranks]: a collective, like the rest of Start.
    STRATA_ASSIGN_OR_RETURN(Communicator dup, comm_->Duplicate());
    gather_comm_ = std::make_unique<Communicator>(std::move(dup));
    gather_coll_ = std::make_unique<RankCollectives>(
        gather_comm_.get(), device_, CommOnDevice(), gather_coll_bytes_);
    STRATA_RETURN_IF_ERROR(gather_coll_->Resize(gather_coll_bytes_));
    gatherer_ = std::make_unique<Worker>();
  }
  mover_ = std::make_unique<Worker>();
  accumulator_ = std::make_unique<Worker>();
  stepper_ = std::make_unique<Worker>();
  scratch_.resize(std::min<uint64_t>(piece_elems_, 1u << 16));

  // Every piece of every nvme role gets its slots once, here, and is
  // zero-filled (gradients excepted: Note [Gradients on NVMe]); later writes
  // rewrite the same slots in place.
  if (swap_) {
    STRATA_ASSIGN_OR_RETURN(StagingLease zero, staging_->Acquire());
    std::memset(zero.data(), 0, zero.size());
    std::vector<std::pair<uint32_t, int>> pieces_of;
    for (uint32_t u = 0; u < units_.size(); ++u) {
      UnitState& s = units_[u];
      for (int r = 0; r < kRoles; ++r) {
        if (RoleResidence(r) != Residence::kNvme || !RoleKept(r)) continue;
        const uint64_t elems = RoleElems(r, s);
        for (uint64_t b = 0; b < elems; b += piece_elems_) {
          const uint64_t n = std::min(piece_elems_, elems - b);
          STRATA_ASSIGN_OR_RETURN(
              SwapHandle h,
              swap_->Allocate(SwapTensorId(u, r, s.nvme[r].size()),
                              RoleBytes(r, s, n)));
          s.nvme[r].push_back(std::move(h));
        }
      }
    }
    // A window of writes in flight: the queue depth's worth.
    const size_t window = std::max<size_t>(1, options_.io.queue_depth);
    std::vector<std::future<Status>> inflight;
    Status first;
    for (uint32_t u = 0; u < units_.size() && first.ok(); ++u) {
      for (int r = 0; r < kRoles && first.ok(); ++r) {
        if (r == kGrad) continue;
        for (size_t p = 0; p < units_[u].nvme[r].size(); ++p) {
          if (inflight.size() == window) {
            Status st = inflight.front().get();
            inflight.erase(inflight.begin());
            if (!st.ok()) {
              first = st;
              break;
            }
          }
          inflight.push_back(
              WritePieceFuture(u, r, p, zero.span(), IoPriority::kBackground));
        }
      }
    }
    for (auto& f : inflight) {
      Status st = f.get();
      if (first.ok()) first = st;
    }
    STRATA_RETURN_IF_ERROR(first);
  }

  if (nvme_grads) {
    std::vector<uint64_t> elems;
    for (const UnitState& s : units_) elems.push_back(s.elems);
    grad_spill_ = std::make_unique<GradSpill>(
        std::move(elems), piece_elems_, grad_pool_.get(), /*open_pieces=*/2,
        [this](uint32_t u, size_t p, std::span<std::byte> dst) {
          return ReadPiece(u, kGrad, p, dst);
        },
        [this](uint32_t u, size_t p, std::span<const std::byte> src,
               std::function<void(Status)> done) {
          WritePieceAsync(u, kGrad, p, src, IoPriority::kBackground,
                          std::move(done));
        },
        [this](const float* g, uint64_t n) {
          return optimizer_->ComputeGradStats(g, CpuDType::kFloat32, n, 1.0);
        });
  }

  MutexLock l(&mu_);
  started_ = true;
  const uint64_t staging_pinned =
      staging_->pinned_bytes() + (grad_pool_ ? grad_pool_->pinned_bytes() : 0);
  stats_.pinned_host_bytes = staging_pinned + PinnedRoleBytes();
  stats_.staging_bytes = staging_pinned;
  for (const UnitState& s : units_) {
    stats_.optimizer_state_bytes += RoleOffset(kMaster, s, s.elems) +
                                    RoleOffset(kExpAvg, s, s.elems) +
                                    RoleOffset(kExpAvgSq, s, s.elems);
    stats_.grad_bytes += RoleBytes(kGrad, s, s.elems);
  }
  for (const FactoredTensor& f : factored_) {
    stats_.optimizer_state_bytes += f.stats.size() * sizeof(float);
  }
  stats_.grad_bytes += full_grads_.size() + reduce_out_.size();
  for (const GradBucket& b : buckets_) stats_.grad_bytes += b.mem.size();
  UpdateTierStatsLocked();
  return Status::Ok();
}

uint64_t EngineImpl::PinnedRoleBytes() const {
  uint64_t n = 0;
  for (const HostBuffer& b : host_) {
    if (b.pinned() || b.registration() != nullptr) n += b.size();
  }
  return n;
}

Status EngineImpl::RunOnMover(std::function<Status()> job) {
  std::promise<Status> done;
  std::future<Status> f = done.get_future();
  mover_->Post(Priority::kUrgent, [&job, &done] { done.set_value(job()); });
  return f.get();
}

// ---- Reading and writing one role of one piece -----------------------------

// Bytes of role `r` for elements [b, b + n) of unit `u`, in the host array.
std::byte* EngineImpl::HostAt(int r, uint32_t u, uint64_t elem) {
  return host_[r].data() + units_[u].host_offset[r] +
         RoleOffset(r, units_[u], elem);
}

// Note [Zero-copy NVMe]
// Pieces move straight between their swap slots and the staging buffers
// (page aligned, at least a piece of fp32 each) with the swap space's
// asynchronous calls: no bounce buffer, no copy, and as many requests in
// flight as the caller submits. `done` runs once, on the swap space's
// completion thread (it must not block), or at once when the request is
// refused before any I/O. A write rewrites the piece's slots in place: if
// it fails, the piece is not valid (a later read fails its checksum) and the
// step that wrote it fails; the staging buffer still holds the data.
//
// Failures: an error names the role, the tensors, the unit and the piece
// before the swap space's own words (file, offset, what failed). A read that
// fails with kIoError is resubmitted up to kReadRetries more times (a read
// changes nothing, so a transient EIO costs a retry, not the step); a
// corrupt block is not retried, since rereading the same bytes cannot help,
// and a write's EIO is relocated by the swap space, never here. Every
// operation is counted from submission until its `done` has returned, so
// that the destructor can wait for them all.
constexpr int kReadRetries = 2;

void EngineImpl::BeginIo() {
  MutexLock l(&io_mu_);
  ++io_inflight_;
}

void EngineImpl::EndIo() {
  MutexLock l(&io_mu_);
  if (--io_inflight_ == 0) io_cv_.SignalAll();
}

Status EngineImpl::PieceError(uint32_t u, int r, size_t p, const char* op,
                              const Status& st) const {
  static constexpr const char* kRoleNames[kRoles] = {
      "parameters", "gradient", "master", "exp_avg", "exp_avg_sq"};
  return st.WithContext(std::string("engine: ") + op + " the " + kRoleNames[r] +
                        " of " + UnitNames(u) + " (unit " + std::to_string(u) +
                        ", piece " + std::to_string(p) + ")");
}

void EngineImpl::ReadPieceAsync(uint32_t u, int r, size_t p,
                                std::span<std::byte> dst, IoPriority pr,
                                std::function<void(Status)> done) {
  BeginIo();
  SubmitRead(u, r, p, dst, pr, kReadRetries, std::move(done));
}

void EngineImpl::SubmitRead(uint32_t u, int r, size_t p,
                            std::span<std::byte> dst, IoPriority pr,
                            int retries, std::function<void(Status)> done) {
  const SwapHandle& h = units_[u].nvme[r][p];
  const uint64_t bytes = h.bytes();
  auto cb = [this, u, r, p, dst, pr, retries, bytes,
             done = std::move(done)](Status st) {
    if (st.code() == StatusCode::kIoError && retries > 0) {
      STRATA_LOG_WARN("strata: {}; retrying",
                      PieceError(u, r, p, "reading", st).ToString());
      SubmitRead(u, r, p, dst, pr, retries - 1, done);
      return;
    }
    if (st.ok()) {
      nvme_read_bytes_ += bytes;
    } else {
      st = PieceError(u, r, p, "reading", st);
    }
    done(std::move(st));
    EndIo();
  };
  Status st = swap_->ReadAsync(h, 0, h.blocks(), dst, pr, cb);
  if (!st.ok()) cb(std::move(st));
}

void EngineImpl::WritePieceAsync(uint32_t u, int r, size_t p,
                                 std::span<const std::byte> src, IoPriority pr,
                                 std::function<void(Status)> done) {
  BeginIo();
  SwapHandle& h = units_[u].nvme[r][p];
  const uint64_t bytes = h.bytes();
  auto cb = [this, u, r, p, bytes, done](Status st) {
    if (st.ok()) {
      nvme_write_bytes_ += bytes;
    } else {
      st = PieceError(u, r, p, "writing", st);
    }
    done(std::move(st));
    EndIo();
  };
  Status st = swap_->WriteAsync(h, 0, h.blocks(), src, pr, cb);
  if (!st.ok()) cb(std::move(st));
}

// The future of a write, for callers that wait on the host.
std::future<Status> EngineImpl::WritePieceFuture(uint32_t u, int r, size_t p,
                                                 std::span<const std::byte> src,
                                                 IoPriority pr) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> f = promise->get_future();
  WritePieceAsync(u, r, p, src, pr,
                  [promise](Status st) { promise->set_value(std::move(st)); });
  return f;
}

std::future<Status> EngineImpl::ReadPieceFuture(uint32_t u, int r, size_t p,
                                                std::span<std::byte> dst,
                                                IoPriority pr) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> f = promise->get_future();
  ReadPieceAsync(u, r, p, dst, pr,
                 [promise](Status st) { promise->set_value(std::move(st)); });
  return f;
}

Status EngineImpl::ReadPiece(uint32_t u, int r, size_t p,
                             std::span<std::byte> dst) {
  return ReadPieceFuture(u, r, p, dst, IoPriority::kUrgent).get();
}

Status EngineImpl::WritePiece(uint32_t u, int r, size_t p,
                              std::span<const std::byte> src) {
  return WritePieceFuture(u, r, p, src, IoPriority::kUrgent).get();
}

// ---- Initial values and reading the master ---------------------------------

Status EngineImpl::ForEachPieceOfTensor(
    TensorId id, int role, bool write,
    const std::function<void(std::byte*, uint64_t, uint64_t)>& fn) {
  const TensorPlace& tensor = layout_->tensor(id);
  UnitState& s = units_[tensor.unit];
  assert(!IsMoment(role));  // elements of a tensor, not of a piece
  const size_t esize = RoleBytes(role, s, 1);
  // The part of the tensor this rank holds of the role, in the role's
  // elements of the unit (the whole tensor for a working copy that is not
  // sharded, the part in this rank's shard otherwise), and where that part
  // starts in the tensor.
  TensorPlace t = tensor;
  uint64_t skip = 0;
  if (role != kParam || ShardedParams()) {
    uint64_t lo = 0, hi = 0;
    if (!ShardPart(tensor, &lo, &hi)) return Status::Ok();
    skip = lo - tensor.offset;
    t.offset = lo - s.shard_begin;
    t.elems = hi - lo;
  }
  if (RoleResidence(role) == Residence::kHost) {
    fn(HostAt(role, t.unit, t.offset), skip, t.elems);
    return Status::Ok();
  }
  if (RoleResidence(role) == Residence::kDevice) {
    // Through a staging buffer, in pieces, on the copy stream.
    for (uint64_t b = 0; b < t.elems; b += piece_elems_) {
      const uint64_t n = std::min(piece_elems_, t.elems - b);
      STRATA_ASSIGN_OR_RETURN(StagingLease lease, staging_->Acquire());
      std::byte* dev = DevAt(s, (t.offset + b) * esize);
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(*copy_stream_, lease.data(),
                                                dev, n * esize,
                                                CopyKind::kDeviceToHost));
      STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
      fn(lease.data(), skip + b, n);
      if (write) {
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(*copy_stream_, dev,
                                                  lease.data(), n * esize,
                                                  CopyKind::kHostToDevice));
        STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
      }
    }
    return Status::Ok();
  }
  return RunOnMover([&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(StagingLease lease, staging_->Acquire());
    const uint64_t first = t.offset / piece_elems_;
    const uint64_t last = (t.offset + t.elems - 1) / piece_elems_;
    for (uint64_t p = first; p <= last; ++p) {
      const uint64_t pb = p * piece_elems_;
      const uint64_t pn = std::min(piece_elems_, RoleElems(role, s) - pb);
      STRATA_RETURN_IF_ERROR(ReadPiece(t.unit, role, p, lease.span()));
      const uint64_t b = std::max(pb, t.offset);
      const uint64_t e = std::min(pb + pn, t.offset + t.elems);
      fn(lease.data() + (b - pb) * esize, skip + b - t.offset, e - b);
      if (write) {
        STRATA_RETURN_IF_ERROR(WritePiece(t.unit, role, p, lease.span()));
      }
    }
    return Status::Ok();
  });
}

Status EngineImpl::SetInitialValues(TensorId id, std::span<const float> v) {
  STRATA_RETURN_IF_ERROR(CheckTensor(id, "SetInitialValues"));
  if (v.size() != numel_[id]) {
    return Status::InvalidArgument(
        "engine: SetInitialValues(" + specs_[id].name +
        "): " + std::to_string(v.size()) + " values for " +
        std::to_string(numel_[id]) + " elements");
  }
  {
    MutexLock l(&mu_);
    if (steps_ > 0) {
      return Status::FailedPrecondition(
          "engine: SetInitialValues after the first Step");
    }
    // A gather in flight may be reading the shard rewritten below.
    if (ShardedParams()) WaitArrivalsLocked();
  }
  STRATA_RETURN_IF_ERROR(ForEachPieceOfTensor(
      id, kMaster, true, [&](std::byte* p, uint64_t b, uint64_t n) {
        std::memcpy(p, v.data() + b, n * 4);
      }));
  const CpuDType wd = ToCpu(specs_[id].dtype);
  Status conv;
  STRATA_RETURN_IF_ERROR(ForEachPieceOfTensor(
      id, kParam, true, [&](std::byte* p, uint64_t b, uint64_t n) {
        Status s = ConvertCpuArray(v.data() + b, CpuDType::kFloat32, p, wd, n);
        if (conv.ok()) conv = s;
      }));
  STRATA_RETURN_IF_ERROR(conv);
  if (!factored_.empty()) {
    // Note [Factored optimizers in the engine]: the new master's squares.
    double sq = 0;
    for (float x : v) sq += double{x} * x;
    factored_[id].param_sq = sq;
  }
  // Cached device copies of a non-device tier are stale now.
  InvalidateCaches();
  return Status::Ok();
}

Status EngineImpl::ReadMaster(TensorId id, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(CheckTensor(id, "ReadMaster"));
  if (out.size() != numel_[id]) {
    return Status::InvalidArgument("engine: ReadMaster(" + specs_[id].name +
                                   "): output holds " +
                                   std::to_string(out.size()) + " of " +
                                   std::to_string(numel_[id]) + " elements");
  }
  if (!MultiRank()) {
    return ForEachPieceOfTensor(id, kMaster, false,
                                [&](std::byte* p, uint64_t b, uint64_t n) {
                                  std::memcpy(out.data() + b, p, n * 4);
                                });
  }
  // Note [Data-parallel ranks]: a collective. Each rank holds the part of
  // the tensor in its shard; the shards are in rank order, so gathering the
  // parts in place makes the tensor. Hand-overs still being accumulated
  // may reduce (zero_stage 2) and must come first on every rank.
  WaitGradsQuiet();
  const TensorPlace& t = layout_->tensor(id);
  const std::vector<size_t> counts =
      RankCounts(t.offset, t.offset + t.elems, units_[t.unit].elems);
  uint64_t mine = 0;
  for (size_t r = 0; r < static_cast<size_t>(options_.rank); ++r) {
    mine += counts[r];
  }
  STRATA_RETURN_IF_ERROR(ForEachPieceOfTensor(
      id, kMaster, false, [&](std::byte* p, uint64_t b, uint64_t n) {
        std::memcpy(out.data() + b, p, n * 4);
      }));
  return coll_
      ->AllGather(out.data() + mine, out.data(), counts, CommType::kFloat32)
      .WithContext("engine: ReadMaster(" + specs_[id].name +
                   ") gathering the shards");
}

Status EngineImpl::CheckTensor(TensorId id, const char* what) const {
  if (!started_) {
    return Status::FailedPrecondition(std::string("engine: ") + what +
                                      " before Start");
  }
  if (id >= specs_.size()) {
    return Status::InvalidArgument(std::string("engine: ") + what +
                                   ": no tensor " + std::to_string(id));
  }
  MutexLock l(&mu_);
  return FailedLocked(what);
}

// Note [Engine failures]
// A failed or corrupt read never makes a copy resident: a fetch's pins get
// the error from Wait and WaitOn, and the device block is dropped with the
// last pin, so the next Fetch reads again. A Step that fails before the
// update changes nothing and the engine stays usable. Once the update has
// started, the pieces before the failure hold the new step and the rest the
// old one, and a failed write leaves its piece invalid on NVMe (pieces are
// rewritten in place): the training state is no longer one step's, so the
// engine fails cleanly instead: every later Fetch, AddGrad, Step,
// SetInitialValues and ReadMaster returns kFailedPrecondition with the first
// error; stats() and the destructor still work.
Status EngineImpl::FailedLocked(const char* what) const {
  if (failed_.ok()) return Status::Ok();
  return Status::FailedPrecondition(
      std::string("engine: ") + what + " refused: " + failed_reason_ + " (" +
      failed_.ToString() + "); restore it from a checkpoint in a new engine");
}

std::string EngineImpl::UnitNames(uint32_t u) const {
  constexpr size_t kNamed = 3;
  const std::vector<uint32_t>& t = layout_->unit(u).tensors;
  std::string out;
  for (size_t i = 0; i < t.size() && i < kNamed; ++i) {
    out += (i == 0 ? "" : ", ") + specs_[t[i]].name;
  }
  if (t.size() > kNamed) {
    out += " and " + std::to_string(t.size() - kNamed) + " more";
  }
  return out;
}

void EngineImpl::WaitArrivalsLocked() {
  for (;;) {
    bool arriving = false;
    for (const UnitState& s : units_) {
      arriving = arriving || (s.arriving && !s.allocating);
    }
    if (!arriving) return;
    cv_.Wait(&mu_);
  }
}

void EngineImpl::InvalidateCaches() {
  std::vector<ArenaBlock> freed;
  {
    MutexLock l(&mu_);
    if (options_.params == Residence::kDevice) return;
    // Note [Stage 3 over ranks]: which copies are dropped may not depend on
    // which have landed.
    if (ShardedParams()) WaitArrivalsLocked();
    for (uint32_t u = 0; u < units_.size(); ++u) {
      const UnitState& s = units_[u];
      if (s.resident && s.pins == 0 && !s.arriving && !s.allocating) {
        DropLocked(u, &freed);
      }
    }
    UpdateTierStatsLocked();
  }
}

// ---- Fetch, prefetch, eviction ---------------------------------------------

StatusOr<ParamPin> EngineImpl::Fetch(TensorId id) {
  STRATA_RETURN_IF_ERROR(CheckTensor(id, "Fetch"));
  const uint32_t u = layout_->tensor(id).unit;
  std::vector<uint32_t> ahead;
  {
    MutexLock l(&mu_);
    while (stepping_) step_cv_.Wait(&mu_);
    STRATA_RETURN_IF_ERROR(FailedLocked("Fetch"));  // by the Step waited for
    if (early_armed_ && last_handed_[id]) {
      return Status::FailedPrecondition(
          "engine: Fetch(" + specs_[id].name +
          ") after its last gradient before Step was handed over (BeginStep): "
          "its update may have begun");
    }
    ++stats_.fetches;
    if (!trace_->OnFetch(u)) stats_.order_changes = trace_->order_changes();
  }
  bool hit = false;
  STRATA_RETURN_IF_ERROR(
      MakeResident(u, /*pin=*/true, /*prefetch=*/false, &hit));
  ParamPin pin;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    if (hit) ++stats_.fetch_hits;
    if (s.prefetched) {
      ++stats_.prefetch_hits;
      s.prefetched = false;
    }
    pin.engine_ = this;
    pin.unit_ = u;
    pin.data_ = DevAt(s, layout_->tensor(id).offset * ElementSize(s.dtype));
    pin.bytes_ = numel_[id] * ElementSize(s.dtype);
    pin.dtype_ = s.dtype;
    ahead = PrefetchCandidatesLocked();
  }
  for (uint32_t v : ahead) {
    bool unused;
    Status st = MakeResident(v, /*pin=*/false, /*prefetch=*/true, &unused);
    if (!st.ok()) {
      STRATA_LOG_DEBUG("strata: prefetch of unit {} skipped: {}", v,
                       st.ToString());
    }
  }
  return pin;
}

// Units ahead of the cursor, within prefetch_bytes, not yet on the device.
std::vector<uint32_t> EngineImpl::PrefetchCandidatesLocked() {
  std::vector<uint32_t> out;
  if (options_.params == Residence::kDevice || !trace_->has_reference()) {
    return out;
  }
  const uint64_t window = options_.prefetch_bytes != 0
                              ? options_.prefetch_bytes
                              : std::max<uint64_t>(device_budget_ / 4, 1);
  // Live bytes: pinned, arriving, or prefetched and not fetched yet.
  uint64_t live = 0;
  for (const UnitState& s : units_) {
    if (s.resident && (s.pins > 0 || s.arriving || s.prefetched)) {
      live += s.param_bytes;
    }
  }
  const uint64_t max_live =
      options_.max_live_bytes != 0 ? options_.max_live_bytes : UINT64_MAX;
  uint64_t bytes = 0;
  for (size_t k = 0;; ++k) {
    const uint64_t v = trace_->upcoming(k);
    if (v == FetchTrace::kNever) break;
    bytes += units_[v].param_bytes;
    if (bytes > window) break;
    if (!units_[v].resident) {
      live += units_[v].param_bytes;
      if (live > max_live) break;
    }
    if (!units_[v].resident && !units_[v].allocating &&
        !HandedOverLocked(static_cast<uint32_t>(v)) &&
        std::find(out.begin(), out.end(), v) == out.end()) {
      out.push_back(static_cast<uint32_t>(v));
    }
  }
  return out;
}

bool EngineImpl::HandedOverLocked(uint32_t u) const {
  if (!early_armed_) return false;
  for (TensorId id : layout_->unit(u).tensors) {
    if (!last_handed_[id]) return false;
  }
  return true;
}

// The unpinned, settled device copy whose next use is furthest away (ties:
// least recently used), and only one used later than `than`; -1 if none.
// With sharded parameters a copy still arriving is a candidate too (the
// caller waits for it to land before it drops it): which copies have landed
// depends on timing, and every rank must pick the same victims (Note
// [Stage 3 over ranks]).
int64_t EngineImpl::PickVictimLocked(uint64_t than) {
  int64_t best = -1;
  uint64_t best_next = 0, best_last = 0;
  for (uint32_t v = 0; v < units_.size(); ++v) {
    const UnitState& s = units_[v];
    if (!s.resident || s.pins > 0 || s.allocating) continue;
    if (s.arriving && !ShardedParams()) continue;
    // Small units persist once fetched (stage3_param_persistence_threshold).
    if (s.param_bytes < options_.persistence_threshold_bytes) continue;
    const uint64_t next = trace_->NextUse(v);
    if (than != FetchTrace::kNever && next <= than) continue;
    if (best < 0 || next > best_next ||
        (next == best_next && s.last_use < best_last)) {
      best = v;
      best_next = next;
      best_last = s.last_use;
    }
  }
  return best;
}

Status EngineImpl::MakeResident(uint32_t u, bool pin, bool prefetch,
                                bool* hit) {
  const uint64_t need = RoundUp(units_[u].param_bytes, 256);
  std::vector<ArenaBlock> victims;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    const uint64_t than = prefetch ? trace_->NextUse(u) : FetchTrace::kNever;
    // Rechecked after every wait: another thread may have fetched `u`.
    for (;;) {
      while (s.allocating) cv_.Wait(&mu_);
      // Touched by the stepper during backward (Note [Updates during
      // backward]): Fetch refused the unit's tensors already, and prefetch
      // passes over every unit handed over (HandedOverLocked); this holds
      // against another thread of the trainer handing it over meanwhile.
      if (early_state_[u] != kEarlyNone) {
        return prefetch ? Status::Ok()
                        : Status::FailedPrecondition(
                              "engine: unit " + std::to_string(u) +
                              " is being updated (BeginStep)");
      }
      // A failed arrival is dropped once unpinned (FinishArrival, Unpin);
      // while pins hold it, fetching it again gets its error, not its bytes.
      if (s.resident && !s.arriving && !s.arrival.ok()) return s.arrival;
      if (s.resident) {
        *hit = true;
        if (pin) {
          if (s.pin.empty()) STRATA_RETURN_IF_ERROR(PinLocked(s));
          ++s.pins;
        }
        s.last_use = ++clock_;
        return Status::Ok();
      }
      if (device_used_ + need <= device_budget_) break;
      const int64_t v = PickVictimLocked(than);
      if (v >= 0 && units_[v].arriving) {
        cv_.Wait(&mu_);  // sharded: lands, then is dropped (rechecked)
      } else if (v >= 0) {
        EvictLocked(static_cast<uint32_t>(v), &victims);
      } else if (prefetch) {
        return Status::Ok();  // nothing colder to make room
      } else if (!WaitForArrivalLocked()) {
        return OutOfDeviceMemoryLocked(u);
      }
    }
    *hit = false;
    device_used_ += need;
    s.allocating = true;
    s.resident = true;
    s.arriving = true;
    s.arrival = Status::Ok();
    s.prefetched = prefetch;
    if (pin) ++s.pins;
    s.last_use = ++clock_;
    if (prefetch) ++stats_.prefetches;
    UpdateTierStatsLocked();
  }
  victims.clear();  // stream-ordered frees, outside the lock
  StatusOr<ArenaBlock> mem = AllocateEvicting(u, need);
  StatusOr<ArenaPin> held = Status::Ok();
  if (mem.ok()) {
    // The release stream is a user of every block (Note [Consumer streams]);
    // the copy stream fills it, pinned until the arrival is over.
    StatusOr<ArenaPin> user = mem->Pin(*release_stream_);
    held = user.ok() ? mem->Pin(*copy_stream_) : user.status();
    if (!held.ok()) mem = held.status();
  }
  if (!mem.ok()) {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    s.allocating = s.resident = s.arriving = false;
    if (pin) --s.pins;
    device_used_ -= need;
    cv_.SignalAll();
    return mem.status();
  }
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    s.dev = std::move(mem).value();
    s.pin = std::move(held).value();
    s.addr = s.pin.data();
    s.allocating = false;
  }
  cv_.SignalAll();
  return StartArrival(u, prefetch ? Priority::kBackground : Priority::kUrgent);
}

// Pins a settled, resident unit's block on the copy stream. If compaction
// moved it since its `ready` was recorded, `ready` is recorded again after
// the copy stream's wait for that compaction.
Status EngineImpl::PinLocked(UnitState& s) {
  STRATA_ASSIGN_OR_RETURN(s.pin, s.dev.Pin(*copy_stream_));
  if (s.pin.data() != s.addr) {
    STRATA_RETURN_IF_ERROR(device_->RecordEvent(*s.ready, *copy_stream_));
    s.addr = s.pin.data();
  }
  return Status::Ok();
}

// Gives up a unit's device copy: its block goes to `freed` (freed in stream
// order by the caller, outside the lock) and its bytes back to the budget.
void EngineImpl::DropLocked(uint32_t v, std::vector<ArenaBlock>* freed) {
  UnitState& s = units_[v];
  freed->push_back(std::move(s.dev));
  s.resident = false;
  s.prefetched = false;
  device_used_ -= RoundUp(s.param_bytes, 256);
}

void EngineImpl::EvictLocked(uint32_t v, std::vector<ArenaBlock>* freed) {
  DropLocked(v, freed);
  ++stats_.evictions;
}

// The device allocator may refuse a request that fits the budget when its
// free space is split; evict colder copies until it succeeds or none is left.
StatusOr<ArenaBlock> EngineImpl::AllocateEvicting(uint32_t u, uint64_t need) {
  for (;;) {
    StatusOr<ArenaBlock> mem = Status::Ok();
    if (ShardedParams()) {
      // Note [Stage 3 over ranks]: a placement every rank makes alike. The
      // frees become reusable first; then a free range is taken as it is,
      // and only when none holds the unit does it compact, once every
      // arrival has landed (an arriving block is pinned, and how many are
      // is timing).
      STRATA_RETURN_IF_ERROR(arena_->SettleFrees());
      mem = arena_->Allocate(units_[u].param_bytes, *copy_stream_,
                             /*movable=*/true, /*wait_for_frees=*/false,
                             /*compact=*/false);
      if (!mem.ok() && mem.status().code() == StatusCode::kOutOfMemory) {
        {
          MutexLock l(&mu_);
          WaitArrivalsLocked();
        }
        STRATA_RETURN_IF_ERROR(arena_->SettleFrees());
        mem = arena_->Allocate(units_[u].param_bytes, *copy_stream_);
      }
    } else {
      mem = arena_->Allocate(units_[u].param_bytes, *copy_stream_);
    }
    if (mem.ok() || mem.status().code() != StatusCode::kOutOfMemory) {
      return mem;
    }
    std::vector<ArenaBlock> victims;
    {
      MutexLock l(&mu_);
      const int64_t v = PickVictimLocked(FetchTrace::kNever);
      if (v < 0 && WaitForArrivalLocked()) continue;
      if (v < 0) {
        return Status::OutOfMemory("engine: the device refused " + Bytes(need) +
                                   " for " + UnitNames(u) + " (unit " +
                                   std::to_string(u) +
                                   ") and nothing is left to evict: " +
                                   std::string(mem.status().message()));
      }
      EvictLocked(static_cast<uint32_t>(v), &victims);
      UpdateTierStatsLocked();
    }
  }
}

// Copies that are still arriving and that no pin holds become victims when
// they land (or are dropped, if their read fails): a fetch that finds no
// victim waits for one of them (the cv_ signal of FinishArrival) rather than
// fail. False, without waiting, when there is none.
bool EngineImpl::WaitForArrivalLocked() {
  for (const UnitState& s : units_) {
    if (s.resident && s.arriving && !s.allocating && s.pins == 0 &&
        !s.rests_here &&
        s.param_bytes >= options_.persistence_threshold_bytes) {
      cv_.Wait(&mu_);
      return true;
    }
  }
  return false;
}

// Row 10 of docs/reliability.md: nothing left to evict. Says what was asked
// and what holds the budget: the pinned and arriving units, by tensor name
// (the first few), and the bytes of each kind.
Status EngineImpl::OutOfDeviceMemoryLocked(uint32_t u) {
  constexpr int kNamed = 4;
  uint64_t pinned = 0, arriving = 0;
  std::string holders;
  int named = 0, unnamed = 0;
  for (uint32_t v = 0; v < units_.size(); ++v) {
    const UnitState& s = units_[v];
    if (!s.resident) continue;
    const uint64_t b = RoundUp(s.param_bytes, 256);
    if (s.pins > 0) pinned += b;
    if (s.arriving) arriving += b;
    if (s.pins == 0 && !s.arriving) continue;
    if (named == kNamed) {
      ++unnamed;
      continue;
    }
    holders += (named++ == 0 ? "" : "; ") + UnitNames(v) + " (" + Bytes(b) +
               (s.pins > 0 ? ", " + std::to_string(s.pins) +
                                 (s.pins == 1 ? " pin" : " pins")
                           : "") +
               (s.arriving ? ", arriving" : "") + ")";
  }
  if (unnamed > 0) holders += "; and " + std::to_string(unnamed) + " more";
  return Status::OutOfMemory(
      "engine: fetching " + UnitNames(u) + " needs " +
      Bytes(RoundUp(units_[u].param_bytes, 256)) +
      " on the device; the budget is " + Bytes(device_budget_) + ", of which " +
      Bytes(pinned) + " is pinned by live ParamPins and " + Bytes(arriving) +
      " is arriving" + (holders.empty() ? "" : ", held by " + holders) +
      "; release pins sooner or raise device_budget_bytes");
}

// Starts the copy of unit `u`'s parameters to its device block; `ready` is
// recorded after it on the copy stream.
Status EngineImpl::StartArrival(uint32_t u, Priority pr) {
  UnitState& s = units_[u];
  if (ShardedParams()) {
    // Note [Stage 3 over ranks]: in the order decided, whatever the priority.
    gatherer_->Post(Priority::kUrgent, [this, u] { GatherArrival(u); });
    return Status::Ok();
  }
  if (options_.params == Residence::kHost) {
    Status st =
        device_->CopyAsync(*copy_stream_, DevAt(s, 0), HostAt(kParam, u, 0),
                           s.param_bytes, CopyKind::kHostToDevice);
    if (st.ok()) st = device_->RecordEvent(*s.ready, *copy_stream_);
    FinishArrival(u, st, s.param_bytes);
    return st;
  }
  // On the mover: take a staging buffer per piece (blocking while all are
  // in use) and start its read; each completion enqueues its piece's copy
  // to the device, and the last one records `ready`.
  const IoPriority io_pr =
      pr == Priority::kUrgent ? IoPriority::kUrgent : IoPriority::kBackground;
  mover_->Post(pr, [this, u, io_pr] {
    UnitState& unit = units_[u];
    const size_t pieces = unit.nvme[kParam].size();
    auto group = std::make_shared<Countdown>(pieces, [this, u](Status st) {
      if (st.ok()) {
        st = device_->RecordEvent(*units_[u].ready, *copy_stream_);
      }
      FinishArrival(u, st, units_[u].param_bytes);
    });
    const size_t esize = ElementSize(unit.dtype);
    for (size_t p = 0; p < pieces; ++p) {
      StatusOr<StagingLease> lease = staging_->Acquire();
      if (!lease.ok()) {
        for (size_t q = p; q < pieces; ++q) group->Finish(lease.status());
        return;
      }
      auto held = std::make_shared<StagingLease>(std::move(lease).value());
      const uint64_t bytes = unit.nvme[kParam][p].bytes();
      std::byte* dst = DevAt(unit, p * piece_elems_ * esize);
      ReadPieceAsync(u, kParam, p, held->span(), io_pr,
                     [this, held, dst, bytes, group](Status st) {
                       if (st.ok()) {
                         st = device_->CopyAsync(*copy_stream_, dst,
                                                 held->data(), bytes,
                                                 CopyKind::kHostToDevice);
                       }
                       if (st.ok()) st = held->RecordDone(*copy_stream_);
                       held->Reset();
                       group->Finish(st);
                     });
    }
  });
  return Status::Ok();
}

void EngineImpl::FinishArrival(uint32_t u, const Status& st, uint64_t bytes) {
  std::vector<ArenaBlock> failed;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    s.arriving = false;
    s.arrival = st;
    if (s.pins == 0 && !s.rests_here) s.pin.Reset();  // may move now
    if (st.ok()) {
      h2d_bytes_ += bytes;
    } else {
      STRATA_LOG_WARN("strata: fetch of unit {} failed: {}", u, st.ToString());
      // Never resident: the block holds a partial copy. Pinned, it goes
      // when the last pin does (Unpin); the pins' Wait and WaitOn return
      // `st` meanwhile.
      if (s.pins == 0 && !s.rests_here) DropLocked(u, &failed);
    }
  }
  cv_.SignalAll();
  failed.clear();  // stream-ordered free, outside the lock
}

// Note [Waiting for an arrival]
// A fetch from NVMe is enqueued on the copy stream only as its pieces' reads
// complete, and a stream waits for an event's last record, so a consumer
// cannot wait for `ready` before then: WaitOn blocks the host until the copy
// is enqueued (not until it is done), then makes the consumer wait for
// `ready`. The host waits only while the read is in flight, which prefetch
// hides in a steady state.
//
// Why not let the consumer stream wait for a host-signalled event instead
// (the host never waiting): the consumer stream then waits for a copy not
// yet on the copy stream. A unit released after that wait has its free
// ordered after it (Note [Consumer streams]); an allocation that reuses the
// block puts a wait for that free on the copy stream, ahead of the pending
// copy, and the streams wait on each other forever. Training a GPT-style
// model with parameters on NVMe under a small budget did exactly that.
Status EngineImpl::WaitArrival(uint32_t u, Stream* consumer) {
  Event* ready;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    if (s.arriving) {
      const auto t0 = Clock::now();
      while (s.arriving) cv_.Wait(&mu_);
      stats_.stall_seconds +=
          std::chrono::duration<double>(Clock::now() - t0).count();
    }
    if (!s.arrival.ok()) return s.arrival;
    if (consumer != nullptr) {
      return device_->WaitEvent(*consumer, *s.ready);
    }
    ready = s.ready.get();
  }
  // Recorded already; waiting for it blocks only this thread.
  return device_->SynchronizeEvent(*ready);
}

// Note [Consumer streams]
// A trainer's stream may be gone long before the engine frees a cached
// device copy, so its uses are not recorded on the DeviceMemory (which would
// keep a pointer to it). At unpin, an event marks the end of each
// consumer's work so far, and the engine's release stream waits for it; every
// device copy is freed in the order of the copy stream and the release
// stream, both the engine's own.
void EngineImpl::Unpin(uint32_t u, const std::vector<Stream*>& consumers) {
  std::vector<ArenaBlock> failed;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    for (Stream* c : consumers) {
      Status st = device_->RecordEvent(*s.use_done, *c);
      if (st.ok()) st = device_->WaitEvent(*release_stream_, *s.use_done);
      if (!st.ok()) {
        // Without the event the only safe order is the host's.
        STRATA_LOG_WARN("strata: ordering a release failed ({}); waiting",
                        st.ToString());
        device_->SynchronizeStream(*c).IgnoreError();
      }
    }
    if (s.pins > 0 && --s.pins == 0 && !s.arriving && !s.rests_here) {
      s.pin.Reset();
      if (s.resident && !s.arrival.ok()) DropLocked(u, &failed);
    }
    s.last_use = ++clock_;
  }
  cv_.SignalAll();
  failed.clear();  // stream-ordered free, outside the lock
}

// ---- Gradients
// ---------------------------------------------------------------

Status EngineImpl::AddGrad(TensorId id, DeviceMemory grad, ElementType dtype,
                           Stream& producer) {
  const void* p = grad.data();
  STRATA_RETURN_IF_ERROR(
      AddGradImpl(id, p, grad.size(), dtype, producer, &grad));
  return Status::Ok();  // `grad` is freed here, after the copy, in order
}

Status EngineImpl::AddGrad(TensorId id, const void* grad, ElementType dtype,
                           Stream& producer) {
  return AddGradImpl(id, grad, SIZE_MAX, dtype, producer, nullptr);
}

Status EngineImpl::AddGradImpl(TensorId id, const void* grad, size_t avail,
                               ElementType dtype, Stream& producer,
                               DeviceMemory* owned) {
  STRATA_RETURN_IF_ERROR(CheckTensor(id, "AddGrad"));
  const size_t esize = ElementSize(dtype);
  const uint64_t n = numel_[id];
  // Note [Data-parallel ranks]: with several ranks a hand-over that fails
  // here still goes to the accumulator (as zeros, below), so that this rank
  // makes the reductions the others make; the step then fails on every
  // rank, naming this one. One rank returns at once.
  Status st;
  if (avail != SIZE_MAX && avail < n * esize) {
    st = Status::InvalidArgument("engine: AddGrad(" + specs_[id].name +
                                 "): " + Bytes(avail) + " of gradient for " +
                                 std::to_string(n) + " elements of " +
                                 std::string(ElementTypeName(dtype)));
    if (!MultiRank()) return st;
  }
  // Chunks of a staging buffer; one, on the device (Note [Gradients reduced
  // on the device]).
  const uint64_t per = DeviceReduce() ? std::max<uint64_t>(n, 1)
                                      : staging_->buffer_bytes() / esize;
  Stream& copies = DeviceReduce() ? *comm_stream_ : *d2h_stream_;
  bool first, last = false;
  {
    MutexLock l(&mu_);
    while (stepping_) step_cv_.Wait(&mu_);
    STRATA_RETURN_IF_ERROR(FailedLocked("AddGrad"));  // by the Step waited for
    if (early_armed_) {
      // Note [Updates during backward]: this is the tensor's last hand-over.
      if (last_handed_[id]) {
        return Status::FailedPrecondition(
            "engine: AddGrad(" + specs_[id].name +
            "): its last gradient before Step was handed over already "
            "(BeginStep); sum a tensor's gradients before handing them over");
      }
      last_handed_[id] = 1;
      uint32_t chunks = 0;
      for (uint64_t b = 0; b < n; b += HandOverChunk(id, b, per)) ++chunks;
      last_chunks_[id] = chunks;
      last = true;
    }
    // The first hand-over of a step overwrites the accumulator; later ones
    // add to it. Jobs run in order, so the first one's land first.
    first = grad_count_[id]++ == 0;
    ++grads_pending_;
    // The copies run on `copies` after what `producer` has so far; the
    // event may be recorded again at once: a wait takes the record it sees
    // when it is enqueued.
    if (st.ok()) st = device_->RecordEvent(*producer_event_, producer);
    if (st.ok()) st = device_->WaitEvent(copies, *producer_event_);
  }
  if (owned != nullptr) owned->RecordUse(copies);
  if (DeviceReduce()) {
    // Note [Gradients reduced on the device]: the accumulator copies it
    // into a bucket, in hand-over order; owned memory (`keep`, held by the
    // job) is freed when the job is done, after that copy in stream order.
    std::shared_ptr<DeviceMemory> keep;
    if (owned != nullptr) {
      keep = std::make_shared<DeviceMemory>(std::move(*owned));
    }
    accumulator_->Post(Priority::kUrgent,
                       [this, id, grad, dtype, first, last, st, keep] {
                         AccumulateOnDevice(id, grad, dtype, first, last, st);
                       });
    return st;  // the job ends the hand-over (grads_pending_)
  }
  uint64_t b = 0, cnt = 0;  // the first element not handed over
  for (; st.ok() && b < n; b += cnt) {
    cnt = HandOverChunk(id, b, per);
    StatusOr<StagingLease> lease = staging_->Acquire();
    if (!lease.ok()) {
      st = lease.status();
      break;
    }
    st = device_->CopyAsync(*d2h_stream_, lease->data(),
                            static_cast<const std::byte*>(grad) + b * esize,
                            cnt * esize, CopyKind::kDeviceToHost);
    if (st.ok()) st = lease->RecordDone(*d2h_stream_);
    if (!st.ok()) break;
    {
      MutexLock l(&mu_);
      ++grads_pending_;
      d2h_bytes_ += cnt * esize;
    }
    auto shared = std::make_shared<StagingLease>(std::move(lease).value());
    accumulator_->Post(
        Priority::kUrgent, [this, id, b, cnt, dtype, first, last, shared] {
          Accumulate(id, b, cnt, dtype, first, last, std::move(*shared), {});
        });
  }
  for (; !st.ok() && MultiRank() && b < n; b += cnt) {
    // The rest as zeros, failed (above).
    cnt = HandOverChunk(id, b, per);
    {
      MutexLock l(&mu_);
      ++grads_pending_;
    }
    accumulator_->Post(Priority::kUrgent,
                       [this, id, b, cnt, dtype, first, last, st] {
                         Accumulate(id, b, cnt, dtype, first, last, {}, st);
                       });
  }
  {
    MutexLock l(&mu_);
    if (!st.ok() && grad_error_.ok()) grad_error_ = st;
    --grads_pending_;
  }
  grads_cv_.SignalAll();
  return st;
}

uint64_t EngineImpl::HandOverChunk(TensorId id, uint64_t b,
                                   uint64_t per) const {
  uint64_t cnt = std::min(per, numel_[id] - b);
  if (grad_spill_ && !MultiRank()) {
    const uint64_t at = layout_->tensor(id).offset + b;
    cnt = std::min(cnt, piece_elems_ - at % piece_elems_);
  }
  return cnt;
}

// On the accumulator: waits for the copy into `lease`, then adds it (as fp32)
// into the tensor's accumulator, or overwrites it on the first micro-batch.
void EngineImpl::Accumulate(TensorId id, uint64_t begin, uint64_t n,
                            ElementType dtype, bool first, bool last,
                            StagingLease lease, Status failed) {
  Status st = failed.ok() ? lease.WaitDone() : failed;
  const TensorPlace& t = layout_->tensor(id);
  float* acc =
      grad_spill_ || MultiRank()
          ? nullptr
          : reinterpret_cast<float*>(HostAt(kGrad, t.unit, t.offset + begin));
  for (uint64_t b = 0; b < n; b += scratch_.size()) {
    const uint64_t cnt = std::min<uint64_t>(scratch_.size(), n - b);
    const std::byte* src =
        st.ok() ? lease.data() + b * ElementSize(dtype) : nullptr;
    const float* vals = scratch_.data();
    if (st.ok() && dtype == ElementType::kFloat32) {
      vals = reinterpret_cast<const float*>(src);
    } else if (st.ok()) {
      st = ConvertCpuArray(src, ToCpu(dtype), scratch_.data(),
                           CpuDType::kFloat32, cnt);
    }
    if (!st.ok()) {
      // Note [Data-parallel ranks]: after a failure of its own, a rank
      // still makes the hand-over's collectives (with zeros), so that no
      // rank waits for it; the step then fails on every rank.
      if (!MultiRank()) break;
      std::fill_n(scratch_.data(), cnt, 0.0f);
      vals = scratch_.data();
    }
    if (MultiRank()) {
      GradSource from;
      from.host = vals;
      const Status added =
          AccumulateRanked(id, t.offset + begin + b, from, cnt, first);
      if (st.ok()) st = added;
    } else if (grad_spill_) {
      // Note [Adafactor's statistics during backward] (factored.cc): the
      // chunk's sums, seen in its piece once its last values are in.
      GradSpill::VisitFn visit;
      if (last && b + cnt == n && TakesSpilledChunks()) {
        const uint64_t at = t.offset + begin;
        visit = [this, id, begin, n, at](const float* piece) {
          EarlySpilledChunk(id, begin, n, piece + at % piece_elems_);
        };
      }
      st = grad_spill_->Add(t.unit, t.offset + begin + b, vals, cnt, first,
                            visit);
    } else if (first) {
      std::memcpy(acc + b, vals, cnt * 4);
    } else {
      for (uint64_t i = 0; i < cnt; ++i) acc[b + i] += vals[i];
    }
  }
  lease.Reset();
  EndHandOver(id, last, st);
}

// Note [Gradients reduced on the device]
// With the collectives on device memory (comm_memory device: NCCL), stages
// 2 and 3 keep their two reduction buckets on the device: a hand-over is
// copied (converted to fp32) from the caller's device memory straight into
// its bucket window on the communicator's stream, after the producer's
// work, and a full bucket is reduce-scattered there, so only this rank's
// part of the window crosses to the host, where it is added to the shard
// as with host buckets. The host path instead copies the whole gradient to
// the host, where the host buckets are reduced (through the device buffer,
// with NCCL: the whole window back to the device). The bucket logic, its
// order and its failures (zeros, so that every rank reduces alike) are the
// same; the accumulator runs it, one job per hand-over.
void EngineImpl::AccumulateOnDevice(TensorId id, const void* grad,
                                    ElementType dtype, bool first, bool last,
                                    Status failed) {
  GradSource src;
  if (failed.ok()) {
    src.device = static_cast<const std::byte*>(grad);
    src.dtype = dtype;
  }
  const Status added =
      AccumulateRanked(id, layout_->tensor(id).offset, src, numel_[id], first);
  EndHandOver(id, last, failed.ok() ? added : failed);
}

void EngineImpl::EndHandOver(TensorId id, bool last, const Status& st) {
  const TensorPlace& t = layout_->tensor(id);
  bool ready = false;
  {
    MutexLock l(&mu_);
    if (!st.ok() && grad_error_.ok()) grad_error_ = st;
    // The unit's last gradients are all in: it may be updated now.
    if (last && early_armed_ && --last_chunks_[id] == 0) {
      ready =
          --unit_waiting_[t.unit] == 0 && grad_error_.ok() && EarlyWorkLocked();
    }
  }
  // Posted before the hand-over counts as done, so that a Step, which waits
  // for the hand-overs and then drains the stepper, finds it queued.
  if (ready) {
    const uint32_t u = t.unit;
    stepper_->Post(Priority::kUrgent, [this, u] {
      if (Factored() || undo_.empty()) {
        EarlyStatistics(u);
      } else {
        EarlyUpdate(u);
      }
    });
  }
  {
    MutexLock l(&mu_);
    --grads_pending_;
  }
  grads_cv_.SignalAll();
}

Status EngineImpl::WaitGrads() {
  MutexLock l(&mu_);
  while (grads_pending_ > 0) grads_cv_.Wait(&mu_);
  Status st = grad_error_;
  grad_error_ = Status::Ok();
  return st;
}

void EngineImpl::WaitGradsQuiet() {
  MutexLock l(&mu_);
  while (grads_pending_ > 0) grads_cv_.Wait(&mu_);
}

// ---- Data-parallel ranks ----------------------------------------------------

// Note [Data-parallel ranks]
// With world_size N above 1 (EngineOptions::comm, zero_stage 1 or 2) every
// rank keeps the whole working copy of every unit (zero_stage 3: its shard,
// Note [Stage 3 over ranks]), and its shard of the rest: the layout pads each
// unit to N equal, aligned shards (the last ones holding the padding), and rank
// r's gradient accumulator, fp32 master and moments cover shard r only, on the
// host or on NVMe, so the optimizer state per rank is 1/N.
// - Gradients are averaged over ranks (DeepSpeed's convention): each rank
//   hands over the gradient of its own micro-batches, the shards receive
//   the sum over ranks (a reduce-scatter of fp32), and the step divides by
//   N with the loss scale. zero_stage 1 accumulates the full local gradient
//   as one rank does and reduce-scatters every unit at the step. zero_stage
//   2 reduces as gradients come: a unit is cut in windows of a packed
//   unit's size (a large tensor's unit spans several), and a hand-over goes
//   into a bucket holding one window of the unit's full gradient (zeros
//   elsewhere); the bucket is reduce-scattered (each rank receiving the
//   window's part in its shard, maybe none: uneven counts) when every
//   tensor overlapping the window is in, when one of them comes again (the
//   next micro-batch), when its buffer is needed for another window (two
//   buckets; the older goes), or at the step. The buckets' memory is two
//   windows, whatever the model.
//   All of this follows the order of the hand-overs, so every rank issues
//   the same collectives when every rank hands over the same tensors in the
//   same order (one thread, as DeepSpeed needs the same backward).
// - The global norm is the sum of every rank's squared sums, and a
//   non-finite shard anywhere skips the step everywhere: each rank's
//   (sum, finite) pair is all-gathered and summed in rank order, so every
//   rank gets the same norm and the same verdict, and the loss scale moves
//   the same on every rank.
// - Stages 1 and 2 keep the parameters on the device. Once every piece is
//   updated, every rank's new working copy of its shard is all-gathered
//   piece by piece through a staging buffer into every rank's device block
//   (GatherParams), in unit order on every rank whichever units were
//   updated during backward.
// - Updates during backward (zero_stage 2): a unit's shard of the gradient
//   is final once the last hand-overs of its tensors are reduced, so the
//   stepper updates it as with one rank; it issues no collective (the
//   gather waits for Step), and Step's agreed overflow verdict undoes every
//   rank's early updates together.
// - The gradient's statistics during backward (zero_stage 2 and 3): for the
//   same reason the stepper takes each rank's stats of its shard of a unit
//   left to Step (and Adafactor's statistics pass over the rank's part of
//   its matrices), with no collective: Step adds the pieces' stats in the
//   same order before the norm's agreement, and reduces Adafactor's sums
//   over the ranks as it would have. A rank whose stepper met a non-finite
//   gradient stops there, and the agreed verdict skips the step on every
//   rank; the others' statistics are dropped with it, as nothing changed.
//   Which units are prefetched depends on the trainer's calls alone, never
//   on the stepper's pace (stage 3's ranks must gather the same units):
//   prefetch passes over a unit once all its tensors' last gradients were
//   handed over (HandedOverLocked), whatever the stepper has done with it.
// - ReadMaster gathers a tensor's master from the shards: a collective.
// - Step agrees on its outcome at three points (before the reduction, before
//   the norm, after the update: AgreeNow), so that a rank whose hand-overs,
//   reads or write-backs failed fails the step on every rank at once, each
//   naming the rank, instead of leaving the others in a collective until
//   the communicator's timeout; a failure after the update began fails the
//   engine on every rank (Note [Engine failures]).
// - Gradients on NVMe (zero_stage 2): the reduced window is added into the
//   spill's pieces of the shard (Note [Gradients on NVMe]).
// - Gradients with zero_stage 3 are reduced as with zero_stage 2.
// - Not with several ranks (refused by CheckOptions): grads on NVMe and
//   updates during backward with zero_stage 1 (which reduces at the step;
//   nor are its statistics taken during backward), updates during backward
//   with zero_stage 3, zero_stage 0.

Status EngineImpl::ReduceUnitGrad(uint32_t u, const float* full) {
  // zero_stage 1: every unit once per step, straight into its shard.
  const std::vector<size_t> counts(static_cast<size_t>(options_.world_size),
                                   units_[u].elems);
  return coll_
      ->ReduceScatter(full, HostAt(kGrad, u, 0), counts, CommType::kFloat32,
                      ReduceOp::kSum)
      .WithContext("engine: reducing the gradient of " + UnitNames(u) +
                   " (unit " + std::to_string(u) + ") over the ranks");
}

Status EngineImpl::ReduceWindow(uint32_t u, uint64_t w, const float* data) {
  const bool device = DeviceReduce();
  const UnitState& s = units_[u];
  const uint64_t lo = w * window_elems_;
  const uint64_t hi = std::min(lo + window_elems_, s.full_elems);
  // Rank r receives the window's elements in its shard (maybe none).
  const std::vector<size_t> counts = RankCounts(lo, hi, s.elems);
  const uint64_t mine = counts[static_cast<size_t>(options_.rank)];
  uint8_t& written = window_written_[window_base_[u] + w];
  float* shard = nullptr;  // in the host array (not with grads on NVMe)
  if (mine > 0 && !grad_spill_) {
    shard = reinterpret_cast<float*>(
        HostAt(kGrad, u, std::max(lo, s.shard_begin) - s.shard_begin));
  }
  // Gradients on NVMe (Note [Gradients on NVMe]) are added through the
  // spill, from the reduction's output.
  float* out = written == 0 && mine > 0 && !grad_spill_
                   ? shard
                   : reinterpret_cast<float*>(reduce_out_.data());
  STRATA_RETURN_IF_ERROR(
      (device ? coll_->ReduceScatterFromDevice(
                    data, out, counts, CommType::kFloat32, ReduceOp::kSum)
              : coll_->ReduceScatter(data, out, counts, CommType::kFloat32,
                                     ReduceOp::kSum))
          .WithContext("engine: reducing the gradient of " + UnitNames(u) +
                       " (unit " + std::to_string(u) + ", elements " +
                       std::to_string(lo) + ".." + std::to_string(hi) +
                       ") over the ranks"));
  if (device) {
    MutexLock l(&mu_);
    d2h_bytes_ += mine * 4;  // only this rank's part left the device
  }
  if (grad_spill_) {
    if (mine > 0) {
      STRATA_RETURN_IF_ERROR(grad_spill_->Add(
          u, std::max(lo, s.shard_begin) - s.shard_begin, out, mine,
          /*overwrite=*/written == 0));
    }
  } else if (written != 0) {
    for (uint64_t i = 0; i < mine; ++i) shard[i] += out[i];
  }
  written = 1;
  return Status::Ok();
}

std::vector<size_t> EngineImpl::RankCounts(uint64_t lo, uint64_t hi,
                                           uint64_t shard) const {
  std::vector<size_t> counts(static_cast<size_t>(options_.world_size));
  for (size_t r = 0; r < counts.size(); ++r) {
    const uint64_t a = std::max<uint64_t>(lo, r * shard);
    const uint64_t b = std::min<uint64_t>(hi, (r + 1) * shard);
    counts[r] = b > a ? b - a : 0;
  }
  return counts;
}

size_t EngineImpl::OldestOpenBucket() const {
  size_t b = buckets_.size();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].unit >= 0 &&
        (b == buckets_.size() || buckets_[i].opened < buckets_[b].opened)) {
      b = i;
    }
  }
  return b;
}

Status EngineImpl::FlushBucket(size_t b) {
  GradBucket& k = buckets_[b];
  const uint32_t u = static_cast<uint32_t>(k.unit);
  k.unit = -1;
  k.present.clear();
  k.ended = 0;
  const void* data = DeviceReduce() ? k.dev.data() : k.mem.data();
  return ReduceWindow(u, k.window, static_cast<const float*>(data));
}

Status EngineImpl::AccumulateRanked(TensorId id, uint64_t elem,
                                    const GradSource& src, uint64_t n,
                                    bool first) {
  const TensorPlace& t = layout_->tensor(id);
  const uint32_t u = t.unit;
  if (options_.zero_stage == 1) {
    float* acc = FullGradAt(u, elem);
    const float* vals = src.host;
    if (first) {
      std::memcpy(acc, vals, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) acc[i] += vals[i];
    }
    return Status::Ok();
  }
  GradSource at = src;
  // zero_stage 2: split at the windows' ends.
  while (n > 0) {
    const uint64_t w = elem / window_elems_;
    const uint64_t lo = w * window_elems_;
    const uint64_t hi = std::min(lo + window_elems_, units_[u].full_elems);
    const uint64_t k = std::min(n, hi - elem);
    // The tensor's part of this window: [tlo, thi).
    const uint64_t tlo = std::max(t.offset, lo);
    const uint64_t thi = std::min(t.offset + t.elems, hi);
    STRATA_RETURN_IF_ERROR(
        AccumulateWindow(id, w, elem, at, k, elem == tlo, elem + k == thi));
    elem += k;
    at = at.Advanced(k);
    n -= k;
  }
  return Status::Ok();
}

Status EngineImpl::AccumulateWindow(TensorId id, uint64_t w, uint64_t elem,
                                    const GradSource& src, uint64_t n,
                                    bool part_begins, bool part_ends) {
  const uint32_t u = layout_->tensor(id).unit;
  const uint64_t lo = w * window_elems_;
  const uint64_t hi = std::min(lo + window_elems_, units_[u].full_elems);
  size_t b = buckets_.size();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].unit == static_cast<int64_t>(u) &&
        buckets_[i].window == w) {
      b = i;
    }
  }
  if (part_begins) {
    if (b < buckets_.size() &&
        std::find(buckets_[b].present.begin(), buckets_[b].present.end(), id) !=
            buckets_[b].present.end()) {
      // The tensor's next hand-over: the window's last one is complete.
      STRATA_RETURN_IF_ERROR(FlushBucket(b));
      b = buckets_.size();
    }
    if (b == buckets_.size()) {
      for (size_t i = 0; i < buckets_.size(); ++i) {
        if (buckets_[i].unit < 0) b = i;
      }
      if (b == buckets_.size()) {  // none free: the oldest goes
        b = OldestOpenBucket();
        STRATA_RETURN_IF_ERROR(FlushBucket(b));
      }
      GradBucket& k = buckets_[b];
      k.unit = u;
      k.window = w;
      k.opened = ++buckets_opened_;
      k.expected = 0;
      for (uint32_t other : layout_->unit(u).tensors) {
        const TensorPlace& o = layout_->tensor(other);
        if (o.offset < hi && o.offset + o.elems > lo) ++k.expected;
      }
      if (DeviceReduce()) {
        STRATA_RETURN_IF_ERROR(device_->MemsetAsync(*comm_stream_, k.dev.data(),
                                                    0, (hi - lo) * 4));
      } else {
        std::memset(k.mem.data(), 0, (hi - lo) * 4);
      }
    }
    buckets_[b].present.push_back(id);
  } else if (b == buckets_.size()) {
    return Status::Internal("engine: a gradient's bucket was lost");
  }
  GradBucket& k = buckets_[b];
  if (!DeviceReduce()) {
    std::memcpy(reinterpret_cast<float*>(k.mem.data()) + (elem - lo), src.host,
                n * 4);
  } else if (src.device != nullptr) {
    // Note [Gradients reduced on the device] (a failed hand-over leaves
    // the zeros the bucket opened with).
    float* dst = reinterpret_cast<float*>(k.dev.data()) + (elem - lo);
    if (src.dtype == ElementType::kFloat32) {
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(
          *comm_stream_, dst, src.device, n * 4, CopyKind::kDeviceToDevice));
    } else {
      ConvertArgs c;
      c.src = src.device;
      c.src_type = src.dtype;
      c.dst = dst;
      c.dst_type = ElementType::kFloat32;
      c.count = n;
      STRATA_RETURN_IF_ERROR(device_->ConvertAsync(*comm_stream_, c));
    }
  }
  if (part_ends && ++k.ended == k.expected) return FlushBucket(b);
  return Status::Ok();
}

Status EngineImpl::ReduceGrads(const std::vector<uint32_t>& counts) {
  if (options_.zero_stage == 1) {
    // Tensors without a gradient this step contribute zeros.
    for (TensorId id = 0; id < specs_.size(); ++id) {
      if (counts[id] == 0) {
        const TensorPlace& t = layout_->tensor(id);
        std::memset(FullGradAt(t.unit, t.offset), 0, t.elems * 4);
      }
    }
    for (uint32_t u = 0; u < units_.size(); ++u) {
      STRATA_RETURN_IF_ERROR(ReduceUnitGrad(u, FullGradAt(u, 0)));
    }
    return Status::Ok();
  }
  // The buckets still open, in the order they were opened; after a failure
  // of its own (a gradient piece it could not write) a rank still makes the
  // other reductions, and the step fails on every rank (RunStep).
  Status first;
  for (size_t b; (b = OldestOpenBucket()) < buckets_.size();) {
    const Status st = FlushBucket(b);
    if (first.ok()) first = st;
  }
  // This rank's part of the windows no rank handed a gradient for (on NVMe
  // a piece not written in the step is zeros already).
  for (uint32_t u = 0; u < units_.size() && !grad_spill_; ++u) {
    const UnitState& s = units_[u];
    for (uint64_t w = 0; w * window_elems_ < s.full_elems; ++w) {
      if (window_written_[window_base_[u] + w] != 0) continue;
      const uint64_t lo = std::max(w * window_elems_, s.shard_begin);
      const uint64_t hi =
          std::min((w + 1) * window_elems_, s.shard_begin + s.elems);
      if (hi > lo) {
        std::memset(HostAt(kGrad, u, lo - s.shard_begin), 0, (hi - lo) * 4);
      }
    }
  }
  return first;
}

StatusOr<GradStats> EngineImpl::AgreeGradStats(const GradStats& local) {
  const size_t n = static_cast<size_t>(options_.world_size);
  const double mine[2] = {local.sum_sq, local.finite ? 1.0 : 0.0};
  std::vector<double> all(2 * n);
  const std::vector<size_t> counts(n, sizeof mine);
  STRATA_RETURN_IF_ERROR(
      coll_->AllGather(mine, all.data(), counts, CommType::kByte)
          .WithContext("engine: agreeing on the gradient's norm"));
  GradStats g;
  for (size_t r = 0; r < n; ++r) {
    g.sum_sq += all[2 * r];
    g.finite = g.finite && all[2 * r + 1] != 0;
  }
  return g;
}

// ---- The optimizer step -----------------------------------------------------

StatusOr<StepArgs> EngineImpl::ResolveStepArgs(const StepArgs& args,
                                               const char* what) {
  if (!(args.loss_scale >= 0) || !std::isfinite(args.loss_scale) ||
      !(args.lr >= 0) || !std::isfinite(args.lr) ||
      !(args.max_grad_norm >= 0) || !std::isfinite(args.max_grad_norm)) {
    return Status::InvalidArgument(
        std::string("engine: ") + what +
        " needs loss_scale >= 0 (0: the engine's), lr >= 0 and "
        "max_grad_norm >= 0, all finite");
  }
  StepArgs r = args;
  const double own = loss_scaler_.scale();
  if (r.loss_scale == 0) {
    r.loss_scale = own;
  } else if (options_.loss_scale.mode != LossScaleMode::kNone &&
             r.loss_scale != own) {
    return Status::InvalidArgument(
        std::string("engine: ") + what + "'s loss_scale " +
        std::to_string(args.loss_scale) + " differs from the engine's " +
        std::to_string(own) + " (loss_scale.mode " +
        std::string(LossScaleModeName(options_.loss_scale.mode)) +
        "); pass 0 or LossScale()");
  }
  return r;
}

StatusOr<StepResult> EngineImpl::Step(const StepArgs& given) {
  StepArgs args;
  {
    MutexLock l(&mu_);
    STRATA_ASSIGN_OR_RETURN(args, ResolveStepArgs(given, "Step"));
    if (!started_)
      return Status::FailedPrecondition("engine: Step before Start");
    if (stepping_) return Status::FailedPrecondition("engine: Step is running");
    STRATA_RETURN_IF_ERROR(FailedLocked("Step"));
    if (early_armed_ && (args.lr != early_args_.lr ||
                         args.loss_scale != early_args_.loss_scale ||
                         args.max_grad_norm != early_args_.max_grad_norm)) {
      return Status::InvalidArgument(
          "engine: Step's lr, loss_scale and max_grad_norm differ from the "
          "BeginStep before it, whose updates may have begun");
    }
    for (const UnitState& s : units_) {
      if (s.pins > 0) {
        return Status::FailedPrecondition(
            "engine: Step with parameters still pinned; drop every ParamPin "
            "first");
      }
    }
    stepping_ = true;
  }
  const auto t0 = Clock::now();
  StatusOr<StepResult> r = RunStep(args);
  // The accumulator is idle (hand-overs wait for stepping_), and so is the
  // stepper (RunStep drained it).
  if (grad_spill_) grad_spill_->EndStep();
  early_pieces_.clear();
  undo_used_ = 0;
  {
    MutexLock l(&mu_);
    EndEarlyLocked();
    stepping_ = false;
    stats_.step_seconds =
        std::chrono::duration<double>(Clock::now() - t0).count();
    stats_.update_seconds = update_seconds_;
    update_seconds_ = 0;
    if (r.ok()) {
      if (r->applied) {
        ++stats_.steps;
      } else {
        ++stats_.skipped_steps;
      }
      r->loss_scale = args.loss_scale;
      loss_scaler_.Update(!r->applied);
    }
    trace_->EndStep();
    started_steps_ = true;
    if (allocations_after_first_step_ == UINT64_MAX) {
      allocations_after_first_step_ = counting_device_.count();
    }
    std::fill(grad_count_.begin(), grad_count_.end(), 0);
    std::fill(window_written_.begin(), window_written_.end(), 0);
    UpdateTierStatsLocked();
  }
  step_cv_.SignalAll();
  return r;
}

StatusOr<StepResult> EngineImpl::RunStep(const StepArgs& args) {
  // Everything handed over is in the accumulators, and every update it
  // started during backward has run (Note [Updates during backward]).
  Status grads = WaitGrads();
  DrainStepper();
  std::vector<uint8_t> early;
  {
    MutexLock l(&mu_);
    if (grads.ok()) grads = early_error_;
    early = early_state_;
  }
  // Note [Data-parallel ranks]: a rank that cannot step tells the others
  // now, instead of leaving them in the reduction until the timeout.
  if (MultiRank()) grads = AgreeNow(grads);
  StatusOr<StepResult> r = grads.ok() ? StepRest(args, early) : grads;
  // The units updated early are undone unless the rest was updated too: on
  // an overflow, and on an error before the rest's update began (one after
  // it has set failed_: Note [Engine failures]).
  bool began;
  {
    MutexLock l(&mu_);
    began = !failed_.ok();
  }
  if ((!r.ok() && !began) || (r.ok() && !r->applied)) {
    STRATA_RETURN_IF_ERROR(UndoEarly());
  }
  return r;
}

StatusOr<StepResult> EngineImpl::StepRest(
    const StepArgs& args, const std::vector<uint8_t>& early_state) {
  std::vector<uint32_t> rest;  // units not updated during backward
  for (uint32_t u = 0; u < units_.size(); ++u) {
    if (early_state[u] != kEarlyUpdated) rest.push_back(u);
  }
  // Every fetch has landed.
  STRATA_RETURN_IF_ERROR(RunOnMover([] { return Status::Ok(); }));
  {
    // Fetches the mover started may still be reading: the step rewrites
    // those pieces.
    MutexLock l(&mu_);
    for (const UnitState& s : units_) {
      while (s.arriving) cv_.Wait(&mu_);
    }
  }
  // Copies of host parameters to the device must be done before the update
  // rewrites them.
  STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
  std::vector<uint32_t> counts;
  {
    MutexLock l(&mu_);
    counts = grad_count_;
  }
  // Tensors without a gradient this step contribute zeros (on NVMe they are
  // zero already: Note [Gradients on NVMe]).
  if (MultiRank()) {
    // Note [Data-parallel ranks]: every shard summed over the ranks, on the
    // accumulator, which owns the buckets and the spill.
    std::promise<Status> reduced;
    std::future<Status> f = reduced.get_future();
    accumulator_->Post(Priority::kUrgent, [this, &reduced, &counts] {
      reduced.set_value(ReduceGrads(counts));
    });
    STRATA_RETURN_IF_ERROR(f.get());
  } else if (!grad_spill_) {
    for (TensorId id = 0; id < specs_.size(); ++id) {
      if (counts[id] == 0) {
        const TensorPlace& t = layout_->tensor(id);
        std::memset(HostAt(kGrad, t.unit, t.offset), 0, t.elems * 4);
      }
    }
  }
  // Note [Step pipeline]: the first pieces' reads go out now.
  Status pre = grad_spill_ ? FlushGrads() : Status::Ok();
  std::unique_ptr<StepReads> reads = NewStepReads(rest, SIZE_MAX);
  if (pre.ok()) pre = StartReads(*reads, /*wait=*/false);
  // Global norm and overflow, over the unscaled gradient.
  GradStats g;
  if (pre.ok()) {
    StatusOr<GradStats> local = GradientStats(early_state);
    if (local.ok()) {
      g = *local;
    } else {
      pre = local.status();
    }
  }
  // Several ranks: every rank learns of another's failure, then the same
  // sums on every rank, and the shards' sum over ranks averaged (Note
  // [Data-parallel ranks]).
  if (MultiRank()) pre = AgreeNow(pre);
  STRATA_RETURN_IF_ERROR(pre);
  if (MultiRank()) {
    STRATA_ASSIGN_OR_RETURN(g, AgreeGradStats(g));
  }
  const double inv_scale = InvGradScale(args.loss_scale);
  StepResult result;
  result.grad_norm = std::sqrt(g.sum_sq) * inv_scale;
  if (!g.finite || !std::isfinite(result.grad_norm)) {
    result.applied = false;
    MutexLock l(&mu_);
    result.step = steps_;
    return result;  // `reads` ends its reads before the undo takes buffers
  }
  double clip = 1.0;
  if (args.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1.
    clip = std::min(1.0, args.max_grad_norm / (result.grad_norm + 1e-6));
  }
  int64_t step;
  {
    MutexLock l(&mu_);
    step = ++steps_;
  }
  CpuStepArgs sa;
  sa.step = step;
  sa.lr = args.lr;
  sa.inv_loss_scale = inv_scale;
  sa.clip_coef = clip;
  sa.check_overflow = false;  // checked above over the same gradient
  Status st = AfterConsumers();
  // Note [Factored optimizers in the engine]: their passes before and after
  // the update.
  if (st.ok() && Factored()) st = FactoredBeforeUpdate(sa, early_state);
  if (st.ok()) st = UpdateAll(*reads, sa);
  if (st.ok() && Factored()) st = FactoredAfterUpdate();
  // Several ranks: a rank whose update failed fails the step everywhere.
  if (MultiRank()) st = AgreeNow(st);
  if (st.ok() && WholeParams()) st = GatherParams();
  if (!st.ok()) {
    MutexLock l(&mu_);
    failed_ = st;  // Note [Engine failures]
    return st;
  }
  InvalidateCaches();
  result.applied = true;
  result.step = step;
  return result;
}

Status EngineImpl::FlushGrads() {
  // The open pieces go to NVMe (each write records its stats), on the
  // accumulator, which owns the spill.
  std::promise<Status> flushed;
  std::future<Status> f = flushed.get_future();
  accumulator_->Post(Priority::kUrgent, [this, &flushed] {
    flushed.set_value(grad_spill_->Flush());
  });
  return f.get();
}

StatusOr<GradStats> EngineImpl::HostGradStats(uint32_t u, size_t p) {
  const uint64_t b = p * piece_elems_;
  return optimizer_->ComputeGradStats(
      HostAt(kGrad, u, b), CpuDType::kFloat32,
      std::min(piece_elems_, units_[u].elems - b), 1.0);
}

StatusOr<GradStats> EngineImpl::GradientStats(
    const std::vector<uint8_t>& early_state) {
  // The same sums, in the same order, whichever tier holds the gradients,
  // so that where they rest never changes a result. A unit updated during
  // backward had its pieces' stats taken then (Note [Updates during
  // backward]); its gradient has not changed since.
  GradStats total;
  for (uint32_t u = 0; u < units_.size(); ++u) {
    for (size_t p = 0; p * piece_elems_ < units_[u].elems; ++p) {
      GradStats g;
      if (grad_spill_) {
        if (grad_spill_->written(u, p)) g = grad_spill_->stats(u, p);
      } else if (early_state[u] == kEarlyUpdated ||
                 early_state[u] == kEarlyStatistics) {
        g = early_stats_[u][p];
      } else {
        STRATA_ASSIGN_OR_RETURN(g, HostGradStats(u, p));
      }
      total.sum_sq += g.sum_sq;
      total.finite = total.finite && g.finite;
    }
  }
  return total;
}

// Note [Step pipeline]
// The step's pieces flow through the staging buffers: what rests on NVMe of
// up to `depth` pieces (states, gradient) is being read ahead while one piece
// is updated and the writes of the pieces before it drain. The reads start
// before the gradient-norm pass, which does not need them, so the drive
// works while the CPU checks the gradient. A piece is started only when all
// its buffers can be had at once, so no piece holds some while waiting for
// the rest; the step waits for buffers (for writes to end) only when nothing
// is left to update.

// One piece of the step: elements [begin, begin + n) of unit `u`, with the
// buffers that hold its states while it is updated.
struct EngineImpl::StepPiece {
  uint32_t unit = 0;
  size_t index = 0;  // piece index within the unit
  uint64_t begin = 0, n = 0;
  StagingLease master, exp_avg, exp_avg_sq, working, grad;
  std::future<Status> read;  // of what rests on NVMe
};

struct EngineImpl::StepReads {
  std::vector<std::pair<uint32_t, size_t>> order;  // (unit, piece)
  size_t next = 0;                                 // in order
  size_t per_piece = 0;                            // staging buffers
  size_t depth = 1;                                // pieces read ahead
  std::deque<std::unique_ptr<StepPiece>> ahead;
  ~StepReads() {
    // Abandoned (an overflow, an error): the reads must end before the
    // buffers go back.
    for (auto& p : ahead) {
      if (p->read.valid()) p->read.wait();
    }
  }
};

size_t EngineImpl::StepBuffersPerPiece() const {
  const bool nvme_states = options_.optimizer_states == Residence::kNvme;
  const size_t states = 1 + (RoleKept(kExpAvg) ? 1 : 0) +
                        (RoleKept(kExpAvgSq) ? 1 : 0);  // and the master
  return (nvme_states ? states : 0) +
         (options_.params != Residence::kHost ? 1 : 0) + (grad_spill_ ? 1 : 0);
}

std::unique_ptr<EngineImpl::StepReads> EngineImpl::NewStepReads(
    const std::vector<uint32_t>& units, size_t max_depth) {
  auto r = std::make_unique<StepReads>();
  for (uint32_t u : units) {
    for (size_t p = 0; p * piece_elems_ < units_[u].elems; ++p) {
      r->order.emplace_back(u, p);
    }
  }
  r->per_piece = StepBuffersPerPiece();
  r->depth = r->per_piece == 0
                 ? 2
                 : std::max<size_t>(1, staging_->count() / r->per_piece);
  r->depth = std::min(r->depth, std::max<size_t>(1, max_depth));
  return r;
}

Status EngineImpl::StartReads(StepReads& r, bool wait) {
  const bool nvme_states = options_.optimizer_states == Residence::kNvme;
  while (r.ahead.size() < r.depth && r.next < r.order.size()) {
    std::vector<StagingLease> leases;
    if (r.per_piece > 0) {
      leases = staging_->TryAcquire(r.per_piece);
      if (leases.empty()) {
        if (!wait || !r.ahead.empty()) break;
        for (size_t i = 0; i < r.per_piece; ++i) {
          STRATA_ASSIGN_OR_RETURN(StagingLease l, staging_->Acquire());
          leases.push_back(std::move(l));
        }
      }
    }
    auto piece = std::make_unique<StepPiece>();
    piece->unit = r.order[r.next].first;
    piece->index = r.order[r.next].second;
    ++r.next;
    piece->begin = piece->index * piece_elems_;
    piece->n = std::min(piece_elems_, units_[piece->unit].elems - piece->begin);
    auto take = [&leases]() {
      StagingLease l = std::move(leases.back());
      leases.pop_back();
      return l;
    };
    std::vector<std::pair<int, StagingLease*>> reads;
    if (options_.params != Residence::kHost) piece->working = take();
    if (nvme_states) {
      piece->master = take();
      reads = {{kMaster, &piece->master}};
      // Note [Factored optimizers in the engine]: the moments kept.
      if (RoleKept(kExpAvg)) {
        piece->exp_avg = take();
        reads.emplace_back(kExpAvg, &piece->exp_avg);
      }
      if (RoleKept(kExpAvgSq)) {
        piece->exp_avg_sq = take();
        reads.emplace_back(kExpAvgSq, &piece->exp_avg_sq);
      }
    }
    if (grad_spill_) {
      piece->grad = take();
      if (grad_spill_->written(piece->unit, piece->index)) {
        reads.emplace_back(kGrad, &piece->grad);
      } else {
        std::memset(piece->grad.data(), 0, piece->n * 4);
      }
    }
    auto promise = std::make_shared<std::promise<Status>>();
    piece->read = promise->get_future();
    auto group = std::make_shared<Countdown>(
        reads.size(),
        [promise](Status st) { promise->set_value(std::move(st)); });
    for (const auto& [role, lease] : reads) {
      ReadPieceAsync(piece->unit, role, piece->index, lease->span(),
                     IoPriority::kUrgent,
                     [group](Status st) { group->Finish(st); });
    }
    r.ahead.push_back(std::move(piece));
  }
  return Status::Ok();
}

Status EngineImpl::UpdateAll(StepReads& r, const CpuStepArgs& sa,
                             std::vector<EarlyPiece>* undo) {
  std::vector<std::future<Status>> writes;
  Status first_error;
  while (first_error.ok()) {
    first_error = StartReads(r, /*wait=*/true);
    if (!first_error.ok() || r.ahead.empty()) break;
    std::unique_ptr<StepPiece> cur = std::move(r.ahead.front());
    r.ahead.pop_front();
    first_error = cur->read.get();
    if (first_error.ok()) first_error = UpdatePiece(*cur, sa, &writes, undo);
  }
  for (auto& w : writes) {
    Status st = w.get();
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  if (options_.params == Residence::kDevice) {
    Status st = device_->SynchronizeStream(*copy_stream_);
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  return first_error;
}

// Note [Data-parallel ranks]: after every update of the step (during
// backward or not), in unit and piece order, the same on every rank. Every
// shard has the same pieces, so piece p of rank r's shard starts at
// r * elems + p's begin. This rank's updated piece is read back from its
// device block, and the pieces are gathered in rounds of as many elements
// per rank as a staging buffer holds for all ranks.
Status EngineImpl::GatherParams() {
  const size_t ranks = static_cast<size_t>(options_.world_size);
  if (coll_->on_device()) {
    // Note [Collectives on device memory]: each rank's updated shard is in
    // its slot of the device block already; the rest is gathered around it.
    STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
    for (uint32_t u = 0; u < units_.size(); ++u) {
      const UnitState& s = units_[u];
      const std::vector<size_t> counts(ranks, s.elems * ElementSize(s.dtype));
      STRATA_RETURN_IF_ERROR(
          coll_->AllGatherInPlace(DevAt(s, 0), counts, CommType::kByte)
              .WithContext("engine: gathering the updated parameters of " +
                           UnitNames(u) + " (unit " + std::to_string(u) +
                           ") on the device"));
    }
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(StagingLease mine, staging_->Acquire());
  STRATA_ASSIGN_OR_RETURN(StagingLease all, staging_->Acquire());
  for (uint32_t u = 0; u < units_.size(); ++u) {
    const UnitState& s = units_[u];
    const size_t es = ElementSize(s.dtype);
    const uint64_t round = GatherRound(es, all.size());
    const CommType type = s.dtype == ElementType::kFloat16
                              ? CommType::kFloat16
                              : CommType::kBFloat16;
    for (uint64_t begin = 0; begin < s.elems; begin += piece_elems_) {
      const uint64_t n = std::min(piece_elems_, s.elems - begin);
      // Also waits for the last round's copies out of `all`.
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(
          *copy_stream_, mine.data(), DevAt(s, (s.shard_begin + begin) * es),
          n * es, CopyKind::kDeviceToHost));
      STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
      {
        MutexLock l(&mu_);
        d2h_bytes_ += n * es;
      }
      for (uint64_t c = 0; c < n; c += round) {
        const uint64_t k = std::min(round, n - c);
        if (c > 0) {
          STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
        }
        const std::vector<size_t> counts(ranks, k);
        STRATA_RETURN_IF_ERROR(
            coll_->AllGather(mine.data() + c * es, all.data(), counts, type)
                .WithContext("engine: gathering the updated parameters of " +
                             UnitNames(u) + " (unit " + std::to_string(u) +
                             ")"));
        for (size_t r = 0; r < ranks; ++r) {
          if (r == static_cast<size_t>(options_.rank)) continue;
          STRATA_RETURN_IF_ERROR(device_->CopyAsync(
              *copy_stream_, DevAt(s, (r * s.elems + begin + c) * es),
              all.data() + r * k * es, k * es, CopyKind::kHostToDevice));
        }
        MutexLock l(&mu_);
        h2d_bytes_ += (ranks - 1) * k * es;
      }
    }
  }
  return device_->SynchronizeStream(*copy_stream_);
}

// Note [Stage 3 over ranks]
// With zero_stage 3 and world_size N above 1, each rank keeps its shard of
// every unit's working copy too, on the host or on NVMe, so the model
// states per rank are 1/N; the device arena holds full units as a cache,
// as with one rank and parameters off the device.
// - A Fetch that finds its unit off the device (or a prefetch) gathers it:
//   every rank sends its shard, piece by piece, in rounds of as many
//   elements per rank as a staging buffer holds for all ranks, and copies
//   every rank's part of each round to the unit's device block (its own
//   too) while the next round is gathered. The pieces of a shard on NVMe
//   are read first, on the gatherer. On the host-emulated device, whose
//   memory is host memory, shards resting in host memory are gathered
//   straight into the device block in one all-gather (the copy after each
//   round would be a second memcpy of the unit on the same cores).
// - Collectives must match across ranks, so what is gathered, and in which
//   order, may depend only on the calls every rank makes (the same
//   Fetches, pins dropped in the same order), never on timing: the
//   gatherer, one thread with its own communicator (a duplicate of comm,
//   so that gradient reductions on the accumulator interleave freely), runs
//   the gathers in the order the fetches decided them, first in first out;
//   a victim still arriving is waited for instead of skipped; the device
//   arena places a unit only after the frees before it are reusable (so
//   where a block goes never depends on how far the streams have come),
//   takes a free range as it is, and compacts (then evicts) only once every
//   arrival has landed (an arriving block is pinned); the cached copies
//   dropped at a step or a load are dropped after every arrival; and
//   updates during backward (which make prefetches depend on when
//   gradients land) are refused. The trainer must fetch from one thread.
// - Each gather begins with an all-reduce (max) of (u, -u): ranks that
//   would gather different units find out there, before any data moves,
//   instead of mixing two units' shards. With the shard on NVMe, one more
//   all-reduce after the data says whether every rank read its pieces.
//   Either failure, or a collective's, fails the engine on every rank
//   (Note [Engine failures]): a retry on one rank would break the match.
// - The step updates the shard where it rests, as one rank does, and drops
//   the cached copies; checkpoints save and load the working copy's shard
//   like the master's (Note [Checkpoints over ranks]).
void EngineImpl::GatherArrival(uint32_t u) {
  Status st;
  {
    // Every rank failed at the same gather (its outcome was agreed), so
    // every rank skips the rest alike.
    MutexLock l(&mu_);
    st = FailedLocked("Fetch");
  }
  if (st.ok()) st = GatherUnit(u);
  if (st.ok()) st = device_->RecordEvent(*units_[u].ready, *copy_stream_);
  if (!st.ok()) {
    MutexLock l(&mu_);
    if (failed_.ok()) {
      failed_ = st;
      failed_reason_ =
          "a gather of parameter shards over the ranks failed, and the "
          "ranks' fetches would no longer match";
    }
  }
  FinishArrival(u, st, units_[u].param_bytes);
}

// Note [Stage 3 over ranks]: this rank's shard of unit u's working copy,
// resting on NVMe, piece by piece in order, the next piece read into the
// other of two staging buffers while the caller uses this one. A failed read
// still hands out its piece (a rank sends what it has, so that no rank waits
// for it; every rank drops it after the agreement) and is kept in error().
// Reads in flight end before the buffers go back, on every way out.
class EngineImpl::ShardPieces {
 public:
  ShardPieces(EngineImpl& engine, uint32_t unit) : e_(engine), u_(unit) {}
  ~ShardPieces() {
    for (std::future<Status>& f : reads_) {
      if (f.valid()) f.wait();
    }
  }
  ShardPieces(const ShardPieces&) = delete;
  ShardPieces& operator=(const ShardPieces&) = delete;

  Status Start() {
    for (StagingLease& b : bufs_) {
      STRATA_ASSIGN_OR_RETURN(b, e_.staging_->Acquire());
    }
    Read(0);
    return Status::Ok();
  }
  // Piece p (0, 1, ... in turn) once read; starts piece p + 1's read into
  // the buffer of piece p - 1, which the caller must be done with.
  const std::byte* Next(size_t p) {
    const Status st = reads_[p % 2].get();
    if (error_.ok()) error_ = st;
    if (p + 1 < e_.NumPieces(u_)) Read(p + 1);
    return bufs_[p % 2].data();
  }
  const Status& error() const { return error_; }

 private:
  void Read(size_t p) {
    reads_[p % 2] = e_.ReadPieceFuture(u_, kParam, p, bufs_[p % 2].span(),
                                       IoPriority::kUrgent);
  }

  EngineImpl& e_;
  const uint32_t u_;
  std::array<StagingLease, 2> bufs_;
  std::array<std::future<Status>, 2> reads_;
  Status error_;
};

Status EngineImpl::GatherUnit(uint32_t u) {
  const UnitState& s = units_[u];
  const std::string what = "engine: gathering the parameters of " +
                           UnitNames(u) + " (unit " + std::to_string(u) +
                           ") from the ranks' shards";
  {
    float head[2] = {static_cast<float>(u), -static_cast<float>(u)};
    STRATA_RETURN_IF_ERROR(
        gather_coll_
            ->AllReduce(head, head, 2, CommType::kFloat32, ReduceOp::kMax)
            .WithContext(what));
    if (head[0] != static_cast<float>(u) || -head[1] != static_cast<float>(u)) {
      return Status::Internal(
          what + ": the ranks fetch different units (units " +
          std::to_string(static_cast<int64_t>(-head[1])) + " to " +
          std::to_string(static_cast<int64_t>(head[0])) +
          " at once): every rank must make the same Fetch calls, from one "
          "thread, and drop its pins in the same order");
    }
  }
  const bool nvme = options_.params == Residence::kNvme;
  const size_t ranks = static_cast<size_t>(options_.world_size);
  const size_t es = ElementSize(s.dtype);
  const uint64_t unit_bytes = ranks * s.elems * es;
  if (gather_coll_->on_device()) return GatherUnitInPlace(u, what);
  if (device_->kind() == DeviceKind::kHostEmulated && !nvme &&
      (options_.allgather_bucket_bytes == 0 ||
       options_.allgather_bucket_bytes >= unit_bytes)) {
    // The host-emulated device's memory is host memory, and the shards at
    // rest are in host memory too: one all-gather straight into the device
    // block, as NCCL gathers into device memory on a GPU, with no staging
    // buffer and no copy after it. The copy stream's work first (a
    // compaction may have moved another block out of this range).
    STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
    const std::vector<size_t> counts(ranks, s.elems * es);
    return gather_coll_
        ->AllGather(HostAt(kParam, u, 0), DevAt(s, 0), counts, CommType::kByte)
        .WithContext(what);
  }
  // On NVMe the next piece is read while this one is gathered.
  ShardPieces shard(*this, u);
  if (nvme) STRATA_RETURN_IF_ERROR(shard.Start());
  const uint64_t round = std::min<uint64_t>(
      piece_elems_, GatherRound(es, staging_->buffer_bytes()));
  for (size_t p = 0; p < NumPieces(u); ++p) {
    const uint64_t begin = p * piece_elems_;
    const uint64_t n = std::min(piece_elems_, s.elems - begin);
    const std::byte* src = nvme ? shard.Next(p) : HostAt(kParam, u, begin);
    for (uint64_t c = 0; c < n; c += round) {
      const uint64_t k = std::min(round, n - c);
      // A buffer per round: the last round's copies to the device go on
      // while this one gathers.
      STRATA_ASSIGN_OR_RETURN(StagingLease all, staging_->Acquire());
      const std::vector<size_t> counts(ranks, k * es);
      STRATA_RETURN_IF_ERROR(
          gather_coll_
              ->AllGather(src + c * es, all.data(), counts, CommType::kByte)
              .WithContext(what));
      for (size_t r = 0; r < ranks; ++r) {
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(
            *copy_stream_, DevAt(s, (r * s.elems + begin + c) * es),
            all.data() + r * k * es, k * es, CopyKind::kHostToDevice));
      }
      STRATA_RETURN_IF_ERROR(all.RecordDone(*copy_stream_));
    }
  }
  if (!nvme) return Status::Ok();
  // Every rank learns whether every rank read its shard, and the first
  // failing rank's error.
  return AgreeOver(*gather_coll_, shard.error()).WithContext(what);
}

// Note [Collectives on device memory]: this rank's shard goes to its slot
// of the device block (read from NVMe a piece ahead), on the gatherer's
// stream, and the rest is gathered around it there.
Status EngineImpl::GatherUnitInPlace(uint32_t u, const std::string& what) {
  const UnitState& s = units_[u];
  const bool nvme = options_.params == Residence::kNvme;
  const size_t es = ElementSize(s.dtype);
  const size_t ranks = static_cast<size_t>(options_.world_size);
  STRATA_ASSIGN_OR_RETURN(Stream * stream, gather_coll_->stream());
  // The copy stream's work first (a compaction may have moved another block
  // out of this range).
  STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
  std::byte* slot =
      DevAt(s, static_cast<uint64_t>(options_.rank) * s.elems * es);
  ShardPieces shard(*this, u);
  if (!nvme) {
    STRATA_RETURN_IF_ERROR(
        device_->CopyAsync(*stream, slot, HostAt(kParam, u, 0), s.elems * es,
                           CopyKind::kHostToDevice));
  } else {
    STRATA_RETURN_IF_ERROR(shard.Start());
    for (size_t p = 0; p < NumPieces(u); ++p) {
      const uint64_t begin = p * piece_elems_;
      const uint64_t n = std::min(piece_elems_, s.elems - begin);
      // Piece p + 1 is read while p is copied; the copy is done before its
      // buffer is read into again.
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream, slot + begin * es,
                                                shard.Next(p), n * es,
                                                CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*stream));
    }
  }
  const std::vector<size_t> counts(ranks, s.elems * es);
  STRATA_RETURN_IF_ERROR(
      gather_coll_->AllGatherInPlace(DevAt(s, 0), counts, CommType::kByte)
          .WithContext(what));
  if (!nvme) return Status::Ok();
  return AgreeOver(*gather_coll_, shard.error()).WithContext(what);
}

Status EngineImpl::UpdatePiece(StepPiece& piece, const CpuStepArgs& sa,
                               std::vector<std::future<Status>>* writes,
                               std::vector<EarlyPiece>* undo) {
  const uint32_t u = piece.unit;
  UnitState& s = units_[u];
  const bool nvme_states = options_.optimizer_states == Residence::kNvme;
  CpuOptimizerTensors t;
  t.n = piece.n;
  t.grad = grad_spill_ ? static_cast<const void*>(piece.grad.data())
                       : HostAt(kGrad, u, piece.begin);
  t.grad_dtype = CpuDType::kFloat32;
  t.moment_dtype = MomentDType();
  t.working_dtype = ToCpu(s.dtype);
  if (nvme_states) {
    t.master = reinterpret_cast<float*>(piece.master.data());
    if (RoleKept(kExpAvg)) t.exp_avg = piece.exp_avg.data();
    if (RoleKept(kExpAvgSq)) t.exp_avg_sq = piece.exp_avg_sq.data();
  } else {
    t.master = reinterpret_cast<float*>(HostAt(kMaster, u, piece.begin));
    if (RoleKept(kExpAvg)) t.exp_avg = HostAt(kExpAvg, u, piece.begin);
    if (RoleKept(kExpAvgSq)) t.exp_avg_sq = HostAt(kExpAvgSq, u, piece.begin);
  }
  // Where this shard's piece starts in this rank's working copy: at
  // shard_begin when it covers the whole unit (0 with one rank).
  const uint64_t wbegin = WorkingBegin(s) + piece.begin;
  t.working = options_.params == Residence::kHost
                  ? static_cast<void*>(HostAt(kParam, u, wbegin))
                  : static_cast<void*>(piece.working.data());
  if (undo != nullptr) {
    EarlyPiece e;
    e.unit = u;
    e.index = piece.index;
    e.begin = piece.begin;
    e.n = piece.n;
    e.undo_offset = undo_used_;
    std::byte* d = undo_.data() + undo_used_;
    const uint64_t mb = RoleBytes(kMaster, s, t.n);
    const uint64_t sb = RoleBytes(kExpAvg, s, t.n);
    std::memcpy(d, t.master, mb);
    std::memcpy(d + mb, t.exp_avg, sb);
    std::memcpy(d + mb + sb, t.exp_avg_sq, sb);
    undo_used_ += UndoBytes(s, t.n);
    undo->push_back(e);
  }
  double seconds = 0;
  if (Factored()) {
    // Note [Factored optimizers in the engine]: tensor by tensor.
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(FactoredUpdate(u, piece.begin, t));
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  } else {
    STRATA_ASSIGN_OR_RETURN(CpuStepResult r, optimizer_->Step(t, sa));
    if (!r.applied)
      return Status::Internal("engine: update refused a checked gradient");
    seconds = r.check_seconds;
    for (int i = 0; i < r.passes; ++i) seconds += r.pass_seconds[i];
  }
  {
    MutexLock l(&mu_);
    update_seconds_ += seconds;
  }
  piece.grad.Reset();

  const size_t esize = ElementSize(s.dtype);
  const size_t wbytes = piece.n * esize;
  if (options_.params == Residence::kDevice) {
    STRATA_RETURN_IF_ERROR(device_->CopyAsync(
        *copy_stream_, DevAt(s, wbegin * esize), piece.working.data(), wbytes,
        CopyKind::kHostToDevice));
    STRATA_RETURN_IF_ERROR(piece.working.RecordDone(*copy_stream_));
    {
      MutexLock l(&mu_);
      h2d_bytes_ += wbytes;
    }
    piece.working.Reset();
  }
  if (!nvme_states && options_.params != Residence::kNvme) {
    return Status::Ok();
  }
  // Write-behind, in flight together; the buffers go back to the pool when
  // the last write is done.
  auto promise = std::make_shared<std::promise<Status>>();
  writes->push_back(promise->get_future());
  auto owned = std::make_shared<StepPiece>(std::move(piece));
  const bool nvme_params = options_.params == Residence::kNvme;
  std::vector<std::pair<int, std::span<const std::byte>>> out;
  if (nvme_states) {
    out.emplace_back(kMaster, owned->master.span());
    if (RoleKept(kExpAvg)) out.emplace_back(kExpAvg, owned->exp_avg.span());
    if (RoleKept(kExpAvgSq)) {
      out.emplace_back(kExpAvgSq, owned->exp_avg_sq.span());
    }
  }
  if (nvme_params) out.emplace_back(kParam, owned->working.span());
  const size_t count = out.size();
  auto group =
      std::make_shared<Countdown>(count, [owned, promise](Status st) mutable {
        owned.reset();  // leases back before the promise wakes the step
        promise->set_value(std::move(st));
      });
  for (const auto& [role, src] : out) {
    WritePieceAsync(owned->unit, role, owned->index, src,
                    IoPriority::kBackground,
                    [group](Status st) { group->Finish(st); });
  }
  return Status::Ok();
}

// ---- Updates during backward ------------------------------------------------

// Note [Updates during backward]
// After BeginStep, each tensor's next hand-over is its last before Step. The
// accumulator counts them per unit; once a unit's last gradients are all
// added, it posts the unit to the stepper (a Worker), which updates it as
// Step would, piece by piece through the same pipeline, while the trainer's
// backward goes on: on a GPU machine the CPU's update overlaps the GPU's
// backward. Step then updates only the units the stepper did not.
//
// What makes it safe:
// - Nothing else touches the unit meanwhile. Fetch refuses a tensor whose
//   last gradient was handed over; prefetch passes over a unit whose
//   tensors all were (its next use follows Step, which drops every cached
//   copy, so a copy made now would be wasted; and the rule depends on the
//   trainer's calls alone, as stage 3's gathers must); the
//   stepper waits for the unit's pins to drop and its arrivals to land, and
//   for in-flight copies of host parameters to end; a device-resident copy
//   is rewritten on the copy stream after the trainer's uses (the release
//   stream's). Stale cached device copies are dropped by Step, as always.
// - Bit-identical results: a piece is updated by the same call with the same
//   arguments (the step number is the next one's), and Step's norm and
//   overflow check add every piece's stats in the same order (an early
//   unit's taken before its update, from the same unchanged gradient).
// - Undo: a gradient that is not finite may arrive after some units were
//   updated, and then the whole step must be skipped. So before a piece is
//   updated early its master and moments are copied into the undo buffer
//   (step_overlap_bytes, allocated at Start; a unit that no longer fits is
//   left to Step); undoing puts them back where they rest and rewrites the
//   working copy from the old master (the working copy is always the
//   master's rounding). An error during an early update, or in Step before
//   the rest's update begins, is undone the same way, and the step fails
//   cleanly. The stepper stops updating once it has
//   seen a gradient that is not finite.
// - Clipping scales every update by the whole gradient's norm, known only
//   at the end, so BeginStep refuses max_grad_norm > 0. Gradients resting on
//   NVMe are read by the step itself (GradSpill's open pieces belong to the
//   accumulator), so with grads on NVMe nothing is updated early; Adafactor's
//   statistics pass runs on the accumulator instead (Note [Adafactor's
//   statistics during backward] in factored.cc).
//
// A unit that is not updated early (no undo buffer, step_overlap_bytes 0,
// or none left; Adafactor and SM3, whose updates wait for the whole
// gradient's statistics) still has its gradient's stats taken on the
// stepper (EarlyStatistics), kept in early_stats_ as an early update's are,
// and its state kEarlyStatistics: Step's norm and overflow check uses them,
// and Step reads that gradient once, for the update, where Step alone reads
// it twice. Adafactor's statistics pass over the unit's matrices runs there
// too (Note [Adafactor's statistics during backward] in factored.cc).
// Nothing changes, so nothing is undone, and the stats are the same calls
// over the same gradient: the same bits. Gradients on the host
// (EarlyStatisticsTaken); over ranks with zero_stage 2 and 3, each rank
// takes its shard's (Note [Data-parallel ranks]).

Status EngineImpl::BeginStep(const StepArgs& given) {
  MutexLock l(&mu_);
  STRATA_ASSIGN_OR_RETURN(const StepArgs args,
                          ResolveStepArgs(given, "BeginStep"));
  if (args.max_grad_norm > 0) {
    return Status::InvalidArgument(
        "engine: BeginStep needs max_grad_norm 0: clipping scales every "
        "update by the norm of the whole gradient, known only once the last "
        "gradient is in (clip with Step alone)");
  }
  if (!started_) {
    return Status::FailedPrecondition("engine: BeginStep before Start");
  }
  while (stepping_) step_cv_.Wait(&mu_);
  STRATA_RETURN_IF_ERROR(FailedLocked("BeginStep"));
  if (early_armed_) {
    return Status::FailedPrecondition(
        "engine: BeginStep called twice before a Step");
  }
  early_armed_ = true;
  early_args_ = args;
  std::fill(last_handed_.begin(), last_handed_.end(), 0);
  std::fill(last_chunks_.begin(), last_chunks_.end(), 0);
  for (uint32_t u = 0; u < units_.size(); ++u) {
    unit_waiting_[u] = static_cast<uint32_t>(layout_->unit(u).tensors.size());
  }
  std::fill(early_state_.begin(), early_state_.end(), kEarlyNone);
  early_overflow_ = false;
  early_error_ = Status::Ok();
  // The accumulator passes no chunk before this step's last hand-overs.
  std::fill(early_spilled_.begin(), early_spilled_.end(), kSpilledNone);
  early_rows_.Clear();
  return Status::Ok();
}

void EngineImpl::EndEarlyLocked() {
  early_armed_ = false;
  std::fill(early_state_.begin(), early_state_.end(), kEarlyNone);
  std::fill(early_spilled_.begin(), early_spilled_.end(), kSpilledNone);
  early_overflow_ = false;
  early_error_ = Status::Ok();
}

// On the stepper: a unit not updated early, its gradient's stats alone
// (and Adafactor's statistics pass).
void EngineImpl::EarlyStatistics(uint32_t u) {
  CpuStepArgs sa;
  {
    MutexLock l(&mu_);
    if (!early_armed_ || early_overflow_ || !early_error_.ok()) return;
    sa = EarlyArgsLocked();
  }
  bool finite = true;
  uint64_t passed = 0;
  Status st = EarlyGradStats(u, &finite);
  if (st.ok() && finite && Factored()) st = EarlyFactoredPasses(u, sa, &passed);
  MutexLock l(&mu_);
  EndEarlyWorkLocked(u, st, finite, kEarlyStatistics, &stats_.early_statistics);
  if (st.ok() && finite) stats_.early_passes += passed;
}

Status EngineImpl::EarlyGradStats(uint32_t u, bool* finite) {
  for (size_t p = 0; p < early_stats_[u].size(); ++p) {
    STRATA_ASSIGN_OR_RETURN(early_stats_[u][p], HostGradStats(u, p));
    if (!early_stats_[u][p].finite) {
      *finite = false;
      return Status::Ok();
    }
  }
  return Status::Ok();
}

void EngineImpl::EndEarlyWorkLocked(uint32_t u, const Status& st, bool finite,
                                    uint8_t done, uint64_t* count) {
  if (!st.ok()) {
    if (early_error_.ok()) early_error_ = st;
  } else if (!finite) {
    early_overflow_ = true;
    early_state_[u] = kEarlyNone;
  } else {
    early_state_[u] = done;
    ++*count;
  }
}

CpuStepArgs EngineImpl::EarlyArgsLocked() const {
  // As Step forms them for this step: max_grad_norm is 0.
  CpuStepArgs sa;
  sa.step = steps_ + 1;
  sa.lr = early_args_.lr;
  sa.inv_loss_scale = InvGradScale(early_args_.loss_scale);
  sa.clip_coef = 1.0;
  sa.check_overflow = false;  // checked by the stepper, and again by Step
  return sa;
}

bool EngineImpl::EarlyWorkLocked() const {
  return EarlyStatisticsTaken() || (!Factored() && !undo_.empty());
}

void EngineImpl::DrainStepper() {
  std::promise<void> drained;
  std::future<void> f = drained.get_future();
  stepper_->Post(Priority::kBackground, [&drained] { drained.set_value(); });
  f.wait();
}

Status EngineImpl::AfterConsumers() {
  if (options_.params != Residence::kDevice) return Status::Ok();
  MutexLock l(&mu_);  // as Unpin, which enqueues on the release stream
  STRATA_RETURN_IF_ERROR(device_->RecordEvent(*released_, *release_stream_));
  return device_->WaitEvent(*copy_stream_, *released_);
}

// On the stepper.
void EngineImpl::EarlyUpdate(uint32_t u) {
  uint64_t need = 0;
  for (uint64_t b = 0; b < units_[u].elems; b += piece_elems_) {
    need += UndoBytes(units_[u], std::min(piece_elems_, units_[u].elems - b));
  }
  if (undo_used_ + need > undo_.size()) {
    // Step updates it; its gradient's stats may be taken now.
    if (EarlyStatisticsTaken()) EarlyStatistics(u);
    return;
  }
  CpuStepArgs sa;
  {
    MutexLock l(&mu_);
    UnitState& s = units_[u];
    // Waits for the trainer's pins (Step, which drains the stepper, starts
    // only once every pin is dropped) and for arrivals in flight.
    while (early_armed_ && (s.pins > 0 || s.arriving || s.allocating)) {
      cv_.Wait(&mu_);
    }
    if (!early_armed_ || early_overflow_ || !early_error_.ok()) {
      return;  // Step updates it
    }
    early_state_[u] = kEarlyUpdating;
    sa = EarlyArgsLocked();
  }
  bool finite = true;
  Status st = EarlyUpdatePieces(u, sa, &finite);
  MutexLock l(&mu_);
  EndEarlyWorkLocked(u, st, finite, kEarlyUpdated, &stats_.early_units);
}

Status EngineImpl::EarlyUpdatePieces(uint32_t u, const CpuStepArgs& sa,
                                     bool* finite) {
  STRATA_RETURN_IF_ERROR(EarlyGradStats(u, finite));
  if (!*finite) return Status::Ok();
  if (options_.params == Residence::kHost) {
    // Fetches of other units may still be copying these parameters.
    STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*copy_stream_));
  }
  STRATA_RETURN_IF_ERROR(AfterConsumers());
  // Half the staging buffers at most, so that fetches still find some.
  const size_t half =
      staging_->count() / 2 / std::max<size_t>(1, StepBuffersPerPiece());
  std::unique_ptr<StepReads> reads = NewStepReads({u}, half);
  return UpdateAll(*reads, sa, &early_pieces_);
}

Status EngineImpl::UndoEarly() {
  if (early_pieces_.empty()) return Status::Ok();
  const bool nvme_states = options_.optimizer_states == Residence::kNvme;
  Status st;
  std::vector<uint32_t> units;
  for (const EarlyPiece& e : early_pieces_) {
    if (!st.ok()) break;
    UnitState& s = units_[e.unit];
    const std::byte* saved = undo_.data() + e.undo_offset;
    // Saved back to back, as UpdatePiece wrote them.
    const std::byte* next = saved;
    for (int role : {kMaster, kExpAvg, kExpAvgSq}) {
      if (!RoleKept(role)) continue;
      const uint64_t bytes = RoleBytes(role, s, e.n);
      const std::byte* src = next;
      next += bytes;
      if (!nvme_states) {
        std::memcpy(HostAt(role, e.unit, e.begin), src, bytes);
        continue;
      }
      StatusOr<StagingLease> lease = staging_->Acquire();
      st = lease.status();
      if (!st.ok()) break;
      std::memcpy(lease->data(), src, bytes);
      st = WritePiece(e.unit, role, e.index, lease->span());
      if (!st.ok()) break;
    }
    if (!st.ok()) break;
    // The working copy is the old master's rounding.
    const CpuDType wt = ToCpu(s.dtype);
    const size_t esize = ElementSize(s.dtype);
    if (options_.params == Residence::kHost) {
      st = ConvertCpuArray(saved, CpuDType::kFloat32,
                           HostAt(kParam, e.unit, WorkingBegin(s) + e.begin),
                           wt, e.n);
    } else {
      StatusOr<StagingLease> lease = staging_->Acquire();
      st = lease.status();
      if (st.ok()) {
        st = ConvertCpuArray(saved, CpuDType::kFloat32, lease->data(), wt, e.n);
      }
      if (st.ok() && options_.params == Residence::kNvme) {
        st = WritePiece(e.unit, kParam, e.index, lease->span());
      } else if (st.ok()) {
        st = device_->CopyAsync(
            *copy_stream_, DevAt(s, (WorkingBegin(s) + e.begin) * esize),
            lease->data(), e.n * esize, CopyKind::kHostToDevice);
        if (st.ok()) st = lease->RecordDone(*copy_stream_);
      }
    }
    if (units.empty() || units.back() != e.unit) units.push_back(e.unit);
  }
  if (st.ok() && options_.params == Residence::kDevice) {
    st = device_->SynchronizeStream(*copy_stream_);
  }
  early_pieces_.clear();
  undo_used_ = 0;
  MutexLock l(&mu_);
  stats_.early_undone += units.size();
  if (!st.ok()) failed_ = st;  // Note [Engine failures]
  return st;
}

// ---- Stats
// ---------------------------------------------------------------------

void EngineImpl::UpdateTierStatsLocked() {
  stats_.device.resident_bytes = device_used_;
  stats_.device.peak_bytes =
      std::max(stats_.device.peak_bytes, stats_.device.resident_bytes);
  uint64_t host = 0;
  for (const HostBuffer& b : host_) host += b.size();
  stats_.host.resident_bytes = host;
  stats_.host.peak_bytes = std::max(stats_.host.peak_bytes, host);
  if (swap_) {
    const uint64_t used = (swap_->capacity_blocks() - swap_->free_blocks()) *
                          swap_->block_bytes();
    stats_.nvme.resident_bytes = used;
    stats_.nvme.peak_bytes = std::max(stats_.nvme.peak_bytes, used);
  }
}

double EngineImpl::LossScale() const {
  MutexLock l(&mu_);
  return loss_scaler_.scale();
}

EngineStats EngineImpl::stats() const {
  MutexLock l(&mu_);
  EngineStats s = stats_;
  if (started_steps_) {
    s.hot_path_allocations =
        counting_device_.count() - allocations_after_first_step_;
  }
  s.nvme_read_bytes = nvme_read_bytes_;
  s.nvme_write_bytes = nvme_write_bytes_;
  s.h2d_bytes = h2d_bytes_;
  s.d2h_bytes = d2h_bytes_;
  s.order_changes = trace_ ? trace_->order_changes() : 0;
  s.loss_scale = loss_scaler_.scale();
  if (arena_) {
    const DeviceArenaStats a = arena_->stats();
    s.fragmentation = a.planner.fragmentation;
    s.compactions = a.planner.compactions;
  }
  return s;
}

}  // namespace strata::memtier

namespace strata {

// ---- ParamPin ---------------------------------------------------------------

ParamPin::ParamPin(ParamPin&& o) noexcept
    : engine_(std::exchange(o.engine_, nullptr)),
      unit_(o.unit_),
      consumers_(std::move(o.consumers_)),
      data_(o.data_),
      bytes_(o.bytes_),
      dtype_(o.dtype_) {}

ParamPin& ParamPin::operator=(ParamPin&& o) noexcept {
  if (this != &o) {
    Reset();
    engine_ = std::exchange(o.engine_, nullptr);
    unit_ = o.unit_;
    consumers_ = std::move(o.consumers_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    dtype_ = o.dtype_;
  }
  return *this;
}

ParamPin::~ParamPin() { Reset(); }

void ParamPin::Reset() {
  if (engine_ != nullptr) {
    std::exchange(engine_, nullptr)->Unpin(unit_, consumers_);
    consumers_.clear();
  }
}

Status ParamPin::WaitOn(Stream& consumer) {
  if (engine_ == nullptr) return Status::FailedPrecondition("empty ParamPin");
  STRATA_RETURN_IF_ERROR(engine_->WaitArrival(unit_, &consumer));
  if (std::find(consumers_.begin(), consumers_.end(), &consumer) ==
      consumers_.end()) {
    consumers_.push_back(&consumer);
  }
  return Status::Ok();
}

Status ParamPin::Wait() {
  if (engine_ == nullptr) return Status::FailedPrecondition("empty ParamPin");
  return engine_->WaitArrival(unit_, nullptr);
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                 Device* device) {
  if (device == nullptr) return Status::InvalidArgument("engine: no device");
  STRATA_RETURN_IF_ERROR(ValidateEngineOptions(options));
  STRATA_RETURN_IF_ERROR(memtier::EngineImpl::CheckOptions(options, *device));
  return std::unique_ptr<Engine>(new memtier::EngineImpl(options, device));
}

std::string EngineStatsJson(const EngineStats& s) {
  auto tier = [](const TierStats& t) {
    return nlohmann::json{{"resident_bytes", t.resident_bytes},
                          {"peak_bytes", t.peak_bytes}};
  };
  nlohmann::json j = {{"device", tier(s.device)},
                      {"host", tier(s.host)},
                      {"nvme", tier(s.nvme)},
                      {"pinned_host_bytes", s.pinned_host_bytes},
                      {"staging_bytes", s.staging_bytes},
                      {"optimizer_state_bytes", s.optimizer_state_bytes},
                      {"grad_bytes", s.grad_bytes},
                      {"nvme_read_bytes", s.nvme_read_bytes},
                      {"nvme_write_bytes", s.nvme_write_bytes},
                      {"h2d_bytes", s.h2d_bytes},
                      {"d2h_bytes", s.d2h_bytes},
                      {"fetches", s.fetches},
                      {"fetch_hits", s.fetch_hits},
                      {"prefetches", s.prefetches},
                      {"prefetch_hits", s.prefetch_hits},
                      {"stall_seconds", s.stall_seconds},
                      {"evictions", s.evictions},
                      {"order_changes", s.order_changes},
                      {"steps", s.steps},
                      {"skipped_steps", s.skipped_steps},
                      {"loss_scale", s.loss_scale},
                      {"early_units", s.early_units},
                      {"early_undone", s.early_undone},
                      {"early_statistics", s.early_statistics},
                      {"early_passes", s.early_passes},
                      {"step_seconds", s.step_seconds},
                      {"update_seconds", s.update_seconds},
                      {"hot_path_allocations", s.hot_path_allocations},
                      {"fragmentation", s.fragmentation},
                      {"compactions", s.compactions}};
  return j.dump();
}

}  // namespace strata
