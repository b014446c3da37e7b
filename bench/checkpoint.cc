// strata-bench checkpoint: saving and loading the state of N parameters whose
// fp32 master and moments rest on NVMe (include/strata/checkpoint.h), beside
// the limit measured in the same run:
//
//   A save reads 12 bytes per parameter from the swap space and writes as
//   many to the checkpoint; a load reads them back and writes them to the
//   swap space (and rewrites the working copy, in host RAM). Both move
//   reads and writes at once on one drive, so the limit is the I/O engine's
//   rate doing that (the rate `step` uses), and
//     ratio = (24 bytes x N / seconds) / that rate.
//   A save's time includes its fsyncs, the manifest and the publication; a
//   load's, the verification of every extent's checksum.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/async_io.h"
#include "strata/checkpoint.h"
#include "strata/device.h"
#include "strata/engine.h"

namespace strata::bench {
namespace {

constexpr const char* kCommand = "checkpoint";
constexpr const char* kLockName = "strata-bench-checkpoint.lock";
constexpr const char* kScratchName = "strata-bench-checkpoint-io.dat";
constexpr const char* kSwapDir = "strata-bench-checkpoint-swap";
constexpr const char* kCheckpointDir = "strata-bench-checkpoint.d";
constexpr uint64_t kMaxParams = uint64_t{1} << 40;
constexpr uint64_t kTensorElems = uint64_t{16} << 20;  // 64 MiB of fp32

struct CheckpointFlags {
  std::string params = "256M";
  std::string dir = ".";
  SwapIoFlags io;
  std::string reps = "2";
  std::string json;
};

struct CheckpointConfig {
  uint64_t params = 0;
  std::string dir;
  SwapIoConfig io;
  int reps = 2;
  std::string json;
};

void AddOptions(CLI::App& app, CheckpointFlags& f) {
  app.add_option("--params", f.params,
                 "parameters, K/M/G/T suffixes (default 256M)");
  app.add_option("--dir", f.dir,
                 "directory for the swap space and the checkpoints "
                 "(default .)");
  AddSwapIoOptions(app, f.io);
  app.add_option("--reps", f.reps,
                 "saves and loads timed, 1..100; the best is kept");
  app.add_option("--json", f.json, "write results as JSON to FILE");
}

StatusOr<CheckpointConfig> Parse(const CheckpointFlags& f) {
  CheckpointConfig c;
  STRATA_ASSIGN_OR_RETURN(c.params,
                          ParseSizeOption("--params", f.params, 1, kMaxParams));
  c.dir = f.dir;
  STRATA_ASSIGN_OR_RETURN(c.io, ParseSwapIoFlags(f.io));
  STRATA_ASSIGN_OR_RETURN(int64_t reps,
                          ParseIntOption("--reps", f.reps, 1, 100));
  c.reps = static_cast<int>(reps);
  c.json = f.json;
  return c;
}

Status Check(const CheckpointConfig& c, RunGuard& guard, JsonOutput* json) {
  if (!c.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(*json, JsonOutput::Prepare("--json", c.json));
  }
  STRATA_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(c.dir, kLockName));
  guard.AdoptLock(std::move(lock));
  for (const char* name : {kSwapDir, kCheckpointDir}) {
    std::error_code ec;
    if (std::filesystem::exists(c.dir + "/" + name, ec)) {
      return Status::AlreadyExists(
          "--dir " + c.dir + ": " + name +
          " exists (left by a run that was killed?); remove it first");
    }
  }
  STRATA_ASSIGN_OR_RETURN(uint64_t free_bytes, FreeBytes(c.dir));
  // The swap space and two checkpoints (12 bytes per parameter each, the
  // second written before the first is pruned), plus the scratch file.
  const uint64_t need = c.params * 36 + (uint64_t{2} << 30);
  if (need > free_bytes) {
    return Status::NoSpace("--dir " + c.dir + ": the run needs " +
                           FormatBytes(need) + ", " + FormatBytes(free_bytes) +
                           " are free");
  }
  // The gradient accumulator and the working copy rest in RAM.
  return CheckMemory(
      "the engine's host arrays (--params " + std::to_string(c.params) + ")",
      c.params * 6 + (uint64_t{1} << 30));
}

// One timed save and load, and the I/O engine's rate measured right after.
struct RepSample {
  double save_s = 0, load_s = 0, io_rate = 0;
};

struct Outcome {
  double io_rate = 0;  // bytes/s, reads and writes at once; the best sample
  std::vector<RepSample> reps;
  double save_s = 1e30, load_s = 1e30;
  // Of the best save: Commit (the fsyncs that make it durable, the
  // manifest, the renames).
  double commit_s = 0;
  uint64_t checkpoint_bytes = 0;
  EngineStats stats;
  std::string io_backend;
};

StatusOr<uint64_t> TreeBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  }
  if (ec) return Status::IoError(dir + ": " + ec.message());
  return total;
}

StatusOr<Outcome> Run(const CheckpointConfig& c, RunGuard& guard) {
  Outcome out;
  std::fprintf(stderr, "checkpoint: measuring the I/O engine's rate\n");
  STRATA_ASSIGN_OR_RETURN(out.io_rate, MeasureMixedIo(c.dir, kScratchName, c.io,
                                                      c.params * 24, guard));

  const std::string swap = c.dir + "/" + kSwapDir;
  const std::string ckpt = c.dir + "/" + kCheckpointDir;
  guard.RemoveTreeOnExit(swap);
  guard.RemoveTreeOnExit(ckpt);
  std::filesystem::create_directory(swap);
  DeviceOptions dopt;
  dopt.choice = DeviceChoice::kHostEmulated;
  dopt.memory_budget_bytes = uint64_t{256} << 20;
  STRATA_ASSIGN_OR_RETURN(auto device, NewHostEmulatedDevice(dopt));
  EngineOptions o;
  o.params = Residence::kHost;
  o.optimizer_states = Residence::kNvme;
  o.nvme_paths = {swap};
  o.io.backend = c.io.engine;
  o.io.queue_depth = c.io.queue_depth;
  o.io_block_bytes = c.io.block_size;
  o.device_budget_bytes = uint64_t{64} << 20;
  STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(o, device.get()));
  const uint64_t tensor = std::min(c.params, kTensorElems);
  for (uint64_t done = 0, i = 0; done < c.params; done += tensor, ++i) {
    TensorSpec s;
    s.name = "p" + std::to_string(i);
    s.shape = {static_cast<int64_t>(std::min(tensor, c.params - done))};
    STRATA_RETURN_IF_ERROR(engine->Register(s).status());
  }
  std::fprintf(stderr, "checkpoint: laying out %llu parameters\n",
               static_cast<unsigned long long>(c.params));
  STRATA_RETURN_IF_ERROR(engine->Start());

  // The checkpoints' data path: an I/O engine of the same kind.
  IoEngineOptions io;
  io.backend = c.io.engine;
  io.queue_depth = c.io.queue_depth;
  STRATA_ASSIGN_OR_RETURN(auto async, AsyncIo::Create(io));
  out.io_backend = std::string(async->name());
  STRATA_ASSIGN_OR_RETURN(auto fs, NewPosixCheckpointFs(async.get()));
  for (int rep = 0; rep <= c.reps; ++rep) {  // rep 0 warms up
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    CheckpointWriterOptions wo;
    wo.dir = ckpt;
    wo.step = rep;
    wo.keep = 1;
    wo.fs = fs.get();
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Begin(wo));
    STRATA_RETURN_IF_ERROR(engine->SaveState(*writer));
    const auto tc = std::chrono::steady_clock::now();
    STRATA_ASSIGN_OR_RETURN(std::string path, writer->Commit());
    const double save = SecondsSince(t0);
    const double commit = SecondsSince(tc);
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    const auto t1 = std::chrono::steady_clock::now();
    STRATA_ASSIGN_OR_RETURN(auto reader,
                            CheckpointReader::Open(path, fs.get()));
    STRATA_RETURN_IF_ERROR(engine->LoadState(*reader));
    const double load = SecondsSince(t1);
    if (rep > 0) {
      if (save < out.save_s) out.commit_s = commit;
      out.save_s = std::min(out.save_s, save);
      out.load_s = std::min(out.load_s, load);
      // Paired: the drive's rate on this VM moved by 15% between minutes,
      // enough for a save to beat the best rate sampled minutes away.
      STRATA_ASSIGN_OR_RETURN(
          double rate,
          MeasureMixedIo(c.dir, kScratchName, c.io, c.params * 24, guard));
      out.reps.push_back({save, load, rate});
      out.io_rate = std::max(out.io_rate, rate);
    }
    if (rep == c.reps) {
      STRATA_ASSIGN_OR_RETURN(out.checkpoint_bytes, TreeBytes(path));
    }
    std::fprintf(stderr, "checkpoint: rep %d: save %.3f s, load %.3f s\n", rep,
                 save, load);
  }
  // The rate was measured again after every timed rep, the best kept (the
  // machine may have been slower while the first sample ran).
  out.stats = engine->stats();
  return out;
}

Status Report(const CheckpointConfig& c, const Outcome& out, JsonOutput& json) {
  const double bytes = 24.0 * static_cast<double>(c.params);
  const double save_rate = bytes / out.save_s;
  const double load_rate = bytes / out.load_s;
  // The median (nearest rank) of each rep's ratio to the rate sampled
  // right after it.
  std::vector<double> save_paired, load_paired;
  nlohmann::json reps = nlohmann::json::array();
  for (const RepSample& r : out.reps) {
    save_paired.push_back(bytes / r.save_s / r.io_rate);
    load_paired.push_back(bytes / r.load_s / r.io_rate);
    reps.push_back({{"save_s", r.save_s},
                    {"load_s", r.load_s},
                    {"io_mixed_bytes_per_s", r.io_rate}});
  }
  const double save_pair = Percentile(save_paired, 50);
  const double load_pair = Percentile(load_paired, 50);
  const std::vector<RatioFigure> figures = {
      {"save ratio", save_rate / out.io_rate, save_pair},
      {"load ratio", load_rate / out.io_rate, load_pair}};
  Table table({"op", "params", "seconds", "commit s", "GB/s (read+write)",
               "limit GB/s", "ratio", "paired"});
  table.AddRow({"save", std::to_string(c.params), Fixed(out.save_s, 3),
                Fixed(out.commit_s, 3), Fixed(save_rate / 1e9, 2),
                Fixed(out.io_rate / 1e9, 2), Fixed(figures[0].best, 3),
                Fixed(save_pair, 3)});
  table.AddRow({"load", std::to_string(c.params), Fixed(out.load_s, 3), "-",
                Fixed(load_rate / 1e9, 2), Fixed(out.io_rate / 1e9, 2),
                Fixed(figures[1].best, 3), Fixed(load_pair, 3)});
  std::printf(
      "strata-bench checkpoint: %llu params, master and moments on NVMe "
      "(%s), checkpoint %s, best of %d\n%s",
      static_cast<unsigned long long>(c.params), out.io_backend.c_str(),
      FormatBytes(out.checkpoint_bytes).c_str(), c.reps,
      table.ToString().c_str());
  PrintAboveOneNote(figures,
                    "the drive's rate moving as many reads as writes at once");
  if (!json.active()) return Status::Ok();
  nlohmann::json j = {
      {"command", kCommand},
      {"machine", MachineInfo()},
      {"filesystem", FilesystemInfo(c.dir)},
      {"config",
       {{"params", c.params},
        {"dir", c.dir},
        {"engine", std::string(IoBackendName(c.io.engine))},
        {"engine_used", out.io_backend},
        {"queue_depth", c.io.queue_depth},
        {"block_size", c.io.block_size},
        {"reps", c.reps},
        {"tensor_elems", std::min(c.params, kTensorElems)},
        {"optimizer_states_rest_on", "nvme"},
        {"params_rest_on", "host"},
        {"saved_roles", {"master", "exp_avg", "exp_avg_sq"}}}},
      {"limits", {{"io_mixed_bytes_per_s", out.io_rate}}},
      {"results",
       {{"bytes_moved_per_op", bytes},
        {"checkpoint_bytes", out.checkpoint_bytes},
        {"save_s", out.save_s},
        {"save_commit_s", out.commit_s},
        {"load_s", out.load_s},
        {"save_bytes_per_s", save_rate},
        {"load_bytes_per_s", load_rate},
        {"save_ratio", save_rate / out.io_rate},
        {"load_ratio", load_rate / out.io_rate},
        {"save_paired_ratio", save_pair},
        {"load_paired_ratio", load_pair},
        {"reps", reps},
        {"engine_stats", nlohmann::json::parse(EngineStatsJson(out.stats))}}}};
  return json.Commit(j);
}

int Main(int argc, char** argv) {
  CLI::App app{
      "checkpoint save and load of NVMe-resident state beside the "
      "I/O engine's rate",
      "strata-bench checkpoint"};
  CheckpointFlags flags;
  AddOptions(app, flags);
  CheckpointConfig cfg;
  JsonOutput json;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, Parse(flags));
        return Status::Ok();
      },
      [&](RunGuard& guard) { return Check(cfg, guard, &json); },
      [&](RunGuard& guard) -> Status {
        STRATA_ASSIGN_OR_RETURN(Outcome out, Run(cfg, guard));
        return Report(cfg, out, json);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("checkpoint",
                     "checkpoint save and load of NVMe-resident state vs the "
                     "I/O engine's rate",
                     Main);

}  // namespace strata::bench
