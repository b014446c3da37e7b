// The C API (include/strata/c.h): each call checks its handles, runs the C++
// call inside Guard, which turns a Status, or an exception that escaped a
// library or the standard library (std::bad_alloc above all), into a code
// and a malloc'd message. Handles count what depends on them so that a
// destroy in the wrong order is refused instead of freeing memory in use.
#include "strata/c.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "capi/engine_checkpoint.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/cpu_adam.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/engine_config.h"
#include "strata/log.h"
#include "strata/status.h"

using strata::CpuDType;
using strata::ElementType;
using strata::Status;
using strata::StatusCode;
using strata::StatusOr;

// ---- Handles ----------------------------------------------------------------
// Each counts its dependents (`users`) with an atomic: the thread-safe objects
// may gain and lose them from several threads at once.

struct strata_device {
  std::unique_ptr<strata::Device> device;
  std::string name;
  std::atomic<int64_t> users{0};  // streams, memory, engines
};

struct strata_stream {
  strata_device* dev = nullptr;
  std::unique_ptr<strata::Stream> stream;
  std::atomic<int64_t> users{0};  // pins that waited on it, memory made on it
};

struct strata_device_memory {
  strata_stream* stream = nullptr;
  strata::DeviceMemory memory;
};

struct strata_external_memory {
  strata_device* dev = nullptr;
  strata::ExternalDeviceMemory memory;
};

struct strata_comm {
  std::shared_ptr<strata::Communicator> comm;
};

struct strata_engine_options {
  strata::EngineConfig config;
};

struct strata_engine {
  strata_device* dev = nullptr;
  int rank = 0;  // EngineOptions::rank: rank 0 writes checkpoints
  std::unique_ptr<strata::Engine> engine;
  std::atomic<int64_t> users{0};  // pins
};

struct strata_param_pin {
  strata_engine* eng = nullptr;
  strata::ParamPin pin;
  std::vector<strata_stream*> consumers;  // each counted once in its users
};

struct strata_cpu_optimizer_options {
  strata::CpuOptimizerOptions options;
};

struct strata_cpu_optimizer {
  std::unique_ptr<strata::CpuOptimizer> optimizer;
};

namespace {

#define STRATA_C_CODE_MATCHES(c, k) \
  static_assert(static_cast<int>(c) == static_cast<int>(StatusCode::k))
STRATA_C_CODE_MATCHES(STRATA_OK, kOk);
STRATA_C_CODE_MATCHES(STRATA_INVALID_ARGUMENT, kInvalidArgument);
STRATA_C_CODE_MATCHES(STRATA_NOT_FOUND, kNotFound);
STRATA_C_CODE_MATCHES(STRATA_ALREADY_EXISTS, kAlreadyExists);
STRATA_C_CODE_MATCHES(STRATA_OUT_OF_MEMORY, kOutOfMemory);
STRATA_C_CODE_MATCHES(STRATA_NO_SPACE, kNoSpace);
STRATA_C_CODE_MATCHES(STRATA_IO_ERROR, kIoError);
STRATA_C_CODE_MATCHES(STRATA_CORRUPTION, kCorruption);
STRATA_C_CODE_MATCHES(STRATA_UNAVAILABLE, kUnavailable);
STRATA_C_CODE_MATCHES(STRATA_NOT_SUPPORTED, kNotSupported);
STRATA_C_CODE_MATCHES(STRATA_BUSY, kBusy);
STRATA_C_CODE_MATCHES(STRATA_PERMISSION_DENIED, kPermissionDenied);
STRATA_C_CODE_MATCHES(STRATA_FAILED_PRECONDITION, kFailedPrecondition);
STRATA_C_CODE_MATCHES(STRATA_OUT_OF_RANGE, kOutOfRange);
STRATA_C_CODE_MATCHES(STRATA_ABORTED, kAborted);
STRATA_C_CODE_MATCHES(STRATA_INTERNAL, kInternal);
#undef STRATA_C_CODE_MATCHES

// The integer a caller passed as a C enum. C lets any int through, but C++
// may assume an enum object holds only values its enumerators span, so the
// value is read as an int, never loaded as the enum.
template <class E>
int EnumValue(const E& e) noexcept {
  static_assert(std::is_enum_v<E> && sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

// An enum value for a uint8_t field; out-of-range values become 255, which
// strata_cpu_optimizer_create refuses.
template <class E>
uint8_t Clamp8(const E& e) noexcept {
  const int v = EnumValue(e);
  return static_cast<uint8_t>(v < 0 || v > 255 ? 255 : v);
}

// A malloc'd copy of `s`, or null when malloc fails.
char* CopyString(std::string_view s) noexcept {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p == nullptr) return nullptr;
  if (!s.empty()) std::memcpy(p, s.data(), s.size());
  p[s.size()] = '\0';
  return p;
}

strata_code_t Fail(strata_code_t code, std::string_view message,
                   char** errptr) noexcept {
  if (errptr != nullptr) *errptr = CopyString(message);
  return code;
}

// Runs `body` (returning a Status); no exception leaves.
template <class F>
strata_code_t Guard(char** errptr, F&& body) noexcept {
  if (errptr != nullptr) *errptr = nullptr;
  try {
    Status st = body();
    if (st.ok()) return STRATA_OK;
    return Fail(static_cast<strata_code_t>(st.code()), st.message(), errptr);
  } catch (const std::bad_alloc&) {
    return Fail(STRATA_OUT_OF_MEMORY, "out of host memory (std::bad_alloc)",
                errptr);
  } catch (const std::exception& e) {
    return Fail(STRATA_INTERNAL, e.what(), errptr);
  } catch (...) {
    return Fail(STRATA_INTERNAL, "unknown exception", errptr);
  }
}

// kInvalidArgument "<call>: <what> is NULL" when `p` is null.
Status Require(const void* p, const char* call, const char* what) {
  if (p != nullptr) return Status::Ok();
  return Status::InvalidArgument(std::string(call) + ": " + what + " is NULL");
}

StatusOr<ElementType> ToElementType(int t, const char* call) {
  switch (t) {
    case STRATA_FLOAT32:
      return ElementType::kFloat32;
    case STRATA_FLOAT16:
      return ElementType::kFloat16;
    case STRATA_BFLOAT16:
      return ElementType::kBFloat16;
    default:
      return Status::InvalidArgument(
          std::string(call) + ": dtype " + std::to_string(t) +
          " is not an element type; accepted: STRATA_FLOAT32, "
          "STRATA_FLOAT16, STRATA_BFLOAT16");
  }
}

strata_dtype_t FromElementType(ElementType t) {
  switch (t) {
    case ElementType::kFloat16:
      return STRATA_FLOAT16;
    case ElementType::kBFloat16:
      return STRATA_BFLOAT16;
    case ElementType::kFloat32:
      break;
  }
  return STRATA_FLOAT32;
}

StatusOr<CpuDType> ToCpuDType(int t, const char* call) {
  switch (t) {
    case STRATA_FLOAT32:
      return CpuDType::kFloat32;
    case STRATA_FLOAT16:
      return CpuDType::kFloat16;
    case STRATA_BFLOAT16:
      return CpuDType::kBFloat16;
    case STRATA_BLOCK8:
      return CpuDType::kBlock8;
  }
  return Status::InvalidArgument(std::string(call) + ": dtype " +
                                 std::to_string(t) +
                                 " is not a strata_dtype_t value");
}

// The C++ view of a strata_cpu_tensors_t (a vector: rows 0).
StatusOr<strata::CpuOptimizerTensors> ToCpuTensors(
    const strata_cpu_tensors_t& t, const char* call) {
  strata::CpuOptimizerTensors ct;
  ct.n = t.n;
  ct.master = t.master;
  ct.grad = t.grad;
  STRATA_ASSIGN_OR_RETURN(ct.grad_dtype,
                          ToCpuDType(EnumValue(t.grad_dtype), call));
  ct.exp_avg = t.exp_avg;
  ct.exp_avg_sq = t.exp_avg_sq;
  STRATA_ASSIGN_OR_RETURN(ct.moment_dtype,
                          ToCpuDType(EnumValue(t.moment_dtype), call));
  ct.working = t.working;
  if (t.working != nullptr) {
    STRATA_ASSIGN_OR_RETURN(ct.working_dtype,
                            ToCpuDType(EnumValue(t.working_dtype), call));
  }
  return ct;
}

// One update of `t` as a rows x cols matrix (rows 0: a vector) with the
// per-step values `a`: what both step calls run.
StatusOr<strata::CpuStepResult> StepCpu(strata_cpu_optimizer* optimizer,
                                        const strata_cpu_tensors_t* t,
                                        size_t rows, size_t cols,
                                        const strata_cpu_step_args_t& a,
                                        const char* call) {
  STRATA_RETURN_IF_ERROR(Require(optimizer, call, "optimizer"));
  STRATA_RETURN_IF_ERROR(Require(t, call, "tensors"));
  STRATA_ASSIGN_OR_RETURN(strata::CpuOptimizerTensors ct,
                          ToCpuTensors(*t, call));
  ct.rows = rows;
  ct.cols = cols;
  strata::CpuStepArgs args;
  args.step = a.step;
  args.lr = a.lr;
  args.inv_loss_scale = a.inv_loss_scale;
  args.clip_coef = a.clip_coef;
  args.check_overflow = a.check_overflow != 0;
  args.param_sq = a.param_sq;
  return optimizer->optimizer->Step(ct, args);
}

// The options a handle holds, or strata's defaults for a NULL one.
strata::CpuOptimizerOptions OptionsOf(
    const strata_cpu_optimizer_options_t* options) {
  return options != nullptr ? options->options : strata::CpuOptimizerOptions{};
}

// The stream must be one of the device's.
Status SameDevice(const strata_stream* s, const strata_device* d,
                  const char* call) {
  if (s->dev == d) return Status::Ok();
  return Status::InvalidArgument(std::string(call) + ": the stream is " +
                                 s->dev->name + "'s, not " + d->name + "'s");
}

Status RefuseWhileUsed(int64_t users, const char* call, const char* what) {
  if (users == 0) return Status::Ok();
  return Status::FailedPrecondition(std::string(call) + ": " +
                                    std::to_string(users) + " " + what +
                                    " still live; destroy them first");
}

Status AddStream(strata_device* dev, std::unique_ptr<strata::Stream> s,
                 strata_stream_t** out) {
  auto h = std::make_unique<strata_stream>();
  h->dev = dev;
  h->stream = std::move(s);
  dev->users.fetch_add(1);
  *out = h.release();
  return Status::Ok();
}

Status AddEngineOptions(StatusOr<strata::EngineConfig> config,
                        strata_engine_options_t** out) {
  if (!config.ok()) return std::move(config).status();
  auto h = std::make_unique<strata_engine_options>();
  h->config = std::move(config).value();
  *out = h.release();
  return Status::Ok();
}

// The communicator `o` asks for, with timeout_s (0: the default), into
// *out.
Status CreateComm(strata::CommOptions o, const char* call, double timeout_s,
                  strata_comm_t** out) {
  if (timeout_s != 0) {
    if (!(timeout_s > 0 && timeout_s <= 1e6)) {
      return Status::InvalidArgument(
          std::string(call) + ": timeout_s " + std::to_string(timeout_s) +
          " is out of range; accepted: (0, 1e6] seconds, or 0 for the "
          "default (" +
          std::to_string(static_cast<int>(o.timeout_s)) + ")");
    }
    o.timeout_s = timeout_s;
  }
  STRATA_ASSIGN_OR_RETURN(strata::Communicator c,
                          strata::Communicator::Create(o));
  auto h = std::make_unique<strata_comm>();
  h->comm = std::make_shared<strata::Communicator>(std::move(c));
  *out = h.release();
  return Status::Ok();
}

// strata_engine_begin_step's and strata_engine_step's arguments.
strata::StepArgs ArgsOf(double lr, double loss_scale, double max_grad_norm) {
  strata::StepArgs args;
  args.lr = lr;
  args.loss_scale = loss_scale;
  args.max_grad_norm = max_grad_norm;
  return args;
}

}  // namespace

extern "C" {

// ---- Codes, memory, version -------------------------------------------------

const char* strata_code_name(strata_code_t code) {
  static constexpr const char* kNames[] = {"OK",
                                           "InvalidArgument",
                                           "NotFound",
                                           "AlreadyExists",
                                           "OutOfMemory",
                                           "NoSpace",
                                           "IoError",
                                           "Corruption",
                                           "Unavailable",
                                           "NotSupported",
                                           "Busy",
                                           "PermissionDenied",
                                           "FailedPrecondition",
                                           "OutOfRange",
                                           "Aborted",
                                           "Internal"};
  const int i = EnumValue(code);
  if (i < 0 || i >= static_cast<int>(std::size(kNames))) return "Unknown";
  return kNames[i];
}

void strata_free(void* p) { std::free(p); }

const char* strata_version_string(void) { return STRATA_VERSION_STRING; }
int strata_version_major(void) { return STRATA_VERSION_MAJOR; }
int strata_version_minor(void) { return STRATA_VERSION_MINOR; }
int strata_version_patch(void) { return STRATA_VERSION_PATCH; }

strata_code_t strata_set_log_level(const char* level, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(Require(level, "strata_set_log_level", "level"));
    static constexpr std::pair<std::string_view, strata::LogLevel> kLevels[] = {
        {"trace", strata::LogLevel::kTrace},
        {"debug", strata::LogLevel::kDebug},
        {"info", strata::LogLevel::kInfo},
        {"warn", strata::LogLevel::kWarn},
        {"error", strata::LogLevel::kError},
        {"off", strata::LogLevel::kOff}};
    for (const auto& [name, value] : kLevels) {
      if (name == level) {
        strata::SetLogLevel(value);
        return Status::Ok();
      }
    }
    return Status::InvalidArgument(
        std::string("strata_set_log_level: unknown level \"") + level +
        "\"; accepted: trace, debug, info, warn, error, off");
  });
}

// ---- Devices ----------------------------------------------------------------

strata_code_t strata_device_create(const char* choice,
                                   uint64_t memory_budget_bytes,
                                   strata_device_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_device_create";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    strata::DeviceOptions o;
    o.memory_budget_bytes = memory_budget_bytes;
    const std::string_view c = choice != nullptr ? choice : "auto";
    if (c == "auto") {
      o.choice = strata::DeviceChoice::kAuto;
    } else if (c == "host") {
      o.choice = strata::DeviceChoice::kHostEmulated;
    } else if (c == "cuda") {
      o.choice = strata::DeviceChoice::kCuda;
    } else if (c.starts_with("cuda:") && c.size() > 5 && c.size() <= 9 &&
               c.find_first_not_of("0123456789", 5) == std::string_view::npos) {
      o.choice = strata::DeviceChoice::kCuda;
      o.cuda_ordinal = std::stoi(std::string(c.substr(5)));
    } else {
      return Status::InvalidArgument(std::string(kCall) +
                                     ": unknown device \"" + std::string(c) +
                                     "\"; accepted: auto, host, cuda, cuda:N");
    }
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::Device> d,
                            strata::NewDevice(o));
    auto h = std::make_unique<strata_device>();
    h->name = d->name();
    h->device = std::move(d);
    *out = h.release();
    return Status::Ok();
  });
}

strata_code_t strata_device_destroy(strata_device_t* device, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    if (device == nullptr) return Status::Ok();
    STRATA_RETURN_IF_ERROR(
        RefuseWhileUsed(device->users.load(), "strata_device_destroy",
                        "streams, device memory ranges or engines are"));
    delete device;
    return Status::Ok();
  });
}

const char* strata_device_kind(const strata_device_t* device) {
  if (device == nullptr) return nullptr;
  return device->device->kind() == strata::DeviceKind::kCuda ? "cuda"
                                                             : "host-emulated";
}

const char* strata_device_name(const strata_device_t* device) {
  return device != nullptr ? device->name.c_str() : nullptr;
}

// ---- Streams ----------------------------------------------------------------

strata_code_t strata_stream_create(strata_device_t* device,
                                   strata_stream_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_stream_create";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(device, kCall, "device"));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::Stream> s,
                            device->device->NewStream({}));
    return AddStream(device, std::move(s), out);
  });
}

strata_code_t strata_stream_wrap_native(strata_device_t* device, void* native,
                                        strata_stream_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_stream_wrap_native";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(device, kCall, "device"));
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<strata::Stream> s,
        device->device->WrapNativeStream(native, strata::StreamKind::kCompute));
    return AddStream(device, std::move(s), out);
  });
}

void* strata_stream_native_handle(const strata_stream_t* stream) {
  return stream != nullptr ? stream->stream->native_handle() : nullptr;
}

strata_code_t strata_stream_synchronize(strata_stream_t* stream,
                                        char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(
        Require(stream, "strata_stream_synchronize", "stream"));
    return stream->dev->device->SynchronizeStream(*stream->stream);
  });
}

strata_code_t strata_stream_destroy(strata_stream_t* stream, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    if (stream == nullptr) return Status::Ok();
    STRATA_RETURN_IF_ERROR(
        RefuseWhileUsed(stream->users.load(), "strata_stream_destroy",
                        "pins that waited on it or device memory made on it "
                        "are"));
    strata_device* dev = stream->dev;
    delete stream;  // an owning stream waits for its work here
    dev->users.fetch_sub(1);
    return Status::Ok();
  });
}

// ---- Device memory ----------------------------------------------------------

strata_code_t strata_device_memory_alloc(strata_stream_t* stream, size_t bytes,
                                         strata_device_memory_t** out,
                                         char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_device_memory_alloc";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(stream, kCall, "stream"));
    auto h = std::make_unique<strata_device_memory>();
    STRATA_ASSIGN_OR_RETURN(
        h->memory, stream->dev->device->Allocate(bytes, *stream->stream));
    h->stream = stream;
    stream->users.fetch_add(1);
    stream->dev->users.fetch_add(1);
    *out = h.release();
    return Status::Ok();
  });
}

void* strata_device_memory_data(const strata_device_memory_t* memory) {
  return memory != nullptr ? memory->memory.data() : nullptr;
}

size_t strata_device_memory_size(const strata_device_memory_t* memory) {
  return memory != nullptr ? memory->memory.size() : 0;
}

void strata_device_memory_free(strata_device_memory_t* memory) {
  if (memory == nullptr) return;
  strata_stream* stream = memory->stream;
  delete memory;  // frees in stream order; needs nothing allocated
  stream->users.fetch_sub(1);
  stream->dev->users.fetch_sub(1);
}

strata_code_t strata_device_register_external(strata_device_t* device,
                                              void* data, size_t bytes,
                                              strata_external_memory_t** out,
                                              char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_device_register_external";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(device, kCall, "device"));
    auto h = std::make_unique<strata_external_memory>();
    STRATA_ASSIGN_OR_RETURN(
        h->memory, device->device->RegisterExternalMemory(data, bytes));
    h->dev = device;
    device->users.fetch_add(1);
    *out = h.release();
    return Status::Ok();
  });
}

void strata_external_memory_unregister(strata_external_memory_t* memory) {
  if (memory == nullptr) return;
  strata_device* dev = memory->dev;
  delete memory;
  dev->users.fetch_sub(1);
}

strata_code_t strata_copy_async(strata_stream_t* stream, void* dst,
                                const void* src, size_t bytes,
                                strata_copy_kind_t kind, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_copy_async";
    STRATA_RETURN_IF_ERROR(Require(stream, kCall, "stream"));
    strata::CopyKind k;
    switch (EnumValue(kind)) {
      case STRATA_HOST_TO_DEVICE:
        k = strata::CopyKind::kHostToDevice;
        break;
      case STRATA_DEVICE_TO_HOST:
        k = strata::CopyKind::kDeviceToHost;
        break;
      case STRATA_DEVICE_TO_DEVICE:
        k = strata::CopyKind::kDeviceToDevice;
        break;
      default:
        return Status::InvalidArgument(std::string(kCall) + ": copy kind " +
                                       std::to_string(EnumValue(kind)) +
                                       " is not a strata_copy_kind_t value");
    }
    return stream->dev->device->CopyAsync(*stream->stream, dst, src, bytes, k);
  });
}

// ---- Communicator -----------------------------------------------------------

strata_code_t strata_comm_create(const char* backend, double timeout_s,
                                 void* mpi_comm, const char* mpi_library,
                                 strata_comm_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_comm_create";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    strata::CommOptions o;
    const std::string_view b = backend != nullptr ? backend : "single";
    if (b == "single") {
      o.backend = strata::CommBackendKind::kSingle;
    } else if (b == "mpi") {
      o.backend = strata::CommBackendKind::kMpi;
      o.mpi_comm = mpi_comm;
      if (mpi_library != nullptr) o.mpi_library = mpi_library;
    } else {
      return Status::InvalidArgument(std::string(kCall) + ": backend \"" +
                                     std::string(b) +
                                     "\" is not known; accepted: single, mpi");
    }
    return CreateComm(o, kCall, timeout_s, out);
  });
}

strata_code_t strata_comm_create_nccl(void* nccl_comm, const int* ranks,
                                      size_t num_ranks,
                                      strata_comm_t* bootstrap,
                                      int cuda_ordinal, double timeout_s,
                                      strata_comm_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_comm_create_nccl";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    if ((nccl_comm == nullptr) == (bootstrap == nullptr)) {
      return Status::InvalidArgument(
          std::string(kCall) +
          ": give one of nccl_comm (the caller's ncclComm_t) and bootstrap "
          "(a communicator of the same ranks to broadcast the NCCL id over)");
    }
    if (ranks == nullptr && num_ranks != 0) {
      return Status::InvalidArgument(std::string(kCall) +
                                     ": ranks is NULL but num_ranks is " +
                                     std::to_string(num_ranks));
    }
    if (cuda_ordinal < 0) {
      return Status::InvalidArgument(std::string(kCall) + ": cuda_ordinal " +
                                     std::to_string(cuda_ordinal) +
                                     " is negative");
    }
    strata::CommOptions o;
    o.backend = strata::CommBackendKind::kNccl;
    o.nccl_comm = nccl_comm;
    if (ranks != nullptr) o.nccl_ranks.assign(ranks, ranks + num_ranks);
    if (bootstrap != nullptr) o.nccl_bootstrap = bootstrap->comm.get();
    o.cuda_ordinal = cuda_ordinal;
    return CreateComm(o, kCall, timeout_s, out);
  });
}

int strata_comm_rank(const strata_comm_t* comm) {
  return comm != nullptr ? comm->comm->rank() : 0;
}

int strata_comm_size(const strata_comm_t* comm) {
  return comm != nullptr ? comm->comm->size() : 0;
}

const char* strata_comm_backend(const strata_comm_t* comm) {
  if (comm == nullptr) return nullptr;
  // CommBackendName's views are of string literals: NUL-terminated.
  return strata::CommBackendName(comm->comm->backend()).data();
}

void strata_comm_destroy(strata_comm_t* comm) { delete comm; }

// ---- Engine options ---------------------------------------------------------

strata_code_t strata_engine_options_from_json(const char* json, size_t length,
                                              strata_engine_options_t** out,
                                              char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_options_from_json";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(json, kCall, "json"));
    return AddEngineOptions(
        strata::ParseEngineConfig(std::string_view(json, length)), out);
  });
}

strata_code_t strata_engine_options_from_file(const char* path,
                                              strata_engine_options_t** out,
                                              char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_options_from_file";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(path, kCall, "path"));
    return AddEngineOptions(strata::ParseEngineConfigFile(path), out);
  });
}

size_t strata_engine_options_num_warnings(
    const strata_engine_options_t* options) {
  return options != nullptr ? options->config.warnings.size() : 0;
}

const char* strata_engine_options_warning(
    const strata_engine_options_t* options, size_t index) {
  if (options == nullptr || index >= options->config.warnings.size()) {
    return nullptr;
  }
  return options->config.warnings[index].c_str();
}

void strata_engine_options_destroy(strata_engine_options_t* options) {
  delete options;
}

strata_code_t strata_engine_options_set_comm(strata_engine_options_t* options,
                                             strata_comm_t* comm,
                                             char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(
        Require(options, "strata_engine_options_set_comm", "options"));
    options->config.options.comm =
        comm != nullptr ? comm->comm : std::shared_ptr<strata::Communicator>();
    return Status::Ok();
  });
}

// ---- Engine -----------------------------------------------------------------

strata_code_t strata_engine_create(const strata_engine_options_t* options,
                                   strata_device_t* device,
                                   strata_engine_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_create";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(options, kCall, "options"));
    STRATA_RETURN_IF_ERROR(Require(device, kCall, "device"));
    auto h = std::make_unique<strata_engine>();
    STRATA_ASSIGN_OR_RETURN(
        h->engine,
        strata::Engine::Create(options->config.options, device->device.get()));
    h->dev = device;
    h->rank = options->config.options.rank;
    device->users.fetch_add(1);
    *out = h.release();
    return Status::Ok();
  });
}

strata_code_t strata_engine_register(strata_engine_t* engine, const char* name,
                                     const int64_t* shape, size_t ndim,
                                     strata_dtype_t dtype, uint32_t* id,
                                     char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_register";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(name, kCall, "name"));
    STRATA_RETURN_IF_ERROR(Require(id, kCall, "id"));
    if (ndim > 0) STRATA_RETURN_IF_ERROR(Require(shape, kCall, "shape"));
    strata::TensorSpec spec;
    spec.name = name;
    spec.shape.assign(shape, shape + ndim);
    STRATA_ASSIGN_OR_RETURN(spec.dtype, ToElementType(EnumValue(dtype), kCall));
    STRATA_ASSIGN_OR_RETURN(*id, engine->engine->Register(spec));
    return Status::Ok();
  });
}

strata_code_t strata_engine_start(strata_engine_t* engine, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(Require(engine, "strata_engine_start", "engine"));
    return engine->engine->Start();
  });
}

size_t strata_engine_num_tensors(const strata_engine_t* engine) {
  return engine != nullptr ? engine->engine->num_tensors() : 0;
}

strata_code_t strata_engine_tensor_numel(strata_engine_t* engine, uint32_t id,
                                         uint64_t* numel, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_tensor_numel";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(numel, kCall, "numel"));
    if (id >= engine->engine->num_tensors()) {
      return Status::InvalidArgument(
          std::string(kCall) + ": no tensor " + std::to_string(id) + " (" +
          std::to_string(engine->engine->num_tensors()) + " registered)");
    }
    uint64_t n = 1;
    for (int64_t d : engine->engine->spec(id).shape) {
      n *= static_cast<uint64_t>(d);
    }
    *numel = n;
    return Status::Ok();
  });
}

strata_code_t strata_engine_set_initial_values(strata_engine_t* engine,
                                               uint32_t id, const float* values,
                                               size_t count, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_set_initial_values";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(values, kCall, "values"));
    return engine->engine->SetInitialValues(
        id, std::span<const float>(values, count));
  });
}

strata_code_t strata_engine_read_master(strata_engine_t* engine, uint32_t id,
                                        float* out, size_t count,
                                        char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_read_master";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    return engine->engine->ReadMaster(id, std::span<float>(out, count));
  });
}

strata_code_t strata_engine_fetch(strata_engine_t* engine, uint32_t id,
                                  strata_param_pin_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_fetch";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    auto h = std::make_unique<strata_param_pin>();
    STRATA_ASSIGN_OR_RETURN(h->pin, engine->engine->Fetch(id));
    h->eng = engine;
    engine->users.fetch_add(1);
    *out = h.release();
    return Status::Ok();
  });
}

void* strata_param_pin_data(const strata_param_pin_t* pin) {
  return pin != nullptr ? pin->pin.data() : nullptr;
}

size_t strata_param_pin_bytes(const strata_param_pin_t* pin) {
  return pin != nullptr ? pin->pin.bytes() : 0;
}

strata_dtype_t strata_param_pin_dtype(const strata_param_pin_t* pin) {
  return pin != nullptr ? FromElementType(pin->pin.dtype()) : STRATA_FLOAT32;
}

strata_code_t strata_param_pin_wait(strata_param_pin_t* pin, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(Require(pin, "strata_param_pin_wait", "pin"));
    return pin->pin.Wait();
  });
}

strata_code_t strata_param_pin_wait_on(strata_param_pin_t* pin,
                                       strata_stream_t* consumer,
                                       char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_param_pin_wait_on";
    STRATA_RETURN_IF_ERROR(Require(pin, kCall, "pin"));
    STRATA_RETURN_IF_ERROR(Require(consumer, kCall, "consumer"));
    STRATA_RETURN_IF_ERROR(SameDevice(consumer, pin->eng->dev, kCall));
    bool known = false;
    for (strata_stream* s : pin->consumers) known = known || s == consumer;
    // Counted before the call: the pin may record the stream even when
    // WaitOn fails part-way, and the count only delays the stream's destroy.
    if (!known) {
      pin->consumers.push_back(consumer);
      consumer->users.fetch_add(1);
    }
    return pin->pin.WaitOn(*consumer->stream);
  });
}

void strata_param_pin_release(strata_param_pin_t* pin) {
  if (pin == nullptr) return;
  pin->pin.Reset();
  for (strata_stream* s : pin->consumers) s->users.fetch_sub(1);
  pin->eng->users.fetch_sub(1);
  delete pin;
}

strata_code_t strata_engine_add_grad(strata_engine_t* engine, uint32_t id,
                                     const void* grad, strata_dtype_t dtype,
                                     strata_stream_t* producer, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_add_grad";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(grad, kCall, "grad"));
    STRATA_RETURN_IF_ERROR(Require(producer, kCall, "producer"));
    STRATA_RETURN_IF_ERROR(SameDevice(producer, engine->dev, kCall));
    STRATA_ASSIGN_OR_RETURN(ElementType t,
                            ToElementType(EnumValue(dtype), kCall));
    return engine->engine->AddGrad(id, grad, t, *producer->stream);
  });
}

strata_code_t strata_engine_add_grad_owned(strata_engine_t* engine, uint32_t id,
                                           strata_device_memory_t* grad,
                                           strata_dtype_t dtype,
                                           strata_stream_t* producer,
                                           char** errptr) {
  // Frees `grad` on every path, as the header promises.
  std::unique_ptr<strata_device_memory_t, void (*)(strata_device_memory_t*)>
      owned(grad, strata_device_memory_free);
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_add_grad_owned";
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(grad, kCall, "grad"));
    STRATA_RETURN_IF_ERROR(Require(producer, kCall, "producer"));
    STRATA_RETURN_IF_ERROR(SameDevice(producer, engine->dev, kCall));
    STRATA_RETURN_IF_ERROR(SameDevice(grad->stream, engine->dev, kCall));
    STRATA_ASSIGN_OR_RETURN(ElementType t,
                            ToElementType(EnumValue(dtype), kCall));
    return engine->engine->AddGrad(id, std::move(grad->memory), t,
                                   *producer->stream);
  });
}

strata_code_t strata_engine_wait_grads(strata_engine_t* engine, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(
        Require(engine, "strata_engine_wait_grads", "engine"));
    return engine->engine->WaitGrads();
  });
}

strata_code_t strata_engine_begin_step(strata_engine_t* engine, double lr,
                                       double loss_scale, double max_grad_norm,
                                       char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(
        Require(engine, "strata_engine_begin_step", "engine"));
    return engine->engine->BeginStep(ArgsOf(lr, loss_scale, max_grad_norm));
  });
}

strata_code_t strata_engine_step(strata_engine_t* engine, double lr,
                                 double loss_scale, double max_grad_norm,
                                 int* applied, double* grad_norm, int64_t* step,
                                 char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(Require(engine, "strata_engine_step", "engine"));
    STRATA_ASSIGN_OR_RETURN(
        strata::StepResult r,
        engine->engine->Step(ArgsOf(lr, loss_scale, max_grad_norm)));
    if (applied != nullptr) *applied = r.applied ? 1 : 0;
    if (grad_norm != nullptr) *grad_norm = r.grad_norm;
    if (step != nullptr) *step = r.step;
    return Status::Ok();
  });
}

strata_code_t strata_engine_loss_scale(strata_engine_t* engine, double* scale,
                                       char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_loss_scale";
    STRATA_RETURN_IF_ERROR(Require(scale, kCall, "scale"));
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    *scale = engine->engine->LossScale();
    return Status::Ok();
  });
}

strata_code_t strata_engine_stats_json(strata_engine_t* engine, char** json,
                                       char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_stats_json";
    STRATA_RETURN_IF_ERROR(Require(json, kCall, "json"));
    *json = nullptr;
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    const std::string s = strata::EngineStatsJson(engine->engine->stats());
    *json = CopyString(s);
    if (*json == nullptr) {
      return Status::OutOfMemory(std::string(kCall) + ": " +
                                 std::to_string(s.size() + 1) +
                                 " bytes for the JSON");
    }
    return Status::Ok();
  });
}

strata_code_t strata_engine_save_checkpoint(strata_engine_t* engine,
                                            const char* dir, int64_t step,
                                            int keep, int save_params,
                                            char** path, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_save_checkpoint";
    if (path != nullptr) *path = nullptr;
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    // Refusals that every rank makes alike come before any collective.
    STRATA_RETURN_IF_ERROR(Require(dir, kCall, "dir"));
    STRATA_ASSIGN_OR_RETURN(
        std::string committed,
        strata::wrap::SaveEngineCheckpoint(*engine->engine, engine->rank, kCall,
                                           dir, step, keep, save_params != 0));
    if (path != nullptr) {
      *path = CopyString(committed);
      if (*path == nullptr) {
        return Status::OutOfMemory(std::string(kCall) + ": " +
                                   std::to_string(committed.size() + 1) +
                                   " bytes for the path (the checkpoint is "
                                   "committed)");
      }
    }
    return Status::Ok();
  });
}

strata_code_t strata_engine_load_checkpoint(strata_engine_t* engine,
                                            const char* path, char** loaded,
                                            char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_engine_load_checkpoint";
    if (loaded != nullptr) *loaded = nullptr;
    STRATA_RETURN_IF_ERROR(Require(engine, kCall, "engine"));
    STRATA_RETURN_IF_ERROR(Require(path, kCall, "path"));
    STRATA_ASSIGN_OR_RETURN(
        std::string opened,
        strata::wrap::LoadEngineCheckpoint(*engine->engine, kCall, path));
    if (loaded != nullptr) {
      *loaded = CopyString(opened);
      if (*loaded == nullptr) {
        return Status::OutOfMemory(std::string(kCall) + ": " +
                                   std::to_string(opened.size() + 1) +
                                   " bytes for the path (the checkpoint is "
                                   "loaded)");
      }
    }
    return Status::Ok();
  });
}

strata_code_t strata_engine_destroy(strata_engine_t* engine, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    if (engine == nullptr) return Status::Ok();
    STRATA_RETURN_IF_ERROR(RefuseWhileUsed(
        engine->users.load(), "strata_engine_destroy", "pins are"));
    strata_device* dev = engine->dev;
    delete engine;
    dev->users.fetch_sub(1);
    return Status::Ok();
  });
}

// ---- CPU optimizer ----------------------------------------------------------

strata_code_t strata_cpu_optimizer_options_create(
    strata_cpu_optimizer_options_t** out, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(
        Require(out, "strata_cpu_optimizer_options_create", "out"));
    *out = new strata_cpu_optimizer_options();
    return Status::Ok();
  });
}

void strata_cpu_optimizer_options_destroy(
    strata_cpu_optimizer_options_t* options) {
  delete options;
}

#define STRATA_C_ALGO_MATCHES(c, k)    \
  static_assert(static_cast<int>(c) == \
                static_cast<int>(strata::CpuOptimizerAlgo::k))
STRATA_C_ALGO_MATCHES(STRATA_CPU_ADAM, kAdam);
STRATA_C_ALGO_MATCHES(STRATA_CPU_ADAMW, kAdamW);
STRATA_C_ALGO_MATCHES(STRATA_CPU_ADAGRAD, kAdagrad);
STRATA_C_ALGO_MATCHES(STRATA_CPU_LION, kLion);
STRATA_C_ALGO_MATCHES(STRATA_CPU_ADAFACTOR, kAdafactor);
STRATA_C_ALGO_MATCHES(STRATA_CPU_SM3, kSm3);
#undef STRATA_C_ALGO_MATCHES

// The enum is stored as given; strata_cpu_optimizer_create checks it.
void strata_cpu_optimizer_options_set_algo(
    strata_cpu_optimizer_options_t* options, strata_cpu_algo_t algo) {
  if (options != nullptr) {
    options->options.algo = static_cast<strata::CpuOptimizerAlgo>(Clamp8(algo));
  }
}

strata_code_t strata_cpu_optimizer_options_set_algo_name(
    strata_cpu_optimizer_options_t* options, const char* name, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_optimizer_options_set_algo_name";
    STRATA_RETURN_IF_ERROR(Require(options, kCall, "options"));
    STRATA_RETURN_IF_ERROR(Require(name, kCall, "name"));
    auto algo = strata::ParseCpuOptimizerAlgo(name);
    if (!algo.ok()) {
      return Status(
          algo.status().code(),
          std::string(kCall) + ": " + std::string(algo.status().message()));
    }
    options->options.algo = *algo;
    return Status::Ok();
  });
}

strata_code_t strata_cpu_optimizer_options_from_json(
    strata_cpu_optimizer_options_t* options, const char* json, size_t length,
    double* lr, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_optimizer_options_from_json";
    STRATA_RETURN_IF_ERROR(Require(options, kCall, "options"));
    if (length > 0) STRATA_RETURN_IF_ERROR(Require(json, kCall, "json"));
    STRATA_ASSIGN_OR_RETURN(
        strata::CpuOptimizerConfig c,
        strata::ParseCpuOptimizerConfig(std::string_view(json, length),
                                        "optimizer", options->options));
    options->options = c.options;
    if (lr != nullptr) *lr = c.lr;
    return Status::Ok();
  });
}

void strata_cpu_optimizer_options_set_betas(
    strata_cpu_optimizer_options_t* options, double beta1, double beta2) {
  if (options == nullptr) return;
  options->options.beta1 = beta1;
  options->options.beta2 = beta2;
}

void strata_cpu_optimizer_options_set_eps(
    strata_cpu_optimizer_options_t* options, double eps) {
  if (options != nullptr) options->options.eps = eps;
}

void strata_cpu_optimizer_options_set_weight_decay(
    strata_cpu_optimizer_options_t* options, double weight_decay) {
  if (options != nullptr) options->options.weight_decay = weight_decay;
}

void strata_cpu_optimizer_options_set_bias_correction(
    strata_cpu_optimizer_options_t* options, int bias_correction) {
  if (options != nullptr) options->options.bias_correction = bias_correction;
}

void strata_cpu_optimizer_options_set_variant(
    strata_cpu_optimizer_options_t* options, strata_cpu_variant_t variant) {
  if (options != nullptr) {
    options->options.variant =
        static_cast<strata::CpuKernelVariant>(Clamp8(variant));
  }
}

void strata_cpu_optimizer_options_set_threads(
    strata_cpu_optimizer_options_t* options, int threads) {
  if (options != nullptr) options->options.threads = threads;
}

void strata_cpu_optimizer_options_set_block8_sweeps(
    strata_cpu_optimizer_options_t* options, int sweeps) {
  if (options != nullptr) options->options.block8_sweeps = sweeps;
}

void strata_cpu_optimizer_options_set_adafactor_eps(
    strata_cpu_optimizer_options_t* options, double eps1, double eps2) {
  if (options == nullptr) return;
  options->options.adafactor.eps1 = eps1;
  options->options.adafactor.eps2 = eps2;
}

void strata_cpu_optimizer_options_set_adafactor_clip_threshold(
    strata_cpu_optimizer_options_t* options, double clip_threshold) {
  if (options != nullptr) {
    options->options.adafactor.clip_threshold = clip_threshold;
  }
}

void strata_cpu_optimizer_options_set_adafactor_decay_rate(
    strata_cpu_optimizer_options_t* options, double decay_rate) {
  if (options != nullptr) options->options.adafactor.decay_rate = decay_rate;
}

void strata_cpu_optimizer_options_set_adafactor_beta1(
    strata_cpu_optimizer_options_t* options, double beta1) {
  if (options != nullptr) options->options.adafactor.beta1 = beta1;
}

void strata_cpu_optimizer_options_set_adafactor_schedule(
    strata_cpu_optimizer_options_t* options, int relative_step,
    int scale_parameter, int warmup_init) {
  if (options == nullptr) return;
  options->options.adafactor.relative_step = relative_step != 0;
  options->options.adafactor.scale_parameter = scale_parameter != 0;
  options->options.adafactor.warmup_init = warmup_init != 0;
}

strata_code_t strata_cpu_optimizer_create(
    const strata_cpu_optimizer_options_t* options, strata_cpu_optimizer_t** out,
    char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_optimizer_create";
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    *out = nullptr;
    const strata::CpuOptimizerOptions o = OptionsOf(options);
    // The setters store what they are given; out-of-enum values stop here.
    if (static_cast<int>(o.algo) > STRATA_CPU_SM3) {
      return Status::InvalidArgument(std::string(kCall) + ": algo " +
                                     std::to_string(int(o.algo)) +
                                     " is not a strata_cpu_algo_t value");
    }
    if (static_cast<int>(o.variant) > STRATA_CPU_VARIANT_AVX512BF16) {
      return Status::InvalidArgument(std::string(kCall) + ": variant " +
                                     std::to_string(int(o.variant)) +
                                     " is not a strata_cpu_variant_t value");
    }
    auto h = std::make_unique<strata_cpu_optimizer>();
    STRATA_ASSIGN_OR_RETURN(h->optimizer, strata::NewCpuOptimizer(o));
    *out = h.release();
    return Status::Ok();
  });
}

void strata_cpu_optimizer_destroy(strata_cpu_optimizer_t* optimizer) {
  delete optimizer;
}

const char* strata_cpu_optimizer_variant(
    const strata_cpu_optimizer_t* optimizer) {
  if (optimizer == nullptr) return nullptr;
  switch (optimizer->optimizer->variant()) {
    case strata::CpuKernelVariant::kAuto:
      return "auto";
    case strata::CpuKernelVariant::kScalar:
      return "scalar";
    case strata::CpuKernelVariant::kAvx2:
      return "avx2";
    case strata::CpuKernelVariant::kAvx512:
      return "avx512";
    case strata::CpuKernelVariant::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

int strata_cpu_optimizer_threads(const strata_cpu_optimizer_t* optimizer) {
  return optimizer != nullptr ? optimizer->optimizer->threads() : 0;
}

strata_code_t strata_cpu_optimizer_step(strata_cpu_optimizer_t* optimizer,
                                        const strata_cpu_tensors_t* t,
                                        int64_t step, double lr,
                                        double inv_loss_scale, double clip_coef,
                                        int check_overflow, int* applied,
                                        char** errptr) {
  return Guard(errptr, [&]() -> Status {
    strata_cpu_step_args_t args = strata_cpu_step_args_default();
    args.step = step;
    args.lr = lr;
    args.inv_loss_scale = inv_loss_scale;
    args.clip_coef = clip_coef;
    args.check_overflow = check_overflow;
    STRATA_ASSIGN_OR_RETURN(
        strata::CpuStepResult r,
        StepCpu(optimizer, t, 0, 0, args, "strata_cpu_optimizer_step"));
    if (applied != nullptr) *applied = r.applied ? 1 : 0;
    return Status::Ok();
  });
}

strata_cpu_step_args_t strata_cpu_step_args_default(void) {
  const strata::CpuStepArgs d;
  strata_cpu_step_args_t a{};
  a.step = d.step;
  a.lr = d.lr;
  a.inv_loss_scale = d.inv_loss_scale;
  a.clip_coef = d.clip_coef;
  a.check_overflow = d.check_overflow ? 1 : 0;
  a.param_sq = d.param_sq;
  return a;
}

static_assert(sizeof(strata_cpu_step_result_t::pass_seconds) ==
              sizeof(strata::CpuStepResult::pass_seconds));

strata_code_t strata_cpu_optimizer_step_shaped(
    strata_cpu_optimizer_t* optimizer, const strata_cpu_tensors_t* t,
    size_t rows, size_t cols, const strata_cpu_step_args_t* args,
    strata_cpu_step_result_t* result, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_optimizer_step_shaped";
    STRATA_RETURN_IF_ERROR(Require(args, kCall, "args"));
    STRATA_ASSIGN_OR_RETURN(strata::CpuStepResult r,
                            StepCpu(optimizer, t, rows, cols, *args, kCall));
    if (result != nullptr) {
      *result = strata_cpu_step_result_t{};
      result->applied = r.applied ? 1 : 0;
      result->param_sq = r.param_sq;
      result->check_seconds = r.check_seconds;
      result->passes = r.passes;
      std::copy(std::begin(r.pass_seconds), std::end(r.pass_seconds),
                result->pass_seconds);
    }
    return Status::Ok();
  });
}

strata_code_t strata_cpu_step_footprint_of(
    const strata_cpu_optimizer_options_t* options,
    const strata_cpu_step_shape_t* shape, strata_cpu_step_footprint_t* out,
    char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_step_footprint_of";
    STRATA_RETURN_IF_ERROR(Require(shape, kCall, "shape"));
    STRATA_RETURN_IF_ERROR(Require(out, kCall, "out"));
    strata::CpuStepShape s;
    s.n = shape->n;
    s.rows = shape->rows;
    s.cols = shape->cols;
    STRATA_ASSIGN_OR_RETURN(s.grad_dtype,
                            ToCpuDType(EnumValue(shape->grad_dtype), kCall));
    STRATA_ASSIGN_OR_RETURN(s.moment_dtype,
                            ToCpuDType(EnumValue(shape->moment_dtype), kCall));
    s.has_working = shape->has_working != 0;
    if (s.has_working) {
      STRATA_ASSIGN_OR_RETURN(
          s.working_dtype, ToCpuDType(EnumValue(shape->working_dtype), kCall));
    }
    s.param_sq_known = shape->param_sq_known != 0;
    STRATA_ASSIGN_OR_RETURN(strata::CpuStepFootprint f,
                            strata::CpuStepFootprintOf(OptionsOf(options), s));
    *out = strata_cpu_step_footprint_t{};
    out->exp_avg_bytes = f.exp_avg_bytes;
    out->exp_avg_sq_bytes = f.exp_avg_sq_bytes;
    out->read_bytes = f.read_bytes;
    out->written_bytes = f.written_bytes;
    out->passes = f.passes;
    return Status::Ok();
  });
}

strata_code_t strata_cpu_optimizer_grad_stats(strata_cpu_optimizer_t* optimizer,
                                              const void* grad,
                                              strata_dtype_t dtype, size_t n,
                                              double scale, double* sum_sq,
                                              int* finite, char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_cpu_optimizer_grad_stats";
    STRATA_RETURN_IF_ERROR(Require(optimizer, kCall, "optimizer"));
    STRATA_ASSIGN_OR_RETURN(CpuDType t, ToCpuDType(EnumValue(dtype), kCall));
    STRATA_ASSIGN_OR_RETURN(
        strata::GradStats s,
        optimizer->optimizer->ComputeGradStats(grad, t, n, scale));
    if (sum_sq != nullptr) *sum_sq = s.sum_sq;
    if (finite != nullptr) *finite = s.finite ? 1 : 0;
    return Status::Ok();
  });
}

size_t strata_cpu_state_bytes(strata_dtype_t dtype, size_t n) {
  switch (EnumValue(dtype)) {  // no Status here: it may throw
    case STRATA_FLOAT32:
      return strata::CpuStateBytes(CpuDType::kFloat32, n);
    case STRATA_FLOAT16:
      return strata::CpuStateBytes(CpuDType::kFloat16, n);
    case STRATA_BFLOAT16:
      return strata::CpuStateBytes(CpuDType::kBFloat16, n);
    case STRATA_BLOCK8:
      return strata::CpuStateBytes(CpuDType::kBlock8, n);
  }
  return 0;
}

strata_code_t strata_convert(const void* src, strata_dtype_t src_dtype,
                             void* dst, strata_dtype_t dst_dtype, size_t n,
                             char** errptr) {
  return Guard(errptr, [&]() -> Status {
    constexpr const char* kCall = "strata_convert";
    STRATA_ASSIGN_OR_RETURN(CpuDType s,
                            ToCpuDType(EnumValue(src_dtype), kCall));
    STRATA_ASSIGN_OR_RETURN(CpuDType d,
                            ToCpuDType(EnumValue(dst_dtype), kCall));
    if (n > 0) {
      STRATA_RETURN_IF_ERROR(Require(src, kCall, "src"));
      STRATA_RETURN_IF_ERROR(Require(dst, kCall, "dst"));
    }
    return strata::ConvertCpuArray(src, s, dst, d, n);
  });
}

}  // extern "C"
