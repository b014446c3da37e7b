// strata._strata: the extension module of the Python package (docs/python.md).
// It binds the CPU optimizer on caller memory (here) and the engine
// (engine_binding.cc). Arrays arrive as DLPack: any
// object with __dlpack__ (torch tensors, NumPy arrays) or a "dltensor"
// capsule; the module borrows the memory for the length of one call (it
// holds the capsule, whose destructor returns the memory to its producer)
// and never links a tensor library.
//
// Errors: what the binding checks itself raises TypeError (not an array, a
// dtype it does not take) or ValueError (shape, layout, device, alignment,
// overlap); a strata Status raises strata.InvalidArgumentError (a
// ValueError) for kInvalidArgument and kOutOfRange, strata.Error (a
// RuntimeError) otherwise, with strata's message and its code name in
// `.code`.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "python/binding.h"
#include "python/dlpack.h"
#include "strata/config.h"
#include "strata/cpu_adam.h"
#include "strata/status.h"
#include "strata/version.h"

namespace strata::python {
namespace {

// The exception types (module attributes; alive as long as the module).
PyObject* g_error = nullptr;
PyObject* g_invalid_argument = nullptr;

}  // namespace

[[noreturn]] void ThrowStatus(const Status& s) {
  PyObject* type = (s.code() == StatusCode::kInvalidArgument ||
                    s.code() == StatusCode::kOutOfRange)
                       ? g_invalid_argument
                       : g_error;
  py::object exc =
      py::reinterpret_borrow<py::object>(type)(std::string(s.message()));
  exc.attr("code") = std::string(StatusCodeName(s.code()));
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

namespace {

std::string_view DTypeName(CpuDType d) {
  switch (d) {
    case CpuDType::kFloat32:
      return "float32";
    case CpuDType::kFloat16:
      return "float16";
    case CpuDType::kBFloat16:
      return "bfloat16";
    case CpuDType::kBlock8:
      return "block8";
  }
  return "?";
}

CpuDType ParseDType(std::string_view name) {
  for (CpuDType d : {CpuDType::kFloat32, CpuDType::kFloat16,
                     CpuDType::kBFloat16, CpuDType::kBlock8}) {
    if (name == DTypeName(d)) return d;
  }
  throw py::value_error("unknown dtype '" + std::string(name) +
                        "': accepted float32, float16, bfloat16, block8");
}

}  // namespace

std::string DeviceName(int32_t type) {
  switch (type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda";
    case kDLCUDAHost:
      return "cuda_host";
    case kDLROCM:
      return "rocm";
    case kDLROCMHost:
      return "rocm_host";
    default:
      return "device type " + std::to_string(type);
  }
}

namespace {

std::string Dims(const int64_t* v, int32_t n) {
  std::string s = "[";
  for (int32_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

std::string Accepted(unsigned accept) {
  std::vector<std::string> names;
  if (accept & kAcceptF32) names.emplace_back("float32");
  if (accept & kAcceptF16) names.emplace_back("float16");
  if (accept & kAcceptBF16) names.emplace_back("bfloat16");
  if (accept & kAcceptU8) names.emplace_back("uint8 (block8 state)");
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    s += (i == 0 ? "" : (i + 1 == names.size() ? " or " : ", ")) + names[i];
  }
  return s;
}

// The "dltensor" capsule of `obj` (itself, or what obj.__dlpack__() gives).
py::object CapsuleOf(py::handle obj, const std::string& what) {
  if (PyCapsule_CheckExact(obj.ptr())) {
    if (!PyCapsule_IsValid(obj.ptr(), kDLTensorCapsuleName)) {
      throw py::value_error(
          what +
          ": the DLPack capsule was already consumed (a capsule is good for "
          "one import; pass the tensor itself)");
    }
    return py::reinterpret_borrow<py::object>(obj);
  }
  if (!py::hasattr(obj, "__dlpack__")) {
    throw py::type_error(what +
                         ": expected an array that supports DLPack (a torch "
                         "tensor, a NumPy array, an object with __dlpack__) "
                         "or a DLPack capsule, got " +
                         std::string(Py_TYPE(obj.ptr())->tp_name));
  }
  py::object capsule = obj.attr("__dlpack__")();
  if (!PyCapsule_IsValid(capsule.ptr(), kDLTensorCapsuleName)) {
    throw py::type_error(what + ": __dlpack__() of " +
                         std::string(Py_TYPE(obj.ptr())->tp_name) +
                         " did not return a \"dltensor\" capsule");
  }
  return capsule;
}

}  // namespace

Borrowed Borrow(py::handle obj, const std::string& what, unsigned accept,
                bool host_only) {
  Borrowed b;
  b.capsule = CapsuleOf(obj, what);
  auto* managed = static_cast<DLManagedTensor*>(
      PyCapsule_GetPointer(b.capsule.ptr(), kDLTensorCapsuleName));
  if (managed == nullptr) throw py::error_already_set();
  const DLTensor& t = managed->dl_tensor;

  const int32_t dev = t.device.device_type;
  b.device_type = dev;
  b.device_id = t.device.device_id;
  if (host_only && dev != kDLCPU && dev != kDLCUDAHost && dev != kDLROCMHost) {
    throw py::value_error(what + " is on " + DeviceName(dev) + ":" +
                          std::to_string(t.device.device_id) +
                          "; strata's CPU optimizer takes host memory (a "
                          "CPU tensor or array)");
  }

  size_t elem = 0;
  unsigned kind = 0;
  if (t.dtype.lanes == 1) {
    if (t.dtype.code == kDLFloat && t.dtype.bits == 32) {
      kind = kAcceptF32, elem = 4, b.dtype = CpuDType::kFloat32;
    } else if (t.dtype.code == kDLFloat && t.dtype.bits == 16) {
      kind = kAcceptF16, elem = 2, b.dtype = CpuDType::kFloat16;
    } else if (t.dtype.code == kDLBfloat && t.dtype.bits == 16) {
      kind = kAcceptBF16, elem = 2, b.dtype = CpuDType::kBFloat16;
    } else if (t.dtype.code == kDLUInt && t.dtype.bits == 8) {
      kind = kAcceptU8, elem = 1, b.dtype = CpuDType::kBlock8;
    }
  }
  if ((kind & accept) == 0) {
    // DLDataTypeCode names; float64 reads "float64", DLPack's bool "bool8".
    static constexpr const char* kCodes[] = {
        "int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
    const std::string code =
        t.dtype.code < std::size(kCodes)
            ? kCodes[t.dtype.code]
            : "(DLPack type code " + std::to_string(t.dtype.code) + ") ";
    throw py::type_error(
        what + " has dtype " + code + std::to_string(t.dtype.bits) +
        (t.dtype.lanes == 1 ? "" : "x" + std::to_string(t.dtype.lanes)) +
        "; accepted: " + Accepted(accept));
  }

  size_t numel = 1;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw py::value_error(what + " has a negative shape");
    numel *= static_cast<size_t>(t.shape[i]);
  }
  if (t.strides != nullptr && numel > 0) {
    int64_t expect = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expect) {
        throw py::value_error(what + " is not contiguous (shape " +
                              Dims(t.shape, t.ndim) + ", strides " +
                              Dims(t.strides, t.ndim) +
                              " elements); pass a C-contiguous array "
                              "(tensor.contiguous(), numpy.ascontiguousarray)");
      }
      expect *= t.shape[i];
    }
  }
  b.data = static_cast<char*>(t.data) + t.byte_offset;
  // kBlock8 state holds fp32 scales after the codes: 4-byte aligned.
  const size_t align = kind == kAcceptU8 ? 4 : elem;
  if (numel > 0 && reinterpret_cast<uintptr_t>(b.data) % align != 0) {
    throw py::value_error(what + " is not " + std::to_string(align) +
                          "-byte aligned (its data starts at an odd offset); "
                          "pass a copy");
  }
  b.numel = numel;
  b.nbytes = numel * elem;
  return b;
}

namespace {

void CheckNumel(const Borrowed& b, const std::string& what, size_t n) {
  if (b.numel != n) {
    throw py::value_error(what + " has " + std::to_string(b.numel) +
                          " elements; master has " + std::to_string(n));
  }
}

void CheckBytes(const Borrowed* b, const std::string& what, size_t bytes,
                std::string_view algo) {
  if (bytes == 0) return;  // unused by this algorithm: may be anything
  if (b == nullptr) {
    throw py::value_error(what + " is required by " + std::string(algo) + " (" +
                          std::to_string(bytes) + " bytes)");
  }
  if (b->nbytes != bytes) {
    throw py::value_error(what + " holds " + std::to_string(b->nbytes) +
                          " bytes; " + std::string(algo) + " with " +
                          std::string(DTypeName(b->dtype)) + " state needs " +
                          std::to_string(bytes) +
                          " (strata.state_bytes gives the size)");
  }
}

// The arrays of one update must not overlap (the kernel streams them
// independently).
void CheckDisjoint(
    const std::vector<std::pair<const Borrowed*, std::string>>& arrays) {
  for (size_t i = 0; i < arrays.size(); ++i) {
    for (size_t j = i + 1; j < arrays.size(); ++j) {
      const Borrowed& a = *arrays[i].first;
      const Borrowed& b = *arrays[j].first;
      const auto a0 = reinterpret_cast<uintptr_t>(a.data);
      const auto b0 = reinterpret_cast<uintptr_t>(b.data);
      if (a.nbytes && b.nbytes && a0 < b0 + b.nbytes && b0 < a0 + a.nbytes) {
        throw py::value_error(arrays[i].second + " and " + arrays[j].second +
                              " overlap in memory; each array of an update "
                              "must be its own memory");
      }
    }
  }
}

// A CpuOptimizer with its thread arena. close() frees the arena; a closed
// object refuses every call. Calls run without the GIL; two calls on one
// object at once (from two Python threads) are refused, not serialized, as
// the optimizer is thread-compatible only.
class PyCpuOptimizer {
 public:
  explicit PyCpuOptimizer(const CpuOptimizerOptions& o)
      : opt_(ValueOrThrow(NewCpuOptimizer(o))) {}

  bool Step(py::handle master, py::handle grad, py::handle exp_avg,
            py::handle exp_avg_sq, int64_t step, double lr, py::handle working,
            size_t rows, size_t cols, double inv_loss_scale, double clip_coef,
            bool check_overflow, double param_sq) {
    const CpuOptimizerOptions& o = Open("step").options();
    const Borrowed m = Borrow(master, "master", kAcceptF32);
    const size_t n = m.numel;
    const Borrowed g =
        Borrow(grad, "grad", kAcceptF32 | kAcceptF16 | kAcceptBF16);
    CheckNumel(g, "grad", n);
    std::vector<std::pair<const Borrowed*, std::string>> all = {{&m, "master"},
                                                                {&g, "grad"}};

    const unsigned state_kinds = kAcceptF32 | kAcceptBF16 | kAcceptU8;
    std::unique_ptr<Borrowed> m1, m2, w;
    if (!exp_avg.is_none()) {
      m1 = std::make_unique<Borrowed>(Borrow(exp_avg, "exp_avg", state_kinds));
      all.emplace_back(m1.get(), "exp_avg");
    }
    if (!exp_avg_sq.is_none()) {
      m2 = std::make_unique<Borrowed>(
          Borrow(exp_avg_sq, "exp_avg_sq", state_kinds));
      all.emplace_back(m2.get(), "exp_avg_sq");
    }
    if (!working.is_none()) {
      w = std::make_unique<Borrowed>(
          Borrow(working, "working", kAcceptF16 | kAcceptBF16));
      CheckNumel(*w, "working", n);
      all.emplace_back(w.get(), "working");
    }
    CheckDisjoint(all);

    CpuOptimizerTensors t;
    t.n = n;
    t.master = static_cast<float*>(m.data);
    t.grad = g.data;
    t.grad_dtype = g.dtype;
    // The moments' type: exp_avg's, else exp_avg_sq's (Adagrad keeps only
    // the sum); Adafactor's and SM3's statistics are fp32 whatever the
    // first moment is.
    const bool factored = CpuOptimizerIsFactored(o.algo);
    t.moment_dtype = m1                ? m1->dtype
                     : m2 && !factored ? m2->dtype
                                       : CpuDType::kFloat32;
    if (m1 && m2 && !factored && m1->dtype != m2->dtype) {
      throw py::type_error("exp_avg is " + std::string(DTypeName(m1->dtype)) +
                           " and exp_avg_sq is " +
                           std::string(DTypeName(m2->dtype)) +
                           "; the two moments share one dtype");
    }
    if (factored && m2 && m2->dtype != CpuDType::kFloat32) {
      throw py::type_error("exp_avg_sq holds " +
                           std::string(CpuOptimizerAlgoName(o.algo)) +
                           "'s statistics, which are float32");
    }
    t.exp_avg = m1 ? m1->data : nullptr;
    t.exp_avg_sq = m2 ? m2->data : nullptr;
    t.rows = rows;
    t.cols = cols;
    if (w) {
      t.working = w->data;
      t.working_dtype = w->dtype;
    }

    CpuStepShape shape;
    shape.n = n;
    shape.rows = rows;
    shape.cols = cols;
    shape.grad_dtype = t.grad_dtype;
    shape.moment_dtype = t.moment_dtype;
    shape.has_working = w != nullptr;
    shape.working_dtype = t.working_dtype;
    const CpuStepFootprint fp = ValueOrThrow(CpuStepFootprintOf(o, shape));
    const std::string_view algo = CpuOptimizerAlgoName(o.algo);
    CheckBytes(m1.get(), "exp_avg", fp.exp_avg_bytes, algo);
    CheckBytes(m2.get(), "exp_avg_sq", fp.exp_avg_sq_bytes, algo);

    CpuStepArgs a;
    a.step = step;
    a.lr = lr;
    a.inv_loss_scale = inv_loss_scale;
    a.clip_coef = clip_coef;
    a.check_overflow = check_overflow;
    a.param_sq = param_sq;

    Busy busy(this, "step");
    StatusOr<CpuStepResult> r = [&] {
      py::gil_scoped_release nogil;
      return opt_->Step(t, a);
    }();
    const CpuStepResult result = ValueOrThrow(std::move(r));
    last_param_sq_ = result.param_sq;
    return result.applied;
  }

  double last_param_sq() const { return last_param_sq_; }

  // The learning rate of the config section it was made from
  // (PyCpuOptimizerFromConfig); None when made by the constructor.
  py::object config_lr() const {
    return config_lr_ ? py::object(py::float_(*config_lr_)) : py::none();
  }
  void set_config_lr(double lr) { config_lr_ = lr; }

  py::tuple GradStats(py::handle grad, double scale) {
    CpuOptimizer& opt = Open("grad_stats");
    const Borrowed g =
        Borrow(grad, "grad", kAcceptF32 | kAcceptF16 | kAcceptBF16);
    Busy busy(this, "grad_stats");
    StatusOr<strata::GradStats> r = [&] {
      py::gil_scoped_release nogil;
      return opt.ComputeGradStats(g.data, g.dtype, g.numel, scale);
    }();
    const strata::GradStats s = ValueOrThrow(std::move(r));
    return py::make_tuple(s.sum_sq, s.finite);
  }

  void Close() {
    if (!opt_) return;
    Busy busy(this, "close");
    opt_.reset();
  }

  bool closed() const { return opt_ == nullptr; }
  const CpuOptimizer& get(const char* what) { return Open(what); }

 private:
  // Marks the object in use for one call; refuses a second at once.
  class Busy {
   public:
    Busy(PyCpuOptimizer* self, const char* what) : self_(self) {
      if (self_->busy_.exchange(true)) {
        ThrowStatus(Status::FailedPrecondition(
            std::string("strata.CpuOptimizer.") + what +
            "() called while another thread is inside a call on the same "
            "optimizer; use one optimizer per thread"));
      }
    }
    ~Busy() { self_->busy_.store(false); }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    PyCpuOptimizer* self_;
  };

  CpuOptimizer& Open(const char* what) {
    if (!opt_) {
      ThrowStatus(Status::FailedPrecondition(
          std::string("strata.CpuOptimizer.") + what +
          "() on a closed optimizer (close() was called)"));
    }
    return *opt_;
  }

  std::unique_ptr<CpuOptimizer> opt_;
  std::atomic<bool> busy_{false};
  double last_param_sq_ = -1.0;  // CpuStepResult::param_sq of the last step
  std::optional<double> config_lr_;
};

// The options both constructors take apart from the algorithm's: threads,
// kernel variant, tile size, the 8-bit update's sweeps.
CpuOptimizerOptions RunOptions(int threads, const std::string& variant,
                               size_t tile_elems, int block8_sweeps) {
  CpuOptimizerOptions o;
  o.threads = threads;
  o.variant = ValueOrThrow(ParseCpuKernelVariant(variant));
  o.tile_elems = tile_elems;
  o.block8_sweeps = block8_sweeps;
  return o;
}

std::unique_ptr<PyCpuOptimizer> NewPyCpuOptimizer(
    const std::string& algo, std::pair<double, double> betas, double eps,
    double weight_decay, bool bias_correction, int threads,
    const std::string& variant, size_t tile_elems, int block8_sweeps) {
  CpuOptimizerOptions o =
      RunOptions(threads, variant, tile_elems, block8_sweeps);
  o.algo = ValueOrThrow(ParseCpuOptimizerAlgo(algo));
  o.beta1 = betas.first;
  o.beta2 = betas.second;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.bias_correction = bias_correction;
  return std::make_unique<PyCpuOptimizer>(o);
}

// An optimizer from a DeepSpeed-style optimizer section: a dict (made JSON
// by Python's json module) or JSON text, read by ParseCpuOptimizerConfig,
// the one parser of it.
std::unique_ptr<PyCpuOptimizer> PyCpuOptimizerFromConfig(
    py::handle section, int threads, const std::string& variant,
    size_t tile_elems, int block8_sweeps) {
  const std::string json = py::isinstance<py::str>(section)
                               ? section.cast<std::string>()
                               : py::module_::import("json")
                                     .attr("dumps")(section)
                                     .cast<std::string>();
  const CpuOptimizerConfig c = ValueOrThrow(ParseCpuOptimizerConfig(
      json, "optimizer",
      RunOptions(threads, variant, tile_elems, block8_sweeps)));
  auto opt = std::make_unique<PyCpuOptimizer>(c.options);
  opt->set_config_lr(c.lr);
  return opt;
}

// Adafactor's options with HF transformers' names (beta1 None: no first
// moment).
py::dict AdafactorDict(const CpuAdafactorOptions& a) {
  py::dict d;
  d["eps"] = py::make_tuple(a.eps1, a.eps2);
  d["clip_threshold"] = a.clip_threshold;
  d["decay_rate"] = a.decay_rate;
  d["beta1"] = a.beta1 > 0 ? py::object(py::float_(a.beta1)) : py::none();
  d["relative_step"] = a.relative_step;
  d["scale_parameter"] = a.scale_parameter;
  d["warmup_init"] = a.warmup_init;
  return d;
}

PyObject* NewException(const char* name, const char* doc, PyObject* bases) {
  PyObject* type = PyErr_NewExceptionWithDoc(name, doc, bases, nullptr);
  if (type == nullptr) throw py::error_already_set();
  return type;
}

}  // namespace

PYBIND11_MODULE(_strata, m) {
  m.doc() =
      "strata's native module: the CPU optimizer on DLPack arrays and the "
      "engine";
  m.attr("__version__") = STRATA_VERSION_STRING;
  m.def(
      "version", [] { return std::string(strata_version()); },
      "The version of the libstrata actually loaded.");

  g_error = NewException(
      "strata.Error",
      "A strata call failed; str() is strata's message, .code its status "
      "code name (e.g. 'FailedPrecondition').",
      PyExc_RuntimeError);
  m.attr("Error") = py::handle(g_error);
  py::tuple bases =
      py::make_tuple(py::handle(g_error), py::handle(PyExc_ValueError));
  g_invalid_argument =
      NewException("strata.InvalidArgumentError",
                   "strata refused an argument (status InvalidArgument or "
                   "OutOfRange); also a ValueError.",
                   bases.ptr());
  m.attr("InvalidArgumentError") = py::handle(g_invalid_argument);

  BindEngine(m);

  m.def(
      "state_bytes",
      [](const std::string& dtype, size_t n) {
        return CpuStateBytes(ParseDType(dtype), n);
      },
      py::arg("dtype"), py::arg("n"),
      "Bytes of one optimizer-state array of n elements of dtype "
      "('float32', 'bfloat16', 'block8').");
  m.def(
      "best_variant",
      [] { return std::string(CpuKernelVariantName(BestCpuKernelVariant())); },
      "The fastest kernel variant this CPU supports.");

  py::class_<PyCpuOptimizer>(m, "CpuOptimizer", R"doc(
strata's fused CPU optimizer over caller memory (include/strata/cpu_adam.h).

CpuOptimizer(algo='adamw', betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             bias_correction=True, threads=0, variant='auto',
             tile_elems=65536, block8_sweeps=0)

algo: adam, adamw, adagrad, lion, adafactor (HF defaults), sm3 (momentum =
betas[0]). threads: the optimizer's worker threads, 0 = all cores.
block8_sweeps: with block8 state, the update's sweeps over each block, 1 or
2 (the same results either way), 0 = the variant's own.
Hyper-parameters out of range raise strata.InvalidArgumentError. Calls must not
overlap on one object (a second concurrent call raises strata.Error); close()
frees the threads. CpuOptimizer.from_config takes any algorithm's parameters,
Adafactor's included.
)doc")
      .def(py::init(&NewPyCpuOptimizer), py::arg("algo") = "adamw",
           py::arg("betas") = std::pair<double, double>(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0,
           py::arg("bias_correction") = true, py::arg("threads") = 0,
           py::arg("variant") = "auto", py::arg("tile_elems") = 65536,
           py::arg("block8_sweeps") = 0)
      .def_static("from_config", &PyCpuOptimizerFromConfig, py::arg("section"),
                  py::kw_only(), py::arg("threads") = 0,
                  py::arg("variant") = "auto", py::arg("tile_elems") = 65536,
                  py::arg("block8_sweeps") = 0,
                  R"doc(
An optimizer from an optimizer section as DeepSpeed writes it, a dict or JSON
text: {"type": "Adafactor", "params": {"lr": 1e-3, "beta1": 0.9, ...}}. type:
adam (AdamW unless params.adam_w_mode is false), adamw, adagrad, lion,
adafactor or sm3, any case; params as each type takes them (Adafactor: HF
transformers' names, eps = [eps1, eps2]; SM3: momentum). The section's
learning rate is the optimizer's lr. strata.InvalidArgumentError names the
JSON path at fault (optimizer.params.betas[1]).
)doc")
      .def("step", &PyCpuOptimizer::Step, py::arg("master"), py::arg("grad"),
           py::arg("exp_avg") = py::none(), py::arg("exp_avg_sq") = py::none(),
           py::kw_only(), py::arg("step"), py::arg("lr"),
           py::arg("working") = py::none(), py::arg("rows") = 0,
           py::arg("cols") = 0, py::arg("inv_loss_scale") = 1.0,
           py::arg("clip_coef") = 1.0, py::arg("check_overflow") = true,
           py::arg("param_sq") = -1.0,
           R"doc(
One fused update, in place. master: float32; grad: float32, float16 or
bfloat16; exp_avg / exp_avg_sq: float32 or bfloat16 (uint8 for block8 state,
strata.state_bytes bytes), zero before step 1, None where the algorithm has no
use for them; working: optional float16/bfloat16 array that receives the
updated weights in the same pass. All C-contiguous host arrays of master's
element count, not overlapping. step: the 1-based step number. Returns False,
having written nothing, when check_overflow found an inf or nan in the
scaled gradient. param_sq (adafactor with scale_parameter): the sum of the
squares of master as the last step left it (last_param_sq), which spares the
step a read of master; pass it only while nothing else has written master.
Negative: not known.
)doc")
      .def("grad_stats", &PyCpuOptimizer::GradStats, py::arg("grad"),
           py::arg("scale") = 1.0,
           "(sum of squares of grad * scale, all finite) in one read-only "
           "pass.")
      .def("close", &PyCpuOptimizer::Close,
           "Frees the optimizer's threads; later calls raise strata.Error.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyCpuOptimizer& self, py::args) {
             self.Close();
             return false;
           })
      .def_property_readonly("closed", &PyCpuOptimizer::closed)
      .def_property_readonly(
          "last_param_sq", &PyCpuOptimizer::last_param_sq,
          "the sum of the squares of master after the last step (for the next "
          "step's param_sq) when it was an applied adafactor step with "
          "scale_parameter; -1.0 otherwise")
      .def_property_readonly("algo",
                             [](PyCpuOptimizer& self) {
                               return std::string(CpuOptimizerAlgoName(
                                   self.get("algo").options().algo));
                             })
      .def_property_readonly("variant",
                             [](PyCpuOptimizer& self) {
                               return std::string(CpuKernelVariantName(
                                   self.get("variant").variant()));
                             })
      .def_property_readonly(
          "threads",
          [](PyCpuOptimizer& self) { return self.get("threads").threads(); })
      .def_property_readonly(
          "block8_sweeps",
          [](PyCpuOptimizer& self) {
            return self.get("block8_sweeps").options().block8_sweeps;
          },
          "the block8 update's sweeps over each block this optimizer runs "
          "(1 or 2; the variant's own unless the constructor chose)")
      .def_property_readonly("betas",
                             [](PyCpuOptimizer& self) {
                               const auto& o = self.get("betas").options();
                               return std::make_pair(o.beta1, o.beta2);
                             })
      .def_property_readonly(
          "eps",
          [](PyCpuOptimizer& self) { return self.get("eps").options().eps; })
      .def_property_readonly(
          "weight_decay",
          [](PyCpuOptimizer& self) {
            return self.get("weight_decay").options().weight_decay;
          })
      .def_property_readonly("lr", &PyCpuOptimizer::config_lr,
                             "the learning rate of the section from_config "
                             "read; None when made by the constructor")
      .def_property_readonly(
          "adafactor",
          [](PyCpuOptimizer& self) {
            return AdafactorDict(self.get("adafactor").options().adafactor);
          },
          "Adafactor's options, with HF transformers' names");
}

}  // namespace strata::python
