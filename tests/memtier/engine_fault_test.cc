// The fault matrix of docs/reliability.md through the engine (rows 1-4, 14
// and 17): parameters and optimizer states rest on NVMe, over a swap space
// whose AsyncIo the test hands to the engine (EngineOptions::shared_io). That
// AsyncIo runs a FaultInjectingBackend (over the in-memory backend and over
// a kernel one) and counts every batch and every run of its callback. Swap
// files are also edited behind the engine's back (bit flips, truncation).
//
// What must hold: a failed or corrupt read never makes a copy resident, and
// Wait, WaitOn, Fetch and Step return the error naming the tensor; a failed
// write-back fails the Step and then the engine refuses further use (Note
// [Engine failures] in memtier/engine.cc); transient faults are absorbed and
// training stays bit-identical with a fault-free run; an engine destroyed
// with fetches, prefetches and gradients in flight runs every callback once
// and leaks nothing.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/async_io.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/host_buffer.h"
#include "swap/backend.h"
#include "swap/fault_backend.h"
#include "swap/swap_space_internal.h"
#include "tests/memtier/engine_test_util.h"
#include "tests/swap/test_util.h"

namespace strata {
namespace {

using swap::FaultPlan;
using swap::FaultRule;
using testing::ScratchDir;

constexpr int kWidth = 128;  // 16 Ki elements: one unit and one piece each
constexpr int kTensors = 4;
constexpr uint64_t kUnitBytes = kWidth * kWidth * 2;  // bf16
constexpr size_t kElems = size_t{kWidth} * kWidth;
constexpr uint32_t kBlock = 64 << 10;

// An AsyncIo that forwards to another and counts, per accepted batch, the
// runs of its callback: after the engine is gone every one must have run
// exactly once. While held, batches wait here before they reach the ring.
class CountingIo final : public AsyncIo {
 public:
  explicit CountingIo(std::unique_ptr<AsyncIo> inner)
      : inner_(std::move(inner)) {}

  using AsyncIo::Submit;
  Status Submit(std::span<const IoRequest> batch, IoPriority priority,
                IoCallback done) override {
    uint64_t id;
    IoCallback counted;
    {
      std::lock_guard<std::mutex> l(mu_);
      id = next_++;
      runs_[id] = 0;
      counted = [this, id, done = std::move(done)](std::span<IoCompletion> c) {
        {
          std::lock_guard<std::mutex> run_lock(mu_);
          ++runs_[id];
        }
        done(c);
      };
      if (held_) {
        held_batches_.push_back(
            {{batch.begin(), batch.end()}, priority, std::move(counted)});
        return Status::Ok();
      }
    }
    Status st = inner_->Submit(batch, priority, std::move(counted));
    if (!st.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      runs_.erase(id);  // refused: its callback never runs
    }
    return st;
  }

  void Hold() {
    std::lock_guard<std::mutex> l(mu_);
    held_ = true;
  }
  // Submits what was held, in order.
  void Release() {
    std::vector<Held> batches;
    {
      std::lock_guard<std::mutex> l(mu_);
      held_ = false;
      batches.swap(held_batches_);
    }
    for (Held& b : batches) {
      EXPECT_TRUE(inner_->Submit(b.batch, b.priority, std::move(b.done)).ok());
    }
  }
  StatusOr<FileId> Open(const std::string& path,
                        const OpenOptions& options) override {
    return inner_->Open(path, options);
  }
  Status Close(FileId file) override { return inner_->Close(file); }
  Status Allocate(FileId file, uint64_t bytes) override {
    return inner_->Allocate(file, bytes);
  }
  Status Sync(FileId file) override { return inner_->Sync(file); }
  size_t alignment(FileId file) const override {
    return inner_->alignment(file);
  }
  bool direct(FileId file) const override { return inner_->direct(file); }
  std::string_view name() const override { return inner_->name(); }
  IoBackend backend() const override { return inner_->backend(); }
  std::string_view fallback_reason() const override {
    return inner_->fallback_reason();
  }
  uint32_t queue_depth() const override { return inner_->queue_depth(); }
  bool OnCompletionThread() const override {
    return inner_->OnCompletionThread();
  }

  uint64_t accepted() const {
    std::lock_guard<std::mutex> l(mu_);
    return runs_.size();
  }
  // Accepted batches whose callback ran other than once, as "id:runs".
  std::string Unbalanced() const {
    std::lock_guard<std::mutex> l(mu_);
    std::string out;
    for (const auto& [id, runs] : runs_) {
      if (runs != 1)
        out += std::to_string(id) + ":" + std::to_string(runs) + " ";
    }
    return out;
  }

 private:
  // Unregistered buffers (as on the backends without fixed buffers).
  int AddBuffer(std::span<std::byte>) override { return -1; }
  void RemoveBuffer(int) override {}

  struct Held {
    std::vector<IoRequest> batch;
    IoPriority priority;
    IoCallback done;
  };
  std::unique_ptr<AsyncIo> inner_;
  mutable std::mutex mu_;
  uint64_t next_ = 0;
  std::map<uint64_t, int> runs_;
  bool held_ = false;
  std::vector<Held> held_batches_;
};

enum class Under { kMemory, kKernel };

using testing::HostDevice;

std::string Name(int i) { return "w" + std::to_string(i); }

// Initial values: the first elements of each tensor form a pattern found
// nowhere else in the swap file (bf16 and fp32 alike are exact).
std::vector<float> Initial(int i) {
  std::vector<float> v(kElems);
  for (size_t j = 0; j < kElems; ++j) v[j] = (i + 1) + (j % 256) / 64.0f;
  return v;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  EXPECT_TRUE(ConvertCpuArray(v.data(), CpuDType::kFloat32, out.data(),
                              CpuDType::kBFloat16, v.size())
                  .ok());
  return out;
}

// A trainer over kTensors tensors: each micro-batch fetches every tensor,
// reads it back from the device and hands over a gradient computed from
// those bytes, so a stale or corrupt fetch would change the result.
class Trainer {
 public:
  explicit Trainer(EngineOptions o) : options_(std::move(o)) {}
  ~Trainer() { Destroy(); }

  Status Start() {
    dev_ = HostDevice();
    STRATA_ASSIGN_OR_RETURN(stream_, dev_->NewStream({}));
    STRATA_ASSIGN_OR_RETURN(eng_, Engine::Create(options_, dev_.get()));
    for (int i = 0; i < kTensors; ++i) {
      TensorSpec s;
      s.name = Name(i);
      s.shape = {kWidth, kWidth};
      STRATA_ASSIGN_OR_RETURN(TensorId id, eng_->Register(s));
      ids_.push_back(id);
    }
    STRATA_RETURN_IF_ERROR(eng_->Start());
    for (int i = 0; i < kTensors; ++i) {
      STRATA_RETURN_IF_ERROR(eng_->SetInitialValues(ids_[i], Initial(i)));
    }
    return Status::Ok();
  }

  // Fetches tensor i and copies its working copy (bf16) to the host.
  Status FetchToHost(int i, std::vector<uint16_t>* out) {
    STRATA_ASSIGN_OR_RETURN(ParamPin p, eng_->Fetch(ids_[i]));
    STRATA_RETURN_IF_ERROR(p.WaitOn(*stream_));
    out->resize(kElems);
    STRATA_RETURN_IF_ERROR(dev_->CopyAsync(
        *stream_, out->data(), p.data(), kElems * 2, CopyKind::kDeviceToHost));
    return dev_->SynchronizeStream(*stream_);
  }

  // Hands over a gradient derived from `param` (fp32, in device memory the
  // engine frees).
  Status AddGrad(int i, const std::vector<uint16_t>& param) {
    std::vector<float> g(kElems);
    STRATA_RETURN_IF_ERROR(ConvertCpuArray(param.data(), CpuDType::kBFloat16,
                                           g.data(), CpuDType::kFloat32,
                                           kElems));
    for (size_t j = 0; j < kElems; ++j) {
      g[j] = g[j] * 0.01f - 0.001f * static_cast<float>(j % 7);
    }
    STRATA_ASSIGN_OR_RETURN(DeviceMemory m,
                            dev_->Allocate(kElems * 4, *stream_));
    STRATA_RETURN_IF_ERROR(dev_->CopyAsync(
        *stream_, m.data(), g.data(), kElems * 4, CopyKind::kHostToDevice));
    return eng_->AddGrad(ids_[i], std::move(m), ElementType::kFloat32,
                         *stream_);
  }

  Status MicroBatch() {
    for (int i = 0; i < kTensors; ++i) {
      std::vector<uint16_t> p;
      STRATA_RETURN_IF_ERROR(FetchToHost(i, &p));
      STRATA_RETURN_IF_ERROR(AddGrad(i, p));
    }
    return dev_->SynchronizeStream(*stream_);
  }

  // What every step of this trainer gets.
  static StepArgs Args() {
    StepArgs a;
    a.lr = 1e-2;
    return a;
  }

  StatusOr<StepResult> Step() { return eng_->Step(Args()); }

  Status BeginStep() { return eng_->BeginStep(Args()); }

  Status TrainStep() {
    STRATA_RETURN_IF_ERROR(MicroBatch());
    STRATA_ASSIGN_OR_RETURN(StepResult r, Step());
    if (!r.applied) return Status::Internal("step skipped");
    return Status::Ok();
  }

  std::vector<std::vector<float>> Masters() {
    std::vector<std::vector<float>> out;
    for (TensorId id : ids_) {
      std::vector<float> v(kElems);
      Status st = eng_->ReadMaster(id, v);
      EXPECT_TRUE(st.ok()) << st.ToString();
      out.push_back(std::move(v));
    }
    return out;
  }

  void Destroy() {
    eng_.reset();
    if (stream_) {
      ASSERT_TRUE(dev_->SynchronizeStream(*stream_).ok());
    }
  }

  Engine& engine() { return *eng_; }
  Device& device() { return *dev_; }
  Stream& stream() { return *stream_; }
  TensorId id(int i) const { return ids_[i]; }

 private:
  EngineOptions options_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Engine> eng_;
  std::vector<TensorId> ids_;
};

constexpr int kSteps = 3;

// Faults the engine absorbs, injected anew in each step's hand-overs (and
// fetches) and again in its Step.
struct TransientCase {
  const char* name;
  std::vector<FaultRule> rules;
};

class EngineFaultTest : public ::testing::TestWithParam<Under> {
 protected:
  // The format the moments rest in (Options).
  CpuDType moments_ = CpuDType::kFloat32;

  void SetUp() override {
    plan_ = std::make_shared<FaultPlan>();
    io_options_.queue_depth = 4;
  }

  std::unique_ptr<swap::Backend> Inner() {
    if (GetParam() == Under::kMemory) {
      return swap::NewMemoryBackend(io_options_);
    }
    auto u = swap::NewUringBackend(io_options_);
    if (u.ok()) return std::move(u).value();
    return std::move(swap::NewThreadBackend(io_options_)).value();
  }

  // Options over a fresh fault-injecting AsyncIo (kept in io_).
  EngineOptions Options() {
    auto a = AsyncIo::Create(
        swap::NewFaultInjectingEngine(Inner(), plan_, io_options_));
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    io_ = std::make_shared<CountingIo>(std::move(a).value());
    EngineOptions o;
    o.partition_bytes = 64 << 10;
    o.staging_buffer_bytes = 64 << 10;
    o.io_block_bytes = kBlock;
    o.io.queue_depth = 4;
    o.optimizer.cpu.threads = 1;
    o.persistence_threshold_bytes = 0;  // every unit may be evicted
    o.params = Residence::kNvme;
    o.optimizer_states = Residence::kNvme;
    o.nvme_paths = {dir_.path()};
    o.device_budget_bytes = 3 * kUnitBytes;
    o.prefetch_bytes = kUnitBytes;
    o.shared_io = io_;
    o.optimizer.moment_dtype = moments_;
    return o;
  }

  // Starts `t`, trains one step and begins the next (BeginStep, with the
  // arguments of Trainer::Step).
  static Status StartAndBeginStep(Trainer& t) {
    STRATA_RETURN_IF_ERROR(t.Start());
    STRATA_RETURN_IF_ERROR(t.TrainStep());
    return t.BeginStep();
  }

  // kSteps steps without faults. `change`, when given, edits Options()
  // first.
  std::vector<std::vector<float>> Baseline(
      void (*change)(EngineOptions&) = nullptr) {
    EngineOptions o = Options();
    if (change != nullptr) change(o);
    Trainer t(o);
    Status st = t.Start();
    EXPECT_TRUE(st.ok()) << st.ToString();
    for (int s = 0; s < kSteps && st.ok(); ++s) {
      st = t.TrainStep();
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
    return t.Masters();
  }

  // After the engine is gone: every callback ran once.
  void ExpectCallbacksBalanced() {
    EXPECT_GT(io_->accepted(), 0u);
    EXPECT_EQ(io_->Unbalanced(), "");
  }

  // A step under `rule` (after `steps` good ones) fails with `code`, saying
  // `what` and naming a tensor; then the engine refuses every call that
  // touches the training state, and once destroyed every callback ran once.
  // `change`, when given, edits Options() first.
  void ExpectStepFailsThenRefuses(int steps, const FaultRule& rule,
                                  StatusCode code, const std::string& what,
                                  void (*change)(EngineOptions&) = nullptr);

  // Each case trains kSteps steps (with BeginStep before each step's
  // hand-overs when `begin_step`; then every tensor, a matrix, must have
  // had Adafactor's statistics pass during them) to the masters of
  // Baseline(change), every callback run once. `change` as above.
  void ExpectTransientFaultsChangeNothing(
      const std::vector<TransientCase>& cases,
      void (*change)(EngineOptions&) = nullptr, bool begin_step = false);

  // The one swap file of the directory.
  std::string SwapFile() const {
    for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
      const std::string n = e.path().filename().string();
      if (n.rfind("strata-swap", 0) == 0 &&
          n.find(".lock") == std::string::npos) {
        return e.path().string();
      }
    }
    return "";
  }

  ScratchDir dir_;
  std::shared_ptr<FaultPlan> plan_;
  IoEngineOptions io_options_;
  std::shared_ptr<CountingIo> io_;
};

void ExpectSame(const std::vector<std::vector<float>>& a,
                const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size());
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4), 0)
        << Name(static_cast<int>(i)) << " differs";
  }
}

bool Has(const Status& st, const std::string& what) {
  return st.ToString().find(what) != std::string::npos;
}

// After a Step failed part-way, every call that touches the training state
// is refused with the first error; stats() still answers.
void ExpectRefusesAfterFailedStep(Trainer& t, const Status& first) {
  const std::string why(first.message());
  auto check = [&](const Status& st, const char* call) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition)
        << call << ": " << st.ToString();
    EXPECT_TRUE(Has(st, "Step failed part-way")) << st.ToString();
    EXPECT_TRUE(Has(st, why.substr(0, 40))) << st.ToString();
  };
  check(t.engine().Fetch(t.id(0)).status(), "Fetch");
  std::vector<uint16_t> zeros(kElems, 0);
  check(t.AddGrad(1, zeros), "AddGrad");
  check(t.Step().status(), "Step");
  std::vector<float> m(kElems);
  check(t.engine().ReadMaster(t.id(0), m), "ReadMaster");
  check(t.engine().SetInitialValues(t.id(0), Initial(0)), "SetInitialValues");
  EXPECT_GT(t.engine().stats().fetches, 0u);
}

void EngineFaultTest::ExpectStepFailsThenRefuses(
    int steps, const FaultRule& rule, StatusCode code, const std::string& what,
    void (*change)(EngineOptions&)) {
  EngineOptions o = Options();
  if (change != nullptr) change(o);
  Trainer t(o);
  ASSERT_TRUE(t.Start().ok());
  for (int s = 0; s < steps; ++s) ASSERT_TRUE(t.TrainStep().ok());
  ASSERT_TRUE(t.MicroBatch().ok());
  plan_->Clear();
  plan_->Add(rule);
  auto r = t.Step();
  plan_->Clear();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), what)) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), " of w")) << r.status().ToString();
  ExpectRefusesAfterFailedStep(t, r.status());
  t.Destroy();
  ExpectCallbacksBalanced();
}

void EngineFaultTest::ExpectTransientFaultsChangeNothing(
    const std::vector<TransientCase>& cases, void (*change)(EngineOptions&),
    bool begin_step) {
  const auto base = Baseline(change);
  for (const TransientCase& c : cases) {
    SCOPED_TRACE(c.name);
    EngineOptions o = Options();
    if (change != nullptr) change(o);
    Trainer t(o);
    ASSERT_TRUE(t.Start().ok());
    const uint64_t before = plan_->injected();
    for (int s = 0; s < kSteps; ++s) {
      if (begin_step) {
        ASSERT_TRUE(t.BeginStep().ok());
      }
      plan_->Clear();
      for (const FaultRule& r : c.rules) plan_->Add(r);
      Status st = t.MicroBatch();  // the fetches' reads (and the spill's)
      ASSERT_TRUE(st.ok()) << st.ToString();
      plan_->Clear();
      for (const FaultRule& r : c.rules) plan_->Add(r);
      auto r = t.Step();  // the step's reads and writes
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_TRUE(r->applied);
    }
    plan_->Clear();
    EXPECT_GE(plan_->injected(), before + kSteps);
    if (begin_step) {
      EXPECT_EQ(t.engine().stats().early_passes, uint64_t{kSteps} * kTensors);
    }
    ExpectSame(base, t.Masters());
    t.Destroy();
    ExpectCallbacksBalanced();
  }
}

// Adafactor, its gradients resting on NVMe.
void AdafactorGradsOnNvme(EngineOptions& o) {
  o.grads = Residence::kNvme;
  o.optimizer.cpu.algo = CpuOptimizerAlgo::kAdafactor;
}

// ---- Rows 1 and 2: write-back fails ----------------------------------------

// Row 1: ENOSPC on a write-back fails the step naming the tensor, and the
// engine fails cleanly from then on; destroying it runs every callback.
TEST_P(EngineFaultTest, NoSpaceOnWriteBackFailsStepThenEngineRefuses) {
  for (uint64_t nth : {1, 4, 9}) {
    SCOPED_TRACE("write " + std::to_string(nth));
    ExpectStepFailsThenRefuses(1,
                               {.op = IoOp::kWrite,
                                .err = ENOSPC,
                                .nth = nth,
                                .count = FaultRule::kForever},
                               StatusCode::kNoSpace, "writing the");
  }
}

// Row 2: a persistent EIO fails the step with the tensor, the file and the
// offset; then the engine refuses.
TEST_P(EngineFaultTest, PersistentWriteErrorFailsStepNamingTensorAndOffset) {
  ExpectStepFailsThenRefuses(
      0,
      {.op = IoOp::kWrite, .err = EIO, .nth = 1, .count = FaultRule::kForever},
      StatusCode::kIoError, "writing the");
  // The swap space's words follow the engine's.
  ExpectStepFailsThenRefuses(
      0,
      {.op = IoOp::kWrite, .err = EIO, .nth = 2, .count = FaultRule::kForever},
      StatusCode::kIoError, "offset");
}

// ---- Row 3: reads fail ------------------------------------------------------

// A fetch whose read fails: Wait and WaitOn name the tensor, a second Fetch
// while pinned gets the error at once, and once unpinned the copy is gone:
// the next fetch reads again (a miss) and gets the right bytes.
TEST_P(EngineFaultTest, FailedFetchNamesTensorAndIsNeverResident) {
  Trainer t(Options());
  ASSERT_TRUE(t.Start().ok());
  plan_->Add(
      {.op = IoOp::kRead, .err = EIO, .nth = 1, .count = FaultRule::kForever});
  auto p = t.engine().Fetch(t.id(1));
  ASSERT_TRUE(p.ok()) << p.status().ToString();  // returns at once
  Status w = p->Wait();
  EXPECT_EQ(w.code(), StatusCode::kIoError) << w.ToString();
  EXPECT_TRUE(Has(w, "reading the parameters of w1")) << w.ToString();
  Status on = p->WaitOn(t.stream());
  EXPECT_EQ(on.code(), StatusCode::kIoError) << on.ToString();
  auto again = t.engine().Fetch(t.id(1));
  EXPECT_EQ(again.status().code(), StatusCode::kIoError)
      << again.status().ToString();
  p->Reset();
  plan_->Clear();

  const EngineStats before = t.engine().stats();
  std::vector<uint16_t> got;
  Status st = t.FetchToHost(1, &got);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(got, ToBf16(Initial(1)));
  const EngineStats after = t.engine().stats();
  EXPECT_EQ(after.fetch_hits, before.fetch_hits) << "a failed copy was reused";
  EXPECT_GT(after.nvme_read_bytes, before.nvme_read_bytes);
  t.Destroy();
  ExpectCallbacksBalanced();
}

// Note [Waiting for an arrival] in memtier/engine.cc: with the fetch's read
// held before the ring, WaitOn waits on the host for the read (not for the
// copy), and the consumer stream then sees the data.
TEST_P(EngineFaultTest, WaitOnWaitsForTheReadThenTheStreamForTheCopy) {
  Trainer t(Options());
  ASSERT_TRUE(t.Start().ok());
  io_->Hold();
  auto p = t.engine().Fetch(t.id(2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::promise<Status> waited;
  std::thread waiter([&] { waited.set_value(p->WaitOn(t.stream())); });
  io_->Release();
  waiter.join();
  Status on = waited.get_future().get();
  ASSERT_TRUE(on.ok()) << on.ToString();
  auto pinned = t.device().AllocatePinnedHost(kElems * 2, {});
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  ASSERT_TRUE(t.device()
                  .CopyAsync(t.stream(), pinned->data(), p->data(), kElems * 2,
                             CopyKind::kDeviceToHost)
                  .ok());
  ASSERT_TRUE(t.device().SynchronizeStream(t.stream()).ok());
  std::vector<uint16_t> got(kElems);
  std::memcpy(got.data(), pinned->data(), kElems * 2);
  EXPECT_EQ(got, ToBf16(Initial(2)));
  p->Reset();
  t.Destroy();
  ExpectCallbacksBalanced();
}

// A read that fails during the step fails it naming the state and tensor.
TEST_P(EngineFaultTest, ReadErrorDuringStepFailsItNamingTheTensor) {
  ExpectStepFailsThenRefuses(
      0,
      {.op = IoOp::kRead, .err = EIO, .nth = 1, .count = FaultRule::kForever},
      StatusCode::kIoError, "reading the");
}

// Adafactor with the gradients on NVMe reads them back before the update
// (its statistics): a read that fails there fails the step, saying so and
// naming the tensor, before any weight moves; then the engine refuses.
TEST_P(EngineFaultTest, ReadErrorBeforeAdafactorsUpdateFailsTheStep) {
  ExpectStepFailsThenRefuses(
      1,
      {.op = IoOp::kRead, .err = EIO, .nth = 1, .count = FaultRule::kForever},
      StatusCode::kIoError,
      "the gradients read back for adafactor's passes before the update: "
      "engine: reading the gradient of w",
      AdafactorGradsOnNvme);
}

// Transient faults in every step (one EIO on a write-back, one or two on
// the reads of the fetches and of the step, short transfers, EINTR and
// EAGAIN), injected anew in each step's hand-overs and in its Step.
std::vector<TransientCase> TransientCases() {
  return {
      // Row 2: relocated by the swap space to a spare slot.
      {"write EIO 1st", {{.op = IoOp::kWrite, .err = EIO, .nth = 1}}},
      {"write EIO 6th", {{.op = IoOp::kWrite, .err = EIO, .nth = 6}}},
      {"write EIO 11th", {{.op = IoOp::kWrite, .err = EIO, .nth = 11}}},
      // Row 3: retried by the engine.
      {"read EIO", {{.op = IoOp::kRead, .err = EIO, .nth = 2, .count = 1}}},
      {"read EIO twice",
       {{.op = IoOp::kRead, .err = EIO, .nth = 1, .count = 2}}},
      {"short transfers",
       {{.kind = FaultRule::Kind::kShort,
         .nth = 1,
         .count = FaultRule::kForever,
         .short_bytes = 4096}}},
      {"EINTR and EAGAIN",
       {{.err = EINTR, .nth = 1, .count = 2},
        {.err = EAGAIN, .nth = 7, .count = 2}}},
  };
}

// The transient faults are absorbed: training ends bit-identical with a
// fault-free run.
TEST_P(EngineFaultTest, TransientFaultsLeaveTrainingBitIdentical) {
  ExpectTransientFaultsChangeNothing(TransientCases());
}

// Adafactor with the gradients on NVMe after BeginStep: the statistics pass
// runs on each last sum as the spill adds it, before its write (Note
// [Adafactor's statistics during backward] in memtier/factored.cc), and the
// step reads the gradients once, for the update. The same transient faults,
// on those writes and on the step's reads, change nothing: the masters of a
// fault-free run with Step alone, every matrix passed during the
// hand-overs.
TEST_P(EngineFaultTest, TransientFaultsAroundEarlyStatisticsFromTheSpill) {
  ExpectTransientFaultsChangeNothing(TransientCases(), AdafactorGradsOnNvme,
                                     /*begin_step=*/true);
}

// ---- Rows 4 and 14: the swap file edited behind the engine ----------------

// Where a piece rests in the one swap file: scans the headers (all slots up
// to the spare ones were written at Start) and the payloads.
struct SwapFileLayout {
  uint64_t header_bytes = 0, payload_base = 0, file_bytes = 0;

  static SwapFileLayout Of(const std::vector<char>& file) {
    SwapFileLayout l;
    l.file_bytes = file.size();
    uint64_t magic = swap::BlockHeader::kMagic;
    for (uint64_t off = 512; off + 8 <= file.size(); off += 512) {
      if (std::memcmp(file.data() + off, &magic, 8) == 0) {
        l.header_bytes = off;  // slot 1's header
        break;
      }
    }
    if (l.header_bytes != 0) {
      const uint64_t slots = file.size() / (l.header_bytes + kBlock);
      l.payload_base = slots * l.header_bytes;
    }
    return l;
  }
  // The slot whose payload starts with `pattern`, or -1.
  int64_t SlotOf(const std::vector<char>& file, const void* pattern,
                 size_t n) const {
    for (uint64_t off = payload_base; off + n <= file.size(); off += kBlock) {
      if (std::memcmp(file.data() + off, pattern, n) == 0) {
        return static_cast<int64_t>((off - payload_base) / kBlock);
      }
    }
    return -1;
  }
};

std::vector<char> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void FlipBit(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  f.flush();
  ASSERT_TRUE(f.good());
}

// Row 14: a bit flipped in a piece's payload, then in its header: the fetch
// fails with kCorruption naming the tensor and the file, its copy is never
// resident, and once the bit is restored the right bytes arrive. The same in
// a master piece fails the step, and the engine refuses from then on.
TEST_P(EngineFaultTest, CorruptPieceFailsFetchAndStepNamingTheTensor) {
  if (GetParam() == Under::kMemory) GTEST_SKIP() << "edits a real file";
  Trainer t(Options());
  ASSERT_TRUE(t.Start().ok());
  const std::string path = SwapFile();
  ASSERT_FALSE(path.empty());
  const std::vector<char> file = ReadFile(path);
  const SwapFileLayout l = SwapFileLayout::Of(file);
  ASSERT_GT(l.header_bytes, 0u);
  const auto w2 = ToBf16(Initial(2));
  const int64_t slot = l.SlotOf(file, w2.data(), 64);
  ASSERT_GE(slot, 0) << "w2's parameters not found in " << path;
  swap::BlockHeader hdr;
  std::memcpy(&hdr, file.data() + slot * l.header_bytes, sizeof hdr);
  ASSERT_EQ(hdr.slot, static_cast<uint64_t>(slot));

  const uint64_t payload = l.payload_base + slot * kBlock + 1000;
  const uint64_t header = slot * l.header_bytes + 20;
  for (uint64_t at : {payload, header}) {
    SCOPED_TRACE(at == payload ? "payload" : "header");
    // The three others in the budget: w2, least recently used, is evicted.
    for (int i : {0, 1, 3}) {
      std::vector<uint16_t> other;
      ASSERT_TRUE(t.FetchToHost(i, &other).ok());
    }
    FlipBit(path, at);
    const uint64_t hits = t.engine().stats().fetch_hits;
    auto p = t.engine().Fetch(t.id(2));
    EXPECT_EQ(t.engine().stats().fetch_hits, hits) << "w2 was still cached";
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    Status w = p->Wait();
    EXPECT_EQ(w.code(), StatusCode::kCorruption) << w.ToString();
    EXPECT_TRUE(Has(w, "reading the parameters of w2")) << w.ToString();
    EXPECT_TRUE(Has(w, path)) << w.ToString();
    p->Reset();
    FlipBit(path, at);  // restored
    std::vector<uint16_t> got;
    Status st = t.FetchToHost(2, &got);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(got, w2);
  }

  // A master piece: the step fails, naming it.
  const auto m3 = Initial(3);
  const int64_t mslot = l.SlotOf(file, m3.data(), 64);
  ASSERT_GE(mslot, 0);
  FlipBit(path, l.payload_base + mslot * kBlock + 4000);
  ASSERT_TRUE(t.MicroBatch().ok());
  auto r = t.Step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption)
      << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), "reading the master of w3"))
      << r.status().ToString();
  ExpectRefusesAfterFailedStep(t, r.status());
  t.Destroy();
  ExpectCallbacksBalanced();
}

// Row 4: the swap file truncated under the engine: fetches and the step
// fail with kCorruption ("end of file") naming the tensor, never abort.
TEST_P(EngineFaultTest, TruncatedSwapFileFailsFetchAndStepCleanly) {
  if (GetParam() == Under::kMemory) GTEST_SKIP() << "truncates a real file";
  Trainer t(Options());
  ASSERT_TRUE(t.Start().ok());
  ASSERT_TRUE(t.TrainStep().ok());
  const std::string path = SwapFile();
  ASSERT_FALSE(path.empty());
  const SwapFileLayout l = SwapFileLayout::Of(ReadFile(path));
  ASSERT_GT(l.payload_base, 0u);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(l.payload_base)), 0);
  for (int i = 0; i < kTensors; ++i) {
    auto p = t.engine().Fetch(t.id(i));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    Status w = p->Wait();
    EXPECT_EQ(w.code(), StatusCode::kCorruption) << w.ToString();
    EXPECT_TRUE(Has(w, "end of file")) << w.ToString();
    EXPECT_TRUE(Has(w, "of " + Name(i))) << w.ToString();
  }
  auto r = t.Step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption)
      << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), " of w")) << r.status().ToString();
  ExpectRefusesAfterFailedStep(t, r.status());
  t.Destroy();
  ExpectCallbacksBalanced();
}

// ---- Row 10: the budget full of copies still arriving --------------------

// Copies arriving and unpinned hold the whole budget (their reads held back
// before the ring): a fetch waits for one to land and evict it, instead of
// failing with kOutOfMemory; the reads are let go from another thread.
TEST_P(EngineFaultTest, FetchWaitsForArrivalsInsteadOfRunningOutOfBudget) {
  Trainer t(Options());
  ASSERT_TRUE(t.Start().ok());
  io_->Hold();
  for (int i = 0; i < 3; ++i) {                   // the budget: three units
    ASSERT_TRUE(t.engine().Fetch(t.id(i)).ok());  // pin dropped at once
  }
  std::thread release([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    io_->Release();
  });
  std::vector<uint16_t> got;
  Status st = t.FetchToHost(3, &got);
  release.join();
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(got, ToBf16(Initial(3)));
  EXPECT_GE(t.engine().stats().evictions, 1u);
  t.Destroy();
  ExpectCallbacksBalanced();
}

// ---- Faults during updates in backward (BeginStep) -------------------------

// A write that fails while units are updated during backward (the only
// writes then are theirs) fails the step naming the tensor, but the updates
// are undone, so the engine stays usable: the steps after it end
// bit-identical with a fault-free run.
TEST_P(EngineFaultTest, AFaultDuringAnEarlyUpdateIsUndone) {
  // The undo puts the moments back in the format they rest in.
  for (CpuDType md :
       {CpuDType::kFloat32, CpuDType::kBFloat16, CpuDType::kBlock8})
    for (uint64_t nth : {1, 6}) {
      SCOPED_TRACE(std::string(MomentDTypeName(md)) + ", write " +
                   std::to_string(nth));
      moments_ = md;
      const auto base = Baseline();
      const FaultRule rule = {
          .op = IoOp::kWrite, .err = ENOSPC, .nth = nth, .count = 1};
      EngineOptions o = Options();
      o.step_overlap_bytes = 16 << 20;
      Trainer t(o);
      ASSERT_TRUE(StartAndBeginStep(t).ok());
      plan_->Clear();
      plan_->Add(rule);
      Status st = t.MicroBatch();
      ASSERT_TRUE(st.ok()) << st.ToString();
      auto r = t.Step();
      plan_->Clear();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), StatusCode::kNoSpace)
          << r.status().ToString();
      EXPECT_TRUE(Has(r.status(), " of w")) << r.status().ToString();
      EXPECT_GT(t.engine().stats().early_undone, 0u);
      for (int s = 1; s < kSteps; ++s) {
        st = t.TrainStep();
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
      ExpectSame(base, t.Masters());
      t.Destroy();
      ExpectCallbacksBalanced();
    }
}

// ---- Row 17: shutdown with I/O in flight ------------------------------------

// The engine is destroyed at every point of a second step (the trace is
// recorded, so fetches start prefetches): fetches whose pins were dropped at
// once, prefetches, gradients still being copied and accumulated, and just
// after a step. Every callback runs once; no device or pinned memory, swap
// file or lock is left behind.
TEST_P(EngineFaultTest, DestroyedWithFetchesPrefetchesAndGradsInFlight) {
  const uint64_t pinned_before = HostBuffer::TotalPinnedBytes();
  // Operations of the second step before the engine goes: fetch i (pin
  // dropped at once), hand over gradient i, and a final Step.
  for (int cut = 0; cut <= 2 * kTensors + 1; ++cut) {
    SCOPED_TRACE("cut after " + std::to_string(cut) + " operations");
    {
      Trainer t(Options());
      ASSERT_TRUE(t.Start().ok());
      ASSERT_TRUE(t.TrainStep().ok());  // records the trace
      int done = 0;
      std::vector<uint16_t> zeros(kElems, 0);
      for (int i = 0; i < kTensors && done < cut; ++i) {
        auto p = t.engine().Fetch(t.id(i));
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        ++done;  // dropped unwaited: its read (and prefetches) in flight
        if (done < cut) {
          ASSERT_TRUE(t.AddGrad(i, zeros).ok());
          ++done;
        }
      }
      if (done < cut) {
        ASSERT_TRUE(t.Step().ok());
        // The next step's first fetch and gradient right behind it.
        ASSERT_TRUE(t.engine().Fetch(t.id(0)).ok());
        ASSERT_TRUE(t.AddGrad(0, zeros).ok());
      }
      if (cut > 0) {
        EXPECT_GT(t.engine().stats().prefetches, 0u);  // the trace's
      }
      t.Destroy();
      EXPECT_EQ(t.device().memory_stats().in_use_bytes, 0u)
          << "device memory left allocated";
    }
    ExpectCallbacksBalanced();
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), pinned_before);
    EXPECT_EQ(SwapFile(), "") << "swap file left behind";
  }
}

// Row 17 with updates during backward queued and running: the engine is
// destroyed right after the last gradient was handed over.
TEST_P(EngineFaultTest, DestroyedWithEarlyUpdatesInFlight) {
  const uint64_t pinned_before = HostBuffer::TotalPinnedBytes();
  for (int handed = 1; handed <= kTensors; handed += 3) {
    SCOPED_TRACE(std::to_string(handed) + " gradients handed over");
    {
      EngineOptions o = Options();
      o.step_overlap_bytes = 16 << 20;
      Trainer t(o);
      ASSERT_TRUE(StartAndBeginStep(t).ok());
      for (int i = 0; i < handed; ++i) {
        std::vector<uint16_t> p;
        ASSERT_TRUE(t.FetchToHost(i, &p).ok());
        ASSERT_TRUE(t.AddGrad(i, p).ok());
      }
      t.Destroy();
      EXPECT_EQ(t.device().memory_stats().in_use_bytes, 0u);
    }
    ExpectCallbacksBalanced();
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), pinned_before);
    EXPECT_EQ(SwapFile(), "") << "swap file left behind";
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, EngineFaultTest,
                         ::testing::Values(Under::kMemory, Under::kKernel),
                         [](const auto& p) {
                           return p.param == Under::kMemory ? "memory"
                                                            : "kernel";
                         });

}  // namespace
}  // namespace strata
