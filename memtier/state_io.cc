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
  std::vector<StatePlacement> out;
  const UnitInfo& info = layout_->unit(u);
  // Unit coordinates of the piece: the shard starts at shard_begin.
  const uint64_t lo = info.shard_begin + begin;
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

Status EngineImpl::SaveRole(CheckpointWriter& writer, int r, Inflight& writes) {
  const StateRole state = StateOf(r);
  const Residence where = RoleResidence(r);
  // A piece whose bytes are in, or arriving in (`arrived`: NVMe reads), a
  // staging buffer.
  struct Ready {
    std::shared_ptr<StagingLease> lease;
    size_t bytes = 0, padded = 0;
    std::vector<StatePlacement> places;
    std::future<Status> arrived;
  };
  // Hands a piece to the writer on this thread (the writer checksums it,
  // which must not hold up the I/O completion thread); the buffer goes back
  // when the write is done.
  auto emit = [&](Ready& p, Status st) -> Status {
    writes.Add();
    if (st.ok()) {
      std::memset(p.lease->data() + p.bytes, 0, p.padded - p.bytes);
      st = writer.WriteExtent(state, {p.lease->data(), p.padded},
                              std::move(p.places),
                              [&writes, lease = p.lease](Status wst) mutable {
                                lease.reset();  // back before the count drops
                                writes.Finish(wst);
                              });
      if (st.ok()) return st;
    }
    writes.Finish(st);
    return st;
  };
  // NVMe reads in flight, at most half the buffers: the rest carry writes.
  const size_t depth = std::max<size_t>(1, staging_->count() / 2);
  std::deque<Ready> reading;
  Status st;
  for (uint32_t u = 0; u < units_.size() && st.ok(); ++u) {
    UnitState& s = units_[u];
    const size_t esize = ElemBytes(r, s);
    for (size_t p = 0; p < NumPieces(u) && st.ok(); ++p) {
      const uint64_t begin = p * piece_elems_;
      const uint64_t n = std::min(piece_elems_, s.elems - begin);
      Ready piece;
      piece.bytes = n * esize;
      piece.padded = RoundUp(piece.bytes, kCheckpointAlign);
      piece.places = PlacementsOf(u, begin, n, {});
      if (where == Residence::kHost) {
        std::byte* src = HostAt(r, u, begin);
        const bool aligned =
            reinterpret_cast<uintptr_t>(src) % kCheckpointAlign == 0 &&
            (begin * esize) + piece.padded <= HostBlockBytes(r, s);
        if (aligned) {  // straight from the host array
          writes.Add();
          st = writer.WriteExtent(
              state, {src, piece.padded}, std::move(piece.places),
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
        auto promise = std::make_shared<std::promise<Status>>();
        piece.arrived = promise->get_future();
        ReadPieceAsync(u, r, p, piece.lease->span(), IoPriority::kUrgent,
                       [promise](Status rst) { promise->set_value(rst); });
        reading.push_back(std::move(piece));
        continue;
      }
      Status copied;
      if (where == Residence::kHost) {
        std::memcpy(buf, HostAt(r, u, begin), piece.bytes);
      } else {
        copied = device_->CopyAsync(*copy_stream_, buf, DevAt(s, begin * esize),
                                    piece.bytes, CopyKind::kDeviceToHost);
        if (copied.ok()) copied = device_->SynchronizeStream(*copy_stream_);
      }
      st = emit(piece, copied);
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
  return st;
}

Status EngineImpl::SaveState(CheckpointWriter& writer, bool params) {
  STRATA_RETURN_IF_ERROR(BeginExclusive("SaveState", /*load=*/false));
  Status st;
  for (size_t i = 0; i < specs_.size() && st.ok(); ++i) {
    CheckpointTensor t;
    t.name = specs_[i].name;
    t.shape = specs_[i].shape;
    t.dtype = specs_[i].dtype;
    StatusOr<uint32_t> index = writer.AddTensor(t);
    if (!index.ok()) {
      st = index.status();
    } else if (*index != i) {
      st = Status::Internal("engine: the checkpoint writer numbered tensor " +
                            t.name + " " + std::to_string(*index) + ", not " +
                            std::to_string(i) +
                            " (was it given tensors before SaveState?)");
    }
  }
  Inflight writes;
  for (const SavedRole& role : kSaved) {
    if (!st.ok()) break;
    if (role.role == kParam && !params) continue;
    st = SaveRole(writer, role.role, writes);
  }
  // Every submitted extent ends before the buffers and the writer may go.
  Status written = writes.Wait();
  if (st.ok()) st = written;
  if (st.ok()) {
    const CpuOptimizerOptions& o = options_.optimizer.cpu;
    nlohmann::json j;
    {
      MutexLock l(&mu_);
      j["step"] = steps_;
    }
    j["optimizer"] = {{"type", std::string(CpuOptimizerAlgoName(o.algo))},
                      {"betas", {o.beta1, o.beta2}},
                      {"eps", o.eps},
                      {"weight_decay", o.weight_decay},
                      {"bias_correction", o.bias_correction}};
    j["partition_bytes"] = options_.partition_bytes;
    j["world_size"] = options_.world_size;
    st = writer.PutBlob(kEngineBlob, j.dump());
  }
  EndExclusive();
  return st.ok() ? st : st.WithContext("engine: SaveState");
}

// ---- Load ------------------------------------------------------------------

void EngineImpl::StorePiece(uint32_t u, int r, size_t p,
                            std::shared_ptr<StagingLease> lease,
                            Inflight& writes) {
  UnitState& s = units_[u];
  const size_t esize = ElemBytes(r, s);
  const uint64_t begin = p * piece_elems_;
  const uint64_t n = std::min(piece_elems_, s.elems - begin);
  writes.Add();
  switch (RoleResidence(r)) {
    case Residence::kHost:
      std::memcpy(HostAt(r, u, begin), lease->data(), n * esize);
      writes.Finish(Status::Ok());
      return;
    case Residence::kDevice: {
      // Loaders share the copy stream: one copy and its wait at a time (the
      // lock guards nothing else, so waiting under it blocks only them).
      MutexLock l(&state_copy_mu_);
      Status st =
          device_->CopyAsync(*copy_stream_, DevAt(s, begin * esize),
                             lease->data(), n * esize, CopyKind::kHostToDevice);
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
                             bool ckpt_params, Inflight& writes) {
  UnitState& s = units_[u];
  const uint64_t begin = p * piece_elems_;
  const uint64_t n = std::min(piece_elems_, s.elems - begin);
  const std::vector<StatePlacement> places = PlacementsOf(u, begin, n, index);
  // Fills a lease with role r of this piece from the checkpoint.
  auto fill = [&](int r) -> StatusOr<std::shared_ptr<StagingLease>> {
    STRATA_ASSIGN_OR_RETURN(StagingLease acquired, staging_->Acquire());
    auto lease = std::make_shared<StagingLease>(std::move(acquired));
    const size_t bytes = n * ElemBytes(r, s);
    std::memset(lease->data(), 0, RoundUp(bytes, kCheckpointAlign));
    STRATA_RETURN_IF_ERROR(
        reader.Read(StateOf(r), places, {lease->data(), bytes}));
    return lease;
  };
  for (int r : {kMaster, kExpAvg, kExpAvgSq}) {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<StagingLease> lease, fill(r));
    if (r == kMaster && !ckpt_params) {
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
  if (ckpt_params) {
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
  for (size_t i = 0; i < specs_.size(); ++i) {
    StatusOr<uint32_t> k = reader.Find(specs_[i].name);
    if (!k.ok()) {
      return Status::NotFound(where + ": tensor " + specs_[i].name +
                              " is not in the checkpoint");
    }
    const CheckpointTensor& t = reader.tensors()[*k];
    if (t.shape != specs_[i].shape) {
      auto shape = [](const std::vector<int64_t>& v) {
        std::string out = "[";
        for (size_t d = 0; d < v.size(); ++d) {
          out += (d ? ", " : "") + std::to_string(v[d]);
        }
        return out + "]";
      };
      return Status::InvalidArgument(
          where + ": tensor " + t.name + " has shape " + shape(t.shape) +
          " there and " + shape(specs_[i].shape) + " here");
    }
    index[i] = *k;
  }
  for (int r : {kMaster, kExpAvg, kExpAvgSq}) {
    if (!reader.HasRole(StateOf(r))) {
      return Status::Corruption(where + ": the checkpoint has no " +
                                std::string(StateRoleName(StateOf(r))));
    }
  }
  // The stored working copy is used only when its dtypes are this engine's.
  bool ckpt_params = reader.HasRole(StateRole::kParam);
  for (size_t i = 0; i < specs_.size() && ckpt_params; ++i) {
    ckpt_params = reader.tensors()[index[i]].dtype == specs_[i].dtype;
  }
  STRATA_ASSIGN_OR_RETURN(std::string blob, reader.Blob(kEngineBlob));
  int64_t step = 0;
  {
    nlohmann::json j = nlohmann::json::parse(blob, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") ||
        !j["step"].is_number_integer() || j["step"].get<int64_t>() < 0) {
      return Status::Corruption(where + ": blob " + kEngineBlob +
                                " has no valid \"step\"");
    }
    step = j["step"].get<int64_t>();
  }
  STRATA_RETURN_IF_ERROR(BeginExclusive("LoadState", /*load=*/true));
  // Two loaders take pieces in turn, so that a checkpoint read is in
  // flight while the other loader verifies, converts or stores its piece
  // (a reader's Read blocks).
  std::vector<std::pair<uint32_t, size_t>> pieces;
  for (uint32_t u = 0; u < units_.size(); ++u) {
    for (size_t p = 0; p < NumPieces(u); ++p) pieces.emplace_back(u, p);
  }
  Inflight writes;
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
      Status pst = LoadPiece(reader, pieces[i].first, pieces[i].second, index,
                             ckpt_params, writes);
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
    st = LoadPiece(reader, pieces[0].first, pieces[0].second, index,
                   ckpt_params, writes);
  }
  if (st.ok() && pieces.size() > 1) {
    std::thread second(loader);
    loader();
    second.join();
  }
  Status written = writes.Wait();
  if (st.ok()) st = written;
  {
    MutexLock l(&mu_);
    if (st.ok()) {
      steps_ = step;
    } else {
      st = st.WithContext(where);
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
