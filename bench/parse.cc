#include "bench/parse.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace strata::bench {
namespace {

std::string Quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string Number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string Prefix(std::string_view option) {
  return std::string(option) + ": ";
}

// Accumulates decimal digits; false when the value passes 2^64 - 1.
bool AccumulateDigits(std::string_view digits, uint64_t* out) {
  uint64_t n = 0;
  for (char c : digits) {
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (n > (std::numeric_limits<uint64_t>::max() - d) / 10) return false;
    n = n * 10 + d;
  }
  *out = n;
  return true;
}

std::string SizeRange(uint64_t min, uint64_t max) {
  if (max == std::numeric_limits<uint64_t>::max()) {
    return "at least " + FormatBytes(min);
  }
  return "range " + FormatBytes(min) + ".." + FormatBytes(max);
}

}  // namespace

StatusOr<uint64_t> ParseSize(std::string_view s) {
  std::string t;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) t += c;
  }
  if (t.empty()) return Status::InvalidArgument("empty size");
  size_t pos = 0;
  while (pos < t.size() && std::isdigit(static_cast<unsigned char>(t[pos]))) {
    ++pos;
  }
  if (pos == 0) {
    return Status::InvalidArgument(
        "bad size " + Quoted(t) +
        " (a whole number, optionally followed by K, M, G or T)");
  }
  uint64_t n = 0;
  if (!AccumulateDigits(std::string_view(t).substr(0, pos), &n)) {
    return Status::InvalidArgument("size " + Quoted(t) +
                                   " does not fit in 64 bits");
  }
  std::string suffix = t.substr(pos);
  for (auto& c : suffix) {
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  int shift = -1;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TB" || suffix == "TIB") {
    shift = 40;
  } else {
    return Status::InvalidArgument("bad size suffix in " + Quoted(t) +
                                   " (accepted: K, M, G, T; powers of 1024)");
  }
  if (shift > 0 && n > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return Status::InvalidArgument("size " + Quoted(t) +
                                   " does not fit in 64 bits");
  }
  return n << shift;
}

std::vector<std::string> SplitList(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string_view::npos) comma = s.size();
    std::string item(s.substr(start, comma - start));
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(std::move(item));
    start = comma + 1;
  }
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (u < 6 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + " " + kUnits[u];
}

StatusOr<uint64_t> ParseSizeOption(std::string_view option,
                                   std::string_view text, uint64_t min,
                                   uint64_t max) {
  auto v = ParseSize(text);
  if (!v.ok()) return v.status().WithContext(option);
  if (*v < min || *v > max) {
    return Status::InvalidArgument(Prefix(option) + FormatBytes(*v) +
                                   " is out of " + SizeRange(min, max));
  }
  return *v;
}

StatusOr<std::vector<uint64_t>> ParseSizeListOption(std::string_view option,
                                                    std::string_view text,
                                                    uint64_t min,
                                                    uint64_t max) {
  std::vector<uint64_t> out;
  for (const std::string& item : SplitList(text)) {
    STRATA_ASSIGN_OR_RETURN(uint64_t v,
                            ParseSizeOption(option, item, min, max));
    out.push_back(v);
  }
  if (out.empty()) {
    return Status::InvalidArgument(Prefix(option) + "empty list " +
                                   Quoted(text) + " (give at least one size)");
  }
  return out;
}

StatusOr<int64_t> ParseIntOption(std::string_view option, std::string_view text,
                                 int64_t min, int64_t max) {
  const std::string range =
      "range " + std::to_string(min) + ".." + std::to_string(max);
  std::string t(text);
  t.erase(0, t.find_first_not_of(" \t"));
  t.erase(t.find_last_not_of(" \t") + 1);
  size_t digits = t.empty() || (t[0] != '-' && t[0] != '+') ? 0 : 1;
  const bool negative = !t.empty() && t[0] == '-';
  if (digits == t.size() ||
      !std::all_of(t.begin() + static_cast<ptrdiff_t>(digits), t.end(),
                   [](char c) { return c >= '0' && c <= '9'; })) {
    return Status::InvalidArgument(Prefix(option) + Quoted(text) +
                                   " is not a whole number (accepted " + range +
                                   ")");
  }
  uint64_t mag = 0;
  if (!AccumulateDigits(std::string_view(t).substr(digits), &mag) ||
      mag > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Status::InvalidArgument(Prefix(option) + t + " is out of " + range);
  }
  const int64_t v =
      negative ? -static_cast<int64_t>(mag) : static_cast<int64_t>(mag);
  if (v < min || v > max) {
    return Status::InvalidArgument(Prefix(option) + std::to_string(v) +
                                   " is out of " + range);
  }
  return v;
}

StatusOr<std::vector<int64_t>> ParseIntListOption(std::string_view option,
                                                  std::string_view text,
                                                  int64_t min, int64_t max) {
  std::vector<int64_t> out;
  for (const std::string& item : SplitList(text)) {
    STRATA_ASSIGN_OR_RETURN(int64_t v, ParseIntOption(option, item, min, max));
    out.push_back(v);
  }
  if (out.empty()) {
    return Status::InvalidArgument(Prefix(option) + "empty list " +
                                   Quoted(text) +
                                   " (give at least one number)");
  }
  return out;
}

StatusOr<double> ParseDoubleOption(std::string_view option,
                                   std::string_view text, double min,
                                   double max, bool min_exclusive) {
  const std::string range = std::string(min_exclusive ? "(" : "[") +
                            Number(min) + ", " + Number(max) + "]";
  const std::string t(text);
  char* end = nullptr;
  errno = 0;
  const double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || errno == ERANGE) {
    return Status::InvalidArgument(Prefix(option) + Quoted(text) +
                                   " is not a number (accepted " + range + ")");
  }
  if (!std::isfinite(v) || v < min || v > max || (min_exclusive && v == min)) {
    return Status::InvalidArgument(Prefix(option) + t + " is out of " + range);
  }
  return v;
}

StatusOr<std::vector<std::string>> ParseChoiceListOption(
    std::string_view option, std::string_view text,
    const std::vector<std::string>& accepted) {
  std::string names;
  for (const auto& a : accepted) names += (names.empty() ? "" : ",") + a;
  std::vector<std::string> out;
  for (const std::string& item : SplitList(text)) {
    if (std::find(accepted.begin(), accepted.end(), item) == accepted.end()) {
      return Status::InvalidArgument(Prefix(option) + Quoted(item) +
                                     " is not one of " + names);
    }
    if (std::find(out.begin(), out.end(), item) == out.end()) {
      out.push_back(item);
    }
  }
  if (out.empty()) {
    return Status::InvalidArgument(Prefix(option) + "empty list " +
                                   Quoted(text) + " (accepted: " + names + ")");
  }
  return out;
}

StatusOr<std::string> ParseChoiceOption(
    std::string_view option, std::string_view text,
    const std::vector<std::string>& accepted) {
  if (std::find(accepted.begin(), accepted.end(), text) != accepted.end()) {
    return std::string(text);
  }
  std::string names;
  for (const auto& a : accepted) names += (names.empty() ? "" : ", ") + a;
  return Status::InvalidArgument(Prefix(option) + Quoted(text) +
                                 " is not one of " + names);
}

}  // namespace strata::bench
