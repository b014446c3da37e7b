// strata-finetune: fine-tunes a GPT-2 style model whose parameters,
// gradients and optimizer states are many times larger than the device
// memory it is given, with strata as the memory backend. Run with no flags it
// trains a small model on the default corpus (docs/finetune.md).
//
// Exit statuses: 0 ok (also --help); 1 the run failed (a device, engine,
// memory or I/O error); 2 bad usage (a flag, file or config that cannot
// work), the message naming it. Under mpirun every rank exits with the
// highest status of all ranks.
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "examples/finetune/io/corpus.h"
#include "examples/finetune/io/data.h"
#include "examples/finetune/io/gpt2_checkpoint.h"
#include "examples/finetune/io/safetensors.h"
#include "examples/finetune/io/tokenizer.h"
#include "examples/finetune/report.h"
#include "examples/finetune/trainer.h"
#include "strata/comm.h"
#include "strata/cpu_adam.h"
#include "strata/engine_config.h"
#include "strata/version.h"

namespace finetune {
namespace {

using strata::Status;
using strata::StatusOr;

constexpr int kExitOk = 0, kExitFailure = 1, kExitUsage = 2;

// The command line as given.
struct Flags {
  std::string preset;
  int64_t layers = 0, heads = 0, embd = 0, context = 0;
  int64_t steps = 0;
  int64_t batch = 8, seq_len = 128, micro_batches = 1;
  double lr = 3e-3, max_grad_norm = 1.0, min_lr_ratio = 0.1;
  bool lr_given = false;  // --lr on the command line
  int64_t warmup = 10;
  std::string dtype = "bf16";
  std::string recompute = "auto";
  std::string device = "auto";
  std::string device_budget;
  std::string nvme;
  std::string data, weights, vocab, merges, config;
  std::string json, plot;
  uint64_t seed = 1;
  int64_t threads = 0;
  std::string checkpoint_dir, export_path, export_dtype = "fp32";
  int64_t save_every = 0, keep = 2, stop_after = 0;
  bool resume = false, save_params = false;
  std::string comm = "auto";
  double comm_timeout = 300;
};

// The data-parallel ranks this process is one of (docs/finetune.md, "Data
// parallelism"): one, or those of an MPI job.
struct Ranks {
  int size = 1, rank = 0;
  int local_rank = 0;              // on this machine: the GPU with nccl
  std::string backend = "single";  // of the engine's communicator
  std::shared_ptr<strata::Communicator> engine;   // the engine's own
  std::shared_ptr<strata::Communicator> trainer;  // loss, agreement
};

// The launcher's world size from its environment: Open MPI's mpirun sets
// OMPI_COMM_WORLD_SIZE, MPICH's (Hydra) and Slurm's PMI set PMI_SIZE. 1
// when neither is set (a plain launch).
int LaunchedRanks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* v = std::getenv(var);
    int n = 0;
    if (v != nullptr &&
        std::from_chars(v, v + std::strlen(v), n).ec == std::errc() && n > 0) {
      return n;
    }
  }
  return 1;
}

// This process's rank among those on its machine, from the launcher's
// environment (Open MPI, MPICH's Hydra, Slurm); 0 when none says.
int LocalRank() {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(var);
    int n = 0;
    if (v != nullptr &&
        std::from_chars(v, v + std::strlen(v), n).ec == std::errc() && n >= 0) {
      return n;
    }
  }
  return 0;
}

StatusOr<std::shared_ptr<strata::Communicator>> NewComm(
    const strata::CommOptions& co, const std::string& flag) {
  StatusOr<strata::Communicator> made = strata::Communicator::Create(co);
  if (!made.ok()) return std::move(made).status().WithContext(flag);
  return std::make_shared<strata::Communicator>(std::move(made).value());
}

// --comm auto (MPI when launched on several ranks), mpi, nccl (the engine's
// collectives on the GPUs; MPI, when launched on several ranks, bootstraps
// it and carries the trainer's) or single.
StatusOr<Ranks> MakeRanks(const Flags& f) {
  Ranks r;
  bool mpi = false;
  const bool nccl = f.comm == "nccl";
  if (f.comm == "auto") {
    mpi = LaunchedRanks() > 1;
  } else if (f.comm == "mpi") {
    mpi = true;
  } else if (nccl) {
    mpi = LaunchedRanks() > 1;
  } else if (f.comm != "single") {
    return Status::InvalidArgument("--comm: '" + f.comm +
                                   "'; accepted: auto, mpi, nccl, single");
  }
  if (!(f.comm_timeout > 0 && f.comm_timeout <= 1e6)) {
    return Status::InvalidArgument(
        "--comm-timeout: must be in (0, 1e6] seconds");
  }
  if (nccl && f.device == "host") {
    return Status::InvalidArgument(
        "--comm nccl runs the engine's collectives on CUDA GPUs; --device "
        "host has none (use --comm mpi)");
  }
  if (!mpi && !nccl) return r;
  strata::CommOptions co;
  co.backend =
      mpi ? strata::CommBackendKind::kMpi : strata::CommBackendKind::kSingle;
  co.timeout_s = f.comm_timeout;
  // Two communicators over the same ranks: the engine's must carry nothing
  // else, and the trainer's carries the loss and the agreement on errors.
  STRATA_ASSIGN_OR_RETURN(r.trainer, NewComm(co, "--comm " + f.comm));
  r.local_rank = LocalRank();
  if (nccl) {
    strata::CommOptions no;
    no.backend = strata::CommBackendKind::kNccl;
    no.timeout_s = f.comm_timeout;
    no.cuda_ordinal = r.local_rank;
    no.nccl_bootstrap = r.trainer.get();
    STRATA_ASSIGN_OR_RETURN(r.engine, NewComm(no, "--comm nccl"));
  } else {
    STRATA_ASSIGN_OR_RETURN(r.engine, NewComm(co, "--comm " + f.comm));
  }
  r.backend = std::string(strata::CommBackendName(r.engine->backend()));
  r.size = r.engine->size();
  r.rank = r.engine->rank();
  return r;
}

// "4096", "512K", "64M", "2G" (powers of 1024).
StatusOr<uint64_t> ParseBytes(const std::string& option,
                              const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || p == text.data()) {
    return Status::InvalidArgument(
        option + ": '" + text + "' is not a size (e.g. 4096, 512K, 64M, 2G)");
  }
  std::string suffix(p, end);
  for (char& c : suffix) c = static_cast<char>(std::toupper(c));
  int shift = 0;
  if (suffix == "K" || suffix == "KIB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MIB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GIB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TIB") {
    shift = 40;
  } else if (!suffix.empty() && suffix != "B") {
    return Status::InvalidArgument(option + ": unknown suffix '" +
                                   std::string(p, end) +
                                   "'; accepted: K, M, G, T");
  }
  if (shift > 0 && v > (UINT64_MAX >> shift)) {
    return Status::InvalidArgument(option + ": '" + text + "' is too large");
  }
  return v << shift;
}

Status Range(const char* option, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return Status::InvalidArgument(
        std::string(option) + ": " + std::to_string(v) + " is outside " +
        std::to_string(lo) + " .. " + std::to_string(hi));
  }
  return Status::Ok();
}

// The model of the default run without a GPU: byte tokens, 4 layers of 256
// channels (3.3M parameters, 59 MB of state), so that 2 cores train it for a
// few minutes and the loss falls clearly.
GptConfig CpuDefaultModel() {
  GptConfig c;
  c.vocab_size = 256;
  c.context_length = 256;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = 256;
  return c;
}

// What main hands to Train, checked.
struct Setup {
  TrainOptions options;
  std::unique_ptr<strata::finetune::Tokenizer> tokenizer;
  std::optional<strata::finetune::TextDataset> data;
  std::optional<strata::finetune::BatchSampler> sampler;
  nlohmann::json config;  // what the run ran with, for --json
  std::vector<std::string> notes;
  // Directories made for the run (each rank's swap directory), removed
  // after it when empty.
  std::vector<std::string> made_dirs;
};

Status ParseModel(const Flags& f, bool cuda, Setup* s) {
  TrainOptions& o = s->options;
  if (!f.preset.empty()) {
    StatusOr<GptConfig> p = PresetConfig(f.preset);
    if (!p.ok())
      return Status::InvalidArgument("--preset: " +
                                     std::string(p.status().message()));
    o.model = *p;
    o.model_name = f.preset;
  } else if (cuda) {
    o.model = PresetConfig("gpt2-124M").value();
    o.model_name = "gpt2-124M";
  } else {
    o.model = CpuDefaultModel();
    o.model_name = "cpu-default (4 layers, 256 channels)";
  }
  if (f.layers != 0) o.model.n_layer = f.layers;
  if (f.heads != 0) o.model.n_head = f.heads;
  if (f.embd != 0) o.model.n_embd = f.embd;
  if (f.context != 0) o.model.context_length = f.context;
  if (f.layers || f.heads || f.embd || f.context) o.model_name += " (custom)";
  return Status::Ok();
}

Status ParseData(const Flags& f, Setup* s) {
  TrainOptions& o = s->options;
  if (f.vocab.empty() != f.merges.empty()) {
    return Status::InvalidArgument(
        "--vocab and --merges come together (GPT-2 BPE)");
  }
  if (!f.vocab.empty()) {
    auto t = strata::finetune::Gpt2BpeTokenizer::Load(f.vocab, f.merges);
    if (!t.ok())
      return Status::InvalidArgument(std::string(t.status().message()));
    s->tokenizer = std::move(t).value();
  } else {
    s->tokenizer = std::make_unique<strata::finetune::ByteTokenizer>();
  }
  const int64_t vocab = s->tokenizer->vocab_size();
  if (f.preset.empty() && f.weights.empty()) {
    o.model.vocab_size = vocab;  // the default model fits the tokenizer
  } else if (vocab > o.model.vocab_size) {
    return Status::InvalidArgument(
        "the " + std::string(s->tokenizer->name()) + " tokenizer has " +
        std::to_string(vocab) +
        " tokens, more than the model's vocabulary of " +
        std::to_string(o.model.vocab_size));
  }
  strata::finetune::DataOptions d;
  if (!f.data.empty()) {
    d.path = f.data;
  } else {
    StatusOr<std::string> p = strata::finetune::DefaultCorpusPath();
    if (!p.ok())
      return Status::InvalidArgument("--data not given: " +
                                     std::string(p.status().message()));
    d.path = *p;
  }
  auto data = strata::finetune::TextDataset::Load(d, s->tokenizer.get());
  if (!data.ok()) {
    return Status::InvalidArgument("--data: " +
                                   std::string(data.status().message()));
  }
  s->data.emplace(std::move(data).value());
  // Every rank draws the global micro-batch and trains on its share.
  auto sampler = strata::finetune::BatchSampler::Create(
      s->data->train(), int64_t{o.batch} * o.engine.world_size, o.seq_len,
      o.seed);
  if (!sampler.ok()) {
    return Status::InvalidArgument("--data: " +
                                   std::string(sampler.status().message()));
  }
  s->sampler.emplace(*sampler);
  s->config["data"] = {{"path", d.path},
                       {"files", s->data->files().size()},
                       {"text_bytes", s->data->text_bytes()},
                       {"tokens", s->data->total_tokens()},
                       {"tokenizer", std::string(s->tokenizer->name())}};
  return Status::Ok();
}

// The --config file as JSON (null without one, or when it does not parse:
// ParseEngineConfigFile says why), to ask which keys it names.
nlohmann::json ConfigKeys(const std::string& path) {
  if (path.empty()) return nullptr;
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

// Whether config `j` names the nested key `keys` (each a member of the
// object before), rather than leaving strata's default.
bool ConfigHas(const nlohmann::json& j,
               std::initializer_list<const char*> keys) {
  const nlohmann::json* at = &j;
  for (const char* k : keys) {
    if (!at->is_object() || !at->contains(k)) return false;
    at = &(*at)[k];
  }
  return true;
}

// Whether a config names the ZeRO stage (zero_optimization.stage or
// strata.zero_stage).
bool ConfigNamesStage(const nlohmann::json& j) {
  return ConfigHas(j, {"zero_optimization", "stage"}) ||
         ConfigHas(j, {"strata", "zero_stage"});
}

// Whether a config names the optimizer's `key` (lr, weight_decay): in the
// DeepSpeed section's params or in strata's optimizer.
bool ConfigNamesOptimizer(const nlohmann::json& j, const char* key) {
  return ConfigHas(j, {"optimizer", "params", key}) ||
         ConfigHas(j, {"strata", "optimizer", key});
}

// With several ranks: the ranks, the ZeRO stage (the config's, else 2),
// parameters on the device with stages 1 and 2 (which keep whole
// parameters there; stage 3 keeps each rank's shard where the config or
// --nvme puts it) and a swap directory per rank, since an engine locks the
// directories it swaps in. `keys`: the config's (ConfigKeys).
Status ParseRanks(const Flags& f, const Ranks& ranks,
                  const nlohmann::json& keys, Setup* s) {
  strata::EngineOptions& e = s->options.engine;
  if (ranks.size == 1) return Status::Ok();
  if (e.world_size != 1 && e.world_size != ranks.size) {
    return Status::InvalidArgument(
        "--config: strata.world_size is " + std::to_string(e.world_size) +
        " but the job runs " + std::to_string(ranks.size) + " ranks");
  }
  if (!ConfigNamesStage(keys)) e.zero_stage = 2;
  if (e.zero_stage != 3 && (f.config.empty() || !f.nvme.empty())) {
    e.params = strata::Residence::kDevice;
  }
  for (std::string& p : e.nvme_paths) {
    p += "/rank-" + std::to_string(ranks.rank);
    s->made_dirs.push_back(p);
  }
  e.world_size = ranks.size;
  e.rank = ranks.rank;
  e.comm = ranks.engine;
  s->options.comm = ranks.trainer;
  return Status::Ok();
}

// Fills the engine options: from --config, else the defaults (parameters
// and optimizer states in host RAM, or on NVMe with --nvme), with a device
// budget from --device-budget or a twelfth of the model state. The
// optimizer's lr a config names is the schedule's peak unless --lr is
// given, and its weight decay replaces the example's 0.01.
Status ParseEngine(const Flags& f, const Ranks& ranks, Setup* s) {
  TrainOptions& o = s->options;
  const nlohmann::json keys = ConfigKeys(f.config);
  if (!f.config.empty()) {
    auto c = strata::ParseEngineConfigFile(f.config);
    if (!c.ok()) {
      return Status::InvalidArgument("--config: " +
                                     std::string(c.status().message()));
    }
    o.engine = c->options;
    o.engine_origin = "--config " + f.config;
    for (const std::string& w : c->warnings) s->notes.push_back(w);
    const double lr = o.engine.optimizer.lr;
    if (ConfigNamesOptimizer(keys, "lr")) {
      if (f.lr_given && lr != o.lr) {
        s->notes.push_back("the optimizer's lr " + General(lr) +
                           " gives way to --lr " + General(o.lr));
      } else if (!f.lr_given && !(lr > 0)) {
        return Status::InvalidArgument(
            "--config: the optimizer's lr is " + General(lr) +
            "; the schedule's peak must be > 0 (or pass --lr)");
      } else if (!f.lr_given) {
        o.lr = lr;
      }
    }
  } else {
    o.engine.params = strata::Residence::kHost;
    o.engine.optimizer_states = strata::Residence::kHost;
    o.engine.grads = strata::Residence::kHost;
  }
  if (!f.nvme.empty()) {
    o.engine.params = strata::Residence::kNvme;
    o.engine.optimizer_states = strata::Residence::kNvme;
    o.engine.nvme_paths = {f.nvme};
  }
  STRATA_RETURN_IF_ERROR(ParseRanks(f, ranks, keys, s));
  const uint64_t state = ModelStateBytes(o.model, o.dtype, o.engine.optimizer);
  // The most the trainer pins at once: one block, or the head with wte.
  const int64_t C = o.model.n_embd;
  const uint64_t esize = strata::ElementSize(o.dtype);
  const uint64_t block = static_cast<uint64_t>(12 * C * C + 13 * C) * esize;
  const uint64_t head =
      static_cast<uint64_t>(o.model.vocab_size * C + 2 * C) * esize;
  if (!f.device_budget.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.engine.device_budget_bytes,
                            ParseBytes("--device-budget", f.device_budget));
  } else if (o.engine.device_budget_bytes == 0) {
    uint64_t want = std::max<uint64_t>(state / 12, 2 * std::max(block, head));
    if (ranks.size > 1 && o.engine.params == strata::Residence::kDevice) {
      // The whole working copy rests there, beside the room to work.
      want += static_cast<uint64_t>(ParameterCount(o.model)) * esize;
    }
    o.engine.device_budget_bytes = (want + (1 << 20) - 1) >> 20 << 20;
  }
  const uint64_t budget = o.engine.device_budget_bytes;
  if (budget < std::max(block, head)) {
    return Status::InvalidArgument(
        "--device-budget: " + HumanBytes(budget) +
        " cannot hold what one block pins at once (" +
        HumanBytes(std::max(block, head)) + ")");
  }
  if (f.config.empty()) {
    // Partitions small enough that several fit in the budget.
    uint64_t part = uint64_t{64} << 20;
    while (part > (64u << 10) && part > budget / 2) part >>= 1;
    o.engine.partition_bytes = part;
    o.engine.persistence_threshold_bytes = 0;
  }
  if (f.max_grad_norm == 0 && o.engine.step_overlap_bytes == 0 &&
      UpdatesDuringBackward(o.engine.optimizer)) {
    // Without clipping the step overlaps backward: room to undo every
    // unit's update (fp32 master and moments) should a gradient overflow.
    o.engine.step_overlap_bytes =
        static_cast<uint64_t>(ParameterCount(o.model)) * 12;
  }
  o.engine.optimizer.cpu.threads = static_cast<int>(f.threads);
  if (!ConfigNamesOptimizer(keys, "weight_decay")) {
    o.engine.optimizer.cpu.weight_decay = 0.01;
  }
  return Status::Ok();
}

Status CheckDirectory(const char* option, const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(std::string(option) + ": directory '" + dir +
                                   "' does not exist");
  }
  return Status::Ok();
}

// An output file's directory must exist, so that a finished run is not lost
// to a typo.
Status CheckOutput(const char* option, const std::string& path) {
  if (path.empty()) return Status::Ok();
  const size_t slash = path.rfind('/');
  return CheckDirectory(option,
                        slash == std::string::npos
                            ? "."
                            : path.substr(0, std::max<size_t>(slash, 1)));
}

// --checkpoint-dir (created when missing, its parent must exist),
// --save-every, --keep, --resume, --save-params, --export, --export-dtype.
Status ParseCheckpoints(const Flags& f, TrainOptions* o) {
  STRATA_RETURN_IF_ERROR(Range("--save-every", f.save_every, 0, INT64_MAX));
  STRATA_RETURN_IF_ERROR(Range("--keep", f.keep, 1, 1000000));
  STRATA_RETURN_IF_ERROR(Range("--stop-after", f.stop_after, 0, INT64_MAX));
  if (f.checkpoint_dir.empty() &&
      (f.resume || f.save_every != 0 || f.save_params)) {
    return Status::InvalidArgument(
        "--resume, --save-every and --save-params need --checkpoint-dir");
  }
  if (!f.checkpoint_dir.empty()) {
    STRATA_RETURN_IF_ERROR(CheckOutput("--checkpoint-dir", f.checkpoint_dir));
    struct stat st;
    if (f.resume && stat(f.checkpoint_dir.c_str(), &st) != 0) {
      return Status::InvalidArgument("--resume: --checkpoint-dir '" +
                                     f.checkpoint_dir + "' does not exist");
    }
  }
  STRATA_RETURN_IF_ERROR(CheckOutput("--export", f.export_path));
  if (f.export_dtype == "fp32") {
    o->export_dtype = strata::ElementType::kFloat32;
  } else if (f.export_dtype == "bf16") {
    o->export_dtype = strata::ElementType::kBFloat16;
  } else if (f.export_dtype == "fp16") {
    o->export_dtype = strata::ElementType::kFloat16;
  } else {
    return Status::InvalidArgument("--export-dtype: '" + f.export_dtype +
                                   "'; accepted: fp32, bf16, fp16");
  }
  o->checkpoint_dir = f.checkpoint_dir;
  o->save_every = f.save_every;
  o->stop_after = f.stop_after;
  o->keep = static_cast<int>(f.keep);
  o->resume = f.resume;
  o->save_params = f.save_params;
  o->export_path = f.export_path;
  return Status::Ok();
}

StatusOr<Setup> ParseFlags(const Flags& f, const Ranks& ranks) {
  Setup s;
  STRATA_RETURN_IF_ERROR(CheckOutput("--json", f.json));
  STRATA_RETURN_IF_ERROR(CheckOutput("--plot", f.plot));
  if (!f.nvme.empty()) STRATA_RETURN_IF_ERROR(CheckDirectory("--nvme", f.nvme));
  TrainOptions& o = s.options;
  STRATA_RETURN_IF_ERROR(Range("--batch", f.batch, 1, 65536));
  STRATA_RETURN_IF_ERROR(Range("--seq-len", f.seq_len, 1, 1 << 20));
  STRATA_RETURN_IF_ERROR(Range("--micro-batches", f.micro_batches, 1, 65536));
  STRATA_RETURN_IF_ERROR(Range("--warmup", f.warmup, 0, INT64_MAX));
  STRATA_RETURN_IF_ERROR(Range("--threads", f.threads, 0, 4096));
  if (!(f.lr > 0) || !std::isfinite(f.lr)) {
    return Status::InvalidArgument("--lr: must be a finite number > 0");
  }
  if (!(f.max_grad_norm >= 0) || !std::isfinite(f.max_grad_norm)) {
    return Status::InvalidArgument("--max-grad-norm: must be >= 0 (0: off)");
  }
  if (!(f.min_lr_ratio >= 0 && f.min_lr_ratio <= 1)) {
    return Status::InvalidArgument("--min-lr-ratio: must be in [0, 1]");
  }
  if (f.dtype == "bf16") {
    o.dtype = strata::ElementType::kBFloat16;
  } else if (f.dtype == "fp16") {
    o.dtype = strata::ElementType::kFloat16;
  } else {
    return Status::InvalidArgument("--dtype: '" + f.dtype +
                                   "'; accepted: bf16, fp16");
  }
  if (f.recompute == "auto") {
    o.recompute = Recompute::kAuto;
  } else if (f.recompute == "always") {
    o.recompute = Recompute::kAlways;
  } else if (f.recompute == "never") {
    o.recompute = Recompute::kNever;
  } else {
    return Status::InvalidArgument("--recompute: '" + f.recompute +
                                   "'; accepted: auto, always, never");
  }
  if (f.device == "auto") {
    o.device.choice = strata::DeviceChoice::kAuto;
  } else if (f.device == "cuda") {
    o.device.choice = strata::DeviceChoice::kCuda;
  } else if (f.device == "host") {
    o.device.choice = strata::DeviceChoice::kHostEmulated;
  } else {
    return Status::InvalidArgument("--device: '" + f.device +
                                   "'; accepted: auto, cuda, host");
  }
  o.device.host_compute_threads = static_cast<int>(f.threads);
  // NCCL runs one rank per GPU: this machine's ranks take one each.
  if (ranks.backend == "nccl") o.device.cuda_ordinal = ranks.local_rank;
  // Which device auto picks decides the default model.
  auto probe = strata::NewDevice(o.device);
  if (!probe.ok()) return probe.status();
  const bool cuda = (*probe)->kind() == strata::DeviceKind::kCuda;
  probe->reset();
  STRATA_RETURN_IF_ERROR(ParseModel(f, cuda, &s));
  o.steps = f.steps != 0 ? f.steps : (cuda ? 1000 : 400);
  STRATA_RETURN_IF_ERROR(Range("--steps", o.steps, 1, INT64_MAX));
  o.batch = static_cast<int>(f.batch);
  o.seq_len = static_cast<int>(f.seq_len);
  o.micro_batches = static_cast<int>(f.micro_batches);
  o.lr = f.lr;
  o.warmup_steps = std::min<int64_t>(f.warmup, o.steps);
  o.min_lr_ratio = f.min_lr_ratio;
  o.max_grad_norm = f.max_grad_norm;
  o.seed = f.seed;
  o.weights = f.weights;
  STRATA_RETURN_IF_ERROR(ParseCheckpoints(f, &o));
  if (!f.weights.empty()) {
    auto file = strata::finetune::SafetensorsFile::Open(f.weights);
    if (!file.ok()) {
      return Status::InvalidArgument("--weights: " +
                                     std::string(file.status().message()));
    }
    auto dims = strata::finetune::InferGpt2Dims(*file);
    if (!dims.ok()) {
      return Status::InvalidArgument("--weights: " +
                                     std::string(dims.status().message()));
    }
    o.model.n_layer = dims->n_layer;
    o.model.n_embd = dims->n_embd;
    o.model.vocab_size = dims->vocab;
    o.model.context_length = dims->n_ctx;
    o.model.n_head = dims->n_embd / 64;  // GPT-2's heads of 64
    o.model_name = "GPT-2 checkpoint " + f.weights;
  }
  STRATA_RETURN_IF_ERROR(ValidateConfig(o.model));
  if (o.seq_len > o.model.context_length) {
    return Status::InvalidArgument("--seq-len: " + std::to_string(o.seq_len) +
                                   " is longer than the model's context of " +
                                   std::to_string(o.model.context_length));
  }
  o.engine.world_size = ranks.size;  // the sampler draws for all ranks
  STRATA_RETURN_IF_ERROR(ParseData(f, &s));
  STRATA_RETURN_IF_ERROR(ParseEngine(f, ranks, &s));
  if (!cuda && o.device.memory_budget_bytes == 0) {
    // The host-emulated device reserves address space: the engine's budget,
    // the activations (logits dominate) and the gradients in flight.
    const uint64_t BT = static_cast<uint64_t>(o.batch) * o.seq_len;
    const uint64_t V = o.model.vocab_size, C = o.model.n_embd;
    const uint64_t L = o.model.n_layer;
    const uint64_t acts =
        BT * V * 8 + (L + 8) * BT * C * 4 * 8 + V * C * 8 + 16 * C * C * 4;
    o.device.memory_budget_bytes =
        o.engine.device_budget_bytes + 2 * acts + (uint64_t{256} << 20);
  }
  s.config["model"] = {{"name", o.model_name},
                       {"vocab_size", o.model.vocab_size},
                       {"context_length", o.model.context_length},
                       {"n_layer", o.model.n_layer},
                       {"n_head", o.model.n_head},
                       {"n_embd", o.model.n_embd}};
  s.config["batch"] = o.batch;
  s.config["seq_len"] = o.seq_len;
  s.config["micro_batches"] = o.micro_batches;
  s.config["steps"] = o.steps;
  s.config["lr"] = o.lr;
  s.config["warmup_steps"] = o.warmup_steps;
  s.config["min_lr_ratio"] = o.min_lr_ratio;
  s.config["max_grad_norm"] = o.max_grad_norm;
  s.config["dtype"] = f.dtype;
  s.config["recompute"] = f.recompute;
  s.config["device"] = f.device;
  s.config["seed"] = o.seed;
  s.config["threads"] = f.threads;
  s.config["weights"] = o.weights;
  s.config["checkpoint"] = {
      {"dir", o.checkpoint_dir},    {"save_every", o.save_every},
      {"stop_after", o.stop_after}, {"keep", o.keep},
      {"resume", o.resume},         {"save_params", o.save_params},
      {"export", o.export_path},    {"export_dtype", f.export_dtype}};
  s.config["engine_config"] = f.config;
  s.config["data_parallel"] = {
      {"ranks", ranks.size},
      {"comm", ranks.backend},
      {"comm_timeout_s", f.comm_timeout},
      {"zero_stage", o.engine.zero_stage},
      {"comm_memory",
       std::string(strata::CommMemoryName(o.engine.comm_memory))},
      {"global_batch", int64_t{o.batch} * o.micro_batches * ranks.size}};
  s.config["engine"] = {
      {"params", std::string(strata::ResidenceName(o.engine.params))},
      {"optimizer_states",
       std::string(strata::ResidenceName(o.engine.optimizer_states))},
      {"grads", std::string(strata::ResidenceName(o.engine.grads))},
      {"nvme_paths", o.engine.nvme_paths},
      {"device_budget_bytes", o.engine.device_budget_bytes},
      {"partition_bytes", o.engine.partition_bytes},
      {"step_overlap_bytes", o.engine.step_overlap_bytes},
      // The optimizer as a DeepSpeed section (its lr the schedule's peak).
      {"optimizer", nlohmann::json::parse(strata::CpuOptimizerConfigJson(
                        {o.engine.optimizer.cpu, o.lr}))},
      {"moments",
       std::string(strata::MomentDTypeName(o.engine.optimizer.moment_dtype))}};
  return s;
}

int ExitCode(const Status& st) {
  if (st.ok()) return kExitOk;
  return st.code() == strata::StatusCode::kInvalidArgument ? kExitUsage
                                                           : kExitFailure;
}

// Checks the flags, trains and writes the reports (rank 0 prints and
// writes; every rank trains its share).
Status Run(const Flags& f, const Ranks& ranks) {
  const bool lead = ranks.rank == 0;
  StatusOr<Setup> setup = ParseFlags(f, ranks);
  // Every rank has its options before any of them makes the engine.
  STRATA_RETURN_IF_ERROR(AgreeAcrossRanks(ranks.trainer.get(), setup.status()));
  Setup& s = *setup;
  if (lead) {
    for (const std::string& n : s.notes) {
      std::fprintf(stderr, "strata-finetune: config: %s\n", n.c_str());
    }
  }
  const TrainOptions& o = s.options;
  if (lead) {
    std::fprintf(stderr, "strata-finetune: %s, %s; %lld text files, %s\n",
                 o.model_name.c_str(),
                 o.resume            ? "resuming from the latest checkpoint"
                 : o.weights.empty() ? "fresh initialization (no --weights)"
                                     : "weights from the checkpoint",
                 static_cast<long long>(s.data->files().size()),
                 HumanBytes(s.data->text_bytes()).c_str());
    if (ranks.size > 1) {
      std::fprintf(stderr,
                   "strata-finetune: %d data-parallel ranks (MPI), ZeRO "
                   "stage %d; global batch %lld sequences per step\n",
                   ranks.size, o.engine.zero_stage,
                   static_cast<long long>(int64_t{o.batch} * o.micro_batches *
                                          ranks.size));
    }
  }
  // Each rank's swap directory, made here and removed after the run; and a
  // checkpoint directory the run makes, removed if a failed run leaves it
  // empty.
  std::error_code exists_ec;
  const bool new_checkpoint_dir =
      lead && !o.checkpoint_dir.empty() &&
      !std::filesystem::exists(o.checkpoint_dir, exists_ec);
  std::vector<std::string> made;
  Status dirs = Status::Ok();
  for (const std::string& d : s.made_dirs) {
    std::error_code ec;
    if (std::filesystem::create_directory(d, ec)) {
      made.push_back(d);
    } else if (ec) {
      dirs = Status::InvalidArgument("--nvme: cannot make " + d + ": " +
                                     ec.message());
      break;
    }
  }
  dirs = AgreeAcrossRanks(ranks.trainer.get(), dirs);
  StatusOr<TrainReport> r = Status::Aborted("not trained");
  if (!dirs.ok()) {
    r = dirs;
  } else {
    Progress progress(
        stderr, o.steps,
        int64_t{o.batch} * o.seq_len * o.micro_batches * ranks.size);
    ProgressFn shown;
    if (lead) shown = [&progress](const StepRecord& st) { progress.Step(st); };
    r = Train(o, *s.sampler, shown);
    if (lead) progress.Finish();
  }
  if (!r.ok() && new_checkpoint_dir) made.push_back(o.checkpoint_dir);
  for (const std::string& d : made) {
    std::error_code ec;
    std::filesystem::remove(d, ec);  // only when empty
  }
  STRATA_RETURN_IF_ERROR(r.status());
  if (!lead) return Status::Ok();
  std::fputs(Summary(o, *r).c_str(), stdout);
  if (!f.json.empty()) {
    STRATA_RETURN_IF_ERROR(
        WriteFileAtomically(f.json, ReportJson(o, *r, s.config).dump(2))
            .WithContext("--json"));
  }
  if (!f.plot.empty()) {
    STRATA_RETURN_IF_ERROR(
        WriteFileAtomically(f.plot,
                            LossPlotSvg(*r, "strata-finetune: " + o.model_name))
            .WithContext("--plot"));
  }
  return Status::Ok();
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "strata-finetune: fine-tune a GPT-2 style model whose training state "
      "is many times the device memory it is given, with strata as the "
      "memory backend. With no flags: a small model on the default corpus."};
  app.add_option("--preset", f.preset,
                 "Model shape: gpt2-124M, gpt2-355M, gpt2-774M, gpt2-1.5B, "
                 "gpt3-6.7B, gpt3-13B, tiny (default: a 4-layer model on a "
                 "CPU, gpt2-124M on a GPU)");
  app.add_option("--layers", f.layers, "Override the number of blocks");
  app.add_option("--heads", f.heads, "Override the attention heads");
  app.add_option("--embd", f.embd, "Override the channels");
  app.add_option("--context", f.context, "Override the context length");
  app.add_option("--steps", f.steps,
                 "Optimizer steps (default 400 on a CPU, 1000 on a GPU)");
  app.add_option("--batch", f.batch, "Sequences per micro-batch (8)");
  app.add_option("--seq-len", f.seq_len, "Tokens per sequence (128)");
  app.add_option("--micro-batches", f.micro_batches,
                 "Micro-batches per step (1)");
  app.add_option("--lr", f.lr,
                 "Peak learning rate (the --config optimizer's lr, else "
                 "3e-3)");
  app.add_option("--warmup", f.warmup, "Warm-up steps (10)");
  app.add_option("--min-lr-ratio", f.min_lr_ratio,
                 "Final learning rate over the peak (0.1)");
  app.add_option("--max-grad-norm", f.max_grad_norm,
                 "Global-norm clipping, 0 = off; off lets the optimizer "
                 "step overlap the backward, keeping a copy of the optimizer "
                 "state in host RAM to undo an overflow (1.0)");
  app.add_option("--dtype", f.dtype, "Working precision: bf16 or fp16");
  app.add_option("--recompute", f.recompute,
                 "Recompute each block in backward: auto (only when keeping "
                 "every block's activations would take over a quarter of the "
                 "free device memory), always or never");
  app.add_option("--device", f.device, "auto, cuda or host");
  app.add_option("--device-budget", f.device_budget,
                 "Device memory for parameters (K/M/G suffixes; default a "
                 "twelfth of the model state)");
  app.add_option("--nvme", f.nvme,
                 "Rest parameters and optimizer states in this directory");
  app.add_option("--data", f.data,
                 "A text file or directory (default: Debian's fortunes)");
  app.add_option("--weights", f.weights,
                 "A GPT-2 checkpoint in safetensors (Hugging Face layout)");
  app.add_option("--vocab", f.vocab, "GPT-2 BPE vocab.json (with --merges)");
  app.add_option("--merges", f.merges, "GPT-2 BPE merges.txt (with --vocab)");
  app.add_option("--config", f.config,
                 "A strata JSON config, or a DeepSpeed ds_config.json");
  app.add_option("--json", f.json, "Write the results as JSON here");
  app.add_option("--plot", f.plot, "Write the loss curve (SVG) here");
  app.add_option("--seed", f.seed, "Initialization and batch seed (1)");
  app.add_option("--checkpoint-dir", f.checkpoint_dir,
                 "Save checkpoints here (docs/checkpoints.md)");
  app.add_option("--save-every", f.save_every,
                 "Save every N steps (0: after the last step only)");
  app.add_option("--keep", f.keep, "Checkpoints kept (2)");
  app.add_option("--stop-after", f.stop_after,
                 "Stop after N steps of the --steps schedule (resume later)");
  app.add_flag("--resume", f.resume,
               "Continue from the latest checkpoint in --checkpoint-dir");
  app.add_flag("--save-params", f.save_params,
               "Also save the working-precision copy");
  app.add_option("--export", f.export_path,
                 "After training, write the weights here (safetensors, "
                 "the layout --weights loads)");
  app.add_option("--export-dtype", f.export_dtype,
                 "fp32 (masters), bf16 or fp16");
  app.add_option("--threads", f.threads,
                 "CPU threads for compute and the optimizer (0: all)");
  app.add_option("--comm", f.comm,
                 "Data-parallel ranks: auto (MPI when launched by mpirun on "
                 "several ranks), mpi, nccl (the engine's collectives on "
                 "the GPUs) or single (docs/finetune.md)");
  app.add_option("--comm-timeout", f.comm_timeout,
                 "Seconds a rank waits for the others in a collective before "
                 "it fails (300)");
  app.set_version_flag("--version", std::string(strata_version()));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  f.lr_given = app.count("--lr") > 0;
  StatusOr<Ranks> ranks = MakeRanks(f);
  if (!ranks.ok()) {
    std::fprintf(stderr, "strata-finetune: %s\n",
                 ranks.status().ToString().c_str());
    return ExitCode(ranks.status());
  }
  Status st = Run(f, *ranks);
  if (!st.ok()) {
    std::fprintf(stderr, "strata-finetune: %s%s\n",
                 ranks->size > 1
                     ? ("rank " + std::to_string(ranks->rank) + ": ").c_str()
                     : "",
                 st.ToString().c_str());
  }
  int code = ExitCode(st);
  if (ranks->trainer != nullptr) {
    // Every rank exits with the highest status of all.
    float c = static_cast<float>(code);
    StatusOr<strata::CommWork> w = ranks->trainer->AllReduce(
        &c, &c, 1, strata::CommType::kFloat32, strata::ReduceOp::kMax);
    if (w.ok() && w->Wait().ok()) code = std::max(code, static_cast<int>(c));
  }
  return code;
}

}  // namespace
}  // namespace finetune

int main(int argc, char** argv) { return finetune::Main(argc, argv); }
