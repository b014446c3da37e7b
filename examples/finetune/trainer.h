// The fine-tune example's trainer: a GPT-2 style model (model/) whose
// parameters, gradients and optimizer states rest in strata's engine. Every
// block fetches its parameters just before its forward and releases them
// after; in backward it fetches them again, recomputes the block from its
// saved input (or, where the device has room, reads the activations its
// forward kept: Recompute), hands its gradients to the engine and releases
// them; the optimizer step is the engine's (overlapping the backward when
// clipping is off: Engine::BeginStep). Only strata's public API
// (include/strata/) is used.
//
// Data-parallel ranks (engine.world_size above 1, ZeRO stage 1 or 2): every
// rank runs Train with the same options but its rank, on a sampler of the
// global micro-batch (batch x world_size sequences, the same on every rank:
// same seed); rank r trains on sequences [r x batch, (r+1) x batch) of each,
// and the engine averages the gradients over ranks, so N ranks of `batch`
// train as one rank of N x batch. The loss of each step is the mean over
// ranks; checkpoints and the export are written by rank 0 (every rank makes
// the engine calls, which are collective: SaveState, CommitState, LoadState,
// ReadMaster). Errors that one rank meets where
// the others go on are agreed on through `comm` at the set-up, each save and
// the export, so that every rank stops with the same code.
//
// Thread-compatible: one thread runs Train.
#ifndef STRATA_EXAMPLES_FINETUNE_TRAINER_H_
#define STRATA_EXAMPLES_FINETUNE_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "examples/finetune/io/data.h"
#include "examples/finetune/model/config.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/engine_options.h"
#include "strata/status.h"

namespace finetune {

// Whether backward recomputes each block from its saved input (activation
// checkpointing) or reads the activations its forward kept.
enum class Recompute {
  // Keep every block's activations when all of them take at most a quarter
  // of the device memory free once the engine has its arena (on the
  // host-emulated device, DeviceOptions::memory_budget_bytes less the
  // engine's device budget), else recompute.
  kAuto,
  kAlways,
  kNever,
};

struct TrainOptions {
  GptConfig model;                    // vocab_size = the tokenizer's
  std::string model_name = "custom";  // for reports
  int batch = 8;                      // sequences per micro-batch
  int seq_len = 128;                  // <= model.context_length
  int micro_batches = 1;              // per optimizer step
  int64_t steps = 200;
  // Stop after this many steps in total (0: at `steps`), keeping the
  // schedule of `steps`: a long run trained in several jobs, with --resume.
  int64_t stop_after = 0;
  // Learning rate: linear warm-up over warmup_steps, then cosine decay to
  // lr * min_lr_ratio at the last step.
  double lr = 3e-3;
  int64_t warmup_steps = 10;
  double min_lr_ratio = 0.1;
  double max_grad_norm = 1.0;  // 0 = no clipping (the step then overlaps)
  // Working precision of parameters: kBFloat16 (default) or kFloat16 (with
  // the engine options' loss scale: dynamic unless they say otherwise).
  strata::ElementType dtype = strata::ElementType::kBFloat16;
  Recompute recompute = Recompute::kAuto;
  // The engine: where each role rests, budgets, NVMe, the optimizer.
  // working_dtype and the optimizer's lr are set from the fields above.
  strata::EngineOptions engine;
  strata::DeviceOptions device;
  // A GPT-2 checkpoint (safetensors, Hugging Face's layout) whose dimensions
  // match `model`; empty: GPT-2's initialization from `seed`.
  std::string weights;
  uint64_t seed = 1;
  // Where `engine` came from, for the message when the engine refuses it
  // ("--config ds.json"; default "the engine options").
  std::string engine_origin = "the engine options";
  // With engine.world_size above 1: the trainer's own communicator over the
  // same ranks as engine.comm (which nothing but the engine may use), for
  // the mean loss and the agreement on errors. Null with one rank.
  std::shared_ptr<strata::Communicator> comm;

  // Checkpoints (docs/checkpoints.md). With a directory, the whole training
  // state (the engine's master, moments and step count; the loss scaler;
  // the data position, which is the step) is saved every `save_every` steps
  // (0: only after the last step) and after the last step, keeping `keep`
  // checkpoints. `resume` continues from the directory's latest checkpoint:
  // steps runs to the same total, and the global batch (batch x
  // world_size), sequence length, micro-batches and seed must be the
  // checkpoint's (the data order depends on them); budgets, tiers and the
  // number of ranks may differ.
  std::string checkpoint_dir;
  int64_t save_every = 0;
  int keep = 2;
  bool resume = false;
  bool save_params = false;  // also store the working-precision copy
  // After training, the weights as safetensors in the layout `weights`
  // takes (Hugging Face's GPT-2 names, Conv1D layout): fp32 masters, or
  // rounded to bf16/fp16 (kFloat32, kBFloat16, kFloat16).
  std::string export_path;
  strata::ElementType export_dtype = strata::ElementType::kFloat32;
};

struct StepRecord {
  int64_t step = 0;  // 1-based
  double loss = 0;   // mean over the step's tokens (of every rank)
  double lr = 0;
  double grad_norm = 0;
  double loss_scale = 1;
  bool applied = true;  // false: an fp16 overflow skipped it
  double seconds = 0;   // wall time of the step
  // Its parts: the micro-batches (forward, backward and handing the
  // gradients over, up to the loss on the host) and the engine's Step.
  double compute_seconds = 0;
  double optimizer_seconds = 0;
};

struct TrainReport {
  std::vector<StepRecord> steps;
  std::string device_name;
  int64_t params = 0;
  int64_t tokens_per_step = 0;  // over all ranks
  double flops_per_token = 0;   // model FLOPs (no recompute)
  // fp16/bf16 working copy, fp32 gradient and master, the moments.
  uint64_t model_state_bytes = 0;
  uint64_t device_budget_bytes = 0;  // the engine's
  uint64_t workspace_bytes = 0;      // the model's activations
  bool recompute = true;             // what Recompute resolved to
  uint64_t device_peak_bytes = 0;    // all device memory, at its peak
  double seconds = 0;                // the training loop
  // Over the steps after the first (which records the fetch order and
  // warms the caches); the first step's figures when there is one step.
  double tokens_per_s = 0;
  double tflops = 0;
  // Means per step over the same steps: StepRecord's two parts.
  double compute_seconds = 0;
  double optimizer_seconds = 0;
  bool from_checkpoint = false;
  // Checkpoints: the step resumed from (0: none), and each save.
  int64_t resumed_from = 0;
  struct Save {
    int64_t step = 0;
    std::string path;
    double seconds = 0;
  };
  std::vector<Save> saves;
  double load_seconds = 0;
  double export_seconds = 0;
  strata::EngineStats engine;  // this rank's engine
};

using ProgressFn = std::function<void(const StepRecord& step)>;

// Trains options.steps steps on the batches `sampler` draws (its batch must
// be options.batch x engine.world_size, its seq_len options.seq_len).
// Errors name what is wrong: the options, the checkpoint, the device or
// engine refusing a budget. With several ranks, an error another rank met
// is kAborted (kInvalidArgument when that rank's was) saying so.
strata::StatusOr<TrainReport> Train(
    const TrainOptions& options, const strata::finetune::BatchSampler& sampler,
    const ProgressFn& progress);

// Agrees on an outcome across the ranks of `comm`, which every rank must
// call at the same point: `local` when it is an error; else OK when every
// rank is OK; else kInvalidArgument (when a rank's error was one) or
// kAborted saying that another rank failed. Null `comm`: `local`. When the
// agreement itself fails (a rank died or stopped calling: the communicator's
// timeout), `local` if an error, else that failure.
strata::Status AgreeAcrossRanks(strata::Communicator* comm,
                                const strata::Status& local);

// Bytes of model state (see TrainReport::model_state_bytes): the working
// copy, the fp32 gradient and master, and the moments `optimizer` keeps per
// element (Adafactor and SM3: a first moment at most).
uint64_t ModelStateBytes(const GptConfig& config, strata::ElementType dtype,
                         const strata::OptimizerOptions& optimizer);

// Whether `optimizer` may update units while backward goes on
// (Engine::BeginStep), and so use an undo buffer: Adafactor and SM3 wait
// for every row and column statistic of the whole gradient (the engine
// takes the gradient's statistics during backward instead).
bool UpdatesDuringBackward(const strata::OptimizerOptions& optimizer);

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_TRAINER_H_
