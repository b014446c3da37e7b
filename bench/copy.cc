// strata-bench copy: host<->device bandwidth through the Device interface.
//
// For every size (4 KiB .. 1 GiB by default), host memory kind (pinned =
// registered with the device, pageable = plain) and direction (h2d, d2h, and
// both at once on two copy streams), it warms up, then enqueues N copies and
// synchronizes once, with N chosen so a run lasts at least --min-time: the
// GB/s (1e9 bytes/s) is throughput with the copies pipelined, as the engine's
// prefetcher runs them. Single synchronized copies give the latency
// percentiles. On a CUDA device the same buffers are also copied by a plain
// cudaMemcpyAsync loop (bench/raw_copy.h) and the ratio is reported.
//
// With no GPU it runs on the host-emulated device, whose link is throttled to
// --link-gbps (PCIe Gen4 x16 by default): the figures then check the
// emulation and the overhead of the Device path, not hardware.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/raw_copy.h"
#include "strata/device.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCommand = "copy";
constexpr uint64_t kMaxCopy = uint64_t{1} << 40;  // 1 TiB

// The command line as typed; ParseCopy turns it into a Config.
struct CopyFlags {
  std::string device = "auto";
  std::string sizes = "4K,64K,1M,16M,64M,256M,1G";
  std::string directions = "h2d,d2h,both";
  std::string memory = "pinned,pageable";
  std::string min_time = "0.2";
  std::string warmup = "2";
  std::string link_gbps = "25";
  std::string pageable_gbps = "12";
  std::string latency_us = "5";
  std::string json;
};

struct Config {
  std::string device = "auto";
  std::vector<uint64_t> sizes;
  std::vector<std::string> directions;
  std::vector<std::string> memory;
  double min_time_s = 0.2;
  int warmup = 2;
  int latency_samples = 20;
  double link_gbps = 25;      // host-emulated only
  double pageable_gbps = 12;  // host-emulated only
  double latency_us = 5;      // host-emulated only
  std::string json;

  uint64_t max_size() const {
    return *std::max_element(sizes.begin(), sizes.end());
  }
};

struct Buffers {
  HostBuffer in;   // h2d source
  HostBuffer out;  // d2h destination
  DeviceMemory dev_in;
  DeviceMemory dev_out;
};

struct Result {
  std::string direction;
  uint64_t bytes = 0;  // per copy
  bool pinned = false;
  int iterations = 0;
  double seconds = 0;
  double gbps = 0;
  double p50_us = 0;
  double p99_us = 0;
  double baseline_gbps = 0;  // 0 = not measured
};

class CopyBench {
 public:
  CopyBench(Device& device, int cuda_ordinal, Stream& up, Stream& down)
      : device_(device), cuda_ordinal_(cuda_ordinal), up_(up), down_(down) {}

  // Enqueues `iterations` rounds of the direction's copies, then waits.
  Status Run(Buffers& b, const std::string& dir, uint64_t bytes,
             int iterations) {
    for (int i = 0; i < iterations; ++i) {
      if (i % 64 == 0) STRATA_RETURN_IF_ERROR(CheckInterrupted());
      if (dir != "d2h") {
        STRATA_RETURN_IF_ERROR(device_.CopyAsync(
            up_, b.dev_in.data(), b.in.data(), bytes, CopyKind::kHostToDevice));
      }
      if (dir != "h2d") {
        STRATA_RETURN_IF_ERROR(device_.CopyAsync(down_, b.out.data(),
                                                 b.dev_out.data(), bytes,
                                                 CopyKind::kDeviceToHost));
      }
    }
    STRATA_RETURN_IF_ERROR(device_.SynchronizeStream(up_));
    return device_.SynchronizeStream(down_);
  }

  StatusOr<Result> Measure(Buffers& b, const std::string& dir, uint64_t bytes,
                           bool pinned, const Config& cfg) {
    Result r;
    r.direction = dir;
    r.bytes = bytes;
    r.pinned = pinned;
    const uint64_t moved = dir == "both" ? 2 * bytes : bytes;
    STRATA_RETURN_IF_ERROR(Run(b, dir, bytes, cfg.warmup));
    // Latency of single synchronized rounds; also sizes the timed run.
    std::vector<double> lat;
    for (int i = 0; i < cfg.latency_samples; ++i) {
      const auto t = Clock::now();
      STRATA_RETURN_IF_ERROR(Run(b, dir, bytes, 1));
      lat.push_back(SecondsSince(t) * 1e6);
      if (SecondsSince(t) * (i + 1) > cfg.min_time_s) break;
    }
    const double one_s = Percentile(lat, 50) / 1e6;
    r.p50_us = Percentile(lat, 50);
    r.p99_us = Percentile(lat, 99);
    r.iterations = static_cast<int>(
        std::clamp(cfg.min_time_s / std::max(one_s, 1e-7), 3.0, 100000.0));
    const auto t = Clock::now();
    STRATA_RETURN_IF_ERROR(Run(b, dir, bytes, r.iterations));
    r.seconds = SecondsSince(t);
    r.gbps = static_cast<double>(moved) * r.iterations / r.seconds / 1e9;
    if (device_.kind() == DeviceKind::kCuda) {
      std::vector<RawCopy> copies;
      if (dir != "d2h") {
        copies.push_back(
            {b.dev_in.data(), b.in.data(), bytes, CopyKind::kHostToDevice});
      }
      if (dir != "h2d") {
        copies.push_back(
            {b.out.data(), b.dev_out.data(), bytes, CopyKind::kDeviceToHost});
      }
      STRATA_ASSIGN_OR_RETURN(
          double raw_s, TimeRawCudaCopies(cuda_ordinal_, copies, r.iterations));
      r.baseline_gbps = static_cast<double>(moved) * r.iterations / raw_s / 1e9;
    }
    return r;
  }

 private:
  Device& device_;
  int cuda_ordinal_;
  Stream& up_;
  Stream& down_;
};

// The targets, judged on this run's rows: on a GPU, pinned h2d and
// d2h at least 0.9 of the plain cudaMemcpyAsync figure from 64 MiB up; on
// any device, pinned copies in both directions at once moving more bytes per
// second than either alone (pageable ones cannot overlap: a pageable d2h
// returns only when done). A target with no rows to judge says so.
nlohmann::json CheckTargets(const std::vector<Result>& results, bool emulated) {
  nlohmann::json out = nlohmann::json::array();
  if (!emulated) {
    double worst = 0;
    uint64_t worst_bytes = 0;
    std::string worst_dir;
    int judged = 0;
    for (const Result& r : results) {
      if (!r.pinned || r.bytes < (64u << 20) || r.direction == "both" ||
          r.baseline_gbps <= 0) {
        continue;
      }
      const double ratio = r.gbps / r.baseline_gbps;
      if (judged++ == 0 || ratio < worst) {
        worst = ratio;
        worst_bytes = r.bytes;
        worst_dir = r.direction;
      }
    }
    nlohmann::json t = {
        {"target", "pinned h2d and d2h >= 0.9 x cudaMemcpyAsync from 64 MiB"},
        {"rows", judged}};
    if (judged == 0) {
      t["met"] = nullptr;
      t["verdict"] = "not judged (no pinned h2d/d2h row of 64 MiB or more)";
    } else {
      t["met"] = worst >= 0.9;
      t["worst_ratio"] = worst;
      t["verdict"] = std::string(worst >= 0.9 ? "met" : "NOT met") +
                     " (lowest ratio " + Fixed(worst, 3) + ", " + worst_dir +
                     " " + FormatBytes(worst_bytes) + ")";
    }
    out.push_back(std::move(t));
  }
  {
    const bool pinned = true;
    std::vector<std::string> slower;
    int judged = 0;
    for (const Result& both : results) {
      if (both.pinned != pinned || both.direction != "both") continue;
      double single = 0;
      int found = 0;
      for (const Result& r : results) {
        if (r.pinned == pinned && r.bytes == both.bytes &&
            r.direction != "both") {
          single = std::max(single, r.gbps);
          ++found;
        }
      }
      if (found < 2) continue;
      ++judged;
      if (both.gbps <= single) slower.push_back(FormatBytes(both.bytes));
    }
    nlohmann::json t = {
        {"target", "pinned both directions at once faster than either alone"},
        {"rows", judged}};
    if (judged == 0) {
      t["met"] = nullptr;
      t["verdict"] = "not judged (needs h2d, d2h and both at one size)";
    } else {
      t["met"] = slower.empty();
      std::string sizes;
      for (const auto& s : slower) sizes += (sizes.empty() ? "" : ", ") + s;
      t["verdict"] =
          slower.empty() ? "met at every size" : "NOT met at " + sizes;
    }
    out.push_back(std::move(t));
  }
  return out;
}

// ---- Parse -----------------------------------------------------------------

void AddOptions(CLI::App& app, CopyFlags& f) {
  AddDeviceOption(app, f.device);
  app.add_option("--sizes", f.sizes,
                 "bytes per copy, comma-separated, 1 B..1T (K/M/G/T suffixes)")
      ->capture_default_str();
  app.add_option("--directions", f.directions, "h2d, d2h, both")
      ->capture_default_str();
  app.add_option("--memory", f.memory, "pinned, pageable")
      ->capture_default_str();
  app.add_option("--min-time", f.min_time,
                 "seconds per timed run, > 0 and <= 3600")
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "untimed rounds first, 0..1000")
      ->capture_default_str();
  app.add_option("--link-gbps", f.link_gbps,
                 "host-emulated link, GB/s per direction (pinned), > 0 and "
                 "<= 10000")
      ->capture_default_str();
  app.add_option("--pageable-gbps", f.pageable_gbps,
                 "host-emulated link for pageable memory, GB/s, > 0 and <= "
                 "10000")
      ->capture_default_str();
  app.add_option("--latency-us", f.latency_us,
                 "host-emulated fixed cost per copy, microseconds, 0..1000000")
      ->capture_default_str();
  app.add_option("--json", f.json, "also write the results here");
}

StatusOr<Config> ParseCopy(const CopyFlags& f) {
  Config cfg;
  STRATA_ASSIGN_OR_RETURN(cfg.device, ParseDeviceOption(f.device));
  STRATA_ASSIGN_OR_RETURN(cfg.sizes,
                          ParseSizeListOption("--sizes", f.sizes, 1, kMaxCopy));
  STRATA_ASSIGN_OR_RETURN(cfg.directions,
                          ParseChoiceListOption("--directions", f.directions,
                                                {"h2d", "d2h", "both"}));
  STRATA_ASSIGN_OR_RETURN(
      cfg.memory,
      ParseChoiceListOption("--memory", f.memory, {"pinned", "pageable"}));
  STRATA_ASSIGN_OR_RETURN(
      cfg.min_time_s,
      ParseDoubleOption("--min-time", f.min_time, 0, 3600, true));
  STRATA_ASSIGN_OR_RETURN(int64_t warmup,
                          ParseIntOption("--warmup", f.warmup, 0, 1000));
  cfg.warmup = static_cast<int>(warmup);
  STRATA_ASSIGN_OR_RETURN(
      cfg.link_gbps,
      ParseDoubleOption("--link-gbps", f.link_gbps, 0, 10000, true));
  STRATA_ASSIGN_OR_RETURN(
      cfg.pageable_gbps,
      ParseDoubleOption("--pageable-gbps", f.pageable_gbps, 0, 10000, true));
  STRATA_ASSIGN_OR_RETURN(
      cfg.latency_us, ParseDoubleOption("--latency-us", f.latency_us, 0, 1e6));
  cfg.json = f.json;
  return cfg;
}

// ---- Check -----------------------------------------------------------------

struct CopyPrepared {
  JsonOutput json;
  DeviceOptions options;
  std::unique_ptr<Device> device;
  std::string why;
};

// Usage errors come back as kInvalidArgument.
StatusOr<CopyPrepared> CheckCopy(const Config& cfg) {
  CopyPrepared p;
  if (!cfg.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.json, JsonOutput::Prepare("--json", cfg.json));
  }
  const uint64_t max_size = cfg.max_size();
  DeviceOptions& opts = p.options;
  opts.choice = DeviceChoiceOf(cfg.device);
  // Room for the two device buffers and no more, on either backend: CUDA's
  // default (all free memory but a reserve) would starve anything else on the
  // GPU for no gain.
  opts.memory_budget_bytes = 2 * max_size + (1 << 20);
  opts.emulated_link_bytes_per_s = static_cast<uint64_t>(cfg.link_gbps * 1e9);
  opts.emulated_pageable_bytes_per_s =
      static_cast<uint64_t>(cfg.pageable_gbps * 1e9);
  opts.emulated_copy_latency_ns = static_cast<uint64_t>(cfg.latency_us * 1e3);
  // Host memory: an in and an out buffer per memory kind, and on the
  // host-emulated device its two "device" buffers as well. Checked before
  // the device is made, counting the emulated buffers unless --device cuda.
  uint64_t host = 2 * max_size * cfg.memory.size();
  if (opts.choice != DeviceChoice::kCuda) host += 2 * max_size;
  STRATA_RETURN_IF_ERROR(CheckMemory(
      "the copy buffers (2 x the largest --sizes per --memory kind, and 2 "
      "more on the host-emulated device)",
      host));
  // A bad STRATA_DEVICE comes back as kInvalidArgument: a usage error like
  // a bad --device.
  STRATA_ASSIGN_OR_RETURN(p.device, NewDevice(opts, &p.why));
  return p;
}

// ---- Run -------------------------------------------------------------------

StatusOr<std::vector<Result>> RunCopy(const Config& cfg, CopyPrepared& p) {
  Device& device = *p.device;
  const bool emulated = device.kind() == DeviceKind::kHostEmulated;
  const uint64_t max_size = cfg.max_size();
  std::string sizes;
  for (uint64_t s : cfg.sizes) {
    sizes += (sizes.empty() ? "" : ",") + FormatBytes(s);
  }
  std::string dirs, mems;
  for (const auto& d : cfg.directions) dirs += (dirs.empty() ? "" : ",") + d;
  for (const auto& m : cfg.memory) mems += (mems.empty() ? "" : ",") + m;
  std::printf("strata-bench copy\n  device: %s\n  chosen: %s\n",
              device.name().c_str(), p.why.c_str());
  if (emulated) {
    std::printf(
        "  NOTE: no GPU in use; this is the host-emulated device with a "
        "link of %.1f GB/s pinned, %.1f GB/s pageable, %.1f us per copy\n",
        cfg.link_gbps, cfg.pageable_gbps, cfg.latency_us);
  }
  std::printf("  sizes: %s  directions: %s  memory: %s  min-time: %.2f s\n\n",
              sizes.c_str(), dirs.c_str(), mems.c_str(), cfg.min_time_s);
  std::fflush(stdout);

  STRATA_ASSIGN_OR_RETURN(auto up, device.NewStream({StreamKind::kCopy}));
  STRATA_ASSIGN_OR_RETURN(auto down, device.NewStream({StreamKind::kCopy}));
  std::vector<Result> results;
  Buffers pinned, pageable;
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dev_in, device.Allocate(max_size, *up));
  STRATA_ASSIGN_OR_RETURN(DeviceMemory dev_out,
                          device.Allocate(max_size, *down));
  HostBufferOptions plain;
  plain.pin = false;
  plain.prefault = true;
  for (const auto& m : cfg.memory) {
    Buffers& b = m == "pinned" ? pinned : pageable;
    for (HostBuffer* h : {&b.in, &b.out}) {
      auto buf = m == "pinned" ? device.AllocatePinnedHost(max_size, {})
                               : HostBuffer::Allocate(max_size, plain);
      if (!buf.ok()) return buf.status().WithContext(m + " host memory");
      *h = std::move(*buf);
    }
    std::memset(b.in.data(), 0x5a, max_size);
  }
  // Declared after every buffer, so destroyed first: on any return, the
  // copies still queued finish before the memory they touch goes.
  struct DrainOnExit {
    Device& device;
    Stream& a;
    Stream& b;
    ~DrainOnExit() {
      device.SynchronizeStream(a).IgnoreError();
      device.SynchronizeStream(b).IgnoreError();
    }
  } drain{device, *up, *down};
  // Both kinds share the device buffers, moved in and out of each.
  CopyBench bench(device, p.options.cuda_ordinal, *up, *down);
  Progress progress(cfg.memory.size() * cfg.directions.size() *
                    cfg.sizes.size());
  for (const auto& m : cfg.memory) {
    Buffers& b = m == "pinned" ? pinned : pageable;
    b.dev_in = std::move(dev_in);
    b.dev_out = std::move(dev_out);
    for (const auto& d : cfg.directions) {
      for (uint64_t size : cfg.sizes) {
        STRATA_RETURN_IF_ERROR(CheckInterrupted());
        progress.Step(m + " " + d + " " + FormatBytes(size));
        auto r = bench.Measure(b, d, size, m == "pinned", cfg);
        if (!r.ok()) {
          return r.status().WithContext(m + " " + d + " " + FormatBytes(size));
        }
        results.push_back(*r);
      }
    }
    dev_in = std::move(b.dev_in);
    dev_out = std::move(b.dev_out);
  }
  return results;
}

// ---- Report ----------------------------------------------------------------

Status ReportCopy(const Config& cfg, CopyPrepared& p,
                  const std::vector<Result>& results) {
  const Device& device = *p.device;
  const bool emulated = device.kind() == DeviceKind::kHostEmulated;
  std::vector<std::string> header = {"memory", "direction", "size",  "iters",
                                     "GB/s",   "p50 us",    "p99 us"};
  if (!emulated) {
    header.push_back("cudaMemcpyAsync GB/s");
    header.push_back("ratio");
  }
  Table table(header);
  nlohmann::json jr = nlohmann::json::array();
  std::vector<RatioFigure> figures;
  for (const Result& r : results) {
    std::vector<std::string> row = {r.pinned ? "pinned" : "pageable",
                                    r.direction,
                                    FormatBytes(r.bytes),
                                    std::to_string(r.iterations),
                                    Fixed(r.gbps, 2),
                                    Fixed(r.p50_us, 1),
                                    Fixed(r.p99_us, 1)};
    nlohmann::json j = {
        {"direction", r.direction},   {"bytes", r.bytes},
        {"pinned", r.pinned},         {"gbps", r.gbps},
        {"iterations", r.iterations}, {"seconds", r.seconds},
        {"latency_p50_us", r.p50_us}, {"latency_p99_us", r.p99_us}};
    if (!emulated) {
      const double ratio = r.gbps / r.baseline_gbps;
      row.push_back(Fixed(r.baseline_gbps, 2));
      row.push_back(Fixed(ratio, 3));
      j["baseline_cuda_memcpy_async_gbps"] = r.baseline_gbps;
      j["ratio_to_baseline"] = ratio;
      figures.push_back({std::string(r.pinned ? "pinned " : "pageable ") +
                             r.direction + " " + FormatBytes(r.bytes) +
                             " ratio",
                         ratio});
    }
    table.AddRow(std::move(row));
    jr.push_back(std::move(j));
  }
  std::printf("%s", table.ToString().c_str());
  PrintAboveOneNote(figures, "the cudaMemcpyAsync loop of the same copies");
  const nlohmann::json targets = CheckTargets(results, emulated);
  for (const auto& t : targets) {
    std::printf("%s: %s\n", t["target"].get<std::string>().c_str(),
                t["verdict"].get<std::string>().c_str());
  }
  if (emulated) {
    std::printf(
        "\n(host-emulated device: GB/s reflects the configured link, not a "
        "GPU)\n");
  }
  if (!p.json.active()) return Status::Ok();
  nlohmann::json out;
  out["command"] = kCommand;
  out["machine"] = MachineInfo();
  out["device"] = {{"kind", DeviceKindName(device.kind())},
                   {"name", device.name()},
                   {"emulated", emulated},
                   {"why", p.why}};
  if (emulated) {
    out["device"]["emulated_link_gbps"] = cfg.link_gbps;
    out["device"]["emulated_pageable_gbps"] = cfg.pageable_gbps;
    out["device"]["emulated_latency_us"] = cfg.latency_us;
  }
  out["config"] = {{"device", cfg.device},
                   {"cuda_ordinal", p.options.cuda_ordinal},
                   {"sizes", cfg.sizes},
                   {"directions", cfg.directions},
                   {"memory", cfg.memory},
                   {"min_time_s", cfg.min_time_s},
                   {"warmup", cfg.warmup},
                   {"latency_samples", cfg.latency_samples},
                   {"link_gbps", cfg.link_gbps},
                   {"pageable_gbps", cfg.pageable_gbps},
                   {"latency_us", cfg.latency_us},
                   {"device_budget_bytes", p.options.memory_budget_bytes}};
  out["results"] = std::move(jr);
  out["targets"] = targets;
  return p.json.Commit(out);
}

int Main(int argc, char** argv) {
  CLI::App app{"host<->device copy bandwidth, pinned and pageable",
               "strata-bench copy"};
  CopyFlags flags;
  AddOptions(app, flags);
  Config cfg;
  CopyPrepared prepared;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseCopy(flags));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(prepared, CheckCopy(cfg));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(std::vector<Result> results,
                                RunCopy(cfg, prepared));
        return ReportCopy(cfg, prepared, results);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("copy", "host<->device copy bandwidth (pinned, pageable)",
                     Main);

}  // namespace strata::bench
