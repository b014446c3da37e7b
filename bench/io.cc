// strata-bench io: the NVMe tier's bandwidth for each engine x block size x
// queue depth x read/write x sequential/random, over one O_DIRECT file, beside
// fio's figure for the same pattern on the same file when fio is installed.
//
// Each run moves the whole file once: sequential runs in order, random runs
// visit every block once in a shuffled order (as fio's random map does), with
// queue_depth requests kept in flight. Latency is submit to reap.
//
// Beside fio, each row runs strata, fio, fio, strata and keeps each side's
// best pass, so that drift over the row reaches both alike. fio's buffers are
// on transparent huge pages, as strata's are: a 1 MiB request over 4 KiB
// pages has 256 segments, more than some devices take in one request
// (virtio-blk: 254), and is split in two. The device's mean request size
// during each side's pass, from /proc/diskstats, shows when one was split.
//
// The run holds <dir>/strata-bench-io.lock for its whole length, so two runs
// on one directory never share the test file, and removes the test file on
// every exit path (errors, SIGINT, SIGTERM) unless --keep-file.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/host_buffer.h"
#include "strata/io_engine.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCommand = "io";
constexpr const char* kDataName = "strata-bench-io.dat";
constexpr const char* kLockName = "strata-bench-io.lock";
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kMaxSize = uint64_t{1} << 50;   // 1 PiB
constexpr uint64_t kMaxBlock = uint64_t{1} << 30;  // 1 GiB
constexpr int64_t kMaxQueueDepth = 1024;
// fio's buffers start on a huge-page boundary, and glibc's malloc asks for
// transparent huge pages under them (glibc 2.35 and later; older ones ignore
// the tunable).
constexpr const char* kFioIomemAlign = "--iomem_align=2097152";
constexpr const char* kFioTunable = "glibc.malloc.hugetlb=1";

// The command line as typed; ParseIo turns it into an IoConfig.
struct IoFlags {
  std::string dir = ".";
  std::string size = "1G";
  std::string engines;
  std::string block_sizes = "1M,4M";
  std::string depths = "8,32";
  std::string rw = "read,write";
  std::string pattern = "seq,rand";
  std::string json;
  bool emit_ds = false;
  bool no_fio = false;
  bool keep_file = false;
  bool no_thp = false;
};

struct IoConfig {
  std::string dir;
  uint64_t size = 0;
  std::vector<IoBackend> engines;  // empty: the probe's choice
  std::vector<uint64_t> block_sizes;
  std::vector<uint64_t> queue_depths;
  std::vector<IoOp> ops;
  std::vector<bool> random;
  bool fio_requested = true;
  bool keep_file = false;
  bool huge_pages = true;
  bool emit_ds = false;
  std::string json;
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
  // The device's mean request size (KiB) during strata's and fio's kept
  // passes; < 0 when unknown (no /proc/diskstats line, no requests).
  double device_request_kib = -1;
  double fio_device_request_kib = -1;
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double iops() const {
    return seconds > 0 ? static_cast<double>(bytes / block_size) / seconds : 0;
  }
};

// What the up-front checks found and hold for the run.
struct IoPrepared {
  std::string path;  // the test file
  std::string fio;   // fio's path; empty: not run
  JsonOutput json;
  nlohmann::json filesystem;
};

// The block device whose /proc/diskstats line counts the test file's I/O.
struct StatsDevice {
  unsigned major = 0;
  unsigned minor = 0;
  std::string name;
};

struct IoOutcome {
  std::vector<IoResult> results;
  nlohmann::json probe;               // null unless the probe chose the engine
  std::optional<StatsDevice> device;  // nullopt: not found or not looked for
};

const char* OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

bool UsesDisk(const IoConfig& cfg) {
  return cfg.engines.empty() ||
         std::any_of(cfg.engines.begin(), cfg.engines.end(),
                     [](IoBackend b) { return b != IoBackend::kMemory; });
}

// ---- Parse -----------------------------------------------------------------

void AddOptions(CLI::App& app, IoFlags& f) {
  app.add_option("--dir", f.dir, "Directory for the test file")
      ->capture_default_str();
  app.add_option("--size", f.size,
                 "Test file size, a multiple of 4 KiB and of every block size "
                 "(K/M/G/T suffixes, powers of 1024)")
      ->capture_default_str();
  app.add_option("--engine", f.engines,
                 "Engines: uring,aio,psync,memory (default: the start-up "
                 "probe's choice)");
  app.add_option("--block-size", f.block_sizes,
                 "Block sizes, multiples of 4 KiB up to 1G")
      ->capture_default_str();
  app.add_option("--queue-depth", f.depths, "Queue depths, 1..1024")
      ->capture_default_str();
  app.add_option("--rw", f.rw, "Directions: read,write")->capture_default_str();
  app.add_option("--pattern", f.pattern, "Offsets: seq,rand")
      ->capture_default_str();
  app.add_option("--json", f.json, "Write results as JSON to FILE");
  app.add_flag("--emit-ds-config", f.emit_ds,
               "Print the best sequential read/write settings as a DeepSpeed "
               "\"aio\" block (needs --pattern with seq, --rw read,write)");
  app.add_flag("--no-fio", f.no_fio, "Do not run fio beside strata");
  app.add_flag("--keep-file", f.keep_file, "Keep the test file afterwards");
  app.add_flag("--no-thp", f.no_thp,
               "Back the I/O buffers with 4 KiB pages instead of transparent "
               "huge pages (shows what buffer contiguity is worth)");
}

StatusOr<IoConfig> ParseIo(const IoFlags& f) {
  IoConfig cfg;
  cfg.dir = f.dir;
  if (cfg.dir.empty()) return Status::InvalidArgument("--dir: empty path");
  STRATA_ASSIGN_OR_RETURN(cfg.size,
                          ParseSizeOption("--size", f.size, kAlign, kMaxSize));
  if (cfg.size % kAlign != 0) {
    return Status::InvalidArgument("--size: " + std::to_string(cfg.size) +
                                   " bytes is not a multiple of 4 KiB");
  }
  STRATA_ASSIGN_OR_RETURN(
      cfg.block_sizes,
      ParseSizeListOption("--block-size", f.block_sizes, kAlign, kMaxBlock));
  for (uint64_t bs : cfg.block_sizes) {
    if (bs % kAlign != 0) {
      return Status::InvalidArgument("--block-size: " + std::to_string(bs) +
                                     " bytes is not a multiple of 4 KiB");
    }
    if (bs > cfg.size || cfg.size % bs != 0) {
      return Status::InvalidArgument(
          "--size: " + FormatBytes(cfg.size) +
          " is not a whole number of blocks of " + FormatBytes(bs) +
          " (--block-size); give a multiple of every block size");
    }
  }
  STRATA_ASSIGN_OR_RETURN(
      std::vector<int64_t> qds,
      ParseIntListOption("--queue-depth", f.depths, 1, kMaxQueueDepth));
  cfg.queue_depths.assign(qds.begin(), qds.end());
  STRATA_ASSIGN_OR_RETURN(
      auto rw, ParseChoiceListOption("--rw", f.rw, {"read", "write"}));
  for (const auto& d : rw) {
    cfg.ops.push_back(d == "read" ? IoOp::kRead : IoOp::kWrite);
  }
  STRATA_ASSIGN_OR_RETURN(
      auto pattern,
      ParseChoiceListOption("--pattern", f.pattern, {"seq", "rand"}));
  for (const auto& p : pattern) cfg.random.push_back(p == "rand");
  if (!f.engines.empty()) {
    const std::vector<std::string> names = SplitList(f.engines);
    if (names.empty()) {
      return Status::InvalidArgument("--engine: empty list '" + f.engines +
                                     "' (accepted: uring,aio,psync,memory)");
    }
    for (const auto& e : names) {
      auto b = ParseIoBackend(e);
      if (!b.ok() || *b == IoBackend::kAuto) {
        return Status::InvalidArgument(
            "--engine: '" + e +
            "' is not one of uring,aio,psync,memory (leave --engine out for "
            "the start-up probe's choice)");
      }
      if (std::find(cfg.engines.begin(), cfg.engines.end(), *b) ==
          cfg.engines.end()) {
        cfg.engines.push_back(*b);
      }
    }
  }
  cfg.emit_ds = f.emit_ds;
  if (cfg.emit_ds) {
    const bool seq = std::count(cfg.random.begin(), cfg.random.end(), false);
    const bool both = cfg.ops.size() == 2;
    if (!seq || !both) {
      return Status::InvalidArgument(
          "--emit-ds-config picks the best sequential read and write "
          "settings: it needs 'seq' in --pattern and both read,write in "
          "--rw");
    }
  }
  cfg.fio_requested = !f.no_fio;
  cfg.keep_file = f.keep_file;
  cfg.huge_pages = !f.no_thp;
  cfg.json = f.json;
  return cfg;
}

// ---- Check
// -------------------------------------------------------------------

// Usage errors (the directory or --json path cannot work) come back as
// kInvalidArgument; the rest are failures of this machine or run.
StatusOr<IoPrepared> CheckIo(const IoConfig& cfg, RunGuard& guard) {
  IoPrepared p;
  struct stat st {};
  if (::stat(cfg.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("--dir: " + cfg.dir +
                                   " is not an existing directory");
  }
  p.path = cfg.dir + "/" + kDataName;
  if (!cfg.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.json, JsonOutput::Prepare("--json", cfg.json));
  }
  STRATA_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(cfg.dir, kLockName));
  guard.AdoptLock(std::move(lock));
  p.filesystem = FilesystemInfo(cfg.dir);
  if (UsesDisk(cfg)) {
    // A test file a kept run left counts as space already taken.
    uint64_t have = 0;
    if (::stat(p.path.c_str(), &st) == 0) {
      have = static_cast<uint64_t>(st.st_blocks) * 512;
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t free_bytes, FreeBytes(cfg.dir));
    if (cfg.size > have && cfg.size - have > free_bytes) {
      return Status::NoSpace("--size " + FormatBytes(cfg.size) +
                             " does not fit in " + cfg.dir + ": " +
                             std::to_string(free_bytes) +
                             " bytes are free; give a smaller --size");
    }
  }
  const uint64_t max_qd =
      *std::max_element(cfg.queue_depths.begin(), cfg.queue_depths.end());
  const uint64_t max_bs =
      *std::max_element(cfg.block_sizes.begin(), cfg.block_sizes.end());
  uint64_t memory = max_qd * max_bs;  // <= 2^40: no overflow
  if (std::count(cfg.engines.begin(), cfg.engines.end(), IoBackend::kMemory)) {
    memory += cfg.size;  // the memory engine's file lives in RAM
  }
  STRATA_RETURN_IF_ERROR(CheckMemory(
      "the I/O buffers (largest --queue-depth x largest --block-size)",
      memory));
  if (cfg.fio_requested) p.fio = FindOnPath("fio").value_or("");
  return p;
}

// ---- Device request sizes
// ----------------------------------------------------

// Requests completed and 512-byte sectors moved, per direction, from one
// /proc/diskstats line.
struct DiskCounters {
  uint64_t reads = 0;
  uint64_t read_sectors = 0;
  uint64_t writes = 0;
  uint64_t write_sectors = 0;
};

// The /proc/diskstats line of major:minor (a partition has its own); its
// name and counters, nullopt when there is none.
std::optional<std::pair<std::string, DiskCounters>> DiskStatsLine(
    unsigned major, unsigned minor) {
  std::ifstream in("/proc/diskstats");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    unsigned ma = 0, mi = 0;
    std::string name;
    uint64_t reads = 0, read_merged = 0, read_sectors = 0, read_ms = 0;
    uint64_t writes = 0, write_merged = 0, write_sectors = 0;
    if (!(fields >> ma >> mi >> name >> reads >> read_merged >> read_sectors >>
          read_ms >> writes >> write_merged >> write_sectors)) {
      continue;
    }
    if (ma != major || mi != minor) continue;
    return std::make_pair(
        name, DiskCounters{reads, read_sectors, writes, write_sectors});
  }
  return std::nullopt;
}

// The device holding `path` (its st_dev), when /proc/diskstats counts it:
// not for tmpfs, overlay or other filesystems without a block device of
// their own.
std::optional<StatsDevice> StatsDeviceOf(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  const unsigned ma = major(st.st_dev), mi = minor(st.st_dev);
  auto line = DiskStatsLine(ma, mi);
  if (!line) return std::nullopt;
  return StatsDevice{ma, mi, line->first};
}

std::optional<DiskCounters> ReadCounters(
    const std::optional<StatsDevice>& dev) {
  if (!dev) return std::nullopt;
  auto line = DiskStatsLine(dev->major, dev->minor);
  if (!line) return std::nullopt;
  return line->second;
}

// Mean request size in KiB of `op` between two readings; -1 when either is
// missing or no request of that direction completed.
double MeanRequestKib(const std::optional<DiskCounters>& before,
                      const std::optional<DiskCounters>& after, IoOp op) {
  if (!before || !after) return -1;
  const bool rd = op == IoOp::kRead;
  const uint64_t b_req = rd ? before->reads : before->writes;
  const uint64_t a_req = rd ? after->reads : after->writes;
  const uint64_t b_sec = rd ? before->read_sectors : before->write_sectors;
  const uint64_t a_sec = rd ? after->read_sectors : after->write_sectors;
  if (a_req <= b_req || a_sec < b_sec) return -1;
  return static_cast<double>(a_sec - b_sec) * 512 / 1024 /
         static_cast<double>(a_req - b_req);
}

// ---- Run
// -----------------------------------------------------------------------

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
      if (next < nblocks) {
        // Stop submitting once interrupted; the engine drains the rest.
        STRATA_RETURN_IF_ERROR(CheckInterrupted());
        STRATA_RETURN_IF_ERROR(submit(slot));
      }
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.p50_us = Percentile(lat_us, 50);
  r.p99_us = Percentile(lat_us, 99);
  return r;
}

// fio's --filename takes ':' as a separator between files.
std::string FioFileName(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (c == ':') out += '\\';
    out += c;
  }
  return out;
}

// fio on the same file, pattern, block size and depth: GB/s, or < 0 when
// fio did not give a figure. kAborted when interrupted (fio is killed).
StatusOr<double> RunFio(const std::string& fio, const std::string& path,
                        const IoConfig& cfg, IoBackend engine, IoOp op,
                        bool random, uint64_t bs, uint64_t qd) {
  const std::string rw = std::string(random ? "rand" : "") +
                         (op == IoOp::kRead ? "read" : "write");
  std::vector<std::string> argv = {fio,
                                   "--name=strata",
                                   "--filename=" + FioFileName(path),
                                   "--rw=" + rw,
                                   "--bs=" + std::to_string(bs),
                                   "--direct=1",
                                   "--output-format=json",
                                   "--norandommap=0",
                                   "--randrepeat=0",
                                   "--group_reporting",
                                   kFioIomemAlign};
  switch (engine) {
    case IoBackend::kUring:
      // Registered buffers and files, as strata's io_uring engine uses.
      argv.insert(argv.end(),
                  {"--ioengine=io_uring", "--fixedbufs", "--registerfiles",
                   "--iodepth=" + std::to_string(qd),
                   "--size=" + std::to_string(cfg.size)});
      break;
    case IoBackend::kAio:
      argv.insert(argv.end(),
                  {"--ioengine=libaio", "--iodepth=" + std::to_string(qd),
                   "--size=" + std::to_string(cfg.size)});
      break;
    case IoBackend::kMemory:
      return -1.0;  // nothing on disk to compare with
    default: {
      // A pool of synchronous workers: qd jobs over disjoint slices.
      const uint64_t slice = cfg.size / qd / bs * bs;
      if (slice == 0) return -1.0;
      argv.insert(argv.end(), {"--ioengine=psync", "--thread",
                               "--numjobs=" + std::to_string(qd),
                               "--size=" + std::to_string(slice),
                               "--offset_increment=" + std::to_string(slice)});
      break;
    }
  }
  // Appended to any tunables the user set; a later setting wins.
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  std::string env = "GLIBC_TUNABLES=";
  if (tunables != nullptr && *tunables != '\0') {
    env += std::string(tunables) + ":";
  }
  env += kFioTunable;
  auto child = RunChild(argv, {env});
  if (!child.ok()) {
    if (child.status().code() == StatusCode::kAborted) return child.status();
    return -1.0;
  }
  if (child->exit_code != 0) return -1.0;
  // fio may print warnings before the JSON.
  const size_t brace = child->out.find('{');
  if (brace == std::string::npos) return -1.0;
  auto j = nlohmann::json::parse(child->out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) {
    return -1.0;
  }
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
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    const uint64_t n = std::min(kChunk, size - off);
    STRATA_RETURN_IF_ERROR(engine.WriteAt(file, off, buf.span().subspan(0, n)));
  }
  return engine.Sync(file);
}

StatusOr<IoOutcome> RunIo(IoConfig cfg, const IoPrepared& p, RunGuard& guard) {
  IoOutcome out;
  std::string probe_note;
  if (cfg.engines.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto probe, NewIoEngine({}));
    cfg.engines.push_back(probe->backend());
    out.probe = {{"engine", probe->name()},
                 {"fallback_reason", probe->fallback_reason()}};
    probe_note = "engine: " + std::string(probe->name()) + " (start-up probe" +
                 (probe->fallback_reason().empty()
                      ? std::string(")")
                      : "; " + std::string(probe->fallback_reason()) + ")");
  }
  const uint64_t max_qd =
      *std::max_element(cfg.queue_depths.begin(), cfg.queue_depths.end());
  const uint64_t max_bs =
      *std::max_element(cfg.block_sizes.begin(), cfg.block_sizes.end());
  HostBufferOptions bo;
  bo.huge_pages = cfg.huge_pages;
  STRATA_ASSIGN_OR_RETURN(HostBuffer buf,
                          HostBuffer::Allocate(max_qd * max_bs, bo));
  const size_t runs = cfg.engines.size() * cfg.block_sizes.size() *
                      cfg.queue_depths.size() * cfg.ops.size() *
                      cfg.random.size();
  Progress progress(runs + 1);
  std::printf("strata-bench io: %s file %s, O_DIRECT%s\n",
              FormatBytes(cfg.size).c_str(), p.path.c_str(),
              p.fio.empty() ? " (fio not run)" : ", beside fio");
  if (!probe_note.empty()) std::printf("%s\n", probe_note.c_str());
  std::fflush(stdout);
  if (UsesDisk(cfg) && !cfg.keep_file) guard.RemoveOnExit(p.path);
  bool disk_filled = false;
  bool device_looked_up = false;
  for (IoBackend b : cfg.engines) {
    const bool memory = b == IoBackend::kMemory;
    for (uint64_t qd : cfg.queue_depths) {
      STRATA_RETURN_IF_ERROR(CheckInterrupted());
      IoEngineOptions o;
      o.backend = b;
      o.queue_depth = static_cast<uint32_t>(qd);
      STRATA_ASSIGN_OR_RETURN(auto engine, NewIoEngine(o));
      STRATA_ASSIGN_OR_RETURN(FileId file,
                              engine->Open(p.path, {.create = true}));
      if (!memory && !engine->direct(file)) {
        std::fprintf(stderr,
                     "strata-bench io: %s refuses O_DIRECT; figures are for "
                     "buffered I/O\n",
                     cfg.dir.c_str());
      }
      const std::span<std::byte> whole = buf.span();
      STRATA_RETURN_IF_ERROR(engine->RegisterBuffers({&whole, 1}));
      // The memory engine's file is new with each engine.
      if (memory || !disk_filled) {
        progress.Step("filling the test file");
        STRATA_RETURN_IF_ERROR(engine->Allocate(file, cfg.size));
        STRATA_RETURN_IF_ERROR(FillFile(*engine, file, cfg.size));
        if (!memory) disk_filled = true;
      }
      if (!memory && !device_looked_up) {
        device_looked_up = true;
        out.device = StatsDeviceOf(p.path);
        if (out.device) {
          std::printf(
              "device: %s (%u:%u), request sizes from /proc/diskstats\n",
              out.device->name.c_str(), out.device->major, out.device->minor);
        } else {
          std::printf(
              "device: none in /proc/diskstats for %s; request sizes not "
              "shown\n",
              cfg.dir.c_str());
        }
        std::fflush(stdout);
      }
      // The memory engine moves nothing on a device.
      const std::optional<StatsDevice> device =
          memory ? std::nullopt : out.device;
      const bool with_fio = !p.fio.empty() && !memory;
      for (uint64_t bs : cfg.block_sizes) {
        for (IoOp op : cfg.ops) {
          for (bool rnd : cfg.random) {
            progress.Step(std::string(engine->name()) + " " + OpName(op) +
                          (rnd ? " rand " : " seq ") + FormatBytes(bs) +
                          " qd " + std::to_string(qd));
            // strata, then with fio: fio, fio, strata. Each side keeps its
            // best pass and the device's request size during that pass.
            auto strata_pass = [&]() -> StatusOr<IoResult> {
              const auto before = ReadCounters(device);
              STRATA_ASSIGN_OR_RETURN(
                  IoResult r, RunOne(*engine, file, cfg, op, rnd, bs, qd, buf));
              r.device_request_kib =
                  MeanRequestKib(before, ReadCounters(device), op);
              return r;
            };
            STRATA_ASSIGN_OR_RETURN(IoResult r, strata_pass());
            if (with_fio) {
              for (int pass = 0; pass < 2; ++pass) {
                const auto before = ReadCounters(device);
                STRATA_ASSIGN_OR_RETURN(
                    double gbps,
                    RunFio(p.fio, p.path, cfg, b, op, rnd, bs, qd));
                const double kib =
                    MeanRequestKib(before, ReadCounters(device), op);
                if (gbps > r.fio_gbps) {
                  r.fio_gbps = gbps;
                  r.fio_device_request_kib = kib;
                }
              }
              STRATA_ASSIGN_OR_RETURN(IoResult again, strata_pass());
              if (again.gbps() > r.gbps()) {
                again.fio_gbps = r.fio_gbps;
                again.fio_device_request_kib = r.fio_device_request_kib;
                r = again;
              }
            }
            out.results.push_back(r);
          }
        }
      }
    }
  }
  return out;
}

// ---- Report ----------------------------------------------------------------

nlohmann::json ConfigJson(const IoConfig& cfg, const IoPrepared& p) {
  nlohmann::json engines = nlohmann::json::array();
  for (IoBackend b : cfg.engines) engines.push_back(IoBackendName(b));
  nlohmann::json rw = nlohmann::json::array();
  for (IoOp op : cfg.ops) rw.push_back(OpName(op));
  nlohmann::json pattern = nlohmann::json::array();
  for (bool r : cfg.random) pattern.push_back(r ? "rand" : "seq");
  return {{"dir", cfg.dir},
          {"file", p.path},
          {"size", cfg.size},
          {"engines", engines},  // empty: the start-up probe's choice
          {"block_sizes", cfg.block_sizes},
          {"queue_depths", cfg.queue_depths},
          {"rw", rw},
          {"patterns", pattern},
          {"direct", true},
          {"fio", !p.fio.empty()},
          {"fio_requested", cfg.fio_requested},
          {"fio_huge_pages", !p.fio.empty()},
          {"thp", cfg.huge_pages},
          {"keep_file", cfg.keep_file},
          {"emit_ds_config", cfg.emit_ds}};
}

// DeepSpeed's aio is libaio: prefer its rows. Best = highest harmonic mean
// of sequential read and write GB/s at one block size and depth. null when
// no engine has both rows at one setting.
nlohmann::json BestDsConfig(const std::vector<IoResult>& results,
                            std::string* engine) {
  std::string want = "aio";
  if (std::none_of(results.begin(), results.end(),
                   [&](const IoResult& r) { return r.engine == want; })) {
    want = results.empty() ? "" : results.front().engine;
  }
  double best = -1;
  uint64_t best_bs = 0, best_qd = 0;
  for (const IoResult& rd : results) {
    if (rd.engine != want || rd.op != IoOp::kRead || rd.random) continue;
    for (const IoResult& wr : results) {
      if (wr.engine != want || wr.op != IoOp::kWrite || wr.random ||
          wr.block_size != rd.block_size || wr.queue_depth != rd.queue_depth) {
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
  *engine = want;
  if (best < 0) return nullptr;
  return {{"aio",
           {{"block_size", best_bs},
            {"queue_depth", best_qd},
            {"intra_op_parallelism", 1},
            {"single_submit", false},
            {"overlap_events", true},
            {"use_gds", false}}}};
}

Status ReportIo(const IoConfig& cfg, IoPrepared& p, const IoOutcome& out) {
  Table table({"engine", "op", "pattern", "block", "qd", "GB/s", "IOPS",
               "p50 us", "p99 us", "dev KiB", "fio GB/s", "fio dev KiB",
               "ratio"});
  auto kib = [](double v) { return v > 0 ? Fixed(v, 0) : std::string("-"); };
  nlohmann::json arr = nlohmann::json::array();
  std::vector<RatioFigure> figures;
  for (const IoResult& r : out.results) {
    const bool have_fio = r.fio_gbps > 0;
    const double ratio = have_fio ? r.gbps() / r.fio_gbps : 0;
    if (have_fio) {
      figures.push_back({r.engine + " " + OpName(r.op) +
                             (r.random ? " rand " : " seq ") +
                             FormatBytes(r.block_size) + " qd" +
                             std::to_string(r.queue_depth) + " ratio",
                         ratio});
    }
    table.AddRow({r.engine, OpName(r.op), r.random ? "rand" : "seq",
                  FormatBytes(r.block_size), std::to_string(r.queue_depth),
                  Fixed(r.gbps(), 3), Fixed(r.iops(), 0), Fixed(r.p50_us, 0),
                  Fixed(r.p99_us, 0), kib(r.device_request_kib),
                  have_fio ? Fixed(r.fio_gbps, 3) : "-",
                  have_fio ? kib(r.fio_device_request_kib) : "-",
                  have_fio ? Fixed(ratio, 3) : "-"});
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
    if (r.device_request_kib > 0) {
      j["device_request_kib"] = r.device_request_kib;
    }
    if (have_fio) {
      j["fio_gbps"] = r.fio_gbps;
      j["ratio_to_fio"] = ratio;
      if (r.fio_device_request_kib > 0) {
        j["fio_device_request_kib"] = r.fio_device_request_kib;
      }
    }
    arr.push_back(std::move(j));
  }
  std::printf("%s", table.ToString().c_str());
  PrintAboveOneNote(figures,
                    "fio (the same engine, pattern, block and queue depth)");
  nlohmann::json doc;
  doc["command"] = kCommand;
  doc["machine"] = MachineInfo();
  doc["filesystem"] = p.filesystem;
  if (out.device) {
    doc["filesystem"]["diskstats"] = {{"name", out.device->name},
                                      {"major", out.device->major},
                                      {"minor", out.device->minor}};
  }
  if (!out.probe.is_null()) doc["probe"] = out.probe;
  doc["config"] = ConfigJson(cfg, p);
  doc["results"] = arr;
  if (cfg.emit_ds) {
    std::string engine;
    nlohmann::json aio = BestDsConfig(out.results, &engine);
    if (aio.is_null()) {
      std::printf(
          "\nDeepSpeed config: no sequential read and write rows of "
          "one engine at one setting; none printed\n");
    } else {
      std::printf(
          "\nDeepSpeed config (best sequential read/write of %s):\n%s\n",
          engine.c_str(), aio.dump(2).c_str());
    }
    doc["ds_config"] = aio;
  }
  if (p.json.active()) {
    STRATA_RETURN_IF_ERROR(p.json.Commit(doc));
    std::printf("JSON: %s\n", p.json.path().c_str());
  }
  return Status::Ok();
}

int Run(int argc, char** argv) {
  CLI::App app{
      "strata-bench io: NVMe tier bandwidth per engine, block size, "
      "queue depth and direction, beside fio",
      "strata-bench io"};
  IoFlags flags;
  AddOptions(app, flags);
  IoConfig cfg;
  IoPrepared prepared;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseIo(flags));
        return Status::Ok();
      },
      [&](RunGuard& guard) -> Status {
        STRATA_ASSIGN_OR_RETURN(prepared, CheckIo(cfg, guard));
        return Status::Ok();
      },
      [&](RunGuard& guard) -> Status {
        STRATA_ASSIGN_OR_RETURN(IoOutcome out, RunIo(cfg, prepared, guard));
        return ReportIo(cfg, prepared, out);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("io",
                     "NVMe tier: engine x block size x queue depth, "
                     "beside fio",
                     Run);

}  // namespace strata::bench
