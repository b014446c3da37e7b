// strata-bench copy: host<->device bandwidth through the Device interface.
//
// For every size (4 KiB .. 1 GiB by default), host memory kind (pinned =
// registered with the device, pageable = plain) and direction (h2d, d2h, and
// both at once on two copy streams), it warms up, then enqueues N copies and
// synchronizes once, with N chosen so a run lasts at least --min-time: the
// GB/s (1e9 bytes/s) is throughput with the copies pipelined, as the engine's
// prefetcher runs them. Single synchronized copies give the latency
// percentiles. On a CUDA device the same buffers are also copied by a plain
// cudaMemcpyAsync loop (gpu/raw_copy.h) and the ratio is reported.
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
#include "gpu/raw_copy.h"
#include "strata/device.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  std::string device = "auto";
  std::string sizes = "4K,64K,1M,16M,64M,256M,1G";
  std::string directions = "h2d,d2h,both";
  std::string memory = "pinned,pageable";
  double min_time_s = 0.2;
  int warmup = 2;
  int latency_samples = 20;
  double link_gbps = 25;      // host-emulated only
  double pageable_gbps = 12;  // host-emulated only
  double latency_us = 5;      // host-emulated only
  std::string json;
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

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

class CopyBench {
 public:
  CopyBench(Device& device, Stream& up, Stream& down)
      : device_(device), up_(up), down_(down) {}

  // Enqueues `iterations` rounds of the direction's copies, then waits.
  Status Run(Buffers& b, const std::string& dir, uint64_t bytes,
             int iterations) {
    for (int i = 0; i < iterations; ++i) {
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
      lat.push_back(Seconds(t) * 1e6);
      if (Seconds(t) * (i + 1) > cfg.min_time_s) break;
    }
    const double one_s = Percentile(lat, 50) / 1e6;
    r.p50_us = Percentile(lat, 50);
    r.p99_us = Percentile(lat, 99);
    r.iterations = static_cast<int>(
        std::clamp(cfg.min_time_s / std::max(one_s, 1e-7), 3.0, 100000.0));
    const auto t = Clock::now();
    STRATA_RETURN_IF_ERROR(Run(b, dir, bytes, r.iterations));
    r.seconds = Seconds(t);
    r.gbps = static_cast<double>(moved) * r.iterations / r.seconds / 1e9;
    if (device_.kind() == DeviceKind::kCuda) {
      std::vector<internal::RawCopy> copies;
      if (dir != "d2h") {
        copies.push_back(
            {b.dev_in.data(), b.in.data(), bytes, CopyKind::kHostToDevice});
      }
      if (dir != "h2d") {
        copies.push_back(
            {b.out.data(), b.dev_out.data(), bytes, CopyKind::kDeviceToHost});
      }
      STRATA_ASSIGN_OR_RETURN(double raw_s, internal::TimeRawCudaCopies(
                                                device_, copies, r.iterations));
      r.baseline_gbps = static_cast<double>(moved) * r.iterations / raw_s / 1e9;
    }
    return r;
  }

 private:
  Device& device_;
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

int Main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"host<->device copy bandwidth, pinned and pageable"};
  app.add_option("--device", cfg.device,
                 "auto (GPU when one works), cuda or host; auto defers to "
                 "STRATA_DEVICE")
      ->check(CLI::IsMember({"auto", "cuda", "host"}));
  app.add_option("--sizes", cfg.sizes, "bytes per copy, comma-separated")
      ->capture_default_str();
  app.add_option("--directions", cfg.directions, "h2d, d2h, both")
      ->capture_default_str();
  app.add_option("--memory", cfg.memory, "pinned, pageable")
      ->capture_default_str();
  app.add_option("--min-time", cfg.min_time_s, "seconds per timed run")
      ->capture_default_str();
  app.add_option("--warmup", cfg.warmup, "untimed rounds first")
      ->capture_default_str();
  app.add_option("--link-gbps", cfg.link_gbps,
                 "host-emulated link, GB/s per direction (pinned)")
      ->capture_default_str();
  app.add_option("--pageable-gbps", cfg.pageable_gbps,
                 "host-emulated link for pageable memory, GB/s")
      ->capture_default_str();
  app.add_option("--latency-us", cfg.latency_us,
                 "host-emulated fixed cost per copy, microseconds")
      ->capture_default_str();
  app.add_option("--json", cfg.json, "also write the results here");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto sizes = ParseSizeList(cfg.sizes);
  if (!sizes.ok()) {
    std::fprintf(stderr, "copy: --sizes: %s\n",
                 sizes.status().ToString().c_str());
    return 2;
  }
  const std::vector<std::string> dirs = SplitList(cfg.directions);
  const std::vector<std::string> mems = SplitList(cfg.memory);
  for (const auto& d : dirs) {
    if (d != "h2d" && d != "d2h" && d != "both") {
      std::fprintf(stderr, "copy: bad direction '%s'\n", d.c_str());
      return 2;
    }
  }
  for (const auto& m : mems) {
    if (m != "pinned" && m != "pageable") {
      std::fprintf(stderr, "copy: bad memory kind '%s'\n", m.c_str());
      return 2;
    }
  }
  const uint64_t max_size = *std::max_element(sizes->begin(), sizes->end());

  DeviceOptions opts;
  opts.choice = cfg.device == "cuda"   ? DeviceChoice::kCuda
                : cfg.device == "host" ? DeviceChoice::kHostEmulated
                                       : DeviceChoice::kAuto;
  // Room for the two device buffers and no more, on either backend: CUDA's
  // default (all free memory but a reserve) would starve anything else on the
  // GPU for no gain.
  opts.memory_budget_bytes = 2 * max_size + (1 << 20);
  opts.emulated_link_bytes_per_s = static_cast<uint64_t>(cfg.link_gbps * 1e9);
  opts.emulated_pageable_bytes_per_s =
      static_cast<uint64_t>(cfg.pageable_gbps * 1e9);
  opts.emulated_copy_latency_ns = static_cast<uint64_t>(cfg.latency_us * 1e3);
  std::string why;
  auto made = NewDevice(opts, &why);
  if (!made.ok()) return Fail("copy", made.status());
  std::unique_ptr<Device> device = std::move(*made);
  const bool emulated = device->kind() == DeviceKind::kHostEmulated;

  std::printf("strata-bench copy\n  device: %s\n  chosen: %s\n",
              device->name().c_str(), why.c_str());
  if (emulated) {
    std::printf(
        "  NOTE: no GPU in use; this is the host-emulated device with a "
        "link of %.1f GB/s pinned, %.1f GB/s pageable, %.1f us per copy\n",
        cfg.link_gbps, cfg.pageable_gbps, cfg.latency_us);
  }
  std::printf("  sizes: %s  directions: %s  memory: %s  min-time: %.2f s\n\n",
              cfg.sizes.c_str(), cfg.directions.c_str(), cfg.memory.c_str(),
              cfg.min_time_s);

  auto up = device->NewStream({StreamKind::kCopy});
  auto down = device->NewStream({StreamKind::kCopy});
  if (!up.ok() || !down.ok()) {
    std::fprintf(stderr, "copy: cannot create streams: %s\n",
                 (!up.ok() ? up.status() : down.status()).ToString().c_str());
    return 1;
  }
  std::vector<Result> results;
  {
    Buffers pinned, pageable;
    auto dev_in = device->Allocate(max_size, **up);
    auto dev_out = device->Allocate(max_size, **down);
    if (!dev_in.ok() || !dev_out.ok()) {
      return Fail("copy", !dev_in.ok() ? dev_in.status() : dev_out.status());
    }
    HostBufferOptions plain;
    plain.pin = false;
    plain.prefault = true;
    for (const auto& m : mems) {
      Buffers& b = m == "pinned" ? pinned : pageable;
      auto in = m == "pinned" ? device->AllocatePinnedHost(max_size, {})
                              : HostBuffer::Allocate(max_size, plain);
      auto out = m == "pinned" ? device->AllocatePinnedHost(max_size, {})
                               : HostBuffer::Allocate(max_size, plain);
      if (!in.ok() || !out.ok()) {
        std::fprintf(
            stderr, "copy: %s host memory: %s\n", m.c_str(),
            (!in.ok() ? in.status() : out.status()).ToString().c_str());
        return 1;
      }
      b.in = std::move(*in);
      b.out = std::move(*out);
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
    } drain{*device, **up, **down};
    // Both kinds share the device buffers, moved in and out of each.
    CopyBench bench(*device, **up, **down);
    Progress progress(mems.size() * dirs.size() * sizes->size());
    for (const auto& m : mems) {
      Buffers& b = m == "pinned" ? pinned : pageable;
      b.dev_in = std::move(*dev_in);
      b.dev_out = std::move(*dev_out);
      for (const auto& d : dirs) {
        for (uint64_t size : *sizes) {
          progress.Step(m + " " + d + " " + FormatBytes(size));
          auto r = bench.Measure(b, d, size, m == "pinned", cfg);
          if (!r.ok()) {
            std::fprintf(stderr, "copy: %s %s %s: %s\n", m.c_str(), d.c_str(),
                         FormatBytes(size).c_str(),
                         r.status().ToString().c_str());
            return 1;
          }
          results.push_back(*r);
        }
      }
      dev_in = std::move(b.dev_in);
      dev_out = std::move(b.dev_out);
    }
  }

  std::vector<std::string> header = {"memory", "direction", "size",  "iters",
                                     "GB/s",   "p50 us",    "p99 us"};
  if (!emulated) {
    header.push_back("cudaMemcpyAsync GB/s");
    header.push_back("ratio");
  }
  Table table(header);
  nlohmann::json jr = nlohmann::json::array();
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
      row.push_back(Fixed(r.baseline_gbps, 2));
      row.push_back(Fixed(r.gbps / r.baseline_gbps, 3));
      j["baseline_cuda_memcpy_async_gbps"] = r.baseline_gbps;
      j["ratio_to_baseline"] = r.gbps / r.baseline_gbps;
    }
    table.AddRow(std::move(row));
    jr.push_back(std::move(j));
  }
  std::printf("%s", table.ToString().c_str());
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

  if (!cfg.json.empty()) {
    nlohmann::json out;
    out["command"] = "copy";
    out["machine"] = MachineInfo();
    out["device"] = {{"kind", DeviceKindName(device->kind())},
                     {"name", device->name()},
                     {"emulated", emulated},
                     {"why", why}};
    if (emulated) {
      out["device"]["emulated_link_gbps"] = cfg.link_gbps;
      out["device"]["emulated_pageable_gbps"] = cfg.pageable_gbps;
      out["device"]["emulated_latency_us"] = cfg.latency_us;
    }
    out["config"] = {{"sizes", cfg.sizes},
                     {"directions", cfg.directions},
                     {"memory", cfg.memory},
                     {"min_time_s", cfg.min_time_s},
                     {"warmup", cfg.warmup}};
    out["results"] = std::move(jr);
    out["targets"] = targets;
    if (Status st = WriteJson(cfg.json, out); !st.ok()) {
      return Fail("copy", st);
    }
  }
  return 0;
}

}  // namespace

STRATA_BENCH_COMMAND("copy", "host<->device copy bandwidth (pinned, pageable)",
                     Main);

}  // namespace strata::bench
