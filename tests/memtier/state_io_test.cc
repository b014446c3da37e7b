// The engine's state saved and loaded through a checkpoint (kept in memory
// here: tests/ckpt tests the files): a run saved, loaded into engines with
// another partition size, piece size and tier placement, and continued must
// equal the uninterrupted run bit for bit; what LoadState refuses changes
// nothing; a read failing part-way fails the engine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "tests/memtier/engine_test_util.h"
#include "tests/memtier/memory_checkpoint.h"
#include "tests/swap/test_util.h"

namespace strata {
namespace {

using testing::HostDevice;
using testing::MemoryCheckpoint;
using testing::MemoryCheckpointReader;
using testing::MemoryCheckpointWriter;
using testing::ScratchDir;

// Odd sizes, so that tensors straddle pieces and units end off alignment;
// the bf16 and fp16 tensors are packed in units of their own dtype.
struct Shape {
  const char* name;
  std::vector<int64_t> shape;
  ElementType dtype;
};
const std::vector<Shape>& Model() {
  static const std::vector<Shape> m = {
      {"embed", {300, 211}, ElementType::kBFloat16},
      {"norm.0", {129}, ElementType::kBFloat16},
      {"block.0", {96, 97}, ElementType::kFloat16},
      {"norm.1", {7}, ElementType::kBFloat16},
      {"block.1", {5000}, ElementType::kBFloat16},
      {"head", {33, 1025}, ElementType::kBFloat16},
  };
  return m;
}

uint64_t Numel(const Shape& s) {
  uint64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return n;
}

// kNvmeGradients: kNvmeEverything with the gradients on NVMe as well.
enum class Placement {
  kHostStates,
  kNvmeEverything,
  kHostParams,
  kNvmeGradients
};

EngineOptions Options(Placement p, const std::string& dir, CpuDType moments,
                      const LossScaleOptions& loss_scale) {
  EngineOptions o;
  o.loss_scale = loss_scale;
  o.optimizer.moment_dtype = moments;
  o.optimizer.cpu.threads = 1;
  o.optimizer.cpu.weight_decay = 0.01;
  o.io.queue_depth = 4;
  switch (p) {
    case Placement::kHostStates:  // params on the device
      o.partition_bytes = 64 << 10;
      o.staging_buffer_bytes = 64 << 10;
      o.io_block_bytes = 64 << 10;
      break;
    case Placement::kNvmeGradients:
      o.grads = Residence::kNvme;
      [[fallthrough]];
    case Placement::kNvmeEverything:  // several pieces per unit
      o.partition_bytes = 256 << 10;
      o.staging_buffer_bytes = 16 << 10;
      o.io_block_bytes = 16 << 10;
      o.params = Residence::kNvme;
      o.optimizer_states = Residence::kNvme;
      o.nvme_paths = {dir};
      break;
    case Placement::kHostParams:
      o.partition_bytes = 128 << 10;
      o.staging_buffer_bytes = 32 << 10;
      o.io_block_bytes = 32 << 10;
      o.params = Residence::kHost;
      break;
  }
  return o;
}

// The gradient of tensor i's element k at step `step`.
float GradOf(size_t i, uint64_t k, int step) {
  return 0.01f * std::cos(0.013f * k + 1.7f * step + 3.0f * i);
}

// The initial value of tensor i's element k.
float InitialOf(size_t i, uint64_t k, uint32_t seed) {
  return 0.05f * std::sin(0.37f * k + seed + 11.0f * i);
}

class Trainer {
 public:
  // `optimizer`, when given, replaces the options' optimizer (its
  // moment_dtype included).
  Trainer(Placement p, uint32_t seed, const std::vector<Shape>& model = Model(),
          CpuDType moments = CpuDType::kFloat32,
          const LossScaleOptions& loss_scale = {},
          const OptimizerOptions* optimizer = nullptr)
      : model_(model) {
    dev_ = HostDevice();
    EngineOptions o = Options(p, dir_.path(), moments, loss_scale);
    if (optimizer != nullptr) o.optimizer = *optimizer;
    engine_ = std::move(Engine::Create(o, dev_.get()).value());
    stream_ = std::move(dev_->NewStream({}).value());
    for (const Shape& s : model_) {
      TensorSpec t;
      t.name = s.name;
      t.shape = s.shape;
      t.dtype = s.dtype;
      ids_.push_back(engine_->Register(t).value());
    }
    EXPECT_TRUE(engine_->Start().ok());
    for (size_t i = 0; i < model_.size(); ++i) {
      std::vector<float> v(Numel(model_[i]));
      for (size_t k = 0; k < v.size(); ++k) v[k] = InitialOf(i, k, seed);
      EXPECT_TRUE(engine_->SetInitialValues(ids_[i], v).ok());
    }
  }

  Engine& engine() { return *engine_; }
  const std::string& dir() const { return dir_.path(); }

  Status AddGrads(int step) {
    for (size_t i = 0; i < model_.size(); ++i) {
      const uint64_t n = Numel(model_[i]);
      std::vector<float> g(n);
      for (uint64_t k = 0; k < n; ++k) g[k] = GradOf(i, k, step);
      STRATA_ASSIGN_OR_RETURN(DeviceMemory d, dev_->Allocate(n * 4, *stream_));
      STRATA_RETURN_IF_ERROR(dev_->CopyAsync(*stream_, d.data(), g.data(),
                                             n * 4, CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(engine_->AddGrad(ids_[i], std::move(d),
                                              ElementType::kFloat32, *stream_));
    }
    return Status::Ok();
  }

  // Steps from..to-1, each of `micro` micro-batches (the same gradients),
  // with BeginStep before the last when `begin_step`.
  Status Train(int from, int to, bool begin_step = false, int micro = 1) {
    for (int s = from; s < to; ++s) {
      StepArgs a;
      a.lr = 1e-2;
      for (int m = 0; m < micro; ++m) {
        if (begin_step && m == micro - 1) {
          STRATA_RETURN_IF_ERROR(engine_->BeginStep(a));
        }
        STRATA_RETURN_IF_ERROR(AddGrads(s));
      }
      STRATA_ASSIGN_OR_RETURN(StepResult r, engine_->Step(a));
      if (!r.applied) return Status::Internal("step skipped");
    }
    return Status::Ok();
  }

  // Every master and working copy, as bytes.
  std::vector<std::vector<uint8_t>> Masters() {
    std::vector<std::vector<uint8_t>> out;
    for (size_t i = 0; i < model_.size(); ++i) {
      std::vector<float> m(Numel(model_[i]));
      EXPECT_TRUE(engine_->ReadMaster(ids_[i], m).ok());
      out.emplace_back(reinterpret_cast<uint8_t*>(m.data()),
                       reinterpret_cast<uint8_t*>(m.data() + m.size()));
    }
    return out;
  }
  std::vector<std::vector<uint8_t>> Working() {
    std::vector<std::vector<uint8_t>> out;
    for (size_t i = 0; i < model_.size(); ++i) {
      auto pin = engine_->Fetch(ids_[i]);
      EXPECT_TRUE(pin.ok()) << pin.status().ToString();
      EXPECT_TRUE(pin->Wait().ok());
      std::vector<uint8_t> w(pin->bytes());
      EXPECT_TRUE(dev_->CopyAsync(*stream_, w.data(), pin->data(), w.size(),
                                  CopyKind::kDeviceToHost)
                      .ok());
      EXPECT_TRUE(dev_->SynchronizeStream(*stream_).ok());
      out.push_back(std::move(w));
    }
    return out;
  }

 private:
  std::vector<Shape> model_;
  ScratchDir dir_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Stream> stream_;
  std::vector<TensorId> ids_;
};

Status Save(Engine& e, MemoryCheckpoint* ckpt, bool params = false) {
  MemoryCheckpointWriter w(ckpt);
  STRATA_RETURN_IF_ERROR(e.SaveState(w, params));
  return w.Commit().status();
}

class StateIoTest : public ::testing::TestWithParam<Placement> {};

TEST_P(StateIoTest, ResumedRunEqualsTheUninterruptedOneBitForBit) {
  // The reference saves after 3 steps (from where GetParam() rests things)
  // and runs on to 6.
  Trainer ref(GetParam(), 1);
  ASSERT_TRUE(ref.Train(0, 3).ok());
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(ref.engine(), &ckpt).ok());
  EXPECT_FALSE(ckpt.blobs["strata.engine"].empty());
  const auto saved = ref.Masters();
  ASSERT_TRUE(ref.Train(3, 6).ok());
  const auto masters = ref.Masters();
  const auto working = ref.Working();

  for (Placement p : {Placement::kHostStates, Placement::kNvmeEverything,
                      Placement::kHostParams}) {
    SCOPED_TRACE(static_cast<int>(p));
    Trainer resumed(p, /*seed=*/7);  // other initial values, all replaced
    MemoryCheckpointReader reader(&ckpt);
    ASSERT_TRUE(resumed.engine().LoadState(reader).ok());
    EXPECT_EQ(resumed.Masters(), saved);
    ASSERT_TRUE(resumed.Train(3, 6).ok());  // bias correction at steps 4..6
    EXPECT_EQ(resumed.engine().stats().steps, 3u);
    EXPECT_EQ(resumed.Masters(), masters);
    EXPECT_EQ(resumed.Working(), working);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, StateIoTest,
                         ::testing::Values(Placement::kHostStates,
                                           Placement::kNvmeEverything,
                                           Placement::kHostParams));

// Saves `ref` after three steps and runs it on to six; what a resumed run
// must then equal.
struct Reference {
  MemoryCheckpoint ckpt;
  std::vector<std::vector<uint8_t>> saved, masters, working;
};
void RunReference(Trainer& ref, Reference* out) {
  ASSERT_TRUE(ref.Train(0, 3).ok());
  ASSERT_TRUE(Save(ref.engine(), &out->ckpt).ok());
  out->saved = ref.Masters();
  ASSERT_TRUE(ref.Train(3, 6).ok());
  out->masters = ref.Masters();
  out->working = ref.Working();
}
void ExpectResumedEqual(Trainer& resumed, const Reference& ref) {
  MemoryCheckpointReader reader(&ref.ckpt);
  Status st = resumed.engine().LoadState(reader);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(resumed.Masters(), ref.saved);
  ASSERT_TRUE(resumed.Train(3, 6).ok());
  EXPECT_EQ(resumed.Masters(), ref.masters);
  EXPECT_EQ(resumed.Working(), ref.working);
}

TEST(StateIo, Bf16MomentsResumeBitForBitInAnyLayout) {
  Trainer ref(Placement::kNvmeEverything, 1, Model(), CpuDType::kBFloat16);
  Reference r;
  RunReference(ref, &r);
  EXPECT_NE(r.ckpt.blobs["strata.engine"].find("\"moment_dtype\":\"bf16\""),
            std::string::npos);
  for (Placement p : {Placement::kHostStates, Placement::kNvmeEverything,
                      Placement::kHostParams}) {
    SCOPED_TRACE(static_cast<int>(p));
    Trainer resumed(p, 7, Model(), CpuDType::kBFloat16);
    ExpectResumedEqual(resumed, r);
  }
  // Stored as fp32 (exactly): an engine of fp32 moments loads it as is,
  // and one of int8 moments refuses it, changing nothing.
  Trainer wide(Placement::kHostStates, 7);
  MemoryCheckpointReader reader(&r.ckpt);
  ASSERT_TRUE(wide.engine().LoadState(reader).ok());
  EXPECT_EQ(wide.Masters(), r.saved);
  Trainer int8(Placement::kNvmeEverything, 7, Model(), CpuDType::kBlock8);
  const auto before = int8.Masters();
  Status st = int8.engine().LoadState(reader);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("moments are bf16 and this engine's int8 "
                              "(optimizer.moment_dtype)"),
            std::string::npos)
      << st.ToString();
  EXPECT_EQ(int8.Masters(), before);
}

TEST(StateIo, Int8MomentsResumeBitForBitInTheSameLayoutOnly) {
  for (Placement p : {Placement::kHostStates, Placement::kNvmeEverything}) {
    SCOPED_TRACE(static_cast<int>(p));
    Trainer ref(p, 1, Model(), CpuDType::kBlock8);
    Reference r;
    RunReference(ref, &r);
    Trainer resumed(p, 7, Model(), CpuDType::kBlock8);
    ExpectResumedEqual(resumed, r);
    // Another piece layout, or another format, is refused naming why.
    MemoryCheckpointReader reader(&r.ckpt);
    Trainer other(Placement::kHostParams, 7, Model(), CpuDType::kBlock8);
    const auto before = other.Masters();
    Status st = other.engine().LoadState(reader);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("load only into the same layout"),
              std::string::npos)
        << st.ToString();
    EXPECT_EQ(other.Masters(), before);
    EXPECT_TRUE(other.Train(0, 1).ok());  // still usable
    Trainer bf16(p, 7, Model(), CpuDType::kBFloat16);
    st = bf16.engine().LoadState(reader);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("int8 moments load only into int8 moments"),
              std::string::npos)
        << st.ToString();
  }
}

TEST(StateIo, TheStoredWorkingCopyIsLoaded) {
  Trainer ref(Placement::kNvmeEverything, 1);
  ASSERT_TRUE(ref.Train(0, 2).ok());
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(ref.engine(), &ckpt, /*params=*/true).ok());
  // Mark the stored working copy so that using it is visible: it then
  // differs from the master rounded to bf16.
  int marked = 0;
  for (auto& e : ckpt.extents) {
    if (e.role != StateRole::kParam) continue;
    for (const StatePlacement& p : e.places) {
      if (p.tensor == 0 && p.tensor_offset == 0) {
        e.data[p.extent_offset * 2] ^= std::byte{1};
        ++marked;
      }
    }
  }
  ASSERT_EQ(marked, 1);
  const auto working = ref.Working();
  Trainer other(Placement::kHostParams, 3);
  MemoryCheckpointReader reader(&ckpt);
  ASSERT_TRUE(other.engine().LoadState(reader).ok());
  const auto loaded = other.Working();
  ASSERT_EQ(loaded.size(), working.size());
  EXPECT_EQ(loaded[0][0], working[0][0] ^ 1);
  for (size_t i = 1; i < loaded.size(); ++i) EXPECT_EQ(loaded[i], working[i]);
}

TEST(StateIo, RefusalsChangeNothing) {
  Trainer ref(Placement::kHostStates, 1);
  ASSERT_TRUE(ref.Train(0, 1).ok());
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(ref.engine(), &ckpt).ok());

  // A tensor the checkpoint lacks, then one of another shape.
  std::vector<Shape> more = Model();
  more.push_back({"extra", {10}, ElementType::kBFloat16});
  std::vector<Shape> other = Model();
  other[2].shape = {97, 96};
  for (const auto& [model, code] :
       {std::pair{more, StatusCode::kNotFound},
        std::pair{other, StatusCode::kInvalidArgument}}) {
    Trainer run(Placement::kNvmeEverything, 5, model);
    const auto before = run.Masters();
    MemoryCheckpointReader reader(&ckpt);
    Status st = run.engine().LoadState(reader);
    EXPECT_EQ(st.code(), code) << st.ToString();
    EXPECT_EQ(run.Masters(), before);
    EXPECT_TRUE(run.Train(0, 1).ok());  // still usable
  }

  // Gradients handed over for the next step would be added to loaded state.
  Trainer run(Placement::kHostStates, 5);
  ASSERT_TRUE(run.AddGrads(0).ok());
  MemoryCheckpointReader reader(&ckpt);
  EXPECT_EQ(run.engine().LoadState(reader).code(),
            StatusCode::kFailedPrecondition);
}

// A dynamic loss scale is part of the state: the resumed run divides by the
// scale the saved one had reached (window 1 doubles it every step), so it
// ends bit for bit where the uninterrupted run does. A bad stored scale is
// refused before anything changes.
TEST(StateIo, ADynamicLossScaleResumesWithTheState) {
  LossScaleOptions ls;
  ls.mode = LossScaleMode::kDynamic;
  ls.initial_scale = 4;
  ls.window = 1;
  Trainer ref(Placement::kHostStates, 1, Model(), CpuDType::kFloat32, ls);
  ASSERT_TRUE(ref.Train(0, 4).ok());
  EXPECT_EQ(ref.engine().LossScale(), 64.0);

  Trainer first(Placement::kHostStates, 1, Model(), CpuDType::kFloat32, ls);
  ASSERT_TRUE(first.Train(0, 2).ok());
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(first.engine(), &ckpt).ok());

  Trainer second(Placement::kNvmeEverything, 9, Model(), CpuDType::kFloat32,
                 ls);
  MemoryCheckpointReader reader(&ckpt);
  ASSERT_TRUE(second.engine().LoadState(reader).ok());
  EXPECT_EQ(second.engine().LossScale(), 16.0);
  ASSERT_TRUE(second.Train(2, 4).ok());
  EXPECT_EQ(second.Masters(), ref.Masters());
  EXPECT_EQ(second.engine().LossScale(), 64.0);

  std::string& blob = ckpt.blobs["strata.engine"];
  const size_t at = blob.find("\"scale\":");
  ASSERT_NE(at, std::string::npos) << blob;
  blob.replace(at, std::string("\"scale\":").size(), "\"scale\":-");
  Trainer third(Placement::kHostStates, 9, Model(), CpuDType::kFloat32, ls);
  const auto before = third.Masters();
  MemoryCheckpointReader bad(&ckpt);
  Status st = third.engine().LoadState(bad);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("loss scale"), std::string::npos)
      << st.ToString();
  EXPECT_EQ(third.Masters(), before);
  EXPECT_EQ(third.engine().LossScale(), 4.0);
}

TEST(StateIo, ACorruptPieceFailsTheSaveNamingIt) {
  Trainer run(Placement::kNvmeEverything, 1);
  ASSERT_TRUE(run.Train(0, 1).ok());
  // Damage every swap file past its first blocks: reads of the states fail
  // their checksums.
  int damaged = 0;
  for (const auto& e : std::filesystem::directory_iterator(run.dir())) {
    if (!e.is_regular_file() || e.file_size() < (64 << 10)) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    for (uint64_t off = 20 << 10; off < e.file_size(); off += 16 << 10) {
      f.seekp(static_cast<std::streamoff>(off));
      f.put('\x5a');
    }
    ++damaged;
  }
  ASSERT_GT(damaged, 0);
  MemoryCheckpoint ckpt;
  MemoryCheckpointWriter w(&ckpt);
  Status st = run.engine().SaveState(w);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.ToString().find("SaveState"), std::string::npos);
  EXPECT_FALSE(ckpt.committed);
}

TEST(StateIo, AFailedReadBeforeAnyStoreLeavesTheEngineUsable) {
  Trainer ref(Placement::kHostStates, 1);
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(ref.engine(), &ckpt).ok());
  Trainer run(Placement::kNvmeEverything, 5);
  const auto before = run.Masters();
  MemoryCheckpointReader reader(&ckpt);
  reader.fail_read = 0;
  EXPECT_EQ(run.engine().LoadState(reader).code(), StatusCode::kCorruption);
  EXPECT_EQ(run.Masters(), before);
  EXPECT_TRUE(run.Train(0, 1).ok());
}

TEST(StateIo, AFailedReadAfterAStoreFailsTheEngine) {
  Trainer ref(Placement::kHostStates, 1);
  MemoryCheckpoint ckpt;
  ASSERT_TRUE(Save(ref.engine(), &ckpt).ok());
  Trainer run(Placement::kNvmeEverything, 5);
  MemoryCheckpointReader reader(&ckpt);
  reader.fail_read = 4;
  Status st = run.engine().LoadState(reader);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.ToString().find("injected"), std::string::npos);
  EXPECT_EQ(run.engine().Fetch(0).status().code(),
            StatusCode::kFailedPrecondition);
  StepArgs a;
  EXPECT_EQ(run.engine().Step(a).status().code(),
            StatusCode::kFailedPrecondition);
}

// ---- Adafactor and SM3 (Note [Factored optimizers in the engine]) ----

// The factored optimizers the tests run: Adafactor as HF's defaults, and
// with a first moment in bf16, a fixed lr and weight decay; SM3 plain and
// with momentum.
std::vector<std::pair<std::string, OptimizerOptions>> FactoredOptimizers() {
  std::vector<std::pair<std::string, OptimizerOptions>> out;
  OptimizerOptions o;
  o.cpu.threads = 1;
  o.cpu.algo = CpuOptimizerAlgo::kAdafactor;
  out.emplace_back("adafactor", o);
  OptimizerOptions m = o;
  m.cpu.adafactor.beta1 = 0.9;
  m.cpu.adafactor.relative_step = false;
  m.cpu.weight_decay = 0.01;
  m.moment_dtype = CpuDType::kBFloat16;
  out.emplace_back("adafactor, bf16 first moment", m);
  OptimizerOptions s = o;
  s.cpu.algo = CpuOptimizerAlgo::kSm3;
  s.cpu.beta1 = 0.0;
  out.emplace_back("sm3", s);
  s.cpu.beta1 = 0.9;
  out.emplace_back("sm3, momentum", s);
  return out;
}

// Each tensor stepped alone by CpuOptimizer::Step, as Trainer trains it:
// the masters after `steps` steps, and in *path each weight's moves added
// up, step by step, without their signs.
std::vector<std::vector<float>> StepAlone(
    const OptimizerOptions& opt, int steps,
    std::vector<std::vector<double>>* path) {
  auto cpu = NewCpuOptimizer(opt.cpu);
  EXPECT_TRUE(cpu.ok());
  std::vector<std::vector<float>> out;
  path->clear();
  for (size_t i = 0; i < Model().size(); ++i) {
    const Shape& sh = Model()[i];
    const uint64_t n = Numel(sh);
    std::vector<float> master(n), grad(n), m(n), before(n);
    std::vector<double> moves(n, 0.0);
    for (uint64_t k = 0; k < n; ++k) master[k] = InitialOf(i, k, 1);
    CpuStepShape shape;
    shape.n = n;
    if (sh.shape.size() == 2) {
      shape.rows = static_cast<size_t>(sh.shape[0]);
      shape.cols = static_cast<size_t>(sh.shape[1]);
    }
    auto fp = CpuStepFootprintOf(opt.cpu, shape);
    EXPECT_TRUE(fp.ok());
    std::vector<float> stats(fp->exp_avg_sq_bytes / 4);
    for (int s = 0; s < steps; ++s) {
      for (uint64_t k = 0; k < n; ++k) grad[k] = GradOf(i, k, s);
      CpuOptimizerTensors t;
      t.n = n;
      t.rows = shape.rows;
      t.cols = shape.cols;
      t.master = master.data();
      t.grad = grad.data();
      t.exp_avg = m.data();  // fp32 here: the engine's may be bf16
      t.exp_avg_sq = stats.data();
      CpuStepArgs a;
      a.step = s + 1;
      a.lr = 1e-2;
      before = master;
      auto r = (*cpu)->Step(t, a);
      EXPECT_TRUE(r.ok() && r->applied);
      for (uint64_t k = 0; k < n; ++k) {
        moves[k] += std::fabs(static_cast<double>(master[k]) - before[k]);
      }
    }
    out.push_back(std::move(master));
    path->push_back(std::move(moves));
  }
  return out;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

// Trained in the engine (tensors cut into pieces mid-row, in every tier),
// each tensor moves as CpuOptimizer::Step moves it alone: SM3 bit for bit,
// Adafactor to its sums' rounding (another order of the same sums). That
// rounding moves each step's update by a small fraction of it, so the
// bound is a fraction of the weight's moves added up, not of its net move:
// where the gradient changes sign from step to step the moves cancel and
// the net move is a small part of what was rounded.
TEST(StateIo, FactoredOptimizersStepAsEachTensorAlone) {
  for (const auto& [name, opt] : FactoredOptimizers()) {
    if (opt.moment_dtype != CpuDType::kFloat32) continue;  // the reference's
    SCOPED_TRACE(name);
    const bool sm3 = opt.cpu.algo == CpuOptimizerAlgo::kSm3;
    std::vector<std::vector<double>> path;
    const auto alone = StepAlone(opt, 4, &path);
    std::vector<std::vector<float>> init;
    for (size_t i = 0; i < Model().size(); ++i) {
      std::vector<float> v(Numel(Model()[i]));
      for (size_t k = 0; k < v.size(); ++k) v[k] = InitialOf(i, k, 1);
      init.push_back(std::move(v));
    }
    for (Placement p : {Placement::kHostStates, Placement::kNvmeEverything,
                        Placement::kHostParams, Placement::kNvmeGradients}) {
      SCOPED_TRACE(static_cast<int>(p));
      Trainer t(p, 1, Model(), CpuDType::kFloat32, {}, &opt);
      ASSERT_TRUE(t.Train(0, 4).ok());
      const auto masters = t.Masters();
      for (size_t i = 0; i < masters.size(); ++i) {
        const std::vector<float> got = AsFloats(masters[i]);
        ASSERT_EQ(got.size(), alone[i].size());
        size_t bad = 0;
        for (size_t k = 0; k < got.size() && bad < 3; ++k) {
          const double want = alone[i][k];
          const bool ok = sm3 ? std::memcmp(&got[k], &alone[i][k], 4) == 0
                              : std::fabs(got[k] - want) <=
                                    1e-5 * path[i][k] + 3e-7 * std::fabs(want);
          if (!ok) {
            ADD_FAILURE() << Model()[i].name << "[" << k << "]: " << got[k]
                          << " vs " << want << " alone";
            ++bad;
          }
        }
        // The step moved it.
        EXPECT_NE(got, init[i]) << Model()[i].name;
      }
    }
  }
}

// A resumed run equals the uninterrupted one bit for bit: the statistics
// and the weights' sums of squares travel in the checkpoint's blob.
TEST(StateIo, FactoredOptimizersResumeBitForBit) {
  for (const auto& [name, opt] : FactoredOptimizers()) {
    for (Placement p : {Placement::kHostStates, Placement::kNvmeEverything,
                        Placement::kNvmeGradients}) {
      SCOPED_TRACE(name + ", placement " + std::to_string(static_cast<int>(p)));
      Trainer ref(p, 1, Model(), CpuDType::kFloat32, {}, &opt);
      Reference r;
      RunReference(ref, &r);
      if (HasFailure()) return;
      EXPECT_FALSE(r.ckpt.blobs["strata.engine.factored"].empty());
      Trainer resumed(p, 7, Model(), CpuDType::kFloat32, {}, &opt);
      ExpectResumedEqual(resumed, r);
      // Without the statistics the load is refused, naming the blob.
      MemoryCheckpoint no_stats = r.ckpt;
      no_stats.blobs.erase("strata.engine.factored");
      Trainer other(p, 7, Model(), CpuDType::kFloat32, {}, &opt);
      MemoryCheckpointReader reader(&no_stats);
      Status st = other.engine().LoadState(reader);
      EXPECT_NE(st.message().find("no blob strata.engine.factored"),
                std::string::npos)
          << st.ToString();
    }
  }
}

// Adafactor without a first moment keeps no moment per element: a step
// whose states rest on NVMe reads a third of AdamW's bytes and writes 8
// fewer a parameter, and the state at rest is the master and the
// statistics.
TEST(StateIo, FactoredStatesMoveOnlyTheMaster) {
  OptimizerOptions adamw;
  adamw.cpu.threads = 1;
  const OptimizerOptions adafactor = FactoredOptimizers()[0].second;
  uint64_t elems = 0;  // of the masters, padding included
  EngineStats adamw_step, adafactor_step, adamw_rest, adafactor_rest;
  for (const OptimizerOptions* opt :
       std::vector<const OptimizerOptions*>{&adamw, &adafactor}) {
    Trainer t(Placement::kNvmeEverything, 1, Model(), CpuDType::kFloat32, {},
              opt);
    ASSERT_TRUE(t.Train(0, 1).ok());
    const EngineStats before = t.engine().stats();
    ASSERT_TRUE(t.Train(1, 2).ok());
    EngineStats d = t.engine().stats();
    d.nvme_read_bytes -= before.nvme_read_bytes;
    d.nvme_write_bytes -= before.nvme_write_bytes;
    (opt == &adamw ? adamw_step : adafactor_step) = d;
    (opt == &adamw ? adamw_rest : adafactor_rest) = before;
  }
  elems = adafactor_step.nvme_read_bytes / 4;
  ASSERT_GT(elems, 0u);
  EXPECT_EQ(adamw_step.nvme_read_bytes, 3 * adafactor_step.nvme_read_bytes);
  EXPECT_EQ(adamw_step.nvme_write_bytes - adafactor_step.nvme_write_bytes,
            8 * elems);
  uint64_t lines = 0;  // the statistics: rows + cols, or 1 + n
  for (const Shape& s : Model()) {
    lines += s.shape.size() == 2 ? s.shape[0] + s.shape[1] : 1 + Numel(s);
  }
  EXPECT_EQ(adamw_rest.optimizer_state_bytes, 12 * elems);
  EXPECT_EQ(adafactor_rest.optimizer_state_bytes, 4 * elems + 4 * lines);
}

// Gradients on NVMe: a step reads each piece of the gradient once for the
// update and once for each of Adafactor's passes before it. Pieces joined
// into whole rows (Note [Whole rows from pieces]), a matrix takes its RMS
// with the statistics wherever the pieces cut it: two reads; one whose rows
// are too wide for that takes an RMS pass of its own, three. SM3 reads once
// (SM3 runs first). Measured against the same step with the gradients on
// the host, which reads the rest. After BeginStep (Note [Adafactor's
// statistics during backward] in memtier/factored.cc) the statistics pass
// runs as the last micro-batch is added (a vector's from its sums set
// aside then), over the ranges Step would take (the same bits), and reads
// nothing: one read fewer, with one micro-batch or two (the pieces read
// back and added to between them).
TEST(StateIo, FactoredGradientsOnNvmeAreReadOncePerPass) {
  struct Case {
    const char* name;
    std::vector<Shape> model;
    uint64_t adafactor_reads;
  };
  // Pieces of 16 KiB: 4096 fp32 elements.
  const std::vector<Case> cases = {
      {"one piece of whole rows",
       {{"w", {16, 256}, ElementType::kBFloat16}},
       2},
      {"rows cut by pieces", {{"w", {40, 1000}, ElementType::kBFloat16}}, 2},
      {"a piece a row", {{"w", {5, 4096}, ElementType::kBFloat16}}, 2},
      {"a piece short of the last row",
       {{"w", {5, 1000}, ElementType::kBFloat16}},
       2},
      {"rows longer than a piece",
       {{"w", {3, 5000}, ElementType::kBFloat16}},
       2},
      {"two tensors cut",
       {{"a", {9, 700}, ElementType::kBFloat16},
        {"b", {31, 333}, ElementType::kBFloat16}},
       2},
      {"rows wider than the fused RMS takes",
       {{"w", {2, 40000}, ElementType::kBFloat16}},
       3},
      {"vectors packed beside matrices, one cut",
       {{"a", {9, 700}, ElementType::kBFloat16},
        {"v", {5000}, ElementType::kBFloat16},
        {"b", {31, 333}, ElementType::kBFloat16},
        {"s", {7}, ElementType::kBFloat16},
        {"r", {1, 300}, ElementType::kBFloat16}},
       2},
  };
  const OptimizerOptions adafactor = FactoredOptimizers()[0].second;
  OptimizerOptions sm3 = adafactor;
  sm3.cpu.algo = CpuOptimizerAlgo::kSm3;
  sm3.cpu.beta1 = 0.0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    uint64_t n = 0;
    for (const Shape& sh : c.model) n += Numel(sh);
    uint64_t grad_bytes = 0;
    for (const OptimizerOptions* opt :
         std::vector<const OptimizerOptions*>{&sm3, &adafactor}) {
      const bool is_sm3 = opt == &sm3;
      SCOPED_TRACE(is_sm3 ? "sm3" : "adafactor");
      // Gradients on the host; on NVMe; on NVMe with BeginStep; the last
      // two with two micro-batches a step.
      struct Run {
        Placement where;
        bool begin_step;
        int micro;
      };
      const Run runs[] = {{Placement::kNvmeEverything, false, 1},
                          {Placement::kNvmeGradients, false, 1},
                          {Placement::kNvmeGradients, true, 1},
                          {Placement::kNvmeGradients, false, 2},
                          {Placement::kNvmeGradients, true, 2}};
      uint64_t read[5] = {}, passes[5] = {};
      std::vector<float> master[5];
      for (int g = 0; g < 5; ++g) {
        const Run& r = runs[g];
        Trainer t(r.where, 1, c.model, CpuDType::kFloat32, {}, opt);
        ASSERT_TRUE(t.Train(0, 1, r.begin_step, r.micro).ok());
        const EngineStats before = t.engine().stats();
        ASSERT_TRUE(t.Train(1, 2, r.begin_step, r.micro).ok());
        const EngineStats after = t.engine().stats();
        read[g] = after.nvme_read_bytes - before.nvme_read_bytes;
        passes[g] = after.early_passes - before.early_passes;
        for (const auto& m : t.Masters()) {
          const std::vector<float> f = AsFloats(m);
          master[g].insert(master[g].end(), f.begin(), f.end());
        }
      }
      // After BeginStep the same bits. SM3: the same reads, no pass.
      // Adafactor: every matrix's statistics pass taken during the
      // hand-overs, its read saved (checked below against grad_bytes).
      EXPECT_EQ(master[2], master[1]);
      EXPECT_EQ(master[4], master[3]);
      EXPECT_EQ(passes[1] + passes[3], 0u);
      uint64_t matrices = 0;  // the vectors' sums are set aside instead
      for (const Shape& sh : c.model) {
        matrices += sh.shape.size() == 2 && sh.shape[0] >= 2 ? 1 : 0;
      }
      EXPECT_EQ(passes[2], is_sm3 ? 0u : matrices);
      EXPECT_EQ(passes[4], passes[2]);
      EXPECT_EQ(read[1] - read[2], read[3] - read[4]);
      if (is_sm3) {
        EXPECT_EQ(read[2], read[1]);
      }
      // SM3's extra reads are the unit's gradient, its padding included.
      if (is_sm3) {
        grad_bytes = read[1] - read[0];
        EXPECT_GE(grad_bytes, n * 4);
      } else {
        EXPECT_EQ(read[1] - read[0], c.adafactor_reads * grad_bytes);
        EXPECT_EQ(read[1] - read[2], grad_bytes);
      }
      // One tensor in one piece: the same ranges, the same bits. Cut by
      // pieces: Adafactor's sums in another order.
      if (is_sm3 || (c.model.size() == 1 && n <= 4096)) {
        EXPECT_EQ(master[0], master[1]);
      } else {
        ASSERT_EQ(master[0].size(), master[1].size());
        for (size_t k = 0; k < master[0].size(); ++k) {
          ASSERT_NEAR(master[1][k], master[0][k],
                      1e-6 * std::fabs(master[0][k]) + 1e-9)
              << k;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata
