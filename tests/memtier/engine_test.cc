// The engine end to end on the host-emulated device: a small deep linear
// network (an MLP without activations) trained through Fetch/AddGrad/Step,
// with everything resting in different tiers, must end bit-identical;
// eviction, prefetch across an order change, overflow, clipping and the
// errors a user meets.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "tests/memtier/engine_test_util.h"
#include "tests/memtier/small_engine_options.h"
#include "tests/swap/test_util.h"

namespace strata {
namespace {

using testing::HostDevice;
using testing::ScratchDir;

constexpr int kWidth = 128;  // 16 Ki elements per layer: one unit each
constexpr int kLayers = 20;
constexpr int kBatch = 16;
constexpr uint64_t kUnitBytes = kWidth * kWidth * 2;  // bf16

EngineOptions BaseOptions() { return testing::SmallEngineOptions(); }

// The trainer: a deep linear network y = W_L ... W_1 x, loss 0.5 |y - t|^2
// / batch, computed on the device with GEMMs in bf16 and fp32 accumulation.
class LinearNet {
 public:
  LinearNet(Device* device, Engine* engine) : dev_(device), eng_(engine) {
    stream_ = std::move(dev_->NewStream({}).value());
    for (int l = 0; l < kLayers; ++l) {
      TensorSpec s;
      s.name = "layer" + std::to_string(l) + ".weight";
      s.shape = {kWidth, kWidth};
      ids_.push_back(eng_->Register(s).value());
    }
    // A few small tensors that the engine packs into one unit.
    for (int i = 0; i < 3; ++i) {
      TensorSpec s;
      s.name = "norm" + std::to_string(i);
      s.shape = {kWidth};
      small_.push_back(eng_->Register(s).value());
    }
  }

  Status Init(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(kWidth)));
    for (TensorId id : ids_) {
      std::vector<float> w(kWidth * kWidth);
      for (float& x : w) x = nd(rng);
      STRATA_RETURN_IF_ERROR(eng_->SetInitialValues(id, w));
    }
    for (TensorId id : small_) {
      std::vector<float> w(kWidth, 1.0f);
      STRATA_RETURN_IF_ERROR(eng_->SetInitialValues(id, w));
    }
    return Status::Ok();
  }

  // One micro-batch: forward, loss gradient on the host, backward.
  Status MicroBatch(uint32_t seed) {
    const size_t act = size_t{kWidth} * kBatch;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> x(act), target(act);
    for (float& v : x) v = nd(rng);
    for (float& v : target) v = nd(rng);
    std::vector<DeviceMemory> y, ybf;  // fp32 and bf16 activations
    for (int l = 0; l <= kLayers; ++l) {
      STRATA_ASSIGN_OR_RETURN(DeviceMemory a,
                              dev_->Allocate(act * 4, *stream_));
      STRATA_ASSIGN_OR_RETURN(DeviceMemory b,
                              dev_->Allocate(act * 2, *stream_));
      y.push_back(std::move(a));
      ybf.push_back(std::move(b));
    }
    STRATA_RETURN_IF_ERROR(dev_->CopyAsync(*stream_, y[0].data(), x.data(),
                                           act * 4, CopyKind::kHostToDevice));
    // The small tensors are fetched too (packed in one unit).
    for (TensorId id : small_) {
      STRATA_ASSIGN_OR_RETURN(ParamPin p, eng_->Fetch(id));
      STRATA_RETURN_IF_ERROR(p.WaitOn(*stream_));
    }
    for (int l = 0; l < kLayers; ++l) {
      STRATA_ASSIGN_OR_RETURN(ParamPin w, eng_->Fetch(ids_[l]));
      STRATA_RETURN_IF_ERROR(w.WaitOn(*stream_));
      STRATA_RETURN_IF_ERROR(Convert(y[l], ybf[l], act));
      STRATA_RETURN_IF_ERROR(Gemm(GemmOp::kNoTranspose, GemmOp::kNoTranspose,
                                  kWidth, kBatch, kWidth, w.data(), kWidth,
                                  ybf[l].data(), kWidth, y[l + 1].data()));
    }
    // dy = (y - t) / batch, on the host.
    std::vector<float> out(act);
    STRATA_RETURN_IF_ERROR(dev_->CopyAsync(*stream_, out.data(),
                                           y[kLayers].data(), act * 4,
                                           CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(dev_->SynchronizeStream(*stream_));
    loss_ = 0;
    for (size_t i = 0; i < act; ++i) {
      const float d = out[i] - target[i];
      loss_ += 0.5 * d * d / kBatch;
      out[i] = d / kBatch;
    }
    STRATA_ASSIGN_OR_RETURN(DeviceMemory dy, dev_->Allocate(act * 4, *stream_));
    STRATA_ASSIGN_OR_RETURN(DeviceMemory dybf,
                            dev_->Allocate(act * 2, *stream_));
    STRATA_RETURN_IF_ERROR(dev_->CopyAsync(*stream_, dy.data(), out.data(),
                                           act * 4, CopyKind::kHostToDevice));
    for (int l = kLayers - 1; l >= 0; --l) {
      STRATA_ASSIGN_OR_RETURN(ParamPin w, eng_->Fetch(ids_[l]));
      STRATA_RETURN_IF_ERROR(w.WaitOn(*stream_));
      STRATA_RETURN_IF_ERROR(Convert(dy, dybf, act));
      // dW = dy * y_{l}^T (fp32), handed to the engine.
      STRATA_ASSIGN_OR_RETURN(DeviceMemory dw,
                              dev_->Allocate(kWidth * kWidth * 4, *stream_));
      STRATA_RETURN_IF_ERROR(Gemm(GemmOp::kNoTranspose, GemmOp::kTranspose,
                                  kWidth, kWidth, kBatch, dybf.data(), kWidth,
                                  ybf[l].data(), kWidth, dw.data()));
      if (before_grad) STRATA_RETURN_IF_ERROR(before_grad(l, dw));
      STRATA_RETURN_IF_ERROR(eng_->AddGrad(ids_[l], std::move(dw),
                                           ElementType::kFloat32, *stream_));
      // dy_{l-1} = W^T dy.
      STRATA_RETURN_IF_ERROR(Gemm(GemmOp::kTranspose, GemmOp::kNoTranspose,
                                  kWidth, kBatch, kWidth, w.data(), kWidth,
                                  dybf.data(), kWidth, dy.data()));
    }
    return dev_->SynchronizeStream(*stream_);
  }

  std::vector<float> Master(TensorId id) {
    std::vector<float> v(
        eng_->spec(id).shape.size() == 1 ? kWidth : size_t{kWidth} * kWidth);
    EXPECT_TRUE(eng_->ReadMaster(id, v).ok());
    return v;
  }

  // Called before each layer's gradient is handed over (it may change it).
  std::function<Status(int layer, DeviceMemory& grad)> before_grad;

  const std::vector<TensorId>& ids() const { return ids_; }
  const std::vector<TensorId>& small() const { return small_; }
  double loss() const { return loss_; }
  Stream& stream() { return *stream_; }
  Device& device() { return *dev_; }

 private:
  Status Convert(const DeviceMemory& in, DeviceMemory& out, size_t n) {
    ConvertArgs c;
    c.src = in.data();
    c.src_type = ElementType::kFloat32;
    c.dst = out.data();
    c.dst_type = ElementType::kBFloat16;
    c.count = n;
    return dev_->ConvertAsync(*stream_, c);
  }
  Status Gemm(GemmOp oa, GemmOp ob, int64_t m, int64_t n, int64_t k,
              const void* a, int64_t lda, const void* b, int64_t ldb, void* c) {
    GemmArgs g;
    g.op_a = oa;
    g.op_b = ob;
    g.m = m;
    g.n = n;
    g.k = k;
    g.ab_type = ElementType::kBFloat16;
    g.c_type = ElementType::kFloat32;
    g.a = a;
    g.lda = lda;
    g.b = b;
    g.ldb = ldb;
    g.c = c;
    g.ldc = m;
    return dev_->GemmAsync(*stream_, g);
  }

  Device* dev_;
  Engine* eng_;
  std::unique_ptr<Stream> stream_;
  std::vector<TensorId> ids_, small_;
  double loss_ = 0;
};

struct Trained {
  std::vector<std::vector<float>> masters;
  std::vector<double> losses;
  EngineStats stats;
};

// How Train steps.
struct Plan {
  int steps = 3;
  int micro = 2;
  double clip = 1.0;
  // BeginStep before each step's last micro-batch.
  bool begin_step = false;
  // Runs before each step (0-based), e.g. to set the net's before_grad.
  std::function<void(int step, Engine& engine, LinearNet& net)> before_step;
  int skipped_step = -1;  // the one step expected not to be applied
};

// Three steps without clipping, which BeginStep needs off: Step alone, and
// BeginStep before each step's last micro-batch.
Plan StepAlone() {
  Plan p;
  p.clip = 0;
  return p;
}

Plan WithBeginStep() {
  Plan p = StepAlone();
  p.begin_step = true;
  return p;
}

Trained Train(EngineOptions o, const Plan& plan) {
  auto dev = HostDevice();
  auto eng = Engine::Create(o, dev.get());
  EXPECT_TRUE(eng.ok()) << eng.status().ToString();
  Trained t;
  if (!eng.ok()) return t;
  LinearNet net(dev.get(), eng->get());
  Status st = (*eng)->Start();
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (!st.ok()) return t;
  st = net.Init(7);
  EXPECT_TRUE(st.ok()) << st.ToString();
  StepArgs a;
  a.lr = 1e-3;
  a.max_grad_norm = plan.clip;
  for (int s = 0; s < plan.steps; ++s) {
    net.before_grad = nullptr;
    if (plan.before_step) plan.before_step(s, **eng, net);
    for (int m = 0; m < plan.micro; ++m) {
      if (plan.begin_step && m == plan.micro - 1) {
        st = (*eng)->BeginStep(a);
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
      st = net.MicroBatch(100 + m);  // the same batches every step
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return t;
      t.losses.push_back(net.loss());
    }
    auto r = (*eng)->Step(a);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) {
      EXPECT_EQ(r->applied, s != plan.skipped_step) << "step " << s;
    }
  }
  for (TensorId id : net.ids()) t.masters.push_back(net.Master(id));
  for (TensorId id : net.small()) t.masters.push_back(net.Master(id));
  t.stats = (*eng)->stats();
  return t;
}

Trained Train(EngineOptions o, int steps = 3, int micro = 2) {
  Plan p;
  p.steps = steps;
  p.micro = micro;
  return Train(o, p);
}

void ExpectBitIdentical(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.masters.size(), b.masters.size());
  for (size_t i = 0; i < a.masters.size(); ++i) {
    ASSERT_EQ(a.masters[i].size(), b.masters[i].size());
    EXPECT_EQ(std::memcmp(a.masters[i].data(), b.masters[i].data(),
                          a.masters[i].size() * 4),
              0)
        << "tensor " << i << " differs";
  }
  EXPECT_EQ(a.losses, b.losses);
}

TEST(EngineTest, OffloadingChangesNothing) {
  EngineOptions resident = BaseOptions();
  resident.params = Residence::kDevice;
  resident.optimizer_states = Residence::kHost;
  const Trained base = Train(resident);
  ASSERT_FALSE(base.masters.empty());
  // Training did something: the loss of the first batch, seen again in the
  // last step, went down.
  ASSERT_EQ(base.losses.size(), 6u);
  EXPECT_LT(base.losses[4], base.losses[0]);

  for (IoBackend backend : {IoBackend::kMemory, IoBackend::kAuto})
    for (Residence grads : {Residence::kHost, Residence::kNvme}) {
      SCOPED_TRACE(std::string(IoBackendName(backend)) + ", grads on " +
                   std::string(ResidenceName(grads)));
      ScratchDir dir;
      EngineOptions off = BaseOptions();
      off.params = Residence::kNvme;
      off.optimizer_states = Residence::kNvme;
      // On NVMe the twenty layers' gradients pass through two open pieces, so
      // the second micro-batch reads each back and adds to it.
      off.grads = grads;
      off.nvme_paths = {dir.path()};
      off.io.backend = backend;
      // A tenth of the parameters' own bytes (the whole training state is 9
      // times more): room for two of the twenty layers at once.
      const uint64_t params = (kLayers * kWidth * kWidth + 3 * kWidth) * 2ull;
      off.device_budget_bytes = params / 10;
      ASSERT_LT(off.device_budget_bytes, 3 * kUnitBytes);
      const Trained t = Train(off);
      ExpectBitIdentical(base, t);
      EXPECT_GT(t.stats.evictions, 0u);
      EXPECT_GT(t.stats.nvme_read_bytes, 0u);
      EXPECT_GT(t.stats.nvme_write_bytes, 0u);
      EXPECT_LE(t.stats.device.peak_bytes, off.device_budget_bytes);
      EXPECT_GT(t.stats.prefetches, 0u);
    }
  {
    EngineOptions host = BaseOptions();
    host.params = Residence::kHost;
    host.optimizer_states = Residence::kHost;
    host.device_budget_bytes = 3 * kUnitBytes;
    ExpectBitIdentical(base, Train(host));
    // Gradients alone on NVMe, and one micro-batch a step (each piece is
    // written once and never read back before the step).
    ScratchDir dir;
    host.grads = Residence::kNvme;
    host.nvme_paths = {dir.path()};
    ExpectBitIdentical(base, Train(host));
    EngineOptions one = resident;
    ExpectBitIdentical(Train(one, 3, 1), Train(host, 3, 1));
  }
}

// The tiers the tests of updates during backward run over; NVMe on the
// in-memory backend.
EngineOptions OverlapOptions(Residence params, Residence states,
                             const std::string& dir) {
  EngineOptions o = BaseOptions();
  o.params = params;
  o.optimizer_states = states;
  if (params == Residence::kNvme || states == Residence::kNvme) {
    o.nvme_paths = {dir};
    o.io.backend = IoBackend::kMemory;
  }
  if (params != Residence::kDevice) o.device_budget_bytes = 4 * kUnitBytes;
  o.step_overlap_bytes = 64 << 20;
  return o;
}

const std::vector<std::pair<Residence, Residence>> kOverlapTiers = {
    {Residence::kDevice, Residence::kHost},
    {Residence::kHost, Residence::kHost},
    {Residence::kNvme, Residence::kNvme},
    {Residence::kDevice, Residence::kNvme}};

std::string TiersName(Residence params, Residence states) {
  return "params on " + std::string(ResidenceName(params)) + ", states on " +
         std::string(ResidenceName(states));
}

// A single-rank communicator with world_size 1 runs no collective: the same
// bits as no communicator.
TEST(EngineTest, ASingleRankCommunicatorChangesNothing) {
  EngineOptions o = BaseOptions();
  const Trained alone = Train(o);
  o.comm = std::make_shared<Communicator>(Communicator::Create().value());
  for (int stage : {1, 2}) {
    o.zero_stage = stage;
    const Trained with = Train(o);
    ExpectBitIdentical(alone, with);
    EXPECT_EQ(with.stats.optimizer_state_bytes,
              alone.stats.optimizer_state_bytes);
  }
  // Master and two fp32 moments of every element, padding included.
  EXPECT_GE(alone.stats.optimizer_state_bytes,
            uint64_t{12} * (kLayers * kWidth * kWidth + 3 * kWidth));
  EXPECT_EQ(alone.stats.grad_bytes, alone.stats.optimizer_state_bytes / 3);
}

TEST(EngineTest, UpdatesDuringBackwardChangeNothing) {
  for (const auto& [params, states] : kOverlapTiers) {
    SCOPED_TRACE(TiersName(params, states));
    ScratchDir dir;
    EngineOptions o = OverlapOptions(params, states, dir.path());
    const Trained base = Train(o, StepAlone());
    ASSERT_FALSE(base.masters.empty());
    EXPECT_EQ(base.stats.early_units, 0u);
    const Plan overlap = WithBeginStep();
    const Trained t = Train(o, overlap);
    ExpectBitIdentical(base, t);
    // Every layer, every step; the packed unit of small tensors gets no
    // gradient and is left to Step.
    EXPECT_EQ(t.stats.early_units, 3u * kLayers);
    EXPECT_EQ(t.stats.early_undone, 0u);
    EXPECT_EQ(t.stats.early_statistics, 0u);
    if (params == Residence::kHost && states == Residence::kHost) {
      // An undo buffer of five layers' states: five layers a step, and the
      // others' gradient stats alone.
      o.step_overlap_bytes = 5 * kWidth * kWidth * 12;
      const Trained five = Train(o, overlap);
      ExpectBitIdentical(base, five);
      EXPECT_EQ(five.stats.early_units, 3u * 5);
      EXPECT_EQ(five.stats.early_statistics, 3u * (kLayers - 5));
      // No undo buffer: every layer's gradient stats alone.
      o.step_overlap_bytes = 0;
      const Trained none = Train(o, overlap);
      ExpectBitIdentical(base, none);
      EXPECT_EQ(none.stats.early_units, 0u);
      EXPECT_EQ(none.stats.early_statistics, 3u * kLayers);
    }
  }
}

// Trains with `o` three steps without BeginStep, and again with BeginStep
// and a skipped step between the first two (the last micro-batch of step 1
// hands over a NaN for layer 0, the last layer of backward, once the
// nineteen others were taken early: updated, counting in early_units, or
// their statistics taken, in early_statistics, as `early` names): both
// must end bit-identical, and only early updates are undone.
void ExpectANonFiniteGradientSkipsTheStep(const EngineOptions& o,
                                          uint64_t EngineStats::*early) {
  const Trained base = Train(o, StepAlone());
  Plan p = WithBeginStep();
  p.steps = 4;
  p.skipped_step = 1;
  p.before_step = [early](int step, Engine& eng, LinearNet& net) {
    if (step != 1) return;
    const uint64_t before = eng.stats().*early;
    auto calls = std::make_shared<int>(0);
    net.before_grad = [&eng, &net, early, before, calls](
                          int layer, DeviceMemory& g) -> Status {
      if (layer != 0 || ++*calls != 2) return Status::Ok();
      for (int i = 0; eng.stats().*early < before + kLayers - 1; ++i) {
        if (i == 60000) return Status::Internal("nothing taken early");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return net.device().MemsetAsync(net.stream(), g.data(), 0xff, g.size());
    };
  };
  Trained t = Train(o, p);
  ASSERT_EQ(t.losses.size(), 8u);
  t.losses.erase(t.losses.begin() + 2, t.losses.begin() + 4);
  ExpectBitIdentical(base, t);
  const bool updates = early == &EngineStats::early_units;
  EXPECT_EQ(t.stats.early_undone, updates ? uint64_t{kLayers} - 1 : 0u);
  EXPECT_EQ(t.stats.skipped_steps, 1u);
  EXPECT_EQ(t.stats.*early, 3u * kLayers + kLayers - 1);
}

TEST(EngineTest, ANonFiniteGradientAfterEarlyUpdatesUndoesThem) {
  for (const auto& [params, states] : kOverlapTiers) {
    SCOPED_TRACE(TiersName(params, states));
    ScratchDir dir;
    ExpectANonFiniteGradientSkipsTheStep(
        OverlapOptions(params, states, dir.path()), &EngineStats::early_units);
  }
}

// Counts what the engine asks the system for: device memory, pinned host
// memory, streams and events.
class CountingDevice : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) override {
    ++calls;
    return DeviceWrapper::Allocate(bytes, stream);
  }
  StatusOr<HostBuffer> AllocatePinnedHost(
      size_t bytes, const HostBufferOptions& options) override {
    ++calls;
    return DeviceWrapper::AllocatePinnedHost(bytes, options);
  }
  StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) override {
    ++calls;
    return DeviceWrapper::NewStream(options);
  }
  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    ++calls;
    return DeviceWrapper::NewEvent();
  }
  int calls = 0;
};

TEST(EngineTest, AfterTheFirstStepNothingIsAllocated) {
  ScratchDir dir;
  auto dev = HostDevice();
  CountingDevice counting(dev.get());
  EngineOptions o = BaseOptions();
  o.params = Residence::kNvme;
  o.optimizer_states = Residence::kNvme;
  o.grads = Residence::kNvme;
  o.nvme_paths = {dir.path()};
  o.io.backend = IoBackend::kMemory;
  o.device_budget_bytes = 3 * kUnitBytes;
  auto eng = Engine::Create(o, &counting);
  ASSERT_TRUE(eng.ok());
  LinearNet net(dev.get(), eng->get());  // the trainer's own memory apart
  ASSERT_TRUE((*eng)->Start().ok());
  ASSERT_TRUE(net.Init(1).ok());
  int calls_after_first = 0;
  uint64_t pinned_after_first = 0;
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(net.MicroBatch(5).ok());
    auto r = (*eng)->Step({});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    if (step == 0) {
      calls_after_first = counting.calls;
      pinned_after_first = HostBuffer::TotalPinnedBytes();
    }
  }
  EXPECT_EQ(counting.calls, calls_after_first);
  EXPECT_EQ(HostBuffer::TotalPinnedBytes(), pinned_after_first);
  EXPECT_EQ((*eng)->stats().hot_path_allocations, 0u);
  EXPECT_GT((*eng)->stats().evictions, 0u);
}

// Puts a pause before each copy the engine asks for, on the copy's own
// stream, once `lag` is set: the engine's streams then fall behind the host.
class LaggingDevice : public CountingDevice {
 public:
  using CountingDevice::CountingDevice;
  Status CopyAsync(Stream& stream, void* dst, const void* src, size_t bytes,
                   CopyKind kind) override {
    if (lag.count() > 0) {
      STRATA_RETURN_IF_ERROR(DeviceWrapper::LaunchHostFunc(
          stream, [d = lag] { std::this_thread::sleep_for(d); }));
    }
    return DeviceWrapper::CopyAsync(stream, dst, src, bytes, kind);
  }
  std::chrono::microseconds lag{0};
};

// Note [The arena's events] in memtier/arena.cc: the engine makes at start
// every event its arena can have in use at once. The first step here fetches
// one tensor while the streams keep up; the later ones fetch them all and
// release each before its copy has run, so every block of the budget waits
// on lagging streams at once. None of that makes an event.
TEST(EngineTest, LaterStepsOnLaggingStreamsMakeNoEvent) {
  constexpr int kTensors = 8;
  auto dev = HostDevice();
  LaggingDevice lagging(dev.get());
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.device_budget_bytes = 4 * kUnitBytes;
  auto eng = Engine::Create(o, &lagging);
  ASSERT_TRUE(eng.ok());
  std::vector<TensorId> ids;
  for (int i = 0; i < kTensors; ++i) {
    TensorSpec s;
    s.name = "t" + std::to_string(i);
    s.shape = {kWidth, kWidth};
    ids.push_back((*eng)->Register(s).value());
  }
  ASSERT_TRUE((*eng)->Start().ok());
  int calls_after_first = 0;
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < (step == 0 ? 1 : kTensors); ++i) {
      auto p = (*eng)->Fetch(ids[i]);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      if (step == 0) {
        ASSERT_TRUE(p->Wait().ok());
      }
    }
    auto r = (*eng)->Step({});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    if (step == 0) {
      calls_after_first = lagging.calls;
      lagging.lag = std::chrono::milliseconds(5);
    }
  }
  EXPECT_EQ(lagging.calls, calls_after_first);
  EXPECT_EQ((*eng)->stats().hot_path_allocations, 0u);
}

class EngineFixture : public ::testing::Test {
 protected:
  void Make(EngineOptions o, int tensors, bool start = true) {
    dev_ = HostDevice();
    auto e = Engine::Create(o, dev_.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    eng_ = std::move(e).value();
    for (int i = 0; i < tensors; ++i) {
      TensorSpec s;
      s.name = "t" + std::to_string(i);
      s.shape = {kWidth, kWidth};
      ids_.push_back(eng_->Register(s).value());
    }
    if (start) {
      Status st = eng_->Start();
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }

  std::unique_ptr<Device> dev_;
  std::unique_ptr<Engine> eng_;
  std::vector<TensorId> ids_;
};

TEST_F(EngineFixture, EvictsUnderPressureAndRefusesWhenPinsFillTheBudget) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.device_budget_bytes = 2 * kUnitBytes;
  Make(o, 4);
  for (int round = 0; round < 2; ++round) {
    for (TensorId id : ids_) {
      auto p = eng_->Fetch(id);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ASSERT_TRUE(p->Wait().ok());
    }
  }
  EXPECT_GE(eng_->stats().evictions, 6u);
  EXPECT_LE(eng_->stats().device.peak_bytes, o.device_budget_bytes);

  auto a = eng_->Fetch(ids_[0]);
  auto b = eng_->Fetch(ids_[1]);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = eng_->Fetch(ids_[2]);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(c.status().message().find("pinned"), std::string::npos)
      << c.status().ToString();
  EXPECT_NE(c.status().message().find("t2"), std::string::npos);
  // What holds the budget: the two pinned tensors, by name.
  EXPECT_NE(c.status().message().find("held by t0 (32768 bytes, 1 pin)"),
            std::string::npos)
      << c.status().ToString();
  EXPECT_NE(c.status().message().find("; t1 ("), std::string::npos)
      << c.status().ToString();
  a->Reset();
  EXPECT_TRUE(eng_->Fetch(ids_[2]).ok());  // room again once unpinned
}

TEST_F(EngineFixture, PrefetchGoesOnAfterAnOrderChange) {
  ScratchDir dir;
  EngineOptions o = BaseOptions();
  o.params = Residence::kNvme;
  o.nvme_paths = {dir.path()};
  o.io.backend = IoBackend::kMemory;
  o.device_budget_bytes = 3 * kUnitBytes;
  o.prefetch_bytes = 2 * kUnitBytes;
  Make(o, 6);
  auto pass = [&](const std::vector<int>& order) {
    for (int i : order) {
      auto p = eng_->Fetch(ids_[i]);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ASSERT_TRUE(p->Wait().ok());
    }
  };
  pass({0, 1, 2, 3, 4, 5});
  ASSERT_TRUE(eng_->Step({}).ok());
  const EngineStats s1 = eng_->stats();
  EXPECT_EQ(s1.prefetches, 0u);  // no trace yet in the first step
  pass({0, 1, 4, 5});            // a branch skips 2 and 3
  const EngineStats s2 = eng_->stats();
  EXPECT_GE(s2.order_changes, 1u);
  EXPECT_GT(s2.prefetches, s1.prefetches);
  // After the jump, 5 was still prefetched from the new position.
  EXPECT_GT(s2.prefetch_hits, 0u);
}

// After BeginStep, prefetch passes over a unit whose tensors all had their
// last gradient handed over: its next use follows Step, which drops every
// cached copy. A trace whose step fetched unit 0 once more after the
// backward (a trainer that read it for a log, say) has the backward's last
// fetches prefetch unit 0 for that use; after BeginStep they pass over it.
// The rule reads the trainer's calls alone, never the stepper's pace, as
// stage 3's ranks need to gather the same units. The masters are the same.
TEST_F(EngineFixture, BeginStepPrefetchesNoUnitHandedOver) {
  uint64_t prefetched[2] = {0, 0};
  std::vector<float> masters[2];
  for (int begin : {0, 1}) {
    SCOPED_TRACE(begin ? "with BeginStep" : "Step alone");
    EngineOptions o = BaseOptions();
    o.params = Residence::kHost;
    o.device_budget_bytes = 3 * kUnitBytes;
    o.prefetch_bytes = 2 * kUnitBytes;
    ids_.clear();
    Make(o, 6);
    auto stream = std::move(dev_->NewStream({}).value());
    auto grad = std::move(dev_->Allocate(kWidth * kWidth * 4, *stream).value());
    const std::vector<float> g(kWidth * kWidth, 0.25f);
    ASSERT_TRUE(dev_->CopyAsync(*stream, grad.data(), g.data(), g.size() * 4,
                                CopyKind::kHostToDevice)
                    .ok());
    ASSERT_TRUE(dev_->SynchronizeStream(*stream).ok());
    StepArgs a;
    a.lr = 1e-2;
    auto fetch = [&](TensorId id) {
      auto p = eng_->Fetch(id);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ASSERT_TRUE(p->Wait().ok());
    };
    // A forward, then a backward that fetches each unit again and hands
    // its gradient over, in the same order; `log`: unit 0 fetched again.
    auto step = [&](bool begin_step, bool log) {
      if (begin_step) {
        ASSERT_TRUE(eng_->BeginStep(a).ok());
      }
      for (TensorId id : ids_) fetch(id);
      for (TensorId id : ids_) {
        fetch(id);
        ASSERT_TRUE(
            eng_->AddGrad(id, grad.data(), ElementType::kFloat32, *stream)
                .ok());
      }
      if (log) fetch(ids_[0]);
      auto r = eng_->Step(a);
      ASSERT_TRUE(r.ok() && r->applied) << r.status().ToString();
    };
    step(false, true);  // the trace
    const uint64_t before = eng_->stats().prefetches;
    step(begin != 0, false);
    prefetched[begin] = eng_->stats().prefetches - before;
    masters[begin].resize(kWidth * kWidth * ids_.size());
    for (size_t i = 0; i < ids_.size(); ++i) {
      ASSERT_TRUE(eng_->ReadMaster(ids_[i], std::span<float>(masters[begin])
                                                .subspan(i * kWidth * kWidth,
                                                         kWidth * kWidth))
                      .ok());
    }
    eng_.reset();  // before the next Make replaces its device
  }
  EXPECT_GT(prefetched[1], 0u);
  EXPECT_EQ(prefetched[1] + 1, prefetched[0]);  // unit 0, for the log
  EXPECT_EQ(masters[1], masters[0]);
}

TEST_F(EngineFixture, OverflowSkipsTheStepAndClippingBoundsTheNorm) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  Make(o, 2);
  std::vector<float> init(kWidth * kWidth, 0.5f);
  ASSERT_TRUE(eng_->SetInitialValues(ids_[0], init).ok());
  auto stream = std::move(dev_->NewStream({}).value());
  auto grad = std::move(dev_->Allocate(kWidth * kWidth * 4, *stream).value());
  std::vector<float> g(kWidth * kWidth, 3.0f);
  g[5] = INFINITY;
  ASSERT_TRUE(dev_->CopyAsync(*stream, grad.data(), g.data(), g.size() * 4,
                              CopyKind::kHostToDevice)
                  .ok());
  ASSERT_TRUE(
      eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream).ok());
  auto r = eng_->Step({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->applied);
  std::vector<float> m(kWidth * kWidth);
  ASSERT_TRUE(eng_->ReadMaster(ids_[0], m).ok());
  EXPECT_EQ(m, init);
  EXPECT_EQ(eng_->stats().skipped_steps, 1u);
  EXPECT_EQ(eng_->stats().update_seconds, 0.0);  // nothing was updated

  // Finite now: scaled by 4, clipped to norm 1.
  g[5] = 3.0f;
  ASSERT_TRUE(dev_->SynchronizeStream(*stream).ok());
  ASSERT_TRUE(dev_->CopyAsync(*stream, grad.data(), g.data(), g.size() * 4,
                              CopyKind::kHostToDevice)
                  .ok());
  ASSERT_TRUE(
      eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream).ok());
  StepArgs a;
  a.loss_scale = 4;
  a.max_grad_norm = 1;
  r = eng_->Step(a);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->applied);
  EXPECT_NEAR(r->grad_norm, 0.75 * kWidth, 1e-3);  // sqrt(n * 0.75^2)
  EXPECT_EQ(r->step, 1);
  ASSERT_TRUE(eng_->ReadMaster(ids_[0], m).ok());
  EXPECT_NE(m, init);
  // The optimizer's time is part of the step's (nothing was updated early).
  const EngineStats st = eng_->stats();
  EXPECT_GT(st.update_seconds, 0.0);
  EXPECT_LE(st.update_seconds, st.step_seconds);
  const auto j = nlohmann::json::parse(EngineStatsJson(st));
  EXPECT_EQ(j["update_seconds"].get<double>(), st.update_seconds);
}

// With a dynamic loss scale the engine owns the scale: it unscales by it,
// refuses a caller's other scale, moves it on overflows and good steps, and
// reports it.
TEST_F(EngineFixture, TheEngineOwnsADynamicLossScale) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.loss_scale.mode = LossScaleMode::kDynamic;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.window = 2;
  o.loss_scale.hysteresis = 1;
  o.loss_scale.min_scale = 256;
  Make(o, 1);
  EXPECT_EQ(eng_->LossScale(), 1024.0);
  auto stream = std::move(dev_->NewStream({}).value());
  auto grad = std::move(dev_->Allocate(kWidth * kWidth * 4, *stream).value());
  // Hands over a gradient of 1.0 everywhere multiplied by the engine's
  // scale, or with an inf.
  const auto hand_over = [&](bool overflow) {
    std::vector<float> g(kWidth * kWidth,
                         static_cast<float>(eng_->LossScale()));
    if (overflow) g[7] = INFINITY;
    ASSERT_TRUE(dev_->SynchronizeStream(*stream).ok());
    ASSERT_TRUE(dev_->CopyAsync(*stream, grad.data(), g.data(), g.size() * 4,
                                CopyKind::kHostToDevice)
                    .ok());
    ASSERT_TRUE(
        eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream)
            .ok());
  };
  hand_over(false);
  StepArgs other;
  other.loss_scale = 512;
  auto r = eng_->Step(other);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("differs from the engine's"),
            std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(eng_->BeginStep(other).code(), StatusCode::kInvalidArgument);

  // (overflow, the scale the step divided by, the scale after it)
  const struct {
    bool overflow;
    double used, next;
  } steps[] = {{false, 1024, 1024}, {false, 1024, 2048}, {true, 2048, 1024},
               {true, 1024, 512},   {true, 512, 256},    {true, 256, 256},
               {false, 256, 256},   {false, 256, 512}};
  bool first = true;
  for (const auto& s : steps) {
    if (!first) hand_over(s.overflow);
    first = false;
    StepArgs a;
    if (s.used == 1024 && !s.overflow) a.loss_scale = 1024;  // its own: fine
    r = eng_->Step(a);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->applied, !s.overflow);
    EXPECT_EQ(r->loss_scale, s.used);
    if (r->applied) {
      EXPECT_NEAR(r->grad_norm, kWidth, 1e-3);  // unscaled: |1| over n
    }
    EXPECT_EQ(eng_->LossScale(), s.next);
  }
  EXPECT_EQ(eng_->stats().loss_scale, 512.0);
  EXPECT_EQ(eng_->stats().skipped_steps, 4u);
  EXPECT_NE(EngineStatsJson(eng_->stats()).find("\"loss_scale\":512"),
            std::string::npos);
}

TEST_F(EngineFixture, SmallUnitsPersistAndStatsComeAsJson) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.device_budget_bytes = 2 * kUnitBytes + 1024;
  o.persistence_threshold_bytes = 4096;  // the packed unit of small tensors
  Make(o, 4, /*start=*/false);
  TensorSpec small;
  small.name = "bias";
  small.shape = {kWidth};
  const TensorId bias = eng_->Register(small).value();
  ASSERT_TRUE(eng_->Start().ok());
  ASSERT_TRUE(eng_->Fetch(bias).ok());
  for (int round = 0; round < 3; ++round) {
    for (TensorId id : ids_) ASSERT_TRUE(eng_->Fetch(id).ok());
  }
  const uint64_t hits = eng_->stats().fetch_hits;
  ASSERT_TRUE(eng_->Fetch(bias).ok());
  EXPECT_EQ(eng_->stats().fetch_hits, hits + 1) << "the small unit was evicted";

  const auto j = nlohmann::json::parse(EngineStatsJson(eng_->stats()));
  EXPECT_EQ(j["fetches"].get<uint64_t>(), 14u);
  EXPECT_GT(j["evictions"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["device"].contains("peak_bytes"));
}

TEST_F(EngineFixture, AFragmentedArenaIsCompactedForAFetch) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.device_budget_bytes = 64 << 10;
  Make(o, 0, /*start=*/false);
  std::vector<TensorId> t;
  for (int i = 0; i < 4; ++i) {
    TensorSpec s;
    s.name = "t" + std::to_string(i);
    s.shape = {i < 3 ? 8192 : 16384};  // three of 16 KiB, one of 32 KiB
    t.push_back(eng_->Register(s).value());
  }
  ASSERT_TRUE(eng_->Start().ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        eng_->SetInitialValues(t[i], std::vector<float>(8192, i + 1.0f)).ok());
  }
  // a, b, c fill three quarters; b is used again, so a is the LRU victim and
  // the free space is split around b and c.
  for (int i : {0, 1, 2, 1}) ASSERT_TRUE(eng_->Fetch(t[i]).ok());
  auto d = eng_->Fetch(t[3]);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const EngineStats s = eng_->stats();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_GE(s.compactions, 1u);
  d->Reset();
  // The moved units still hold their values.
  auto stream = std::move(dev_->NewStream({}).value());
  for (int i : {1, 2}) {
    auto p = eng_->Fetch(t[i]);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(p->WaitOn(*stream).ok());
    std::vector<uint16_t> host(8192);
    ASSERT_TRUE(dev_->CopyAsync(*stream, host.data(), p->data(), 8192 * 2,
                                CopyKind::kDeviceToHost)
                    .ok());
    ASSERT_TRUE(dev_->SynchronizeStream(*stream).ok());
    std::vector<float> back(8192);
    ASSERT_TRUE(ConvertCpuArray(host.data(), CpuDType::kBFloat16, back.data(),
                                CpuDType::kFloat32, 8192)
                    .ok());
    EXPECT_EQ(back, std::vector<float>(8192, i + 1.0f)) << "unit " << i;
  }
}

TEST_F(EngineFixture, ErrorsNameWhatIsWrong) {
  EngineOptions o = BaseOptions();
  o.optimizer_states = Residence::kNvme;
  auto dev = HostDevice();
  auto e = Engine::Create(o, dev.get());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("nvme_paths"), std::string::npos);
  // Several ranks need the trainer's communicator, of their size.
  o = BaseOptions();
  o.world_size = 2;
  auto ranks = Engine::Create(o, dev.get());
  ASSERT_FALSE(ranks.ok());
  EXPECT_EQ(ranks.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ranks.status().message().find("needs comm"), std::string::npos)
      << ranks.status().ToString();
  o.comm = std::make_shared<Communicator>(Communicator::Create().value());
  o.zero_stage = 1;
  ranks = Engine::Create(o, dev.get());
  ASSERT_FALSE(ranks.ok());
  EXPECT_EQ(ranks.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ranks.status().message().find("comm has rank 0 of 1 but the "
                                          "options say rank 0 of world_size 2"),
            std::string::npos)
      << ranks.status().ToString();

  Make(BaseOptions(), 1, /*start=*/false);
  EXPECT_EQ(eng_->Fetch(ids_[0]).status().code(),
            StatusCode::kFailedPrecondition);
  TensorSpec dup;
  dup.name = "t0";
  dup.shape = {4};
  EXPECT_EQ(eng_->Register(dup).status().code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(eng_->Start().ok());
  EXPECT_EQ(eng_->Register(dup).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(eng_->Fetch(99).status().code(), StatusCode::kInvalidArgument);
  std::vector<float> wrong(3);
  EXPECT_EQ(eng_->SetInitialValues(ids_[0], wrong).code(),
            StatusCode::kInvalidArgument);
  auto pin = eng_->Fetch(ids_[0]);
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(eng_->Step({}).status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(EngineFixture, BeginStepStatesItsContract) {
  EngineOptions o = BaseOptions();
  o.params = Residence::kHost;
  o.step_overlap_bytes = 1 << 20;
  Make(o, 2);
  StepArgs clip;
  clip.max_grad_norm = 1;
  Status st = eng_->BeginStep(clip);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_grad_norm"), std::string::npos);
  ASSERT_TRUE(eng_->BeginStep({}).ok());
  EXPECT_EQ(eng_->BeginStep({}).code(), StatusCode::kFailedPrecondition);

  auto stream = std::move(dev_->NewStream({}).value());
  auto grad = std::move(dev_->Allocate(kWidth * kWidth * 4, *stream).value());
  ASSERT_TRUE(
      dev_->MemsetAsync(*stream, grad.data(), 0, kWidth * kWidth * 4).ok());
  ASSERT_TRUE(
      eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream).ok());
  st = eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("t0"), std::string::npos) << st.ToString();
  EXPECT_EQ(eng_->Fetch(ids_[0]).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(eng_->Fetch(ids_[1]).ok());  // no gradient handed over yet
  StepArgs other;
  other.lr = 0.5;
  EXPECT_EQ(eng_->Step(other).status().code(), StatusCode::kInvalidArgument);
  auto r = eng_->Step({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->applied);
  EXPECT_EQ(eng_->stats().early_units, 1u);
  // Past the Step, the tensor is an ordinary one again.
  EXPECT_TRUE(eng_->Fetch(ids_[0]).ok());
  EXPECT_TRUE(
      eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream).ok());
  EXPECT_TRUE(
      eng_->AddGrad(ids_[0], grad.data(), ElementType::kFloat32, *stream).ok());
  EXPECT_TRUE(eng_->WaitGrads().ok());
}

// ---- Moment formats ----------------------------------------------------

constexpr CpuDType kNarrowMoments[] = {CpuDType::kBFloat16, CpuDType::kBlock8};

// `resident` (parameters on the device, states on the host) trained again
// with parameters and states on NVMe (gradients in each of `grads`) and
// with parameters on the host: `base`'s bits every time.
void ExpectOtherTiersChangeNothing(const EngineOptions& resident,
                                   const Trained& base,
                                   const std::vector<Residence>& grads) {
  for (Residence g : grads) {
    SCOPED_TRACE("grads on " + std::string(ResidenceName(g)));
    ScratchDir dir;
    EngineOptions off = resident;
    off.params = Residence::kNvme;
    off.optimizer_states = Residence::kNvme;
    off.grads = g;
    off.nvme_paths = {dir.path()};
    off.io.backend = IoBackend::kMemory;
    off.device_budget_bytes = 2 * kUnitBytes;
    const Trained t = Train(off);
    ExpectBitIdentical(base, t);
    EXPECT_GT(t.stats.evictions, 0u);
  }
  EngineOptions host = resident;
  host.params = Residence::kHost;
  host.device_budget_bytes = 3 * kUnitBytes;
  ExpectBitIdentical(base, Train(host));
}

TEST(EngineTest, NarrowMomentsRestAnywhereAndChangeNothing) {
  const Trained wide = Train(BaseOptions());
  for (CpuDType md : kNarrowMoments) {
    SCOPED_TRACE(std::string(MomentDTypeName(md)));
    EngineOptions resident = BaseOptions();
    resident.optimizer.moment_dtype = md;
    const Trained base = Train(resident);
    ASSERT_EQ(base.masters.size(), wide.masters.size());
    // The format is in use: the masters are not fp32 moments' ones.
    bool differs = false;
    for (size_t i = 0; i < base.masters.size(); ++i) {
      differs = differs || base.masters[i] != wide.masters[i];
    }
    EXPECT_TRUE(differs);
    ASSERT_EQ(base.losses.size(), 6u);
    EXPECT_LT(base.losses[4], base.losses[0]);
    ExpectOtherTiersChangeNothing(resident, base,
                                  {Residence::kHost, Residence::kNvme});
  }
}

TEST(EngineTest, NarrowMomentsMoveAndHoldTheirOwnBytes) {
  // Twenty layers of one piece each, and the unit of the three small
  // tensors (384 elements).
  std::vector<uint64_t> pieces(kLayers, uint64_t{kWidth} * kWidth);
  pieces.push_back(3 * kWidth);
  uint64_t fp32_bytes = 0;
  for (CpuDType md :
       {CpuDType::kFloat32, CpuDType::kBFloat16, CpuDType::kBlock8}) {
    SCOPED_TRACE(std::string(MomentDTypeName(md)));
    ScratchDir dir;
    auto dev = HostDevice();
    EngineOptions o = BaseOptions();
    o.params = Residence::kHost;
    o.optimizer_states = Residence::kNvme;
    o.nvme_paths = {dir.path()};
    o.io.backend = IoBackend::kMemory;
    o.device_budget_bytes = 3 * kUnitBytes;
    o.optimizer.moment_dtype = md;
    auto eng = Engine::Create(o, dev.get());
    ASSERT_TRUE(eng.ok()) << eng.status().ToString();
    LinearNet net(dev.get(), eng->get());
    ASSERT_TRUE((*eng)->Start().ok());
    ASSERT_TRUE(net.Init(1).ok());
    // The master and both moments of every piece, read and written once.
    uint64_t expect = 0;
    for (uint64_t n : pieces) expect += n * 4 + 2 * CpuStateBytes(md, n);
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(net.MicroBatch(5).ok());
      const EngineStats before = (*eng)->stats();
      auto r = (*eng)->Step({});
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_TRUE(r->applied);
      const EngineStats after = (*eng)->stats();
      EXPECT_EQ(after.nvme_read_bytes - before.nvme_read_bytes, expect);
      EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, expect);
    }
    if (md == CpuDType::kFloat32) {
      fp32_bytes = expect;
      EXPECT_EQ(expect, 12 * (kLayers * kWidth * kWidth + 3 * kWidth));
    } else {
      // bf16: 8 bytes a parameter; int8: 6 and the scales.
      EXPECT_LE(expect * 12, fp32_bytes * (md == CpuDType::kBlock8 ? 6.01 : 8));
    }
  }
}

TEST(EngineTest, NarrowMomentsUpdateDuringBackwardAsInStep) {
  for (CpuDType md : kNarrowMoments) {
    for (const auto& [params, states] :
         {std::pair{Residence::kHost, Residence::kHost},
          std::pair{Residence::kNvme, Residence::kNvme}}) {
      SCOPED_TRACE(std::string(MomentDTypeName(md)) + ", " +
                   TiersName(params, states));
      ScratchDir dir;
      EngineOptions o = OverlapOptions(params, states, dir.path());
      o.optimizer.moment_dtype = md;
      const Trained base = Train(o, StepAlone());
      const Plan overlap = WithBeginStep();
      const Trained t = Train(o, overlap);
      ExpectBitIdentical(base, t);
      EXPECT_EQ(t.stats.early_units, 3u * kLayers);
      // An undo buffer of five layers' states in this format: five layers
      // a step.
      o.step_overlap_bytes =
          5 * (kWidth * kWidth * 4 + 2 * CpuStateBytes(md, kWidth * kWidth));
      const Trained five = Train(o, overlap);
      ExpectBitIdentical(base, five);
      EXPECT_EQ(five.stats.early_units, 3u * 5);
      o.step_overlap_bytes = 64 << 20;
      ExpectANonFiniteGradientSkipsTheStep(o, &EngineStats::early_units);
    }
  }
}

TEST_F(EngineFixture, Int8MomentsNeedWholeBlocksInAPiece) {
  EngineOptions o = BaseOptions();
  o.optimizer.moment_dtype = CpuDType::kBlock8;
  o.staging_buffer_bytes = 4096;  // 1024 fp32 elements
  Make(o, 1, /*start=*/false);
  Status st = eng_->Start();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("optimizer.moment_dtype"), std::string::npos)
      << st.ToString();
  o.optimizer.cpu.algo = CpuOptimizerAlgo::kAdagrad;
  auto dev = HostDevice();
  auto e = Engine::Create(o, dev.get());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("optimizer.moment_dtype"),
            std::string::npos);
}

// ---- Adafactor and SM3 (Note [Factored optimizers in the engine]) ----

// The deep linear network trains with each factored optimizer, to the same
// bits wherever the states and parameters rest.
TEST(EngineTest, FactoredOptimizersTrainAndRestAnywhere) {
  const Trained adamw = Train(BaseOptions());
  for (CpuOptimizerAlgo algo :
       {CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kSm3}) {
    for (bool first_moment : {false, true}) {
      SCOPED_TRACE(std::string(CpuOptimizerAlgoName(algo)) +
                   (first_moment ? ", first moment" : ""));
      EngineOptions resident = BaseOptions();
      resident.optimizer.cpu.algo = algo;
      if (algo == CpuOptimizerAlgo::kAdafactor) {
        resident.optimizer.cpu.adafactor.beta1 = first_moment ? 0.9 : 0.0;
      } else {
        resident.optimizer.cpu.beta1 = first_moment ? 0.9 : 0.0;
        resident.optimizer.cpu.weight_decay = 0.0;
      }
      if (first_moment) resident.optimizer.moment_dtype = CpuDType::kBFloat16;
      const Trained base = Train(resident);
      ASSERT_EQ(base.losses.size(), 6u);
      EXPECT_LT(base.losses[4], base.losses[0]);  // it trains
      ASSERT_EQ(base.masters.size(), adamw.masters.size());
      EXPECT_NE(base.masters[0], adamw.masters[0]);  // another optimizer
      // Gradients on NVMe too: each tensor lies in one piece, so
      // Adafactor's passes before the update take the same ranges.
      ExpectOtherTiersChangeNothing(resident, base,
                                    {Residence::kHost, Residence::kNvme});
    }
  }
}

// Note [Adafactor's statistics during backward]: after BeginStep the
// stepper takes each layer's gradient stats (and Adafactor's statistics
// pass) while the rest of backward runs, and Step updates alone, to the same
// bits wherever the states and parameters rest, with or without an undo
// buffer.
TEST(EngineTest, FactoredStatisticsDuringBackwardChangeNothing) {
  for (const auto& [params, states] : kOverlapTiers) {
    for (int k = 0; k < 3; ++k) {
      const bool first_moment = k == 1;
      const CpuOptimizerAlgo algo =
          k == 2 ? CpuOptimizerAlgo::kSm3 : CpuOptimizerAlgo::kAdafactor;
      SCOPED_TRACE(TiersName(params, states) + ", " +
                   std::string(CpuOptimizerAlgoName(algo)) +
                   (first_moment ? ", first moment" : ""));
      ScratchDir dir;
      EngineOptions o = OverlapOptions(params, states, dir.path());
      o.optimizer.cpu.algo = algo;
      o.optimizer.cpu.adafactor.beta1 = first_moment ? 0.9 : 0.0;
      if (algo == CpuOptimizerAlgo::kSm3) o.optimizer.cpu.beta1 = 0.0;
      if (k > 0) o.step_overlap_bytes = 0;  // needs no undo buffer
      const Trained base = Train(o, StepAlone());
      ASSERT_EQ(base.losses.size(), 6u);
      EXPECT_LT(base.losses[4], base.losses[0]);  // it trains
      EXPECT_EQ(base.stats.early_statistics, 0u);
      const Trained t = Train(o, WithBeginStep());
      ExpectBitIdentical(base, t);
      // Every layer, every step: the packed small tensors get no gradient.
      EXPECT_EQ(t.stats.early_statistics, 3u * kLayers);
      EXPECT_EQ(t.stats.early_units, 0u);
      // Adafactor's statistics pass over every layer's matrix with them.
      EXPECT_EQ(t.stats.early_passes,
                algo == CpuOptimizerAlgo::kAdafactor ? 3u * kLayers : 0u);
    }
  }
}

// A non-finite gradient after the statistics of the other layers were
// taken (Adafactor's passes, AdamW's gradient stats alone): the step is
// skipped, and the next ones step as if it had not come (nothing was
// changed to undo).
TEST(EngineTest, StatisticsDuringBackwardSurviveAnOverflow) {
  for (CpuOptimizerAlgo algo :
       {CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kAdamW}) {
    SCOPED_TRACE(std::string(CpuOptimizerAlgoName(algo)));
    EngineOptions o = BaseOptions();
    o.optimizer.cpu.algo = algo;
    ExpectANonFiniteGradientSkipsTheStep(o, &EngineStats::early_statistics);
  }
}

// Gradients resting on NVMe (Note [Adafactor's statistics during backward]
// in memtier/factored.cc): after BeginStep the accumulator passes each
// matrix's last micro-batch as it adds it, before its pieces are written,
// so that Step reads each gradient once, for the update: the same bits as
// Step alone, one read of every layer's gradient fewer a step.
TEST(EngineTest, AdafactorStatisticsDuringBackwardWithGradientsOnNvme) {
  ScratchDir dir;
  EngineOptions o = BaseOptions();
  o.optimizer.cpu.algo = CpuOptimizerAlgo::kAdafactor;
  const Trained base = Train(o, StepAlone());
  o.grads = Residence::kNvme;
  o.params = Residence::kHost;
  o.device_budget_bytes = 3 * kUnitBytes;
  o.nvme_paths = {dir.path()};
  o.io.backend = IoBackend::kMemory;
  const Trained alone = Train(o, StepAlone());
  ExpectBitIdentical(base, alone);
  EXPECT_EQ(alone.stats.early_passes, 0u);
  const Trained t = Train(o, WithBeginStep());
  ExpectBitIdentical(base, t);
  EXPECT_EQ(t.stats.early_passes, 3u * kLayers);
  EXPECT_EQ(t.stats.early_statistics, 0u);
  // Every layer is a unit of one piece: Step alone read it back for the
  // statistics pass too.
  EXPECT_EQ(alone.stats.nvme_read_bytes - t.stats.nvme_read_bytes,
            uint64_t{3} * kLayers * kWidth * kWidth * 4);
}

TEST_F(EngineFixture, FactoredOptimizersStateWhatTheyRefuse) {
  EngineOptions o = BaseOptions();
  o.optimizer.cpu.algo = CpuOptimizerAlgo::kAdafactor;
  Make(o, 2);
  // BeginStep refuses clipping as with every optimizer.
  StepArgs clip;
  clip.max_grad_norm = 1.0;
  Status st = eng_->BeginStep(clip);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_grad_norm 0"), std::string::npos)
      << st.ToString();
  st = eng_->BeginStep({});
  EXPECT_TRUE(st.ok()) << st.ToString();
  // A tensor of three dimensions has no rows and columns to factor.
  for (CpuOptimizerAlgo algo :
       {CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kSm3}) {
    o.optimizer.cpu.algo = algo;
    auto dev = HostDevice();
    auto e = Engine::Create(o, dev.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    TensorSpec s;
    s.name = "conv";
    s.shape = {8, 4, 3};
    ASSERT_TRUE((*e)->Register(s).ok());
    st = (*e)->Start();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("tensor conv has shape [8, 4, 3]"),
              std::string::npos)
        << st.ToString();
  }
}

}  // namespace
}  // namespace strata
