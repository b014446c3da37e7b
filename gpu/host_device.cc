// The host-emulated device: what stands in for a GPU on machines without one
// (ours, and CI), faithful in ordering so that the engine's pipelines and
// this module's policies are tested everywhere.
//
//   - Memory: one mapping of the budget's size (pages are committed when
//     touched), placed by the shared StreamOrderedPool.
//   - Streams: one executor thread each, running tasks in enqueue order. A
//     stream's native handle is its executor; WrapNativeStream of it gives a
//     second, non-owning Stream on the same executor.
//   - Host events: a wait is a task that blocks its executor until the
//     generation is reached, which stalls that stream only.
//   - Events: a record enqueues a marker with a sequence number; an event is
//     complete when the marker of its latest record has run. Completion is
//     tracked per sequence number, so a wait captured on an earlier record is
//     not released by a later record that happens to finish first.
//   - Copies: memcpy. With DeviceOptions::emulated_link_bytes_per_s each
//     direction is a link that copies occupy in turn (two streams copying
//     host-to-device share it, one each way run side by side), and a task
//     lasts until its slot on the link ends, so overlap of copies with other
//     work is observable. Copies from or to pageable memory return to the
//     caller only when done, as CUDA's do.
//   - Compute: GEMM (OpenBLAS), conversions (vector code) and
//     LaunchHostWork run on the stream's executor inside one oneTBB arena of
//     DeviceOptions::host_compute_threads (gpu/cpu_compute.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "gpu/cpu_compute.h"
#include "gpu/cpu_kernels.h"
#include "gpu/host_func.h"
#include "gpu/host_signal.h"
#include "gpu/stream_ordered_pool.h"
#include "strata/device.h"
#include "util/log.h"
#include "util/mutex.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Set on an executor thread while it runs a LaunchHostFunc or LaunchHostWork
// function. Such a function may not call the device (CUDA forbids it, see
// Device::LaunchHostFunc); the host-emulated device refuses the call, so that
// code breaking the rule fails its tests here and not only on a GPU.
thread_local bool t_in_host_func = false;

// ---- Streams ----------------------------------------------------------------

// One executor thread running tasks in order. Shared by the Stream that made
// it and the wrappers of its native handle (WrapNativeStream); the last one
// to go drains the queue and joins. Thread-safe.
class Executor {
 public:
  Executor() : thread_([this] { Run(); }) {}

  // Drains the queue, then joins.
  ~Executor() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    work_cv_.Signal();
    thread_.join();
  }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Returns the task's ticket; WaitFor(ticket) returns after it ran.
  uint64_t Enqueue(HostFunction task) {
    uint64_t ticket;
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(task));
      ticket = ++enqueued_;
    }
    work_cv_.Signal();
    return ticket;
  }

  void WaitFor(uint64_t ticket) {
    MutexLock lock(&mu_);
    while (completed_ < ticket) done_cv_.Wait(&mu_);
  }

  void WaitAll() {
    uint64_t ticket;
    {
      MutexLock lock(&mu_);
      ticket = enqueued_;
    }
    WaitFor(ticket);
  }

  // Set when the owning Stream is gone: its native handle no longer names a
  // stream that may be wrapped.
  std::atomic<bool> retired{false};

 private:
  void Run() STRATA_EXCLUDES(mu_) {
    mu_.Lock();
    for (;;) {
      while (!stop_ && queue_.empty()) work_cv_.Wait(&mu_);
      if (queue_.empty()) break;  // stop_ and drained
      HostFunction task = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      task();
      task = nullptr;  // what it captured goes before the completion shows
      mu_.Lock();
      ++completed_;
      done_cv_.SignalAll();
    }
    mu_.Unlock();
  }

  Mutex mu_;
  CondVar work_cv_;  // queue_ or stop_ changed
  CondVar done_cv_;  // completed_ grew
  std::deque<HostFunction> queue_ STRATA_GUARDED_BY(mu_);
  uint64_t enqueued_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t completed_ STRATA_GUARDED_BY(mu_) = 0;
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts in the ctor
};

// A Stream on an executor: the owner (NewStream), which drains it when
// destroyed, or a wrapper (WrapNativeStream), which does not.
class EmulatedStream final : public Stream {
 public:
  EmulatedStream(const void* owner, StreamKind kind,
                 std::shared_ptr<Executor> executor, bool owns)
      : Stream(owner, kind, DeviceKind::kHostEmulated, executor.get(), owns),
        executor_(std::move(executor)) {}
  ~EmulatedStream() override {
    if (owns_native_stream()) {
      executor_->retired = true;
      executor_->WaitAll();
    }
  }
  Executor& executor() const { return *executor_; }

 private:
  std::shared_ptr<Executor> executor_;
};

// The executors of a device's live streams by native handle, so that
// WrapNativeStream accepts exactly those. Thread-safe.
class ExecutorRegistry {
 public:
  void Add(const std::shared_ptr<Executor>& e) {
    MutexLock lock(&mu_);
    std::erase_if(executors_,
                  [](const auto& kv) { return kv.second.expired(); });
    executors_[e.get()] = e;
  }
  std::shared_ptr<Executor> Find(const void* native) {
    MutexLock lock(&mu_);
    auto it = executors_.find(native);
    if (it == executors_.end()) return nullptr;
    std::shared_ptr<Executor> e = it->second.lock();
    return e != nullptr && !e->retired ? e : nullptr;
  }

 private:
  Mutex mu_;
  std::map<const void*, std::weak_ptr<Executor>> executors_
      STRATA_GUARDED_BY(mu_);
};

// ---- Events -----------------------------------------------------------------

// The state of an event, shared with the marker tasks of its records, so an
// Event may be destroyed with records still queued (as a cudaEvent may).
// Thread-safe. Sequence numbers start at 1; 0 means "never recorded".
class EventState {
 public:
  uint64_t NextRecord() {
    MutexLock lock(&mu_);
    return ++latest_;
  }
  uint64_t latest() {
    MutexLock lock(&mu_);
    return latest_;
  }
  void MarkDone(uint64_t seq) {
    MutexLock lock(&mu_);
    done_above_.insert(seq);
    while (!done_above_.empty() && *done_above_.begin() == watermark_ + 1) {
      ++watermark_;
      done_above_.erase(done_above_.begin());
    }
    // Notified under the lock: a woken waiter may destroy the last owner
    // of this state as soon as it can observe the completion.
    cv_.SignalAll();
  }
  bool IsDone(uint64_t seq) {
    MutexLock lock(&mu_);
    return DoneLocked(seq);
  }
  void WaitDone(uint64_t seq) {
    MutexLock lock(&mu_);
    while (!DoneLocked(seq)) cv_.Wait(&mu_);
  }

 private:
  bool DoneLocked(uint64_t seq) const STRATA_REQUIRES(mu_) {
    return seq <= watermark_ || done_above_.count(seq) != 0;
  }

  Mutex mu_;
  CondVar cv_;  // a record completed
  // The latest record.
  uint64_t latest_ STRATA_GUARDED_BY(mu_) = 0;
  // Records 1..watermark_ are done.
  uint64_t watermark_ STRATA_GUARDED_BY(mu_) = 0;
  // Done records above watermark_.
  std::set<uint64_t> done_above_ STRATA_GUARDED_BY(mu_);
};

class EmulatedEvent final : public Event {
 public:
  EmulatedEvent(const void* owner, std::shared_ptr<EventState> state)
      : Event(owner, DeviceKind::kHostEmulated, state.get()),
        state_(std::move(state)) {}
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

// A HostEvent whose waits block a stream's executor (a host thread anyway),
// and only that stream. The wait tasks share its state, so an event
// destroyed (and so abandoned) with waits queued leaves nothing dangling.
class EmulatedHostEvent final : public HostEvent {
 public:
  explicit EmulatedHostEvent(const void* owner)
      : HostEvent(owner, std::make_shared<internal::HostSignal>()) {}
  using HostEvent::signal;
};

// ---- Registered host memory -------------------------------------------------

// Host ranges registered with the device: copies from or to them are
// "pinned". Shared with the registrations, which may outlive the device.
// Thread-safe.
class PinnedRanges {
 public:
  void Add(const void* p, size_t bytes) {
    MutexLock lock(&mu_);
    ranges_[Addr(p)] = Addr(p) + bytes;
  }
  void Remove(const void* p) {
    MutexLock lock(&mu_);
    ranges_.erase(Addr(p));
  }
  bool Contains(const void* p, size_t bytes) {
    MutexLock lock(&mu_);
    auto it = ranges_.upper_bound(Addr(p));
    if (it == ranges_.begin()) return false;
    --it;
    return Addr(p) + bytes <= it->second;
  }

 private:
  static uintptr_t Addr(const void* p) {
    return reinterpret_cast<uintptr_t>(p);
  }
  Mutex mu_;
  // start -> end
  std::map<uintptr_t, uintptr_t> ranges_ STRATA_GUARDED_BY(mu_);
};

class HostRegistrationRecord final : public HostRegistration {
 public:
  HostRegistrationRecord(std::shared_ptr<PinnedRanges> ranges, const void* p,
                         size_t bytes)
      : ranges_(std::move(ranges)), p_(p) {
    ranges_->Add(p, bytes);
  }
  ~HostRegistrationRecord() override { ranges_->Remove(p_); }

 private:
  std::shared_ptr<PinnedRanges> ranges_;
  const void* p_;
};

// ---- The emulated link ------------------------------------------------------

// One direction of the link. A copy occupies it from max(now, when the
// previous copy's slot ends) for latency + bytes / rate. Thread-safe.
class Link {
 public:
  // Returns when the copy's slot ends; Clock::time_point{} for "unthrottled".
  Clock::time_point Reserve(uint64_t bytes, uint64_t bytes_per_s,
                            uint64_t latency_ns) {
    if (bytes_per_s == 0 && latency_ns == 0) return {};
    const double seconds =
        bytes_per_s == 0
            ? 0.0
            : static_cast<double>(bytes) / static_cast<double>(bytes_per_s);
    const auto duration = std::chrono::nanoseconds(latency_ns) +
                          std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(seconds));
    MutexLock lock(&mu_);
    const auto start = std::max(Clock::now(), busy_until_);
    busy_until_ = start + duration;
    return busy_until_;
  }

 private:
  Mutex mu_;
  Clock::time_point busy_until_ STRATA_GUARDED_BY(mu_) = {};
};

// ---- The device -------------------------------------------------------------

class HostEmulatedDevice final : public Device {
 public:
  HostEmulatedDevice(const DeviceOptions& options, HostBuffer region)
      : options_(options),
        region_(std::move(region)),
        pool_(this, region_.data(), region_.size(), "host-emulated device"),
        pinned_(std::make_shared<PinnedRanges>()),
        compute_(options.host_compute_threads) {}

  DeviceKind kind() const override { return DeviceKind::kHostEmulated; }
  std::string name() const override {
    std::string s = "host-emulated";
    if (options_.emulated_link_bytes_per_s != 0) {
      s += " (link " +
           std::to_string(options_.emulated_link_bytes_per_s / 1000000) +
           " MB/s per direction)";
    }
    return s;
  }

  StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) override {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    auto executor = std::make_shared<Executor>();
    executors_.Add(executor);
    return std::unique_ptr<Stream>(
        new EmulatedStream(this, options.kind, std::move(executor), true));
  }
  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    return std::unique_ptr<Event>(
        new EmulatedEvent(this, std::make_shared<EventState>()));
  }

  StatusOr<std::unique_ptr<Stream>> WrapNativeStream(void* native,
                                                     StreamKind kind) override {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    std::shared_ptr<Executor> executor = executors_.Find(native);
    if (executor == nullptr) {
      char p[32];
      std::snprintf(p, sizeof p, "%p", native);
      return Status::InvalidArgument(
          std::string("WrapNativeStream: ") + p +
          " is not the native handle of a live stream of this host-emulated "
          "device");
    }
    return std::unique_ptr<Stream>(
        new EmulatedStream(this, kind, std::move(executor), false));
  }

  StatusOr<std::unique_ptr<HostEvent>> NewHostEvent() override {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    return std::unique_ptr<HostEvent>(new EmulatedHostEvent(this));
  }
  Status WaitHostEvent(Stream& stream, const HostEvent& event,
                       uint64_t generation) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    STRATA_ASSIGN_OR_RETURN(const EmulatedHostEvent* e, Mine(event));
    STRATA_ASSIGN_OR_RETURN(bool must_wait, e->signal()->BeginWait(generation));
    if (!must_wait) return Status::Ok();
    s->executor().Enqueue(
        [signal = e->signal(), generation] { signal->WaitFor(generation); });
    return Status::Ok();
  }

  Status RecordEvent(Event& event, Stream& stream) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    STRATA_ASSIGN_OR_RETURN(EmulatedEvent * e, Mine(event));
    std::shared_ptr<EventState> state = e->state();
    const uint64_t seq = state->NextRecord();
    s->executor().Enqueue([state, seq] { state->MarkDone(seq); });
    return Status::Ok();
  }
  Status WaitEvent(Stream& stream, const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    STRATA_ASSIGN_OR_RETURN(EmulatedEvent * e, Mine(event));
    std::shared_ptr<EventState> state = e->state();
    const uint64_t seq = state->latest();
    if (seq == 0) return Status::Ok();  // never recorded: nothing to wait for
    s->executor().Enqueue([state, seq] { state->WaitDone(seq); });
    return Status::Ok();
  }
  StatusOr<bool> QueryEvent(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedEvent * e, Mine(event));
    return e->state()->IsDone(e->state()->latest());
  }
  Status SynchronizeEvent(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedEvent * e, Mine(event));
    e->state()->WaitDone(e->state()->latest());
    return Status::Ok();
  }
  Status SynchronizeStream(Stream& stream) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    s->executor().WaitAll();
    return Status::Ok();
  }
  Status LaunchHostFunc(Stream& stream, HostFunction fn) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    if (!fn) return Status::InvalidArgument("LaunchHostFunc: empty function");
    s->executor().Enqueue([fn = std::move(fn)]() mutable {
      t_in_host_func = true;
      internal::RunHostFunction(fn);
      fn = nullptr;  // what it captured is destroyed under the same rules
      t_in_host_func = false;
    });
    return Status::Ok();
  }
  Status LaunchHostWork(Stream& stream, HostFunction fn) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    if (!fn) return Status::InvalidArgument("LaunchHostWork: empty function");
    // The executor is a host thread of this stream alone, so it may run
    // long work itself; the arena bounds the threads `fn` fans out to.
    s->executor().Enqueue([this, fn = std::move(fn)]() mutable {
      t_in_host_func = true;
      HostFunction body = [&fn] { internal::RunHostFunction(fn); };
      compute_.Run(body);
      fn = nullptr;
      t_in_host_func = false;
    });
    return Status::Ok();
  }

  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) override {
    STRATA_RETURN_IF_ERROR(Mine(stream).status());
    return pool_.Allocate(bytes, stream);
  }
  StatusOr<DeviceMemory> TryAllocate(size_t bytes, Stream& stream) override {
    STRATA_RETURN_IF_ERROR(Mine(stream).status());
    return pool_.TryAllocate(bytes, stream);
  }
  StatusOr<ExternalDeviceMemory> RegisterExternalMemory(void* data,
                                                        size_t bytes) override {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    return pool_.RegisterExternal(data, bytes);
  }
  DeviceMemoryStats memory_stats() const override { return pool_.stats(); }

  Status RegisterHostBuffer(HostBuffer& buffer) override {
    if (buffer.empty()) return Status::Ok();
    buffer.AttachRegistration(std::make_unique<HostRegistrationRecord>(
        pinned_, buffer.data(), buffer.size()));
    return Status::Ok();
  }

  Status CopyAsync(Stream& stream, void* dst, const void* src, size_t bytes,
                   CopyKind kind) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    if (bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(pool_.CheckCopy(dst, src, bytes, kind));
    const void* host = nullptr;  // the host end, if any
    Link* link = nullptr;        // the link direction it crosses
    if (kind == CopyKind::kHostToDevice) {
      host = src;
      link = &h2d_;
    } else if (kind == CopyKind::kDeviceToHost) {
      host = dst;
      link = &d2h_;
    }
    const bool pinned = host == nullptr || pinned_->Contains(host, bytes);
    uint64_t rate = options_.emulated_link_bytes_per_s;
    if (!pinned && options_.emulated_pageable_bytes_per_s != 0) {
      rate = options_.emulated_pageable_bytes_per_s;
    }
    const uint64_t latency = options_.emulated_copy_latency_ns;
    const uint64_t ticket = s->executor().Enqueue([=] {
      const Clock::time_point end = link != nullptr
                                        ? link->Reserve(bytes, rate, latency)
                                        : Clock::time_point{};
      std::memmove(dst, src, bytes);
      if (end != Clock::time_point{}) std::this_thread::sleep_until(end);
    });
    // Pageable memory: the caller may reuse it on return (CUDA's contract).
    if (!pinned) s->executor().WaitFor(ticket);
    return Status::Ok();
  }

  Status MemsetAsync(Stream& stream, void* dst, uint8_t value,
                     size_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    if (bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(pool_.CheckInside(dst, bytes, "memset destination"));
    s->executor().Enqueue([=] { std::memset(dst, value, bytes); });
    return Status::Ok();
  }

  Status ConvertAsync(Stream& stream, const ConvertArgs& args) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    if (args.count == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(pool_.CheckConvert(args));
    s->executor().Enqueue([this, args] { compute_.Convert(args); });
    return Status::Ok();
  }

  Status GemmAsync(Stream& stream, const GemmArgs& args) override {
    STRATA_ASSIGN_OR_RETURN(EmulatedStream * s, Mine(stream));
    STRATA_RETURN_IF_ERROR(pool_.CheckGemm(args));
    if (args.m == 0 || args.n == 0) return Status::Ok();
    s->executor().Enqueue([this, args] { compute_.Gemm(args); });
    return Status::Ok();
  }

 private:
  static Status NotFromHostFunc() {
    if (!t_in_host_func) return Status::Ok();
    return Status::FailedPrecondition(
        "a device call from inside a LaunchHostFunc function (CUDA forbids "
        "it; see Device::LaunchHostFunc)");
  }
  StatusOr<EmulatedStream*> Mine(Stream& stream) const {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    if (stream.owner() != this) {
      return Status::InvalidArgument(
          "stream belongs to another device than host-emulated");
    }
    return static_cast<EmulatedStream*>(&stream);
  }
  StatusOr<EmulatedEvent*> Mine(const Event& event) const {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    if (event.owner() != this) {
      return Status::InvalidArgument(
          "event belongs to another device than host-emulated");
    }
    return static_cast<EmulatedEvent*>(const_cast<Event*>(&event));
  }
  StatusOr<const EmulatedHostEvent*> Mine(const HostEvent& event) const {
    STRATA_RETURN_IF_ERROR(NotFromHostFunc());
    if (event.owner() != this) {
      return Status::InvalidArgument(
          "host event belongs to another device than host-emulated");
    }
    return static_cast<const EmulatedHostEvent*>(&event);
  }

  const DeviceOptions options_;
  HostBuffer region_;  // the "device memory"
  Link h2d_;
  Link d2h_;
  // Declared after region_: waits for pending frees before it is unmapped.
  internal::StreamOrderedPool pool_;
  std::shared_ptr<PinnedRanges> pinned_;
  ExecutorRegistry executors_;
  // Used by tasks on the executors, which finish before the device goes.
  internal::CpuCompute compute_;
};

}  // namespace

StatusOr<std::unique_ptr<Device>> NewHostEmulatedDevice(
    const DeviceOptions& options) {
  if (options.host_compute_threads < 0) {
    return Status::InvalidArgument(
        "DeviceOptions::host_compute_threads is " +
        std::to_string(options.host_compute_threads) +
        "; expected 0 (all CPUs) or a positive thread count");
  }
  const uint64_t budget = options.memory_budget_bytes != 0
                              ? options.memory_budget_bytes
                              : uint64_t{1} << 30;
  HostBufferOptions region_options;
  region_options.pin = false;  // it stands for device memory
  // Transparent huge pages, as a GPU maps its memory in large pages: a copy
  // or a collective into 4 KiB pages ran about 40% slower here (pages are
  // still committed only as they are used, 2 MiB at a time).
  region_options.huge_pages = true;
  auto region = HostBuffer::Allocate(budget, region_options);
  if (!region.ok()) {
    return std::move(region).status().WithContext(
        "host-emulated device memory budget");
  }
  return std::unique_ptr<Device>(
      new HostEmulatedDevice(options, std::move(*region)));
}

}  // namespace strata
