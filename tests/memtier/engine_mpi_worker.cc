// Runs under mpirun (tests/memtier/engine_mpi_test.cc starts it):
//   engine_mpi_worker <plugin> train
//       for zero_stage 1 and 2 (parameters on the device) and 3 (each
//       rank's shard of the parameters on host or NVMe, gathered by Fetch,
//       with a device budget that forces evictions), optimizer states on
//       host and on NVMe, and gradients on NVMe: a model trained over the
//       ranks (each rank handing over the gradients of its own data) ends
//       with the masters of one engine trained alone on the whole batch,
//       within rounding; the working copy is the master's rounding on every
//       rank; a gradient overflow on one rank skips the step on all; each
//       rank's optimizer state is 1/N of the single engine's, and with
//       stage 3 its host memory too.
//   engine_mpi_worker <plugin> statistics
//       zero_stage 2 and 3 with BeginStep, AdamW, Adafactor and SM3: the
//       gradient statistics each rank's stepper takes of its shard during
//       backward leave the masters, norms and skipped steps of Step alone,
//       bit for bit.
//   engine_mpi_worker <plugin> errors
//       the option combinations refused with several ranks.
//   engine_mpi_worker <plugin> ckpt-save DIR
//       for each checkpoint case (stage, states on host or NVMe, moment
//       format): trains on this world's ranks, saves after kSteps steps into
//       DIR and goes on (the uninterrupted run); a second run loads that
//       checkpoint and goes on: masters bit for bit the first run's. Rank 0
//       writes the masters at the save beside the checkpoint.
//   engine_mpi_worker <plugin> ckpt-load DIR W
//       loads each case's checkpoint saved on W ranks at this world size:
//       the masters right after the load are the saved ones bit for bit,
//       and the steps after it stay within 1e-4 of one engine trained alone
//       on the same data; int8 moments at another world size are refused.
//   engine_mpi_worker <plugin> step-fault
//       zero_stage 2 and 3, optimizer states on NVMe: the last rank's
//       write-backs fail (EIO) in the third step; zero_stage 2, gradients
//       on NVMe: its gradient writes fail from the third step's hand-overs
//       on. Every rank's Step fails at once (well within the communicator's
//       60 s timeout), the others naming that rank; once an update has
//       begun, every engine refuses further use. Also with the collectives
//       on device memory, and an AddGrad refused on the caller's thread
//       (also after BeginStep, the other ranks taking statistics).
//   engine_mpi_worker <plugin> gather-fault
//       zero_stage 3, parameters on NVMe: the last rank's reads fail from
//       the third step; every rank's fetch fails at once naming that rank,
//       with the collectives on host and on device memory.
//   engine_mpi_worker <plugin> ckpt-fail DIR
//       a writer rank without a writer, a disk that fills during the save
//       and a commit that fails: every rank gets the same error, and the
//       checkpoint directory keeps only the earlier checkpoint.
// Prints "rank R: CASE: ok ..." per case, "FAIL ..." otherwise; exit 0 when
// every case passes.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "swap/backend.h"
#include "swap/fault_backend.h"
#include "tests/memtier/memory_checkpoint.h"
#include "tests/memtier/small_engine_options.h"
#include "tests/util/scratch_dir.h"
#include "util/half.h"

namespace strata {
namespace {

constexpr int kSteps = 4;
constexpr int kMicro = 2;
constexpr int kOverflowStep = 2;  // the last rank's gradient has an inf
constexpr double kClip = 2.0;

using testing::ScratchDir;

// One tensor a unit of its own (two pieces per shard), one smaller, and
// seven packed into two units; two of them never get a gradient, so that
// zero_stage 2 keeps buckets open across hand-overs.
std::vector<TensorSpec> Specs() {
  std::vector<TensorSpec> s;
  s.push_back({"big", {300, 200}, ElementType::kBFloat16});
  s.push_back({"mid", {5000}, ElementType::kBFloat16});
  for (int i = 0; i < 7; ++i) {
    s.push_back(
        {"small" + std::to_string(i), {30, 100}, ElementType::kBFloat16});
  }
  return s;
}
bool HasGrad(size_t i) { return i != 6 && i != 8; }

uint64_t Numel(const TensorSpec& s) {
  uint64_t n = 1;
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

EngineOptions Base() {
  EngineOptions o = testing::SmallEngineOptions();
  o.loss_scale.mode = LossScaleMode::kDynamic;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  return o;
}

// Checkpoints in a training run (ckpt-* modes).
struct Phases {
  std::string load;            // loaded after Start; steps begin at kSteps
  std::string save;            // saved after kSteps steps
  bool params = false;         // save the working copy too
  int steps = kSteps;          // the last step + 1
  std::vector<int> after;      // the data of steps >= kSteps (empty: same)
  CheckpointFs* fs = nullptr;  // the writer's
  bool null_writer = false;    // rank 0 passes no writer
  bool stop_after_save = false;
  ElementType grad_dtype = ElementType::kFloat32;  // of the hand-overs
  std::vector<TensorSpec> specs = Specs();         // the model
  // BeginStep before each step's last micro-batch, clipping off (called
  // anyway with step_overlap_bytes above 0, which needs it).
  bool begin_step = false;
  bool clip = true;  // max_grad_norm kClip, unless BeginStep is called
  // Every hand-over accumulated before a step's reads are counted: the
  // read-backs of the micro-batches' pieces (Note [Gradients on NVMe])
  // then fall before the count, not in it as the accumulator's pace has it.
  bool wait_grads = false;
};

struct Trained {
  std::string error;  // empty: every call succeeded
  Status saved;       // the save's outcome (Phases::save)
  std::vector<std::vector<float>> at_checkpoint;  // masters saved or loaded
  std::vector<std::vector<float>> masters;
  std::vector<double> norms;
  std::vector<bool> applied;
  double loss_scale = 0;
  bool working_is_master = true;
  EngineStats stats;
  std::vector<uint64_t> step_reads;  // the NVMe bytes each Step read
};

#define CHECK_OK(expr)                                      \
  do {                                                      \
    Status _st = (expr);                                    \
    if (!_st.ok()) {                                        \
      t.error = std::string(#expr) + ": " + _st.ToString(); \
      return t;                                             \
    }                                                       \
  } while (0)
#define ASSIGN_OK(lhs, expr)                                            \
  auto lhs##_or = (expr);                                               \
  if (!lhs##_or.ok()) {                                                 \
    t.error = std::string(#expr) + ": " + lhs##_or.status().ToString(); \
    return t;                                                           \
  }                                                                     \
  auto lhs = std::move(lhs##_or).value()

// The working copy of tensor `id` as fp32, read through Fetch.
Status ReadWorking(Engine& e, Device& dev, Stream& stream, TensorId id,
                   std::vector<float>& out) {
  STRATA_ASSIGN_OR_RETURN(ParamPin pin, e.Fetch(id));
  STRATA_RETURN_IF_ERROR(pin.Wait());
  std::vector<uint16_t> raw(pin.bytes() / 2);
  STRATA_RETURN_IF_ERROR(dev.CopyAsync(stream, raw.data(), pin.data(),
                                       pin.bytes(), CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(dev.SynchronizeStream(stream));
  out.resize(raw.size());
  return ConvertCpuArray(raw.data(), CpuDType::kBFloat16, out.data(),
                         CpuDType::kFloat32, raw.size());
}

// Hands over `g` (fp32, on the host) as tensor `id`'s gradient, through
// device memory the engine then owns.
// `g` as fp32, or rounded to bf16 (dtype kBFloat16).
Status HandOver(Engine& e, Device& dev, Stream& stream, TensorId id,
                const std::vector<float>& g,
                ElementType dtype = ElementType::kFloat32) {
  std::vector<uint16_t> bf16;
  const void* src = g.data();
  size_t bytes = g.size() * 4;
  if (dtype == ElementType::kBFloat16) {
    for (float x : g) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      bf16.push_back(Bf16FromFloatBits(u));
    }
    src = bf16.data();
    bytes = bf16.size() * 2;
  }
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dm, dev.Allocate(bytes, stream));
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(stream, dm.data(), src, bytes, CopyKind::kHostToDevice));
  // The staging vector goes out of scope: the copy must be done first.
  STRATA_RETURN_IF_ERROR(dev.SynchronizeStream(stream));
  return e.AddGrad(id, std::move(dm), dtype, stream);
}

// Trains on the data of ranks `data` of `world` (each rank's gradient
// divided by data.size() when one engine takes them all, as the engine
// averages over ranks).
Trained Train(EngineOptions o, const std::vector<int>& data, int world,
              const Phases& ph = {}) {
  Trained t;
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = 64 << 20;
  dopt.host_compute_threads = 1;
  ASSIGN_OK(dev, NewHostEmulatedDevice(dopt));
  ScratchDir dir;
  if (o.optimizer_states == Residence::kNvme || o.grads == Residence::kNvme ||
      o.params == Residence::kNvme) {
    o.nvme_paths = {dir.path()};
  }
  ASSIGN_OK(eng, Engine::Create(o, dev.get()));
  ASSIGN_OK(stream, dev->NewStream({}));
  const std::vector<TensorSpec>& specs = ph.specs;
  std::vector<TensorId> ids;
  for (const TensorSpec& s : specs) {
    ASSIGN_OK(id, eng->Register(s));
    ids.push_back(id);
  }
  CHECK_OK(eng->Start());
  std::mt19937 init(7);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> w(Numel(specs[i]));
    for (float& x : w) x = nd(init);
    CHECK_OK(eng->SetInitialValues(ids[i], w));
  }
  auto masters = [&](std::vector<std::vector<float>>& out) -> Status {
    for (size_t i = 0; i < specs.size(); ++i) {
      std::vector<float> v(Numel(specs[i]));
      STRATA_RETURN_IF_ERROR(eng->ReadMaster(ids[i], v));
      out.push_back(std::move(v));
    }
    return Status::Ok();
  };
  int first = 0;
  if (!ph.load.empty()) {
    ASSIGN_OK(reader, CheckpointReader::Open(ph.load));
    CHECK_OK(eng->LoadState(*reader));
    CHECK_OK(masters(t.at_checkpoint));
    first = kSteps;
  }
  for (int s = first; s < ph.steps; ++s) {
    if (s == kSteps && !ph.save.empty()) {
      // Rank 0 writes; every rank agrees on each stage's outcome.
      std::unique_ptr<CheckpointWriter> w;
      Status begun;
      if (o.rank == 0 && !ph.null_writer) {
        CheckpointWriterOptions wo;
        wo.dir = ph.save;
        wo.step = kSteps + (ph.fs != nullptr ? 1 : 0);
        wo.fs = ph.fs;
        auto b = CheckpointWriter::Begin(wo);
        begun = b.status();
        if (b.ok()) w = std::move(b).value();
      }
      Status st = eng->Agree(begun);
      if (st.ok()) st = eng->SaveState(w.get(), ph.params);
      if (st.ok()) st = eng->CommitState(w.get()).status();
      t.saved = st;
      w.reset();
      if (ph.stop_after_save) return t;
      CHECK_OK(st);
      CHECK_OK(masters(t.at_checkpoint));
    }
    const std::vector<int>& d =
        s >= kSteps && !ph.after.empty() ? ph.after : data;
    const float share = 1.0f / static_cast<float>(d.size());
    // Updates during backward need clipping off.
    const bool begin = o.step_overlap_bytes > 0 || ph.begin_step;
    StepArgs a;
    a.lr = 1e-2;
    a.max_grad_norm = begin || !ph.clip ? 0.0 : kClip;
    for (int m = 0; m < kMicro; ++m) {
      if (begin && m == kMicro - 1) {
        CHECK_OK(eng->BeginStep(a));
      }
      for (size_t i = 0; i < specs.size(); ++i) {
        if (!HasGrad(i)) continue;
        std::vector<float> w;
        CHECK_OK(ReadWorking(*eng, *dev, *stream, ids[i], w));
        std::vector<float> g(w.size(), 0.0f);
        for (int dr : d) {
          std::mt19937 rng(1000003u * static_cast<uint32_t>(dr) +
                           10007u * static_cast<uint32_t>(s) +
                           101u * static_cast<uint32_t>(m) +
                           static_cast<uint32_t>(i));
          std::normal_distribution<float> z(0.0f, 0.01f);
          for (size_t j = 0; j < g.size(); ++j) {
            g[j] += (0.5f * w[j] + z(rng)) * share;
          }
          if (s == kOverflowStep && m == 0 && i == 0 && dr == world - 1) {
            g[7] = std::numeric_limits<float>::infinity();
          }
        }
        const float scale = static_cast<float>(eng->LossScale());
        for (float& x : g) x *= scale;
        CHECK_OK(HandOver(*eng, *dev, *stream, ids[i], g, ph.grad_dtype));
      }
    }
    if (ph.wait_grads) CHECK_OK(eng->WaitGrads());
    const uint64_t before = eng->stats().nvme_read_bytes;
    ASSIGN_OK(r, eng->Step(a));
    t.step_reads.push_back(eng->stats().nvme_read_bytes - before);
    t.applied.push_back(r.applied);
    t.norms.push_back(r.grad_norm);
  }
  t.loss_scale = eng->LossScale();
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> v(Numel(specs[i]));
    CHECK_OK(eng->ReadMaster(ids[i], v));
    std::vector<float> w;
    CHECK_OK(ReadWorking(*eng, *dev, *stream, ids[i], w));
    std::vector<uint16_t> rounded(v.size());
    std::vector<float> back(v.size());
    CHECK_OK(ConvertCpuArray(v.data(), CpuDType::kFloat32, rounded.data(),
                             CpuDType::kBFloat16, v.size()));
    CHECK_OK(ConvertCpuArray(rounded.data(), CpuDType::kBFloat16, back.data(),
                             CpuDType::kFloat32, v.size()));
    if (std::memcmp(back.data(), w.data(), v.size() * 4) != 0) {
      t.working_is_master = false;
    }
    t.masters.push_back(std::move(v));
  }
  t.stats = eng->stats();
  return t;
}

double MaxDiff(const std::vector<std::vector<float>>& a,
               const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return INFINITY;
    for (size_t j = 0; j < a[i].size(); ++j) {
      const double d = std::fabs(double(a[i][j]) - b[i][j]);
      if (!(d <= m)) m = d;  // NaN sticks
    }
  }
  return m;
}

bool Same(const std::vector<std::vector<float>>& a,
          const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

int Fail(int rank, const std::string& what, const std::string& why) {
  std::printf("FAIL rank %d: %s: %s\n", rank, what.c_str(), why.c_str());
  std::fflush(stdout);
  return 1;
}

// Adafactor, stage 2, each rank's gradient shard on NVMe, one matrix of
// 331 rows of 500 whose shards begin and end mid-row on 2 or 3 ranks, over
// pieces of 16 Ki elements: the statistics fuse the RMS of the whole rows of
// each rank's part (Note [Whole rows from pieces] in memtier/factored.cc),
// so the drive gives the gradient twice a step, and the pieces that hold
// the part's first and last rows once more (at most two a step), where
// SM3 reads it once. A part read whole for the RMS would read it three
// times. The masters agree with one engine on the whole batch.
int CutRowsReadTheirEdgesAgain(const std::shared_ptr<Communicator>& comm,
                               const std::vector<int>& all) {
  const int rank = comm->rank(), world = comm->size();
  const std::string name =
      "adafactor, stage 2, gradients on nvme, a matrix cut mid-row";
  Phases ph;
  ph.specs = {{"cut", {331, 500}, ElementType::kBFloat16}};
  ph.wait_grads = true;
  std::vector<uint64_t> read[2];  // each step's: SM3's, Adafactor's
  std::vector<bool> applied;
  std::string why;
  for (CpuOptimizerAlgo algo :
       {CpuOptimizerAlgo::kSm3, CpuOptimizerAlgo::kAdafactor}) {
    EngineOptions o = Base();
    o.optimizer.cpu.algo = algo;
    o.zero_stage = 2;
    o.grads = Residence::kNvme;
    const Trained one = Train(o, all, world, ph);
    o.rank = rank;
    o.world_size = world;
    o.comm = comm;
    const Trained many = Train(o, {rank}, world, ph);
    if (!one.error.empty() || !many.error.empty()) {
      return Fail(rank, name, one.error + " / " + many.error);
    }
    const double diff = MaxDiff(one.masters, many.masters);
    if (!(diff <= 1e-4)) why += " masters differ by " + std::to_string(diff);
    read[algo == CpuOptimizerAlgo::kSm3 ? 0 : 1] = many.step_reads;
    applied = many.applied;
  }
  // A piece of the gradient: the staging buffer's bytes. The rank's part
  // of the matrix: a world-th of it, give or take the unit's padding.
  const uint64_t piece = Base().staging_buffer_bytes;
  const uint64_t elems = 331 * 500;
  const uint64_t part_lo = elems / world * 4 - 4096;
  const uint64_t part_hi = (elems + world - 1) / world * 4 + 4096;
  // Beside SM3's step (the shards' reduction and the update), Adafactor's
  // reads the part for its statistics, and for its RMS the pieces that
  // hold the part's first and last rows; a part read whole for the RMS
  // would read it twice.
  if (!(2 * part_lo > part_hi + 2 * piece)) {
    return Fail(rank, name, "the part is too small to tell a third read");
  }
  uint64_t sm3 = 0, adafactor = 0;
  for (size_t s = 0; s < applied.size(); ++s) {
    if (!applied[s]) continue;
    sm3 += read[0][s];
    adafactor += read[1][s];
    const uint64_t extra = read[1][s] - std::min(read[1][s], read[0][s]);
    if (!(extra >= part_lo && extra <= part_hi + 2 * piece)) {
      why += " adafactor's step " + std::to_string(s) + " read " +
             std::to_string(read[1][s]) + " bytes, " + std::to_string(extra) +
             " more than SM3's " + std::to_string(read[0][s]) + ", not " +
             std::to_string(part_lo) + " to " +
             std::to_string(part_hi + 2 * piece) + ";";
    }
  }
  if (!why.empty()) return Fail(rank, name, why);
  std::printf("rank %d: %s: ok (adafactor's steps read %.3f x SM3's bytes)\n",
              rank, name.c_str(),
              static_cast<double>(adafactor) / static_cast<double>(sm3));
  std::fflush(stdout);
  return 0;
}

int TrainCases(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank(), world = comm->size();
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  int rc = 0;
  struct Placement {
    int stage;
    Residence states, grads;
    bool early = false;  // updates during backward
    Residence params = Residence::kDevice;
    uint64_t device_budget = 0;  // 0: automatic
    // reduce_bucket_bytes and allgather_bucket_bytes (0: automatic).
    uint64_t reduce_bucket = 0, allgather_bucket = 0;
    // kDevice: the engine's device-memory path (NCCL's), over MPI on the
    // host-emulated device.
    CommMemory comm_memory = CommMemory::kHost;
  };
  // Stage 3 with a budget below the model's 180 KiB of parameters: fetches
  // evict, and prefetches land while others are fetched.
  constexpr uint64_t kTight = 160 << 10;
  for (const Placement& p :
       {Placement{1, Residence::kHost, Residence::kHost},
        Placement{1, Residence::kNvme, Residence::kHost},
        Placement{2, Residence::kHost, Residence::kHost},
        Placement{2, Residence::kNvme, Residence::kHost},
        Placement{2, Residence::kHost, Residence::kNvme},
        Placement{2, Residence::kNvme, Residence::kHost, true},
        Placement{3, Residence::kHost, Residence::kHost, false,
                  Residence::kHost},
        Placement{3, Residence::kHost, Residence::kHost, false,
                  Residence::kHost, kTight},
        Placement{3, Residence::kNvme, Residence::kNvme, false,
                  Residence::kNvme, kTight},
        // Small buckets: more, smaller reductions and gathers.
        Placement{2, Residence::kHost, Residence::kHost, false,
                  Residence::kDevice, 0, 8 << 10, 4 << 10},
        Placement{3, Residence::kHost, Residence::kHost, false,
                  Residence::kHost, kTight, 8 << 10, 4 << 10},
        // The collectives on device memory.
        Placement{1, Residence::kHost, Residence::kHost, false,
                  Residence::kDevice, 0, 0, 0, CommMemory::kDevice},
        Placement{2, Residence::kNvme, Residence::kNvme, false,
                  Residence::kDevice, 0, 8 << 10, 0, CommMemory::kDevice},
        Placement{2, Residence::kHost, Residence::kHost, true,
                  Residence::kDevice, 0, 0, 0, CommMemory::kDevice},
        // The device buckets and buffers come out of the budget: 64 KiB
        // more leaves the arena below the model still.
        Placement{3, Residence::kHost, Residence::kHost, false,
                  Residence::kHost, kTight + (64 << 10), 8 << 10, 0,
                  CommMemory::kDevice},
        Placement{3, Residence::kNvme, Residence::kNvme, false,
                  Residence::kNvme, kTight + (64 << 10), 8 << 10, 0,
                  CommMemory::kDevice}}) {
    const int stage = p.stage;
    {
      {
        const std::string name =
            "stage " + std::to_string(stage) + ", states " +
            std::string(ResidenceName(p.states)) + ", grads " +
            std::string(ResidenceName(p.grads)) +
            (p.early ? ", updates during backward" : "") +
            (p.stage == 3 ? ", params " + std::string(ResidenceName(p.params))
                          : "") +
            (p.device_budget > 0 ? ", tight device budget" : "") +
            (p.reduce_bucket > 0 ? ", small buckets" : "") +
            (p.comm_memory == CommMemory::kDevice ? ", collectives on device"
                                                  : "");
        EngineOptions o = Base();
        o.zero_stage = stage;
        o.optimizer_states = p.states;
        o.grads = p.grads;
        if (p.early) o.step_overlap_bytes = 1 << 20;
        o.params = p.params;
        o.device_budget_bytes = p.device_budget;
        o.reduce_bucket_bytes = p.reduce_bucket;
        o.allgather_bucket_bytes = p.allgather_bucket;
        o.comm_memory = p.comm_memory;
        const Trained one = Train(o, all, world);
        o.rank = rank;
        o.world_size = world;
        o.comm = comm;
        const Trained many = Train(o, {rank}, world);
        if (!one.error.empty()) {
          rc |= Fail(rank, name, "one rank: " + one.error);
          continue;
        }
        if (!many.error.empty()) {
          rc |= Fail(rank, name, many.error);
          continue;
        }
        std::string why;
        double max_diff = 0;
        for (size_t i = 0; i < one.masters.size(); ++i) {
          for (size_t j = 0; j < one.masters[i].size(); ++j) {
            const double d =
                std::fabs(double(one.masters[i][j]) - many.masters[i][j]);
            if (!(d <= max_diff)) max_diff = d;  // NaN sticks
          }
        }
        if (!(max_diff <= 1e-4)) {
          why += " masters differ by " + std::to_string(max_diff) + ";";
        }
        // Stage 1 and 2 move something: a broken reduction or gather would
        // show as a difference of the order of lr, 1e-2.
        if (one.applied != many.applied) why += " applied steps differ;";
        if (many.applied.size() == kSteps &&
            (many.applied[kOverflowStep] || !many.applied[kOverflowStep + 1])) {
          why += " the overflow step was not the one skipped;";
        }
        for (size_t s = 0; s < one.norms.size() && s < many.norms.size(); ++s) {
          if (!one.applied[s]) continue;
          if (!(std::fabs(one.norms[s] - many.norms[s]) <=
                1e-4 * one.norms[s]) ||
              !(p.early || one.norms[s] > kClip)) {
            why += " step " + std::to_string(s) + " norm " +
                   std::to_string(many.norms[s]) + " vs " +
                   std::to_string(one.norms[s]) + ";";
          }
        }
        if (one.loss_scale != many.loss_scale || many.loss_scale != 512) {
          why += " loss scale " + std::to_string(many.loss_scale) + " vs " +
                 std::to_string(one.loss_scale) + ";";
        }
        // The units whose every tensor has a gradient (all but the packed
        // ones) are updated during backward in the steps without overflow.
        if (p.early && many.stats.early_units == 0) {
          why += " nothing was updated during backward;";
        }
        if (!many.working_is_master) {
          why += " the working copy is not the master's rounding;";
        }
        // 1/N of the optimizer state, give or take each unit's padding.
        const double ratio = double(many.stats.optimizer_state_bytes) * world /
                             double(one.stats.optimizer_state_bytes);
        if (!(ratio >= 1.0 && ratio <= 1.05)) {
          why += " optimizer state " +
                 std::to_string(many.stats.optimizer_state_bytes) +
                 " bytes x " + std::to_string(world) + " ranks vs " +
                 std::to_string(one.stats.optimizer_state_bytes) + ";";
        }
        // Stage 3: every role on the host is this rank's shard (on NVMe
        // the pieces round up to whole I/O blocks).
        const double host = double(many.stats.host.peak_bytes) * world /
                            double(one.stats.host.peak_bytes);
        if (stage == 3 && one.stats.host.peak_bytes > 0 &&
            !(host >= 1.0 && host <= 1.1)) {
          why += " host memory " + std::to_string(many.stats.host.peak_bytes) +
                 " bytes x " + std::to_string(world) + " ranks vs " +
                 std::to_string(one.stats.host.peak_bytes) + ";";
        }
        if (p.device_budget > 0 &&
            (many.stats.evictions == 0 || many.stats.prefetches == 0)) {
          why += " no eviction or no prefetch under the tight budget;";
        }
        // Stage 2: the gradient shard (a third of fp32 master and moments)
        // plus two bucket windows and the reduction's output, each at most
        // a packed unit (partition_bytes, rounded to whole shard blocks),
        // however large a tensor is ("big" spans four windows).
        const uint64_t window =
            (p.reduce_bucket > 0 ? 2 * p.reduce_bucket : 64 << 10) +
            128 * 4 * world;
        if (stage >= 2 &&
            many.stats.grad_bytes >
                many.stats.optimizer_state_bytes / 3 + 3 * window) {
          why +=
              " gradients " + std::to_string(many.stats.grad_bytes) + " bytes;";
        }
        if (!why.empty()) {
          rc |= Fail(rank, name, why);
          continue;
        }
        std::printf(
            "rank %d: %s: ok (max master difference %.3g; optimizer state "
            "%llu bytes, one rank %llu; gradients %llu bytes, one rank "
            "%llu; host %llu bytes, one rank %llu; %llu evictions, %llu "
            "prefetches)\n",
            rank, name.c_str(), max_diff,
            static_cast<unsigned long long>(many.stats.optimizer_state_bytes),
            static_cast<unsigned long long>(one.stats.optimizer_state_bytes),
            static_cast<unsigned long long>(many.stats.grad_bytes),
            static_cast<unsigned long long>(one.stats.grad_bytes),
            static_cast<unsigned long long>(many.stats.host.peak_bytes),
            static_cast<unsigned long long>(one.stats.host.peak_bytes),
            static_cast<unsigned long long>(many.stats.evictions),
            static_cast<unsigned long long>(many.stats.prefetches));
        std::fflush(stdout);
      }
    }
  }
  // bf16 hand-overs, converted on the device into the device buckets
  // (comm_memory device) or on the host into the host buckets: the same
  // fp32 values either way, so the same masters bit for bit.
  for (int stage : {2, 3}) {
    const std::string name = "stage " + std::to_string(stage) +
                             ", bf16 gradients, collectives on device";
    EngineOptions o = Base();
    o.zero_stage = stage;
    o.params = stage == 3 ? Residence::kHost : Residence::kDevice;
    o.rank = rank;
    o.world_size = world;
    o.comm = comm;
    o.reduce_bucket_bytes = 8 << 10;
    Phases bf16;
    bf16.grad_dtype = ElementType::kBFloat16;
    o.comm_memory = CommMemory::kHost;
    const Trained host = Train(o, {rank}, world, bf16);
    o.comm_memory = CommMemory::kDevice;
    const Trained device = Train(o, {rank}, world, bf16);
    if (!host.error.empty() || !device.error.empty()) {
      rc |= Fail(rank, name, host.error + " / " + device.error);
    } else if (!Same(host.masters, device.masters)) {
      rc |= Fail(rank, name,
                 "masters differ from the host path's by " +
                     std::to_string(MaxDiff(host.masters, device.masters)));
    } else {
      std::printf("rank %d: %s: ok (the host path's masters bit for bit)\n",
                  rank, name.c_str());
      std::fflush(stdout);
    }
  }
  // Adafactor and SM3: each tensor's statistics summed (or maxed) over the
  // ranks between the passes, as one engine sees the whole gradient; stage
  // 2 also with each rank's gradient shard on NVMe (read back for
  // Adafactor's passes before the update).
  for (CpuOptimizerAlgo algo :
       {CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kSm3}) {
    for (int variant : {2, 3, 4}) {
      const int stage = variant == 3 ? 3 : 2;
      const std::string name =
          std::string(CpuOptimizerAlgoName(algo)) + ", stage " +
          std::to_string(stage) +
          (variant == 3   ? ", states and params on nvme"
           : variant == 4 ? ", states on host, gradients on nvme"
                          : ", states on host");
      EngineOptions o = Base();
      o.optimizer.cpu.algo = algo;
      o.zero_stage = stage;
      if (stage == 3) {
        o.optimizer_states = Residence::kNvme;
        o.params = Residence::kNvme;
        o.device_budget_bytes = kTight;
      }
      if (variant == 4) o.grads = Residence::kNvme;
      const Trained one = Train(o, all, world);
      o.rank = rank;
      o.world_size = world;
      o.comm = comm;
      const Trained many = Train(o, {rank}, world);
      if (!one.error.empty() || !many.error.empty()) {
        rc |= Fail(rank, name, one.error + " / " + many.error);
        continue;
      }
      const double diff = MaxDiff(one.masters, many.masters);
      std::string why;
      if (!(diff <= 1e-4)) why += " masters differ by " + std::to_string(diff);
      if (one.applied != many.applied) why += " applied steps differ;";
      if (!many.working_is_master) {
        why += " the working copy is not the master's rounding;";
      }
      if (!why.empty()) {
        rc |= Fail(rank, name, why);
        continue;
      }
      std::printf("rank %d: %s: ok (max master difference %.3g)\n", rank,
                  name.c_str(), diff);
      std::fflush(stdout);
    }
  }
  rc |= CutRowsReadTheirEdgesAgain(comm, all);
  return rc;
}

// Stages 2 and 3 with BeginStep: each rank's stepper takes the stats of its
// shard of the units not updated early (and Adafactor's statistics pass)
// during backward. The masters, the norms and the skipped step (the last
// rank's overflow, met by its stepper alone) are those of Step alone, bit
// for bit.
int StatisticsDuringBackward(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank(), world = comm->size();
  int rc = 0;
  struct Case {
    std::string name;
    int stage;
    CpuOptimizerAlgo algo;
    uint64_t step_overlap = 0;  // some units updated early, the rest not
    CommMemory comm_memory = CommMemory::kHost;
  };
  for (const Case& c :
       {Case{"adamw, stage 2", 2, CpuOptimizerAlgo::kAdamW},
        Case{"adamw, stage 2, some units updated early", 2,
             CpuOptimizerAlgo::kAdamW, 96 << 10},
        Case{"adamw, stage 2, collectives on device", 2,
             CpuOptimizerAlgo::kAdamW, 0, CommMemory::kDevice},
        Case{"adamw, stage 3, tight device budget", 3,
             CpuOptimizerAlgo::kAdamW},
        Case{"adafactor, stage 2", 2, CpuOptimizerAlgo::kAdafactor},
        Case{"adafactor, stage 3, tight device budget", 3,
             CpuOptimizerAlgo::kAdafactor},
        Case{"adafactor, stage 3, tight device budget, collectives on device",
             3, CpuOptimizerAlgo::kAdafactor, 0, CommMemory::kDevice},
        Case{"sm3, stage 2", 2, CpuOptimizerAlgo::kSm3}}) {
    const std::string name = "statistics during backward, " + c.name;
    EngineOptions o = Base();
    o.optimizer.cpu.algo = c.algo;
    o.zero_stage = c.stage;
    o.step_overlap_bytes = c.step_overlap;
    o.comm_memory = c.comm_memory;
    if (c.stage == 3) {
      o.params = Residence::kHost;
      o.device_budget_bytes = 160 << 10;  // below the model: evictions
      if (c.comm_memory == CommMemory::kDevice) {
        // The device buckets and buffers come out of the budget too.
        o.device_budget_bytes += 64 << 10;
        o.reduce_bucket_bytes = 8 << 10;
      }
    }
    o.rank = rank;
    o.world_size = world;
    o.comm = comm;
    Phases alone;
    alone.clip = false;
    Phases begun;
    begun.begin_step = true;
    const Trained b = Train(o, {rank}, world, begun);
    o.step_overlap_bytes = 0;  // which would call BeginStep
    const Trained a = Train(o, {rank}, world, alone);
    if (!a.error.empty() || !b.error.empty()) {
      rc |= Fail(rank, name, a.error + " / " + b.error);
      continue;
    }
    std::string why;
    if (!Same(a.masters, b.masters)) {
      why += " masters differ by " +
             std::to_string(MaxDiff(a.masters, b.masters)) + ";";
    }
    if (a.norms != b.norms) why += " norms differ;";
    if (a.applied != b.applied || b.applied.size() != kSteps ||
        b.applied[kOverflowStep]) {
      why += " the overflow step was not the one skipped;";
    }
    if (!b.working_is_master) {
      why += " the working copy is not the master's rounding;";
    }
    if (a.stats.early_statistics != 0 || b.stats.early_statistics == 0) {
      why += " units with statistics during backward: " +
             std::to_string(b.stats.early_statistics) + " (without BeginStep " +
             std::to_string(a.stats.early_statistics) + ");";
    }
    if ((c.step_overlap > 0) != (b.stats.early_units > 0)) {
      why +=
          " units updated early: " + std::to_string(b.stats.early_units) + ";";
    }
    if (c.stage == 3 && (b.stats.evictions == 0 || b.stats.prefetches == 0)) {
      why += " no eviction or no prefetch under the tight budget;";
    }
    if (!why.empty()) {
      rc |= Fail(rank, name, why);
      continue;
    }
    std::printf(
        "rank %d: %s: ok (Step alone's masters and norms bit for bit; %llu "
        "units' statistics and %llu units' updates during backward)\n",
        rank, name.c_str(),
        static_cast<unsigned long long>(b.stats.early_statistics),
        static_cast<unsigned long long>(b.stats.early_units));
    std::fflush(stdout);
  }
  return rc;
}

// The combinations refused with several ranks, each naming what to change.
int ErrorCases(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank(), world = comm->size();
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = 16 << 20;
  auto dev = NewHostEmulatedDevice(dopt);
  if (!dev.ok()) return Fail(rank, "errors", dev.status().ToString());
  struct Case {
    const char* name;
    void (*change)(EngineOptions&);
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {"no comm", [](EngineOptions& o) { o.comm = nullptr; },
       StatusCode::kInvalidArgument, "needs comm"},
      {"rank mismatch",
       [](EngineOptions& o) { o.rank = (o.rank + 1) % o.world_size; },
       StatusCode::kInvalidArgument, "must agree"},
      {"world_size 1 with a bigger comm",
       [](EngineOptions& o) {
         o.world_size = 1;
         o.rank = 0;
       },
       StatusCode::kInvalidArgument, "must agree"},
      {"zero_stage 3 with params on the device",
       [](EngineOptions& o) { o.zero_stage = 3; }, StatusCode::kNotSupported,
       "zero_stage 3 and params on the device"},
      {"updates during backward with zero_stage 3",
       [](EngineOptions& o) {
         o.zero_stage = 3;
         o.params = Residence::kHost;
         o.step_overlap_bytes = 1 << 20;
       },
       StatusCode::kNotSupported, "with zero_stage 3: updates during"},
      {"zero_stage 0", [](EngineOptions& o) { o.zero_stage = 0; },
       StatusCode::kNotSupported, "zero_stage 0"},
      {"grads on nvme with zero_stage 1",
       [](EngineOptions& o) {
         o.zero_stage = 1;
         o.grads = Residence::kNvme;
         o.nvme_paths = {"unused"};
       },
       StatusCode::kNotSupported, "grads on nvme with zero_stage 1"},
      {"updates during backward with zero_stage 1",
       [](EngineOptions& o) {
         o.zero_stage = 1;
         o.step_overlap_bytes = 1 << 20;
       },
       StatusCode::kNotSupported, "with zero_stage 1, which reduces"},
  };
  int rc = 0;
  for (const Case& c : cases) {
    EngineOptions o = Base();
    o.zero_stage = 2;
    o.rank = rank;
    o.world_size = world;
    o.comm = comm;
    c.change(o);
    auto e = Engine::Create(o, dev->get());
    if (e.ok() || e.status().code() != c.code ||
        e.status().message().find(c.says) == std::string::npos) {
      rc |= Fail(rank, c.name,
                 e.ok() ? std::string("accepted") : e.status().ToString());
      continue;
    }
    std::printf("rank %d: %s: refused: %s\n", rank, c.name,
                e.status().ToString().c_str());
  }
  std::fflush(stdout);
  return rc;
}

// ---- Checkpoints over ranks ------------------------------------------------

constexpr int kMore = 2;  // steps after the checkpoint

struct CkptCase {
  const char* name;
  int stage;
  Residence states;
  CpuDType moments;
  bool params;                          // the working copy saved too
  Residence rest = Residence::kDevice;  // where parameters rest
  CommMemory comm_memory = CommMemory::kHost;
  CpuOptimizerAlgo algo = CpuOptimizerAlgo::kAdamW;
};
const CkptCase kCkptCases[] = {
    {"s2-host-fp32", 2, Residence::kHost, CpuDType::kFloat32, false},
    {"s1-nvme-bf16", 1, Residence::kNvme, CpuDType::kBFloat16, false},
    {"s2-nvme-fp32-params", 2, Residence::kNvme, CpuDType::kFloat32, true},
    {"s2-host-int8", 2, Residence::kHost, CpuDType::kBlock8, false},
    {"s3-nvme-fp32-params", 3, Residence::kNvme, CpuDType::kFloat32, true,
     Residence::kNvme},
    {"s3-host-bf16", 3, Residence::kHost, CpuDType::kBFloat16, false,
     Residence::kHost},
    // The collectives on device memory: rank q's pieces reach the writer
    // through the device buffer.
    {"s2-nvme-fp32-params-dev", 2, Residence::kNvme, CpuDType::kFloat32, true,
     Residence::kDevice, CommMemory::kDevice},
    {"s3-host-bf16-dev", 3, Residence::kHost, CpuDType::kBFloat16, true,
     Residence::kHost, CommMemory::kDevice},
    // Statistics per row and column, a vector's per element gathered from
    // the ranks that hold them.
    {"s2-host-adafactor", 2, Residence::kHost, CpuDType::kFloat32, false,
     Residence::kDevice, CommMemory::kHost, CpuOptimizerAlgo::kAdafactor},
    {"s3-nvme-sm3", 3, Residence::kNvme, CpuDType::kFloat32, false,
     Residence::kNvme, CommMemory::kHost, CpuOptimizerAlgo::kSm3},
};

EngineOptions CkptOptions(const CkptCase& c,
                          const std::shared_ptr<Communicator>& comm) {
  EngineOptions o = Base();
  o.optimizer_states = c.states;
  o.optimizer.moment_dtype = c.moments;
  o.optimizer.cpu.algo = c.algo;
  o.params = c.rest;
  o.comm_memory = c.comm_memory;
  if (comm->size() > 1) {
    o.zero_stage = c.stage;
    o.rank = comm->rank();
    o.world_size = comm->size();
    o.comm = comm;
  }
  return o;
}

// Each rank's own data at this world size (one rank: ranks 0 and 1's).
std::vector<int> CkptData(const Communicator& comm, int saved_world) {
  if (comm.size() > 1) return {comm.rank()};
  std::vector<int> d;
  for (int r = 0; r < saved_world; ++r) d.push_back(r);
  return d;
}

std::string CkptDir(const std::string& dir, int world, const CkptCase& c) {
  return dir + "/w" + std::to_string(world) + "-" + c.name;
}

int CkptSave(const std::shared_ptr<Communicator>& comm,
             const std::string& dir) {
  const int rank = comm->rank(), world = comm->size();
  int rc = 0;
  for (const CkptCase& c : kCkptCases) {
    const std::string name = std::string("ckpt-save ") + c.name;
    const EngineOptions o = CkptOptions(c, comm);
    const std::vector<int> data = CkptData(*comm, 2);
    Phases save;
    save.save = CkptDir(dir, world, c);
    save.params = c.params;
    save.steps = kSteps + kMore;
    const Trained a = Train(o, data, 2, save);
    if (!a.error.empty()) {
      rc |= Fail(rank, name, "uninterrupted: " + a.error);
      continue;
    }
    Phases load;
    load.load = save.save;
    load.steps = kSteps + kMore;
    const Trained b = Train(o, data, 2, load);
    if (!b.error.empty()) {
      rc |= Fail(rank, name, "resumed: " + b.error);
      continue;
    }
    std::string why;
    if (!Same(a.at_checkpoint, b.at_checkpoint)) {
      why += " the loaded masters are not the saved ones;";
    }
    if (!Same(a.masters, b.masters) || a.loss_scale != b.loss_scale) {
      why += " resumed run differs from the uninterrupted one by " +
             std::to_string(MaxDiff(a.masters, b.masters)) + ";";
    }
    if (!why.empty()) {
      rc |= Fail(rank, name, why);
      continue;
    }
    if (rank == 0) {
      FILE* f = std::fopen((save.save + ".masters").c_str(), "wb");
      for (const auto& v : a.at_checkpoint) {
        std::fwrite(v.data(), 4, v.size(), f);
      }
      std::fclose(f);
    }
    std::printf("rank %d: %s: ok (resumed bit for bit)\n", rank, name.c_str());
    std::fflush(stdout);
  }
  return rc;
}

int CkptLoad(const std::shared_ptr<Communicator>& comm, const std::string& dir,
             int saved) {
  const int rank = comm->rank(), world = comm->size();
  int rc = 0;
  for (const CkptCase& c : kCkptCases) {
    const std::string name = std::string("ckpt-load ") + c.name + " from " +
                             std::to_string(saved) + " ranks";
    const EngineOptions o = CkptOptions(c, comm);
    Phases load;
    load.load = CkptDir(dir, saved, c);
    load.steps = kSteps + kMore;
    load.after = {rank};
    const Trained l = Train(o, CkptData(*comm, saved), 2, load);
    if (c.moments == CpuDType::kBlock8 && saved != world) {
      if (l.error.find("InvalidArgument") == std::string::npos ||
          l.error.find("world_size " + std::to_string(saved)) ==
              std::string::npos) {
        rc |= Fail(rank, name, "int8 across world sizes: " + l.error);
      } else {
        std::printf("rank %d: %s: refused: %s\n", rank, name.c_str(),
                    l.error.c_str());
      }
      continue;
    }
    if (!l.error.empty()) {
      rc |= Fail(rank, name, l.error);
      continue;
    }
    // The masters at the save.
    std::vector<std::vector<float>> want;
    FILE* f = std::fopen((load.load + ".masters").c_str(), "rb");
    for (const TensorSpec& s : Specs()) {
      std::vector<float> v(Numel(s));
      if (f == nullptr || std::fread(v.data(), 4, v.size(), f) != v.size()) {
        break;
      }
      want.push_back(std::move(v));
    }
    if (f != nullptr) std::fclose(f);
    // One engine alone: the saving ranks' data, then this world's.
    EngineOptions one = o;
    one.world_size = 1;
    one.rank = 0;
    one.comm = nullptr;
    one.zero_stage = Base().zero_stage;
    Phases ref;
    ref.steps = kSteps + kMore;
    for (int r = 0; r < world; ++r) ref.after.push_back(r);
    const Trained r = Train(one, {0, 1}, 2, ref);
    std::string why;
    if (!r.error.empty()) why += " reference: " + r.error + ";";
    if (!Same(l.at_checkpoint, want)) {
      why += " the loaded masters are not the saved ones (max difference " +
             std::to_string(MaxDiff(l.at_checkpoint, want)) + ");";
    }
    const double d = MaxDiff(l.masters, r.masters);
    if (!(d <= 1e-4)) {
      why += " the steps after the load differ from one engine's by " +
             std::to_string(d) + ";";
    }
    if (!why.empty()) {
      rc |= Fail(rank, name, why);
      continue;
    }
    std::printf("rank %d: %s: ok (max difference after %d steps %.3g)\n", rank,
                name.c_str(), kMore, d);
    std::fflush(stdout);
  }
  return rc;
}

// POSIX files whose data writes fail with ENOSPC after `good` of them, or
// whose small files (the manifest, "latest") fail to be written.
class FullDiskFs final : public CheckpointFs {
 public:
  FullDiskFs(std::unique_ptr<CheckpointFs> base, int good, bool small)
      : base_(std::move(base)), left_(good), small_(small) {}
  class Full final : public File {
   public:
    Full(std::unique_ptr<File> f, std::atomic<int>* left)
        : f_(std::move(f)), left_(left) {}
    void Write(uint64_t offset, std::span<const std::byte> buf,
               std::function<void(Status)> done) override {
      if (left_->fetch_sub(1) <= 0) {
        done(Status::FromErrno(ENOSPC, "write"));
        return;
      }
      f_->Write(offset, buf, std::move(done));
    }
    void Read(uint64_t offset, std::span<std::byte> buf,
              std::function<void(Status)> done) override {
      f_->Read(offset, buf, std::move(done));
    }
    Status Sync() override { return f_->Sync(); }
    StatusOr<uint64_t> Size() override { return f_->Size(); }

   private:
    std::unique_ptr<File> f_;
    std::atomic<int>* left_;
  };
  StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> f, base_->Create(path));
    return std::unique_ptr<File>(new Full(std::move(f), &left_));
  }
  StatusOr<std::unique_ptr<File>> Overwrite(const std::string& path) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> f, base_->Overwrite(path));
    return std::unique_ptr<File>(new Full(std::move(f), &left_));
  }
  StatusOr<std::unique_ptr<File>> Open(const std::string& path) override {
    return base_->Open(path);
  }
  StatusOr<std::string> ReadSmall(const std::string& path) override {
    return base_->ReadSmall(path);
  }
  Status WriteSmall(const std::string& path, std::string_view data) override {
    if (small_) return Status::FromErrno(ENOSPC, "write " + path);
    return base_->WriteSmall(path, data);
  }
  Status Rename(const std::string& from, const std::string& to) override {
    return base_->Rename(from, to);
  }
  Status SyncDir(const std::string& dir) override {
    return base_->SyncDir(dir);
  }
  Status MakeDir(const std::string& path) override {
    return base_->MakeDir(path);
  }
  Status RemoveAll(const std::string& path) override {
    return base_->RemoveAll(path);
  }
  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    return base_->List(dir);
  }
  StatusOr<std::unique_ptr<Lock>> LockDir(const std::string& dir) override {
    return base_->LockDir(dir);
  }

 private:
  std::unique_ptr<CheckpointFs> base_;
  std::atomic<int> left_;
  bool small_;
};

int CkptFail(const std::shared_ptr<Communicator>& comm,
             const std::string& dir) {
  const int rank = comm->rank();
  int rc = 0;
  const CkptCase& c = kCkptCases[2];  // states on NVMe, working copy saved
  const EngineOptions o = CkptOptions(c, comm);
  const std::string at = dir + "/fail";
  // A good checkpoint first: the failed saves must leave it alone.
  Phases good;
  good.save = at;
  good.steps = kSteps + 1;
  const Trained g = Train(o, {rank}, 2, good);
  if (!g.error.empty()) return Fail(rank, "ckpt-fail first save", g.error);
  struct Fault {
    const char* name;
    bool null_writer;
    int good_writes;  // -1: no FullDiskFs
    bool small;
    const char* says;
  };
  for (const Fault& f :
       {Fault{"no writer on the writer rank", true, -1, false,
              "without a checkpoint"},
        Fault{"disk full during the save", false, 3, false, "rank 0: "},
        Fault{"commit fails", false, 1 << 30, true, "rank 0: "}}) {
    const std::string name = std::string("ckpt-fail ") + f.name;
    std::unique_ptr<CheckpointFs> fs;
    if (f.good_writes >= 0 && rank == 0) {
      auto posix = NewPosixCheckpointFs();
      if (!posix.ok()) return Fail(rank, name, posix.status().ToString());
      fs = std::make_unique<FullDiskFs>(std::move(posix).value(), f.good_writes,
                                        f.small);
    }
    Phases bad;
    bad.save = at;
    bad.steps = kSteps + 1;
    bad.params = true;
    bad.fs = fs.get();
    bad.null_writer = f.null_writer;
    bad.stop_after_save = true;
    const Trained b = Train(o, {rank}, 2, bad);
    std::string why;
    if (!b.error.empty()) why += " " + b.error + ";";
    if (b.saved.ok() || b.saved.message().find(f.says) == std::string::npos) {
      why += " save: " + b.saved.ToString() + ";";
    }
    // Every rank the same error: its hash agreed over the ranks.
    const std::string text = b.saved.ToString();
    uint64_t h = std::hash<std::string>{}(text);
    std::vector<uint64_t> all(static_cast<size_t>(comm->size()));
    const std::vector<size_t> counts(all.size(), 8);
    auto w = comm->AllGather(&h, all.data(), counts, CommType::kByte);
    if (!w.ok() || !w->Wait().ok()) return Fail(rank, name, "all-gather");
    for (uint64_t x : all) {
      if (x != all[0]) why += " the ranks' errors differ;";
    }
    // Nothing half-written: "latest" still names the first checkpoint, and
    // no other step or temporary directory is left.
    if (rank == 0) {
      for (const auto& e : std::filesystem::directory_iterator(at)) {
        const std::string n = e.path().filename().string();
        char want[32];
        std::snprintf(want, sizeof want, "step-%012d", kSteps);
        if (n.rfind("step-", 0) == 0 && n != want) {
          why += " left " + n + ";";
        }
        if (n.rfind(".tmp-step-", 0) == 0) why += " left " + n + ";";
      }
      auto reader = CheckpointReader::Open(at);
      if (!reader.ok() || (*reader)->step() != kSteps) {
        why += " latest: " + (reader.ok() ? std::to_string((*reader)->step())
                                          : reader.status().ToString());
      }
    }
    if (!why.empty()) {
      rc |= Fail(rank, name, why);
      continue;
    }
    std::printf("rank %d: %s: refused: %s\n", rank, name.c_str(), text.c_str());
    std::fflush(stdout);
  }
  return rc;
}

// ---- A failed write-back on one rank ---------------------------------------

// One rank's engine for the fault cases, with this rank's tensors started
// at 0.01 (`started`: how that went); the last rank's I/O goes through a
// fault-injecting engine that `plan` drives.
struct FaultRig {
  std::unique_ptr<Device> dev;
  std::unique_ptr<Stream> stream;
  ScratchDir dir;
  std::unique_ptr<Engine> eng;  // destroyed first
  std::vector<TensorId> ids;
  Status started;
};

// Ends a fault case: to `why` (what the case itself found wrong) it adds
// the checks every case makes: the error `text` names the last rank (where
// `named`), it came within 20 s, and (where `refused`) a Fetch after it is
// refused as the engine's failure (kFailedPrecondition). Reports the case;
// 1 when it failed.
int EndFaultCase(const std::shared_ptr<Communicator>& comm,
                 const std::string& name, std::string why,
                 const std::string& text, bool named, double seconds,
                 Engine& eng, TensorId id, bool refused) {
  const int rank = comm->rank();
  if (named && text.find("rank " + std::to_string(comm->size() - 1) + ": ") ==
                   std::string::npos) {
    why += " the error does not name the failed rank: " + text + ";";
  }
  if (!(seconds < 20)) why += " took " + std::to_string(seconds) + " s;";
  auto again = eng.Fetch(id);
  if (refused && (again.ok() ||
                  again.status().code() != StatusCode::kFailedPrecondition)) {
    why += " a Fetch after the failure: " +
           (again.ok() ? std::string("accepted") : again.status().ToString()) +
           ";";
  }
  if (!why.empty()) return Fail(rank, name, why);
  std::printf("rank %d: %s: refused in %.2f s: %s\n", rank, name.c_str(),
              seconds, text.c_str());
  std::fflush(stdout);
  return 0;
}

StatusOr<std::unique_ptr<FaultRig>> MakeFaultRig(
    EngineOptions o, const std::shared_ptr<Communicator>& comm,
    const std::shared_ptr<swap::FaultPlan>& plan) {
  auto rig = std::make_unique<FaultRig>();
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = 64 << 20;
  dopt.host_compute_threads = 1;
  STRATA_ASSIGN_OR_RETURN(rig->dev, NewHostEmulatedDevice(dopt));
  STRATA_ASSIGN_OR_RETURN(rig->stream, rig->dev->NewStream({}));
  o.nvme_paths = {rig->dir.path()};
  o.rank = comm->rank();
  o.world_size = comm->size();
  o.comm = comm;
  if (comm->rank() == comm->size() - 1) {
    IoEngineOptions io;
    io.queue_depth = 4;
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<AsyncIo> a,
                            AsyncIo::Create(swap::NewFaultInjectingEngine(
                                swap::NewMemoryBackend(io), plan, io)));
    o.shared_io = std::shared_ptr<AsyncIo>(std::move(a));
  }
  STRATA_ASSIGN_OR_RETURN(rig->eng, Engine::Create(o, rig->dev.get()));
  for (const TensorSpec& s : Specs()) {
    STRATA_ASSIGN_OR_RETURN(TensorId id, rig->eng->Register(s));
    rig->ids.push_back(id);
  }
  rig->started = rig->eng->Start();
  for (size_t i = 0; i < rig->ids.size() && rig->started.ok(); ++i) {
    rig->started = rig->eng->SetInitialValues(
        rig->ids[i], std::vector<float>(Numel(Specs()[i]), 0.01f));
  }
  return rig;
}

int StepFault(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank(), world = comm->size();
  int rc = 0;
  struct Case {
    int stage;
    Residence states, grads;
    CommMemory comm_memory = CommMemory::kHost;
    // The last rank's AddGrad of the first tensor fails on the caller's
    // thread (a gradient too short), instead of its I/O.
    bool short_handover = false;
    // BeginStep before each step's hand-overs: the other units' statistics
    // are taken during them, on every rank.
    bool begin_step = false;
  };
  for (const Case& c :
       {Case{2, Residence::kNvme, Residence::kHost},
        Case{3, Residence::kNvme, Residence::kHost},
        Case{2, Residence::kHost, Residence::kNvme},
        Case{3, Residence::kNvme, Residence::kHost, CommMemory::kDevice},
        Case{2, Residence::kHost, Residence::kHost, CommMemory::kHost, true},
        Case{3, Residence::kHost, Residence::kHost, CommMemory::kHost, true},
        Case{2, Residence::kHost, Residence::kHost, CommMemory::kHost, true,
             true},
        Case{3, Residence::kHost, Residence::kHost, CommMemory::kHost, true,
             true}}) {
    const int stage = c.stage;
    const bool in_handover = c.grads == Residence::kNvme || c.short_handover;
    const std::string name =
        "step-fault stage " + std::to_string(stage) +
        (c.grads == Residence::kNvme ? ", gradients on nvme" : "") +
        (c.comm_memory == CommMemory::kDevice ? ", collectives on device"
                                              : "") +
        (c.short_handover ? ", a hand-over refused" : "") +
        (c.begin_step ? ", BeginStep" : "");
    EngineOptions o = Base();
    o.zero_stage = stage;
    o.params = stage == 3 ? Residence::kHost : Residence::kDevice;
    o.optimizer_states = c.states;
    o.grads = c.grads;
    o.comm_memory = c.comm_memory;
    auto plan = std::make_shared<swap::FaultPlan>();
    const bool faulty = rank == world - 1;
    auto rig = MakeFaultRig(o, comm, plan);
    if (!rig.ok()) return Fail(rank, name, rig.status().ToString());
    auto& eng = (*rig)->eng;
    auto& dev = (*rig)->dev;
    auto& stream = (*rig)->stream;
    const std::vector<TensorId>& ids = (*rig)->ids;
    Status st = (*rig)->started;
    StatusOr<StepResult> r = Status::Ok();
    double seconds = 0;
    auto fault = [&] {
      swap::FaultRule f;
      f.op = IoOp::kWrite;
      f.count = swap::FaultRule::kForever;
      plan->Add(f);
    };
    Status refused;  // the short hand-over's own error
    StepArgs a;
    a.lr = 1e-2;
    for (int s = 0; s < 3 && st.ok(); ++s) {
      if (s == 2 && faulty && in_handover && !c.short_handover) fault();
      if (c.begin_step) st = eng->BeginStep(a);
      for (size_t i = 0; i < ids.size() && st.ok(); ++i) {
        std::vector<float> w;
        st = ReadWorking(*eng, *dev, *stream, ids[i], w);
        std::vector<float> g(w.size(), 1e-3f * static_cast<float>(rank + 1));
        if (s == 2 && faulty && c.short_handover && i == 0) {
          g.resize(g.size() / 2);
          refused = HandOver(*eng, *dev, *stream, ids[i], g);
          if (refused.ok()) st = Status::Internal("a short gradient taken");
          continue;
        }
        if (st.ok()) st = HandOver(*eng, *dev, *stream, ids[i], g);
      }
      if (!st.ok()) break;
      if (s == 2 && faulty && !in_handover) fault();
      const auto t0 = std::chrono::steady_clock::now();
      r = eng->Step(a);
      seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      if (s < 2 && !r.ok()) st = r.status();
    }
    std::string why;
    if (!st.ok()) why += " before the fault: " + st.ToString() + ";";
    if (r.ok()) why += " the step with the fault succeeded;";
    const std::string text = r.ok() ? "" : r.status().ToString();
    if (c.short_handover &&
        (text.find("AddGrad(") == std::string::npos ||
         (faulty && refused.code() != StatusCode::kInvalidArgument))) {
      why += " the refused hand-over is not the step's error (" + text +
             "; AddGrad said " + refused.ToString() + ");";
    }
    // The update had begun on some rank: every engine refuses further use
    // (a failed hand-over fails the step before any update).
    rc |= EndFaultCase(comm, name, why, text, /*named=*/!faulty, seconds, *eng,
                       ids[0], /*refused=*/!in_handover);
  }
  return rc;
}

// ---- A failed read of a stage-3 shard on one rank ---------------------------

// Stage 3 with the parameters' shards on NVMe: from the third step the last
// rank cannot read its shard. The gather still runs on every rank, then
// their agreement fails the fetch on every rank at once, naming that rank,
// and the engine refuses further use (a gather's failure is the engine's).
// On host and on device memory (the in-place gather).
int GatherFault(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank(), world = comm->size();
  int rc = 0;
  for (CommMemory memory : {CommMemory::kHost, CommMemory::kDevice}) {
    const std::string name = std::string("gather-fault, collectives on ") +
                             std::string(CommMemoryName(memory));
    EngineOptions o = Base();
    o.zero_stage = 3;
    o.params = Residence::kNvme;
    o.comm_memory = memory;
    auto plan = std::make_shared<swap::FaultPlan>();
    const bool faulty = rank == world - 1;
    auto rig = MakeFaultRig(o, comm, plan);
    if (!rig.ok()) return Fail(rank, name, rig.status().ToString());
    Engine& eng = *(*rig)->eng;
    Status st = (*rig)->started;
    Status fetched;  // the fetch that met the fault
    double seconds = 0;
    for (int s = 0; s < 3 && st.ok() && fetched.ok(); ++s) {
      if (s == 2 && faulty) {
        swap::FaultRule f;
        f.op = IoOp::kRead;
        f.count = swap::FaultRule::kForever;
        plan->Add(f);
      }
      for (size_t i = 0; i < (*rig)->ids.size() && st.ok(); ++i) {
        std::vector<float> w;
        const auto t0 = std::chrono::steady_clock::now();
        const Status got =
            ReadWorking(eng, *(*rig)->dev, *(*rig)->stream, (*rig)->ids[i], w);
        seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count();
        if (!got.ok()) {
          if (s == 2)
            fetched = got;
          else
            st = got;
          break;
        }
        const std::vector<float> g(w.size(), 1e-3f);
        st = HandOver(eng, *(*rig)->dev, *(*rig)->stream, (*rig)->ids[i], g);
      }
      if (!st.ok() || !fetched.ok()) break;
      StepArgs a;
      a.lr = 1e-2;
      StatusOr<StepResult> r = eng.Step(a);
      if (!r.ok()) st = r.status();
    }
    std::string why;
    if (!st.ok()) why += " before the fault: " + st.ToString() + ";";
    if (fetched.ok()) why += " every fetch with the fault succeeded;";
    // Every rank, the failed one too, has the agreed error.
    rc |= EndFaultCase(comm, name, why, fetched.ToString(), /*named=*/true,
                       seconds, eng, (*rig)->ids[0], /*refused=*/true);
  }
  return rc;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <plugin> train|errors\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[2];
  strata::CommOptions o;
  o.backend = strata::CommBackendKind::kMpi;
  o.mpi_library = argv[1];
  o.timeout_s = 60;
  auto comm = strata::Communicator::Create(o);
  if (!comm.ok()) {
    std::printf("FAIL Create: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  auto shared = std::make_shared<strata::Communicator>(std::move(comm).value());
  if (mode == "train") return strata::TrainCases(shared);
  if (mode == "errors") return strata::ErrorCases(shared);
  if (mode == "statistics") return strata::StatisticsDuringBackward(shared);
  if (mode == "step-fault") return strata::StepFault(shared);
  if (mode == "gather-fault") return strata::GatherFault(shared);
  if (mode == "ckpt-save" && argc == 4) {
    return strata::CkptSave(shared, argv[3]);
  }
  if (mode == "ckpt-load" && argc == 5) {
    return strata::CkptLoad(shared, argv[3], std::atoi(argv[4]));
  }
  if (mode == "ckpt-fail" && argc == 4) {
    return strata::CkptFail(shared, argv[3]);
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
