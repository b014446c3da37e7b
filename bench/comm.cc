// strata-bench comm: all-gather, reduce-scatter and all-reduce bandwidth by
// message size through strata's Communicator, run on every rank of
// `mpirun -np N strata-bench comm ...` (one rank without mpirun).
//
// Figures as nccl-tests defines them, for a message of S bytes (the whole
// gathered buffer, the whole reduce-scatter input, the all-reduce buffer):
//   algbw = S / time          (time: the slowest rank's, per iteration)
//   busbw = algbw x (n-1)/n   for all-gather and reduce-scatter
//   busbw = algbw x 2(n-1)/n  for all-reduce
// busbw is comparable with the link's bandwidth whatever n is. MPI and
// single rank move pinned host memory; NCCL moves CUDA device memory,
// bootstrapped over MPI.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/comm.h"
#include "strata/device.h"

namespace strata::bench {
namespace {

constexpr const char* kCommand = "comm";
constexpr uint64_t kMaxMessage = uint64_t{16} << 30;  // 16 GiB

struct CommFlags {
  std::string backend = "auto";
  std::string ops = "all-gather,reduce-scatter,all-reduce";
  std::string sizes = "4K,64K,1M,16M,64M";
  std::string type = "float32";
  std::string iters = "20";
  std::string warmup = "3";
  std::string timeout = "300";
  std::string json;
};

struct CommConfig {
  std::string backend;  // single, mpi or nccl after "auto" is resolved
  std::vector<std::string> ops;
  std::vector<uint64_t> sizes;
  std::string type;
  int iters = 20;
  int warmup = 3;
  double timeout_s = 300;
  std::string json;
};

struct Row {
  std::string op;
  uint64_t bytes = 0;  // S
  double seconds = 0;  // per iteration, the slowest rank
  double algbw = 0;    // GB/s
  double busbw = 0;    // GB/s
};

// ---- Parse -----------------------------------------------------------------

void AddOptions(CLI::App& app, CommFlags& f) {
  app.add_option("--backend", f.backend,
                 "auto (mpi under mpirun, else single), single, mpi, nccl")
      ->capture_default_str();
  app.add_option("--ops", f.ops, "all-gather, reduce-scatter, all-reduce")
      ->capture_default_str();
  app.add_option("--sizes", f.sizes,
                 "message bytes, comma-separated, 1K..16G (K/M/G suffixes)")
      ->capture_default_str();
  app.add_option("--type", f.type, "float32 or bfloat16")
      ->capture_default_str();
  app.add_option("--iters", f.iters, "timed iterations per size, 1..100000")
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "untimed iterations first, 0..1000")
      ->capture_default_str();
  app.add_option("--timeout", f.timeout,
                 "seconds a collective may wait for the others, > 0 and "
                 "<= 1000000")
      ->capture_default_str();
  app.add_option("--json", f.json, "also write the results here (rank 0)");
}

// --type's element type (a checked value).
CommType TypeOf(const std::string& type) {
  return type == "float32" ? CommType::kFloat32 : CommType::kBFloat16;
}

// Open MPI, MPICH and Slurm's PMI say how many ranks were launched.
bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

StatusOr<CommConfig> ParseComm(const CommFlags& f) {
  CommConfig c;
  STRATA_ASSIGN_OR_RETURN(c.backend,
                          ParseChoiceOption("--backend", f.backend,
                                            {"auto", "single", "mpi", "nccl"}));
  if (c.backend == "auto") c.backend = LaunchedByMpi() ? "mpi" : "single";
  STRATA_ASSIGN_OR_RETURN(
      c.ops,
      ParseChoiceListOption("--ops", f.ops,
                            {"all-gather", "reduce-scatter", "all-reduce"}));
  STRATA_ASSIGN_OR_RETURN(
      c.sizes, ParseSizeListOption("--sizes", f.sizes, 1024, kMaxMessage));
  STRATA_ASSIGN_OR_RETURN(
      c.type, ParseChoiceOption("--type", f.type, {"float32", "bfloat16"}));
  // A message is whole elements: a ragged tail would be left out of the
  // collective while counted in the figures.
  const size_t elem = CommTypeSize(TypeOf(c.type));
  for (uint64_t s : c.sizes) {
    if (s % elem != 0) {
      return Status::InvalidArgument(
          "--sizes: " + std::to_string(s) + " bytes is not a multiple of " +
          std::to_string(elem) + " bytes, the size of one " + c.type +
          " element (--type)");
    }
  }
  STRATA_ASSIGN_OR_RETURN(int64_t iters,
                          ParseIntOption("--iters", f.iters, 1, 100000));
  STRATA_ASSIGN_OR_RETURN(int64_t warmup,
                          ParseIntOption("--warmup", f.warmup, 0, 1000));
  c.iters = static_cast<int>(iters);
  c.warmup = static_cast<int>(warmup);
  STRATA_ASSIGN_OR_RETURN(
      c.timeout_s, ParseDoubleOption("--timeout", f.timeout, 0, 1e6, true));
  c.json = f.json;
  return c;
}

// ---- Check -----------------------------------------------------------------

struct CommPrepared {
  JsonOutput json;
  std::optional<Communicator> host;  // barriers, timing agreement
  std::optional<Communicator> nccl;  // --backend nccl
  std::unique_ptr<Device> device;    // --backend nccl
  std::unique_ptr<Stream> stream;

  Communicator& measured() { return nccl ? *nccl : *host; }
};

Status MakeCommunicators(const CommConfig& c, CommPrepared& p) {
  CommOptions o;
  o.timeout_s = c.timeout_s;
  o.backend =
      c.backend == "single" ? CommBackendKind::kSingle : CommBackendKind::kMpi;
  STRATA_ASSIGN_OR_RETURN(p.host, Communicator::Create(o));
  if (c.backend != "nccl") return Status::Ok();
  DeviceOptions d;
  d.choice = DeviceChoice::kCuda;
  STRATA_ASSIGN_OR_RETURN(p.device, NewDevice(d));
  STRATA_ASSIGN_OR_RETURN(p.stream, p.device->NewStream({}));
  CommOptions n;
  n.backend = CommBackendKind::kNccl;
  n.timeout_s = c.timeout_s;
  n.nccl_bootstrap = &*p.host;
  STRATA_ASSIGN_OR_RETURN(p.nccl, Communicator::Create(n));
  return Status::Ok();
}

// Every rank learns whether any failed its checks, so none waits for a rank
// that has left. Rank 0 alone writes the JSON.
StatusOr<CommPrepared> CheckComm(const CommConfig& c) {
  CommPrepared p;
  STRATA_RETURN_IF_ERROR(MakeCommunicators(c, p));
  Status local = Status::Ok();
  if (p.host->rank() == 0 && !c.json.empty()) {
    auto json = JsonOutput::Prepare("--json", c.json);
    if (json.ok()) p.json = std::move(*json);
    local = json.status();
  }
  const uint64_t largest = *std::max_element(c.sizes.begin(), c.sizes.end());
  if (local.ok()) {
    local = CheckMemory(
        "the send and receive buffers (2 x the largest --sizes)", 2 * largest);
  }
  float failed = local.ok() ? 0 : 1;
  STRATA_ASSIGN_OR_RETURN(
      CommWork w, p.host->AllReduce(&failed, &failed, 1, CommType::kFloat32,
                                    ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(w.Wait());
  STRATA_RETURN_IF_ERROR(local);
  if (failed != 0) {
    return Status::Aborted("another rank failed its checks (see its message)");
  }
  return p;
}

// ---- Run -------------------------------------------------------------------

// Send and receive buffers of `bytes` each, on the host or the GPU.
struct Buffers {
  HostBuffer host_send, host_recv;
  DeviceMemory dev_send, dev_recv;
  void* send() { return dev_send.empty() ? host_send.data() : dev_send.data(); }
  void* recv() { return dev_recv.empty() ? host_recv.data() : dev_recv.data(); }
};

StatusOr<Buffers> AllocateBuffers(CommPrepared& p, uint64_t bytes) {
  Buffers b;
  if (p.device != nullptr) {
    STRATA_ASSIGN_OR_RETURN(b.dev_send, p.device->Allocate(bytes, *p.stream));
    STRATA_ASSIGN_OR_RETURN(b.dev_recv, p.device->Allocate(bytes, *p.stream));
    STRATA_RETURN_IF_ERROR(
        p.device->MemsetAsync(*p.stream, b.dev_send.data(), 0, bytes));
    return b;
  }
  STRATA_ASSIGN_OR_RETURN(b.host_send, HostBuffer::Allocate(bytes, {}));
  STRATA_ASSIGN_OR_RETURN(b.host_recv, HostBuffer::Allocate(bytes, {}));
  std::memset(b.host_send.data(), 0, bytes);  // zeros: no NaN, no overflow
  return b;
}

// One collective of `bytes` (S, as nccl-tests), waited for.
Status RunOnce(CommPrepared& p, Buffers& b, const std::string& op,
               uint64_t bytes, CommType type) {
  Communicator& comm = p.measured();
  const size_t count = bytes / CommTypeSize(type);
  const std::vector<size_t> counts = ShardCounts(count, comm.size());
  CommPlace place{p.device.get(), p.stream.get()};
  StatusOr<CommWork> w =
      op == "all-gather"
          ? comm.AllGather(b.send(), b.recv(), counts, type, place)
      : op == "reduce-scatter" ? comm.ReduceScatter(b.send(), b.recv(), counts,
                                                    type, ReduceOp::kSum, place)
                               : comm.AllReduce(b.send(), b.recv(), count, type,
                                                ReduceOp::kSum, place);
  if (!w.ok()) return w.status();
  return w->Wait();
}

StatusOr<Row> Measure(const CommConfig& c, CommPrepared& p, Buffers& b,
                      const std::string& op, uint64_t bytes) {
  const CommType type = TypeOf(c.type);
  for (int i = 0; i < c.warmup; ++i) {
    STRATA_RETURN_IF_ERROR(RunOnce(p, b, op, bytes, type));
  }
  STRATA_RETURN_IF_ERROR(p.host->Barrier());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < c.iters; ++i) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    STRATA_RETURN_IF_ERROR(RunOnce(p, b, op, bytes, type));
  }
  float secs = static_cast<float>(SecondsSince(t0));
  STRATA_ASSIGN_OR_RETURN(
      CommWork w,
      p.host->AllReduce(&secs, &secs, 1, CommType::kFloat32, ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(w.Wait());
  const double n = p.measured().size();
  Row r{op, bytes, secs / c.iters};
  r.algbw = static_cast<double>(bytes) / r.seconds / 1e9;
  r.busbw = r.algbw * (op == "all-reduce" ? 2 : 1) * (n - 1) / n;
  return r;
}

StatusOr<std::vector<Row>> RunComm(const CommConfig& c, CommPrepared& p) {
  const uint64_t largest = *std::max_element(c.sizes.begin(), c.sizes.end());
  STRATA_ASSIGN_OR_RETURN(Buffers b, AllocateBuffers(p, largest));
  std::vector<Row> rows;
  Progress progress(c.ops.size() * c.sizes.size());
  for (const std::string& op : c.ops) {
    for (uint64_t bytes : c.sizes) {
      if (p.host->rank() == 0) progress.Step(op + " " + FormatBytes(bytes));
      auto r = Measure(c, p, b, op, bytes);
      if (!r.ok()) return r.status().WithContext(op + " " + FormatBytes(bytes));
      rows.push_back(*r);
    }
  }
  if (p.stream != nullptr) {
    STRATA_RETURN_IF_ERROR(p.device->SynchronizeStream(*p.stream));
  }
  return rows;
}

// ---- Report ----------------------------------------------------------------

Status ReportComm(const CommConfig& c, CommPrepared& p,
                  const std::vector<Row>& rows) {
  if (p.host->rank() != 0) return Status::Ok();
  Communicator& comm = p.measured();
  std::printf("strata-bench comm: %s, %d ranks, %s, %d iterations\n\n",
              std::string(CommBackendName(comm.backend())).c_str(), comm.size(),
              c.type.c_str(), c.iters);
  Table table({"op", "size", "time us", "algbw GB/s", "busbw GB/s"});
  nlohmann::json jr = nlohmann::json::array();
  for (const Row& r : rows) {
    table.AddRow({r.op, FormatBytes(r.bytes), Fixed(r.seconds * 1e6, 1),
                  Fixed(r.algbw, 3), Fixed(r.busbw, 3)});
    jr.push_back({{"op", r.op},
                  {"bytes", r.bytes},
                  {"seconds", r.seconds},
                  {"algbw_gbps", r.algbw},
                  {"busbw_gbps", r.busbw}});
  }
  std::printf("%s", table.ToString().c_str());
  if (!p.json.active()) return Status::Ok();
  nlohmann::json out;
  out["command"] = kCommand;
  out["machine"] = MachineInfo();
  out["ranks"] = comm.size();
  out["config"] = {{"backend", c.backend},    {"ops", c.ops},
                   {"sizes", c.sizes},        {"type", c.type},
                   {"iters", c.iters},        {"warmup", c.warmup},
                   {"timeout_s", c.timeout_s}};
  out["results"] = std::move(jr);
  return p.json.Commit(out);
}

int Main(int argc, char** argv) {
  CLI::App app{"collective bandwidth by message size (run under mpirun)",
               "strata-bench comm"};
  CommFlags flags;
  AddOptions(app, flags);
  CommConfig cfg;
  CommPrepared prepared;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseComm(flags));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(prepared, CheckComm(cfg));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(std::vector<Row> rows, RunComm(cfg, prepared));
        return ReportComm(cfg, prepared, rows);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("comm",
                     "all-gather, reduce-scatter, all-reduce bandwidth (MPI, "
                     "NCCL)",
                     Main);

}  // namespace strata::bench
