#include "bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace strata::bench {

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  size_t idx = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return v[std::min(idx, v.size() - 1)];
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

void PrintAboveOneNote(const std::vector<RatioFigure>& figures,
                       const std::string& reference) {
  std::string above;
  for (const RatioFigure& f : figures) {
    if (f.best <= 1 && f.paired <= 1) continue;
    above += (above.empty() ? "" : "; ") + f.what + " " + Fixed(f.best, 3);
    if (f.paired >= 0) above += ", paired " + Fixed(f.paired, 3);
  }
  if (above.empty()) return;
  std::printf(
      "note: above 1 (%s): %s was measured slower than the work it bounds, "
      "so it was disturbed (other load on the machine, or a virtual "
      "machine's memory or drive rate moving between samples) and those "
      "ratios bound nothing; run again.\n",
      above.c_str(), reference.c_str());
}

}  // namespace strata::bench
