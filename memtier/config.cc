// The engine's options: validation, and the JSON reader for strata's own
// keys and DeepSpeed configs (docs/config.md).
//
// Note [One list of known keys]: a section's known keys are exactly the keys
// its reader asks for (ObjReader::Take), so a key cannot be handled without
// being known, nor known without being handled. Whatever is left in the
// object when the reader goes out of scope is an unknown key.
//
// Note [Ranges in one place]: the reader checks types and what only the JSON
// can say (a required key, two spellings that disagree, the type's own
// bounds); every range of a field is checked by the validator, which names
// the JSON path that set the field (Origins) when there is one.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpu_adam/kernels.h"
#include "strata/cpu_adam.h"
#include "strata/engine_config.h"
#include "strata/engine_options.h"

namespace strata {

namespace {

using Json = nlohmann::json;

constexpr uint64_t kAlign = 4096;
constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMaxBytes = uint64_t{1} << 50;        // 1 PiB
constexpr uint64_t kMaxBufferBytes = uint64_t{1} << 40;  // 1 TiB
constexpr uint64_t kMaxIoBlockBytes = uint64_t{1} << 30;
constexpr size_t kMaxErrors = 20;

// "1 GiB" for exact multiples of a binary unit, else the number.
std::string SizeText(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"PiB", "TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 5; ++i) {
    const uint64_t unit = kKiB << (10 * (4 - i));
    if (bytes >= unit && bytes % unit == 0) {
      return std::to_string(bytes / unit) + " " + kUnits[i];
    }
  }
  return std::to_string(bytes);
}

std::string RealText(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// ---- Validation
// --------------------------------------------------------------

// EngineOptions field ("io.queue_depth") -> JSON path that set it.
using Origins = std::map<std::string, std::string, std::less<>>;

std::string_view Leaf(std::string_view path) {
  const size_t dot = path.find_last_of('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

class Checker {
 public:
  explicit Checker(const Origins* origins) : origins_(origins) {}

  // The field as the user named it: its JSON path when a config set it
  // (with the field in parentheses where the names differ), else the field.
  std::string Name(std::string_view field) const {
    if (origins_ != nullptr) {
      const std::string_view base = field.substr(0, field.find('['));
      auto it = origins_->find(base);
      if (it != origins_->end()) {
        if (Leaf(it->second) == Leaf(field)) return it->second;
        return it->second + " (" + std::string(field) + ")";
      }
    }
    return std::string(field);
  }

  void Fail(std::string_view field, std::string_view what) {
    errors_.push_back(Name(field) + ": " + std::string(what));
  }

  // lo <= v <= hi and a multiple of align, or 0 where zero_is_auto.
  void Size(std::string_view field, uint64_t v, uint64_t lo, uint64_t hi,
            uint64_t align, bool zero_is_auto) {
    if (zero_is_auto && v == 0) return;
    if (v >= lo && v <= hi && v % align == 0) return;
    std::string accepted = zero_is_auto ? "0 (automatic) or " : "";
    accepted += SizeText(lo) + " .. " + SizeText(hi);
    if (align > 1) accepted += " in multiples of " + std::to_string(align);
    const bool unaligned = v >= lo && v <= hi;
    Fail(field,
         std::to_string(v) +
             (unaligned ? " bytes is not a multiple of " + std::to_string(align)
                        : " bytes is out of range") +
             "; accepted: " + accepted);
  }

  void Count(std::string_view field, int64_t v, int64_t lo, int64_t hi,
             bool zero_is_auto = false) {
    if ((zero_is_auto && v == 0) || (v >= lo && v <= hi)) return;
    Fail(field, std::to_string(v) + " is out of range; accepted: " +
                    (zero_is_auto ? "0 (automatic) or " : "") +
                    std::to_string(lo) + " .. " + std::to_string(hi));
  }

  // Finite, lo <= v (lo < v where !lo_closed) and v < hi (v <= hi where
  // hi_closed).
  void Real(std::string_view field, double v, double lo, bool lo_closed,
            double hi, bool hi_closed) {
    const bool ok = std::isfinite(v) && (lo_closed ? v >= lo : v > lo) &&
                    (hi_closed ? v <= hi : v < hi);
    if (ok) return;
    std::string accepted = std::string(lo_closed ? "[" : "(") + RealText(lo) +
                           ", " + (std::isinf(hi) ? "inf" : RealText(hi)) +
                           (hi_closed ? "]" : ")");
    Fail(field, RealText(v) + " is out of range; accepted: " + accepted);
  }

  const std::vector<std::string>& errors() const { return errors_; }

 private:
  const Origins* origins_;
  std::vector<std::string> errors_;
};

std::string Join(const std::vector<std::string>& lines, size_t limit) {
  std::string out;
  for (size_t i = 0; i < lines.size() && i < limit; ++i) {
    if (i > 0) out += "; ";
    out += lines[i];
  }
  if (lines.size() > limit) {
    out += "; and " + std::to_string(lines.size() - limit) + " more";
  }
  return out;
}

void CheckResidences(const EngineOptions& o, Checker& c) {
  if (static_cast<int>(o.comm_memory) > static_cast<int>(CommMemory::kDevice)) {
    c.Fail("comm_memory", "not a choice; accepted: auto, host, device");
  }
  if (o.zero_stage < 0 || o.zero_stage > 3) {
    c.Count("zero_stage", o.zero_stage, 0, 3);
  } else if (o.zero_stage < 3 && o.params != Residence::kDevice) {
    c.Fail("params", "resting on " + std::string(ResidenceName(o.params)) +
                         " needs zero_stage 3 (zero_stage is " +
                         std::to_string(o.zero_stage) +
                         "); accepted with stages 0 .. 2: device");
  }
  if (o.optimizer_states == Residence::kDevice) {
    c.Fail("optimizer_states",
           "device is not supported (the optimizer runs on the CPU); "
           "accepted: host, nvme");
  }
  if (o.grads == Residence::kDevice) {
    c.Fail("grads",
           "device is not supported (gradients are accumulated on the "
           "host); accepted: host, nvme");
  }
  std::string on_nvme;
  const std::pair<const char*, Residence> roles[] = {
      {"params", o.params},
      {"optimizer_states", o.optimizer_states},
      {"grads", o.grads}};
  for (const auto& [role, residence] : roles) {
    if (residence != Residence::kNvme) continue;
    on_nvme += on_nvme.empty() ? role : std::string(", ") + role;
  }
  if (!on_nvme.empty() && o.nvme_paths.empty()) {
    c.Fail("nvme_paths", "empty, but " + on_nvme +
                             " rest on nvme; give at least one directory");
  }
  std::set<std::string_view> seen;
  for (size_t i = 0; i < o.nvme_paths.size(); ++i) {
    const std::string field = "nvme_paths[" + std::to_string(i) + "]";
    if (o.nvme_paths[i].empty()) c.Fail(field, "an empty path");
    if (!seen.insert(o.nvme_paths[i]).second) {
      c.Fail(field, "\"" + o.nvme_paths[i] + "\" is given twice");
    }
  }
}

void CheckSizes(const EngineOptions& o, Checker& c) {
  c.Size("device_budget_bytes", o.device_budget_bytes, 1, kMaxBytes, 1, true);
  c.Size("host_budget_bytes", o.host_budget_bytes, 1, kMaxBytes, 1, true);
  c.Size("partition_bytes", o.partition_bytes, kAlign, kMaxBufferBytes, kAlign,
         false);
  if (o.device_budget_bytes != 0 && o.device_budget_bytes >= 1 &&
      o.partition_bytes <= kMaxBufferBytes &&
      o.device_budget_bytes < o.partition_bytes) {
    c.Fail("device_budget_bytes",
           std::to_string(o.device_budget_bytes) +
               " bytes cannot hold one partition (partition_bytes " +
               std::to_string(o.partition_bytes) +
               "); accepted: 0 (automatic) or at least partition_bytes");
  }
  c.Count("staging_buffer_count", o.staging_buffer_count, 1, 4096, true);
  c.Size("staging_buffer_bytes", o.staging_buffer_bytes, kAlign,
         kMaxBufferBytes, kAlign, true);
  c.Size("prefetch_bytes", o.prefetch_bytes, 0, kMaxBytes, 1, false);
  c.Size("max_live_bytes", o.max_live_bytes, 1, kMaxBytes, 1, false);
  c.Size("persistence_threshold_bytes", o.persistence_threshold_bytes, 0,
         kMaxBytes, 1, false);
  // max_persistent_bytes: every value is meaningful (kUnlimited: no limit).
  c.Size("max_reuse_distance_bytes", o.max_reuse_distance_bytes, 0, kMaxBytes,
         1, false);
  c.Size("sub_group_bytes", o.sub_group_bytes, 1, kMaxBytes, 1, false);
  c.Size("step_overlap_bytes", o.step_overlap_bytes, 0, kMaxBytes, 1, false);
  c.Size("reduce_bucket_bytes", o.reduce_bucket_bytes, 0, kMaxBytes, 1, false);
  c.Size("allgather_bucket_bytes", o.allgather_bucket_bytes, 0, kMaxBytes, 1,
         false);
  c.Count("io.queue_depth", o.io.queue_depth, 1, 32768);
  c.Count("io.threads", o.io.threads, 0, 4096);
  c.Count("io.max_retries", o.io.max_retries, 0, 1000);
  c.Size("io_block_bytes", o.io_block_bytes, kAlign, kMaxIoBlockBytes, kAlign,
         false);
}

// Whether a narrow moment format holds what `algo` keeps per element: both
// moments of Adam, AdamW and Lion (bf16, int8), Adafactor's and SM3's first
// moment (bf16).
bool MomentFormatFits(CpuDType format, CpuOptimizerAlgo algo) {
  switch (algo) {
    case CpuOptimizerAlgo::kAdam:
    case CpuOptimizerAlgo::kAdamW:
    case CpuOptimizerAlgo::kLion:
      return true;
    case CpuOptimizerAlgo::kAdafactor:
    case CpuOptimizerAlgo::kSm3:
      return format == CpuDType::kBFloat16;
    case CpuOptimizerAlgo::kAdagrad:
      break;
  }
  return false;
}

void CheckTraining(const EngineOptions& o, Checker& c) {
  if (o.working_dtype != CpuDType::kFloat16 &&
      o.working_dtype != CpuDType::kBFloat16 &&
      o.working_dtype != CpuDType::kFloat32) {
    c.Fail("working_dtype", "not a dtype; accepted: fp16, bf16, fp32");
  }
  const LossScaleOptions& ls = o.loss_scale;
  if (ls.mode != LossScaleMode::kNone && ls.mode != LossScaleMode::kStatic &&
      ls.mode != LossScaleMode::kDynamic) {
    c.Fail("loss_scale.mode", "not a mode; accepted: none, static, dynamic");
  }
  if (ls.mode != LossScaleMode::kNone) {
    c.Real("loss_scale.initial_scale", ls.initial_scale, 0, false,
           std::ldexp(1.0, 64), true);
  }
  if (ls.mode == LossScaleMode::kDynamic) {
    c.Count("loss_scale.window", ls.window, 1, UINT32_MAX);
    c.Count("loss_scale.hysteresis", ls.hysteresis, 1, UINT32_MAX);
    c.Real("loss_scale.min_scale", ls.min_scale, 0, false, INFINITY, false);
    if (std::isfinite(ls.initial_scale) && ls.min_scale > ls.initial_scale) {
      c.Fail("loss_scale.min_scale", RealText(ls.min_scale) +
                                         " is above initial_scale (" +
                                         RealText(ls.initial_scale) +
                                         "); accepted: (0, initial_scale]");
    }
  }
  c.Real("gradient_clipping", o.gradient_clipping, 0, true, INFINITY, false);
  c.Count("gradient_accumulation_steps", o.gradient_accumulation_steps, 1,
          int64_t{1} << 20);
  const OptimizerOptions& opt = o.optimizer;
  c.Real("optimizer.lr", opt.lr, 0, true, INFINITY, false);
  c.Real("optimizer.cpu.beta1", opt.cpu.beta1, 0, true, 1, false);
  c.Real("optimizer.cpu.beta2", opt.cpu.beta2, 0, true, 1, false);
  c.Real("optimizer.cpu.eps", opt.cpu.eps, 0, true, INFINITY, false);
  c.Real("optimizer.cpu.weight_decay", opt.cpu.weight_decay, 0, true, INFINITY,
         false);
  c.Count("optimizer.cpu.threads", opt.cpu.threads, 0, 4096);
  c.Count("optimizer.cpu.block8_sweeps", opt.cpu.block8_sweeps, 1, 2,
          /*zero_is_auto=*/true);
  if (opt.moment_dtype != CpuDType::kFloat32 &&
      opt.moment_dtype != CpuDType::kBFloat16 &&
      opt.moment_dtype != CpuDType::kBlock8) {
    c.Fail("optimizer.moment_dtype",
           "fp16 is not a moment format; accepted: fp32, bf16, int8");
  } else if (opt.moment_dtype != CpuDType::kFloat32 &&
             !MomentFormatFits(opt.moment_dtype, opt.cpu.algo)) {
    c.Fail("optimizer.moment_dtype",
           std::string(MomentDTypeName(opt.moment_dtype)) + " with " +
               std::string(CpuOptimizerAlgoName(opt.cpu.algo)) +
               "; accepted: fp32 with any optimizer, bf16 with adam, adamw, "
               "lion, adafactor or sm3 (their first moment), int8 with adam, "
               "adamw or lion");
  }
  c.Count("optimizer.cpu.tile_elems",
          static_cast<int64_t>(std::min<size_t>(opt.cpu.tile_elems, INT64_MAX)),
          1, int64_t{1} << 30);
}

Status Validate(const EngineOptions& o, const Origins* origins,
                std::string_view prefix) {
  Checker c(origins);
  if (o.world_size < 1 || o.world_size > 65536) {
    c.Count("world_size", o.world_size, 1, 65536);
  } else if (o.rank < 0 || o.rank >= o.world_size) {
    c.Fail("rank", std::to_string(o.rank) +
                       " is out of range; accepted: 0 .. world_size - 1 (" +
                       std::to_string(o.world_size - 1) + ")");
  }
  CheckResidences(o, c);
  CheckSizes(o, c);
  CheckTraining(o, c);
  if (c.errors().empty()) return Status::Ok();
  return Status::InvalidArgument(std::string(prefix) +
                                 Join(c.errors(), kMaxErrors));
}

// ---- Reading JSON
// ------------------------------------------------------------

// Errors and warnings of one parse, and where each field came from.
struct Ctx {
  std::vector<std::string> errors;
  std::vector<std::string> warnings;
  Origins origins;

  void Error(std::string_view path, std::string_view what) {
    errors.push_back(std::string(path) + ": " + std::string(what));
  }
  void Warn(std::string_view path, std::string_view what) {
    warnings.push_back(std::string(path) + ": " + std::string(what));
  }
  void SetOrigin(std::string_view field, std::string_view path) {
    origins[std::string(field)] = std::string(path);
  }
};

bool IsIdentifier(std::string_view key) {
  if (key.empty()) return false;
  return std::all_of(key.begin(), key.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
           (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
  });
}

// JSON text of a string, with invalid UTF-8 replaced (never throws).
std::string Quote(std::string_view s) {
  return Json(std::string(s))
      .dump(-1, ' ', false, Json::error_handler_t::replace);
}

// "a.b" for identifier-like keys, else a["odd key"].
std::string JoinPath(std::string_view parent, std::string_view key) {
  if (!IsIdentifier(key)) return std::string(parent) + "[" + Quote(key) + "]";
  if (parent.empty()) return std::string(key);
  return std::string(parent) + "." + std::string(key);
}

// What a value is, for "expected X, got Y".
std::string Describe(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return std::string("boolean ") + (v.get<bool>() ? "true" : "false");
    case Json::value_t::string: {
      std::string s = v.get<std::string>();
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return "string " + Quote(s);
    }
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "number " + v.dump();
  }
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  }
  return out;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + cost});
      diag = up;
    }
  }
  return row[b.size()];
}

// A value and its JSON path; value is null when the key is absent.
struct Field {
  const Json* value = nullptr;
  std::string path;
  explicit operator bool() const { return value != nullptr; }
};

// Reads one JSON object (Note [One list of known keys]). An absent section
// reads as empty; a section of another type is a type error.
class ObjReader {
 public:
  ObjReader(Ctx& ctx, const Field& field) : ctx_(ctx), path_(field.path) {
    if (!field) return;
    if (!field.value->is_object()) {
      ctx_.Error(PathText(),
                 "expected an object, got " + Describe(*field.value));
      return;
    }
    obj_ = field.value;
  }
  ~ObjReader() { ReportUnknownKeys(); }
  ObjReader(const ObjReader&) = delete;
  ObjReader& operator=(const ObjReader&) = delete;

  bool present() const { return obj_ != nullptr; }
  const std::string& path() const { return path_; }

  Field Take(std::string_view key) {
    known_.emplace_back(key);
    Field f{nullptr, JoinPath(path_, key)};
    if (obj_ == nullptr) return f;
    auto it = obj_->find(std::string(key));
    if (it != obj_->end()) f.value = &*it;
    return f;
  }

  // The one of several spellings that is present; two present with
  // different values are an error.
  Field TakeAny(std::initializer_list<std::string_view> keys) {
    Field found;
    std::string names;
    for (std::string_view key : keys) {
      names += names.empty() ? std::string(key) : ", " + std::string(key);
    }
    for (std::string_view key : keys) {
      Field f = Take(key);
      if (!f) continue;
      if (found && *found.value != *f.value) {
        ctx_.Error(f.path,
                   "disagrees with " + found.path + "; give one of " + names);
        continue;
      }
      if (!found) found = f;
    }
    if (!found) found.path = JoinPath(path_, *keys.begin());
    return found;
  }

 private:
  std::string PathText() const { return path_.empty() ? "(top level)" : path_; }

  void ReportUnknownKeys() {
    if (obj_ == nullptr) return;
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      const std::string& key = it.key();
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) {
        continue;
      }
      std::string what = "unknown key";
      std::string_view best;
      size_t best_d = SIZE_MAX;
      const std::string lower = Lower(key);
      for (const std::string& k : known_) {
        const size_t d = EditDistance(lower, k);
        if (d < best_d) {
          best_d = d;
          best = k;
        }
      }
      const size_t limit = std::max<size_t>(2, key.size() / 3);
      if (!best.empty() && best_d <= limit) {
        what += "; did you mean " + std::string(best) + "?";
      } else if (known_.size() <= 12) {
        std::string list;
        for (const std::string& k : known_) {
          list += list.empty() ? k : ", " + k;
        }
        what += "; known keys: " + list;
      }
      ctx_.Error(JoinPath(path_, key), what);
    }
  }

  Ctx& ctx_;
  std::string path_;
  const Json* obj_ = nullptr;
  std::vector<std::string> known_;
};

void TypeError(Ctx& ctx, const Field& f, std::string_view expected) {
  const Json& v = *f.value;
  if (v.is_string() && Lower(v.get<std::string>()) == "auto") {
    ctx.Error(f.path,
              "\"auto\" must be resolved by the caller before strata reads "
              "the config (Hugging Face's Trainer does so); expected " +
                  std::string(expected));
    return;
  }
  std::string what =
      "expected " + std::string(expected) + ", got " + Describe(v);
  if (expected == "a boolean" && v.is_string()) {
    what += " (strings are read as booleans only in the aio section)";
  }
  ctx.Error(f.path, what);
}

std::optional<uint64_t> ReadU64(Ctx& ctx, const Field& f) {
  if (!f) return std::nullopt;
  const Json& v = *f.value;
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    ctx.Error(f.path, "must not be negative, got " + v.dump());
    return std::nullopt;
  }
  if (v.is_number_float()) {
    // 1e9 is integral and arrives as a float (DeepSpeed's pp_int accepts it).
    const double d = v.get<double>();
    if (!std::isfinite(d) || d >= 18446744073709551616.0) {
      ctx.Error(f.path, v.dump() + " is too large; accepted: at most " +
                            std::to_string(UINT64_MAX));
    } else if (d < 0) {
      ctx.Error(f.path, "must not be negative, got " + v.dump());
    } else if (d != std::floor(d)) {
      ctx.Error(f.path, "expected an integer, got " + v.dump());
    } else {
      return static_cast<uint64_t>(d);
    }
    return std::nullopt;
  }
  TypeError(ctx, f, "a non-negative integer");
  return std::nullopt;
}

// ReadU64 within the bounds of the destination type (ranges proper are the
// validator's).
std::optional<uint64_t> ReadBounded(Ctx& ctx, const Field& f, uint64_t max) {
  std::optional<uint64_t> v = ReadU64(ctx, f);
  if (v && *v > max) {
    ctx.Error(f.path, std::to_string(*v) +
                          " is out of range; accepted: at most " +
                          std::to_string(max));
    return std::nullopt;
  }
  return v;
}

std::optional<double> ReadDouble(Ctx& ctx, const Field& f) {
  if (!f) return std::nullopt;
  if (!f.value->is_number()) {
    TypeError(ctx, f, "a number");
    return std::nullopt;
  }
  const double d = f.value->get<double>();
  if (!std::isfinite(d)) {
    ctx.Error(f.path, f.value->dump() + " is not a finite number");
    return std::nullopt;
  }
  return d;
}

// `strings`: also "true"/"false" (any case), with a warning.
std::optional<bool> ReadBool(Ctx& ctx, const Field& f, bool strings = false) {
  if (!f) return std::nullopt;
  const Json& v = *f.value;
  if (v.is_boolean()) return v.get<bool>();
  if (strings && v.is_string()) {
    const std::string s = Lower(v.get<std::string>());
    if (s == "true" || s == "false") {
      ctx.Warn(f.path,
               "the string " + v.dump() + " is read as the boolean " + s);
      return s == "true";
    }
  }
  TypeError(ctx, f, "a boolean");
  return std::nullopt;
}

std::optional<std::string> ReadString(Ctx& ctx, const Field& f) {
  if (!f) return std::nullopt;
  if (!f.value->is_string()) {
    TypeError(ctx, f, "a string");
    return std::nullopt;
  }
  return f.value->get<std::string>();
}

// The index of the value among `names` (exact match, or ignoring case).
std::optional<size_t> ReadChoice(Ctx& ctx, const Field& f,
                                 std::span<const std::string_view> names,
                                 bool any_case = false) {
  std::string list;
  for (std::string_view n : names) {
    list += list.empty() ? std::string(n) : ", " + std::string(n);
  }
  if (f && !f.value->is_string()) {
    TypeError(ctx, f, "one of " + list);
    return std::nullopt;
  }
  std::optional<std::string> s = ReadString(ctx, f);
  if (!s) return std::nullopt;
  const std::string key = any_case ? Lower(*s) : *s;
  size_t i = 0;
  for (std::string_view n : names) {
    if (key == (any_case ? Lower(n) : std::string(n))) return i;
    ++i;
  }
  TypeError(ctx, f, "one of " + list);
  return std::nullopt;
}

// A reader of the value among `names` as the matching one of `values`.
template <typename T, size_t N>
auto ReadEnum(const std::string_view (&names)[N], const T (&values)[N]) {
  return [&names, &values](Ctx& ctx, const Field& f) -> std::optional<T> {
    std::optional<size_t> i = ReadChoice(ctx, f, names);
    if (!i) return std::nullopt;
    return values[*i];
  };
}

constexpr std::string_view kResidenceNames[] = {"device", "host", "nvme"};
constexpr std::string_view kDeviceNames[] = {"none", "cpu", "nvme"};
constexpr std::string_view kCommMemoryNames[] = {"auto", "host", "device"};
constexpr CommMemory kCommMemories[] = {CommMemory::kAuto, CommMemory::kHost,
                                        CommMemory::kDevice};
constexpr Residence kResidences[] = {Residence::kDevice, Residence::kHost,
                                     Residence::kNvme};
constexpr std::string_view kAlgoNames[] = {"adam", "adamw",     "adagrad",
                                           "lion", "adafactor", "sm3"};
constexpr CpuOptimizerAlgo kAlgos[] = {
    CpuOptimizerAlgo::kAdam,      CpuOptimizerAlgo::kAdamW,
    CpuOptimizerAlgo::kAdagrad,   CpuOptimizerAlgo::kLion,
    CpuOptimizerAlgo::kAdafactor, CpuOptimizerAlgo::kSm3};
// DeepSpeed's type names (any case); its "Adam" is AdamW by default.
constexpr std::string_view kDsAlgoNames[] = {"Adam", "AdamW",     "Adagrad",
                                             "Lion", "Adafactor", "SM3"};
constexpr std::string_view kModeNames[] = {"none", "static", "dynamic"};
constexpr LossScaleMode kModes[] = {
    LossScaleMode::kNone, LossScaleMode::kStatic, LossScaleMode::kDynamic};
// The moment formats, in CpuDType order (fp16 is not one).
constexpr std::string_view kMomentNames[] = {"fp32", "fp16", "bf16", "int8"};
constexpr std::string_view kDtypeNames[] = {"fp16", "bf16", "fp32"};
constexpr CpuDType kDtypes[] = {CpuDType::kFloat16, CpuDType::kBFloat16,
                                CpuDType::kFloat32};

// A string or an array of strings (nvme paths); null reads as absent.
std::optional<std::vector<std::string>> ReadPaths(Ctx& ctx, const Field& f) {
  if (!f || f.value->is_null()) return std::nullopt;
  if (f.value->is_string()) {
    return std::vector<std::string>{f.value->get<std::string>()};
  }
  if (!f.value->is_array()) {
    TypeError(ctx, f, "a path or an array of paths");
    return std::nullopt;
  }
  std::vector<std::string> paths;
  bool ok = true;
  for (size_t i = 0; i < f.value->size(); ++i) {
    Field item{&(*f.value)[i], f.path + "[" + std::to_string(i) + "]"};
    std::optional<std::string> s = ReadString(ctx, item);
    if (!s) {
      ok = false;
    } else if (s->empty()) {
      ctx.Error(item.path, "an empty path");
      ok = false;
    } else {
      paths.push_back(*s);
    }
  }
  if (ok && paths.empty()) {
    ctx.Error(f.path, "an empty array; give at least one path");
    ok = false;
  }
  if (!ok) return std::nullopt;
  return paths;
}

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t RoundUpAligned(uint64_t bytes) {
  if (bytes > UINT64_MAX - (kAlign - 1)) return UINT64_MAX;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// A key strata knows and does not act on: reported, unless its value is
// `harmless` (what strata does anyway).
void Unsupported(Ctx& ctx, const Field& f, std::string_view why,
                 const Json& harmless = Json()) {
  if (!f) return;
  if (!harmless.is_null() && *f.value == harmless) return;
  ctx.Warn(f.path, "accepted, not supported yet: " + std::string(why));
}

void AddPaths(EngineOptions* o, const std::vector<std::string>& paths) {
  for (const std::string& p : paths) {
    if (std::find(o->nvme_paths.begin(), o->nvme_paths.end(), p) ==
        o->nvme_paths.end()) {
      o->nvme_paths.push_back(p);
    }
  }
}

// Everything read from the document that decides more than one field.
struct DocState {
  bool deepspeed = false;  // a key other than `strata` at the top level
  uint64_t elem_bytes = 2;
  int stage = 0;
  std::optional<bool> pin_param, pin_optimizer;
  std::optional<uint64_t> train_batch, micro_batch, ds_accumulation;
  Field train_batch_field, micro_batch_field, accumulation_field;
  bool strata_accumulation = false;
  bool strata_sets_optimizer_states = false;
  bool strata_sets_pin = false;
};

// ---- fp16 / bf16 ----

void ReadPrecision(Ctx& ctx, ObjReader& top, DocState& st, EngineOptions* o) {
  bool fp16_on = false;
  bool bf16_on = false;
  Field fp16_enabled;
  LossScaleOptions ls;
  {
    ObjReader fp16(ctx, top.Take("fp16"));
    fp16_enabled = fp16.Take("enabled");
    fp16_on = ReadBool(ctx, fp16_enabled).value_or(false);
    Unsupported(ctx, fp16.Take("auto_cast"),
                "autocasting is the trainer's (strata receives its tensors)",
                false);
    Field master = fp16.Take("fp16_master_weights_and_grads");
    if (ReadBool(ctx, master).value_or(false)) {
      ctx.Error(master.path,
                "true is not supported: strata keeps fp32 master weights "
                "and gradients; accepted: false");
    }
    std::optional<double> static_scale;
    Field scale = fp16.Take("loss_scale");
    if (std::optional<double> v = ReadDouble(ctx, scale)) {
      if (*v < 0) {
        ctx.Error(scale.path, RealText(*v) +
                                  " is out of range; accepted: 0 (dynamic) "
                                  "or a positive static scale");
      } else if (*v > 0) {
        static_scale = *v;
      }
    }
    Field power = fp16.Take("initial_scale_power");
    std::optional<uint64_t> p = ReadBounded(ctx, power, 1000);
    Field window = fp16.Take("loss_scale_window");
    std::optional<uint64_t> w = ReadBounded(ctx, window, UINT32_MAX);
    Field hysteresis = fp16.Take("hysteresis");
    std::optional<uint64_t> h = ReadBounded(ctx, hysteresis, UINT32_MAX);
    Field consecutive = fp16.Take("consecutive_hysteresis");
    std::optional<bool> ch = ReadBool(ctx, consecutive);
    Field min_scale = fp16.Take("min_loss_scale");
    std::optional<double> m = ReadDouble(ctx, min_scale);
    if (fp16_on) {
      if (static_scale) {
        ls.mode = LossScaleMode::kStatic;
        ls.initial_scale = *static_scale;
        ctx.SetOrigin("loss_scale.initial_scale", scale.path);
      } else {
        ls.mode = LossScaleMode::kDynamic;
        if (p) {
          ls.initial_scale = std::ldexp(1.0, static_cast<int>(*p));
          ctx.SetOrigin("loss_scale.initial_scale", power.path);
        }
      }
      ctx.SetOrigin("loss_scale.mode", fp16_enabled.path);
      if (w) ls.window = static_cast<uint32_t>(*w);
      if (h) ls.hysteresis = static_cast<uint32_t>(*h);
      if (ch) ls.consecutive_hysteresis = *ch;
      if (m) ls.min_scale = *m;
      ctx.SetOrigin("loss_scale.window", window.path);
      ctx.SetOrigin("loss_scale.hysteresis", hysteresis.path);
      ctx.SetOrigin("loss_scale.min_scale", min_scale.path);
    }
  }
  Field bf16_enabled;
  {
    // "bfloat16" is DeepSpeed's older name of the section.
    ObjReader bf16(ctx, top.TakeAny({"bf16", "bfloat16"}));
    bf16_enabled = bf16.Take("enabled");
    bf16_on = ReadBool(ctx, bf16_enabled).value_or(false);
    Unsupported(ctx, bf16.Take("immediate_grad_update"),
                "gradients are always accumulated in fp32 on the host");
  }
  if (fp16_on && bf16_on) {
    ctx.Error(bf16_enabled.path,
              "fp16 and bf16 are both enabled; enable at most one");
    return;
  }
  if (fp16_on) {
    o->working_dtype = CpuDType::kFloat16;
    o->loss_scale = ls;
    ctx.SetOrigin("working_dtype", fp16_enabled.path);
  } else if (bf16_on) {
    o->working_dtype = CpuDType::kBFloat16;
    ctx.SetOrigin("working_dtype", bf16_enabled.path);
  } else if (st.deepspeed) {
    // DeepSpeed trains in fp32 when neither is enabled.
    o->working_dtype = CpuDType::kFloat32;
  }
}

// strata.<key>, looked up quietly before the strata section is read (its
// reader reports problems); null when absent.
const Json* PeekStrata(const Json& root, const char* key) {
  auto s = root.find("strata");
  if (s == root.end() || !s->is_object()) return nullptr;
  auto v = s->find(key);
  return v == s->end() ? nullptr : &*v;
}

// The working dtype strata.working_dtype asks for: element counts are
// converted with the final dtype.
std::optional<CpuDType> PeekWorkingDtype(const Json& root) {
  const Json* d = PeekStrata(root, "working_dtype");
  if (d == nullptr || !d->is_string()) return std::nullopt;
  const std::string v = d->get<std::string>();
  if (v == "fp16") return CpuDType::kFloat16;
  if (v == "bf16") return CpuDType::kBFloat16;
  if (v == "fp32") return CpuDType::kFloat32;
  return std::nullopt;
}

// ---- zero_optimization ----

// Residence named by an offload section's `device`; nullopt when absent or
// invalid.
std::optional<Residence> ReadDevice(Ctx& ctx, const Field& f) {
  return ReadEnum(kDeviceNames, kResidences)(ctx, f);
}

// `device`, `nvme_path` and `pin_memory` of an offload section.
std::optional<Residence> ReadOffloadTier(Ctx& ctx, ObjReader& sec,
                                         EngineOptions* o,
                                         std::optional<bool>* pin,
                                         Field* device) {
  *device = sec.Take("device");
  std::optional<Residence> r = ReadDevice(ctx, *device);
  Field path = sec.Take("nvme_path");
  std::optional<std::vector<std::string>> paths = ReadPaths(ctx, path);
  if (r == Residence::kNvme) {
    if (!paths && (!path || path.value->is_null())) {
      ctx.Error(path.path, "required when device is \"nvme\"");
    }
    if (paths) {
      AddPaths(o, *paths);
      ctx.SetOrigin("nvme_paths", path.path);
    }
  } else if (paths) {
    ctx.Warn(path.path, "ignored: device is not \"nvme\"");
  }
  *pin = ReadBool(ctx, sec.Take("pin_memory"));
  return r;
}

void ReadOffloadParam(Ctx& ctx, const Field& f, DocState& st,
                      EngineOptions* o) {
  ObjReader sec(ctx, f);
  if (!sec.present()) return;
  Field device;
  if (std::optional<Residence> r =
          ReadOffloadTier(ctx, sec, o, &st.pin_param, &device)) {
    o->params = *r;
    ctx.SetOrigin("params", device.path);
  }
  Field count = sec.Take("buffer_count");
  if (std::optional<uint64_t> v = ReadBounded(ctx, count, UINT32_MAX)) {
    o->staging_buffer_count = static_cast<uint32_t>(*v);
    ctx.SetOrigin("staging_buffer_count", count.path);
  }
  // Elements of the working dtype, rounded up to whole 4 KiB pages.
  Field size = sec.Take("buffer_size");
  if (std::optional<uint64_t> v = ReadU64(ctx, size)) {
    o->staging_buffer_bytes = RoundUpAligned(SaturatingMul(*v, st.elem_bytes));
    ctx.SetOrigin("staging_buffer_bytes", size.path);
  }
  Unsupported(ctx, sec.Take("max_in_cpu"),
              "the host tier is bounded by strata.host_budget_bytes");
}

void ReadOffloadOptimizer(Ctx& ctx, const Field& f, DocState& st,
                          EngineOptions* o) {
  ObjReader sec(ctx, f);
  Field device{nullptr, JoinPath(sec.path(), "device")};
  std::optional<Residence> r;
  if (sec.present()) {
    r = ReadOffloadTier(ctx, sec, o, &st.pin_optimizer, &device);
    Unsupported(ctx, sec.Take("buffer_count"),
                "one staging pool (offload_param.buffer_count, "
                "strata.staging_buffer_count) carries every role");
    // strata always pipelines the step and creates state lazily.
    ReadBool(ctx, sec.Take("pipeline_read"));
    ReadBool(ctx, sec.Take("pipeline_write"));
    ReadBool(ctx, sec.Take("fast_init"));
    Field ratio = sec.Take("ratio");
    if (std::optional<double> v = ReadDouble(ctx, ratio)) {
      if (*v <= 0 || *v > 1) {
        ctx.Error(ratio.path,
                  RealText(*v) + " is out of range; accepted: (0, 1]");
      } else if (*v < 1) {
        ctx.Warn(ratio.path,
                 "accepted, not supported yet: partial offload; every "
                 "optimizer state is offloaded");
      }
    }
    Field super = sec.Take("super_offload");
    if (ReadBool(ctx, super).value_or(false)) {
      ctx.Warn(super.path, "accepted, not supported yet: SuperOffload");
    }
    Field perc = sec.Take("cpuadam_cores_perc");
    if (std::optional<double> v = ReadDouble(ctx, perc)) {
      if (*v <= 0 || *v > 1) {
        ctx.Error(perc.path,
                  RealText(*v) + " is out of range; accepted: (0, 1]");
      } else {
        ctx.Warn(perc.path,
                 "accepted, not supported yet: strata.optimizer.threads "
                 "sets the CPU optimizer's threads");
      }
    }
  }
  if (!r || *r == Residence::kDevice) {
    // The optimizer runs on the CPU: states cannot stay on the device.
    if (st.deepspeed && !st.strata_sets_optimizer_states) {
      ctx.Warn(device.path,
               "optimizer states on the device are not supported; they "
               "rest in host memory (as with \"cpu\")");
    }
    return;
  }
  if (st.stage == 0) {
    ctx.Error(device.path,
              "offloading the optimizer needs stage 1 or more "
              "(zero_optimization.stage is 0)");
    return;
  }
  o->optimizer_states = *r;
  ctx.SetOrigin("optimizer_states", device.path);
  // Gradients rest in host memory for both cpu and nvme offload: they are
  // accumulated there and reach NVMe with the step (strata.grads moves them).
  o->grads = Residence::kHost;
}

// A stage3_* knob in elements, set as bytes of the working dtype.
void ReadElems(Ctx& ctx, ObjReader& z,
               std::initializer_list<std::string_view> spellings,
               uint64_t elem_bytes, std::string_view field, uint64_t* out) {
  Field f = z.TakeAny(spellings);
  if (std::optional<uint64_t> v = ReadU64(ctx, f)) {
    *out = SaturatingMul(*v, elem_bytes);
    ctx.SetOrigin(field, f.path);
  }
}

void ReadZero(Ctx& ctx, const Field& f, DocState& st, EngineOptions* o) {
  ObjReader z(ctx, f);
  if (!z.present()) {
    // Without the section nothing is offloaded and zero_stage keeps
    // strata's default (stages differ only in what may be offloaded).
    if (st.deepspeed) {
      st.stage = o->zero_stage;
      ReadOffloadOptimizer(
          ctx, Field{nullptr, "zero_optimization.offload_optimizer"}, st, o);
    }
    return;
  }
  Field stage = z.Take("stage");
  st.stage = 0;  // DeepSpeed's default
  if (std::optional<uint64_t> v = ReadBounded(ctx, stage, INT_MAX)) {
    st.stage = static_cast<int>(*v);
    ctx.SetOrigin("zero_stage", stage.path);
  }
  o->zero_stage = st.stage;

  // Deprecated spellings of the offload sections.
  Field cpu_offload = z.Take("cpu_offload");
  Field cpu_offload_param = z.Take("cpu_offload_param");
  Field cpu_offload_pin = z.Take("cpu_offload_use_pin_memory");
  Field offload_param = z.Take("offload_param");
  Field offload_optimizer = z.Take("offload_optimizer");
  Json param_json, optimizer_json;
  if (ReadBool(ctx, cpu_offload_param).value_or(false)) {
    if (offload_param) {
      ctx.Error(cpu_offload_param.path,
                "give offload_param or this deprecated key, not both");
    } else {
      ctx.Warn(cpu_offload_param.path,
               "deprecated; read as offload_param.device \"cpu\"");
      param_json = {{"device", "cpu"}};
      offload_param = Field{&param_json, offload_param.path};
    }
  }
  if (ReadBool(ctx, cpu_offload).value_or(false)) {
    if (offload_optimizer) {
      ctx.Error(cpu_offload.path,
                "give offload_optimizer or this deprecated key, not both");
    } else {
      ctx.Warn(cpu_offload.path,
               "deprecated; read as offload_optimizer.device \"cpu\"");
      optimizer_json = {{"device", "cpu"}};
      offload_optimizer = Field{&optimizer_json, offload_optimizer.path};
    }
  }
  if (std::optional<bool> v = ReadBool(ctx, cpu_offload_pin)) {
    ctx.Warn(cpu_offload_pin.path, "deprecated; read as pin_memory");
    st.pin_param = st.pin_optimizer = *v;
  }
  ReadOffloadParam(ctx, offload_param, st, o);
  ReadOffloadOptimizer(ctx, offload_optimizer, st, o);

  const uint64_t e = st.elem_bytes;
  ReadElems(ctx, z, {"sub_group_size"}, e, "sub_group_bytes",
            &o->sub_group_bytes);
  ReadElems(ctx, z, {"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, e,
            "prefetch_bytes", &o->prefetch_bytes);
  ReadElems(
      ctx, z,
      {"stage3_param_persistence_threshold", "param_persistence_threshold"}, e,
      "persistence_threshold_bytes", &o->persistence_threshold_bytes);
  // sys.maxsize elements saturates to kUnlimited.
  ReadElems(
      ctx, z,
      {"stage3_model_persistence_threshold", "model_persistence_threshold"}, e,
      "max_persistent_bytes", &o->max_persistent_bytes);
  ReadElems(ctx, z, {"stage3_max_live_parameters", "max_live_parameters"}, e,
            "max_live_bytes", &o->max_live_bytes);
  ReadElems(ctx, z, {"stage3_max_reuse_distance", "max_reuse_distance"}, e,
            "max_reuse_distance_bytes", &o->max_reuse_distance_bytes);

  Unsupported(ctx,
              z.TakeAny({"stage3_gather_16bit_weights_on_model_save",
                         "gather_16bit_weights_on_model_save",
                         "stage3_gather_fp16_weights_on_model_save"}),
              "saving a model is not strata's yet", false);
  Unsupported(ctx,
              z.TakeAny({"stage3_module_granularity_threshold",
                         "module_granularity_threshold"}),
              "strata fetches per tensor, not per module", 0);
  Unsupported(ctx,
              z.TakeAny({"stage3_use_all_reduce_for_fetch_params",
                         "use_all_reduce_for_fetch_params"}),
              "stage 3 fetches gather the shards with an all-gather", false);
  Unsupported(
      ctx, z.TakeAny({"stage3_allgather_sequential", "allgather_sequential"}),
      "stage 3 fetches gather in the order they are decided", false);
  // The buckets of the reduction and the gathers over ranks.
  ReadElems(ctx, z, {"reduce_bucket_size"}, e, "reduce_bucket_bytes",
            &o->reduce_bucket_bytes);
  ReadElems(ctx, z, {"allgather_bucket_size"}, e, "allgather_bucket_bytes",
            &o->allgather_bucket_bytes);
  // What strata does anyway with several ranks when true: stages 2 and 3
  // reduce as gradients come, into buckets of their own, by reduce-scatter,
  // and gather each rank's partition whole.
  Unsupported(ctx, z.Take("overlap_comm"),
              "stages 2 and 3 always reduce as gradients come", true);
  for (std::string_view key :
       {"contiguous_gradients", "reduce_scatter", "allgather_partitions"}) {
    Unsupported(ctx, z.Take(key), "strata always does it", true);
  }
  // Collectives and DeepSpeed-specific machinery: none of these change the
  // engine's reduction over ranks (docs/memtier.md, "Data-parallel ranks").
  for (std::string_view key :
       {"round_robin_gradients", "use_multi_rank_bucket_allreduce",
        "zero_hpz_partition_size", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
        "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "load_from_fp32_weights",
        "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
        "memory_efficient_linear", "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings"}) {
    Unsupported(ctx, z.Take(key), "no effect in strata yet");
  }
}

// ---- aio ----

void ReadAio(Ctx& ctx, const Field& f, EngineOptions* o) {
  ObjReader aio(ctx, f);
  Field block = aio.Take("block_size");
  if (std::optional<uint64_t> v = ReadU64(ctx, block)) {
    o->io_block_bytes = *v;
    ctx.SetOrigin("io_block_bytes", block.path);
  }
  Field depth = aio.Take("queue_depth");
  if (std::optional<uint64_t> v = ReadBounded(ctx, depth, UINT32_MAX)) {
    o->io.queue_depth = static_cast<uint32_t>(*v);
    ctx.SetOrigin("io.queue_depth", depth.path);
  }
  // thread_count before v0.16.4; num_threads in some tools.
  Field threads =
      aio.TakeAny({"intra_op_parallelism", "thread_count", "num_threads"});
  if (ReadU64(ctx, threads).value_or(1) != 1) {
    ctx.Warn(threads.path,
             "accepted, not supported yet: strata submits from one thread "
             "per ring (the thread-pool backend's workers are "
             "strata.io.threads)");
  }
  Field single = aio.Take("single_submit");
  if (ReadBool(ctx, single, true).value_or(false)) {
    ctx.Warn(single.path,
             "accepted, not supported yet: strata always "
             "submits in batches");
  }
  Field overlap = aio.Take("overlap_events");
  if (!ReadBool(ctx, overlap, true).value_or(true)) {
    ctx.Warn(overlap.path,
             "accepted, not supported yet: strata always "
             "overlaps completions");
  }
  Field gds = aio.Take("use_gds");
  if (ReadBool(ctx, gds, true).value_or(false)) {
    ctx.Warn(gds.path,
             "accepted, not supported yet: GPUDirect Storage; data "
             "goes through pinned host memory");
  }
}

// ---- optimizer ----

// DeepSpeed's optimizer: Adam (AdamW unless adam_w_mode is false), AdamW,
// Adagrad, Lion. The section's meaning (type names, adam_w_mode, which
// params each type takes, their ranges) is cpu_adam's
// ParseCpuOptimizerConfig, the one parser of it; this reader adds what only
// the engine config has: its choice of types, unknown keys with a
// suggestion, legacy_fusion's warning, the origins of the options, and
// torch's (lion-pytorch's) defaults for what params leave out.
void ReadDsOptimizer(Ctx& ctx, const Field& f, EngineOptions* o) {
  const size_t errors_before = ctx.errors.size();
  Field type, params_field, lr, betas, eps, wd;
  std::optional<size_t> algo;
  {
    ObjReader opt(ctx, f);
    if (!opt.present()) return;
    type = opt.Take("type");
    algo = ReadChoice(ctx, type, kDsAlgoNames, true);
    if (!type) {
      ctx.Error(type.path,
                "required: Adam, AdamW, Adagrad, Lion, Adafactor or SM3");
    }
    Unsupported(ctx, opt.Take("legacy_fusion"), "no effect in strata");
    params_field = opt.Take("params");
    ObjReader params(ctx, params_field);
    lr = params.Take("lr");
    betas = params.Take("betas");
    eps = params.Take("eps");
    wd = params.Take("weight_decay");
    // The rest of each type's params (ParseCpuOptimizerConfig's).
    for (std::string_view key :
         {"bias_correction", "adam_w_mode", "amsgrad", "torch_adam",
          "clip_threshold", "decay_rate", "beta1", "scale_parameter",
          "relative_step", "warmup_init", "momentum"}) {
      params.Take(key);
    }
  }  // the readers report unknown keys here
  if (!algo || ctx.errors.size() != errors_before) return;
  OptimizerOptions& out = o->optimizer;
  CpuOptimizerOptions base = out.cpu;
  double default_lr = out.lr;
  const std::string lower = Lower(type.value->get<std::string>());
  if (lower == "adagrad") {
    default_lr = 1e-2;  // torch.optim.Adagrad's defaults
    base.eps = 1e-10;
  } else if (lower == "lion") {
    default_lr = 1e-4;  // lion-pytorch's defaults
    base.beta2 = 0.99;
  }
  Json section = {{"type", *type.value}};
  if (params_field) section["params"] = *params_field.value;
  StatusOr<CpuOptimizerConfig> cfg =
      ParseCpuOptimizerConfig(section.dump(), f.path, base);
  std::vector<std::pair<const char*, std::string>> origins = {
      {"optimizer.lr", lr.path},
      {"optimizer.cpu.beta1", betas.path + "[0]"},
      {"optimizer.cpu.beta2", betas.path + "[1]"},
      {"optimizer.cpu.eps", eps.path},
      {"optimizer.cpu.weight_decay", wd.path}};
  if (!cfg.ok()) {
    // "path: what", the path one of params'; name the option it sets too.
    const std::string msg(cfg.status().message());
    const size_t colon = msg.find(": ");
    std::string path = msg.substr(0, colon);
    for (const auto& [field, from] : origins) {
      if (from == path) path += " (" + std::string(field) + ")";
    }
    ctx.Error(path, colon == std::string::npos ? "" : msg.substr(colon + 2));
    return;
  }
  out.cpu = cfg->options;
  out.lr = lr ? cfg->lr : default_lr;
  ctx.SetOrigin("optimizer.cpu.algo", type.path);
  const bool given[] = {bool(lr), bool(betas), bool(betas), bool(eps),
                        bool(wd)};
  for (size_t k = 0; k < origins.size(); ++k) {
    if (given[k]) ctx.SetOrigin(origins[k].first, origins[k].second);
  }
}

// ---- other top-level DeepSpeed keys ----

void ReadDsTopLevel(Ctx& ctx, ObjReader& top, DocState& st, EngineOptions* o) {
  Field clip = top.Take("gradient_clipping");
  if (std::optional<double> v = ReadDouble(ctx, clip)) {
    o->gradient_clipping = *v;
    ctx.SetOrigin("gradient_clipping", clip.path);
  }
  st.accumulation_field = top.Take("gradient_accumulation_steps");
  st.ds_accumulation = ReadBounded(ctx, st.accumulation_field, UINT32_MAX);
  st.train_batch_field = top.Take("train_batch_size");
  st.train_batch = ReadU64(ctx, st.train_batch_field);
  st.micro_batch_field = top.Take("train_micro_batch_size_per_gpu");
  st.micro_batch = ReadU64(ctx, st.micro_batch_field);
  if (st.train_batch == 0u) {
    ctx.Error(st.train_batch_field.path,
              "0 is out of range; accepted: at least 1");
  }
  if (st.micro_batch == 0u) {
    ctx.Error(st.micro_batch_field.path,
              "0 is out of range; accepted: at least 1");
  }
  // Values equal to strata's own behaviour are not reported.
  Unsupported(ctx, top.Take("zero_allow_untested_optimizer"),
              "strata runs only its own CPU optimizers", false);
  Unsupported(ctx, top.Take("zero_force_ds_cpu_optimizer"),
              "strata always runs its own CPU optimizer", true);
  // The training loop's and DeepSpeed's own features.
  for (std::string_view key : {"steps_per_print",
                               "wall_clock_breakdown",
                               "memory_breakdown",
                               "dump_state",
                               "prescale_gradients",
                               "gradient_predivide_factor",
                               "sparse_gradients",
                               "scheduler",
                               "amp",
                               "activation_checkpointing",
                               "flops_profiler",
                               "tensorboard",
                               "wandb",
                               "csv_monitor",
                               "comet",
                               "comms_logger",
                               "communication_data_type",
                               "seq_parallel_communication_data_type",
                               "data_types",
                               "checkpoint",
                               "elasticity",
                               "autotuning",
                               "compression_training",
                               "data_efficiency",
                               "curriculum_learning",
                               "pipeline",
                               "sparse_attention",
                               "nebula",
                               "eigenvalue",
                               "progressive_layer_drop",
                               "quantize_training",
                               "dataloader_drop_last",
                               "disable_allgather",
                               "timers",
                               "compile",
                               "hybrid_engine",
                               "weight_quantization",
                               "tensor_parallel",
                               "graph_harvesting",
                               "torch_autocast",
                               "use_data_before_expert_parallel_",
                               "zero_optimization_stage_and_offload_warning"}) {
    Unsupported(ctx, top.Take(key), "no effect in strata");
  }
}

// train_batch_size = micro batch x accumulation steps x world size, as
// DeepSpeed requires; the missing one of the three is derived.
void CheckBatch(Ctx& ctx, DocState& st, EngineOptions* o) {
  if (st.strata_accumulation) return;  // strata's key decides
  const uint64_t ws = static_cast<uint64_t>(std::max(o->world_size, 1));
  std::optional<uint64_t> gas = st.ds_accumulation;
  if (gas) {
    o->gradient_accumulation_steps = static_cast<uint32_t>(*gas);
    ctx.SetOrigin("gradient_accumulation_steps", st.accumulation_field.path);
  }
  if (!st.train_batch || *st.train_batch == 0) return;
  if (st.micro_batch && *st.micro_batch == 0) return;
  if (gas && st.micro_batch) {
    if (SaturatingMul(SaturatingMul(*st.micro_batch, *gas), ws) !=
        *st.train_batch) {
      ctx.Error(st.train_batch_field.path,
                std::to_string(*st.train_batch) +
                    " is not train_micro_batch_size_per_gpu (" +
                    std::to_string(*st.micro_batch) +
                    ") x gradient_accumulation_steps (" + std::to_string(*gas) +
                    ") x world size (" + std::to_string(ws) + ")");
    }
    return;
  }
  const uint64_t per_step = st.micro_batch ? SaturatingMul(*st.micro_batch, ws)
                                           : SaturatingMul(gas.value_or(1), ws);
  if (per_step == 0 || *st.train_batch % per_step != 0) {
    ctx.Error(st.train_batch_field.path,
              std::to_string(*st.train_batch) + " is not a multiple of " +
                  std::to_string(per_step) +
                  (st.micro_batch ? " (micro batch x world size)"
                                  : " (accumulation steps x world size)"));
    return;
  }
  if (st.micro_batch) {
    const uint64_t derived = *st.train_batch / per_step;
    if (derived > UINT32_MAX) {
      ctx.Error(st.train_batch_field.path,
                "gives more than 4294967295 accumulation steps");
      return;
    }
    o->gradient_accumulation_steps = static_cast<uint32_t>(derived);
    ctx.SetOrigin("gradient_accumulation_steps", st.train_batch_field.path);
  }
}

// ---- strata ----

// A strata key read into an EngineOptions field (`field` names it for the
// validator's messages).
template <typename T>
struct Binding {
  const char* key;
  const char* field;
  T* dst;
};

// Reads each binding's key with `read` (Ctx&, const Field&) -> optional.
template <typename T, typename Read>
void ReadInto(Ctx& ctx, ObjReader& sec, std::initializer_list<Binding<T>> keys,
              Read read) {
  for (const Binding<T>& b : keys) {
    Field v = sec.Take(b.key);
    if (auto x = read(ctx, v)) {
      *b.dst = static_cast<T>(*x);
      ctx.SetOrigin(b.field, v.path);
    }
  }
}

std::optional<uint64_t> ReadInt(Ctx& ctx, const Field& f) {
  return ReadBounded(ctx, f, INT_MAX);
}
std::optional<uint64_t> ReadU32(Ctx& ctx, const Field& f) {
  return ReadBounded(ctx, f, UINT32_MAX);
}
std::optional<bool> ReadStrictBool(Ctx& ctx, const Field& f) {
  return ReadBool(ctx, f);
}

// A string naming an enum value, through the enum's own parser.
template <typename T>
auto ReadNamed(StatusOr<T> (*parse)(std::string_view), const char* expected) {
  return [parse, expected](Ctx& ctx, const Field& f) -> std::optional<T> {
    std::optional<std::string> s = ReadString(ctx, f);
    if (!s) return std::nullopt;
    StatusOr<T> v = parse(*s);
    if (v.ok()) return *v;
    TypeError(ctx, f, expected);
    return std::nullopt;
  };
}

void ReadStrataOptimizer(Ctx& ctx, const Field& f, OptimizerOptions* out) {
  ObjReader sec(ctx, f);
  ReadInto<CpuOptimizerAlgo>(ctx, sec,
                             {{"algo", "optimizer.cpu.algo", &out->cpu.algo}},
                             ReadEnum(kAlgoNames, kAlgos));
  ReadInto<double>(
      ctx, sec,
      {{"lr", "optimizer.lr", &out->lr},
       {"beta1", "optimizer.cpu.beta1", &out->cpu.beta1},
       {"beta2", "optimizer.cpu.beta2", &out->cpu.beta2},
       {"eps", "optimizer.cpu.eps", &out->cpu.eps},
       {"weight_decay", "optimizer.cpu.weight_decay", &out->cpu.weight_decay}},
      ReadDouble);
  ReadInto<bool>(ctx, sec,
                 {{"bias_correction", "optimizer.cpu.bias_correction",
                   &out->cpu.bias_correction}},
                 ReadStrictBool);
  ReadInto<int>(ctx, sec,
                {{"threads", "optimizer.cpu.threads", &out->cpu.threads},
                 {"block8_sweeps", "optimizer.cpu.block8_sweeps",
                  &out->cpu.block8_sweeps}},
                ReadInt);
  ReadInto<CpuKernelVariant>(
      ctx, sec, {{"variant", "optimizer.cpu.variant", &out->cpu.variant}},
      ReadNamed(&ParseCpuKernelVariant,
                "one of auto, scalar, avx2, avx512, avx512bf16"));
  ReadInto<CpuDType>(
      ctx, sec,
      {{"moment_dtype", "optimizer.moment_dtype", &out->moment_dtype}},
      ReadNamed(&ParseMomentDType, "one of fp32, bf16, int8"));
}

void ReadStrataLossScale(Ctx& ctx, const Field& f, LossScaleOptions* ls) {
  ObjReader sec(ctx, f);
  ReadInto<LossScaleMode>(ctx, sec, {{"mode", "loss_scale.mode", &ls->mode}},
                          ReadEnum(kModeNames, kModes));
  ReadInto<double>(
      ctx, sec,
      {{"initial_scale", "loss_scale.initial_scale", &ls->initial_scale},
       {"min_scale", "loss_scale.min_scale", &ls->min_scale}},
      ReadDouble);
  ReadInto<uint32_t>(ctx, sec,
                     {{"window", "loss_scale.window", &ls->window},
                      {"hysteresis", "loss_scale.hysteresis", &ls->hysteresis}},
                     ReadU32);
  ReadInto<bool>(
      ctx, sec,
      {{"consecutive_hysteresis", "loss_scale.consecutive_hysteresis",
        &ls->consecutive_hysteresis}},
      ReadStrictBool);
}

void ReadStrataIo(Ctx& ctx, const Field& f, IoEngineOptions* io) {
  ObjReader sec(ctx, f);
  ReadInto<IoBackend>(
      ctx, sec, {{"backend", "io.backend", &io->backend}},
      ReadNamed(&ParseIoBackend, "one of auto, uring, aio, psync, memory"));
  ReadInto<uint32_t>(ctx, sec,
                     {{"queue_depth", "io.queue_depth", &io->queue_depth},
                      {"threads", "io.threads", &io->threads},
                      {"max_retries", "io.max_retries", &io->max_retries}},
                     ReadU32);
  ReadInto<bool>(
      ctx, sec,
      {{"direct_io", "io.direct_io", &io->direct_io},
       {"register_buffers", "io.register_buffers", &io->register_buffers},
       {"register_files", "io.register_files", &io->register_files}},
      ReadStrictBool);
}

void ReadStrata(Ctx& ctx, const Field& f, EngineOptions* o) {
  ObjReader s(ctx, f);
  ReadInto<int>(ctx, s,
                {{"rank", "rank", &o->rank},
                 {"world_size", "world_size", &o->world_size},
                 {"zero_stage", "zero_stage", &o->zero_stage}},
                ReadInt);
  ReadInto<Residence>(
      ctx, s,
      {{"params", "params", &o->params},
       {"optimizer_states", "optimizer_states", &o->optimizer_states},
       {"grads", "grads", &o->grads}},
      ReadEnum(kResidenceNames, kResidences));
  ReadInto<CommMemory>(ctx, s,
                       {{"comm_memory", "comm_memory", &o->comm_memory}},
                       ReadEnum(kCommMemoryNames, kCommMemories));
  // Replaces the DeepSpeed nvme_path(s).
  ReadInto<std::vector<std::string>>(
      ctx, s, {{"nvme_paths", "nvme_paths", &o->nvme_paths}}, ReadPaths);
  ReadInto<uint64_t>(
      ctx, s,
      {{"device_budget_bytes", "device_budget_bytes", &o->device_budget_bytes},
       {"host_budget_bytes", "host_budget_bytes", &o->host_budget_bytes},
       {"partition_bytes", "partition_bytes", &o->partition_bytes},
       {"staging_buffer_bytes", "staging_buffer_bytes",
        &o->staging_buffer_bytes},
       {"prefetch_bytes", "prefetch_bytes", &o->prefetch_bytes},
       {"max_live_bytes", "max_live_bytes", &o->max_live_bytes},
       {"persistence_threshold_bytes", "persistence_threshold_bytes",
        &o->persistence_threshold_bytes},
       {"max_persistent_bytes", "max_persistent_bytes",
        &o->max_persistent_bytes},
       {"max_reuse_distance_bytes", "max_reuse_distance_bytes",
        &o->max_reuse_distance_bytes},
       {"sub_group_bytes", "sub_group_bytes", &o->sub_group_bytes},
       {"step_overlap_bytes", "step_overlap_bytes", &o->step_overlap_bytes},
       {"reduce_bucket_bytes", "reduce_bucket_bytes", &o->reduce_bucket_bytes},
       {"allgather_bucket_bytes", "allgather_bucket_bytes",
        &o->allgather_bucket_bytes},
       {"io_block_bytes", "io_block_bytes", &o->io_block_bytes}},
      ReadU64);
  ReadInto<uint32_t>(
      ctx, s,
      {{"staging_buffer_count", "staging_buffer_count",
        &o->staging_buffer_count},
       {"gradient_accumulation_steps", "gradient_accumulation_steps",
        &o->gradient_accumulation_steps}},
      ReadU32);
  ReadInto<bool>(ctx, s, {{"pin_memory", "pin_memory", &o->pin_memory}},
                 ReadStrictBool);
  ReadInto<CpuDType>(ctx, s,
                     {{"working_dtype", "working_dtype", &o->working_dtype}},
                     ReadEnum(kDtypeNames, kDtypes));
  ReadInto<double>(
      ctx, s,
      {{"gradient_clipping", "gradient_clipping", &o->gradient_clipping}},
      ReadDouble);
  ReadStrataLossScale(ctx, s.Take("loss_scale"), &o->loss_scale);
  ReadStrataOptimizer(ctx, s.Take("optimizer"), &o->optimizer);
  ReadStrataIo(ctx, s.Take("io"), &o->io);
}

// pin_memory of the two offload sections: strata has one flag, off when
// either asks for it off.
void ApplyPin(Ctx& ctx, const DocState& st, EngineOptions* o) {
  if (st.strata_sets_pin || (!st.pin_param && !st.pin_optimizer)) return;
  const bool pin =
      st.pin_param.value_or(true) && st.pin_optimizer.value_or(true);
  if (st.pin_param && st.pin_optimizer && *st.pin_param != *st.pin_optimizer) {
    ctx.Warn("zero_optimization",
             "offload_param.pin_memory and offload_optimizer.pin_memory "
             "differ; strata has one flag and pins nothing");
  }
  o->pin_memory = pin;
}

void ReadDocument(Ctx& ctx, const Json& root, EngineOptions* o) {
  if (!root.is_object()) {
    ctx.Error("(top level)", "expected a JSON object, got " + Describe(root));
    return;
  }
  DocState st;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() != "strata") st.deepspeed = true;
  }
  // strata's keys override the DeepSpeed sections.
  st.strata_sets_optimizer_states =
      PeekStrata(root, "optimizer_states") != nullptr;
  st.strata_sets_pin = PeekStrata(root, "pin_memory") != nullptr;
  st.strata_accumulation =
      PeekStrata(root, "gradient_accumulation_steps") != nullptr;
  ObjReader top(ctx, Field{&root, ""});
  ReadPrecision(ctx, top, st, o);
  st.elem_bytes =
      cpu_adam::DTypeSize(PeekWorkingDtype(root).value_or(o->working_dtype));
  ReadZero(ctx, top.Take("zero_optimization"), st, o);
  ReadAio(ctx, top.Take("aio"), o);
  ReadDsOptimizer(ctx, top.Take("optimizer"), o);
  ReadDsTopLevel(ctx, top, st, o);
  ReadStrata(ctx, top.Take("strata"), o);
  ApplyPin(ctx, st, o);
  CheckBatch(ctx, st, o);
}

// Finds the first key given twice in one object (nlohmann keeps the last
// silently), with its path, while the parser runs.
class DuplicateKeyFinder {
 public:
  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        frames_.push_back(Frame{false, 0, {}, {}});
        break;
      case Json::parse_event_t::array_start:
        frames_.push_back(Frame{true, 0, {}, {}});
        break;
      case Json::parse_event_t::key:
        if (!frames_.empty() && parsed.is_string()) {
          Frame& top = frames_.back();
          top.key = parsed.get<std::string>();
          if (!top.keys.insert(top.key).second && first_.empty()) {
            first_ = Path();
          }
        }
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        ElementDone();
        break;
      case Json::parse_event_t::value:
        ElementDone();
        break;
    }
    return true;
  }

  // Path of the first duplicate; empty if none.
  const std::string& first() const { return first_; }
  // Path of the value being parsed ("" at the top level).
  std::string Path() const {
    std::string path;
    for (const Frame& f : frames_) {
      path = f.array ? path + "[" + std::to_string(f.index) + "]"
                     : JoinPath(path, f.key);
    }
    return path;
  }

 private:
  struct Frame {
    bool array;
    size_t index;
    std::string key;
    std::set<std::string> keys;
  };

  void ElementDone() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
  }

  std::vector<Frame> frames_;
  std::string first_;
};

constexpr std::string_view kPrefix = "engine config: ";

// nlohmann's message without its "[json.exception.<kind>.<id>] " tag.
std::string WhatOf(const Json::exception& e) {
  std::string what = e.what();
  const size_t start = what.find("] ");
  return start == std::string::npos ? what : what.substr(start + 2);
}

StatusOr<EngineConfig> ParseImpl(std::string_view text) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    return Status::InvalidArgument(std::string(kPrefix) +
                                   "empty input; expected a JSON object");
  }
  DuplicateKeyFinder dups;
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), std::ref(dups),
                       /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
    return Status::InvalidArgument(std::string(kPrefix) +
                                   "invalid JSON: " + WhatOf(e));
  } catch (const Json::out_of_range& e) {
    // A number beyond a double ("number overflow parsing '1e400'"), which
    // nlohmann reports without a position: the path the parser was at names
    // the value.
    const std::string path = dups.Path();
    return Status::InvalidArgument(
        std::string(kPrefix) + (path.empty() ? "(top level)" : path) + ": " +
        WhatOf(e) + "; a number must be within a double's range");
  }
  if (!dups.first().empty()) {
    return Status::InvalidArgument(std::string(kPrefix) + dups.first() +
                                   ": key given twice in one object");
  }
  Ctx ctx;
  EngineConfig config;
  ReadDocument(ctx, root, &config.options);
  if (!ctx.errors.empty()) {
    return Status::InvalidArgument(std::string(kPrefix) +
                                   Join(ctx.errors, kMaxErrors));
  }
  STRATA_RETURN_IF_ERROR(Validate(config.options, &ctx.origins, kPrefix));
  config.warnings = std::move(ctx.warnings);
  return config;
}

// The name at the enum's value in a table of names in enum order.
template <typename T, size_t N>
std::string_view NameOf(T value, const std::string_view (&names)[N]) {
  const size_t i = static_cast<size_t>(value);
  return i < N ? names[i] : "?";
}

}  // namespace

std::string_view ResidenceName(Residence residence) {
  return NameOf(residence, kResidenceNames);
}

std::string_view CommMemoryName(CommMemory memory) {
  return NameOf(memory, kCommMemoryNames);
}

std::string_view LossScaleModeName(LossScaleMode mode) {
  return NameOf(mode, kModeNames);
}

std::string_view MomentDTypeName(CpuDType dtype) {
  return NameOf(dtype, kMomentNames);
}

StatusOr<CpuDType> ParseMomentDType(std::string_view name) {
  const std::string lower = Lower(name);
  for (CpuDType d :
       {CpuDType::kFloat32, CpuDType::kBFloat16, CpuDType::kBlock8}) {
    if (lower == MomentDTypeName(d)) return d;
  }
  return Status::InvalidArgument("moment format \"" + std::string(name) +
                                 "\"; accepted: fp32, bf16, int8");
}

Status ValidateEngineOptions(const EngineOptions& options) {
  return Validate(options, nullptr, "invalid EngineOptions: ");
}

StatusOr<EngineConfig> ParseEngineConfig(std::string_view json) {
  // Nothing inside should throw past the parser; this is the last guard of
  // "no exception escapes" (std::bad_alloc, a nlohmann type_error).
  try {
    return ParseImpl(json);
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory(std::string(kPrefix) + "out of memory");
  } catch (const std::exception& e) {
    return Status::Internal(std::string(kPrefix) + e.what());
  }
}

StatusOr<EngineConfig> ParseEngineConfigFile(const std::string& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::FromErrno(errno != 0 ? errno : EIO,
                             "open engine config " + path);
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return Status::FromErrno(errno != 0 ? errno : EIO,
                             "read engine config " + path);
  }
  StatusOr<EngineConfig> config = ParseEngineConfig(text.str());
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

}  // namespace strata
