// Saving and loading the engine's state through a checkpoint
// (include/strata/checkpoint.h).
//
// Note [Streaming the state]
// A save or a load takes the engine as a Step does (stepping_: Fetch and
// AddGrad wait, a Step is refused), once every arrival has landed, and moves
// each role of each piece of each unit between where it rests and the
// checkpoint, one staging-buffer-sized extent at a time:
//   - save: a role resting on the host is written straight from the host
//     array when the piece is aligned there, else copied into a staging
//     buffer; one on NVMe is read into a staging buffer and, from the read's
//     completion, written to the checkpoint; one on the device is copied to
//     a staging buffer. Reads and writes of many pieces are in flight at once,
//     as many as the staging buffers allow; a buffer goes back when its
//     extent is written.
//   - load: each piece is filled from the checkpoint by its tensors'
//     placements (so the checkpoint's extents need not match this engine's
//     pieces: another partition size, another tier placement or, with the
//     collectives, another rank count), then stored where the role rests;
//     two loaders take pieces in turn (a checkpoint read blocks), and NVMe
//     writes stay in flight while the next pieces are read. Without a
//     stored working copy the master is rounded to the working dtype in the
//     same pass.
// The extents carry what the piece holds between and after tensors (zeros:
// alignment gaps are never given a gradient), padded with zeros to the
// checkpoint's alignment, so a piece is written without reshaping it.
//
// Note [Moment formats in checkpoints]
// A checkpoint's moment roles are fp32 (StateRoleType): an extent of a
// moment has 4 bytes per element. The engine's moment format
// (optimizer.moment_dtype, Note [Moment formats] in engine.cc) is recorded
// in the blob strata.engine ("moment_dtype") and the moments are saved so:
//   - fp32: as they rest.
//   - bf16: widened to fp32 (exact). A load rounds them back, so a bf16
//     checkpoint continues bit for bit, loads into any layout like fp32,
//     and fp32 and bf16 checkpoints load into engines of either format.
//   - int8: each element's 8-bit code in its own fp32 slot (a
//     little-endian uint32, 0..255), so that the extents' placements carry
//     them like any element; the block scales, one fp32 per
//     kCpuBlock8Elems of a piece, in piece order, in the blobs
//     strata.engine.scales.exp_avg and .exp_avg_sq (4 bytes per 2048
//     elements: the one part gathered in RAM). Alignment gaps hold code 0
//     (their gradients and masters are zero, so are their moments), which
//     is why a load may leave their slots unread. A code means something
//     only with its block's scale, and the blocks are the saving engine's
//     pieces, so such a checkpoint loads only into an engine whose pieces
//     are the same (same tensors in the same order, partition_bytes and
//     piece size), and int8 and the other formats refuse each other.
// The checkpoint module's element types cannot say "bf16 moment" or "8-bit
// block", hence fp32 slots; the bytes on disk are therefore those of fp32
// moments for every format (the NVMe tier is where the formats save).
#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "memtier/engine_impl.h"
#include "util/log.h"

namespace strata::memtier {
namespace {

// The engine's roles a checkpoint stores, and their checkpoint names.
struct SavedRole {
  int role;
  StateRole state;
};
constexpr SavedRole kSaved[] = {{kMaster, StateRole::kMaster},
                                {kExpAvg, StateRole::kExpAvg},
                                {kExpAvgSq, StateRole::kExpAvgSq},
                                {kParam, StateRole::kParam}};

StateRole StateOf(int role) {
  for (const SavedRole& s : kSaved) {
    if (s.role == role) return s.state;
  }
  return StateRole::kMaster;
}

constexpr const char* kEngineBlob = "strata.engine";
// Note [Factored optimizers in the engine]: Adafactor's and SM3's
// statistics.
constexpr const char* kFactoredBlob = "strata.engine.factored";

// Note [Moment formats in checkpoints]: the blob of a role's int8 scales.
std::string ScalesBlob(int role) {
  return std::string(kEngineBlob) + ".scales." +
         std::string(StateRoleName(StateOf(role)));
}

uint64_t Blocks(uint64_t n) {
  return (n + kCpuBlock8Elems - 1) / kCpuBlock8Elems;
}

// A kBlock8 array of n elements (Note [Moment formats in checkpoints]) in
// place as n fp32-sized slots, each holding its element's code as a
// little-endian uint32 (from the last down, so that no code is overwritten
// before it is read); its scales are appended to `scales` first.
void Block8ToSlots(std::byte* p, uint64_t n, std::vector<float>* scales) {
  const size_t at = scales->size();
  scales->resize(at + Blocks(n));
  std::memcpy(scales->data() + at, p + RoundUp(n, 4), Blocks(n) * 4);
  for (uint64_t i = n; i-- > 0;) {
    const uint32_t code = static_cast<uint8_t>(p[i]);
    std::memcpy(p + i * 4, &code, 4);
  }
}

// The inverse, with the array's `scales`; false when a slot holds no code.
bool SlotsToBlock8(std::byte* p, uint64_t n, const float* scales) {
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t code;
    std::memcpy(&code, p + i * 4, 4);
    if (code > 255) return false;
    p[i] = static_cast<std::byte>(code);
  }
  std::memset(p + n, 0, RoundUp(n, 4) - n);
  std::memcpy(p + RoundUp(n, 4), scales, Blocks(n) * 4);
  return true;
}

// Widens n bf16 values at `p` to fp32 in place (exact: a bf16 is the upper
// half of a fp32), from the last element down so that no value is
// overwritten before it is read.
void WidenBf16InPlace(std::byte* p, uint64_t n) {
  for (uint64_t i = n; i-- > 0;) {
    uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    const uint32_t w = uint32_t{h} << 16;
    std::memcpy(p + i * 4, &w, 4);
  }
}

}  // namespace

Status EngineImpl::BeginExclusive(const char* what, bool load) {
  if (!started_) {
    return Status::FailedPrecondition(std::string("engine: ") + what +
                                      " before Start");
  }
  {
    MutexLock l(&mu_);
    if (stepping_) {
      return Status::FailedPrecondition(std::string("engine: ") + what +
                                        " while a Step runs");
    }
    STRATA_RETURN_IF_ERROR(FailedLocked(what));
    if (early_armed_) {
      return Status::FailedPrecondition(
          std::string("engine: ") + what +
          " between BeginStep and its Step (updates may be under way)");
    }
    if (load) {
      for (const UnitState& s : units_) {
        if (s.pins > 0) {
          return Status::FailedPrecondition(
              "engine: LoadState with parameters still pinned; drop every "
              "ParamPin first");
        }
      }
      bool handed = grads_pending_ > 0;
      for (uint32_t c : grad_count_) handed = handed || c > 0;
      if (handed) {
        return Status::FailedPrecondition(
            "engine: LoadState after gradients were handed over for the next "
            "Step; load between a Step and the next AddGrad");
      }
    }
    stepping_ = true;
  }
  // Fetches the mover started may still be reading pieces this rewrites or
  // reads; the mover is idle afterwards (fetches wait for stepping_).
  Status st = RunOnMover([] { return Status::Ok(); });
  {
    MutexLock l(&mu_);
    for (const UnitState& s : units_) {
      while (s.arriving) cv_.Wait(&mu_);
    }
  }
  // Copies from the host to the device must be done before a load rewrites
  // their sources, and the trainer's uses of device-resident parameters
  // before it rewrites those.
  if (st.ok() && load) st = AfterConsumers();
  if (st.ok()) st = device_->SynchronizeStream(*copy_stream_);
  if (!st.ok()) EndExclusive();
  return st;
}

void EngineImpl::EndExclusive() {
  {
    MutexLock l(&mu_);
    stepping_ = false;
    UpdateTierStatsLocked();
  }
  step_cv_.SignalAll();
}

std::vector<StatePlacement> EngineImpl::PlacementsOf(
    uint32_t u, uint64_t begin, uint64_t n,
    const std::vector<uint32_t>& index) const {
  // Unit coordinates of the piece: the shard starts at shard_begin.
  return PlacementsInUnit(u, layout_->unit(u).shard_begin + begin, n, index);
}

std::vector<StatePlacement> EngineImpl::PlacementsInUnit(
    uint32_t u, uint64_t lo, uint64_t n,
    const std::vector<uint32_t>& index) const {
  std::vector<StatePlacement> out;
  const UnitInfo& info = layout_->unit(u);
  const uint64_t hi = lo + n;
  for (uint32_t id : info.tensors) {
    const TensorPlace& t = layout_->tensor(id);
    const uint64_t b = std::max(lo, t.offset);
    const uint64_t e = std::min(hi, t.offset + t.elems);
    if (b >= e) continue;
    StatePlacement p;
    p.tensor = index.empty() ? id : index[id];
    p.tensor_offset = b - t.offset;
    p.extent_offset = b - lo;
    p.elems = e - b;
    out.push_back(p);
  }
  return out;
}

// ---- Save ------------------------------------------------------------------

Status EngineImpl::DeclareTensors(CheckpointWriter& writer) {
  for (size_t i = 0; i < specs_.size(); ++i) {
    CheckpointTensor t;
    t.name = specs_[i].name;
    t.shape = specs_[i].shape;
    t.dtype = specs_[i].dtype;
    STRATA_ASSIGN_OR_RETURN(uint32_t index, writer.AddTensor(t));
    if (index != i) {
      return Status::Internal("engine: the checkpoint writer numbered tensor " +
                              t.name + " " + std::to_string(index) + ", not " +
                              std::to_string(i) +
                              " (was it given tensors before SaveState?)");
    }
  }
  return Status::Ok();
}

Status EngineImpl::CopyOut(int r, uint32_t u, uint64_t begin, size_t bytes,
                           std::byte* buf) {
  if (RoleResidence(r) == Residence::kHost) {
    std::memcpy(buf, HostAt(r, u, begin), bytes);
    return Status::Ok();
  }
  UnitState& s = units_[u];
  STRATA_RETURN_IF_ERROR(device_->CopyAsync(*copy_stream_, buf,
                                            DevAt(s, RoleOffset(r, s, begin)),
                                            bytes, CopyKind::kDeviceToHost));
  return device_->SynchronizeStream(*copy_stream_);
}

size_t EngineImpl::ToExtentPayload(int r, std::byte* buf, uint64_t n,
                                   size_t raw,
                                   std::vector<float>* scales) const {
  if (!IsMoment(r)) return raw;
  if (MomentDType() == CpuDType::kBFloat16) {
    WidenBf16InPlace(buf, n);
  } else if (MomentDType() == CpuDType::kBlock8) {
    Block8ToSlots(buf, n, scales);
  }
  return n * 4;
}

Status EngineImpl::WriteStaged(CheckpointWriter& writer, StateRole state,
                               std::shared_ptr<StagingLease> lease,
                               size_t bytes, std::vector<StatePlacement> places,
                               Inflight& writes) {
  std::byte* buf = lease->data();
  const size_t padded = RoundUp(bytes, kCheckpointAlign);
  std::memset(buf + bytes, 0, padded - bytes);
  writes.Add();
  Status st =
      writer.WriteExtent(state, {buf, padded}, std::move(places),
                         [&writes, lease](Status done) mutable {
                           lease.reset();  // back before the count drops
                           writes.Finish(done);
                         });
  if (!st.ok()) writes.Finish(st);
  return st;
}

Status EngineImpl::PutScales(CheckpointWriter& writer, int r,
                             const std::vector<float>& scales) {
  if (!IsMoment(r) || MomentDType() != CpuDType::kBlock8) return Status::Ok();
  return writer.PutBlob(
      ScalesBlob(r),
      {reinterpret_cast<const char*>(scales.data()), scales.size() * 4});
}

Status EngineImpl::SaveRole(CheckpointWriter& writer, int r, Inflight& writes) {
  const StateRole state = StateOf(r);
  const Residence where = RoleResidence(r);
  // A piece whose bytes are in, or arriving in (`arrived`: NVMe reads), a
  // staging buffer.
  // `raw` is what the role holds of it (Note [Moment formats in
  // checkpoints]: a moment's extent holds n fp32 slots instead).
  struct Ready {
    std::shared_ptr<StagingLease> lease;
    uint64_t n = 0;
    size_t raw = 0;
    std::vector<StatePlacement> places;
    std::future<Status> arrived;
  };
  // Hands a piece to the writer on this thread (the writer checksums it,
  // which must not hold up the I/O completion thread); the buffer goes back
  // when the write is done.
  // Note [Moment formats in checkpoints]: int8 moments' scales, in piece
  // order (pieces are emitted in order, on this thread).
  std::vector<float> scales;
  auto emit = [&](Ready& p, Status st) -> Status {
    if (!st.ok()) {
      writes.Add();
      writes.Finish(st);
      return st;
    }
    const size_t bytes =
        ToExtentPayload(r, p.lease->data(), p.n, p.raw, &scales);
    return WriteStaged(writer, state, p.lease, bytes, std::move(p.places),
                       writes);
  };
  // NVMe reads in flight, at most half the buffers: the rest carry writes.
  const size_t depth = std::max<size_t>(1, staging_->count() / 2);
  std::deque<Ready> reading;
  Status st;
  // A role saved as it rests (not a bf16 or int8 moment).
  const bool as_is = !IsMoment(r) || MomentDType() == CpuDType::kFloat32;
  for (uint32_t u = 0; u < units_.size() && st.ok(); ++u) {
    UnitState& s = units_[u];
    for (size_t p = 0; p < NumPieces(u) && st.ok(); ++p) {
      const uint64_t begin = p * piece_elems_;
      const uint64_t n = std::min(piece_elems_, s.elems - begin);
      Ready piece;
      piece.n = n;
      piece.raw = RoleBytes(r, s, n);
      piece.places = PlacementsOf(u, begin, n, {});
      if (where == Residence::kHost && as_is) {
        // As it rests, the payload is the role's bytes.
        std::byte* src = HostAt(r, u, begin);
        const size_t padded = RoundUp(piece.raw, kCheckpointAlign);
        const bool aligned =
            reinterpret_cast<uintptr_t>(src) % kCheckpointAlign == 0 &&
            RoleOffset(r, s, begin) + padded <= HostBlockBytes(r, s);
        if (aligned) {  // straight from the host array
          writes.Add();
          st =
              writer.WriteExtent(state, {src, padded}, std::move(piece.places),
                                 [&writes](Status wst) { writes.Finish(wst); });
          if (!st.ok()) writes.Finish(st);
          continue;
        }
      }
      if (reading.size() >= depth) {
        st = emit(reading.front(), reading.front().arrived.get());
        reading.pop_front();
        if (!st.ok()) break;
      }
      StatusOr<StagingLease> acquired = staging_->Acquire();
      if (!acquired.ok()) {
        st = acquired.status();
        break;
      }
      piece.lease = std::make_shared<StagingLease>(std::move(*acquired));
      std::byte* buf = piece.lease->data();
      if (where == Residence::kNvme) {
        piece.arrived =
            ReadPieceFuture(u, r, p, piece.lease->span(), IoPriority::kUrgent);
        reading.push_back(std::move(piece));
        continue;
      }
      st = emit(piece, CopyOut(r, u, begin, piece.raw, buf));
    }
  }
  // The reads still in flight end before their buffers go back.
  for (Ready& p : reading) {
    if (st.ok()) {
      st = emit(p, p.arrived.get());
    } else {
      p.arrived.wait();
    }
  }
  if (st.ok()) st = PutScales(writer, r, scales);
  return st;
}

Status EngineImpl::SaveState(CheckpointWriter& writer, bool params) {
  if (MultiRank()) return SaveStateRanked(&writer, params);
  STRATA_RETURN_IF_ERROR(BeginExclusive("SaveState", /*load=*/false));
  Status st = DeclareTensors(writer);
  Inflight writes;
  for (const SavedRole& role : kSaved) {
    if (!st.ok()) break;
    if (role.role == kParam && !params) continue;
    if (!RoleKept(role.role)) continue;
    st = SaveRole(writer, role.role, writes);
  }
  // Every submitted extent ends before the buffers and the writer may go.
  Status written = writes.Wait();
  if (st.ok()) st = written;
  if (st.ok()) st = writer.PutBlob(kEngineBlob, EngineBlobJson());
  if (st.ok() && Factored()) st = writer.PutBlob(kFactoredBlob, FactoredBlob());
  EndExclusive();
  return st.ok() ? st : st.WithContext("engine: SaveState");
}

std::string EngineImpl::EngineBlobJson() const {
  const CpuOptimizerOptions& o = options_.optimizer.cpu;
  nlohmann::json j;
  {
    MutexLock l(&mu_);
    j["step"] = steps_;
    j["loss_scale"] = nlohmann::json::parse(loss_scaler_.Save());
  }
  j["optimizer"] = {{"type", std::string(CpuOptimizerAlgoName(o.algo))},
                    {"betas", {o.beta1, o.beta2}},
                    {"eps", o.eps},
                    {"weight_decay", o.weight_decay},
                    {"bias_correction", o.bias_correction}};
  if (o.algo == CpuOptimizerAlgo::kAdafactor) {
    j["optimizer"]["adafactor"] =
        nlohmann::json::parse(CpuAdafactorParamsJson(o.adafactor));
  }
  j["partition_bytes"] = options_.partition_bytes;
  j["world_size"] = options_.world_size;
  j["moment_dtype"] = std::string(MomentDTypeName(MomentDType()));
  j["piece_elems"] = piece_elems_;
  return j.dump();
}

// ---- Several ranks ---------------------------------------------------------

// Note [Checkpoints over ranks]
// A checkpoint saved over N ranks is one a single engine could have saved:
// the same roles, full tensors by name and global shape, the same blob (its
// "world_size" says N), so it loads at any world size with no conversion.
// - Save: a collective. Rank 0 alone has a CheckpointWriter. For each role
//   of master and moments, unit by unit, each rank's shard in rank order,
//   piece by piece: the shard's owner reads the piece where it rests into a
//   staging buffer and broadcasts it (rank 0's own pieces move on no
//   collective), and rank 0 converts it as one rank does (Note [Moment
//   formats in checkpoints]) and writes it as an extent, its placements
//   those of that rank's shard; pieces that hold only a unit's padding (a
//   last shard) are not written. So rank 0 holds a few staging buffers of
//   the state at a time, never the whole state. The working copy (with
//   `params`) is whole on every rank with zero_stage 1 and 2: rank 0 writes
//   its own; with zero_stage 3 it is sharded and moves like the master.
// - Errors: a rank that fails (a read, a write, a refused call) keeps its
//   first error and goes on with the collectives, doing nothing else, so
//   that no rank waits for another forever; at the end the ranks agree on
//   the outcome (Agree: every rank's status all-gathered, the lowest
//   failing rank's message broadcast), so every rank returns the same
//   Status. CommitState commits on rank 0 and agrees likewise: a commit
//   that fails leaves nothing published (the writer removes its temporary
//   directory), and every rank says so.
// - Before a save the ranks check that their step counts, loss scales and
//   optimizer settings are equal (a hash of the blob all-gathered); before
//   a load, that every rank opened the same checkpoint (its step and blob).
// - Load: every rank reads, by placements, only its shard's elements of
//   master and moments (another world size cuts other ranges from the same
//   extents), and the working copy, whole (zero_stage 1 and 2) or its
//   shard (3): the stored one, or the master rounded. No collective moves
//   data.
// - int8 moments: their blocks are the saving ranks' shards' pieces, the
//   scales in the blob unit by unit, shard by shard, piece by piece; they
//   load only at the same world_size (and layout), else kInvalidArgument
//   naming both layouts. fp32 and bf16 moments load at any world size.

Status EngineImpl::AgreeOver(RankCollectives& coll, const Status& local) {
  // Each rank's code, errno and message length; then the lowest failing
  // rank's message.
  struct Head {
    int32_t code = 0;
    int32_t sys_errno = 0;
    uint32_t len = 0;
    uint32_t pad = 0;
  };
  constexpr size_t kMaxMessage = 16 << 10;
  const std::string_view msg =
      local.message().substr(0, std::min(local.message().size(), kMaxMessage));
  Head mine;
  mine.code = static_cast<int32_t>(local.code());
  mine.sys_errno = local.sys_errno();
  mine.len = static_cast<uint32_t>(msg.size());
  const size_t ranks = static_cast<size_t>(options_.world_size);
  std::vector<Head> all(ranks);
  const std::vector<size_t> counts(ranks, sizeof(Head));
  auto failed = [](const Status& st) {
    return st.WithContext(
        "engine: agreeing on an outcome over the ranks (the communicator "
        "failed)");
  };
  if (Status st = coll.AllGather(&mine, all.data(), counts, CommType::kByte);
      !st.ok()) {
    return failed(st);
  }
  size_t root = 0;
  while (root < ranks && all[root].code == 0) ++root;
  if (root == ranks) return Status::Ok();
  std::string text(all[root].len, '\0');
  if (root == static_cast<size_t>(options_.rank)) {
    std::memcpy(text.data(), msg.data(), msg.size());
  }
  if (!text.empty()) {
    if (Status st = coll.Broadcast(text.data(), text.size(), CommType::kByte,
                                   static_cast<int>(root));
        !st.ok()) {
      return failed(st);
    }
  }
  return Status(static_cast<StatusCode>(all[root].code),
                "rank " + std::to_string(root) + ": " + text,
                all[root].sys_errno);
}

Status EngineImpl::Agree(const Status& local) {
  if (!MultiRank()) return local;
  // Before Start nothing else runs on the communicator.
  if (started_) WaitGradsQuiet();
  return AgreeNow(local);
}

Status EngineImpl::AgreeSame(const std::string& what, const std::string& mine) {
  const size_t ranks = static_cast<size_t>(options_.world_size);
  const uint64_t h = std::hash<std::string>{}(mine);
  std::vector<uint64_t> all(ranks);
  const std::vector<size_t> counts(ranks, sizeof(uint64_t));
  STRATA_RETURN_IF_ERROR(
      coll_->AllGather(&h, all.data(), counts, CommType::kByte)
          .WithContext("engine: comparing " + what + " over the ranks"));
  for (size_t r = 1; r < ranks; ++r) {
    if (all[r] != all[0]) {
      return Status::InvalidArgument(
          "engine: " + what + " differs between rank 0 and rank " +
          std::to_string(r) + "; every rank must have the same");
    }
  }
  return Status::Ok();
}

Status EngineImpl::SaveState(CheckpointWriter* writer, bool params) {
  if (MultiRank()) return SaveStateRanked(writer, params);
  if (writer == nullptr) {
    return Status::InvalidArgument(
        "engine: SaveState with a null writer (world_size 1: the one rank "
        "writes)");
  }
  return SaveState(*writer, params);
}

StatusOr<std::string> EngineImpl::CommitState(CheckpointWriter* writer) {
  if (!MultiRank()) {
    if (writer == nullptr) {
      return Status::InvalidArgument(
          "engine: CommitState with a null writer (world_size 1: the one "
          "rank commits)");
    }
    return writer->Commit();
  }
  const bool writes = options_.rank == 0;
  Status local;
  std::string path;
  if (writes != (writer != nullptr)) {
    local = Status::InvalidArgument(
        "engine: CommitState on rank " + std::to_string(options_.rank) +
        (writes ? " (the writer rank) without a writer"
                : " with a writer: rank 0 alone commits; pass null"));
  } else if (writes) {
    StatusOr<std::string> committed = writer->Commit();
    if (committed.ok()) {
      path = *committed;
    } else {
      local = committed.status();
    }
  }
  STRATA_RETURN_IF_ERROR(Agree(local));
  // Every rank learns the path.
  uint64_t len = path.size();
  STRATA_RETURN_IF_ERROR(coll_->Broadcast(&len, 8, CommType::kByte, 0));
  path.resize(len);
  if (len > 0) {
    STRATA_RETURN_IF_ERROR(
        coll_->Broadcast(path.data(), len, CommType::kByte, 0));
  }
  return path;
}

Status EngineImpl::SaveStateRanked(CheckpointWriter* writer, bool params) {
  const bool writes = options_.rank == 0;
  Status local;
  if (writes && writer == nullptr) {
    local = Status::FailedPrecondition(
        "engine: SaveState on rank 0, the writer rank, without a checkpoint "
        "writer (did CheckpointWriter::Begin fail there?)");
  } else if (!writes && writer != nullptr) {
    local = Status::InvalidArgument(
        "engine: SaveState on rank " + std::to_string(options_.rank) +
        " with a checkpoint writer: rank 0 alone writes; pass null on the "
        "other ranks");
  }
  // A bucket the accumulator reduces would interleave its collective with
  // the save's.
  WaitGradsQuiet();
  bool began = false;
  if (local.ok()) {
    local = BeginExclusive("SaveState", /*load=*/false);
    began = local.ok();
  }
  Status st = AgreeNow(local);
  if (st.ok()) {
    // With sharded parameters `params` adds a role of collectives.
    st = AgreeSame(
        "the step count, loss scale, optimizer settings or params argument",
        EngineBlobJson() + (params && ShardedParams() ? "+params" : ""));
  }
  if (!st.ok()) {
    if (began) EndExclusive();
    return st.WithContext("engine: SaveState");
  }
  if (writes && local.ok()) local = DeclareTensors(*writer);
  Inflight written;
  for (int r : {kMaster, kExpAvg, kExpAvgSq, kParam}) {
    if (r == kParam && !(params && ShardedParams())) continue;
    if (!RoleKept(r)) continue;
    st = SaveRoleRanked(writer, r, written, local);
    if (!st.ok()) break;
  }
  // A vector's statistics from the ranks that hold its elements.
  if (st.ok()) st = GatherFactoredVectors();
  if (st.ok() && writes && params && WholeParams() && local.ok()) {
    local = SaveWholeParams(*writer, written);
  }
  const Status w = written.Wait();
  if (local.ok()) local = w;
  if (writes && local.ok())
    local = writer->PutBlob(kEngineBlob, EngineBlobJson());
  if (writes && local.ok() && Factored()) {
    local = writer->PutBlob(kFactoredBlob, FactoredBlob());
  }
  EndExclusive();
  // A collective that failed broke the communicator: every rank sees it.
  if (st.ok()) st = AgreeNow(local);
  return st.ok() ? st : st.WithContext("engine: SaveState");
}

Status EngineImpl::SaveRoleRanked(CheckpointWriter* writer, int r,
                                  Inflight& writes, Status& local) {
  const StateRole state = StateOf(r);
  const Residence where = RoleResidence(r);
  const int me = options_.rank;
  std::vector<float> scales;  // rank 0: int8 scales in the blob's order
  for (uint32_t u = 0; u < units_.size(); ++u) {
    UnitState& s = units_[u];
    for (int q = 0; q < options_.world_size; ++q) {
      // Rank 0's own pieces need no collective.
      if (q == 0 && me != 0) continue;
      for (size_t p = 0; p < NumPieces(u); ++p) {
        const uint64_t begin = p * piece_elems_;
        const uint64_t n = std::min(piece_elems_, s.elems - begin);
        const size_t raw = RoleBytes(r, s, n);
        STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
        auto lease = std::make_shared<StagingLease>(std::move(acquired));
        std::byte* buf = lease->data();
        if (q == me && local.ok()) {
          local = where == Residence::kNvme ? ReadPiece(u, r, p, lease->span())
                                            : CopyOut(r, u, begin, raw, buf);
        }
        if (q != 0) {
          STRATA_RETURN_IF_ERROR(
              coll_->Broadcast(buf, raw, CommType::kByte, q)
                  .WithContext("engine: SaveState: moving the " +
                               std::string(StateRoleName(state)) + " of " +
                               UnitNames(u) + " (unit " + std::to_string(u) +
                               ", rank " + std::to_string(q) + "'s piece " +
                               std::to_string(p) + ") to rank 0"));
        }
        if (me != 0 || !local.ok()) continue;
        // Converted even when it is padding only: int8 scales are kept for
        // every piece of every shard.
        const size_t bytes = ToExtentPayload(r, buf, n, raw, &scales);
        std::vector<StatePlacement> places = PlacementsInUnit(
            u, static_cast<uint64_t>(q) * s.elems + begin, n, {});
        if (places.empty()) continue;  // padding only
        local = WriteStaged(*writer, state, std::move(lease), bytes,
                            std::move(places), writes);
      }
    }
  }
  if (me == 0 && local.ok()) local = PutScales(*writer, r, scales);
  return Status::Ok();
}

Status EngineImpl::SaveWholeParams(CheckpointWriter& writer, Inflight& writes) {
  for (uint32_t u = 0; u < units_.size(); ++u) {
    UnitState& s = units_[u];
    for (size_t p = 0; p < NumWholePieces(u); ++p) {
      const uint64_t begin = p * piece_elems_;
      const uint64_t n = std::min(piece_elems_, s.full_elems - begin);
      std::vector<StatePlacement> places = PlacementsInUnit(u, begin, n, {});
      if (places.empty()) continue;
      const size_t raw = RoleBytes(kParam, s, n);
      STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
      auto lease = std::make_shared<StagingLease>(std::move(acquired));
      // On the device with several ranks today (stages 1 and 2), but a host
      // array is the whole unit's as well.
      STRATA_RETURN_IF_ERROR(CopyOut(kParam, u, begin, raw, lease->data()));
      STRATA_RETURN_IF_ERROR(WriteStaged(writer, StateRole::kParam,
                                         std::move(lease), raw,
                                         std::move(places), writes));
    }
  }
  return Status::Ok();
}

Status EngineImpl::LoadWholeParamPiece(CheckpointReader& reader, uint32_t u,
                                       size_t p,
                                       const std::vector<uint32_t>& index,
                                       bool ckpt_params, Inflight& writes) {
  UnitState& s = units_[u];
  const uint64_t begin = p * piece_elems_;
  const uint64_t n = std::min(piece_elems_, s.full_elems - begin);
  const std::vector<StatePlacement> places =
      PlacementsInUnit(u, begin, n, index);
  const size_t es = ElementSize(s.dtype);
  STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
  auto working = std::make_shared<StagingLease>(std::move(acquired));
  std::memset(working->data(), 0, RoundUp(n * es, kCheckpointAlign));
  if (!places.empty()) {
    if (ckpt_params) {
      STRATA_RETURN_IF_ERROR(
          reader.Read(StateRole::kParam, places, {working->data(), n * es}));
    } else {
      // The master rounded to the working dtype, as with one rank.
      STRATA_ASSIGN_OR_RETURN(StagingLease master, staging_->Acquire());
      std::memset(master.data(), 0, RoundUp(n * 4, kCheckpointAlign));
      STRATA_RETURN_IF_ERROR(
          reader.Read(StateRole::kMaster, places, {master.data(), n * 4}));
      STRATA_RETURN_IF_ERROR(ConvertCpuArray(master.data(), CpuDType::kFloat32,
                                             working->data(), ToCpu(s.dtype),
                                             n));
    }
  }
  StorePiece(u, kParam, p, std::move(working), writes);
  return Status::Ok();
}

// ---- Load ------------------------------------------------------------------

void EngineImpl::StorePiece(uint32_t u, int r, size_t p,
                            std::shared_ptr<StagingLease> lease,
                            Inflight& writes) {
  UnitState& s = units_[u];
  const uint64_t begin = p * piece_elems_;
  const uint64_t bytes =
      RoleBytes(r, s, std::min(piece_elems_, RoleElems(r, s) - begin));
  writes.Add();
  switch (RoleResidence(r)) {
    case Residence::kHost:
      std::memcpy(HostAt(r, u, begin), lease->data(), bytes);
      writes.Finish(Status::Ok());
      return;
    case Residence::kDevice: {
      // Loaders share the copy stream: one copy and its wait at a time (the
      // lock guards nothing else, so waiting under it blocks only them).
      MutexLock l(&state_copy_mu_);
      Status st =
          device_->CopyAsync(*copy_stream_, DevAt(s, RoleOffset(r, s, begin)),
                             lease->data(), bytes, CopyKind::kHostToDevice);
      if (st.ok()) st = device_->SynchronizeStream(*copy_stream_);
      writes.Finish(st);
      return;
    }
    case Residence::kNvme:
      WritePieceAsync(u, r, p, lease->span(), IoPriority::kUrgent,
                      [&writes, lease](Status st) mutable {
                        lease.reset();
                        writes.Finish(st);
                      });
      return;
  }
}

Status EngineImpl::LoadPiece(CheckpointReader& reader, uint32_t u, size_t p,
                             const std::vector<uint32_t>& index,
                             bool ckpt_params, const Block8Scales* scales,
                             Inflight& writes) {
  UnitState& s = units_[u];
  const uint64_t begin = p * piece_elems_;
  const uint64_t n = std::min(piece_elems_, s.elems - begin);
  const std::vector<StatePlacement> places = PlacementsOf(u, begin, n, index);
  // Fills a lease with role r of this piece from the checkpoint, as stored
  // (Note [Moment formats in checkpoints]).
  const CpuDType moments = MomentDType();
  auto fill = [&](int r) -> StatusOr<std::shared_ptr<StagingLease>> {
    STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
    auto lease = std::make_shared<StagingLease>(std::move(acquired));
    const size_t bytes = IsMoment(r) ? n * 4 : RoleBytes(r, s, n);
    std::memset(lease->data(), 0, RoundUp(bytes, kCheckpointAlign));
    // A piece of padding alone (a last shard, with several ranks) reads
    // nothing.
    if (!places.empty()) {
      STRATA_RETURN_IF_ERROR(
          reader.Read(StateOf(r), places, {lease->data(), bytes}));
    }
    if (IsMoment(r) && scales != nullptr) {
      // The gaps' slots stay zero: their codes are zero (Note [Moment
      // formats in checkpoints]).
      const std::vector<float>& v =
          r == kExpAvg ? scales->exp_avg : scales->exp_avg_sq;
      const uint64_t first = scales->first[u] + p * Blocks(piece_elems_);
      if (!SlotsToBlock8(lease->data(), n, v.data() + first)) {
        return Status::Corruption(
            "the " + std::string(StateRoleName(StateOf(r))) + " of " +
            UnitNames(u) + " (unit " + std::to_string(u) + ", piece " +
            std::to_string(p) +
            ") holds a slot that is no int8 code (above 255)");
      }
    }
    return lease;
  };
  for (int r : {kMaster, kExpAvg, kExpAvgSq}) {
    if (!RoleKept(r)) continue;
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<StagingLease> lease, fill(r));
    if (IsMoment(r) && moments == CpuDType::kBFloat16) {
      // Stored as fp32: rounded to bf16 (exact for a bf16 engine's save).
      STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
      auto narrow = std::make_shared<StagingLease>(std::move(acquired));
      STRATA_RETURN_IF_ERROR(ConvertCpuArray(lease->data(), CpuDType::kFloat32,
                                             narrow->data(),
                                             CpuDType::kBFloat16, n));
      lease = std::move(narrow);
    }
    // With whole parameters on several ranks the working copy is the whole
    // unit's (LoadWholeParamPiece), not the shard's.
    if (r == kMaster && !ckpt_params && !WholeParams()) {
      // The working copy: the master rounded to the working dtype.
      STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
      auto working = std::make_shared<StagingLease>(std::move(acquired));
      std::memset(working->data(), 0,
                  RoundUp(n * ElementSize(s.dtype), kCheckpointAlign));
      STRATA_RETURN_IF_ERROR(ConvertCpuArray(lease->data(), CpuDType::kFloat32,
                                             working->data(), ToCpu(s.dtype),
                                             n));
      StorePiece(u, kParam, p, std::move(working), writes);
    }
    StorePiece(u, r, p, std::move(lease), writes);
  }
  if (ckpt_params && !WholeParams()) {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<StagingLease> lease, fill(kParam));
    StorePiece(u, kParam, p, std::move(lease), writes);
  }
  return Status::Ok();
}

Status EngineImpl::LoadState(CheckpointReader& reader) {
  // Everything that can be checked before a byte changes is checked first:
  // names, shapes, dtypes, the roles and the engine's blob.
  if (!started_) {
    return Status::FailedPrecondition("engine: LoadState before Start");
  }
  const std::string where = "engine: LoadState from " + reader.path();
  std::vector<uint32_t> index(specs_.size());
  bool ckpt_params = false;
  std::string blob;
  std::string factored_blob;
  int64_t step = 0;
  LossScaler scaler(options_.loss_scale);
  Block8Scales scales;
  const Block8Scales* scales_ptr = nullptr;
  auto check = [&]() -> Status {
    for (size_t i = 0; i < specs_.size(); ++i) {
      StatusOr<uint32_t> k = reader.Find(specs_[i].name);
      if (!k.ok()) {
        return Status::NotFound(where + ": tensor " + specs_[i].name +
                                " is not in the checkpoint");
      }
      const CheckpointTensor& t = reader.tensors()[*k];
      if (t.shape != specs_[i].shape) {
        return Status::InvalidArgument(
            where + ": tensor " + t.name + " has shape " + ShapeText(t.shape) +
            " there and " + ShapeText(specs_[i].shape) + " here");
      }
      index[i] = *k;
    }
    for (int r : {kMaster, kExpAvg, kExpAvgSq}) {
      if (!RoleKept(r)) continue;
      if (!reader.HasRole(StateOf(r))) {
        return Status::Corruption(where + ": the checkpoint has no " +
                                  std::string(StateRoleName(StateOf(r))));
      }
    }
    // The stored working copy is used only when its dtypes are this engine's.
    ckpt_params = reader.HasRole(StateRole::kParam);
    for (size_t i = 0; i < specs_.size() && ckpt_params; ++i) {
      ckpt_params = reader.tensors()[index[i]].dtype == specs_[i].dtype;
    }
    STRATA_ASSIGN_OR_RETURN(blob, reader.Blob(kEngineBlob));
    if (Factored()) {
      StatusOr<std::string> b = reader.Blob(kFactoredBlob);
      if (!b.ok()) {
        return Status::NotFound(
            where + ": the checkpoint has no blob " + kFactoredBlob +
            " (the statistics of Adafactor or SM3): was it saved by " +
            std::string(CpuOptimizerAlgoName(options_.optimizer.cpu.algo)) +
            "?");
      }
      factored_blob = std::move(b).value();
      STRATA_RETURN_IF_ERROR(
          LoadFactoredBlob(factored_blob, /*apply=*/false).WithContext(where));
    }
    {
      nlohmann::json j = nlohmann::json::parse(blob, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("step") ||
          !j["step"].is_number_integer() || j["step"].get<int64_t>() < 0) {
        return Status::Corruption(where + ": blob " + kEngineBlob +
                                  " has no valid \"step\"");
      }
      step = j["step"].get<int64_t>();
      // A checkpoint without the key (older than the engine's own scale)
      // leaves the scale at the options' initial one.
      if (j.contains("loss_scale")) {
        STRATA_RETURN_IF_ERROR(scaler.Load(j["loss_scale"].dump(),
                                           where + ": blob " + kEngineBlob));
      }
      // Note [Moment formats in checkpoints]. A checkpoint without the key is
      // older than the formats: fp32.
      CpuDType saved = CpuDType::kFloat32;
      if (j.contains("moment_dtype")) {
        StatusOr<CpuDType> d =
            j["moment_dtype"].is_string()
                ? ParseMomentDType(j["moment_dtype"].get<std::string>())
                : StatusOr<CpuDType>(Status::InvalidArgument("not a string"));
        if (!d.ok()) {
          return Status::Corruption(where + ": blob " + kEngineBlob +
                                    " has a bad \"moment_dtype\" (" +
                                    d.status().ToString() + ")");
        }
        saved = *d;
      }
      const CpuDType here = MomentDType();
      const std::string formats =
          "the checkpoint's moments are " +
          std::string(MomentDTypeName(saved)) + " and this engine's " +
          std::string(MomentDTypeName(here)) + " (optimizer.moment_dtype)";
      if ((saved == CpuDType::kBlock8) != (here == CpuDType::kBlock8)) {
        return Status::InvalidArgument(
            where + ": " + formats +
            "; int8 moments load only into int8 moments (fp32 and bf16 load "
            "into each other)");
      }
      if (here == CpuDType::kBlock8) {
        // Stored as this layout's piece arrays: the same tensors in the same
        // order, partition size and piece size give the same pieces.
        bool same = reader.tensors().size() == specs_.size();
        for (size_t i = 0; i < specs_.size() && same; ++i) {
          same = index[i] == i && reader.tensors()[i].dtype == specs_[i].dtype;
        }
        const auto number = [&j](const char* key) -> uint64_t {
          return j.contains(key) && j[key].is_number_unsigned()
                     ? j[key].get<uint64_t>()
                     : 0;
        };
        const uint64_t partition = number("partition_bytes");
        const uint64_t piece = number("piece_elems");
        // Note [Checkpoints over ranks]: the pieces are the shards' pieces.
        const uint64_t world =
            j.contains("world_size") ? number("world_size") : 1;
        const uint64_t world_here = static_cast<uint64_t>(options_.world_size);
        if (!same || partition != options_.partition_bytes ||
            piece != piece_elems_ || world != world_here) {
          return Status::InvalidArgument(
              where +
              ": int8 moments are stored as the saving engine's quantized "
              "pieces and load only into the same layout: the same tensors in "
              "the same order, partition_bytes, pieces (staging_buffer_bytes "
              "/ 4, whole blocks) and world_size (the pieces are each rank's "
              "shard's); the checkpoint has partition_bytes " +
              std::to_string(partition) + ", pieces of " +
              std::to_string(piece) + " elements and world_size " +
              std::to_string(world) +
              (same ? "" : " and other tensors or another order") +
              ", this engine " + std::to_string(options_.partition_bytes) +
              ", " + std::to_string(piece_elems_) + " and " +
              std::to_string(world_here));
        }
      }
    }
    // Note [Moment formats in checkpoints]: int8 moments' scales, whole;
    // with several ranks, unit by unit, each unit's shards in rank order
    // (Note [Checkpoints over ranks]).
    if (MomentDType() == CpuDType::kBlock8) {
      uint64_t blocks = 0;
      for (uint32_t u = 0; u < units_.size(); ++u) {
        uint64_t shard = 0;
        for (size_t p = 0; p < NumPieces(u); ++p) {
          shard += Blocks(
              std::min(piece_elems_, units_[u].elems - p * piece_elems_));
        }
        scales.first.push_back(blocks +
                               static_cast<uint64_t>(options_.rank) * shard);
        blocks += static_cast<uint64_t>(options_.world_size) * shard;
      }
      for (int r : {kExpAvg, kExpAvgSq}) {
        STRATA_ASSIGN_OR_RETURN(std::string b, reader.Blob(ScalesBlob(r)));
        if (b.size() != blocks * 4) {
          return Status::Corruption(
              where + ": blob " + ScalesBlob(r) + " has " +
              std::to_string(b.size()) + " bytes, not " +
              std::to_string(blocks * 4) + " (4 per block of int8 moments)");
        }
        std::vector<float>& v =
            r == kExpAvg ? scales.exp_avg : scales.exp_avg_sq;
        v.resize(blocks);
        std::memcpy(v.data(), b.data(), b.size());
      }
      scales_ptr = &scales;
    }
    return Status::Ok();
  };
  if (!MultiRank()) {
    STRATA_RETURN_IF_ERROR(check());
    STRATA_RETURN_IF_ERROR(BeginExclusive("LoadState", /*load=*/true));
  } else {
    // Note [Checkpoints over ranks]: every rank checks, then they agree;
    // and every rank must have read the same checkpoint.
    WaitGradsQuiet();
    STRATA_RETURN_IF_ERROR(AgreeNow(check()));
    STRATA_RETURN_IF_ERROR(AgreeSame(
        "the checkpoint (its step and blob " + std::string(kEngineBlob) + ")",
        std::to_string(reader.step()) + "\n" + blob));
    const Status began = BeginExclusive("LoadState", /*load=*/true);
    const Status agreed = AgreeNow(began);
    if (!agreed.ok()) {
      if (began.ok()) EndExclusive();
      return agreed;
    }
  }
  Inflight writes;
  // Two loaders take pieces in turn, so that a checkpoint read is in
  // flight while the other loader verifies, converts or stores its piece
  // (a reader's Read blocks). With several ranks, pieces marked `whole`
  // are of a unit's whole working copy (Note [Checkpoints over ranks]).
  struct LoadItem {
    uint32_t u;
    size_t p;
    bool whole;
  };
  std::vector<LoadItem> pieces;
  for (uint32_t u = 0; u < units_.size(); ++u) {
    for (size_t p = 0; p < NumPieces(u); ++p) pieces.push_back({u, p, false});
    if (WholeParams()) {
      for (size_t p = 0; p < NumWholePieces(u); ++p) {
        pieces.push_back({u, p, true});
      }
    }
  }
  auto load = [&](const LoadItem& item) {
    return item.whole ? LoadWholeParamPiece(reader, item.u, item.p, index,
                                            ckpt_params, writes)
                      : LoadPiece(reader, item.u, item.p, index, ckpt_params,
                                  scales_ptr, writes);
  };
  std::atomic<size_t> next{0};
  Mutex error_mu;
  Status st;
  auto loader = [&] {
    for (;;) {
      {
        MutexLock l(&error_mu);
        if (!st.ok()) return;
      }
      const size_t i = next.fetch_add(1);
      if (i >= pieces.size()) return;
      Status pst = load(pieces[i]);
      if (!pst.ok()) {
        MutexLock l(&error_mu);
        if (st.ok()) st = pst;
      }
    }
  };
  // The first piece alone: a checkpoint that fails its first read then
  // changes nothing.
  if (!pieces.empty()) {
    next = 1;
    st = load(pieces[0]);
  }
  if (st.ok() && pieces.size() > 1) {
    std::thread second(loader);
    loader();
    second.join();
  }
  Status written = writes.Wait();
  if (st.ok()) st = written;
  if (!st.ok()) st = st.WithContext(where);
  // Note [Checkpoints over ranks]: a rank that loaded everything fails too
  // when another did not (the ranks' states would not match).
  if (MultiRank()) st = AgreeNow(st);
  {
    MutexLock l(&mu_);
    if (st.ok()) {
      steps_ = step;
      loss_scaler_ = scaler;
      if (Factored()) st = LoadFactoredBlob(factored_blob, /*apply=*/true);
    } else {
      // Note [Engine failures]: partly loaded, unless nothing was stored.
      if (writes.started() > 0) failed_ = st;
    }
  }
  EndExclusive();
  // Cached device copies of parameters resting elsewhere are stale.
  if (st.ok()) InvalidateCaches();
  return st;
}

}  // namespace strata::memtier
