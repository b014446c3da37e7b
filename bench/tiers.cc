// strata-bench tiers: the bandwidth of each hop between the tiers alone, and
// the engine's end-to-end movement of NVMe-resident parameters beside the
// slowest hop it crosses, all measured in the same run:
//
//   nvme_write  pieces written to a swap space (the engine's SwapSpace path:
//               WriteAsync from pinned buffers, same block size, queue depth
//               and backend, as many pieces in flight as the engine has
//               staging buffers);
//   nvme_read   the same pieces read back (ReadAsync, checksums verified);
//   h2d, d2h    the same pieces copied between pinned host buffers and device
//               memory on one copy stream, as the engine copies them;
//   e2e_fetch   one pass of the engine (include/strata/engine.h) over
//               parameters resting on NVMe with a device budget far below
//               their size, so that every pass reads them from NVMe: every
//               tensor fetched in order, waited on by a compute stream,
//               released; the pass ends when that stream is done.
//   e2e_writeback  the same engine's gradients resting on NVMe: every
//               tensor's fp32 gradient handed over from the device (AddGrad,
//               in backward's order), until the last accumulator is written
//               to NVMe (by the Step, which writes the open ones out first).
//   efficiency  = e2e throughput / the slowest hop it crosses (nvme_read and
//               h2d; d2h and nvme_write), each the best of --reps. Above 1
//               would mean the hops are measured less favourably than the
//               engine runs.
//   paired      the median of each repetition's e2e rate over the slowest
//               hop it crosses in that same repetition: the drive's rate
//               drifts from minute to minute on shared machines, so a best
//               pass of the engine can meet a best hop sampled minutes away
//               (one run gave an e2e_fetch efficiency of 1.12); each
//               repetition measures the engine and its hops side by side.
//
// The engine prefetches along the order its last step recorded, so each pass
// ends with a Step (outside the fetch's timing) that a NaN gradient skips, as
// an fp16 overflow would: it ends the recording without touching the
// parameters, and without the optimizer's update, which the write-back's
// Step would otherwise be timed with.
//
// The engine's swap space and the hops' lie in two subdirectories of --dir
// (a swap space locks its directory), made and removed by the run; --dir
// itself is locked for the run.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/host_buffer.h"
#include "strata/io_engine.h"
#include "strata/swap_space.h"
#include "util/align.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCommand = "tiers";
constexpr const char* kLockName = "strata-bench-tiers.lock";
constexpr const char* kEngineDirName = "strata-bench-tiers-engine";
constexpr const char* kHopDirName = "strata-bench-tiers-hops";
constexpr uint64_t kMinSize = uint64_t{256} << 10;
constexpr uint64_t kMaxSize = uint64_t{1} << 50;
// bf16 bytes per tensor: the engine's default partition (64 MiB of fp32)
// holds 32 MiB of bf16; smaller runs use smaller tensors, at least 8 of them.
constexpr uint64_t kMaxTensorBytes = uint64_t{32} << 20;
constexpr uint64_t kMinTensors = 8;
// What the engine's staging pool holds when optimizer states rest on the
// host and gradients on NVMe (its automatic count), its smallest buffer, and
// the buffers its gradient accumulators add into besides.
constexpr uint32_t kStagingCount = 8;
constexpr uint64_t kMinStagingBytes = uint64_t{4} << 20;
constexpr uint32_t kGradBuffers = 3;
// Host bytes the engine keeps per byte of bf16 parameters: the fp32 master
// and moments.
constexpr uint64_t kEngineHostPerByte = 6;
constexpr uint64_t kSlack = uint64_t{64} << 20;

// ---- Parse -----------------------------------------------------------------

struct TiersFlags {
  std::string size = "1G";
  std::string dir = ".";
  std::string device = "auto";
  SwapIoFlags io;
  std::string budget = "auto";
  std::string reps = "3";
  std::string json;
};

// The parameters' shape, derived from --size: equal tensors (the last one
// may be smaller), one engine unit and one NVMe piece each.
struct Shape {
  uint64_t size = 0;  // --size
  uint64_t tensor_bytes = 0;
  uint64_t tensors = 0;
  uint64_t last_bytes = 0;
  uint64_t staging_bytes = 0;  // the engine's automatic choice
  uint64_t prefetch_bytes = 0;
  uint64_t budget = 0;  // the engine's device budget

  uint64_t bytes(uint64_t i) const {
    return i + 1 == tensors ? last_bytes : tensor_bytes;
  }
};

struct TiersConfig {
  uint64_t size = 0;
  std::string dir;
  std::string device;
  IoBackend engine = IoBackend::kAuto;
  uint32_t queue_depth = 32;
  uint64_t block_size = 1 << 20;
  bool auto_budget = true;
  int reps = 3;
  std::string json;
  Shape shape;
};

void AddOptions(CLI::App& app, TiersFlags& f) {
  app.add_option("--size", f.size,
                 "bytes of bf16 parameters, a multiple of 4 KiB, 256K..1P "
                 "(K/M/G/T suffixes)")
      ->capture_default_str();
  app.add_option("--dir", f.dir, "directory for the NVMe tier")
      ->capture_default_str();
  AddDeviceOption(app, f.device);
  AddSwapIoOptions(app, f.io);
  app.add_option("--budget", f.budget,
                 "the engine's device budget: auto, or bytes from two tensors "
                 "up to below --size")
      ->capture_default_str();
  app.add_option("--reps", f.reps,
                 "timed passes of each row, 1..100; the best "
                 "is kept")
      ->capture_default_str();
  app.add_option("--json", f.json, "write results as JSON to FILE");
}

// The tensors and the engine's staging and prefetch settings for `size`.
Shape ShapeFor(uint64_t size) {
  Shape s;
  s.size = size;
  // A multiple of 2048 bytes: a whole number of 1024 bf16 elements, so no
  // padding, and a partition (2 x tensor bytes) of whole pages.
  s.tensor_bytes = std::min(kMaxTensorBytes, size / kMinTensors / 2048 * 2048);
  s.tensors = (size + s.tensor_bytes - 1) / s.tensor_bytes;
  s.last_bytes = size - (s.tensors - 1) * s.tensor_bytes;
  s.staging_bytes = std::max(kMinStagingBytes, 2 * s.tensor_bytes);
  s.prefetch_bytes = EngineOptions().prefetch_bytes;
  return s;
}

// The automatic budget: the tensor being used, the engine's prefetch window
// (the tensors ahead it reads while that one is used) and one more, but at
// most half of the tensors, so that no pass finds them cached.
uint64_t AutoBudget(const Shape& s) {
  const uint64_t ahead = s.prefetch_bytes / s.tensor_bytes;
  const uint64_t units =
      std::max<uint64_t>(2, std::min(ahead + 2, s.tensors / 2));
  return units * s.tensor_bytes;
}

Status ParseBudget(const TiersFlags& f, TiersConfig& c) {
  Shape& s = c.shape;
  c.auto_budget = f.budget == "auto";
  if (c.auto_budget) {
    s.budget = AutoBudget(s);
    return Status::Ok();
  }
  // Two tensors at least (one in use, one arriving); below --size, so that
  // passes cannot be served from the device.
  StatusOr<uint64_t> b = ParseSizeOption(
      "--budget", f.budget, 2 * s.tensor_bytes, c.size - s.tensor_bytes);
  if (!b.ok()) {
    return Status::InvalidArgument(
        std::string(b.status().message()) + " (auto, or two tensors of " +
        FormatBytes(s.tensor_bytes) +
        " at least and --size less one tensor at most, so that every pass "
        "reads from NVMe)");
  }
  s.budget = *b;
  return Status::Ok();
}

StatusOr<TiersConfig> ParseTiers(const TiersFlags& f) {
  TiersConfig c;
  STRATA_ASSIGN_OR_RETURN(
      c.size, ParseSizeOption("--size", f.size, kMinSize, kMaxSize));
  if (c.size % 4096 != 0) {
    return Status::InvalidArgument("--size: " + std::to_string(c.size) +
                                   " bytes is not a multiple of 4 KiB");
  }
  c.dir = f.dir;
  if (c.dir.empty()) return Status::InvalidArgument("--dir: empty path");
  STRATA_ASSIGN_OR_RETURN(c.device, ParseDeviceOption(f.device));
  STRATA_ASSIGN_OR_RETURN(SwapIoConfig io, ParseSwapIoFlags(f.io));
  c.engine = io.engine;
  c.queue_depth = io.queue_depth;
  c.block_size = io.block_size;
  c.shape = ShapeFor(c.size);
  STRATA_RETURN_IF_ERROR(ParseBudget(f, c));
  STRATA_ASSIGN_OR_RETURN(int64_t reps,
                          ParseIntOption("--reps", f.reps, 1, 100));
  c.reps = static_cast<int>(reps);
  c.json = f.json;
  return c;
}

// ---- Check -----------------------------------------------------------------

// Bytes a swap space takes for the tensors as pieces of whole blocks, at
// `scale` bytes per byte of bf16 (2 for fp32 gradients).
uint64_t SwapBytes(const TiersConfig& c, uint64_t scale = 1) {
  const Shape& s = c.shape;
  return (s.tensors - 1) * RoundUp(scale * s.tensor_bytes, c.block_size) +
         RoundUp(scale * s.last_bytes, c.block_size);
}

DeviceOptions DeviceOptionsFor(const TiersConfig& c) {
  DeviceOptions o;
  o.choice = DeviceChoiceOf(c.device);
  // The engine's arena, the hops' device pieces, two fp32 gradients.
  o.memory_budget_bytes =
      c.shape.budget + (kStagingCount + 4) * c.shape.tensor_bytes + kSlack;
  return o;  // an unthrottled host-emulated link: host copies at memcpy speed
}

struct TiersPrepared {
  JsonOutput json;
  DeviceOptions device_options;
  std::unique_ptr<Device> device;
  std::string why;
  nlohmann::json filesystem;
};

Status CheckSpaceAndMemory(const TiersConfig& c, bool host_device) {
  // The hops' swap space, and the engine's: parameters, fp32 gradients and
  // room for its staging buffers.
  const uint64_t disk = 2 * SwapBytes(c) + SwapBytes(c, 2) +
                        kStagingCount * c.shape.staging_bytes + kSlack;
  STRATA_ASSIGN_OR_RETURN(uint64_t free_bytes, FreeBytes(c.dir));
  if (disk > free_bytes) {
    return Status::NoSpace(
        "--size " + FormatBytes(c.size) + " does not fit in " + c.dir +
        ": the engine's and the hops' swap files need " + std::to_string(disk) +
        " bytes, " + std::to_string(free_bytes) + " are free");
  }
  uint64_t host = kEngineHostPerByte * c.size +
                  (2 * kStagingCount + kGradBuffers) * c.shape.staging_bytes +
                  kSlack;
  if (host_device) host += DeviceOptionsFor(c).memory_budget_bytes;
  return CheckMemory("tiers' host arrays (6 bytes per byte of --size " +
                         FormatBytes(c.size) +
                         ", staging buffers, and the host-emulated device)",
                     host);
}

// Usage errors (the directory, --json, STRATA_DEVICE) come back as
// kInvalidArgument; the rest are failures of this machine or run.
StatusOr<TiersPrepared> CheckTiers(const TiersConfig& c, RunGuard& guard) {
  TiersPrepared p;
  struct stat st {};
  if (::stat(c.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("--dir: " + c.dir +
                                   " is not an existing directory");
  }
  if (!c.json.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.json, JsonOutput::Prepare("--json", c.json));
  }
  STRATA_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(c.dir, kLockName));
  guard.AdoptLock(std::move(lock));
  p.filesystem = FilesystemInfo(c.dir);
  p.device_options = DeviceOptionsFor(c);
  STRATA_RETURN_IF_ERROR(
      CheckSpaceAndMemory(c, p.device_options.choice != DeviceChoice::kCuda));
  STRATA_ASSIGN_OR_RETURN(p.device, NewDevice(p.device_options, &p.why));
  return p;
}

// ---- Run: shared pieces ----------------------------------------------------

// A directory this run makes (or finds left by an earlier one) and removes
// when it goes; what is inside must be gone by then (the swap spaces remove
// their files when destroyed, before this).
class ScopedDir {
 public:
  static StatusOr<std::unique_ptr<ScopedDir>> Make(std::string path) {
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      return Status::FromErrno(errno, "mkdir " + path);
    }
    return std::unique_ptr<ScopedDir>(new ScopedDir(std::move(path)));
  }
  ScopedDir(const ScopedDir&) = delete;
  ScopedDir& operator=(const ScopedDir&) = delete;
  ~ScopedDir() { ::rmdir(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  explicit ScopedDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// At most one asynchronous operation in flight per slot. The destructor
// waits for all of them, so the buffers they use may go afterwards.
class Slots {
 public:
  explicit Slots(size_t n) : done_(n) {}
  Slots(const Slots&) = delete;
  Slots& operator=(const Slots&) = delete;
  ~Slots() { Drain().IgnoreError(); }

  // Waits for the slot's last operation; then the callback for its next.
  // The caller runs the callback itself when the operation is refused.
  StatusOr<std::function<void(Status)>> Take(size_t slot) {
    STRATA_RETURN_IF_ERROR(Wait(slot));
    auto promise = std::make_shared<std::promise<Status>>();
    done_[slot] = promise->get_future();
    return std::function<void(Status)>(
        [promise](Status st) { promise->set_value(std::move(st)); });
  }
  Status Drain() {
    Status first;
    for (size_t i = 0; i < done_.size(); ++i) {
      Status st = Wait(i);
      if (first.ok()) first = st;
    }
    return first;
  }

 private:
  Status Wait(size_t slot) {
    if (!done_[slot].valid()) return Status::Ok();
    return done_[slot].get();
  }
  std::vector<std::future<Status>> done_;
};

// One timed row: the bytes and seconds of its best (fastest) pass.
double Gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

struct Row {
  std::string hop;
  uint64_t bytes = 0;
  double seconds = 0;
  double gbps() const { return Gbps(bytes, seconds); }
  // Keeps this pass if it is the fastest so far; says whether it was.
  bool Keep(uint64_t b, double s) {
    if (s <= 0 || (seconds > 0 && b / s <= bytes / seconds)) return false;
    bytes = b;
    seconds = s;
    return true;
  }
};

// ---- Run: the hops ---------------------------------------------------------

// The hops' working set: a swap space holding the tensors as pieces, and one
// pinned host buffer (of a staging buffer's size) and one device piece per
// slot, as many slots as the engine has staging buffers.
struct HopRig {
  Device* device = nullptr;
  const Shape* shape = nullptr;
  std::unique_ptr<Stream> stream;  // a copy stream, as the engine's
  std::vector<DeviceMemory> dev;
  std::vector<HostBuffer> host;
  std::unique_ptr<SwapSpace> swap;
  std::vector<SwapHandle> pieces;
};

StatusOr<std::unique_ptr<HopRig>> MakeHopRig(const TiersConfig& c,
                                             Device& device,
                                             const std::string& dir) {
  auto rig = std::make_unique<HopRig>();
  rig->device = &device;
  rig->shape = &c.shape;
  STRATA_ASSIGN_OR_RETURN(rig->stream, device.NewStream({StreamKind::kCopy}));
  HostBufferOptions ho;
  ho.prefault = true;  // as the engine's staging pool
  for (uint32_t i = 0; i < kStagingCount; ++i) {
    STRATA_ASSIGN_OR_RETURN(
        HostBuffer h, device.AllocatePinnedHost(c.shape.staging_bytes, ho));
    std::memset(h.data(), 0x5a, h.size());
    rig->host.push_back(std::move(h));
    STRATA_ASSIGN_OR_RETURN(
        DeviceMemory d, device.Allocate(c.shape.tensor_bytes, *rig->stream));
    rig->dev.push_back(std::move(d));
  }
  SwapSpaceOptions so;  // as the engine opens its own
  so.dirs = {dir};
  so.capacity_bytes = SwapBytes(c);
  so.block_bytes = static_cast<uint32_t>(c.block_size);
  so.io.backend = c.engine;
  so.io.queue_depth = c.queue_depth;
  so.queue_depth = c.queue_depth;
  so.synchronous_io = false;
  STRATA_ASSIGN_OR_RETURN(rig->swap, SwapSpace::Open(so));
  for (uint64_t i = 0; i < c.shape.tensors; ++i) {
    STRATA_ASSIGN_OR_RETURN(SwapHandle h,
                            rig->swap->Allocate(i, c.shape.bytes(i)));
    rig->pieces.push_back(std::move(h));
  }
  return rig;
}

// Every piece written (or read) once, a slot's worth in flight each.
StatusOr<double> NvmePass(HopRig& rig, bool write) {
  Slots slots(rig.host.size());
  const auto t0 = Clock::now();
  for (size_t i = 0; i < rig.pieces.size(); ++i) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    const size_t slot = i % rig.host.size();
    STRATA_ASSIGN_OR_RETURN(auto done, slots.Take(slot));
    SwapHandle& h = rig.pieces[i];
    const std::span<std::byte> buf = rig.host[slot].span();
    Status st = write ? rig.swap->WriteAsync(h, 0, h.blocks(), buf,
                                             IoPriority::kBackground, done)
                      : rig.swap->ReadAsync(h, 0, h.blocks(), buf,
                                            IoPriority::kBackground, done);
    if (!st.ok()) {
      done(st);
      return st;
    }
  }
  STRATA_RETURN_IF_ERROR(slots.Drain());
  return SecondsSince(t0);
}

// Every piece copied once between a slot's pinned buffer and its device
// piece, all enqueued on the copy stream, then waited for.
StatusOr<double> CopyPass(HopRig& rig, CopyKind kind) {
  const auto t0 = Clock::now();
  for (size_t i = 0; i < rig.pieces.size(); ++i) {
    if (i % 64 == 0) STRATA_RETURN_IF_ERROR(CheckInterrupted());
    const size_t slot = i % rig.host.size();
    void* host = rig.host[slot].data();
    void* dev = rig.dev[slot].data();
    const bool up = kind == CopyKind::kHostToDevice;
    STRATA_RETURN_IF_ERROR(rig.device->CopyAsync(*rig.stream, up ? dev : host,
                                                 up ? host : dev,
                                                 rig.pieces[i].bytes(), kind));
  }
  STRATA_RETURN_IF_ERROR(rig.device->SynchronizeStream(*rig.stream));
  return SecondsSince(t0);
}

// ---- Run: the engine -------------------------------------------------------

// An engine whose parameters and gradients rest on NVMe, with the tensors
// registered, and a compute stream that consumes them and produces fp32
// gradients, one tensor's worth each: finite ones, and NaN ones that make a
// Step skip (Note at the top).
struct EngineRig {
  Device* device = nullptr;
  const Shape* shape = nullptr;
  std::unique_ptr<Stream> compute;
  DeviceMemory grad, nan_grad;
  std::unique_ptr<Engine> engine;  // after the stream: destroyed first
  std::vector<TensorId> ids;
};

EngineOptions EngineOptionsFor(const TiersConfig& c, const std::string& dir) {
  EngineOptions o;
  o.params = Residence::kNvme;
  o.grads = Residence::kNvme;
  o.nvme_paths = {dir};
  o.io.backend = c.engine;
  o.io.queue_depth = c.queue_depth;
  o.io_block_bytes = c.block_size;
  o.partition_bytes = 2 * c.shape.tensor_bytes;  // one tensor per unit
  o.staging_buffer_bytes = c.shape.staging_bytes;
  o.staging_buffer_count = kStagingCount;
  o.device_budget_bytes = c.shape.budget;
  o.persistence_threshold_bytes = 0;  // every tensor comes from NVMe
  return o;
}

StatusOr<std::unique_ptr<EngineRig>> MakeEngineRig(const TiersConfig& c,
                                                   Device& device,
                                                   const std::string& dir) {
  auto rig = std::make_unique<EngineRig>();
  rig->device = &device;
  rig->shape = &c.shape;
  STRATA_ASSIGN_OR_RETURN(rig->compute, device.NewStream({}));
  const uint64_t fp32 = 2 * c.shape.tensor_bytes;
  STRATA_ASSIGN_OR_RETURN(rig->grad, device.Allocate(fp32, *rig->compute));
  STRATA_ASSIGN_OR_RETURN(rig->nan_grad, device.Allocate(fp32, *rig->compute));
  // 0x3c3c3c3c is about 0.0115; 0xffffffff is a NaN.
  STRATA_RETURN_IF_ERROR(
      device.MemsetAsync(*rig->compute, rig->grad.data(), 0x3c, fp32));
  STRATA_RETURN_IF_ERROR(
      device.MemsetAsync(*rig->compute, rig->nan_grad.data(), 0xff, fp32));
  STRATA_ASSIGN_OR_RETURN(rig->engine,
                          Engine::Create(EngineOptionsFor(c, dir), &device));
  for (uint64_t i = 0; i < c.shape.tensors; ++i) {
    TensorSpec s;
    s.name = "p" + std::to_string(i);
    s.shape = {static_cast<int64_t>(c.shape.bytes(i) / 2)};
    STRATA_ASSIGN_OR_RETURN(TensorId id, rig->engine->Register(s));
    rig->ids.push_back(id);
  }
  STRATA_RETURN_IF_ERROR(rig->engine->Start());
  return rig;
}

// What one pass of the engine did, from its stats.
struct PassStats {
  double seconds = 0;
  uint64_t nvme_read_bytes = 0, h2d_bytes = 0;
  uint64_t nvme_write_bytes = 0, d2h_bytes = 0;
  // Fetches that found the tensor on the device: brought by a prefetch of
  // this pass, or cached since an earlier one.
  uint64_t fetch_hits = 0, prefetch_hits = 0;
  uint64_t cache_hits() const { return fetch_hits - prefetch_hits; }
  double stall_seconds = 0;
};

// Every tensor fetched in order, waited on by the compute stream and
// released; done when the compute stream is.
StatusOr<PassStats> FetchPass(EngineRig& rig) {
  const EngineStats before = rig.engine->stats();
  const auto t0 = Clock::now();
  for (TensorId id : rig.ids) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    STRATA_ASSIGN_OR_RETURN(ParamPin pin, rig.engine->Fetch(id));
    STRATA_RETURN_IF_ERROR(pin.WaitOn(*rig.compute));
  }
  STRATA_RETURN_IF_ERROR(rig.device->SynchronizeStream(*rig.compute));
  PassStats p;
  p.seconds = SecondsSince(t0);
  const EngineStats after = rig.engine->stats();
  p.nvme_read_bytes = after.nvme_read_bytes - before.nvme_read_bytes;
  p.h2d_bytes = after.h2d_bytes - before.h2d_bytes;
  p.fetch_hits = after.fetch_hits - before.fetch_hits;
  p.prefetch_hits = after.prefetch_hits - before.prefetch_hits;
  p.stall_seconds = after.stall_seconds - before.stall_seconds;
  return p;
}

Status CheckSkipped(const StatusOr<StepResult>& r) {
  STRATA_RETURN_IF_ERROR(r.status());
  if (r->applied) {
    return Status::Internal("tiers: a step with a NaN gradient was applied");
  }
  return Status::Ok();
}

// Ends the engine's step (its fetch order becomes the one it prefetches
// along) with a Step that the NaN gradient skips.
Status EndStep(EngineRig& rig) {
  STRATA_RETURN_IF_ERROR(
      rig.engine->AddGrad(rig.ids.front(), rig.nan_grad.data(),
                          ElementType::kFloat32, *rig.compute));
  return CheckSkipped(rig.engine->Step({}));
}

// Seconds from `t0` until the engine's NVMe writes reach `target` bytes past
// `base`, watched while `step` runs (the Step writes the last accumulators
// out, then reads some back for an update the NaN gradient cancels: only the
// writes count). kInternal if the step ends short of `target`.
StatusOr<double> UntilWritten(Engine& engine, uint64_t base, uint64_t target,
                              Clock::time_point t0,
                              std::future<StatusOr<StepResult>>& step) {
  for (;;) {
    const bool ended = step.wait_for(std::chrono::microseconds(200)) ==
                       std::future_status::ready;
    const uint64_t written = engine.stats().nvme_write_bytes - base;
    if (written >= target) return SecondsSince(t0);
    if (ended) {
      STRATA_RETURN_IF_ERROR(CheckSkipped(step.get()));
      return Status::Internal("tiers: the write-back wrote " +
                              std::to_string(written) + " of " +
                              std::to_string(target) + " gradient bytes");
    }
  }
}

// Every tensor's fp32 gradient handed over from the device, in backward's
// order (the first tensor's a NaN, so that the Step ends the pass without
// an update), until the last accumulator is on NVMe.
StatusOr<PassStats> WritebackPass(EngineRig& rig) {
  const EngineStats before = rig.engine->stats();
  const uint64_t target = 2 * rig.shape->size;
  const auto t0 = Clock::now();
  for (auto it = rig.ids.rbegin(); it != rig.ids.rend(); ++it) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    const DeviceMemory& g = *it == rig.ids.front() ? rig.nan_grad : rig.grad;
    STRATA_RETURN_IF_ERROR(rig.engine->AddGrad(
        *it, g.data(), ElementType::kFloat32, *rig.compute));
  }
  Engine* engine = rig.engine.get();
  std::future<StatusOr<StepResult>> step =
      std::async(std::launch::async, [engine] { return engine->Step({}); });
  StatusOr<double> s =
      UntilWritten(*engine, before.nvme_write_bytes, target, t0, step);
  if (step.valid()) {
    STRATA_RETURN_IF_ERROR(CheckSkipped(step.get()));
  }
  STRATA_RETURN_IF_ERROR(s.status());
  const EngineStats after = rig.engine->stats();
  PassStats p;
  p.seconds = *s;
  p.nvme_write_bytes = target;
  p.d2h_bytes = after.d2h_bytes - before.d2h_bytes;
  return p;
}

// ---- Run -------------------------------------------------------------------

struct E2eRow {
  Row row;
  PassStats pass;                    // of the kept pass
  std::vector<std::string> crosses;  // the hops it crosses
};

// The GB/s of every pass of one repetition, by its row's name.
using RepRates = std::map<std::string, double>;

struct TiersOutcome {
  Row nvme_write{"nvme_write"}, nvme_read{"nvme_read"}, h2d{"h2d"}, d2h{"d2h"};
  E2eRow fetch{{"e2e_fetch"}, {}, {"nvme_read", "h2d"}};
  E2eRow writeback{{"e2e_writeback"}, {}, {"d2h", "nvme_write"}};
  std::vector<RepRates> reps;
  EngineStats engine_stats;
  std::string io_engine;
};

// One timed pass of a hop, kept if it is the fastest, its rate in `rep`.
Status MeasureHop(HopRig& rig, Row& row, Progress& progress, RepRates& rep) {
  progress.Step(row.hop);
  StatusOr<double> s =
      row.hop == "nvme_write" ? NvmePass(rig, true)
      : row.hop == "nvme_read"
          ? NvmePass(rig, false)
          : CopyPass(rig, row.hop == "h2d" ? CopyKind::kHostToDevice
                                           : CopyKind::kDeviceToHost);
  STRATA_RETURN_IF_ERROR(s.status());
  row.Keep(rig.shape->size, *s);
  rep[row.hop] = Gbps(rig.shape->size, *s);
  return Status::Ok();
}

Status MeasureFetch(EngineRig& rig, TiersOutcome& out, Progress& progress,
                    RepRates& rep) {
  progress.Step("e2e_fetch");
  STRATA_ASSIGN_OR_RETURN(PassStats p, FetchPass(rig));
  STRATA_RETURN_IF_ERROR(EndStep(rig));
  // Bytes that came from NVMe: a tensor found on the device counts nothing.
  if (out.fetch.row.Keep(p.nvme_read_bytes, p.seconds)) out.fetch.pass = p;
  rep[out.fetch.row.hop] = Gbps(p.nvme_read_bytes, p.seconds);
  return Status::Ok();
}

Status MeasureWriteback(EngineRig& rig, TiersOutcome& out, Progress& progress,
                        RepRates& rep) {
  progress.Step("e2e_writeback");
  STRATA_ASSIGN_OR_RETURN(PassStats p, WritebackPass(rig));
  if (out.writeback.row.Keep(p.nvme_write_bytes, p.seconds)) {
    out.writeback.pass = p;
  }
  rep[out.writeback.row.hop] = Gbps(p.nvme_write_bytes, p.seconds);
  return Status::Ok();
}

// One repetition: the writes (the hop's and the engine's write-back), the
// copies, then the reads (the hop's and the engine's fetch), so that no read
// runs while the drive may still be absorbing writes. Within each pair the
// hop and the engine take turns going first, so that neither is always
// measured after the other.
// Each repetition's rates are kept too, for the paired figure: the engine's
// pass against the hops measured beside it, in the same minute.
Status MeasureRep(int rep, HopRig& hops, EngineRig& engine, TiersOutcome& out,
                  Progress& progress) {
  const bool hop_first = rep % 2 == 1;
  RepRates& r = out.reps.emplace_back();
  if (hop_first) {
    STRATA_RETURN_IF_ERROR(MeasureHop(hops, out.nvme_write, progress, r));
  }
  STRATA_RETURN_IF_ERROR(MeasureWriteback(engine, out, progress, r));
  if (!hop_first) {
    STRATA_RETURN_IF_ERROR(MeasureHop(hops, out.nvme_write, progress, r));
  }
  for (Row* row : {&out.h2d, &out.d2h}) {
    STRATA_RETURN_IF_ERROR(MeasureHop(hops, *row, progress, r));
  }
  if (hop_first) {
    STRATA_RETURN_IF_ERROR(MeasureHop(hops, out.nvme_read, progress, r));
  }
  STRATA_RETURN_IF_ERROR(MeasureFetch(engine, out, progress, r));
  if (!hop_first) {
    STRATA_RETURN_IF_ERROR(MeasureHop(hops, out.nvme_read, progress, r));
  }
  return Status::Ok();
}

StatusOr<TiersOutcome> RunTiers(const TiersConfig& c, TiersPrepared& p) {
  TiersOutcome out;
  Device& device = *p.device;
  // Declared first, so removed last: after the swap spaces inside them.
  STRATA_ASSIGN_OR_RETURN(auto engine_dir,
                          ScopedDir::Make(c.dir + "/" + kEngineDirName));
  STRATA_ASSIGN_OR_RETURN(auto hop_dir,
                          ScopedDir::Make(c.dir + "/" + kHopDirName));
  std::fprintf(stderr, "tiers: %llu tensors of %s; laying out\n",
               static_cast<unsigned long long>(c.shape.tensors),
               FormatBytes(c.shape.tensor_bytes).c_str());
  STRATA_ASSIGN_OR_RETURN(auto hops, MakeHopRig(c, device, hop_dir->path()));
  STRATA_ASSIGN_OR_RETURN(auto engine,
                          MakeEngineRig(c, device, engine_dir->path()));
  out.io_engine = std::string(hops->swap->engine_name());
  // Untimed: the hops' pieces written once, and a first pass that records
  // the order the engine prefetches along later.
  STRATA_RETURN_IF_ERROR(NvmePass(*hops, /*write=*/true).status());
  STRATA_RETURN_IF_ERROR(FetchPass(*engine).status());
  STRATA_RETURN_IF_ERROR(EndStep(*engine));
  Progress progress(static_cast<size_t>(c.reps) * 6);
  for (int rep = 0; rep < c.reps; ++rep) {
    STRATA_RETURN_IF_ERROR(MeasureRep(rep, *hops, *engine, out, progress));
  }
  out.engine_stats = engine->engine->stats();
  return out;
}

// ---- Report ----------------------------------------------------------------

struct Reference {
  std::string hop;
  double gbps = 0;
};

Reference Slowest(const TiersOutcome& out, const E2eRow& e) {
  Reference best;
  for (const Row* r : {&out.nvme_write, &out.nvme_read, &out.h2d, &out.d2h}) {
    if (std::find(e.crosses.begin(), e.crosses.end(), r->hop) ==
        e.crosses.end()) {
      continue;
    }
    if (best.hop.empty() || r->gbps() < best.gbps) best = {r->hop, r->gbps()};
  }
  return best;
}

nlohmann::json RowJson(const Row& r) {
  return {{"hop", r.hop},
          {"bytes", r.bytes},
          {"seconds", r.seconds},
          {"gbps", r.gbps()}};
}

double Efficiency(const TiersOutcome& out, const E2eRow& e) {
  const Reference ref = Slowest(out, e);
  return ref.gbps > 0 ? e.row.gbps() / ref.gbps : 0.0;
}

// Each repetition's engine pass over the slowest hop it crosses in that
// repetition.
std::vector<double> PairedRatios(const TiersOutcome& out, const E2eRow& e) {
  std::vector<double> ratios;
  for (const RepRates& r : out.reps) {
    double slowest = 0;
    for (const std::string& hop : e.crosses) {
      const double g = r.at(hop);
      if (slowest == 0 || g < slowest) slowest = g;
    }
    ratios.push_back(slowest > 0 ? r.at(e.row.hop) / slowest : 0.0);
  }
  return ratios;
}

// The median of the paired ratios (nearest rank).
double PairedEfficiency(const TiersOutcome& out, const E2eRow& e) {
  std::vector<double> ratios = PairedRatios(out, e);
  return ratios.empty() ? 0.0 : Percentile(ratios, 50);
}

nlohmann::json E2eJson(const TiersOutcome& out, const E2eRow& e) {
  const Reference ref = Slowest(out, e);
  nlohmann::json j = RowJson(e.row);
  j["crosses"] = e.crosses;
  j["slowest_hop"] = ref.hop;
  j["slowest_hop_gbps"] = ref.gbps;
  j["efficiency"] = Efficiency(out, e);
  j["paired_efficiency"] = PairedEfficiency(out, e);
  j["paired_ratios"] = PairedRatios(out, e);
  if (&e == &out.fetch) {
    j["nvme_read_bytes"] = e.pass.nvme_read_bytes;
    j["h2d_bytes"] = e.pass.h2d_bytes;
    j["fetch_hits"] = e.pass.fetch_hits;
    j["prefetch_hits"] = e.pass.prefetch_hits;
    j["cache_hits"] = e.pass.cache_hits();
    j["stall_seconds"] = e.pass.stall_seconds;
  } else {
    j["nvme_write_bytes"] = e.pass.nvme_write_bytes;
    j["d2h_bytes"] = e.pass.d2h_bytes;
  }
  return j;
}

nlohmann::json ConfigJson(const TiersConfig& c, const TiersPrepared& p) {
  return {{"size", c.size},
          {"tensor_bytes", c.shape.tensor_bytes},
          {"tensors", c.shape.tensors},
          {"dtype", "bf16"},
          {"grad_dtype", "fp32"},
          {"dir", c.dir},
          {"engine", std::string(IoBackendName(c.engine))},
          {"queue_depth", c.queue_depth},
          {"block_size", c.block_size},
          {"threads", IoEngineOptions().threads},
          {"device", c.device},
          {"device_budget_bytes", p.device_options.memory_budget_bytes},
          {"budget", c.shape.budget},
          {"budget_auto", c.auto_budget},
          {"staging_buffer_bytes", c.shape.staging_bytes},
          {"staging_buffer_count", kStagingCount},
          {"pieces_in_flight", kStagingCount},
          {"prefetch_bytes", c.shape.prefetch_bytes},
          {"persistence_threshold_bytes", 0},
          {"params_rest_on", "nvme"},
          {"grads_rest_on", "nvme"},
          {"optimizer_states_rest_on", "host"},
          {"reps", c.reps}};
}

void AddE2eRow(Table& table, const TiersOutcome& out, const E2eRow& e) {
  const Reference ref = Slowest(out, e);
  const bool fetch = &e == &out.fetch;
  table.AddRow({e.row.hop, Fixed(e.row.bytes / 1e9, 3), Fixed(e.row.seconds, 3),
                Fixed(e.row.gbps(), 3), ref.hop + " " + Fixed(ref.gbps, 3),
                Fixed(Efficiency(out, e), 3),
                Fixed(PairedEfficiency(out, e), 3),
                fetch ? std::to_string(e.pass.prefetch_hits) : "",
                fetch ? std::to_string(e.pass.cache_hits()) : "",
                fetch ? Fixed(e.pass.stall_seconds, 3) : ""});
}

void PrintTable(const TiersConfig& c, const TiersPrepared& p,
                const TiersOutcome& out) {
  Table table({"hop", "GB", "s", "GB/s", "slowest hop", "efficiency", "paired",
               "prefetched", "cached", "stall s"});
  for (const Row* r : {&out.nvme_write, &out.nvme_read, &out.h2d, &out.d2h}) {
    table.AddRow({r->hop, Fixed(r->bytes / 1e9, 3), Fixed(r->seconds, 3),
                  Fixed(r->gbps(), 3), "", "", "", "", "", ""});
  }
  AddE2eRow(table, out, out.fetch);
  AddE2eRow(table, out, out.writeback);
  std::printf(
      "strata-bench tiers: %s of bf16 parameters in %llu tensors, device %s, "
      "I/O %s qd %u block %s, device budget %s, best of %d\n%s",
      FormatBytes(c.size).c_str(),
      static_cast<unsigned long long>(c.shape.tensors),
      p.device->name().c_str(), out.io_engine.c_str(), c.queue_depth,
      FormatBytes(c.block_size).c_str(), FormatBytes(c.shape.budget).c_str(),
      c.reps, table.ToString().c_str());
  std::vector<RatioFigure> figures;
  for (const E2eRow* e : {&out.fetch, &out.writeback}) {
    figures.push_back({e->row.hop + " efficiency", Efficiency(out, *e),
                       PairedEfficiency(out, *e)});
  }
  PrintAboveOneNote(figures, "the slowest hop alone");
}

Status ReportTiers(const TiersConfig& c, TiersPrepared& p,
                   const TiersOutcome& out) {
  PrintTable(c, p, out);
  if (!p.json.active()) return Status::Ok();
  nlohmann::json results = nlohmann::json::array();
  for (const Row* r : {&out.nvme_write, &out.nvme_read, &out.h2d, &out.d2h}) {
    results.push_back(RowJson(*r));
  }
  results.push_back(E2eJson(out, out.fetch));
  results.push_back(E2eJson(out, out.writeback));
  nlohmann::json reps = nlohmann::json::array();
  for (const RepRates& r : out.reps) {
    nlohmann::json one = nlohmann::json::object();
    for (const auto& [hop, gbps] : r) one[hop + "_gbps"] = gbps;
    reps.push_back(one);
  }
  nlohmann::json j = {{"command", kCommand},
                      {"machine", MachineInfo()},
                      {"filesystem", p.filesystem},
                      {"device",
                       {{"kind", DeviceKindName(p.device->kind())},
                        {"name", p.device->name()},
                        {"why", p.why}}},
                      {"io_engine", out.io_engine},
                      {"config", ConfigJson(c, p)},
                      {"results", results},
                      {"reps", reps},
                      {"engine_stats", nlohmann::json::parse(
                                           EngineStatsJson(out.engine_stats))}};
  return p.json.Commit(j);
}

int Main(int argc, char** argv) {
  CLI::App app{
      "each hop between the tiers alone, and the engine's fetch of "
      "NVMe-resident parameters beside the slowest",
      "strata-bench tiers"};
  TiersFlags flags;
  AddOptions(app, flags);
  TiersConfig cfg;
  TiersPrepared prepared;
  return RunCommand(
      kCommand, app, argc, argv,
      [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(cfg, ParseTiers(flags));
        return Status::Ok();
      },
      [&](RunGuard& guard) -> Status {
        STRATA_ASSIGN_OR_RETURN(prepared, CheckTiers(cfg, guard));
        return Status::Ok();
      },
      [&](RunGuard&) -> Status {
        STRATA_ASSIGN_OR_RETURN(TiersOutcome out, RunTiers(cfg, prepared));
        return ReportTiers(cfg, prepared, out);
      });
}

}  // namespace

STRATA_BENCH_COMMAND("tiers",
                     "each hop between the tiers vs the engine's "
                     "end-to-end fetch",
                     Main);

}  // namespace strata::bench
