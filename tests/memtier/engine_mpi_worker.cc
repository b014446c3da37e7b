// Runs under mpirun (tests/memtier/engine_mpi_test.cc starts it):
//   engine_mpi_worker <plugin> train
//       for zero_stage 1 and 2 (parameters on the device), optimizer
//       states on host and on NVMe, and stage 2's gradients on NVMe: a
//       model trained over the ranks (each rank
//       handing over the gradients of its own data) ends with the masters of
//       one engine trained alone on the whole batch, within rounding; the
//       working copy is the master's rounding on every rank; a gradient
//       overflow on one rank skips the step on all; and each rank's optimizer
//       state is 1/N of the single engine's.
//   engine_mpi_worker <plugin> errors
//       the option combinations refused with several ranks.
// Prints "rank R: CASE: ok ..." per case, "FAIL ..." otherwise; exit 0 when
// every case passes.
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "tests/memtier/memory_checkpoint.h"
#include "tests/memtier/small_engine_options.h"
#include "tests/util/scratch_dir.h"

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

struct Trained {
  std::string error;  // empty: every call succeeded
  std::vector<std::vector<float>> masters;
  std::vector<double> norms;
  std::vector<bool> applied;
  double loss_scale = 0;
  bool working_is_master = true;
  EngineStats stats;
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

// Trains on the data of ranks `data` of `world` (each rank's gradient
// divided by data.size() when one engine takes them all, as the engine
// averages over ranks).
Trained Train(EngineOptions o, const std::vector<int>& data, int world) {
  Trained t;
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = 64 << 20;
  dopt.host_compute_threads = 1;
  ASSIGN_OK(dev, NewHostEmulatedDevice(dopt));
  ScratchDir dir;
  if (o.optimizer_states == Residence::kNvme || o.grads == Residence::kNvme) {
    o.nvme_paths = {dir.path()};
  }
  ASSIGN_OK(eng, Engine::Create(o, dev.get()));
  ASSIGN_OK(stream, dev->NewStream({}));
  const std::vector<TensorSpec> specs = Specs();
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
  const float share = 1.0f / static_cast<float>(data.size());
  for (int s = 0; s < kSteps; ++s) {
    // Updates during backward need clipping off.
    StepArgs a;
    a.lr = 1e-2;
    a.max_grad_norm = o.step_overlap_bytes > 0 ? 0.0 : kClip;
    for (int m = 0; m < kMicro; ++m) {
      if (o.step_overlap_bytes > 0 && m == kMicro - 1) {
        CHECK_OK(eng->BeginStep(a));
      }
      for (size_t i = 0; i < specs.size(); ++i) {
        if (!HasGrad(i)) continue;
        std::vector<float> w;
        CHECK_OK(ReadWorking(*eng, *dev, *stream, ids[i], w));
        std::vector<float> g(w.size(), 0.0f);
        for (int d : data) {
          std::mt19937 rng(1000003u * static_cast<uint32_t>(d) +
                           10007u * static_cast<uint32_t>(s) +
                           101u * static_cast<uint32_t>(m) +
                           static_cast<uint32_t>(i));
          std::normal_distribution<float> z(0.0f, 0.01f);
          for (size_t j = 0; j < g.size(); ++j) {
            g[j] += (0.5f * w[j] + z(rng)) * share;
          }
          if (s == kOverflowStep && m == 0 && i == 0 && d == world - 1) {
            g[7] = std::numeric_limits<float>::infinity();
          }
        }
        const float scale = static_cast<float>(eng->LossScale());
        for (float& x : g) x *= scale;
        ASSIGN_OK(dm, dev->Allocate(g.size() * 4, *stream));
        CHECK_OK(dev->CopyAsync(*stream, dm.data(), g.data(), g.size() * 4,
                                CopyKind::kHostToDevice));
        CHECK_OK(eng->AddGrad(ids[i], std::move(dm), ElementType::kFloat32,
                              *stream));
      }
    }
    ASSIGN_OK(r, eng->Step(a));
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

int Fail(int rank, const std::string& what, const std::string& why) {
  std::printf("FAIL rank %d: %s: %s\n", rank, what.c_str(), why.c_str());
  std::fflush(stdout);
  return 1;
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
  };
  for (const Placement& p :
       {Placement{1, Residence::kHost, Residence::kHost},
        Placement{1, Residence::kNvme, Residence::kHost},
        Placement{2, Residence::kHost, Residence::kHost},
        Placement{2, Residence::kNvme, Residence::kHost},
        Placement{2, Residence::kHost, Residence::kNvme},
        Placement{2, Residence::kNvme, Residence::kHost, true}}) {
    const int stage = p.stage;
    {
      {
        const std::string name =
            "stage " + std::to_string(stage) + ", states " +
            std::string(ResidenceName(p.states)) + ", grads " +
            std::string(ResidenceName(p.grads)) +
            (p.early ? ", updates during backward" : "");
        EngineOptions o = Base();
        o.zero_stage = stage;
        o.optimizer_states = p.states;
        o.grads = p.grads;
        if (p.early) o.step_overlap_bytes = 1 << 20;
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
        // Stage 2: the gradient shard (a third of fp32 master and moments)
        // plus two bucket windows and the reduction's output, each at most
        // a packed unit (partition_bytes, rounded to whole shard blocks),
        // however large a tensor is ("big" spans four windows).
        const uint64_t window = (64 << 10) + 128 * 4 * world;
        if (stage == 2 &&
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
            "%llu)\n",
            rank, name.c_str(), max_diff,
            static_cast<unsigned long long>(many.stats.optimizer_state_bytes),
            static_cast<unsigned long long>(one.stats.optimizer_state_bytes),
            static_cast<unsigned long long>(many.stats.grad_bytes),
            static_cast<unsigned long long>(one.stats.grad_bytes));
        std::fflush(stdout);
      }
    }
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
      {"zero_stage 3", [](EngineOptions& o) { o.zero_stage = 3; },
       StatusCode::kNotSupported, "zero_stage 3"},
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
  // And an engine that works refuses checkpoints, saying why.
  EngineOptions o = Base();
  o.zero_stage = 1;
  o.rank = rank;
  o.world_size = world;
  o.comm = comm;
  auto e = Engine::Create(o, dev->get());
  if (!e.ok()) return Fail(rank, "errors", e.status().ToString());
  if (!(*e)->Register({"w", {1000}, ElementType::kBFloat16}).ok() ||
      !(*e)->Start().ok()) {
    return Fail(rank, "errors", "start");
  }
  testing::MemoryCheckpoint ckpt;
  testing::MemoryCheckpointWriter writer(&ckpt);
  const Status saved = (*e)->SaveState(writer);
  if (saved.code() != StatusCode::kNotSupported ||
      saved.message().find("world_size") == std::string::npos) {
    rc |= Fail(rank, "checkpoint", saved.ToString());
  } else {
    std::printf("rank %d: checkpoint: refused: %s\n", rank,
                saved.ToString().c_str());
  }
  std::fflush(stdout);
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
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
