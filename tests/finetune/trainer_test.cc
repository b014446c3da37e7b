// The fine-tune example's trainer end to end on the host-emulated device at
// a tiny size: the loss falls; offloading to a device budget of a fraction
// of the model (parameters and optimizer states on NVMe) and updating during
// backward leave the loss trajectory bit-identical; a checkpoint loads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "examples/finetune/io/data.h"
#include "examples/finetune/io/safetensors.h"
#include "examples/finetune/io/tokenizer.h"
#include "examples/finetune/trainer.h"
#include "tests/swap/test_util.h"

namespace finetune {
namespace {

using strata::testing::ScratchDir;

constexpr char kText[] =
    "It was the best of times, it was the worst of times, it was the age of "
    "wisdom, it was the age of foolishness, it was the epoch of belief, it "
    "was the epoch of incredulity, it was the season of Light, it was the "
    "season of Darkness, it was the spring of hope, it was the winter of "
    "despair.\n";

TrainOptions Tiny() {
  TrainOptions o;
  o.model.vocab_size = 256;
  o.model.context_length = 32;
  o.model.n_layer = 2;
  o.model.n_head = 2;
  o.model.n_embd = 32;
  o.batch = 4;
  o.seq_len = 16;
  o.steps = 12;
  o.lr = 1e-2;
  o.warmup_steps = 2;
  o.device.choice = strata::DeviceChoice::kHostEmulated;
  o.engine.params = strata::Residence::kDevice;
  o.engine.optimizer_states = strata::Residence::kHost;
  o.engine.partition_bytes = 64 << 10;
  o.engine.persistence_threshold_bytes = 0;
  o.engine.device_budget_bytes = 16 << 20;
  o.engine.optimizer.cpu.threads = 1;
  return o;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.path() + "/text.txt";
    std::ofstream f(path_);
    for (int i = 0; i < 20; ++i) f << kText;
    f.close();
    strata::finetune::DataOptions d;
    d.path = path_;
    auto data = strata::finetune::TextDataset::Load(d, &tokenizer_);
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    data_.emplace(std::move(data).value());
  }

  strata::StatusOr<TrainReport> Report(const TrainOptions& o) {
    auto sampler = strata::finetune::BatchSampler::Create(
        data_->train(), o.batch, o.seq_len, o.seed);
    EXPECT_TRUE(sampler.ok());
    return Train(o, *sampler, nullptr);
  }

  std::vector<double> Losses(const TrainOptions& o,
                             strata::EngineStats* stats = nullptr) {
    auto r = Report(o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::vector<double> out;
    if (!r.ok()) return out;
    for (const StepRecord& s : r->steps) out.push_back(s.loss);
    if (stats != nullptr) *stats = r->engine;
    return out;
  }

  ScratchDir dir_;
  std::string path_;
  strata::finetune::ByteTokenizer tokenizer_;
  std::optional<strata::finetune::TextDataset> data_;
};

TEST_F(TrainerTest, TheLossFalls) {
  const std::vector<double> l = Losses(Tiny());
  ASSERT_EQ(l.size(), 12u);
  EXPECT_NEAR(l[0], std::log(256.0), 0.3);  // a fresh model guesses evenly
  EXPECT_LT(l.back(), l[0] - 1.0);
}

TEST_F(TrainerTest, OffloadingAndUpdatesDuringBackwardChangeNoLoss) {
  TrainOptions o = Tiny();
  o.model.n_layer = 6;
  o.max_grad_norm = 0;  // lets the step overlap the backward
  const std::vector<double> base = Losses(o);
  ASSERT_FALSE(base.empty());

  // Parameters and optimizer states on NVMe, a device budget of a tenth of
  // the model state: four units of parameters (a block spans two).
  TrainOptions off = o;
  off.engine.params = strata::Residence::kNvme;
  off.engine.optimizer_states = strata::Residence::kNvme;
  off.engine.nvme_paths = {dir_.path()};
  off.engine.io.backend = strata::IoBackend::kMemory;
  off.engine.device_budget_bytes = 128 << 10;
  strata::EngineStats s;
  EXPECT_EQ(Losses(off, &s), base);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.nvme_read_bytes, 0u);
  EXPECT_LE(s.device.peak_bytes, off.engine.device_budget_bytes);
  EXPECT_GE(ModelStateBytes(off.model, off.dtype, off.engine.optimizer),
            10 * off.engine.device_budget_bytes);

  off.engine.step_overlap_bytes = 8 << 20;
  EXPECT_EQ(Losses(off, &s), base);
  EXPECT_GT(s.early_units, 0u);
}

// Adafactor and SM3 train the model from the engine, on the device and
// from NVMe alike; without clipping the trainer calls BeginStep, and the
// engine takes their gradients' statistics during backward (it cannot
// update them then), Adafactor's statistics pass with gradients on NVMe
// too. Their model state holds no second moment per element.
TEST_F(TrainerTest, FactoredOptimizersTrainWithStatisticsDuringBackward) {
  for (strata::CpuOptimizerAlgo algo :
       {strata::CpuOptimizerAlgo::kAdafactor, strata::CpuOptimizerAlgo::kSm3}) {
    SCOPED_TRACE(std::string(strata::CpuOptimizerAlgoName(algo)));
    TrainOptions o = Tiny();
    o.max_grad_norm = 0;
    o.engine.optimizer.cpu.algo = algo;
    o.engine.optimizer.cpu.beta1 = 0.0;  // SM3 without momentum
    o.engine.optimizer.cpu.adafactor.relative_step = false;  // the lr's
    o.engine.optimizer.cpu.adafactor.scale_parameter = false;
    strata::EngineStats s;
    const std::vector<double> base = Losses(o, &s);
    ASSERT_EQ(base.size(), 12u);
    EXPECT_LT(base.back(), base[0] - 1.0);
    EXPECT_EQ(s.early_units, 0u);
    EXPECT_GT(s.early_statistics, 0u);
    const bool adafactor = algo == strata::CpuOptimizerAlgo::kAdafactor;
    EXPECT_EQ(s.early_passes > 0, adafactor);
    TrainOptions off = o;
    off.engine.params = strata::Residence::kNvme;
    off.engine.optimizer_states = strata::Residence::kNvme;
    off.engine.nvme_paths = {dir_.path()};
    off.engine.io.backend = strata::IoBackend::kMemory;
    EXPECT_EQ(Losses(off), base);
    // The gradients on NVMe too: nothing but Adafactor's statistics pass is
    // taken during backward, as the last gradients are added (each tensor
    // lies in one piece, so the passes take the ranges they take on the
    // host).
    off.engine.grads = strata::Residence::kNvme;
    strata::EngineStats g;
    EXPECT_EQ(Losses(off, &g), base);
    EXPECT_EQ(g.early_statistics, 0u);
    EXPECT_EQ(g.early_passes, s.early_passes);
    const uint64_t n = static_cast<uint64_t>(ParameterCount(o.model));
    EXPECT_EQ(ModelStateBytes(o.model, o.dtype, o.engine.optimizer),
              n * (strata::ElementSize(o.dtype) + 8));
  }
}

TEST_F(TrainerTest, KeepingActivationsInsteadOfRecomputingChangesNoLoss) {
  TrainOptions o = Tiny();
  o.recompute = Recompute::kAlways;
  auto always = Report(o);
  ASSERT_TRUE(always.ok()) << always.status().ToString();
  EXPECT_TRUE(always->recompute);
  o.recompute = Recompute::kNever;
  auto never = Report(o);
  ASSERT_TRUE(never.ok()) << never.status().ToString();
  EXPECT_FALSE(never->recompute);
  EXPECT_GT(never->workspace_bytes, always->workspace_bytes);
  ASSERT_EQ(never->steps.size(), always->steps.size());
  for (size_t i = 0; i < never->steps.size(); ++i) {
    EXPECT_EQ(never->steps[i].loss, always->steps[i].loss) << i;
    EXPECT_EQ(never->steps[i].grad_norm, always->steps[i].grad_norm) << i;
  }

  // Auto keeps them where a quarter of the device's free memory holds
  // every block's, and recomputes where it does not.
  o.recompute = Recompute::kAuto;
  o.device.memory_budget_bytes = o.engine.device_budget_bytes + (64 << 20);
  auto roomy = Report(o);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  EXPECT_FALSE(roomy->recompute);
  o.device.memory_budget_bytes = o.engine.device_budget_bytes + (640 << 10);
  auto tight = Report(o);
  ASSERT_TRUE(tight.ok()) << tight.status().ToString();
  EXPECT_TRUE(tight->recompute);
}

TEST_F(TrainerTest, Fp16WithADynamicLossScaleTrains) {
  TrainOptions o = Tiny();
  o.dtype = strata::ElementType::kFloat16;
  o.engine.loss_scale.mode = strata::LossScaleMode::kDynamic;
  o.engine.loss_scale.initial_scale = 1024;
  const std::vector<double> l = Losses(o);
  ASSERT_EQ(l.size(), 12u);
  EXPECT_LT(l.back(), l[0] - 1.0);
}

TEST_F(TrainerTest, WeightsFromACheckpointGiveTheSameLossAsThoseValues) {
  // A checkpoint in GPT-2's layout holding the initialization of seed 5.
  TrainOptions o = Tiny();
  o.seed = 5;
  o.steps = 1;
  std::vector<std::vector<float>> values;
  std::vector<strata::finetune::SafetensorsTensorData> tensors;
  for (const ParamSpec& s : ListParameters(o.model)) {
    values.emplace_back(s.numel);
    InitParameter(s, o.model, o.seed, values.back());
  }
  size_t i = 0;
  for (const ParamSpec& s : ListParameters(o.model)) {
    strata::finetune::SafetensorsTensorData t;
    t.spec.name = s.name;
    t.spec.dtype = strata::finetune::SafetensorsDType::kF32;
    t.spec.shape = s.shape;
    t.data = std::as_bytes(std::span<const float>(values[i++]));
    tensors.push_back(t);
  }
  const std::string file = dir_.path() + "/model.safetensors";
  ASSERT_TRUE(strata::finetune::WriteSafetensors(file, tensors).ok());
  const std::vector<double> fresh = Losses(o);
  // The same batches (the seed draws them too), the weights from the file.
  o.weights = file;
  EXPECT_EQ(Losses(o), fresh);
  // A checkpoint of other dimensions is refused, naming what differs.
  TrainOptions wrong = o;
  wrong.model.n_embd = 64;
  auto sampler = strata::finetune::BatchSampler::Create(
      data_->train(), wrong.batch, wrong.seq_len, wrong.seed);
  ASSERT_TRUE(sampler.ok());
  auto r = Train(wrong, *sampler, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("wte"), std::string::npos)
      << r.status().ToString();
}

TEST_F(TrainerTest, ResumingGivesTheUninterruptedLossesBitForBit) {
  TrainOptions o = Tiny();
  o.dtype = strata::ElementType::kFloat16;  // the loss scaler is resumed too
  o.engine.loss_scale.mode = strata::LossScaleMode::kDynamic;
  o.engine.loss_scale.initial_scale = 65536;
  o.engine.loss_scale.window = 3;
  const std::vector<double> base = Losses(o);
  ASSERT_EQ(base.size(), 12u);

  // The same schedule, stopped after 6 steps, saving every 4 (and at the
  // stop).
  TrainOptions cut = o;
  cut.stop_after = 6;
  cut.checkpoint_dir = dir_.path() + "/ckpt";
  cut.save_every = 4;
  auto first = Report(cut);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->saves.size(), 2u);
  EXPECT_EQ(first->saves[1].step, 6);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(first->steps[i].loss, base[i]);

  // Resumed into another placement: NVMe, a small device budget, other
  // partitions and an early step.
  TrainOptions resumed = o;
  resumed.checkpoint_dir = cut.checkpoint_dir;
  resumed.resume = true;
  resumed.max_grad_norm = o.max_grad_norm;
  resumed.engine.params = strata::Residence::kNvme;
  resumed.engine.optimizer_states = strata::Residence::kNvme;
  resumed.engine.nvme_paths = {dir_.path()};
  resumed.engine.partition_bytes = 128 << 10;
  resumed.engine.device_budget_bytes = 512 << 10;
  auto rest = Report(resumed);
  ASSERT_TRUE(rest.ok()) << rest.status().ToString();
  EXPECT_EQ(rest->resumed_from, 6);
  ASSERT_EQ(rest->steps.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(rest->steps[i].step, static_cast<int64_t>(i) + 7);
    EXPECT_EQ(rest->steps[i].loss, base[6 + i]) << "step " << i + 7;
  }

  // The latest is now step 12, the schedule's end: nothing is left.
  auto done = Report(resumed);
  EXPECT_EQ(done.status().code(), strata::StatusCode::kInvalidArgument);
  // Another batch would change the data order: refused, naming it.
  TrainOptions other = resumed;
  other.steps = 20;
  other.batch = 2;
  auto refused = Report(other);
  EXPECT_EQ(refused.status().code(), strata::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().ToString().find("batch"), std::string::npos)
      << refused.status().ToString();
}

TEST_F(TrainerTest, TheExportLoadsAsWeights) {
  TrainOptions o = Tiny();
  o.steps = 3;
  o.export_path = dir_.path() + "/export.safetensors";
  auto r = Report(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // The export is what --weights loads (Hugging Face's names and layout),
  // and it is the trained model: its first loss is far below a fresh one's.
  TrainOptions from = Tiny();
  from.weights = o.export_path;
  from.steps = 1;
  auto again = Report(from);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->from_checkpoint);
  EXPECT_LT(again->steps[0].loss, r->steps[0].loss - 0.3);
  auto file = strata::finetune::SafetensorsFile::Open(o.export_path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto wte = file->ReadFloat32("wte.weight");
  ASSERT_TRUE(wte.ok());
  EXPECT_EQ(wte->size(), 256u * 32u);
}

}  // namespace
}  // namespace finetune
