// The CUDA backend. Policy:
//   - Device memory: one cudaMalloc of the budget at creation, placed by the
//     shared StreamOrderedPool (stream-ordered reuse with cudaEvents), so the
//     engine never calls cudaMalloc/cudaFree on the hot path and an
//     out-of-memory answer is about our budget, not the driver's.
//   - Streams are cudaStreamNonBlocking (no implicit sync with the legacy
//     default stream); copy streams get the highest priority.
//   - Pinned host memory is a HostBuffer (mmap, exact size) registered with
//     cudaHostRegister, so the swap tier's O_DIRECT buffers are DMA-able.
//   - Every cudaError_t becomes a Status here, with context.
//   - Every entry point makes this device current for the calling thread and
//     puts the caller's current device back when it returns: the current
//     device is per thread and shared by every CUDA runtime in the process
//     (PyTorch's too), so strata never leaves it changed.
//   - Events block the waiting thread instead of spinning a core
//     (cudaEventBlockingSync): the cores belong to the CPU optimizer and I/O.
//   - Wrapped native streams (WrapNativeStream) are used, never destroyed or
//     synchronized by their wrapper.
//   - Host events are words of mapped pinned memory that streams wait on with
//     cuStreamWaitValue32 (gpu/cuda_host_event.h); no callback thread blocks.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/cpu_kernels.h"
#include "gpu/cublas.h"
#include "gpu/cuda_host_event.h"
#include "gpu/cuda_kernels.h"
#include "gpu/host_func.h"
#include "gpu/host_work.h"
#include "gpu/stream_ordered_pool.h"
#include "strata/device.h"
#include "util/log.h"
#include "util/mutex.h"
#include "util/unique_handle.h"

namespace strata {
namespace {

static_assert(
    static_cast<int>(ElementType::kFloat32) == internal::kKernelFloat32 &&
    static_cast<int>(ElementType::kFloat16) == internal::kKernelFloat16 &&
    static_cast<int>(ElementType::kBFloat16) == internal::kKernelBFloat16);

Status CudaStatus(cudaError_t err, std::string_view context) {
  if (err == cudaSuccess) return Status::Ok();
  const std::string msg = std::string(context) + ": " +
                          cudaGetErrorString(err) + " (" +
                          cudaGetErrorName(err) + ")";
  switch (err) {
    case cudaErrorMemoryAllocation:
      return Status::OutOfMemory(msg);
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNotPermitted:
      return Status::Unavailable(msg);
    case cudaErrorInvalidValue:
      return Status::InvalidArgument(msg);
    case cudaErrorNotSupported:
      return Status::NotSupported(msg);
    default:
      // Launch failures, illegal addresses, ECC errors: the context is
      // probably unusable; the message says which.
      return Status::IoError(msg);
  }
}

// Makes `ordinal` the calling thread's current device for one call, then
// restores the previous one.
class ScopedCurrentDevice {
 public:
  explicit ScopedCurrentDevice(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != ordinal) {
      status_ = CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice");
      restore_ = status_.ok() && previous_ >= 0;
    }
  }
  ~ScopedCurrentDevice() {
    if (restore_) (void)cudaSetDevice(previous_);
  }
  ScopedCurrentDevice(const ScopedCurrentDevice&) = delete;
  ScopedCurrentDevice& operator=(const ScopedCurrentDevice&) = delete;

  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  bool restore_ = false;
  Status status_;
};

struct CudaStreamTraits {
  using Handle = cudaStream_t;
  static Handle Invalid() { return nullptr; }
  static void Close(Handle s) { cudaStreamDestroy(s); }
};
struct CudaEventTraits {
  using Handle = cudaEvent_t;
  static Handle Invalid() { return nullptr; }
  static void Close(Handle e) { cudaEventDestroy(e); }
};
struct CudaMallocTraits {
  using Handle = void*;
  static Handle Invalid() { return nullptr; }
  static void Close(Handle p) { cudaFree(p); }
};

// A stream made by NewStream (owning `owned`), or a wrapper of a native one
// (`owned` empty).
class CudaStream final : public Stream {
 public:
  CudaStream(const void* owner, StreamKind kind,
             UniqueHandle<CudaStreamTraits> owned)
      : Stream(owner, kind, DeviceKind::kCuda, owned.get(), true),
        owned_(std::move(owned)) {}
  CudaStream(const void* owner, StreamKind kind, cudaStream_t wrapped)
      : Stream(owner, kind, DeviceKind::kCuda, wrapped, false) {}
  // As the interface promises: an owned stream's queued work finishes before
  // it goes (it may still read host memory the caller frees next). A wrapper
  // leaves the native stream alone.
  ~CudaStream() override {
    if (owns_native_stream()) cudaStreamSynchronize(owned_.get());
  }
  cudaStream_t get() const {
    return static_cast<cudaStream_t>(native_handle());
  }

 private:
  UniqueHandle<CudaStreamTraits> owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(const void* owner, UniqueHandle<CudaEventTraits> e)
      : Event(owner, DeviceKind::kCuda, e.get()), event_(std::move(e)) {}
  cudaEvent_t get() const { return event_.get(); }

 private:
  UniqueHandle<CudaEventTraits> event_;
};

// A host event on a word of `words`; destruction abandons it (releasing any
// stream still waiting) and gives the word back for reuse.
class CudaHostEvent final : public HostEvent {
 public:
  CudaHostEvent(const void* owner, internal::HostWordPool* words,
                internal::HostWord word)
      : HostEvent(owner, std::make_shared<internal::HostSignal>(
                             word.host, std::atomic_ref<uint32_t>(*word.host)
                                            .load(std::memory_order_acquire))),
        words_(words),
        word_(word) {}
  ~CudaHostEvent() override {
    Abandon();
    words_->Give(word_);
  }
  using HostEvent::signal;
  CUdeviceptr device_word() const { return word_.device; }

 private:
  internal::HostWordPool* const words_;
  const internal::HostWord word_;
};

class CudaHostRegistration final : public HostRegistration {
 public:
  CudaHostRegistration(int ordinal, void* p) : ordinal_(ordinal), p_(p) {}
  ~CudaHostRegistration() override {
    ScopedCurrentDevice current(ordinal_);
    (void)cudaHostUnregister(p_);
  }

 private:
  const int ordinal_;
  void* const p_;
};

// Runs on CUDA's callback thread, where no CUDA call is allowed; see
// Device::LaunchHostFunc for what that asks of `fn`.
void RunHostFunc(void* arg) {
  std::unique_ptr<HostFunction> fn(static_cast<HostFunction*>(arg));
  internal::RunHostFunction(*fn);
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name,
             UniqueHandle<CudaMallocTraits> arena, uint64_t budget,
             internal::StreamWaitValue32Fn wait_value32,
             std::string no_host_events_why)
      : ordinal_(ordinal),
        name_(std::move(name)),
        arena_(std::move(arena)),
        pool_(std::in_place, this, static_cast<std::byte*>(arena_.get()),
              budget, name_),
        wait_value32_(wait_value32),
        no_host_events_why_(std::move(no_host_events_why)) {}

  // Tears down in order with this device current: the host-work worker
  // (its events use the words), the cuBLAS handle, then the pool (which
  // waits for pending frees), then the arena, then the host event words.
  ~CudaDevice() override {
    host_work_.reset();
    ScopedCurrentDevice current(ordinal_);
    cublas_.reset();
    pool_.reset();
    arena_.reset();
    host_words_.reset();
  }

  int ordinal() const { return ordinal_; }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }

  StatusOr<std::unique_ptr<Stream>> NewStream(
      const StreamOptions& options) override {
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    int least = 0, greatest = 0;
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                   "cudaDeviceGetStreamPriorityRange"));
    cudaStream_t s = nullptr;
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithPriority(
                       &s, cudaStreamNonBlocking,
                       options.kind == StreamKind::kCopy ? greatest : least),
                   "cudaStreamCreateWithPriority"));
    return std::unique_ptr<Stream>(
        new CudaStream(this, options.kind, UniqueHandle<CudaStreamTraits>(s)));
  }

  StatusOr<std::unique_ptr<Event>> NewEvent() override {
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    cudaEvent_t e = nullptr;
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(
                       &e, cudaEventDisableTiming | cudaEventBlockingSync),
                   "cudaEventCreateWithFlags"));
    return std::unique_ptr<Event>(
        new CudaEvent(this, UniqueHandle<CudaEventTraits>(e)));
  }

  Status RecordEvent(Event& event, Stream& stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, Mine(event));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaEventRecord(e->get(), s->get()), "cudaEventRecord");
  }
  Status WaitEvent(Stream& stream, const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, Mine(event));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaStreamWaitEvent(s->get(), e->get(), 0),
                      "cudaStreamWaitEvent");
  }
  StatusOr<bool> QueryEvent(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, Mine(event));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    const cudaError_t err = cudaEventQuery(e->get());
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error; do not leave it pending
      return false;
    }
    STRATA_RETURN_IF_ERROR(CudaStatus(err, "cudaEventQuery"));
    return true;
  }
  Status SynchronizeEvent(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, Mine(event));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaEventSynchronize(e->get()), "cudaEventSynchronize");
  }
  Status SynchronizeStream(Stream& stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaStreamSynchronize(s->get()), "cudaStreamSynchronize");
  }
  Status LaunchHostFunc(Stream& stream, HostFunction fn) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    if (!fn) return Status::InvalidArgument("LaunchHostFunc: empty function");
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    auto owned = std::make_unique<HostFunction>(std::move(fn));
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaLaunchHostFunc(s->get(), RunHostFunc, owned.get()),
                   "cudaLaunchHostFunc"));
    owned.release();  // RunHostFunc owns it now
    return Status::Ok();
  }
  // A host function hands `fn` to a worker thread and the stream waits on a
  // host event the worker signals (gpu/host_work.h): CUDA's callback thread
  // never runs the long work.
  Status LaunchHostWork(Stream& stream, HostFunction fn) override {
    STRATA_RETURN_IF_ERROR(Mine(stream).status());
    return host_work_->Launch(stream, std::move(fn));
  }

  StatusOr<std::unique_ptr<Stream>> WrapNativeStream(void* native,
                                                     StreamKind kind) override {
    auto s = static_cast<cudaStream_t>(native);
    if (s == cudaStreamPerThread) {
      return Status::InvalidArgument(
          "WrapNativeStream: cudaStreamPerThread names another stream on "
          "every thread that uses it; wrap a created stream or the legacy "
          "default stream");
    }
    if (s != nullptr && s != cudaStreamLegacy) {
      ScopedCurrentDevice current(ordinal_);
      STRATA_RETURN_IF_ERROR(current.status());
      int device = -1;
      STRATA_RETURN_IF_ERROR(CudaStatus(cudaStreamGetDevice(s, &device),
                                        "WrapNativeStream: cudaStreamGetDevice")
                                 .WithContext(name_));
      if (device != ordinal_) {
        return Status::InvalidArgument(
            "WrapNativeStream: the stream belongs to cuda:" +
            std::to_string(device) + ", not to " + name_);
      }
    }
    return std::unique_ptr<Stream>(new CudaStream(this, kind, s));
  }

  StatusOr<std::unique_ptr<HostEvent>> NewHostEvent() override {
    if (wait_value32_ == nullptr) {
      return Status::NotSupported(
          name_ + " has no host events: " + no_host_events_why_);
    }
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    internal::HostWord word;
    STRATA_RETURN_IF_ERROR(CudaStatus(host_words_->Take(&word),
                                      "cudaHostAlloc of a host event word"));
    return std::unique_ptr<HostEvent>(
        new CudaHostEvent(this, &*host_words_, word));
  }

  Status WaitHostEvent(Stream& stream, const HostEvent& event,
                       uint64_t generation) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    if (event.owner() != this) {
      return Status::InvalidArgument(
          "host event belongs to another device than " + name_);
    }
    const auto& e = static_cast<const CudaHostEvent&>(event);
    STRATA_ASSIGN_OR_RETURN(bool must_wait, e.signal()->BeginWait(generation));
    if (!must_wait) return Status::Ok();
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    // Cyclic >=, Note [Host event word]. CUstream and cudaStream_t are one
    // type; null is the legacy default stream for both.
    const CUresult r = wait_value32_(s->get(), e.device_word(),
                                     e.signal()->WordValue(generation),
                                     CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) return Status::Ok();
    const std::string msg = "cuStreamWaitValue32 on " + name_ +
                            " failed with CUresult " + std::to_string(r);
    if (r == CUDA_ERROR_NOT_SUPPORTED) return Status::NotSupported(msg);
    if (r == CUDA_ERROR_INVALID_VALUE) return Status::InvalidArgument(msg);
    return Status::IoError(msg);
  }

  StatusOr<DeviceMemory> Allocate(size_t bytes, Stream& stream) override {
    STRATA_RETURN_IF_ERROR(Mine(stream).status());
    return pool_->Allocate(bytes, stream);
  }
  StatusOr<DeviceMemory> TryAllocate(size_t bytes, Stream& stream) override {
    STRATA_RETURN_IF_ERROR(Mine(stream).status());
    return pool_->TryAllocate(bytes, stream);
  }

  // Both ends must be memory of this GPU that CUDA knows as device (or
  // managed) memory; the pool then checks what it checks for every device.
  StatusOr<ExternalDeviceMemory> RegisterExternalMemory(void* data,
                                                        size_t bytes) override {
    const auto a = reinterpret_cast<uintptr_t>(data);
    if (data != nullptr && bytes != 0 && a + bytes > a) {
      ScopedCurrentDevice current(ordinal_);
      STRATA_RETURN_IF_ERROR(current.status());
      for (const uintptr_t p : {a, a + bytes - 1}) {
        cudaPointerAttributes attr{};
        const cudaError_t err =
            cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(p));
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          return CudaStatus(err,
                            "RegisterExternalMemory: "
                            "cudaPointerGetAttributes");
        }
        if (attr.type != cudaMemoryTypeDevice &&
            attr.type != cudaMemoryTypeManaged) {
          return Status::InvalidArgument(
              "RegisterExternalMemory: byte " + std::to_string(p - a) +
              " of the range is not device memory (cudaMemoryType " +
              std::to_string(static_cast<int>(attr.type)) + ")");
        }
        if (attr.device != ordinal_) {
          return Status::InvalidArgument(
              "RegisterExternalMemory: the range is memory of cuda:" +
              std::to_string(attr.device) + ", not of " + name_);
        }
      }
    }
    return pool_->RegisterExternal(data, bytes);
  }
  DeviceMemoryStats memory_stats() const override { return pool_->stats(); }

  // cudaHostRegister page-locks the range itself, so the buffer is not also
  // mlock'ed: that would only add RLIMIT_MEMLOCK's limit, which the driver's
  // pinning does not count against.
  StatusOr<HostBuffer> AllocatePinnedHost(
      size_t bytes, const HostBufferOptions& options) override {
    HostBufferOptions o = options;
    o.pin = false;
    o.require_pin = false;
    return Device::AllocatePinnedHost(bytes, o);
  }

  Status RegisterHostBuffer(HostBuffer& buffer) override {
    if (buffer.empty()) return Status::Ok();
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    // Drop an earlier registration first: CUDA refuses to register a range
    // twice.
    buffer.AttachRegistration(nullptr);
    STRATA_RETURN_IF_ERROR(CudaStatus(
        cudaHostRegister(buffer.data(), buffer.size(),
                         cudaHostRegisterPortable),
        "cudaHostRegister of " + std::to_string(buffer.size()) + " bytes"));
    buffer.AttachRegistration(
        std::make_unique<CudaHostRegistration>(ordinal_, buffer.data()));
    return Status::Ok();
  }

  Status CopyAsync(Stream& stream, void* dst, const void* src, size_t bytes,
                   CopyKind kind) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    if (bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(pool_->CheckCopy(dst, src, bytes, kind));
    const cudaMemcpyKind k =
        kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
        : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                          : cudaMemcpyDeviceToDevice;
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, k, s->get()),
                      "cudaMemcpyAsync " + std::string(CopyKindName(kind)) +
                          " of " + std::to_string(bytes) + " bytes");
  }

  Status MemsetAsync(Stream& stream, void* dst, uint8_t value,
                     size_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    if (bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(
        pool_->CheckInside(dst, bytes, "memset destination"));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    return CudaStatus(cudaMemsetAsync(dst, value, bytes, s->get()),
                      "cudaMemsetAsync");
  }

  Status ConvertAsync(Stream& stream, const ConvertArgs& args) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    if (args.count == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(pool_->CheckConvert(args));
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    const internal::ConvertLaunch launch{
        args.src,   static_cast<int>(args.src_type),
        args.dst,   static_cast<int>(args.dst_type),
        args.count, args.scale};
    return CudaStatus(internal::LaunchConvert(launch, s->get()),
                      "conversion kernel launch");
  }

  Status GemmAsync(Stream& stream, const GemmArgs& g) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, Mine(stream));
    STRATA_RETURN_IF_ERROR(pool_->CheckGemm(g));
    if (g.m == 0 || g.n == 0) return Status::Ok();
    const bool ta = g.op_a == GemmOp::kTranspose;
    const bool tb = g.op_b == GemmOp::kTranspose;
    STRATA_ASSIGN_OR_RETURN(const internal::CublasApi* api,
                            internal::CublasApi::Get());
    ScopedCurrentDevice current(ordinal_);
    STRATA_RETURN_IF_ERROR(current.status());
    // One handle for the device; it is bound to a stream per call, so calls
    // are serialized (they only enqueue).
    MutexLock lock(&cublas_mu_);
    if (!cublas_) {
      cublasHandle_t h = nullptr;
      STRATA_RETURN_IF_ERROR(api->ToStatus(api->create(&h), "cublasCreate"));
      cublas_.reset(h);
      // No TF32 for fp32 inputs (trainers compare against fp32 references),
      // and no split-K reduction in fp16/bf16 when C is fp16/bf16: the
      // interface promises fp32 accumulation.
      STRATA_RETURN_IF_ERROR(api->ToStatus(
          api->set_math_mode(
              h, static_cast<cublasMath_t>(
                     CUBLAS_DEFAULT_MATH |
                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
          "cublasSetMathMode"));
    }
    STRATA_RETURN_IF_ERROR(api->ToStatus(
        api->set_stream(cublas_.get(), s->get()), "cublasSetStream"));
    const float alpha = g.alpha, beta = g.beta;
    return api->ToStatus(
        api->gemm_ex(cublas_.get(), ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                     tb ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.m),
                     static_cast<int>(g.n), static_cast<int>(g.k), &alpha, g.a,
                     DataType(g.ab_type), static_cast<int>(g.lda), g.b,
                     DataType(g.ab_type), static_cast<int>(g.ldb), &beta, g.c,
                     DataType(g.c_type), static_cast<int>(g.ldc),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

  StatusOr<CudaStream*> Mine(Stream& stream) const {
    if (stream.owner() != this) {
      return Status::InvalidArgument("stream belongs to another device than " +
                                     name_);
    }
    return static_cast<CudaStream*>(&stream);
  }

 private:
  static cudaDataType DataType(ElementType t) {
    switch (t) {
      case ElementType::kFloat32:
        return CUDA_R_32F;
      case ElementType::kFloat16:
        return CUDA_R_16F;
      case ElementType::kBFloat16:
        return CUDA_R_16BF;
    }
    return CUDA_R_32F;
  }

  StatusOr<CudaEvent*> Mine(const Event& event) const {
    if (event.owner() != this) {
      return Status::InvalidArgument("event belongs to another device than " +
                                     name_);
    }
    return static_cast<CudaEvent*>(const_cast<Event*>(&event));
  }

  const int ordinal_;
  const std::string name_;
  // First: the words outlive every other member (reset last by the dtor).
  std::optional<internal::HostWordPool> host_words_{std::in_place};
  UniqueHandle<CudaMallocTraits> arena_;
  // After arena_: waits for pending frees before the arena is freed.
  std::optional<internal::StreamOrderedPool> pool_;
  // Null when host events are not supported; the reason then.
  const internal::StreamWaitValue32Fn wait_value32_;
  const std::string no_host_events_why_;
  // Stream-ordered host work; reset first by the destructor.
  std::optional<internal::HostWorkRunner> host_work_{std::in_place, this};
  Mutex cublas_mu_;
  // Last member: destroyed first.
  internal::UniqueCublasHandle cublas_ STRATA_GUARDED_BY(cublas_mu_);
};

}  // namespace

StatusOr<std::unique_ptr<Device>> NewCudaDevice(const DeviceOptions& options) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaStatus(err, "cudaGetDeviceCount");
  }
  if (count == 0) return Status::Unavailable("no CUDA device is visible");
  const int ordinal = options.cuda_ordinal;
  if (ordinal < 0 || ordinal >= count) {
    return Status::Unavailable("CUDA device " + std::to_string(ordinal) +
                               " asked for, but " + std::to_string(count) +
                               " visible");
  }
  ScopedCurrentDevice current(ordinal);
  STRATA_RETURN_IF_ERROR(current.status());
  cudaDeviceProp prop{};
  STRATA_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, ordinal),
                                    "cudaGetDeviceProperties"));
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_RETURN_IF_ERROR(
      CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  const std::string name = "cuda:" + std::to_string(ordinal) + " (" +
                           prop.name + ", sm_" + std::to_string(prop.major) +
                           std::to_string(prop.minor) + ")";
  uint64_t budget = options.memory_budget_bytes;
  if (budget == 0) {
    budget = free_bytes > options.cuda_reserve_bytes
                 ? free_bytes - options.cuda_reserve_bytes
                 : 0;
  }
  if (budget == 0 || budget > free_bytes) {
    return Status::OutOfMemory(
        name + ": a device memory budget of " + std::to_string(budget) +
        " bytes does not fit: " + std::to_string(free_bytes) + " of " +
        std::to_string(total_bytes) + " bytes are free (reserve " +
        std::to_string(options.cuda_reserve_bytes) + " bytes)");
  }
  void* base = nullptr;
  STRATA_RETURN_IF_ERROR(CudaStatus(
      cudaMalloc(&base, budget),
      name + ": cudaMalloc of the " + std::to_string(budget) + "-byte budget"));
  std::string no_host_events_why;
  const internal::StreamWaitValue32Fn wait_value32 =
      internal::ResolveStreamWaitValue32(ordinal, &no_host_events_why);
  if (wait_value32 == nullptr) {
    STRATA_LOG_ONCE(WARN, "{}: host events are not supported: {}", name,
                    no_host_events_why);
  }
  return std::unique_ptr<Device>(
      new CudaDevice(ordinal, name, UniqueHandle<CudaMallocTraits>(base),
                     budget, wait_value32, std::move(no_host_events_why)));
}

}  // namespace strata
