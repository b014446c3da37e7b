// ParseCpuOptimizerConfig: an optimizer chosen by name, from a DeepSpeed
// style `optimizer` section. Every error names the JSON path of the value
// and what is accepted there.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "strata/cpu_adam.h"

namespace strata {
namespace {

using Json = nlohmann::json;

Status Bad(const std::string& path, const std::string& what) {
  return Status::InvalidArgument(path + ": " + what);
}

// %g: 1 rather than 1.000000 in messages.
std::string Num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

StatusOr<double> Number(const Json& v, const std::string& path, double lo,
                        double hi, bool hi_open) {
  if (!v.is_number()) return Bad(path, "expected a number, got " + v.dump());
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || (hi_open ? x >= hi : x > hi)) {
    return Bad(path, Num(x) + " is out of range; accepted: [" + Num(lo) + ", " +
                         Num(hi) + (hi_open ? ")" : "]"));
  }
  return x;
}

StatusOr<bool> Bool(const Json& v, const std::string& path) {
  if (!v.is_boolean()) return Bad(path, "expected true or false");
  return v.get<bool>();
}

// [a, b] with a and b in [0, 1).
Status Betas(const Json& v, const std::string& path, double* b1, double* b2) {
  if (!v.is_array() || v.size() != 2) {
    return Bad(path,
               "expected an array of two numbers [beta1, beta2], each in "
               "[0, 1)");
  }
  STRATA_ASSIGN_OR_RETURN(*b1, Number(v[0], path + "[0]", 0.0, 1.0, true));
  STRATA_ASSIGN_OR_RETURN(*b2, Number(v[1], path + "[1]", 0.0, 1.0, true));
  return Status::Ok();
}

std::string Join(const std::vector<const char*>& names) {
  std::string out;
  for (const char* n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

}  // namespace

StatusOr<CpuOptimizerConfig> ParseCpuOptimizerConfig(
    std::string_view text, std::string_view path_view,
    const CpuOptimizerOptions& base) {
  const std::string path(path_view);
  const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false,
                             /*ignore_comments=*/false);
  if (j.is_discarded()) return Bad(path, "not valid JSON");
  if (!j.is_object()) {
    return Bad(path, "expected an object {\"type\": ..., \"params\": {...}}");
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "type" && key != "params") {
      return Bad(path + "." + key, "unknown key (accepted: type, params)");
    }
  }
  if (!j.contains("type") || !j["type"].is_string()) {
    return Bad(path + ".type",
               "expected a string: adam, adamw, adagrad, lion, adafactor or "
               "sm3");
  }
  const std::string type = j["type"].get<std::string>();
  auto algo = ParseCpuOptimizerAlgo(type);
  if (!algo.ok()) return algo.status().WithContext(path + ".type");
  CpuOptimizerConfig cfg;
  cfg.options = base;
  CpuOptimizerOptions& o = cfg.options;
  o.algo = *algo;
  if (o.algo == CpuOptimizerAlgo::kSm3) o.beta1 = 0.0;  // momentum off
  Json params = Json::object();
  if (j.contains("params")) {
    params = j["params"];
    if (!params.is_object()) return Bad(path + ".params", "expected an object");
  }
  std::vector<const char*> accepted;
  switch (o.algo) {
    case CpuOptimizerAlgo::kAdam:
    case CpuOptimizerAlgo::kAdamW:
      accepted = {"lr",           "betas",           "eps",
                  "weight_decay", "bias_correction", "adam_w_mode",
                  "amsgrad",      "torch_adam"};
      break;
    case CpuOptimizerAlgo::kLion:
      accepted = {"lr", "betas", "weight_decay"};
      break;
    case CpuOptimizerAlgo::kAdagrad:
      accepted = {"lr", "eps", "weight_decay"};
      break;
    case CpuOptimizerAlgo::kAdafactor:
      accepted = {
          "lr",         "eps",          "clip_threshold",  "decay_rate",
          "beta1",      "weight_decay", "scale_parameter", "relative_step",
          "warmup_init"};
      break;
    case CpuOptimizerAlgo::kSm3:
      accepted = {"lr", "momentum", "eps", "weight_decay"};
      break;
  }
  // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
  bool adam_w_mode =
      o.algo == CpuOptimizerAlgo::kAdam || o.algo == CpuOptimizerAlgo::kAdamW;
  bool lr_given = false;
  for (const auto& [key, v] : params.items()) {
    const std::string p = path + ".params." + key;
    bool known = false;
    for (const char* a : accepted) known = known || key == a;
    if (!known) {
      return Bad(p, "unknown parameter of " +
                        std::string(CpuOptimizerAlgoName(o.algo)) +
                        " (accepted: " + Join(accepted) + ")");
    }
    if (key == "lr") {
      if (o.algo == CpuOptimizerAlgo::kAdafactor && v.is_null()) continue;
      STRATA_ASSIGN_OR_RETURN(cfg.lr, Number(v, p, 0.0, 1e6, false));
      lr_given = true;
    } else if (key == "betas") {
      STRATA_RETURN_IF_ERROR(Betas(v, p, &o.beta1, &o.beta2));
    } else if (key == "eps" && o.algo == CpuOptimizerAlgo::kAdafactor) {
      if (!v.is_array() || v.size() != 2) {
        return Bad(p, "expected [eps1, eps2], each >= 0");
      }
      STRATA_ASSIGN_OR_RETURN(o.adafactor.eps1,
                              Number(v[0], p + "[0]", 0.0, 1.0, false));
      STRATA_ASSIGN_OR_RETURN(o.adafactor.eps2,
                              Number(v[1], p + "[1]", 0.0, 1.0, false));
    } else if (key == "eps") {
      STRATA_ASSIGN_OR_RETURN(o.eps, Number(v, p, 0.0, 1.0, false));
    } else if (key == "weight_decay") {
      STRATA_ASSIGN_OR_RETURN(o.weight_decay, Number(v, p, 0.0, 1e6, false));
    } else if (key == "bias_correction") {
      STRATA_ASSIGN_OR_RETURN(o.bias_correction, Bool(v, p));
    } else if (key == "adam_w_mode") {
      STRATA_ASSIGN_OR_RETURN(adam_w_mode, Bool(v, p));
    } else if (key == "amsgrad") {
      STRATA_ASSIGN_OR_RETURN(bool ams, Bool(v, p));
      if (ams) return Bad(p, "true is not supported (accepted: false)");
    } else if (key == "torch_adam") {
      STRATA_RETURN_IF_ERROR(Bool(v, p).status());  // DeepSpeed's choice
    } else if (key == "clip_threshold") {
      STRATA_ASSIGN_OR_RETURN(o.adafactor.clip_threshold,
                              Number(v, p, 1e-30, 1e30, false));
    } else if (key == "decay_rate") {
      STRATA_ASSIGN_OR_RETURN(o.adafactor.decay_rate,
                              Number(v, p, -1.0, 0.0, true));
    } else if (key == "beta1") {
      if (v.is_null()) {
        o.adafactor.beta1 = 0.0;
      } else {
        STRATA_ASSIGN_OR_RETURN(o.adafactor.beta1,
                                Number(v, p, 0.0, 1.0, true));
      }
    } else if (key == "scale_parameter") {
      STRATA_ASSIGN_OR_RETURN(o.adafactor.scale_parameter, Bool(v, p));
    } else if (key == "relative_step") {
      STRATA_ASSIGN_OR_RETURN(o.adafactor.relative_step, Bool(v, p));
    } else if (key == "warmup_init") {
      STRATA_ASSIGN_OR_RETURN(o.adafactor.warmup_init, Bool(v, p));
    } else if (key == "momentum") {
      STRATA_ASSIGN_OR_RETURN(o.beta1, Number(v, p, 0.0, 1.0, true));
    }
  }
  if (o.algo == CpuOptimizerAlgo::kAdam || o.algo == CpuOptimizerAlgo::kAdamW) {
    if (*algo == CpuOptimizerAlgo::kAdamW && !adam_w_mode) {
      return Bad(path + ".params.adam_w_mode",
                 "false contradicts type AdamW (use type Adam)");
    }
    o.algo = adam_w_mode ? CpuOptimizerAlgo::kAdamW : CpuOptimizerAlgo::kAdam;
  }
  if (o.algo == CpuOptimizerAlgo::kAdafactor) {
    // As HF: a given lr turns the relative step off unless it is asked for.
    if (lr_given && !params.contains("relative_step")) {
      o.adafactor.relative_step = false;
    }
    if (lr_given && o.adafactor.relative_step) {
      return Bad(path + ".params.lr",
                 "a fixed lr cannot be combined with relative_step true");
    }
    if (o.adafactor.warmup_init && !o.adafactor.relative_step) {
      return Bad(path + ".params.warmup_init", "needs relative_step true");
    }
    if (!lr_given && !o.adafactor.relative_step) {
      return Bad(path + ".params.lr", "required when relative_step is false");
    }
  }
  return cfg;
}

std::string CpuAdafactorParamsJson(const CpuAdafactorOptions& a) {
  const Json j = {{"eps", {a.eps1, a.eps2}},
                  {"clip_threshold", a.clip_threshold},
                  {"decay_rate", a.decay_rate},
                  {"beta1", a.beta1},
                  {"relative_step", a.relative_step},
                  {"scale_parameter", a.scale_parameter},
                  {"warmup_init", a.warmup_init}};
  return j.dump();
}

std::string CpuOptimizerConfigJson(const CpuOptimizerConfig& c) {
  const CpuOptimizerOptions& o = c.options;
  Json params;
  switch (o.algo) {
    case CpuOptimizerAlgo::kAdam:
    case CpuOptimizerAlgo::kAdamW:
      params = {{"lr", c.lr},
                {"betas", {o.beta1, o.beta2}},
                {"eps", o.eps},
                {"weight_decay", o.weight_decay},
                {"bias_correction", o.bias_correction}};
      // "adam" alone reads as AdamW (DeepSpeed's rule).
      if (o.algo == CpuOptimizerAlgo::kAdam) params["adam_w_mode"] = false;
      break;
    case CpuOptimizerAlgo::kLion:
      params = {{"lr", c.lr},
                {"betas", {o.beta1, o.beta2}},
                {"weight_decay", o.weight_decay}};
      break;
    case CpuOptimizerAlgo::kAdagrad:
      params = {{"lr", c.lr}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
      break;
    case CpuOptimizerAlgo::kAdafactor:
      params = Json::parse(CpuAdafactorParamsJson(o.adafactor));
      // A fixed lr and relative_step exclude each other.
      params["lr"] = o.adafactor.relative_step ? Json(nullptr) : Json(c.lr);
      params["weight_decay"] = o.weight_decay;
      break;
    case CpuOptimizerAlgo::kSm3:
      params = {{"lr", c.lr},
                {"momentum", o.beta1},
                {"eps", o.eps},
                {"weight_decay", o.weight_decay}};
      break;
  }
  const Json j = {{"type", std::string(CpuOptimizerAlgoName(o.algo))},
                  {"params", params}};
  return j.dump();
}

}  // namespace strata
