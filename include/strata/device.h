// The device interface: everything strata does on a GPU goes through it, so
// the tier manager, the prefetcher and the optimizer pipeline are the same
// code with or without a GPU.
//
// Backends:
//   - CUDA (NewCudaDevice): device memory in one arena under a byte budget,
//     cudaStreams, cudaEvents, cudaMemcpyAsync, conversion kernels, cuBLAS
//     (loaded at run time, see GemmAsync).
//   - Host-emulated (NewHostEmulatedDevice): "device" memory is host memory
//     under the same budget, every stream is an in-order executor thread,
//     events behave as CUDA's, copies are memcpy optionally throttled to a
//     link bandwidth and latency, so that overlap is observable anywhere;
//     GEMM runs on OpenBLAS and conversions on vector code, over
//     DeviceOptions::host_compute_threads threads.
//   - DeviceWrapper forwards every call; it is the base for test doubles.
//
// Device memory is stream-ordered (docs/gpu.md, Note [Stream-ordered reuse]):
// a block handed back by ~DeviceMemory returns to the free list only after
// every stream that used it (the allocation stream plus those named with
// DeviceMemory::RecordUse) has completed the work enqueued before the free.
//
// This header includes no CUDA header; streams and events are opaque, and
// their native handles are `void*` (strata/device_cuda.h, which includes the
// CUDA headers, offers typed helpers: WrapCudaStream, CudaStreamOf...).
//
// Lifetimes: Streams, Events, HostEvents, DeviceMemory and
// ExternalDeviceMemory made by a device must be destroyed before it, and work
// enqueued through a wrapped native stream must be complete by then. A stream
// named in DeviceMemory::RecordUse (or used to allocate) must outlive that
// DeviceMemory.
#ifndef STRATA_DEVICE_H_
#define STRATA_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "strata/export.h"
#include "strata/host_buffer.h"
#include "strata/status.h"

namespace strata {

class Device;
namespace internal {
class StreamOrderedPool;
class HostSignal;
}  // namespace internal

enum class DeviceKind : uint8_t { kHostEmulated, kCuda };
// "host-emulated" or "cuda".
STRATA_EXPORT std::string_view DeviceKindName(DeviceKind kind);

// Element types of conversions and GEMM.
enum class ElementType : uint8_t { kFloat32, kFloat16, kBFloat16 };
STRATA_EXPORT size_t ElementSize(ElementType type);  // bytes: 4, 2, 2
STRATA_EXPORT std::string_view ElementTypeName(ElementType type);

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };
STRATA_EXPORT std::string_view CopyKindName(CopyKind kind);  // "h2d"...

// A move-only std::function (C++23's std::move_only_function, in C++20):
// it holds callables that cannot be copied, such as a lambda that captures a
// std::promise, a std::unique_ptr or a pin. Empty when default-constructed,
// moved from, or made from a null function pointer or an empty
// std::function. Calling an empty one is undefined. Thread-compatible.
template <class Signature>
class MoveOnlyFunction;

template <class R, class... Args>
class MoveOnlyFunction<R(Args...)> {
 public:
  MoveOnlyFunction() noexcept = default;
  MoveOnlyFunction(std::nullptr_t) noexcept {}  // NOLINT: as std::function
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, MoveOnlyFunction> &&
           std::is_invocable_r_v<R, std::decay_t<F>&, Args...>)
      MoveOnlyFunction(F&& f) {  // NOLINT: implicit, as std::function
    using D = std::decay_t<F>;
    if constexpr (std::is_pointer_v<D> || std::is_member_pointer_v<D> ||
                  IsFunctionWrapper<D>::value) {
      if (!f) return;
    }
    impl_ = std::make_unique<Impl<D>>(std::forward<F>(f));
  }
  MoveOnlyFunction(MoveOnlyFunction&&) noexcept = default;
  MoveOnlyFunction& operator=(MoveOnlyFunction&&) noexcept = default;
  MoveOnlyFunction(const MoveOnlyFunction&) = delete;
  MoveOnlyFunction& operator=(const MoveOnlyFunction&) = delete;
  ~MoveOnlyFunction() = default;

  explicit operator bool() const noexcept { return impl_ != nullptr; }
  R operator()(Args... args) {
    return impl_->Call(std::forward<Args>(args)...);
  }

 private:
  template <class T>
  struct IsFunctionWrapper : std::false_type {};
  template <class S>
  struct IsFunctionWrapper<std::function<S>> : std::true_type {};
  template <class S>
  struct IsFunctionWrapper<MoveOnlyFunction<S>> : std::true_type {};

  struct Base {
    virtual ~Base() = default;
    virtual R Call(Args... args) = 0;
  };
  template <class F>
  struct Impl final : Base {
    template <class G>
    explicit Impl(G&& g) : f(std::forward<G>(g)) {}
    R Call(Args... args) override {
      return std::invoke(f, std::forward<Args>(args)...);
    }
    F f;
  };
  std::unique_ptr<Base> impl_;
};

// What Device::LaunchHostFunc runs.
using HostFunction = MoveOnlyFunction<void()>;

// Copy streams carry transfers (CUDA: created with the highest priority so the
// few kernels they run are not queued behind long compute kernels); compute
// streams carry kernels. Both accept every operation.
enum class StreamKind : uint8_t { kCompute, kCopy };

struct StreamOptions {
  StreamKind kind = StreamKind::kCompute;
};

// An in-order queue of device work. Made by Device::NewStream, whose stream
// owns its native queue and whose destruction waits for its queued work to
// finish; or by Device::WrapNativeStream, a non-owning wrapper of a native
// queue made elsewhere (e.g. PyTorch's current stream), whose destruction
// neither waits nor destroys the native queue. Thread-safe: operations
// enqueued from several threads run in the order the enqueue calls returned.
class STRATA_EXPORT Stream {
 public:
  virtual ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamKind kind() const noexcept { return kind_; }
  // The backend device that made this stream (for ownership checks).
  const void* owner() const noexcept { return owner_; }
  // The backend of that device.
  DeviceKind device_kind() const noexcept { return device_kind_; }
  // The native queue. CUDA: its cudaStream_t (null for the legacy default
  // stream). Host-emulated: an opaque handle of the stream's executor thread,
  // which only WrapNativeStream of the same device accepts. Valid while the
  // owning Stream lives.
  void* native_handle() const noexcept { return native_; }
  // False for a wrapper made by Device::WrapNativeStream.
  bool owns_native_stream() const noexcept { return owns_native_; }

 protected:
  Stream(const void* owner, StreamKind kind, DeviceKind device_kind,
         void* native, bool owns_native)
      : owner_(owner),
        kind_(kind),
        device_kind_(device_kind),
        native_(native),
        owns_native_(owns_native) {}

 private:
  const void* owner_;
  StreamKind kind_;
  DeviceKind device_kind_;
  void* native_;
  bool owns_native_;
};

// A marker in a stream, as a cudaEvent: complete when the work enqueued
// before its most recent record has finished; never recorded = complete.
// Made by Device::NewEvent. Thread-safe.
class STRATA_EXPORT Event {
 public:
  virtual ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  const void* owner() const noexcept { return owner_; }
  DeviceKind device_kind() const noexcept { return device_kind_; }
  // CUDA: the cudaEvent_t (created with cudaEventDisableTiming and
  // cudaEventBlockingSync; strata records and destroys it, a caller may
  // record it too or make its own streams wait on it). Host-emulated: an
  // opaque handle of the event's state. Valid while this Event lives.
  void* native_handle() const noexcept { return native_; }

 protected:
  Event(const void* owner, DeviceKind device_kind, void* native)
      : owner_(owner), device_kind_(device_kind), native_(native) {}

 private:
  const void* owner_;
  DeviceKind device_kind_;
  void* native_;
};

// A flag that host code raises and streams wait on, so that work on a stream
// can wait for long CPU work (an optimizer step on a oneTBB worker) without a
// host function blocking a callback thread. Made by Device::NewHostEvent.
//
// It counts generations: it starts at generation 0, Signal(g) raises it to g
// (never lowers it), and Device::WaitHostEvent(stream, event, g) makes work
// enqueued on the stream afterwards wait until the generation is at least g.
// Reuse it across steps by waiting for and signalling step numbers; nothing
// needs resetting. A generation waited for must be less than 2^31 above the
// generation signalled at the time of the wait.
//
// Abandon() releases every wait, present and future, as if signalled: for
// shutdown and error paths, so that no stream waits forever (the work after
// the wait then runs on whatever the host left in memory). There is no
// timeout: a stream waits until Signal or Abandon, and SynchronizeStream on
// it blocks meanwhile (other streams go on).
//
// Destruction abandons, so a stream still waiting is released and never
// hangs or reads freed memory; still, destroy an event only once its waits
// have been signalled or its streams drained, or the work after the waits
// runs early.
//
// Thread-safe; Signal, Abandon and the accessors never block for long, call
// no device API, and may be called from any thread, including a function
// given to LaunchHostFunc.
class STRATA_EXPORT HostEvent {
 public:
  virtual ~HostEvent();
  HostEvent(const HostEvent&) = delete;
  HostEvent& operator=(const HostEvent&) = delete;

  void Signal(uint64_t generation) noexcept;
  void Abandon() noexcept;
  // The highest generation signalled so far.
  uint64_t generation() const noexcept;
  bool abandoned() const noexcept;
  const void* owner() const noexcept { return owner_; }

 protected:
  HostEvent(const void* owner, std::shared_ptr<internal::HostSignal> signal);
  // The backend's state, shared with its queued waits.
  const std::shared_ptr<internal::HostSignal>& signal() const noexcept {
    return signal_;
  }

 private:
  const void* owner_;
  std::shared_ptr<internal::HostSignal> signal_;
};

namespace internal {

// The address range of DeviceMemory and ExternalDeviceMemory.
class DeviceRange {
 public:
  // The device address (a host address on the host-emulated device). Null
  // when empty.
  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  // data() + offset, as bytes. REQUIRES: offset <= size().
  std::byte* at(size_t offset) const noexcept {
    return static_cast<std::byte*>(data_) + offset;
  }

 protected:
  DeviceRange() noexcept = default;
  ~DeviceRange() = default;
  DeviceRange(const DeviceRange&) = default;
  DeviceRange& operator=(const DeviceRange&) = default;

  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace internal

// A block of device memory; move-only. Destruction (or Reset) frees it in
// stream order: the block is handed out again only after the allocation
// stream and every stream named in RecordUse have completed the work they
// had been given before the free. Thread-compatible.
// data() is aligned to 256 bytes; size() is the bytes asked for (the block
// may be larger, rounded to 256 bytes).
class STRATA_EXPORT DeviceMemory final : public internal::DeviceRange {
 public:
  DeviceMemory() noexcept = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory() { Reset(); }

  // Records that work on `stream` uses this memory, so that reuse after the
  // free also waits for it (PyTorch's recordStream). Call it any time before
  // the free; recording the allocation stream again is harmless.
  void RecordUse(Stream& stream);

  // Frees the block (stream-ordered, see above). The object becomes empty.
  void Reset() noexcept;

 private:
  friend class internal::StreamOrderedPool;

  internal::StreamOrderedPool* pool_ = nullptr;
  uint64_t offset_ = 0;           // in the pool's region
  uint64_t reserved_ = 0;         // bytes taken from the pool (size_ rounded)
  std::vector<Stream*> streams_;  // streams whose work must finish first
};

// Device memory that strata did not allocate (a PyTorch tensor's storage),
// registered with a device by Device::RegisterExternalMemory so that its
// CopyAsync, MemsetAsync, ConvertAsync and GemmAsync accept pointers into it
// as device memory. Move-only; destruction (or Reset) unregisters the range.
// The registration only admits the range to those calls: it neither frees
// the memory nor orders anything, and unregistering does not wait for work
// already enqueued. REQUIRES: the memory stays allocated while registered
// and until work enqueued on it completes (the owner's allocator, e.g. with
// PyTorch's recordStream, governs that). Thread-compatible.
class STRATA_EXPORT ExternalDeviceMemory final : public internal::DeviceRange {
 public:
  ExternalDeviceMemory() noexcept = default;
  ExternalDeviceMemory(const ExternalDeviceMemory&) = delete;
  ExternalDeviceMemory& operator=(const ExternalDeviceMemory&) = delete;
  ExternalDeviceMemory(ExternalDeviceMemory&& other) noexcept;
  ExternalDeviceMemory& operator=(ExternalDeviceMemory&& other) noexcept;
  ~ExternalDeviceMemory() { Reset(); }

  // Unregisters the range. The object becomes empty.
  void Reset() noexcept;

 private:
  friend class internal::StreamOrderedPool;

  internal::StreamOrderedPool* pool_ = nullptr;
};

// Counters of the device memory pool. Bytes are SUM gauges unless marked
// COUNT; all are for this device object's lifetime.
struct DeviceMemoryStats {
  uint64_t budget_bytes = 0;        // the pool's size
  uint64_t in_use_bytes = 0;        // handed out now (rounded sizes)
  uint64_t peak_in_use_bytes = 0;   // high-water mark of in_use_bytes
  uint64_t pending_free_bytes = 0;  // freed, waiting for streams to finish
  uint64_t free_bytes = 0;          // reusable now
  uint64_t largest_free_block = 0;  // bytes; bounds the largest Allocate
  uint64_t allocations = 0;         // COUNT of successful Allocate/TryAllocate
  uint64_t frees = 0;               // COUNT of freed blocks
  // COUNT of kOutOfMemory results of Allocate and TryAllocate.
  uint64_t failed_allocations = 0;
  uint64_t reuse_waits = 0;  // COUNT of Allocate's host waits on pending frees
  // COUNT of TryAllocate's kBusy results (it would have had to wait).
  uint64_t busy_allocations = 0;
  uint64_t external_ranges = 0;  // ExternalDeviceMemory registered now
};

// out = convert(in * scale), element-wise, for `count` elements. The product
// is computed in fp32 (one rounding), then rounded to the output type with
// round-to-nearest-even; overflow gives +-inf, NaN gives the canonical NaN.
// Both pointers are device memory (the pool's or a registered
// ExternalDeviceMemory's); they must not overlap unless equal and the types
// have the same size.
struct ConvertArgs {
  const void* src = nullptr;
  ElementType src_type = ElementType::kFloat32;
  void* dst = nullptr;
  ElementType dst_type = ElementType::kFloat16;
  size_t count = 0;    // elements
  float scale = 1.0f;  // e.g. the loss scale, or 1/loss scale to unscale
};

enum class GemmOp : uint8_t { kNoTranspose, kTranspose };

// C = alpha * op(A) * op(B) + beta * C with BLAS's column-major convention:
// element (i, j) of a matrix with leading dimension ld is at i + j * ld.
// op(A) is m x k, op(B) is k x n, C is m x n. A and B have the same type;
// C has that type or kFloat32. Products accumulate in fp32. When beta is 0,
// C is not read (NaNs in it do not propagate). All pointers are device memory
// (the pool's or registered ExternalDeviceMemory).
struct GemmArgs {
  GemmOp op_a = GemmOp::kNoTranspose;
  GemmOp op_b = GemmOp::kNoTranspose;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  float beta = 0.0f;
  ElementType ab_type = ElementType::kFloat32;
  ElementType c_type = ElementType::kFloat32;
  const void* a = nullptr;
  int64_t lda = 0;  // >= rows of A as stored: m (kNoTranspose) or k
  const void* b = nullptr;
  int64_t ldb = 0;  // >= k (kNoTranspose) or n
  void* c = nullptr;
  int64_t ldc = 0;  // >= m
};

// Which backend NewDevice builds.
enum class DeviceChoice : uint8_t {
  kAuto,          // CUDA when a device works, else host-emulated
  kCuda,          // CUDA or an Unavailable error
  kHostEmulated,  // always the host-emulated device
};

struct DeviceOptions {
  // kAuto defers to the environment variable STRATA_DEVICE (auto, cuda or
  // host) when it is set; an explicit choice here wins over it.
  DeviceChoice choice = DeviceChoice::kAuto;

  // Bytes of device memory this device may hand out. 0 = automatic: for CUDA
  // the free memory at creation minus cuda_reserve_bytes; for the
  // host-emulated device 1 GiB (address space; pages are used when touched).
  uint64_t memory_budget_bytes = 0;

  // ---- CUDA ----
  int cuda_ordinal = 0;  // which GPU
  // Bytes left outside the budget when it is automatic, for the CUDA
  // context, cuBLAS workspaces and kernels' own needs. Default 1 GiB.
  uint64_t cuda_reserve_bytes = uint64_t{1} << 30;

  // ---- Host-emulated ----
  // Bandwidth of each direction of the emulated link, bytes/s; the two
  // directions are independent (full duplex) and streams copying in the same
  // direction share it. 0 = unthrottled (memcpy speed). PCIe Gen4 x16 is
  // about 25e9.
  uint64_t emulated_link_bytes_per_s = 0;
  // Bandwidth for copies from or to pageable (unregistered) host memory,
  // bytes/s. 0 = same as emulated_link_bytes_per_s.
  uint64_t emulated_pageable_bytes_per_s = 0;
  // Fixed cost of each host<->device copy on the link, nanoseconds. Default 0.
  uint64_t emulated_copy_latency_ns = 0;
  // Threads that the device's compute (GEMM, conversions, LaunchHostWork)
  // may use at once, the stream's own thread included: a oneTBB arena of
  // this concurrency, whose workers come from the process's one oneTBB pool
  // (the CPU optimizer's too), so the two do not oversubscribe the cores.
  // 0 = oneTBB's default, the CPUs in the process's affinity mask.
  // Negative is kInvalidArgument.
  int host_compute_threads = 0;
};

// A device: memory under a budget, pinned host memory, streams, events and
// work on streams. Thread-safe: every method may be called from any thread.
// Methods ending in Async only enqueue; their errors about arguments come
// back at once, while a CUDA failure during execution may surface from a
// later synchronization. Host code joins a stream's order in three ways:
// LaunchHostFunc for quick callbacks, LaunchHostWork for long CPU work (the
// host-emulated device's own kernels, an optimizer step), and HostEvents for
// work the host schedules itself.
class STRATA_EXPORT Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  // Human-readable identity, e.g. "cuda:0 (NVIDIA H100, sm_90)".
  virtual std::string name() const = 0;

  // ---- Streams and events ----
  virtual StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) = 0;
  virtual StatusOr<std::unique_ptr<Event>> NewEvent() = 0;
  // Marks the current end of `stream`'s queue; supersedes earlier records.
  virtual Status RecordEvent(Event& event, Stream& stream) = 0;
  // Work enqueued on `stream` after this call waits for `event`'s most
  // recent record at the time of this call (later records do not matter).
  // The host does not wait.
  virtual Status WaitEvent(Stream& stream, const Event& event) = 0;
  // True when the event is complete. Never blocks.
  virtual StatusOr<bool> QueryEvent(const Event& event) = 0;
  // Blocks the calling thread until the event is complete.
  virtual Status SynchronizeEvent(const Event& event) = 0;
  // Blocks the calling thread until all work enqueued on `stream` is done.
  virtual Status SynchronizeStream(Stream& stream) = 0;
  // Runs `fn` on a host thread when the work enqueued before it is done;
  // work enqueued after waits for `fn` to return (cudaLaunchHostFunc).
  // CUDA's rules hold on every backend:
  //   - `fn` must not call this Device, nor any CUDA API;
  //   - `fn` and what it captures are destroyed on that thread, so it must
  //     not hold the last reference to a DeviceMemory, a registered
  //     HostBuffer, a Stream or an Event (their destructors call the device);
  //   - `fn` should return quickly: host functions of different streams may
  //     run one at a time on one thread;
  //   - after a device error that ends the context, `fn` may never run.
  // An exception thrown by `fn` is logged and dropped. `fn` may be move-only
  // (a lambda that captures a std::promise); an empty one is
  // kInvalidArgument. For long host work, use LaunchHostWork or a HostEvent.
  virtual Status LaunchHostFunc(Stream& stream, HostFunction fn) = 0;
  // Runs `fn`, host work that may take long (a CPU kernel, an optimizer
  // step), in stream order: it starts once the work enqueued on `stream`
  // before it is done, and work enqueued after it waits until it returns.
  // Unlike a host function, it does not run on a callback thread:
  //   Host-emulated: on the stream's own thread, inside the device's compute
  //   arena, so oneTBB algorithms in `fn` use up to
  //   DeviceOptions::host_compute_threads threads. This is how CPU kernels
  //   run on the host-emulated device, on its memory directly.
  //   CUDA: on a worker thread the device owns. A host function only hands
  //   `fn` to the worker, and the stream then waits on a HostEvent that the
  //   worker signals when `fn` returns, so no CUDA callback thread ever
  //   blocks. Host work of all streams runs on that one thread, in the order
  //   the streams reach it.
  // Otherwise LaunchHostFunc's rules hold: `fn` must not call this Device
  // (the host-emulated device refuses it on the stream's thread), what it
  // captures is destroyed on the thread that ran it and so must not hold the
  // last reference to device objects, and an exception it throws is logged
  // and dropped (the stream goes on). kInvalidArgument for an empty `fn`.
  // Default: kNotSupported. CUDA: kNotSupported when NewHostEvent is.
  virtual Status LaunchHostWork(Stream& stream, HostFunction fn);

  // ---- Native streams and events ----
  // A Stream that enqueues on `native`, a queue made outside this Device,
  // without owning it: destroying the wrapper neither waits for the queue nor
  // destroys it (call SynchronizeStream first when that is wanted). Every
  // Device call accepts it, including WaitHostEvent and, for DeviceMemory,
  // RecordUse. REQUIRES: the native queue outlives the wrapper.
  //   CUDA: a cudaStream_t of this device's GPU, or null / cudaStreamLegacy
  //   for the legacy default stream (PyTorch's default "current stream").
  //   cudaStreamPerThread is refused (it names another stream on every
  //   thread), as is a stream of another GPU (kInvalidArgument).
  //   Host-emulated: the native_handle() of a live Stream of this device;
  //   the wrapper is a second Stream on the same executor, so work enqueued
  //   through either runs in one order. Anything else is kInvalidArgument.
  virtual StatusOr<std::unique_ptr<Stream>> WrapNativeStream(
      void* native, StreamKind kind) = 0;

  // ---- Host-signalled events (see HostEvent) ----
  // CUDA: kNotSupported with the reason when the driver lacks stream memory
  // operations or the GPU cannot map host memory (docs/gpu.md).
  virtual StatusOr<std::unique_ptr<HostEvent>> NewHostEvent() = 0;
  // Work enqueued on `stream` after this call waits until `event` reaches
  // `generation` (or is abandoned). The host does not wait. A generation
  // already reached, or an abandoned event, enqueues nothing. kInvalidArgument
  // when `generation` is 2^31 or more above event.generation().
  virtual Status WaitHostEvent(Stream& stream, const HostEvent& event,
                               uint64_t generation) = 0;

  // ---- Memory ----
  // `bytes` of device memory whose first user is `stream`. kOutOfMemory
  // when the budget cannot hold it even after waiting for pending frees; the
  // message says what was asked, what is free and the budget. bytes == 0
  // gives an empty DeviceMemory.
  virtual StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) = 0;
  // As Allocate, but returns at once and never waits on a stream: the block;
  // kBusy when it does not fit now but could once pending frees complete
  // (free plus pending bytes cover the request; retry later, evict, or call
  // Allocate to wait); kOutOfMemory when it cannot fit even then.
  virtual StatusOr<DeviceMemory> TryAllocate(size_t bytes, Stream& stream) = 0;
  virtual DeviceMemoryStats memory_stats() const = 0;

  // Admits [data, data + bytes), device memory that strata did not allocate,
  // to this device's copies, memsets, conversions and GEMMs (see
  // ExternalDeviceMemory). The checks that protect a CUDA context hold for it
  // as for the pool: kInvalidArgument for a null or empty range, one whose
  // end wraps around, one that overlaps the pool or another registered range
  // (register the enclosing allocation once), and, on every call, for
  // operands that straddle the range's end, overlap or are misaligned.
  //   CUDA: the first and last byte must be device (or managed) memory of
  //   this GPU, as cudaPointerGetAttributes says.
  //   Host-emulated: host memory the caller declares device memory; copies
  //   then treat it as the device end, and refuse it as a host end.
  virtual StatusOr<ExternalDeviceMemory> RegisterExternalMemory(
      void* data, size_t bytes) = 0;

  // Exact-size page-locked host memory registered with this device (CUDA:
  // cudaHostRegister), so copies from and to it are truly asynchronous. The
  // registration is released with the buffer. Default: HostBuffer::Allocate
  // then RegisterHostBuffer.
  virtual StatusOr<HostBuffer> AllocatePinnedHost(
      size_t bytes, const HostBufferOptions& options);
  // Registers an existing buffer (e.g. a swap tier's bounce buffer) with this
  // device; replaces any earlier registration of that buffer (on failure the
  // buffer is left unregistered). REQUIRES: no copy of the buffer is in
  // flight.
  virtual Status RegisterHostBuffer(HostBuffer& buffer) = 0;

  // ---- Work on a stream ----
  // Device ends are the pool's memory or registered ExternalDeviceMemory;
  // host ends are neither. Host memory must stay valid until the copy
  // completes. Copies from or to
  // unregistered (pageable) host memory return only once the host memory may
  // be reused, as CUDA's do; registered ones return at once.
  virtual Status CopyAsync(Stream& stream, void* dst, const void* src,
                           size_t bytes, CopyKind kind) = 0;
  virtual Status MemsetAsync(Stream& stream, void* dst, uint8_t value,
                             size_t bytes) = 0;
  virtual Status ConvertAsync(Stream& stream, const ConvertArgs& args) = 0;
  // (Optional) Default: NotSupported. CUDA: cuBLAS, Unavailable when
  // libcublas cannot be loaded. Host-emulated: OpenBLAS sgemm in panels over
  // DeviceOptions::host_compute_threads threads; 16-bit A and B are widened
  // to fp32 exactly first, a 16-bit C is computed in fp32 and rounded once.
  virtual Status GemmAsync(Stream& stream, const GemmArgs& args);

 protected:
  Device() = default;
};

// Forwards every call to another device; override what a test double needs.
class STRATA_EXPORT DeviceWrapper : public Device {
 public:
  explicit DeviceWrapper(Device* target) : target_(target) {}
  Device* target() const { return target_; }

  DeviceKind kind() const override { return target_->kind(); }
  std::string name() const override { return target_->name(); }
  StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) override {
    return target_->NewStream(options);
  }
  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    return target_->NewEvent();
  }
  Status RecordEvent(Event& event, Stream& stream) override {
    return target_->RecordEvent(event, stream);
  }
  Status WaitEvent(Stream& stream, const Event& event) override {
    return target_->WaitEvent(stream, event);
  }
  StatusOr<bool> QueryEvent(const Event& event) override {
    return target_->QueryEvent(event);
  }
  Status SynchronizeEvent(const Event& event) override {
    return target_->SynchronizeEvent(event);
  }
  Status SynchronizeStream(Stream& stream) override {
    return target_->SynchronizeStream(stream);
  }
  Status LaunchHostFunc(Stream& stream, HostFunction fn) override {
    return target_->LaunchHostFunc(stream, std::move(fn));
  }
  Status LaunchHostWork(Stream& stream, HostFunction fn) override {
    return target_->LaunchHostWork(stream, std::move(fn));
  }
  StatusOr<std::unique_ptr<Stream>> WrapNativeStream(void* native,
                                                     StreamKind kind) override {
    return target_->WrapNativeStream(native, kind);
  }
  StatusOr<std::unique_ptr<HostEvent>> NewHostEvent() override {
    return target_->NewHostEvent();
  }
  Status WaitHostEvent(Stream& stream, const HostEvent& event,
                       uint64_t generation) override {
    return target_->WaitHostEvent(stream, event, generation);
  }
  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) override {
    return target_->Allocate(bytes, stream);
  }
  StatusOr<DeviceMemory> TryAllocate(size_t bytes, Stream& stream) override {
    return target_->TryAllocate(bytes, stream);
  }
  StatusOr<ExternalDeviceMemory> RegisterExternalMemory(void* data,
                                                        size_t bytes) override {
    return target_->RegisterExternalMemory(data, bytes);
  }
  DeviceMemoryStats memory_stats() const override {
    return target_->memory_stats();
  }
  StatusOr<HostBuffer> AllocatePinnedHost(
      size_t bytes, const HostBufferOptions& options) override {
    return target_->AllocatePinnedHost(bytes, options);
  }
  Status RegisterHostBuffer(HostBuffer& buffer) override {
    return target_->RegisterHostBuffer(buffer);
  }
  Status CopyAsync(Stream& stream, void* dst, const void* src, size_t bytes,
                   CopyKind kind) override {
    return target_->CopyAsync(stream, dst, src, bytes, kind);
  }
  Status MemsetAsync(Stream& stream, void* dst, uint8_t value,
                     size_t bytes) override {
    return target_->MemsetAsync(stream, dst, value, bytes);
  }
  Status ConvertAsync(Stream& stream, const ConvertArgs& args) override {
    return target_->ConvertAsync(stream, args);
  }
  Status GemmAsync(Stream& stream, const GemmArgs& args) override {
    return target_->GemmAsync(stream, args);
  }

 private:
  Device* target_;  // not owned
};

// The host-emulated device. Fails only when its memory cannot be mapped.
STRATA_EXPORT StatusOr<std::unique_ptr<Device>> NewHostEmulatedDevice(
    const DeviceOptions& options = {});

// The CUDA device options.cuda_ordinal. kUnavailable with the reason when
// there is no driver or device ("CUDA driver version is insufficient...") or
// when strata was built without CUDA.
STRATA_EXPORT StatusOr<std::unique_ptr<Device>> NewCudaDevice(
    const DeviceOptions& options = {});

// The device chosen by options.choice or STRATA_DEVICE (see DeviceOptions).
// Logs once which device was chosen and why; `why`, when not null, receives
// the same sentence. kInvalidArgument for a bad STRATA_DEVICE value.
STRATA_EXPORT StatusOr<std::unique_ptr<Device>> NewDevice(
    const DeviceOptions& options = {}, std::string* why = nullptr);

}  // namespace strata

#endif  // STRATA_DEVICE_H_
