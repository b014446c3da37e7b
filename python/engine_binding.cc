// strata.Engine, strata.Pin and strata.Communicator: the memtier engine
// (include/strata/engine.h) for Python, on the device the engine owns
// (host-emulated or CUDA), alone or as one of several data-parallel ranks.
//
// Lifetimes: an Engine owns one Core (device, its streams, the engine). A
// Pin, and every DLPack tensor made from it, holds the pin's state, which
// holds the Core, so the engine outlives every view of its memory: close()
// refuses further calls at once, and the engine is destroyed when the last
// pin and the last tensor viewing a pin are gone. A parameter is released
// when its Pin is released (or collected) and no tensor made from it is
// alive, so a tensor never points at memory the engine has reused.
//
// Threads: the engine is thread-safe; each call copies the Core pointer
// first, so a close() from another thread cannot destroy it under a call.
// Blocking calls run without the GIL. The DLPack deleter touches no Python
// object, so it may run on any thread (autograd's), without the GIL.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "capi/engine_checkpoint.h"
#include "python/binding.h"
#include "python/dlpack.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/engine_config.h"
#include "strata/status.h"
#include "util/mutex.h"

namespace strata::python {
namespace {

// The device, its streams and the engine, destroyed in that reverse order.
struct Core {
  std::unique_ptr<Device> device;
  // Producer of the gradients handed over from host memory.
  std::unique_ptr<Stream> stream;
  Mutex mu;
  // Wrappers of native (PyTorch) streams, by handle; kept until the end as
  // pins that waited on them record them.
  std::map<uintptr_t, std::unique_ptr<Stream>> wrapped STRATA_GUARDED_BY(mu);
  std::unique_ptr<Engine> engine;
  int ordinal = 0;  // the CUDA device's
  std::atomic<int64_t> live_pins{0};

  ~Core() {
    engine.reset();  // before the streams and the device it used
  }

  // The wrapper of a stream handle as DLPack passes it (1: the legacy
  // default stream, CUDA's null handle).
  Stream* Native(int64_t handle) {
    return ValueOrThrow(
        Wrapped(handle == 1 ? 0 : static_cast<uintptr_t>(handle)));
  }

  StatusOr<Stream*> Wrapped(uintptr_t handle) STRATA_EXCLUDES(mu) {
    MutexLock l(&mu);
    auto it = wrapped.find(handle);
    if (it != wrapped.end()) return it->second.get();
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<Stream> s,
        device->WrapNativeStream(reinterpret_cast<void*>(handle),
                                 StreamKind::kCompute));
    Stream* p = s.get();
    wrapped.emplace(handle, std::move(s));
    return p;
  }
};

// One fetched parameter; shared by the Pin and the tensors made from it.
struct PinState {
  std::shared_ptr<Core> core;  // declared first: destroyed after `pin`
  ParamPin pin;
  std::vector<int64_t> shape;
  ~PinState() {
    pin.Reset();
    core->live_pins.fetch_sub(1);
  }
};

// Runs `f` (a blocking engine call) without the GIL; raises its error.
template <typename F>
auto NoGil(F f) {
  auto r = [&] {
    py::gil_scoped_release nogil;
    return f();
  }();
  if constexpr (std::is_same_v<decltype(r), Status>) {
    OkOrThrow(r);
  } else {
    return ValueOrThrow(std::move(r));
  }
}

int32_t DLDeviceTypeOf(const Device& d) {
  return d.kind() == DeviceKind::kCuda ? kDLCUDA : kDLCPU;
}

DLDataType DLTypeOf(ElementType t) {
  switch (t) {
    case ElementType::kFloat32:
      return {kDLFloat, 32, 1};
    case ElementType::kFloat16:
      return {kDLFloat, 16, 1};
    case ElementType::kBFloat16:
      return {kDLBfloat, 16, 1};
  }
  return {kDLFloat, 32, 1};
}

ElementType ToElement(CpuDType d) {
  switch (d) {
    case CpuDType::kFloat16:
      return ElementType::kFloat16;
    case CpuDType::kBFloat16:
      return ElementType::kBFloat16;
    default:
      return ElementType::kFloat32;
  }
}

// What a DLPack tensor made from a pin carries.
struct Export {
  std::shared_ptr<PinState> state;
  DLManagedTensor managed{};
};

void DeleteExport(DLManagedTensor* self) {
  delete static_cast<Export*>(self->manager_ctx);
}

void DestroyCapsule(PyObject* capsule) {
  // A consumer renames the capsule "used_dltensor" and owns the tensor.
  if (!PyCapsule_IsValid(capsule, kDLTensorCapsuleName)) return;
  auto* m = static_cast<DLManagedTensor*>(
      PyCapsule_GetPointer(capsule, kDLTensorCapsuleName));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

class PyPin {
 public:
  explicit PyPin(std::shared_ptr<PinState> s) : state_(std::move(s)) {}

  void Wait() {
    std::shared_ptr<PinState> s = State("wait");
    NoGil([&] { return s->pin.Wait(); });
  }

  // The protocol's arguments: `stream` is the consumer's stream (CUDA: its
  // handle; 1 the legacy default stream); the data has arrived for work
  // enqueued on it afterwards. None: the host waits. The rest are accepted
  // for torch 2.x, which passes them; this export is always DLPack 0.x.
  py::capsule DLPack(py::object stream, py::object /*max_version*/,
                     py::object /*dl_device*/, py::object copy) {
    std::shared_ptr<PinState> s = State("__dlpack__");
    if (!copy.is_none() && copy.cast<bool>()) {
      throw py::value_error(
          "strata.Pin.__dlpack__(copy=True): a pin exports its device "
          "memory only; copy the tensor made from it instead");
    }
    const bool cuda = s->core->device->kind() == DeviceKind::kCuda;
    if (cuda && !stream.is_none() && stream.cast<int64_t>() != -1) {
      Stream* consumer = s->core->Native(stream.cast<int64_t>());
      NoGil([&] { return s->pin.WaitOn(*consumer); });
    } else {
      NoGil([&] { return s->pin.Wait(); });
    }

    auto e = std::make_unique<Export>();
    e->state = s;
    DLTensor& t = e->managed.dl_tensor;
    t.data = s->pin.data();
    t.device = {DLDeviceTypeOf(*s->core->device), cuda ? s->core->ordinal : 0};
    t.ndim = static_cast<int32_t>(s->shape.size());
    t.dtype = DLTypeOf(s->pin.dtype());
    t.shape = s->shape.data();  // lives in the state the export holds
    t.strides = nullptr;        // C-contiguous
    t.byte_offset = 0;
    e->managed.manager_ctx = e.get();
    e->managed.deleter = DeleteExport;
    PyObject* cap =
        PyCapsule_New(&e->managed, kDLTensorCapsuleName, DestroyCapsule);
    if (cap == nullptr) throw py::error_already_set();
    e.release();
    return py::reinterpret_steal<py::capsule>(cap);
  }

  py::tuple DLPackDevice() {
    std::shared_ptr<PinState> s = State("__dlpack_device__");
    const Device& d = *s->core->device;
    return py::make_tuple(DLDeviceTypeOf(d),
                          d.kind() == DeviceKind::kCuda ? s->core->ordinal : 0);
  }

  void Release() { state_.reset(); }
  bool released() const { return state_ == nullptr; }
  const PinState& get(const char* what) { return *State(what); }

 private:
  std::shared_ptr<PinState> State(const char* what) {
    if (!state_) {
      ThrowStatus(Status::FailedPrecondition(
          std::string("strata.Pin.") + what +
          "() on a released pin (release() was called)"));
    }
    return state_;
  }

  std::shared_ptr<PinState> state_;
};

// Into `c`, which the caller destroys (without the GIL) on failure too.
Status NewCore(const DeviceOptions& d, const EngineOptions& o, Core& c) {
  STRATA_ASSIGN_OR_RETURN(c.device, NewDevice(d));
  STRATA_ASSIGN_OR_RETURN(c.stream, c.device->NewStream(StreamOptions{}));
  STRATA_ASSIGN_OR_RETURN(c.engine, Engine::Create(o, c.device.get()));
  c.ordinal = d.cuda_ordinal;
  return Status::Ok();
}

// A communicator the engines made with it share (EngineOptions::comm).
class PyComm {
 public:
  // What the constructor takes besides the backend and the timeout; each
  // belongs to one backend.
  struct Extra {
    std::optional<std::string> mpi_library;
    py::object mpi_comm;  // None, an mpi4py communicator or an address
    const PyComm* bootstrap = nullptr;
    int cuda_ordinal = 0;
    std::optional<uintptr_t> nccl_comm;  // an ncclComm_t as an int
    std::optional<std::vector<int>> nccl_ranks;
  };

  PyComm(const std::string& backend, double timeout_s, const Extra& x) {
    CommOptions o;
    if (backend == "single") {
      o.backend = CommBackendKind::kSingle;
    } else if (backend == "mpi") {
      o.backend = CommBackendKind::kMpi;
    } else if (backend == "nccl") {
      o.backend = CommBackendKind::kNccl;
    } else {
      Refuse("backend '" + backend +
             "' is not known; accepted: 'single', 'mpi', 'nccl'");
    }
    if (!(timeout_s > 0 && timeout_s <= 1e6)) {
      Refuse("timeout_s " + std::to_string(timeout_s) +
             " is out of range; accepted: (0, 1e6] seconds");
    }
    o.timeout_s = timeout_s;
    const bool mpi_args = x.mpi_library.has_value() || !x.mpi_comm.is_none();
    const bool nccl_args = x.bootstrap != nullptr || x.cuda_ordinal != 0 ||
                           x.nccl_comm.has_value() || x.nccl_ranks.has_value();
    if (mpi_args && o.backend != CommBackendKind::kMpi) {
      Refuse("mpi_library and mpi_comm are for backend 'mpi', not '" + backend +
             "'");
    }
    if (nccl_args && o.backend != CommBackendKind::kNccl) {
      Refuse(
          "bootstrap, cuda_ordinal, nccl_comm and nccl_ranks are for backend "
          "'nccl', not '" +
          backend + "'");
    }
    if (o.backend == CommBackendKind::kMpi) SetMpi(x, &o);
    if (o.backend == CommBackendKind::kNccl) SetNccl(x, &o);
    StatusOr<Communicator> c = [&] {
      py::gil_scoped_release nogil;
      return Communicator::Create(o);
    }();
    if (!c.ok()) {
      ThrowStatus(std::move(c).status().WithContext(kCall));
    }
    comm_ = std::make_shared<Communicator>(*std::move(c));
  }

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  std::string backend() const {
    return std::string(CommBackendName(comm_->backend()));
  }
  void Barrier() {
    std::shared_ptr<Communicator> c = comm_;
    NoGil([&] { return c->Barrier(); });
  }
  const std::shared_ptr<Communicator>& get() const { return comm_; }

 private:
  static constexpr const char* kCall = "strata.Communicator";

  [[noreturn]] static void Refuse(const std::string& why) {
    ThrowStatus(Status::InvalidArgument(std::string(kCall) + ": " + why));
  }

  // The backend's library, and the caller's MPI_Comm: an mpi4py
  // communicator, or the address of an MPI_Comm (mpi4py's
  // MPI._addressof(comm)), read once by Create.
  static void SetMpi(const Extra& x, CommOptions* o) {
    if (x.mpi_library.has_value()) {
      if (x.mpi_library->empty()) {
        Refuse(
            "mpi_library is empty; accepted: None (strata's MPI backend "
            "beside libstrata) or the backend's path");
      }
      o->mpi_library = *x.mpi_library;
    }
    if (x.mpi_comm.is_none()) return;
    uintptr_t address = 0;
    if (py::isinstance<py::int_>(x.mpi_comm)) {
      address = x.mpi_comm.cast<uintptr_t>();
    } else {
      try {
        address = py::module_::import("mpi4py.MPI")
                      .attr("_addressof")(x.mpi_comm)
                      .cast<uintptr_t>();
      } catch (py::error_already_set& e) {
        Refuse(
            "mpi_comm is neither an mpi4py communicator nor an MPI_Comm's "
            "address (" +
            std::string(e.what()) + ")");
      }
    }
    if (address == 0) Refuse("mpi_comm's address is 0");
    o->mpi_comm = reinterpret_cast<void*>(address);
  }

  // The caller's ncclComm_t with its ranks, or a bootstrap over `bootstrap`
  // (one rank when None).
  void SetNccl(const Extra& x, CommOptions* o) {
    if (x.cuda_ordinal < 0) {
      Refuse("cuda_ordinal " + std::to_string(x.cuda_ordinal) + " is negative");
    }
    o->cuda_ordinal = x.cuda_ordinal;
    if (x.nccl_comm.has_value()) {
      if (x.bootstrap != nullptr) {
        Refuse("give nccl_comm or bootstrap, not both");
      }
      if (*x.nccl_comm == 0) Refuse("nccl_comm is 0");
      o->nccl_comm = reinterpret_cast<void*>(*x.nccl_comm);
      if (x.nccl_ranks.has_value()) o->nccl_ranks = *x.nccl_ranks;
      return;
    }
    if (x.nccl_ranks.has_value()) Refuse("nccl_ranks needs nccl_comm");
    if (x.bootstrap == nullptr) {
      StatusOr<Communicator> one = Communicator::Create();
      if (!one.ok()) ThrowStatus(std::move(one).status());
      one_rank_ = std::make_shared<Communicator>(*std::move(one));
    }
    o->nccl_bootstrap =
        x.bootstrap != nullptr ? x.bootstrap->get().get() : one_rank_.get();
  }

  std::shared_ptr<Communicator> one_rank_;  // NCCL's bootstrap of one rank
  std::shared_ptr<Communicator> comm_;
};

struct PyStepResult {
  bool applied;
  double grad_norm;
  int64_t step;
  double loss_scale;
};

class PyEngine {
 public:
  PyEngine(const std::string& config, const std::string& device,
           uint64_t device_memory_bytes, int cuda_ordinal, const PyComm* comm) {
    EngineConfig cfg = ValueOrThrow(ParseEngineConfig(config));
    warnings_ = std::move(cfg.warnings);
    working_ = cfg.options.working_dtype;
    // The config says world_size and rank; Engine::Create checks them
    // against the communicator's size and rank.
    if (comm != nullptr) cfg.options.comm = comm->get();
    rank_ = cfg.options.rank;
    world_size_ = cfg.options.world_size;
    DeviceOptions d;
    if (device == "auto") {
      d.choice = DeviceChoice::kAuto;
    } else if (device == "host") {
      d.choice = DeviceChoice::kHostEmulated;
    } else if (device == "cuda") {
      d.choice = DeviceChoice::kCuda;
    } else {
      throw py::value_error("strata.Engine: device '" + device +
                            "': accepted 'auto', 'host', 'cuda'");
    }
    d.memory_budget_bytes = device_memory_bytes;
    d.cuda_ordinal = cuda_ordinal;
    auto core = std::make_shared<Core>();
    const Status st = [&] {
      py::gil_scoped_release nogil;
      Status r = NewCore(d, cfg.options, *core);
      if (!r.ok()) core.reset();
      return r;
    }();
    OkOrThrow(st);
    core_ = std::move(core);
    ordinal_ = cuda_ordinal;
  }

  ~PyEngine() {
    py::gil_scoped_release nogil;
    core_.reset();
  }

  TensorId Register(const std::string& name, const std::vector<int64_t>& shape,
                    const std::string& dtype) {
    std::shared_ptr<Core> c = Open("register");
    TensorSpec spec;
    spec.name = name;
    spec.shape = shape;
    if (dtype.empty()) {
      spec.dtype = ToElement(working_);
    } else if (dtype == "bfloat16") {
      spec.dtype = ElementType::kBFloat16;
    } else if (dtype == "float16") {
      spec.dtype = ElementType::kFloat16;
    } else {
      throw py::value_error("strata.Engine.register(" + name + "): dtype '" +
                            dtype + "': accepted bfloat16, float16");
    }
    return ValueOrThrow(c->engine->Register(spec));
  }

  void Start() {
    std::shared_ptr<Core> c = Open("start");
    NoGil([&] { return c->engine->Start(); });
  }

  void SetInitialValues(TensorId id, py::handle values) {
    std::shared_ptr<Core> c = Open("set_initial_values");
    const std::span<float> v = Master(*c, id, values, "values");
    NoGil([&] { return c->engine->SetInitialValues(id, v); });
  }

  void ReadMaster(TensorId id, py::handle out) {
    std::shared_ptr<Core> c = Open("read_master");
    const std::span<float> v = Master(*c, id, out, "out");
    NoGil([&] { return c->engine->ReadMaster(id, v); });
  }

  PyPin Fetch(TensorId id) {
    std::shared_ptr<Core> c = Open("fetch");
    Numel(*c, id, "fetch");
    auto s = std::make_shared<PinState>();
    c->live_pins.fetch_add(1);
    s->core = c;
    s->shape = c->engine->spec(id).shape;
    s->pin = NoGil([&] { return c->engine->Fetch(id); });
    return PyPin(std::move(s));
  }

  // Copies the gradient into device memory the engine frees once it has
  // read it, so the caller's tensor may go as soon as this returns.
  void AddGrad(TensorId id, py::handle grad, py::object stream) {
    std::shared_ptr<Core> c = Open("add_grad");
    const size_t n = Numel(*c, id, "add_grad");
    const Borrowed g =
        Borrow(grad, "grad", kAcceptF32 | kAcceptF16 | kAcceptBF16,
               /*host_only=*/false);
    CheckCount(*c, id, g, n);
    const bool cuda = c->device->kind() == DeviceKind::kCuda;
    const bool host_mem = g.device_type == kDLCPU ||
                          g.device_type == kDLCUDAHost ||
                          g.device_type == kDLROCMHost;
    if (!host_mem &&
        !(cuda && g.device_type == kDLCUDA && g.device_id == ordinal_)) {
      throw py::value_error(
          "grad of " + c->engine->spec(id).name + " is on " +
          DeviceName(g.device_type) + ":" + std::to_string(g.device_id) +
          "; this engine's device (" + c->device->name() + ") takes " +
          (cuda ? "cuda:" + std::to_string(ordinal_) + " or host" : "host") +
          " memory");
    }
    Stream* producer = cuda && !stream.is_none()
                           ? c->Native(stream.cast<int64_t>())
                           : c->stream.get();
    const ElementType t = ToElement(g.dtype);
    NoGil([&] { return HandOver(*c, id, g, host_mem, t, *producer); });
  }

  void WaitGrads() {
    std::shared_ptr<Core> c = Open("wait_grads");
    NoGil([&] { return c->engine->WaitGrads(); });
  }

  static StepArgs ArgsOf(double lr, double loss_scale, double max_grad_norm) {
    StepArgs a;
    a.lr = lr;
    a.loss_scale = loss_scale;
    a.max_grad_norm = max_grad_norm;
    return a;
  }

  void BeginStep(double lr, double loss_scale, double max_grad_norm) {
    std::shared_ptr<Core> c = Open("begin_step");
    const StepArgs a = ArgsOf(lr, loss_scale, max_grad_norm);
    NoGil([&] { return c->engine->BeginStep(a); });
  }

  PyStepResult Step(double lr, double loss_scale, double max_grad_norm) {
    std::shared_ptr<Core> c = Open("step");
    const StepArgs a = ArgsOf(lr, loss_scale, max_grad_norm);
    const StepResult v = NoGil([&] { return c->engine->Step(a); });
    return PyStepResult{v.applied, v.grad_norm, v.step, v.loss_scale};
  }

  double LossScale() { return Open("loss_scale")->engine->LossScale(); }

  // A collective with several ranks (capi/engine_checkpoint.h).
  std::string SaveCheckpoint(py::object dir, int64_t step, bool params,
                             std::optional<int> keep) {
    constexpr const char* kCall = "strata.Engine.save_checkpoint";
    std::shared_ptr<Core> c = Open("save_checkpoint");
    const std::string d = Path(dir, kCall, "dir");
    if (keep.has_value() && *keep < 1) {
      ThrowStatus(Status::InvalidArgument(
          std::string(kCall) + ": keep " + std::to_string(*keep) +
          " is below 1; accepted: >= 1, or None (the default, 2)"));
    }
    return NoGil([&] {
      return wrap::SaveEngineCheckpoint(*c->engine, rank_, kCall, d, step,
                                        keep.value_or(0), params);
    });
  }

  std::string LoadCheckpoint(py::object path) {
    constexpr const char* kCall = "strata.Engine.load_checkpoint";
    std::shared_ptr<Core> c = Open("load_checkpoint");
    const std::string p = Path(path, kCall, "path");
    return NoGil(
        [&] { return wrap::LoadEngineCheckpoint(*c->engine, kCall, p); });
  }

  py::object Stats() {
    std::shared_ptr<Core> c = Open("stats");
    const std::string json = EngineStatsJson(c->engine->stats());
    return py::module_::import("json").attr("loads")(json);
  }

  void Close() {
    if (!core_) return;
    std::shared_ptr<Core> c = std::move(core_);
    py::gil_scoped_release nogil;
    c.reset();  // the engine goes now, or with its last pin
  }

  bool closed() const { return core_ == nullptr; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t live_pins() { return core_ ? core_->live_pins.load() : 0; }
  const std::vector<std::string>& warnings() const { return warnings_; }
  std::string working_dtype() const {
    return std::string(ElementTypeName(ToElement(working_)));
  }
  size_t num_tensors() { return Open("num_tensors")->engine->num_tensors(); }
  std::string device_name() { return Open("device")->device->name(); }
  std::string device_kind() {
    return std::string(DeviceKindName(Open("device_kind")->device->kind()));
  }
  py::tuple TensorInfo(TensorId id) {
    std::shared_ptr<Core> c = Open("tensor");
    Numel(*c, id, "tensor");
    const TensorSpec& s = c->engine->spec(id);
    return py::make_tuple(s.name, py::tuple(py::cast(s.shape)),
                          std::string(ElementTypeName(s.dtype)));
  }

 private:
  std::shared_ptr<Core> Open(const char* what) {
    if (!core_) {
      ThrowStatus(Status::FailedPrecondition(
          std::string("strata.Engine.") + what +
          "() on a closed engine (close() was called)"));
    }
    return core_;
  }

  // A str or os.PathLike, not empty.
  static std::string Path(py::handle p, const char* call, const char* what) {
    py::object s = py::module_::import("os").attr("fspath")(p);
    if (!py::isinstance<py::str>(s)) {
      throw py::type_error(std::string(call) + ": " + what +
                           " must be a str or os.PathLike of str");
    }
    std::string v = s.cast<std::string>();
    if (v.empty()) {
      ThrowStatus(Status::InvalidArgument(std::string(call) + ": " + what +
                                          " is empty"));
    }
    return v;
  }

  static size_t Numel(Core& c, TensorId id, const char* what) {
    if (id >= c.engine->num_tensors()) {
      ThrowStatus(Status::InvalidArgument(
          std::string("strata.Engine.") + what + ": tensor id " +
          std::to_string(id) + " is not registered (" +
          std::to_string(c.engine->num_tensors()) + " tensors)"));
    }
    size_t n = 1;
    for (int64_t d : c.engine->spec(id).shape) n *= static_cast<size_t>(d);
    return n;
  }

  static void CheckCount(Core& c, TensorId id, const Borrowed& b, size_t n) {
    if (b.numel != n) {
      throw py::value_error("tensor " + c.engine->spec(id).name + " has " +
                            std::to_string(n) + " elements; the array has " +
                            std::to_string(b.numel));
    }
  }

  // A float32 host array of the tensor's element count, borrowed for the
  // call (the caller holds `arr`).
  static std::span<float> Master(Core& c, TensorId id, py::handle arr,
                                 const char* what) {
    const size_t n = Numel(c, id, what);
    const Borrowed v = Borrow(arr, what, kAcceptF32);
    CheckCount(c, id, v, n);
    return std::span<float>(static_cast<float*>(v.data), n);
  }

  static Status HandOver(Core& c, TensorId id, const Borrowed& g, bool host_mem,
                         ElementType t, Stream& producer) {
    STRATA_ASSIGN_OR_RETURN(DeviceMemory copy,
                            c.device->Allocate(g.nbytes, producer));
    if (host_mem) {
      // From pageable memory the copy returns once the source may be
      // reused; from page-locked memory it is asynchronous, so wait.
      STRATA_RETURN_IF_ERROR(c.device->CopyAsync(
          producer, copy.data(), g.data, g.nbytes, CopyKind::kHostToDevice));
      if (g.device_type != kDLCPU) {
        STRATA_RETURN_IF_ERROR(c.device->SynchronizeStream(producer));
      }
    } else {
      // Ordered on the producer stream, so PyTorch reuses the memory only
      // after the copy.
      STRATA_ASSIGN_OR_RETURN(
          ExternalDeviceMemory ext,
          c.device->RegisterExternalMemory(g.data, g.nbytes));
      STRATA_RETURN_IF_ERROR(c.device->CopyAsync(
          producer, copy.data(), g.data, g.nbytes, CopyKind::kDeviceToDevice));
    }
    return c.engine->AddGrad(id, std::move(copy), t, producer);
  }

  std::shared_ptr<Core> core_;
  std::vector<std::string> warnings_;
  CpuDType working_ = CpuDType::kBFloat16;
  int ordinal_ = 0;
  int rank_ = 0;  // EngineOptions::rank: rank 0 writes checkpoints
  int world_size_ = 1;
};

}  // namespace

void BindEngine(py::module_& m) {
  py::class_<PyComm>(m, "Communicator", R"doc(
The data-parallel communicator engines average gradients over
(include/strata/comm.h).

Communicator(backend='single', timeout_s=300.0, mpi_library=None,
             bootstrap=None, cuda_ordinal=0, mpi_comm=None, nccl_comm=None,
             nccl_ranks=None)

backend: 'single' (one rank; every collective a copy), 'mpi' (the ranks
of MPI_COMM_WORLD: start the processes with mpirun; MPI is initialized if
the process has not done so; or those of `mpi_comm`, the caller's
communicator: an mpi4py one or the address of an MPI_Comm, duplicated, MPI
initialized by the caller) or 'nccl' (the engine's collectives on CUDA
GPUs, on GPU `cuda_ordinal`: the caller's `nccl_comm`, an ncclComm_t as an
int, not owned, with `nccl_ranks`, its members' global ranks; or the ranks
of `bootstrap`, an 'mpi' Communicator whose rank 0 broadcasts the NCCL id;
or one rank when neither is given).
timeout_s: how long a collective waits for the other ranks before it fails,
in (0, 1e6] seconds. mpi_library: None (strata's MPI backend,
libstrata_comm_mpi.so, beside libstrata, then the loader's search path) or
the backend's path. strata.Error (code 'Unavailable') when MPI, NCCL or a
GPU is missing. Give it to one Engine (Engine(..., comm=...)); the engine
keeps it alive.
)doc")
      .def(py::init([](const std::string& backend, double timeout_s,
                       std::optional<std::string> mpi_library,
                       const PyComm* bootstrap, int cuda_ordinal,
                       py::object mpi_comm, std::optional<uintptr_t> nccl_comm,
                       std::optional<std::vector<int>> nccl_ranks) {
             PyComm::Extra x;
             x.mpi_library = std::move(mpi_library);
             x.mpi_comm = std::move(mpi_comm);
             x.bootstrap = bootstrap;
             x.cuda_ordinal = cuda_ordinal;
             x.nccl_comm = nccl_comm;
             x.nccl_ranks = std::move(nccl_ranks);
             return std::make_unique<PyComm>(backend, timeout_s, x);
           }),
           py::arg("backend") = "single", py::arg("timeout_s") = 300.0,
           py::arg("mpi_library") = py::none(),
           py::arg("bootstrap") = py::none(), py::arg("cuda_ordinal") = 0,
           py::arg("mpi_comm") = py::none(), py::arg("nccl_comm") = py::none(),
           py::arg("nccl_ranks") = py::none())
      .def_property_readonly("rank", &PyComm::rank)
      .def_property_readonly("size", &PyComm::size)
      .def_property_readonly("backend", &PyComm::backend)
      .def("barrier", &PyComm::Barrier,
           "Returns once every rank has called it (a collective; not while "
           "an engine made with this communicator lives).")
      .def("__repr__", [](const PyComm& c) {
        return "Communicator(backend='" + c.backend() +
               "', rank=" + std::to_string(c.rank()) +
               ", size=" + std::to_string(c.size()) + ")";
      });

  py::class_<PyStepResult>(m, "StepResult",
                           "What Engine.step() did: applied (False: an inf "
                           "or nan skipped the step), grad_norm, step, "
                           "loss_scale (what the gradients were divided by).")
      .def_readonly("applied", &PyStepResult::applied)
      .def_readonly("grad_norm", &PyStepResult::grad_norm)
      .def_readonly("step", &PyStepResult::step)
      .def_readonly("loss_scale", &PyStepResult::loss_scale)
      .def("__repr__", [](const PyStepResult& r) {
        return "StepResult(applied=" +
               std::string(r.applied ? "True" : "False") +
               ", grad_norm=" + std::to_string(r.grad_norm) +
               ", step=" + std::to_string(r.step) +
               ", loss_scale=" + std::to_string(r.loss_scale) + ")";
      });

  py::class_<PyPin>(m, "Pin", R"doc(
A fetched parameter (Engine.fetch): its device copy stays put while the pin
or any tensor made from it lives. torch.from_dlpack(pin) views it without a
copy (a CPU tensor on the host-emulated device, a CUDA tensor on CUDA), after
waiting for the data (the host waits; on CUDA, the consumer's stream). The
parameter is released once release() was called (or the pin collected) and
every such tensor is gone.
)doc")
      .def("wait", &PyPin::Wait, "Blocks until the data has arrived.")
      .def("release", &PyPin::Release,
           "Drops this pin's hold; tensors made from it keep theirs.")
      .def("__dlpack__", &PyPin::DLPack, py::kw_only(),
           py::arg("stream") = py::none(), py::arg("max_version") = py::none(),
           py::arg("dl_device") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack_device__", &PyPin::DLPackDevice)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyPin& self, py::args) {
             self.Release();
             return false;
           })
      .def_property_readonly("released", &PyPin::released)
      .def_property_readonly(
          "shape",
          [](PyPin& self) {
            return py::tuple(py::cast(self.get("shape").shape));
          })
      .def_property_readonly(
          "dtype",
          [](PyPin& self) {
            return std::string(ElementTypeName(self.get("dtype").pin.dtype()));
          })
      .def_property_readonly(
          "nbytes", [](PyPin& self) { return self.get("nbytes").pin.bytes(); })
      .def_property_readonly("data_ptr", [](PyPin& self) {
        return reinterpret_cast<uintptr_t>(self.get("data_ptr").pin.data());
      });

  py::class_<PyEngine>(m, "Engine", R"doc(
strata's engine (include/strata/engine.h) on a device it owns.

Engine(config, device='auto', device_memory_bytes=0, cuda_ordinal=0,
       comm=None)

config: the JSON text of a strata config or a DeepSpeed ds_config
(docs/config.md); a bad key raises strata.InvalidArgumentError naming its
JSON path. device: 'host' (host-emulated: device memory is host memory),
'cuda', or 'auto' (CUDA when a GPU works, else host; STRATA_DEVICE may
decide). device_memory_bytes: the device's budget (0 = automatic). comm: a
strata.Communicator for data-parallel ranks; the config still says
world_size, rank and zero_stage, which must agree with it.

Register every tensor, start(), set_initial_values(), then per step fetch()
what compute needs, add_grad() each gradient, step(). Tensor ids are the
integers register() returns. Calls after close() raise strata.Error.
)doc")
      .def(py::init<const std::string&, const std::string&, uint64_t, int,
                    const PyComm*>(),
           py::arg("config"), py::arg("device") = "auto",
           py::arg("device_memory_bytes") = 0, py::arg("cuda_ordinal") = 0,
           py::arg("comm") = py::none())
      .def("register", &PyEngine::Register, py::arg("name"), py::arg("shape"),
           py::arg("dtype") = "",
           "Before start(): a trainable tensor; returns its id. dtype: "
           "'bfloat16' or 'float16' (default: the config's working dtype).")
      .def("start", &PyEngine::Start,
           "Lays the tensors out and reserves every tier.")
      .def("set_initial_values", &PyEngine::SetInitialValues, py::arg("id"),
           py::arg("values"),
           "After start(), before the first step: a float32 host array of "
           "the tensor's element count, written to its master and working "
           "copy.")
      .def("read_master", &PyEngine::ReadMaster, py::arg("id"), py::arg("out"),
           "Fills `out` (a float32 host array of the tensor's element "
           "count) with the tensor's fp32 master.")
      .def("fetch", &PyEngine::Fetch, py::arg("id"),
           "A Pin of the tensor's working copy; returns at once.")
      .def("add_grad", &PyEngine::AddGrad, py::arg("id"), py::arg("grad"),
           py::arg("stream") = py::none(),
           "Hands over a gradient (float32, float16 or bfloat16, "
           "C-contiguous, the tensor's element count, multiplied by the loss "
           "scale): host memory, or on CUDA memory of the engine's GPU "
           "produced on `stream` (a CUDA stream handle; None: the legacy "
           "default stream). The array may be freed when the call returns.")
      .def("wait_grads", &PyEngine::WaitGrads,
           "Blocks until every gradient handed over is accumulated.")
      .def("begin_step", &PyEngine::BeginStep, py::kw_only(), py::arg("lr"),
           py::arg("loss_scale") = 0.0, py::arg("max_grad_norm") = 0.0,
           "Optional, before the backward of the step's last micro-batch, "
           "with the arguments step() will get (max_grad_norm 0): each "
           "tensor's next gradient is its last before step(), and the "
           "engine updates a unit, or takes its gradient's statistics, as "
           "soon as all of its tensors' last gradients are in, while "
           "backward still runs; step() does the rest, to the same results. "
           "Until step() returns, a tensor whose last gradient was handed "
           "over can be neither fetched nor given another.")
      .def("step", &PyEngine::Step, py::kw_only(), py::arg("lr"),
           py::arg("loss_scale") = 0.0, py::arg("max_grad_norm") = 0.0,
           "The optimizer over every tensor; returns a StepResult. "
           "loss_scale 0: the engine's own (Engine.loss_scale).")
      .def_property_readonly(
          "loss_scale", &PyEngine::LossScale,
          "The scale to multiply the next step's loss by: 1 without loss "
          "scaling, else the config's static scale or the dynamic one.")
      .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"),
           py::arg("step"), py::kw_only(), py::arg("params") = false,
           py::arg("keep") = py::none(),
           "Between steps: writes checkpoint `step` (>= 0) of the directory "
           "`dir` (masters, moments, step count, loss scale; the working "
           "copy too with params=True), keeping the `keep` newest (None: "
           "2). Returns the checkpoint's path. With several ranks every "
           "rank calls it alike and rank 0 writes.")
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("path"),
           "After start(): replaces the state with a checkpoint's (a "
           "checkpoint, or a directory of them: its latest), saved at any "
           "world size. Returns the path loaded. With several ranks every "
           "rank calls it alike.")
      .def("stats", &PyEngine::Stats, "The engine's counters as a dict.")
      .def("tensor", &PyEngine::TensorInfo, py::arg("id"),
           "(name, shape, dtype) of a registered tensor.")
      .def("close", &PyEngine::Close,
           "Refuses every later call; the engine is destroyed once no pin "
           "or tensor made from one is left.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyEngine& self, py::args) {
             self.Close();
             return false;
           })
      .def_property_readonly("closed", &PyEngine::closed)
      .def_property_readonly("rank", &PyEngine::rank,
                             "The config's rank (0 with one rank).")
      .def_property_readonly("world_size", &PyEngine::world_size,
                             "The config's world_size.")
      .def_property_readonly("live_pins", &PyEngine::live_pins,
                             "Pins (or tensors made from them) alive now.")
      .def_property_readonly("warnings", &PyEngine::warnings,
                             "The config's warnings (keys accepted but not "
                             "acted on), each '<json path>: <why>'.")
      .def_property_readonly("working_dtype", &PyEngine::working_dtype)
      .def_property_readonly("num_tensors", &PyEngine::num_tensors)
      .def_property_readonly("device", &PyEngine::device_name)
      .def_property_readonly("device_kind", &PyEngine::device_kind);
}

}  // namespace strata::python
