// What strata-finetune shows: a progress line per step (a bar redrawn in
// place on a terminal), the summary at the end, the JSON document of --json
// and the loss curve of --plot (SVG).
#ifndef STRATA_EXAMPLES_FINETUNE_REPORT_H_
#define STRATA_EXAMPLES_FINETUNE_REPORT_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "examples/finetune/trainer.h"
#include "strata/status.h"

namespace finetune {

// Prints each step to `out`: on a terminal one line redrawn in place with a
// bar, step, loss, tokens/s and the time left; otherwise one line per step.
class Progress {
 public:
  Progress(std::FILE* out, int64_t steps, int64_t tokens_per_step);
  void Step(const StepRecord& step);
  void Finish();  // ends the redrawn line

 private:
  std::FILE* out_;
  bool tty_;
  int64_t steps_;
  int64_t tokens_per_step_;
  double elapsed_ = 0;
  double first_ = 0;  // the first step's time, left out of the rate
};

// "1.50 GiB", "512 KiB", "12 B".
std::string HumanBytes(uint64_t bytes);

// A number in printf's %g: "0.003", "1e-05".
std::string General(double v);

// The end-of-run summary (several lines).
std::string Summary(const TrainOptions& options, const TrainReport& report);

// The --json document: the configuration it ran with, the results
// (loss_first, loss_last, steps, tokens_per_s, model_state_bytes,
// device_budget_bytes, peak_device_bytes, ...), the loss of every step and
// the engine's stats.
nlohmann::json ReportJson(const TrainOptions& options,
                          const TrainReport& report,
                          const nlohmann::json& run_config);

// The loss curve as an SVG document.
std::string LossPlotSvg(const TrainReport& report, const std::string& title);

// Writes `text` to `path` through a temporary file renamed into place, so a
// failed write leaves no partial file; errors name the path.
strata::Status WriteFileAtomically(const std::string& path,
                                   const std::string& text);

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_REPORT_H_
