#include "examples/finetune/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numbers>
#include <optional>
#include <utility>

#include "examples/finetune/io/gpt2_checkpoint.h"
#include "examples/finetune/io/safetensors.h"
#include "examples/finetune/model/model.h"
#include "strata/checkpoint.h"
#include "strata/log.h"

#include <nlohmann/json.hpp>

namespace finetune {
namespace {

using strata::DeviceMemory;
using strata::ElementType;
using strata::Engine;
using strata::ParamPin;
using strata::Status;
using strata::StatusOr;
using strata::TensorId;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The learning rate of step s (0-based): linear warm-up, then cosine decay.
double LearningRate(const TrainOptions& o, int64_t s) {
  if (s < o.warmup_steps) {
    return o.lr * static_cast<double>(s + 1) /
           static_cast<double>(o.warmup_steps);
  }
  const int64_t decay = std::max<int64_t>(1, o.steps - o.warmup_steps);
  const double t =
      std::min(1.0, static_cast<double>(s - o.warmup_steps) / decay);
  const double min_lr = o.lr * o.min_lr_ratio;
  return min_lr +
         0.5 * (o.lr - min_lr) * (1.0 + std::cos(std::numbers::pi * t));
}

class Run {
 public:
  Run(const TrainOptions& o, const strata::finetune::BatchSampler& sampler)
      : o_(o), sampler_(sampler) {}

  Status Setup(TrainReport* report);
  StatusOr<StepRecord> TrainStep(int64_t s);
  // Checkpoints: the step to start from (0 without resume), a save after
  // `steps` steps, and the export of the weights.
  StatusOr<int64_t> Resume(TrainReport* report);
  Status Save(int64_t steps, TrainReport* report);
  Status Export(TrainReport* report);
  Engine& engine() { return *engine_; }
  strata::Device& device() { return *device_; }

 private:
  Status LoadInitialValues(TrainReport* report);
  Status MicroBatch(int64_t index, bool last, const strata::StepArgs& args,
                    double* loss);
  // Fetches every tensor of `ids` and makes the stream wait for them.
  Status FetchAll(const std::vector<TensorId>& ids,
                  std::vector<ParamPin>* pins);
  // A fresh fp32 gradient buffer of a tensor, freed by the engine in stream
  // order once handed over.
  StatusOr<DeviceMemory> GradBuffer(TensorId id);
  Status HandOver(TensorId id, DeviceMemory grad);

  // What must be the same on resume: the data order depends on it.
  nlohmann::json DataConfig() const;
  StatusOr<std::unique_ptr<strata::CheckpointWriter>> OpenWriter(int64_t steps);
  std::string RankScratchDir() const;
  // The checkpoint's step, once its trainer blob matches this run.
  StatusOr<int64_t> ReadTrainerState(
      std::unique_ptr<strata::CheckpointReader>* reader);

  const TrainOptions& o_;
  const strata::finetune::BatchSampler& sampler_;
  std::unique_ptr<strata::Device> device_;
  std::unique_ptr<strata::Stream> stream_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<GptModel> model_;
  std::vector<ParamSpec> specs_;
  std::vector<TensorId> ids_;  // per spec
  // ids_ per block and slot, and the global tensors.
  std::vector<std::vector<TensorId>> block_ids_;
  TensorId wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0;
  std::vector<int32_t> tokens_, inputs_, targets_;
};

Status Run::Setup(TrainReport* report) {
  STRATA_RETURN_IF_ERROR(ValidateConfig(o_.model));
  if (o_.seq_len < 1 || o_.seq_len > o_.model.context_length) {
    return Status::InvalidArgument(
        "sequence length " + std::to_string(o_.seq_len) +
        " is outside 1 .. the model's context length " +
        std::to_string(o_.model.context_length));
  }
  if (sampler_.batch() != int64_t{o_.batch} * o_.engine.world_size ||
      sampler_.seq_len() != o_.seq_len) {
    return Status::InvalidArgument("the batch sampler's shape differs");
  }
  STRATA_ASSIGN_OR_RETURN(device_, strata::NewDevice(o_.device));
  STRATA_ASSIGN_OR_RETURN(stream_, device_->NewStream({}));
  report->device_name = device_->name();

  strata::EngineOptions eo = o_.engine;
  eo.working_dtype = o_.dtype == ElementType::kFloat16
                         ? strata::CpuDType::kFloat16
                         : strata::CpuDType::kBFloat16;
  eo.optimizer.lr = o_.lr;
  // Only fp16 gradients underflow: bf16 runs unscaled whatever the config.
  if (o_.dtype != ElementType::kFloat16) {
    eo.loss_scale.mode = strata::LossScaleMode::kNone;
  }
  StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(eo, device_.get());
  if (!engine.ok() &&
      (engine.status().code() == strata::StatusCode::kNotSupported ||
       engine.status().code() == strata::StatusCode::kInvalidArgument)) {
    // Options the engine refuses or does not run (e.g. a ZeRO stage with
    // several ranks): the user's to change, like any option that cannot
    // work; the message says where they came from.
    return Status::InvalidArgument(o_.engine_origin + ": " +
                                   std::string(engine.status().message()));
  }
  STRATA_ASSIGN_OR_RETURN(engine_, std::move(engine));
  specs_ = ListParameters(o_.model);
  block_ids_.assign(o_.model.n_layer, std::vector<TensorId>(kBlockTensorCount));
  for (const ParamSpec& s : specs_) {
    strata::TensorSpec t;
    t.name = s.name;
    t.shape = s.shape;
    t.dtype = o_.dtype;
    STRATA_ASSIGN_OR_RETURN(TensorId id, engine_->Register(t));
    ids_.push_back(id);
    if (s.layer >= 0) {
      block_ids_[s.layer][s.slot] = id;
    } else if (s.slot == kWte) {
      wte_ = id;
    } else if (s.slot == kWpe) {
      wpe_ = id;
    } else if (s.slot == kLnfWeight) {
      lnf_w_ = id;
    } else {
      lnf_b_ = id;
    }
  }
  STRATA_RETURN_IF_ERROR(engine_->Start());
  // A resumed run gets every value from the checkpoint.
  if (!o_.resume) STRATA_RETURN_IF_ERROR(LoadInitialValues(report));

  ModelOptions mo;
  mo.batch_size = o_.batch;
  mo.seq_len = o_.seq_len;
  mo.param_type = o_.dtype;
  mo.checkpoint_blocks = o_.recompute != Recompute::kNever;
  if (o_.recompute == Recompute::kAuto) {
    // Every block's activations against a quarter of the device memory
    // free once the engine holds its arena.
    const uint64_t free = device_->memory_stats().free_bytes;
    const uint64_t all = uint64_t(o_.model.n_layer) *
                         GptModel::BlockActivationBytes(o_.model, mo);
    mo.checkpoint_blocks = all > free / 4;
  }
  report->recompute = mo.checkpoint_blocks;
  STRATA_ASSIGN_OR_RETURN(
      model_, GptModel::Create(device_.get(), stream_.get(), o_.model, mo));
  const size_t n = static_cast<size_t>(o_.batch) * o_.seq_len;
  tokens_.resize(static_cast<size_t>(sampler_.batch()) * (o_.seq_len + 1));
  inputs_.resize(n);
  targets_.resize(n);

  report->params = ParameterCount(o_.model);
  report->tokens_per_step =
      int64_t{o_.batch} * o_.seq_len * o_.micro_batches * o_.engine.world_size;
  report->flops_per_token = TrainingFlopsPerToken(o_.model, o_.seq_len);
  report->model_state_bytes =
      ModelStateBytes(o_.model, o_.dtype, o_.engine.optimizer);
  report->workspace_bytes = model_->workspace_bytes();
  return Status::Ok();
}

Status Run::LoadInitialValues(TrainReport* report) {
  std::vector<float> values;
  if (o_.weights.empty()) {
    for (size_t i = 0; i < specs_.size(); ++i) {
      values.resize(specs_[i].numel);
      InitParameter(specs_[i], o_.model, o_.seed, values);
      STRATA_RETURN_IF_ERROR(engine_->SetInitialValues(ids_[i], values));
    }
    return Status::Ok();
  }
  using strata::finetune::Gpt2Dims;
  STRATA_ASSIGN_OR_RETURN(strata::finetune::SafetensorsFile file,
                          strata::finetune::SafetensorsFile::Open(o_.weights));
  Gpt2Dims dims;
  dims.n_layer = o_.model.n_layer;
  dims.n_embd = o_.model.n_embd;
  dims.vocab = o_.model.vocab_size;
  dims.n_ctx = o_.model.context_length;
  STRATA_ASSIGN_OR_RETURN(strata::finetune::Gpt2CheckpointMap map,
                          strata::finetune::MapGpt2Checkpoint(file, dims));
  for (size_t i = 0; i < specs_.size(); ++i) {
    values.resize(specs_[i].numel);
    STRATA_RETURN_IF_ERROR(
        strata::finetune::ReadGpt2Parameter(file, map, specs_[i].name, values));
    STRATA_RETURN_IF_ERROR(engine_->SetInitialValues(ids_[i], values));
  }
  report->from_checkpoint = true;
  return Status::Ok();
}

Status Run::FetchAll(const std::vector<TensorId>& ids,
                     std::vector<ParamPin>* pins) {
  pins->clear();
  for (TensorId id : ids) {
    STRATA_ASSIGN_OR_RETURN(ParamPin p, engine_->Fetch(id));
    STRATA_RETURN_IF_ERROR(p.WaitOn(*stream_));
    pins->push_back(std::move(p));
  }
  return Status::Ok();
}

StatusOr<DeviceMemory> Run::GradBuffer(TensorId id) {
  int64_t n = 1;
  for (int64_t d : engine_->spec(id).shape) n *= d;
  return device_->Allocate(static_cast<size_t>(n) * 4, *stream_);
}

Status Run::HandOver(TensorId id, DeviceMemory grad) {
  return engine_->AddGrad(id, std::move(grad), ElementType::kFloat32, *stream_);
}

Status Run::MicroBatch(int64_t index, bool last, const strata::StepArgs& args,
                       double* loss) {
  // The global micro-batch; this rank's sequences are its share.
  STRATA_RETURN_IF_ERROR(sampler_.Fill(index, tokens_));
  const int T = o_.seq_len;
  const size_t first = static_cast<size_t>(o_.engine.rank) * o_.batch;
  for (int b = 0; b < o_.batch; ++b) {
    const int32_t* row = tokens_.data() + (first + b) * (T + 1);
    std::copy(row, row + T, inputs_.begin() + static_cast<size_t>(b) * T);
    std::copy(row + 1, row + T + 1,
              targets_.begin() + static_cast<size_t>(b) * T);
  }
  STRATA_RETURN_IF_ERROR(model_->SetBatch(inputs_, targets_));
  std::vector<ParamPin> pins;

  // Forward, block by block; only each block's input is kept.
  STRATA_RETURN_IF_ERROR(FetchAll({wte_, wpe_}, &pins));
  STRATA_RETURN_IF_ERROR(
      model_->EmbeddingForward({pins[0].data(), pins[1].data()}));
  pins.clear();
  const int L = static_cast<int>(o_.model.n_layer);
  auto block_params = [](const std::vector<ParamPin>& p) {
    BlockParams bp;
    for (int i = 0; i < kBlockTensorCount; ++i) bp.t[i] = p[i].data();
    return bp;
  };
  for (int l = 0; l < L; ++l) {
    STRATA_RETURN_IF_ERROR(FetchAll(block_ids_[l], &pins));
    STRATA_RETURN_IF_ERROR(model_->BlockForward(l, block_params(pins)));
    pins.clear();
  }

  // From here on each tensor's gradient is its last of the step: the
  // engine may update a unit while backward goes on, or (Adafactor, SM3, no
  // room to undo) take its gradient's statistics.
  if (last && args.max_grad_norm == 0) {
    STRATA_RETURN_IF_ERROR(engine_->BeginStep(args));
  }
  // The head: final LayerNorm, tied LM head, loss, and their backward. The
  // wte gradient collects the head's part now and the embedding's at the
  // end, and is handed over once.
  STRATA_RETURN_IF_ERROR(FetchAll({lnf_w_, lnf_b_, wte_}, &pins));
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dlnf_w, GradBuffer(lnf_w_));
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dlnf_b, GradBuffer(lnf_b_));
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dwte, GradBuffer(wte_));
  HeadGrads hg;
  hg.lnf_weight = static_cast<float*>(dlnf_w.data());
  hg.lnf_bias = static_cast<float*>(dlnf_b.data());
  hg.wte = static_cast<float*>(dwte.data());
  STRATA_RETURN_IF_ERROR(model_->HeadForwardBackward(
      {pins[0].data(), pins[1].data(), pins[2].data()}, &hg,
      static_cast<float>(args.loss_scale)));
  pins.clear();
  STRATA_RETURN_IF_ERROR(HandOver(lnf_w_, std::move(dlnf_w)));
  STRATA_RETURN_IF_ERROR(HandOver(lnf_b_, std::move(dlnf_b)));

  // Backward, block by block, recomputing each from its input.
  std::vector<DeviceMemory> grads(kBlockTensorCount);
  for (int l = L - 1; l >= 0; --l) {
    STRATA_RETURN_IF_ERROR(FetchAll(block_ids_[l], &pins));
    BlockGrads bg;
    for (int i = 0; i < kBlockTensorCount; ++i) {
      STRATA_ASSIGN_OR_RETURN(grads[i], GradBuffer(block_ids_[l][i]));
      bg.t[i] = static_cast<float*>(grads[i].data());
    }
    STRATA_RETURN_IF_ERROR(model_->BlockBackward(l, block_params(pins), bg));
    pins.clear();
    for (int i = 0; i < kBlockTensorCount; ++i) {
      STRATA_RETURN_IF_ERROR(HandOver(block_ids_[l][i], std::move(grads[i])));
    }
  }
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dwpe, GradBuffer(wpe_));
  STRATA_RETURN_IF_ERROR(model_->EmbeddingBackward(
      {static_cast<float*>(dwte.data()), static_cast<float*>(dwpe.data())}));
  STRATA_RETURN_IF_ERROR(HandOver(wpe_, std::move(dwpe)));
  STRATA_RETURN_IF_ERROR(HandOver(wte_, std::move(dwte)));
  STRATA_ASSIGN_OR_RETURN(float mean, model_->MeanLoss());
  *loss = mean;
  return Status::Ok();
}

StatusOr<StepRecord> Run::TrainStep(int64_t s) {
  const auto t0 = Clock::now();
  StepRecord rec;
  rec.step = s + 1;
  rec.lr = LearningRate(o_, s);
  rec.loss_scale = engine_->LossScale();
  strata::StepArgs args;
  args.lr = rec.lr;
  args.loss_scale = rec.loss_scale;
  args.max_grad_norm = o_.max_grad_norm;
  double sum = 0;
  for (int m = 0; m < o_.micro_batches; ++m) {
    double loss = 0;
    STRATA_RETURN_IF_ERROR(MicroBatch(s * o_.micro_batches + m,
                                      m == o_.micro_batches - 1, args, &loss));
    sum += loss;
  }
  rec.loss = sum / o_.micro_batches;
  rec.compute_seconds = Since(t0);
  const auto t_step = Clock::now();
  STRATA_ASSIGN_OR_RETURN(strata::StepResult r, engine_->Step(args));
  rec.optimizer_seconds = Since(t_step);
  if (o_.comm != nullptr) {
    // The mean over ranks of their means over equally many tokens: the
    // mean over the global batch.
    float mean = static_cast<float>(rec.loss);
    STRATA_ASSIGN_OR_RETURN(
        strata::CommWork w,
        o_.comm->AllReduce(&mean, &mean, 1, strata::CommType::kFloat32,
                           strata::ReduceOp::kSum));
    STRATA_RETURN_IF_ERROR(w.Wait().WithContext("the mean loss over ranks"));
    rec.loss = static_cast<double>(mean) / o_.engine.world_size;
  }
  rec.applied = r.applied;
  rec.grad_norm = r.grad_norm;
  rec.seconds = Since(t0);
  return rec;
}

constexpr const char* kTrainerBlob = "finetune.trainer";

// The step after which the run stops: --stop-after within the schedule.
int64_t EndStep(const TrainOptions& o) {
  return o.stop_after > 0 ? std::min(o.steps, o.stop_after) : o.steps;
}

nlohmann::json Run::DataConfig() const {
  // The sequences of a micro-batch over all ranks (--batch with one): the
  // data order is the same for any split of them into ranks.
  return {{"batch", int64_t{o_.batch} * o_.engine.world_size},
          {"seq_len", o_.seq_len},
          {"micro_batches", o_.micro_batches},
          {"seed", o_.seed},
          {"vocab_size", o_.model.vocab_size},
          {"n_layer", o_.model.n_layer},
          {"n_embd", o_.model.n_embd}};
}

// A checkpoint of the whole state, whatever the number of ranks: every
// rank calls the engine's SaveState and CommitState (collective calls with
// several ranks, each returning the same outcome on every rank), rank 0
// alone holds the writer and adds the trainer's blob.
Status Run::Save(int64_t steps, TrainReport* report) {
  const auto t0 = Clock::now();
  const bool writes = o_.engine.rank == 0;
  std::unique_ptr<strata::CheckpointWriter> w;
  Status begun = Status::Ok();
  if (writes) {
    strata::CheckpointWriterOptions wo;
    wo.dir = o_.checkpoint_dir;
    wo.step = steps;
    wo.keep = o_.keep;
    StatusOr<std::unique_ptr<strata::CheckpointWriter>> b =
        strata::CheckpointWriter::Begin(wo);
    begun = b.status();
    if (b.ok()) w = std::move(b).value();
  }
  STRATA_RETURN_IF_ERROR(engine_->Agree(begun));
  STRATA_RETURN_IF_ERROR(engine_->SaveState(w.get(), o_.save_params));
  Status put = Status::Ok();
  if (writes) {
    nlohmann::json j = {
        {"step", steps}, {"model", o_.model_name}, {"data", DataConfig()}};
    put = w->PutBlob(kTrainerBlob, j.dump());
  }
  // A checkpoint without the trainer's blob is never committed.
  STRATA_RETURN_IF_ERROR(engine_->Agree(put));
  STRATA_ASSIGN_OR_RETURN(std::string path, engine_->CommitState(w.get()));
  report->saves.push_back(
      {steps, path.empty() ? o_.checkpoint_dir : path, Since(t0)});
  return Status::Ok();
}

StatusOr<int64_t> Run::Resume(TrainReport* report) {
  if (!o_.resume) return 0;
  const auto t0 = Clock::now();
  // Every rank opens the checkpoint, reads the trainer's state and checks
  // it; they agree before the engine's LoadState (a collective with several
  // ranks, with one outcome on every rank).
  std::unique_ptr<strata::CheckpointReader> r;
  StatusOr<int64_t> step = ReadTrainerState(&r);
  STRATA_RETURN_IF_ERROR(engine_->Agree(step.status()));
  STRATA_RETURN_IF_ERROR(engine_->LoadState(*r));
  report->resumed_from = *step;
  report->load_seconds = Since(t0);
  return *step;
}

StatusOr<int64_t> Run::ReadTrainerState(
    std::unique_ptr<strata::CheckpointReader>* reader) {
  STRATA_ASSIGN_OR_RETURN(*reader,
                          strata::CheckpointReader::Open(o_.checkpoint_dir));
  strata::CheckpointReader* r = reader->get();
  STRATA_ASSIGN_OR_RETURN(std::string blob, r->Blob(kTrainerBlob));
  const nlohmann::json j = nlohmann::json::parse(blob, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("step") ||
      !j["step"].is_number_integer() || !j.contains("data")) {
    return Status::Corruption(r->path() + ": blob " + kTrainerBlob +
                              " is not the trainer's state");
  }
  const nlohmann::json want = DataConfig();
  for (auto it = want.begin(); it != want.end(); ++it) {
    if (!j["data"].contains(it.key()) || j["data"][it.key()] != it.value()) {
      return Status::InvalidArgument(
          "--resume: the checkpoint " + r->path() + " was trained with " +
          it.key() + " " +
          (j["data"].contains(it.key()) ? j["data"][it.key()].dump() : "?") +
          ", this run has " + it.value().dump() +
          (it.key() == "batch" && o_.engine.world_size > 1
               ? " (--batch " + std::to_string(o_.batch) + " x " +
                     std::to_string(o_.engine.world_size) + " ranks)"
               : "") +
          " (the data order depends on it)");
    }
  }
  const int64_t step = j["step"].get<int64_t>();
  if (step >= EndStep(o_)) {
    return Status::InvalidArgument(
        "--resume: the checkpoint " + r->path() + " is at step " +
        std::to_string(step) + ", and this run ends at step " +
        std::to_string(EndStep(o_)) + " (--steps " + std::to_string(o_.steps) +
        ", --stop-after " + std::to_string(o_.stop_after) +
        "): nothing is left to train");
  }
  return step;
}

Status Run::Export(TrainReport* report) {
  if (o_.export_path.empty()) return Status::Ok();
  const auto t0 = Clock::now();
  // Every rank reads each master (with several ranks ReadMaster gathers the
  // shards: a collective call); rank 0 writes the file. A rank whose file
  // fails still reads the rest, so that the others are not left waiting.
  const bool writes = o_.engine.rank == 0;
  using strata::finetune::SafetensorsDType;
  SafetensorsDType dt = SafetensorsDType::kF32;
  strata::CpuDType cdt = strata::CpuDType::kFloat32;
  if (o_.export_dtype == ElementType::kBFloat16) {
    dt = SafetensorsDType::kBF16;
    cdt = strata::CpuDType::kBFloat16;
  } else if (o_.export_dtype == ElementType::kFloat16) {
    dt = SafetensorsDType::kF16;
    cdt = strata::CpuDType::kFloat16;
  }
  std::optional<strata::finetune::SafetensorsWriter> w;
  Status file = Status::Ok();
  if (writes) {
    std::vector<strata::finetune::SafetensorsTensorSpec> specs;
    for (const ParamSpec& p : specs_) specs.push_back({p.name, dt, p.shape});
    auto created = strata::finetune::SafetensorsWriter::Create(
        o_.export_path, std::move(specs),
        {{"format", "pt"}, {"exported_by", "strata-finetune"}});
    file = created.status();
    if (created.ok()) w.emplace(std::move(created).value());
    if (!file.ok() && o_.comm == nullptr) return file;  // nobody waits
  }
  // One tensor at a time: the model is never whole in RAM.
  std::vector<float> master;
  std::vector<std::byte> out;
  for (size_t i = 0; i < specs_.size(); ++i) {
    master.resize(specs_[i].numel);
    STRATA_RETURN_IF_ERROR(engine_->ReadMaster(ids_[i], master));
    if (!w || !file.ok()) continue;
    const size_t esize = strata::ElementSize(o_.export_dtype);
    out.resize(master.size() * esize);
    file = strata::ConvertCpuArray(master.data(), strata::CpuDType::kFloat32,
                                   out.data(), cdt, master.size());
    if (file.ok()) file = w->Write(out);
  }
  if (w && file.ok()) file = w->Finish();
  STRATA_RETURN_IF_ERROR(AgreeAcrossRanks(o_.comm.get(), file));
  report->export_seconds = Since(t0);
  return Status::Ok();
}

}  // namespace

Status AgreeAcrossRanks(strata::Communicator* comm, const Status& local) {
  if (comm == nullptr) return local;
  // 0 ok, 1 failed, 2 refused options or files (kInvalidArgument).
  float code = local.ok()                                             ? 0.0f
               : local.code() == strata::StatusCode::kInvalidArgument ? 2.0f
                                                                      : 1.0f;
  StatusOr<strata::CommWork> w = comm->AllReduce(
      &code, &code, 1, strata::CommType::kFloat32, strata::ReduceOp::kMax);
  Status agreed = w.ok() ? w->Wait() : w.status();
  if (!local.ok()) return local;
  if (!agreed.ok()) return agreed.WithContext("agreeing with the other ranks");
  if (code >= 2.0f) {
    return Status::InvalidArgument(
        "another rank refused its options or files (its message says why)");
  }
  if (code >= 1.0f) {
    return Status::Aborted("another rank failed (its message says why)");
  }
  return Status::Ok();
}

uint64_t ModelStateBytes(const GptConfig& config, ElementType dtype,
                         const strata::OptimizerOptions& optimizer) {
  const auto n = static_cast<uint64_t>(ParameterCount(config));
  const strata::CpuOptimizerOptions& o = optimizer.cpu;
  // Adam's family keeps two moments per element; Adafactor and SM3 at most
  // a first moment (their statistics per row and column are a few bytes).
  uint64_t moments = 2;
  if (strata::CpuOptimizerIsFactored(o.algo)) {
    moments = strata::CpuOptimizerUsesExpAvg(o) ? 1 : 0;
  }
  return n * (strata::ElementSize(dtype) + 4 + 4) +
         moments * strata::CpuStateBytes(optimizer.moment_dtype, n);
}

bool UpdatesDuringBackward(const strata::OptimizerOptions& optimizer) {
  return !strata::CpuOptimizerIsFactored(optimizer.cpu.algo);
}

StatusOr<TrainReport> Train(const TrainOptions& o,
                            const strata::finetune::BatchSampler& sampler,
                            const ProgressFn& progress) {
  if (o.steps < 1 || o.batch < 1 || o.micro_batches < 1) {
    return Status::InvalidArgument(
        "steps, batch and micro-batches must be >= 1");
  }
  if (o.dtype != ElementType::kBFloat16 && o.dtype != ElementType::kFloat16) {
    return Status::InvalidArgument("the working dtype is bf16 or fp16");
  }
  if (o.checkpoint_dir.empty() && (o.resume || o.save_every != 0)) {
    return Status::InvalidArgument(
        "--resume and --save-every need --checkpoint-dir");
  }
  if (o.save_every < 0 || o.keep < 1 || o.stop_after < 0) {
    return Status::InvalidArgument(
        "--save-every and --stop-after must be >= 0, --keep >= 1");
  }
  TrainReport report;
  Run run(o, sampler);
  STRATA_RETURN_IF_ERROR(AgreeAcrossRanks(o.comm.get(), run.Setup(&report)));
  STRATA_ASSIGN_OR_RETURN(const int64_t first, run.Resume(&report));
  const auto t0 = Clock::now();
  const int64_t end = EndStep(o);  // > first: Resume checked it
  for (int64_t s = first; s < end; ++s) {
    STRATA_ASSIGN_OR_RETURN(StepRecord rec, run.TrainStep(s));
    report.steps.push_back(rec);
    if (progress) progress(rec);
    const bool last = s + 1 == end;
    if (!o.checkpoint_dir.empty() &&
        (last || (o.save_every > 0 && (s + 1) % o.save_every == 0))) {
      STRATA_RETURN_IF_ERROR(run.Save(s + 1, &report));
    }
  }
  report.seconds = Since(t0);
  STRATA_RETURN_IF_ERROR(run.Export(&report));
  // The timed steps (TrainReport): those after the first, or the only one.
  const size_t skip = report.steps.size() > 1 ? 1 : 0;
  double timed = 0, compute = 0, optimizer = 0;
  for (size_t i = skip; i < report.steps.size(); ++i) {
    timed += report.steps[i].seconds;
    compute += report.steps[i].compute_seconds;
    optimizer += report.steps[i].optimizer_seconds;
  }
  const auto timed_steps = static_cast<int64_t>(report.steps.size() - skip);
  report.tokens_per_s =
      static_cast<double>(report.tokens_per_step * timed_steps) / timed;
  report.compute_seconds = compute / static_cast<double>(timed_steps);
  report.optimizer_seconds = optimizer / static_cast<double>(timed_steps);
  report.tflops = report.tokens_per_s * report.flops_per_token / 1e12;
  report.engine = run.engine().stats();
  report.device_budget_bytes = o.engine.device_budget_bytes;
  report.device_peak_bytes = run.device().memory_stats().peak_in_use_bytes;
  return report;
}

}  // namespace finetune
