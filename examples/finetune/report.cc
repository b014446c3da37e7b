#include "examples/finetune/report.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "strata/cpu_adam.h"
#include "strata/engine.h"

namespace finetune {
namespace {

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string Duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600) {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm",
                  static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60));
  } else if (t >= 60) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds",
                  static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(t));
  }
  return buf;
}

std::string Rate(double tokens_per_s) {
  if (tokens_per_s >= 1e6) return Fixed(tokens_per_s / 1e6, 2) + "M";
  if (tokens_per_s >= 1e3) return Fixed(tokens_per_s / 1e3, 1) + "k";
  return Fixed(tokens_per_s, 0);
}

}  // namespace

std::string General(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string HumanBytes(uint64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? std::to_string(b) + " B" : Fixed(v, 2) + " " + kUnits[u];
}

Progress::Progress(std::FILE* out, int64_t steps, int64_t tokens_per_step)
    : out_(out),
      tty_(isatty(fileno(out)) != 0),
      steps_(steps),
      tokens_per_step_(tokens_per_step) {}

void Progress::Step(const StepRecord& s) {
  elapsed_ += s.seconds;
  if (s.step == 1) first_ = s.seconds;
  const int64_t timed_steps = s.step > 1 ? s.step - 1 : 1;
  const double timed = s.step > 1 ? elapsed_ - first_ : elapsed_;
  const double rate =
      static_cast<double>(tokens_per_step_ * timed_steps) / timed;
  const double left =
      timed / timed_steps * static_cast<double>(steps_ - s.step);
  std::string line = "step " + std::to_string(s.step) + "/" +
                     std::to_string(steps_) + "  loss " + Fixed(s.loss, 4) +
                     "  " + Rate(rate) + " tok/s  left " + Duration(left);
  if (!s.applied) line += "  (overflow: skipped)";
  if (tty_) {
    constexpr int kWidth = 24;
    const int done = static_cast<int>(kWidth * s.step / steps_);
    std::string bar(done, '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\r[%s] %s\x1b[K", bar.c_str(), line.c_str());
  } else {
    std::fprintf(out_, "%s  %.3fs\n", line.c_str(), s.seconds);
  }
  std::fflush(out_);
}

void Progress::Finish() {
  if (tty_) std::fprintf(out_, "\n");
}

std::string Summary(const TrainOptions& o, const TrainReport& r) {
  const strata::EngineStats& e = r.engine;
  std::string s;
  auto line = [&s](const std::string& k, const std::string& v) {
    s += "  " + k + std::string(k.size() < 22 ? 22 - k.size() : 1, ' ') + v +
         "\n";
  };
  s += "strata-finetune: " + std::to_string(r.steps.size()) + " steps of " +
       o.model_name + " on " + r.device_name + "\n";
  line("loss",
       Fixed(r.steps.front().loss, 4) + " -> " + Fixed(r.steps.back().loss, 4));
  line("tokens/s", Fixed(r.tokens_per_s, 1) + " (" +
                       std::to_string(r.tokens_per_step) + " per step)");
  if (o.engine.world_size > 1) {
    line("data-parallel ranks", std::to_string(o.engine.world_size) +
                                    " (ZeRO stage " +
                                    std::to_string(o.engine.zero_stage) +
                                    "); the figures below are rank 0's");
  }
  line("achieved TFLOPS", Fixed(r.tflops, 4) + " (model FLOPs, no recompute)");
  const strata::CpuOptimizerOptions& opt = o.engine.optimizer.cpu;
  const bool relative = opt.algo == strata::CpuOptimizerAlgo::kAdafactor &&
                        opt.adafactor.relative_step;
  line("optimizer", std::string(strata::CpuOptimizerAlgoName(opt.algo)) + ", " +
                        (relative ? std::string("relative step size")
                                  : "peak lr " + General(o.lr)) +
                        ", weight decay " + General(opt.weight_decay) + ", " +
                        std::string(strata::MomentDTypeName(
                            o.engine.optimizer.moment_dtype)) +
                        " moments");
  line("parameters", std::to_string(r.params));
  const double ratio =
      r.device_budget_bytes > 0
          ? static_cast<double>(r.model_state_bytes) / r.device_budget_bytes
          : 0;
  line("model state", HumanBytes(r.model_state_bytes) + ", " + Fixed(ratio, 1) +
                          "x the device budget of " +
                          HumanBytes(r.device_budget_bytes));
  line("peak per tier", "device " + HumanBytes(e.device.peak_bytes) +
                            ", host " + HumanBytes(e.host.peak_bytes) +
                            ", nvme " + HumanBytes(e.nvme.peak_bytes));
  line("device memory peak",
       HumanBytes(r.device_peak_bytes) + " (engine budget, activations " +
           HumanBytes(r.workspace_bytes) + ", gradients in flight)");
  line("recompute", r.recompute ? "each block in backward (checkpointing)"
                                : "none (every block's activations kept)");
  line("moved", "host->device " + HumanBytes(e.h2d_bytes) + ", device->host " +
                    HumanBytes(e.d2h_bytes) + ", nvme read " +
                    HumanBytes(e.nvme_read_bytes) + ", nvme write " +
                    HumanBytes(e.nvme_write_bytes));
  line("fetches", std::to_string(e.fetches) + " (" +
                      std::to_string(e.fetch_hits) + " on the device, " +
                      std::to_string(e.prefetch_hits) + " by prefetch)");
  line("time per step",
       Fixed(r.compute_seconds, 4) + " s forward and backward, " +
           Fixed(r.optimizer_seconds, 4) + " s optimizer step");
  line("stall", Fixed(e.stall_seconds, 3) + " s waiting for fetches");
  line("steps skipped", std::to_string(e.skipped_steps));
  line(
      "updates in backward",
      std::to_string(e.early_units) + " units, " +
          std::to_string(e.early_statistics) +
          " more with their gradient's statistics alone" +
          (e.early_passes > 0 ? ", Adafactor's statistics of " +
                                    std::to_string(e.early_passes) + " matrices"
                              : std::string()));
  line("wall time", Fixed(r.seconds, 1) + " s");
  if (r.resumed_from > 0) {
    line("resumed", "from step " + std::to_string(r.resumed_from) + " in " +
                        Fixed(r.load_seconds, 2) + " s");
  }
  if (!r.saves.empty()) {
    double secs = 0;
    for (const TrainReport::Save& v : r.saves) secs += v.seconds;
    line("checkpoints", std::to_string(r.saves.size()) + " saved in " +
                            Fixed(secs, 2) + " s, the last " +
                            r.saves.back().path);
  }
  if (!o.export_path.empty()) {
    line("exported",
         o.export_path + " in " + Fixed(r.export_seconds, 2) + " s");
  }
  return s;
}

nlohmann::json ReportJson(const TrainOptions& o, const TrainReport& r,
                          const nlohmann::json& run_config) {
  nlohmann::json losses = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRecord& s : r.steps) {
    losses.push_back(s.loss);
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"lr", s.lr},
                     {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale},
                     {"applied", s.applied},
                     {"seconds", s.seconds},
                     {"compute_seconds", s.compute_seconds},
                     {"optimizer_seconds", s.optimizer_seconds}});
  }
  nlohmann::json j;
  j["tool"] = "strata-finetune";
  j["config"] = run_config;
  j["device"] = r.device_name;
  j["loss_first"] = r.steps.front().loss;
  j["loss_last"] = r.steps.back().loss;
  j["steps"] = static_cast<int64_t>(r.steps.size());
  j["tokens_per_step"] = r.tokens_per_step;
  j["tokens_per_s"] = r.tokens_per_s;
  j["tflops"] = r.tflops;
  j["flops_per_token"] = r.flops_per_token;
  j["params"] = r.params;
  j["model_state_bytes"] = r.model_state_bytes;
  j["device_budget_bytes"] = r.device_budget_bytes;
  j["peak_device_bytes"] = r.engine.device.peak_bytes;
  j["device_memory_peak_bytes"] = r.device_peak_bytes;
  j["workspace_bytes"] = r.workspace_bytes;
  j["recompute"] = r.recompute;
  j["from_checkpoint"] = r.from_checkpoint;
  j["resumed_from_step"] = r.resumed_from;
  j["load_seconds"] = r.load_seconds;
  nlohmann::json saves = nlohmann::json::array();
  for (const TrainReport::Save& v : r.saves) {
    saves.push_back(
        {{"step", v.step}, {"path", v.path}, {"seconds", v.seconds}});
  }
  j["checkpoints"] = saves;
  j["export_seconds"] = r.export_seconds;
  j["wall_seconds"] = r.seconds;
  j["losses"] = losses;
  j["step_records"] = steps;
  j["engine"] = nlohmann::json::parse(strata::EngineStatsJson(r.engine));
  (void)o;
  return j;
}

std::string LossPlotSvg(const TrainReport& r, const std::string& title) {
  constexpr double kW = 720, kH = 420, kL = 70, kR = 20, kT = 40, kB = 50;
  double lo = r.steps.front().loss, hi = lo;
  for (const StepRecord& s : r.steps) {
    lo = std::min(lo, s.loss);
    hi = std::max(hi, s.loss);
  }
  if (hi - lo < 1e-9) hi = lo + 1;
  const double pad = (hi - lo) * 0.05;
  lo -= pad;
  hi += pad;
  const double n = static_cast<double>(std::max<size_t>(r.steps.size(), 2));
  const double first = static_cast<double>(r.steps.front().step);
  auto x = [&](double step) {
    return kL + (step - first) / (n - 1) * (kW - kL - kR);
  };
  auto y = [&](double loss) {
    return kT + (hi - loss) / (hi - lo) * (kH - kT - kB);
  };
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                    Fixed(kW, 0) + "\" height=\"" + Fixed(kH, 0) +
                    "\" font-family=\"sans-serif\" font-size=\"12\">\n"
                    "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::string safe;
  for (char c : title) {
    if (c == '<') {
      safe += "&lt;";
    } else if (c == '&') {
      safe += "&amp;";
    } else if (c == '>') {
      safe += "&gt;";
    } else {
      safe += c;
    }
  }
  svg += "<text x=\"" + Fixed(kW / 2, 0) +
         "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" + safe +
         "</text>\n";
  // Axes, ticks and labels.
  svg += "<path d=\"M" + Fixed(kL, 1) + " " + Fixed(kT, 1) + " V" +
         Fixed(kH - kB, 1) + " H" + Fixed(kW - kR, 1) +
         "\" stroke=\"black\" fill=\"none\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4;
    svg += "<text x=\"" + Fixed(kL - 6, 1) + "\" y=\"" + Fixed(y(v) + 4, 1) +
           "\" text-anchor=\"end\">" + Fixed(v, 2) + "</text>\n";
    const double st = 1 + (n - 1) * i / 4;
    svg += "<text x=\"" + Fixed(x(st), 1) + "\" y=\"" + Fixed(kH - kB + 18, 1) +
           "\" text-anchor=\"middle\">" + Fixed(st, 0) + "</text>\n";
  }
  svg += "<text x=\"" + Fixed((kL + kW - kR) / 2, 0) + "\" y=\"" +
         Fixed(kH - 12, 0) + "\" text-anchor=\"middle\">step</text>\n";
  svg += "<text x=\"16\" y=\"" + Fixed((kT + kH - kB) / 2, 0) +
         "\" transform=\"rotate(-90 16 " + Fixed((kT + kH - kB) / 2, 0) +
         ")\" text-anchor=\"middle\">loss</text>\n";
  svg +=
      "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" "
      "points=\"";
  for (const StepRecord& s : r.steps) {
    svg += Fixed(x(static_cast<double>(s.step)), 1) + "," +
           Fixed(y(s.loss), 1) + " ";
  }
  svg += "\"/>\n</svg>\n";
  return svg;
}

strata::Status WriteFileAtomically(const std::string& path,
                                   const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd =
      open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return strata::Status::FromErrno(errno, "creating " + tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      close(fd);
      unlink(tmp.c_str());
      return strata::Status::FromErrno(err, "writing " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return strata::Status::FromErrno(err, "writing " + tmp);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return strata::Status::FromErrno(err, "renaming " + tmp + " to " + path);
  }
  return strata::Status::Ok();
}

}  // namespace finetune
