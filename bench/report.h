// What the benches print beside their tables, kept apart from the
// subcommands so that tests link it alone.
#ifndef STRATA_BENCH_REPORT_H_
#define STRATA_BENCH_REPORT_H_

#include <string>
#include <vector>

namespace strata::bench {

// The p-th percentile (0..100) by nearest rank; sorts `v`. 0 for empty.
double Percentile(std::vector<double>& v, double p);

// Fixed notation with `digits` decimals.
std::string Fixed(double v, int digits);

// One figure of a table against a reference measured in the same run:
// `what` names the row and the figure ("host adamw fp32 efficiency").
struct RatioFigure {
  std::string what;
  double best = 0;  // the best run against the best reference sample
  // The median of each run against its own sample; < 0 where there is none.
  double paired = -1;
};

// Under a table of ratios to a reference measured in the same run (a bound,
// or work that the measured work also does): a figure above 1 is one the
// work cannot reach unless the reference was measured while the machine
// was slower. Prints a note naming `reference` and each such figure;
// nothing when none is above 1.
void PrintAboveOneNote(const std::vector<RatioFigure>& figures,
                       const std::string& reference);

}  // namespace strata::bench

#endif  // STRATA_BENCH_REPORT_H_
