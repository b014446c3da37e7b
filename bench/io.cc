// strata-bench io: the NVMe tier's bandwidth for each engine x block size x
// queue depth x read/write x sequential/random, over one O_DIRECT file, beside
// fio's figure for the same pattern on the same file when fio is installed.
//
// Each run moves the whole file once: sequential runs in order, random runs
// visit every block once in a shuffled order (as fio's random map does), with
// queue_depth requests kept in flight. Latency is submit to reap.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/host_buffer.h"
#include "strata/io_engine.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct IoConfig {
  std::string dir = ".";
  uint64_t size = uint64_t{1} << 30;
  std::vector<IoBackend> engines;  // empty: the probe's choice
  std::vector<uint64_t> block_sizes = {1 << 20, 4 << 20};
  std::vector<uint64_t> queue_depths = {8, 32};
  std::vector<IoOp> ops = {IoOp::kRead, IoOp::kWrite};
  std::vector<bool> random = {false, true};
  bool fio = true;
  bool keep_file = false;
  bool huge_pages = true;
};

struct IoResult {
  std::string engine;
  IoOp op;
  bool random;
  uint64_t block_size;
  uint64_t queue_depth;
  uint64_t bytes = 0;
  double seconds = 0;
  double p50_us = 0;
  double p99_us = 0;
  double fio_gbps = -1;  // < 0: fio not run
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double iops() const {
    return seconds > 0 ? static_cast<double>(bytes / block_size) / seconds : 0;
  }
};

const char* OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

StatusOr<IoResult> RunOne(IoEngine& engine, FileId file, const IoConfig& cfg,
                          IoOp op, bool random, uint64_t bs, uint64_t qd,
                          HostBuffer& buf) {
  IoResult r{std::string(engine.name()), op, random, bs, qd};
  const uint64_t nblocks = cfg.size / bs;
  std::vector<uint64_t> order(nblocks);
  std::iota(order.begin(), order.end(), 0);
  if (random) {
    std::mt19937_64 rng(bs * 31 + qd);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::vector<Clock::time_point> started(qd);
  std::vector<double> lat_us;
  lat_us.reserve(nblocks);
  std::vector<IoCompletion> done(qd);
  uint64_t next = 0;
  auto submit = [&](uint64_t slot) -> Status {
    IoRequest req{file, order[next] * bs, buf.span().subspan(slot * bs, bs), op,
                  slot};
    ++next;
    started[slot] = Clock::now();
    return engine.Submit({&req, 1});
  };
  const auto t0 = Clock::now();
  for (uint64_t s = 0; s < qd && next < nblocks; ++s) {
    STRATA_RETURN_IF_ERROR(submit(s));
  }
  while (engine.in_flight() > 0) {
    STRATA_ASSIGN_OR_RETURN(size_t n, engine.Reap(done, 1));
    const auto now = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(done[i].status);
      const uint64_t slot = done[i].tag;
      lat_us.push_back(
          std::chrono::duration<double, std::micro>(now - started[slot])
              .count());
      r.bytes += bs;
      if (next < nblocks) STRATA_RETURN_IF_ERROR(submit(slot));
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.p50_us = Percentile(lat_us, 50);
  r.p99_us = Percentile(lat_us, 99);
  return r;
}

bool HaveFio() { return std::system("command -v fio >/dev/null 2>&1") == 0; }

// fio on the same file, pattern, block size and depth. Returns GB/s or < 0.
double RunFio(const std::string& path, const IoConfig& cfg, IoBackend engine,
              IoOp op, bool random, uint64_t bs, uint64_t qd) {
  std::string rw = std::string(random ? "rand" : "") +
                   (op == IoOp::kRead ? "read" : "write");
  std::string cmd = "fio --name=strata --filename=" + path + " --rw=" + rw +
                    " --bs=" + std::to_string(bs) +
                    " --direct=1 --output-format=json --norandommap=0"
                    " --randrepeat=0 --group_reporting";
  switch (engine) {
    case IoBackend::kUring:
      // Registered buffers and files, as strata's io_uring engine uses.
      cmd += " --ioengine=io_uring --fixedbufs --registerfiles --iodepth=" +
             std::to_string(qd) + " --size=" + std::to_string(cfg.size);
      break;
    case IoBackend::kAio:
      cmd += " --ioengine=libaio --iodepth=" + std::to_string(qd) +
             " --size=" + std::to_string(cfg.size);
      break;
    default: {
      // A pool of synchronous workers: qd jobs over disjoint slices.
      const uint64_t slice = cfg.size / qd / bs * bs;
      if (slice == 0) return -1;
      cmd += " --ioengine=psync --thread --numjobs=" + std::to_string(qd) +
             " --size=" + std::to_string(slice) +
             " --offset_increment=" + std::to_string(slice);
      break;
    }
  }
  cmd += " 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, p)) > 0) out.append(chunk, n);
  if (::pclose(p) != 0) return -1;
  // fio may print warnings before the JSON.
  const size_t brace = out.find('{');
  if (brace == std::string::npos) return -1;
  auto j = nlohmann::json::parse(out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) return -1;
  const auto& job = j["jobs"][0][op == IoOp::kRead ? "read" : "write"];
  return job.value("bw_bytes", 0.0) / 1e9;
}

Status FillFile(IoEngine& engine, FileId file, uint64_t size) {
  constexpr uint64_t kChunk = 4 << 20;
  STRATA_ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(kChunk));
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= buf.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(buf.data() + i, &v, 8);
  }
  for (uint64_t off = 0; off < size; off += kChunk) {
    const uint64_t n = std::min(kChunk, size - off);
    STRATA_RETURN_IF_ERROR(engine.WriteAt(file, off, buf.span().subspan(0, n)));
  }
  return engine.Sync(file);
}

int Run(int argc, char** argv) {
  CLI::App app{
      "strata-bench io: NVMe tier bandwidth per engine, block size, "
      "queue depth and direction, beside fio",
      "strata-bench io"};
  IoConfig cfg;
  std::string size = "1G", engines, block_sizes = "1M,4M", depths = "8,32",
              rw = "read,write", pattern = "seq,rand", json;
  bool emit_ds = false, no_fio = false;
  app.add_option("--dir", cfg.dir, "Directory for the test file")
      ->capture_default_str();
  app.add_option("--size", size, "Test file size (K/M/G suffixes)")
      ->capture_default_str();
  app.add_option("--engine", engines,
                 "Engines: uring,aio,psync (default: the start-up probe's "
                 "choice)");
  app.add_option("--block-size", block_sizes, "Block sizes")
      ->capture_default_str();
  app.add_option("--queue-depth", depths, "Queue depths")
      ->capture_default_str();
  app.add_option("--rw", rw, "Directions: read,write")->capture_default_str();
  app.add_option("--pattern", pattern, "Offsets: seq,rand")
      ->capture_default_str();
  app.add_option("--json", json, "Write results as JSON to FILE");
  app.add_flag("--emit-ds-config", emit_ds,
               "Print the best settings as a DeepSpeed \"aio\" block");
  app.add_flag("--no-fio", no_fio, "Do not run fio beside strata");
  app.add_flag("--keep-file", cfg.keep_file, "Keep the test file afterwards");
  bool no_thp = false;
  app.add_flag("--no-thp", no_thp,
               "Back the I/O buffers with 4 KiB pages instead of transparent "
               "huge pages (shows what buffer contiguity is worth)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const Status& s) { return Fail("strata-bench io", s); };
  auto sz = ParseSize(size);
  if (!sz.ok()) return fail(sz.status());
  cfg.size = *sz;
  auto bss = ParseSizeList(block_sizes);
  if (!bss.ok()) return fail(bss.status());
  cfg.block_sizes = *bss;
  auto qds = ParseSizeList(depths);
  if (!qds.ok()) return fail(qds.status());
  cfg.queue_depths = *qds;
  cfg.ops.clear();
  for (const auto& d : SplitList(rw)) {
    if (d == "read") {
      cfg.ops.push_back(IoOp::kRead);
    } else if (d == "write") {
      cfg.ops.push_back(IoOp::kWrite);
    } else {
      return fail(Status::InvalidArgument("--rw takes read,write, not " + d));
    }
  }
  cfg.random.clear();
  for (const auto& p : SplitList(pattern)) {
    if (p != "seq" && p != "rand") {
      return fail(Status::InvalidArgument("--pattern takes seq,rand"));
    }
    cfg.random.push_back(p == "rand");
  }
  for (const auto& e : SplitList(engines)) {
    auto b = ParseIoBackend(e);
    if (!b.ok()) return fail(b.status());
    cfg.engines.push_back(*b);
  }
  for (uint64_t bs : cfg.block_sizes) {
    if (bs == 0 || bs % 4096 != 0 || bs > cfg.size) {
      return fail(Status::InvalidArgument(
          "block sizes must be multiples of 4 KiB no larger than --size"));
    }
  }
  for (uint64_t qd : cfg.queue_depths) {
    if (qd == 0 || qd > 1024) {
      return fail(Status::InvalidArgument("queue depths must be 1..1024"));
    }
  }
  cfg.fio = !no_fio && HaveFio();
  cfg.huge_pages = !no_thp;

  nlohmann::json doc;
  doc["tool"] = "strata-bench io";
  doc["machine"] = MachineInfo();
  doc["filesystem"] = FilesystemInfo(cfg.dir);
  std::string probe_note;
  if (cfg.engines.empty()) {
    auto probe = NewIoEngine({});
    if (!probe.ok()) return fail(probe.status());
    cfg.engines.push_back((*probe)->backend());
    doc["probe"] = {{"engine", (*probe)->name()},
                    {"fallback_reason", (*probe)->fallback_reason()}};
    probe_note = "engine: " + std::string((*probe)->name()) +
                 " (start-up probe" +
                 ((*probe)->fallback_reason().empty()
                      ? std::string(")")
                      : "; " + std::string((*probe)->fallback_reason()) + ")");
  }
  const std::string path = cfg.dir + "/strata-bench-io.dat";
  std::vector<IoResult> results;
  uint64_t max_qd =
      *std::max_element(cfg.queue_depths.begin(), cfg.queue_depths.end());
  uint64_t max_bs =
      *std::max_element(cfg.block_sizes.begin(), cfg.block_sizes.end());
  HostBufferOptions bo;
  bo.huge_pages = cfg.huge_pages;
  auto buf = HostBuffer::Allocate(max_qd * max_bs, bo);
  if (!buf.ok()) return fail(buf.status());
  const size_t runs = cfg.engines.size() * cfg.block_sizes.size() *
                      cfg.queue_depths.size() * cfg.ops.size() *
                      cfg.random.size();
  Progress progress(runs + 1);
  std::printf("strata-bench io: %s file %s, O_DIRECT%s\n",
              FormatBytes(cfg.size).c_str(), path.c_str(),
              cfg.fio ? ", beside fio" : " (fio not run)");
  if (!probe_note.empty()) std::printf("%s\n", probe_note.c_str());
  bool filled = false;
  for (IoBackend b : cfg.engines) {
    for (uint64_t qd : cfg.queue_depths) {
      IoEngineOptions o;
      o.backend = b;
      o.queue_depth = static_cast<uint32_t>(qd);
      auto engine = NewIoEngine(o);
      if (!engine.ok()) return fail(engine.status());
      auto file = (*engine)->Open(path, {.create = true});
      if (!file.ok()) return fail(file.status());
      if (!(*engine)->direct(*file)) {
        std::fprintf(stderr,
                     "strata-bench io: %s refuses O_DIRECT; figures are for "
                     "buffered I/O\n",
                     cfg.dir.c_str());
      }
      const std::span<std::byte> whole = buf->span();
      if (Status s = (*engine)->RegisterBuffers({&whole, 1}); !s.ok()) {
        return fail(s);
      }
      if (!filled) {
        progress.Step("filling the test file");
        if (Status s = (*engine)->Allocate(*file, cfg.size); !s.ok()) {
          return fail(s);
        }
        if (Status s = FillFile(**engine, *file, cfg.size); !s.ok()) {
          return fail(s);
        }
        filled = true;
      }
      for (uint64_t bs : cfg.block_sizes) {
        for (IoOp op : cfg.ops) {
          for (bool rnd : cfg.random) {
            progress.Step(std::string((*engine)->name()) + " " + OpName(op) +
                          (rnd ? " rand " : " seq ") + FormatBytes(bs) +
                          " qd " + std::to_string(qd));
            auto r = RunOne(**engine, *file, cfg, op, rnd, bs, qd, *buf);
            if (!r.ok()) return fail(r.status());
            if (cfg.fio) {
              r->fio_gbps = RunFio(path, cfg, b, op, rnd, bs, qd);
            }
            results.push_back(*r);
          }
        }
      }
    }
  }
  if (!cfg.keep_file) std::filesystem::remove(path);

  Table table({"engine", "op", "pattern", "block", "qd", "GB/s", "IOPS",
               "p50 us", "p99 us", "fio GB/s", "ratio"});
  nlohmann::json arr = nlohmann::json::array();
  for (const IoResult& r : results) {
    const bool have_fio = r.fio_gbps > 0;
    table.AddRow({r.engine, OpName(r.op), r.random ? "rand" : "seq",
                  FormatBytes(r.block_size), std::to_string(r.queue_depth),
                  Fixed(r.gbps(), 3), Fixed(r.iops(), 0), Fixed(r.p50_us, 0),
                  Fixed(r.p99_us, 0), have_fio ? Fixed(r.fio_gbps, 3) : "-",
                  have_fio ? Fixed(r.gbps() / r.fio_gbps, 3) : "-"});
    nlohmann::json j = {{"engine", r.engine},
                        {"op", OpName(r.op)},
                        {"pattern", r.random ? "rand" : "seq"},
                        {"block_size", r.block_size},
                        {"queue_depth", r.queue_depth},
                        {"bytes", r.bytes},
                        {"seconds", r.seconds},
                        {"gbps", r.gbps()},
                        {"gibps", r.gbps() * 1e9 / (1u << 30)},
                        {"iops", r.iops()},
                        {"lat_p50_us", r.p50_us},
                        {"lat_p99_us", r.p99_us}};
    if (have_fio) {
      j["fio_gbps"] = r.fio_gbps;
      j["ratio_to_fio"] = r.gbps() / r.fio_gbps;
    }
    arr.push_back(std::move(j));
  }
  std::printf("%s", table.ToString().c_str());
  doc["config"] = {
      {"dir", cfg.dir}, {"size", cfg.size}, {"direct", true}, {"fio", cfg.fio}};
  doc["results"] = arr;

  if (emit_ds) {
    // DeepSpeed's aio is libaio: prefer its rows. Best = highest harmonic
    // mean of sequential read and write GB/s at one block size and depth.
    std::string want = "aio";
    if (std::none_of(results.begin(), results.end(),
                     [&](const IoResult& r) { return r.engine == want; })) {
      want = results.empty() ? "" : results.front().engine;
    }
    double best = -1;
    uint64_t best_bs = 1 << 20, best_qd = 8;
    for (const IoResult& rd : results) {
      if (rd.engine != want || rd.op != IoOp::kRead || rd.random) continue;
      for (const IoResult& wr : results) {
        if (wr.engine != want || wr.op != IoOp::kWrite || wr.random ||
            wr.block_size != rd.block_size ||
            wr.queue_depth != rd.queue_depth) {
          continue;
        }
        const double h = 2 / (1 / rd.gbps() + 1 / wr.gbps());
        if (h > best) {
          best = h;
          best_bs = rd.block_size;
          best_qd = rd.queue_depth;
        }
      }
    }
    nlohmann::json aio = {{"aio",
                           {{"block_size", best_bs},
                            {"queue_depth", best_qd},
                            {"intra_op_parallelism", 1},
                            {"single_submit", false},
                            {"overlap_events", true},
                            {"use_gds", false}}}};
    std::printf("\nDeepSpeed config (best sequential read/write of %s):\n%s\n",
                want.c_str(), aio.dump(2).c_str());
    doc["ds_config"] = aio;
  }
  if (!json.empty()) {
    if (Status s = WriteJson(json, doc); !s.ok()) return fail(s);
    std::printf("JSON: %s\n", json.c_str());
  }
  return 0;
}

}  // namespace

STRATA_BENCH_COMMAND("io",
                     "NVMe tier: engine x block size x queue depth, "
                     "beside fio",
                     Run);

}  // namespace strata::bench
