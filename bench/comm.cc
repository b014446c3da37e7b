// strata-bench comm: all-gather, reduce-scatter and all-reduce bandwidth by
// message size through strata's Communicator, run on every rank of
// `mpirun -np N strata-bench comm ...` (one rank without mpirun).
//
// Figures as nccl-tests defines them, for a message of S bytes (the whole
// gathered buffer, the whole reduce-scatter input, the all-reduce buffer):
//   algbw = S / time          (time: the slowest rank's, per iteration)
//   busbw = algbw x (n-1)/n   for all-gather and reduce-scatter
//   busbw = algbw x 2(n-1)/n  for all-reduce
// busbw is comparable with the link's bandwidth whatever n is. MPI and
// single rank move pinned host memory; NCCL moves CUDA device memory,
// bootstrapped over MPI.
//
// stage3-fetch: the engine's ZeRO stage-3 fetch over the ranks (each rank
// keeps its shard of every unit, a Fetch that misses all-gathers the unit
// into the device block) against the plain all-gather of the same units'
// bytes, measured in turn in the same run (Note [The stage-3 fetch]).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/host_buffer.h"
#include "util/align.h"

namespace strata::bench {
namespace {

constexpr const char* kCommand = "comm";
constexpr uint64_t kMaxMessage = uint64_t{16} << 30;  // 16 GiB
constexpr const char* kStage3 = "stage3-fetch";
// stage3-fetch's reduce_bucket_bytes with the collectives on device memory
// (no gradient is handed over; the buckets only take device budget).
constexpr uint64_t kStage3BucketBytes = uint64_t{1} << 20;

struct CommFlags {
  std::string backend = "auto";
  std::string ops = "all-gather,reduce-scatter,all-reduce,stage3-fetch";
  std::string sizes = "4K,64K,1M,16M,64M";
  std::string type = "float32";
  std::string iters = "20";
  std::string warmup = "3";
  std::string timeout = "300";
  std::string comm_memory = "host";
  std::string json;
  const CLI::Option* ops_option = nullptr;  // whether --ops was given
};

struct CommConfig {
  std::string backend;  // single, mpi or nccl after "auto" is resolved
  std::vector<std::string> ops;
  std::vector<uint64_t> sizes;
  std::string type;
  int iters = 20;
  int warmup = 3;
  double timeout_s = 300;
  std::string comm_memory;  // stage3-fetch's engine: host or device
  std::string json;
};

// Note [The stage-3 fetch]
// stage3-fetch measures, for a model of S bytes of bf16 parameters, one pass
// of the engine (zero_stage 3, world_size n, the parameters' shards and the
// optimizer states on the host, a host-emulated device) fetching every
// tensor in order (Fetch, pin.Wait(), the pin dropped), against the plain
// all-gather of the same units' bytes through the same Communicator, one
// all-gather per unit as the engine cuts it (each rank sending its padded
// shard, equal shards), from a host array of this rank's shards into one of
// two unit-sized buffers in turn.
// - Tensors (Stage3ShapeFor): S / 8 rounded down to a multiple of q = lcm(4
//   KiB, 256 n) bytes, at least 16 KiB rounded up to q and at most 32 MiB
//   rounded down to q, the last one shorter; one tensor (S) when S is not
//   above that. Each tensor is a unit of its own: partition_bytes is twice
//   the tensor (fp32), at least 64 KiB, and units pad to 128 n elements.
// - Staging buffers: what the engine picks by itself with everything on the
//   host (count 6; bytes: a shard's elements x 4 rounded up to 4 KiB, in 4
//   MiB .. 64 MiB), set explicitly so that the JSON states them. A unit's
//   gather runs in rounds of min(bytes / 4, bytes / (2 n)) elements per
//   rank.
// - Device budget: the unit in use and the prefetch window
//   (prefetch_bytes / unit), at most half the units, at least two units
//   (the engine's own minimum, partition_bytes).
// - Between passes an applied Step with lr 0 and no gradient (the
//   parameters stay as they are) ends the fetch order the engine
//   prefetches along and drops every cached device copy, so that every
//   pass gathers every unit; each pass is checked for it (its host-to-device
//   bytes are every unit's, and no fetch found a unit cached).
// - The first pass (which records the order) is untimed; then --warmup
//   untimed repetitions and --iters timed ones, each one engine pass and
//   one reference pass, taking turns going first; each pass starts after a
//   barrier and its time is the slowest rank's. ratio = the reference's
//   mean time / the fetch's; paired = the median of each repetition's own
//   ratio. The fetch does the same all-gathers plus the copies to the
//   device, so a ratio above 1 means the reference was measured badly.
// - At the end every rank fetches the first and the last tensor and
//   compares the device bytes with the values SetInitialValues gave (exact
//   in bf16); a mismatch on any rank fails the run.
struct Stage3Shape {
  uint64_t size = 0;  // S
  int ranks = 1;
  uint64_t tensor_bytes = 0, tensors = 0, last_bytes = 0;
  uint64_t unit_bytes = 0, last_unit_bytes = 0;  // padded to 128 n elements
  uint64_t partition_bytes = 0;
  uint64_t staging_bytes = 0;
  uint32_t staging_count = 6;
  uint64_t round_elems = 0;  // per rank, per gather round
  uint64_t prefetch_bytes = 0;
  uint64_t budget_units = 0, budget_bytes = 0;

  uint64_t bytes(uint64_t i) const {
    return i + 1 == tensors ? last_bytes : tensor_bytes;
  }
  uint64_t unit(uint64_t i) const {
    return i + 1 == tensors ? last_unit_bytes : unit_bytes;
  }
  uint64_t gathered_bytes() const {
    return (tensors - 1) * unit_bytes + last_unit_bytes;
  }
  uint64_t shard(uint64_t i) const {
    return unit(i) / static_cast<uint64_t>(ranks);
  }
  uint64_t rounds_per_unit() const {
    const uint64_t elems = shard(0) / 2;
    return (elems + round_elems - 1) / round_elems;
  }
};

Stage3Shape Stage3ShapeFor(uint64_t size, int ranks) {
  Stage3Shape s;
  s.size = size;
  s.ranks = ranks;
  const uint64_t n = static_cast<uint64_t>(ranks);
  const uint64_t q = std::lcm<uint64_t>(4096, 256 * n);
  const uint64_t lo = RoundUp(uint64_t{16} << 10, q);
  const uint64_t hi = std::max(q, (uint64_t{32} << 20) / q * q);
  const uint64_t t = std::clamp(size / 8 / q * q, lo, std::max(lo, hi));
  s.tensor_bytes = t >= size ? size : t;
  s.tensors = (size + s.tensor_bytes - 1) / s.tensor_bytes;
  s.last_bytes = size - (s.tensors - 1) * s.tensor_bytes;
  const uint64_t quantum = 128 * n;  // elements
  s.unit_bytes = 2 * RoundUp(s.tensor_bytes / 2, quantum);
  s.last_unit_bytes = 2 * RoundUp(s.last_bytes / 2, quantum);
  s.partition_bytes =
      std::max<uint64_t>(uint64_t{64} << 10, RoundUp(2 * s.tensor_bytes, 4096));
  // The engine's automatic staging buffers: a shard's elements as fp32.
  s.staging_bytes = std::clamp<uint64_t>(RoundUp(s.unit_bytes / n * 2, 4096),
                                         uint64_t{4} << 20, uint64_t{64} << 20);
  s.round_elems = std::min(s.staging_bytes / 4, s.staging_bytes / (2 * n));
  s.prefetch_bytes = EngineOptions().prefetch_bytes;
  const uint64_t ahead = s.prefetch_bytes / s.unit_bytes;
  s.budget_units = std::max<uint64_t>(2, std::min(ahead + 1, s.tensors / 2));
  s.budget_bytes =
      std::max(s.partition_bytes, s.budget_units * RoundUp(s.unit_bytes, 256));
  return s;
}

// Host bytes one rank needs for stage3-fetch at `s`: the engine's host
// roles (the working copy's shard, 2 bytes per element, the fp32 master,
// moments and gradient shard, 16), its gradient buckets, staging buffers and
// the host-emulated device; the reference's shards and two unit buffers;
// the initial values and the check's copy.
uint64_t Stage3HostBytes(const Stage3Shape& s) {
  const uint64_t shards = s.gathered_bytes() / static_cast<uint64_t>(s.ranks);
  return 9 * shards + 4 * s.unit_bytes + s.staging_count * s.staging_bytes +
         s.budget_bytes + shards + 2 * s.unit_bytes + 2 * s.tensor_bytes +
         s.tensor_bytes + (uint64_t{64} << 20);
}

struct Stage3Result {
  Stage3Shape shape;
  std::vector<double> fetch_s, ref_s;  // per timed repetition, slowest rank
  double fetch_mean = 0, ref_mean = 0;
  double ratio = 0, paired = 0;
  std::vector<double> paired_ratios;
  uint64_t pass_h2d_bytes = 0;  // of every pass
  uint64_t prefetch_hits = 0;   // over the timed passes
  double stall_seconds = 0;     // over the timed passes
  int checked_tensors = 0;
  EngineStats stats;
};

struct Row {
  std::string op;
  uint64_t bytes = 0;  // S
  double seconds = 0;  // per iteration, the slowest rank
  double algbw = 0;    // GB/s
  double busbw = 0;    // GB/s
  std::optional<Stage3Result> stage3;
};

// ---- Parse -----------------------------------------------------------------

void AddOptions(CLI::App& app, CommFlags& f) {
  app.add_option("--backend", f.backend,
                 "auto (mpi under mpirun, else single), single, mpi, nccl")
      ->capture_default_str();
  f.ops_option =
      app.add_option("--ops", f.ops,
                     "all-gather, reduce-scatter, all-reduce, stage3-fetch "
                     "(the default leaves stage3-fetch out with --backend "
                     "nccl)")
          ->capture_default_str();
  app.add_option("--sizes", f.sizes,
                 "message bytes, comma-separated, 1K..16G (K/M/G suffixes)")
      ->capture_default_str();
  app.add_option("--type", f.type, "float32 or bfloat16")
      ->capture_default_str();
  app.add_option("--iters", f.iters, "timed iterations per size, 1..100000")
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "untimed iterations first, 0..1000")
      ->capture_default_str();
  app.add_option("--timeout", f.timeout,
                 "seconds a collective may wait for the others, > 0 and "
                 "<= 1000000")
      ->capture_default_str();
  app.add_option("--comm-memory", f.comm_memory,
                 "stage3-fetch's engine gathers on host memory or, as with "
                 "NCCL, on device memory (host, device)")
      ->capture_default_str();
  app.add_option("--json", f.json, "also write the results here (rank 0)");
}

// --type's element type (a checked value).
CommType TypeOf(const std::string& type) {
  return type == "float32" ? CommType::kFloat32 : CommType::kBFloat16;
}

// Open MPI, MPICH and Slurm's PMI say how many ranks were launched.
bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

StatusOr<CommConfig> ParseComm(const CommFlags& f) {
  CommConfig c;
  STRATA_ASSIGN_OR_RETURN(c.backend,
                          ParseChoiceOption("--backend", f.backend,
                                            {"auto", "single", "mpi", "nccl"}));
  if (c.backend == "auto") c.backend = LaunchedByMpi() ? "mpi" : "single";
  STRATA_ASSIGN_OR_RETURN(
      c.ops, ParseChoiceListOption(
                 "--ops", f.ops,
                 {"all-gather", "reduce-scatter", "all-reduce", kStage3}));
  const bool stage3 =
      std::find(c.ops.begin(), c.ops.end(), kStage3) != c.ops.end();
  const bool ops_given = f.ops_option != nullptr && f.ops_option->count() > 0;
  if (c.backend == "nccl" && stage3 && !ops_given) {
    c.ops.erase(std::find(c.ops.begin(), c.ops.end(), kStage3));
  } else if (c.backend == "nccl" && stage3) {
    return Status::InvalidArgument(
        "--ops: stage3-fetch runs the engine on the host-emulated device, "
        "where NCCL cannot run; --backend mpi with --comm-memory device "
        "runs the engine's NCCL path (collectives on device memory) there");
  }
  STRATA_ASSIGN_OR_RETURN(
      c.comm_memory,
      ParseChoiceOption("--comm-memory", f.comm_memory, {"host", "device"}));
  STRATA_ASSIGN_OR_RETURN(
      c.sizes, ParseSizeListOption("--sizes", f.sizes, 1024, kMaxMessage));
  STRATA_ASSIGN_OR_RETURN(
      c.type, ParseChoiceOption("--type", f.type, {"float32", "bfloat16"}));
  // A message is whole elements: a ragged tail would be left out of the
  // collective while counted in the figures.
  const size_t elem = CommTypeSize(TypeOf(c.type));
  for (uint64_t s : c.sizes) {
    if (s % elem != 0) {
      return Status::InvalidArgument(
          "--sizes: " + std::to_string(s) + " bytes is not a multiple of " +
          std::to_string(elem) + " bytes, the size of one " + c.type +
          " element (--type)");
    }
  }
  STRATA_ASSIGN_OR_RETURN(int64_t iters,
                          ParseIntOption("--iters", f.iters, 1, 100000));
  STRATA_ASSIGN_OR_RETURN(int64_t warmup,
                          ParseIntOption("--warmup", f.warmup, 0, 1000));
  c.iters = static_cast<int>(iters);
  c.warmup = static_cast<int>(warmup);
  STRATA_ASSIGN_OR_RETURN(
      c.timeout_s, ParseDoubleOption("--timeout", f.timeout, 0, 1e6, true));
  c.json = f.json;
  return c;
}

// ---- Check -----------------------------------------------------------------

struct CommPrepared {
  JsonOutput json;
  std::optional<Communicator> host;  // barriers, timing agreement
  std::optional<Communicator> nccl;  // --backend nccl
  std::unique_ptr<Device> device;    // --backend nccl
  std::unique_ptr<Stream> stream;

  Communicator& measured() { return nccl ? *nccl : *host; }
};

Status MakeCommunicators(const CommConfig& c, CommPrepared& p) {
  CommOptions o;
  o.timeout_s = c.timeout_s;
  // NCCL is bootstrapped over MPI under mpirun, else over one rank (a GPU
  // machine without MPI runs it on one GPU).
  const bool single =
      c.backend == "single" || (c.backend == "nccl" && !LaunchedByMpi());
  o.backend = single ? CommBackendKind::kSingle : CommBackendKind::kMpi;
  STRATA_ASSIGN_OR_RETURN(p.host, Communicator::Create(o));
  if (c.backend != "nccl") return Status::Ok();
  DeviceOptions d;
  d.choice = DeviceChoice::kCuda;
  STRATA_ASSIGN_OR_RETURN(p.device, NewDevice(d));
  STRATA_ASSIGN_OR_RETURN(p.stream, p.device->NewStream({}));
  CommOptions n;
  n.backend = CommBackendKind::kNccl;
  n.timeout_s = c.timeout_s;
  n.nccl_bootstrap = &*p.host;
  STRATA_ASSIGN_OR_RETURN(p.nccl, Communicator::Create(n));
  return Status::Ok();
}

bool HasStage3(const CommConfig& c) {
  return std::find(c.ops.begin(), c.ops.end(), kStage3) != c.ops.end();
}

// Whether any op besides stage3-fetch runs (the collectives' own buffers).
bool HasPlainOps(const CommConfig& c) {
  return c.ops.size() > (HasStage3(c) ? 1u : 0u);
}

// Every rank learns whether any failed its checks, so none waits for a rank
// that has left. Rank 0 alone writes the JSON.
StatusOr<CommPrepared> CheckComm(const CommConfig& c) {
  CommPrepared p;
  STRATA_RETURN_IF_ERROR(MakeCommunicators(c, p));
  Status local = Status::Ok();
  if (p.host->rank() == 0 && !c.json.empty()) {
    auto json = JsonOutput::Prepare("--json", c.json);
    if (json.ok()) p.json = std::move(*json);
    local = json.status();
  }
  const uint64_t largest = *std::max_element(c.sizes.begin(), c.sizes.end());
  if (local.ok() && HasPlainOps(c)) {
    local = CheckMemory(
        "the send and receive buffers (2 x the largest --sizes)", 2 * largest);
  }
  if (local.ok() && HasStage3(c)) {
    const Stage3Shape s = Stage3ShapeFor(largest, p.host->size());
    local = CheckMemory(
        "stage3-fetch's engine, device and reference buffers on this rank "
        "(for --sizes " +
            FormatBytes(largest) + ")",
        Stage3HostBytes(s));
  }
  float failed = local.ok() ? 0 : 1;
  STRATA_ASSIGN_OR_RETURN(
      CommWork w, p.host->AllReduce(&failed, &failed, 1, CommType::kFloat32,
                                    ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(w.Wait());
  STRATA_RETURN_IF_ERROR(local);
  if (failed != 0) {
    return Status::Aborted("another rank failed its checks (see its message)");
  }
  return p;
}

// ---- Run -------------------------------------------------------------------

// Send and receive buffers of `bytes` each, on the host or the GPU.
struct Buffers {
  HostBuffer host_send, host_recv;
  DeviceMemory dev_send, dev_recv;
  void* send() { return dev_send.empty() ? host_send.data() : dev_send.data(); }
  void* recv() { return dev_recv.empty() ? host_recv.data() : dev_recv.data(); }
};

StatusOr<Buffers> AllocateBuffers(CommPrepared& p, uint64_t bytes) {
  Buffers b;
  if (p.device != nullptr) {
    STRATA_ASSIGN_OR_RETURN(b.dev_send, p.device->Allocate(bytes, *p.stream));
    STRATA_ASSIGN_OR_RETURN(b.dev_recv, p.device->Allocate(bytes, *p.stream));
    STRATA_RETURN_IF_ERROR(
        p.device->MemsetAsync(*p.stream, b.dev_send.data(), 0, bytes));
    return b;
  }
  STRATA_ASSIGN_OR_RETURN(b.host_send, HostBuffer::Allocate(bytes, {}));
  STRATA_ASSIGN_OR_RETURN(b.host_recv, HostBuffer::Allocate(bytes, {}));
  std::memset(b.host_send.data(), 0, bytes);  // zeros: no NaN, no overflow
  return b;
}

// One collective of `bytes` (S, as nccl-tests), waited for.
Status RunOnce(CommPrepared& p, Buffers& b, const std::string& op,
               uint64_t bytes, CommType type) {
  Communicator& comm = p.measured();
  const size_t count = bytes / CommTypeSize(type);
  const std::vector<size_t> counts = ShardCounts(count, comm.size());
  CommPlace place{p.device.get(), p.stream.get()};
  StatusOr<CommWork> w =
      op == "all-gather"
          ? comm.AllGather(b.send(), b.recv(), counts, type, place)
      : op == "reduce-scatter" ? comm.ReduceScatter(b.send(), b.recv(), counts,
                                                    type, ReduceOp::kSum, place)
                               : comm.AllReduce(b.send(), b.recv(), count, type,
                                                ReduceOp::kSum, place);
  if (!w.ok()) return w.status();
  return w->Wait();
}

// The slowest rank's seconds of `pass`, which starts after a barrier.
StatusOr<double> Slowest(CommPrepared& p,
                         const std::function<StatusOr<double>()>& pass) {
  STRATA_RETURN_IF_ERROR(p.host->Barrier());
  STRATA_ASSIGN_OR_RETURN(double s, pass());
  float secs = static_cast<float>(s);
  STRATA_ASSIGN_OR_RETURN(
      CommWork w,
      p.host->AllReduce(&secs, &secs, 1, CommType::kFloat32, ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(w.Wait());
  return static_cast<double>(secs);
}

StatusOr<Row> Measure(const CommConfig& c, CommPrepared& p, Buffers& b,
                      const std::string& op, uint64_t bytes) {
  const CommType type = TypeOf(c.type);
  for (int i = 0; i < c.warmup; ++i) {
    STRATA_RETURN_IF_ERROR(RunOnce(p, b, op, bytes, type));
  }
  STRATA_ASSIGN_OR_RETURN(
      const double secs, Slowest(p, [&]() -> StatusOr<double> {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < c.iters; ++i) {
          STRATA_RETURN_IF_ERROR(CheckInterrupted());
          STRATA_RETURN_IF_ERROR(RunOnce(p, b, op, bytes, type));
        }
        return SecondsSince(t0);
      }));
  const double n = p.measured().size();
  Row r{op, bytes, secs / c.iters};
  r.algbw = static_cast<double>(bytes) / r.seconds / 1e9;
  r.busbw = r.algbw * (op == "all-reduce" ? 2 : 1) * (n - 1) / n;
  return r;
}

// ---- Run: stage3-fetch ------------------------------------------------------

// The value tensor `t` holds at element `i`: a small integer, exact in bf16,
// that differs between neighbouring elements and tensors.
float Stage3Value(uint64_t t, uint64_t i) {
  return static_cast<float>(static_cast<int>((i + 37 * t) % 251) - 125);
}

std::string Hex16(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%04x", v & 0xffffu);
  return buf;
}

// One rank's engine and the device it runs on (destroyed first).
struct Stage3Rig {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;  // the check's copies
  std::unique_ptr<Engine> engine;
  std::vector<TensorId> ids;

  ~Stage3Rig() {
    engine.reset();
    stream.reset();
  }
};

StatusOr<std::unique_ptr<Stage3Rig>> MakeStage3Rig(const Stage3Shape& s,
                                                   const CommConfig& c,
                                                   CommPrepared& p) {
  auto rig = std::make_unique<Stage3Rig>();
  // With the collectives on device memory the engine takes their buffers
  // (at most a staging buffer and 64 KiB) and its two gradient buckets
  // (kStage3BucketBytes of bf16: twice that in fp32 each, rounded up to the
  // ranks' alignment; twice that again is set aside) from its budget: the
  // arena stays as large as with host memory.
  const bool on_device = c.comm_memory == "device";
  const uint64_t coll_bytes =
      on_device ? s.staging_bytes + (64 << 10) + 2 * (4 * kStage3BucketBytes)
                : 0;
  DeviceOptions d;
  d.choice = DeviceChoice::kHostEmulated;
  d.memory_budget_bytes = s.budget_bytes + coll_bytes + (uint64_t{64} << 20);
  STRATA_ASSIGN_OR_RETURN(rig->device, NewDevice(d));
  STRATA_ASSIGN_OR_RETURN(rig->stream, rig->device->NewStream({}));
  EngineOptions o;
  o.rank = p.host->rank();
  o.world_size = p.host->size();
  o.zero_stage = 3;
  if (o.world_size > 1) {
    // The engine's own communicator: nothing else may use its one.
    STRATA_ASSIGN_OR_RETURN(Communicator dup, p.host->Duplicate());
    o.comm = std::make_shared<Communicator>(std::move(dup));
  }
  o.params = Residence::kHost;
  o.optimizer_states = Residence::kHost;
  o.grads = Residence::kHost;
  o.partition_bytes = s.partition_bytes;
  o.staging_buffer_bytes = s.staging_bytes;
  o.staging_buffer_count = s.staging_count;
  o.device_budget_bytes = s.budget_bytes + coll_bytes;
  o.prefetch_bytes = s.prefetch_bytes;
  o.persistence_threshold_bytes = 0;  // every unit is gathered every pass
  o.comm_memory = on_device ? CommMemory::kDevice : CommMemory::kHost;
  if (on_device) o.reduce_bucket_bytes = kStage3BucketBytes;
  STRATA_ASSIGN_OR_RETURN(rig->engine, Engine::Create(o, rig->device.get()));
  for (uint64_t i = 0; i < s.tensors; ++i) {
    TensorSpec t;
    t.name = "p" + std::to_string(i);
    t.shape = {static_cast<int64_t>(s.bytes(i) / 2)};
    STRATA_ASSIGN_OR_RETURN(TensorId id, rig->engine->Register(t));
    rig->ids.push_back(id);
  }
  STRATA_RETURN_IF_ERROR(rig->engine->Start());  // a collective
  std::vector<float> values(s.tensor_bytes / 2);
  for (uint64_t i = 0; i < s.tensors; ++i) {
    const uint64_t n = s.bytes(i) / 2;
    for (uint64_t k = 0; k < n; ++k) values[k] = Stage3Value(i, k);
    STRATA_RETURN_IF_ERROR(rig->engine->SetInitialValues(
        rig->ids[i], std::span<const float>(values.data(), n)));
  }
  return rig;
}

// Ends the pass's step: the order it fetched in becomes the one the engine
// prefetches along, and the applied step (lr 0, no gradient: nothing
// changes) drops every cached device copy. A collective.
Status EndStage3Step(Stage3Rig& rig) {
  StepArgs a;
  a.lr = 0;
  STRATA_ASSIGN_OR_RETURN(StepResult r, rig.engine->Step(a));
  if (!r.applied) {
    return Status::Internal(
        "stage3-fetch: a step without gradients was "
        "skipped");
  }
  return Status::Ok();
}

struct Stage3Pass {
  double seconds = 0;
  uint64_t h2d_bytes = 0, cache_hits = 0, prefetch_hits = 0;
  double stall_seconds = 0;
};

// Every tensor fetched in order, waited for on the host and released.
StatusOr<Stage3Pass> FetchPass(Stage3Rig& rig) {
  const EngineStats before = rig.engine->stats();
  const auto t0 = std::chrono::steady_clock::now();
  for (TensorId id : rig.ids) {
    STRATA_ASSIGN_OR_RETURN(ParamPin pin, rig.engine->Fetch(id));
    STRATA_RETURN_IF_ERROR(pin.Wait());
  }
  Stage3Pass r;
  r.seconds = SecondsSince(t0);
  const EngineStats after = rig.engine->stats();
  r.h2d_bytes = after.h2d_bytes - before.h2d_bytes;
  r.prefetch_hits = after.prefetch_hits - before.prefetch_hits;
  r.cache_hits = after.fetch_hits - before.fetch_hits - r.prefetch_hits;
  r.stall_seconds = after.stall_seconds - before.stall_seconds;
  return r;
}

// Every unit all-gathered alone, as the engine cuts it: this rank's shard
// of unit i from `shards`, into one of two unit-sized buffers in turn.
StatusOr<double> ReferencePass(const Stage3Shape& s, Communicator& comm,
                               HostBuffer& shards, HostBuffer (&recv)[2]) {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t offset = 0;
  for (uint64_t i = 0; i < s.tensors; ++i) {
    const std::vector<size_t> counts(static_cast<size_t>(s.ranks), s.shard(i));
    STRATA_ASSIGN_OR_RETURN(
        CommWork w, comm.AllGather(shards.data() + offset, recv[i % 2].data(),
                                   counts, CommType::kByte));
    STRATA_RETURN_IF_ERROR(w.Wait());
    offset += s.shard(i);
  }
  return SecondsSince(t0);
}

// The engine's pass was a true fetch of every unit.
Status CheckPass(const Stage3Shape& s, const Stage3Pass& pass) {
  if (pass.cache_hits != 0 || pass.h2d_bytes != s.gathered_bytes()) {
    return Status::Internal(
        "stage3-fetch: a pass found " + std::to_string(pass.cache_hits) +
        " units cached on the device and moved " +
        std::to_string(pass.h2d_bytes) + " bytes to it, where every one of " +
        std::to_string(s.tensors) + " units (" +
        std::to_string(s.gathered_bytes()) +
        " bytes) should have been gathered");
  }
  return Status::Ok();
}

// The device bytes of the first and the last tensor against their values
// (Stage3Value, exact in bf16). Every rank fetches both (collectives);
// returns how many this rank found wrong, in `bad`.
Status CheckData(const Stage3Shape& s, Stage3Rig& rig, std::string* bad) {
  std::vector<uint64_t> which = {0};
  if (s.tensors > 1) which.push_back(s.tensors - 1);
  STRATA_ASSIGN_OR_RETURN(HostBuffer got,
                          HostBuffer::Allocate(s.tensor_bytes, {}));
  for (uint64_t t : which) {
    STRATA_ASSIGN_OR_RETURN(ParamPin pin, rig.engine->Fetch(rig.ids[t]));
    STRATA_RETURN_IF_ERROR(pin.WaitOn(*rig.stream));
    STRATA_RETURN_IF_ERROR(rig.device->CopyAsync(*rig.stream, got.data(),
                                                 pin.data(), s.bytes(t),
                                                 CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(rig.device->SynchronizeStream(*rig.stream));
    const auto* bits = reinterpret_cast<const uint16_t*>(got.data());
    for (uint64_t k = 0; k < s.bytes(t) / 2; ++k) {
      const float v = Stage3Value(t, k);
      uint32_t f;
      std::memcpy(&f, &v, sizeof f);
      if (bits[k] != static_cast<uint16_t>(f >> 16)) {
        if (bad->empty()) {
          *bad = "tensor p" + std::to_string(t) + " element " +
                 std::to_string(k) + " is bf16 " + Hex16(bits[k]) +
                 " after the gather, not " + Hex16(f >> 16) + " (" +
                 std::to_string(v) + ")";
        }
        break;
      }
    }
  }
  return Status::Ok();
}

// Every rank's `bad` agreed: an error on every rank when any found one.
Status AgreeData(CommPrepared& p, const std::string& bad) {
  float mine = bad.empty() ? 0.0f : static_cast<float>(p.host->rank() + 1);
  STRATA_ASSIGN_OR_RETURN(
      CommWork w,
      p.host->AllReduce(&mine, &mine, 1, CommType::kFloat32, ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(w.Wait());
  if (!bad.empty()) {
    return Status::Corruption("stage3-fetch: wrong data on rank " +
                              std::to_string(p.host->rank()) + ": " + bad);
  }
  if (mine != 0) {
    return Status::Corruption("stage3-fetch: rank " +
                              std::to_string(static_cast<int>(mine) - 1) +
                              " fetched wrong data (its message says where)");
  }
  return Status::Ok();
}

StatusOr<Row> MeasureStage3(const CommConfig& c, CommPrepared& p,
                            uint64_t bytes) {
  Stage3Result r;
  const Stage3Shape& s = r.shape = Stage3ShapeFor(bytes, p.host->size());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Rig> rig,
                          MakeStage3Rig(s, c, p));
  // The reference's shards (this rank's part of every unit) and buffers.
  HostBufferOptions ho;
  ho.prefault = true;
  STRATA_ASSIGN_OR_RETURN(
      HostBuffer shards,
      HostBuffer::Allocate(s.gathered_bytes() / s.ranks, ho));
  std::memset(shards.data(), 0x3c, shards.size());
  HostBuffer recv[2];
  for (HostBuffer& b : recv) {
    STRATA_ASSIGN_OR_RETURN(b, HostBuffer::Allocate(s.unit_bytes, ho));
  }
  // Untimed: the pass that records the order, and one reference pass.
  STRATA_ASSIGN_OR_RETURN(Stage3Pass first, FetchPass(*rig));
  STRATA_RETURN_IF_ERROR(CheckPass(s, first));
  STRATA_RETURN_IF_ERROR(EndStage3Step(*rig));
  STRATA_RETURN_IF_ERROR(ReferencePass(s, *p.host, shards, recv).status());
  r.pass_h2d_bytes = first.h2d_bytes;
  for (int rep = 0; rep < c.warmup + c.iters; ++rep) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    Stage3Pass pass;
    auto fetch = [&]() -> StatusOr<double> {
      STRATA_ASSIGN_OR_RETURN(double secs,
                              Slowest(p, [&]() -> StatusOr<double> {
                                STRATA_ASSIGN_OR_RETURN(pass, FetchPass(*rig));
                                return pass.seconds;
                              }));
      STRATA_RETURN_IF_ERROR(CheckPass(s, pass));
      STRATA_RETURN_IF_ERROR(EndStage3Step(*rig));
      return secs;
    };
    auto reference = [&]() {
      return Slowest(p,
                     [&] { return ReferencePass(s, *p.host, shards, recv); });
    };
    double fetch_s = 0, ref_s = 0;
    if (rep % 2 == 0) {
      STRATA_ASSIGN_OR_RETURN(fetch_s, fetch());
      STRATA_ASSIGN_OR_RETURN(ref_s, reference());
    } else {
      STRATA_ASSIGN_OR_RETURN(ref_s, reference());
      STRATA_ASSIGN_OR_RETURN(fetch_s, fetch());
    }
    if (rep < c.warmup) continue;
    r.fetch_s.push_back(fetch_s);
    r.ref_s.push_back(ref_s);
    r.paired_ratios.push_back(ref_s / fetch_s);
    r.prefetch_hits += pass.prefetch_hits;
    r.stall_seconds += pass.stall_seconds;
  }
  std::string bad;
  STRATA_RETURN_IF_ERROR(CheckData(s, *rig, &bad));
  STRATA_RETURN_IF_ERROR(AgreeData(p, bad));
  r.checked_tensors = s.tensors > 1 ? 2 : 1;
  r.stats = rig->engine->stats();
  const double n = static_cast<double>(c.iters);
  r.fetch_mean = std::accumulate(r.fetch_s.begin(), r.fetch_s.end(), 0.0) / n;
  r.ref_mean = std::accumulate(r.ref_s.begin(), r.ref_s.end(), 0.0) / n;
  r.ratio = r.ref_mean / r.fetch_mean;
  std::vector<double> sorted = r.paired_ratios;
  r.paired = Percentile(sorted, 50);
  Row row{kStage3, bytes, r.fetch_mean};
  const double ranks = s.ranks;
  row.algbw = static_cast<double>(s.gathered_bytes()) / row.seconds / 1e9;
  row.busbw = row.algbw * (ranks - 1) / ranks;
  row.stage3 = std::move(r);
  return row;
}

StatusOr<std::vector<Row>> RunComm(const CommConfig& c, CommPrepared& p) {
  const uint64_t largest = *std::max_element(c.sizes.begin(), c.sizes.end());
  Buffers b;  // for the collectives alone (stage3-fetch has its own)
  if (HasPlainOps(c)) {
    STRATA_ASSIGN_OR_RETURN(b, AllocateBuffers(p, largest));
  }
  std::vector<Row> rows;
  Progress progress(c.ops.size() * c.sizes.size());
  for (const std::string& op : c.ops) {
    for (uint64_t bytes : c.sizes) {
      if (p.host->rank() == 0) progress.Step(op + " " + FormatBytes(bytes));
      auto r = op == kStage3 ? MeasureStage3(c, p, bytes)
                             : Measure(c, p, b, op, bytes);
      if (!r.ok()) return r.status().WithContext(op + " " + FormatBytes(bytes));
      rows.push_back(*r);
    }
  }
  if (p.stream != nullptr) {
    STRATA_RETURN_IF_ERROR(p.device->SynchronizeStream(*p.stream));
  }
  return rows;
}

// ---- Report ----------------------------------------------------------------

nlohmann::json Stage3ShapeJson(const Stage3Shape& s) {
  return {{"size", s.size},
          {"dtype", "bf16"},
          {"tensors", s.tensors},
          {"tensor_bytes", s.tensor_bytes},
          {"last_tensor_bytes", s.last_bytes},
          {"units", s.tensors},
          {"unit_bytes", s.unit_bytes},
          {"last_unit_bytes", s.last_unit_bytes},
          {"gathered_bytes", s.gathered_bytes()},
          {"shard_bytes", s.shard(0)},
          {"partition_bytes", s.partition_bytes},
          {"staging_buffer_bytes", s.staging_bytes},
          {"staging_buffer_count", s.staging_count},
          {"round_elems_per_rank", s.round_elems},
          {"rounds_per_unit", s.rounds_per_unit()},
          {"prefetch_bytes", s.prefetch_bytes},
          {"device_budget_units", s.budget_units},
          {"device_budget_bytes", s.budget_bytes}};
}

nlohmann::json Stage3Json(const Stage3Result& r) {
  return {{"shape", Stage3ShapeJson(r.shape)},
          {"fetch_seconds", r.fetch_s},
          {"allgather_seconds", r.ref_s},
          {"allgather_mean_seconds", r.ref_mean},
          {"allgather_algbw_gbps",
           static_cast<double>(r.shape.gathered_bytes()) / r.ref_mean / 1e9},
          {"ratio", r.ratio},
          {"paired_ratio", r.paired},
          {"paired_ratios", r.paired_ratios},
          {"pass_h2d_bytes", r.pass_h2d_bytes},
          {"prefetch_hits", r.prefetch_hits},
          {"stall_seconds", r.stall_seconds},
          {"checked_tensors", r.checked_tensors},
          {"engine_stats", nlohmann::json::parse(EngineStatsJson(r.stats))}};
}

Status ReportComm(const CommConfig& c, CommPrepared& p,
                  const std::vector<Row>& rows) {
  if (p.host->rank() != 0) return Status::Ok();
  Communicator& comm = p.measured();
  std::printf("strata-bench comm: %s, %d ranks, %s, %d iterations\n\n",
              std::string(CommBackendName(comm.backend())).c_str(), comm.size(),
              c.type.c_str(), c.iters);
  Table table({"op", "size", "time us", "algbw GB/s", "busbw GB/s",
               "all-gather us", "ratio", "paired"});
  nlohmann::json jr = nlohmann::json::array();
  std::vector<RatioFigure> figures;
  for (const Row& r : rows) {
    const Stage3Result* s3 = r.stage3 ? &*r.stage3 : nullptr;
    table.AddRow({r.op, FormatBytes(r.bytes), Fixed(r.seconds * 1e6, 1),
                  Fixed(r.algbw, 3), Fixed(r.busbw, 3),
                  s3 ? Fixed(s3->ref_mean * 1e6, 1) : "",
                  s3 ? Fixed(s3->ratio, 3) : "",
                  s3 ? Fixed(s3->paired, 3) : ""});
    nlohmann::json one = {{"op", r.op},
                          {"bytes", r.bytes},
                          {"seconds", r.seconds},
                          {"algbw_gbps", r.algbw},
                          {"busbw_gbps", r.busbw}};
    if (s3) {
      one.update(Stage3Json(*s3));
      figures.push_back({r.op + " " + FormatBytes(r.bytes) + " ratio",
                         s3->ratio, s3->paired});
    }
    jr.push_back(std::move(one));
  }
  std::printf("%s", table.ToString().c_str());
  if (HasStage3(c)) {
    std::printf(
        "\nstage3-fetch: the engine's fetch of every unit (zero_stage 3, "
        "shards on the host, host-emulated device, collectives on %s "
        "memory) against the all-gather alone of the same units; ratio = "
        "all-gather time / fetch time, paired = the median of each "
        "repetition's ratio.\n",
        c.comm_memory.c_str());
    PrintAboveOneNote(figures,
                      "the all-gather alone (the fetch does the same "
                      "all-gathers and more)");
  }
  if (!p.json.active()) return Status::Ok();
  nlohmann::json out;
  out["command"] = kCommand;
  out["machine"] = MachineInfo();
  out["ranks"] = comm.size();
  out["config"] = {{"backend", c.backend},    {"ops", c.ops},
                   {"sizes", c.sizes},        {"type", c.type},
                   {"iters", c.iters},        {"warmup", c.warmup},
                   {"timeout_s", c.timeout_s}};
  if (HasStage3(c)) {
    nlohmann::json shapes = nlohmann::json::array();
    for (uint64_t bytes : c.sizes) {
      shapes.push_back(Stage3ShapeJson(Stage3ShapeFor(bytes, comm.size())));
    }
    out["config"]["stage3"] = {
        {"ranks", comm.size()},
        {"zero_stage", 3},
        {"device", "host-emulated"},
        {"params_rest_on", "host"},
        {"optimizer_states_rest_on", "host"},
        {"grads_rest_on", "host"},
        {"comm_memory", c.comm_memory},
        {"reduce_bucket_bytes",
         c.comm_memory == "device" ? kStage3BucketBytes : 0},
        {"pin_memory", true},
        {"persistence_threshold_bytes", 0},
        {"between_passes", "Step with lr 0 and no gradient"},
        {"shapes", std::move(shapes)}};
  }
  out["results"] = std::move(jr);
  return p.json.Commit(out);
}

int Main(int argc, char** argv) {
  CLI::App app{"collective bandwidth by message size (run under mpirun)",
               "strata-bench comm"};
  CommFlags flags;
  AddOptions(app, flags);
  CommConfig cfg;
  CommPrepared prepared;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseComm(flags));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(prepared, CheckComm(cfg));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(std::vector<Row> rows, RunComm(cfg, prepared));
        return ReportComm(cfg, prepared, rows);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("comm",
                     "all-gather, reduce-scatter, all-reduce bandwidth (MPI, "
                     "NCCL); the engine's stage-3 fetch vs the all-gather",
                     Main);

}  // namespace strata::bench
