// Parsing of strata-bench option values: sizes with suffixes, integers,
// decimals and comma-separated lists, each checked against a range. Every
// error message names the option and the accepted range, e.g.
// "--queue-depth: 0 is out of range 1..1024". No exceptions: a value too
// large for 64 bits is an error like any other.
#ifndef STRATA_BENCH_PARSE_H_
#define STRATA_BENCH_PARSE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

// Parses "4096", "4K", "1M", "2G", "1T" (powers of 1024; "KB"/"KiB" and
// lower case too; blanks ignored). kInvalidArgument for an empty string, a
// missing number, an unknown suffix, or a value that does not fit in 64 bits
// (digits or digits x suffix).
StatusOr<uint64_t> ParseSize(std::string_view s);

// Splits a comma-separated list; empty items are dropped ("a,,b" is a, b).
std::vector<std::string> SplitList(std::string_view s);

// "1 MiB", "4 KiB", "512 B": the largest unit that divides `bytes`.
std::string FormatBytes(uint64_t bytes);

// The option-level parsers: `option` ("--size") prefixes every message.
// Sizes in [min, max] bytes.
StatusOr<uint64_t> ParseSizeOption(std::string_view option,
                                   std::string_view text, uint64_t min,
                                   uint64_t max);
// A non-empty list of sizes, each in [min, max].
StatusOr<std::vector<uint64_t>> ParseSizeListOption(std::string_view option,
                                                    std::string_view text,
                                                    uint64_t min, uint64_t max);
// A decimal integer (optional sign, digits only) in [min, max].
StatusOr<int64_t> ParseIntOption(std::string_view option, std::string_view text,
                                 int64_t min, int64_t max);
// A non-empty list of integers, each in [min, max].
StatusOr<std::vector<int64_t>> ParseIntListOption(std::string_view option,
                                                  std::string_view text,
                                                  int64_t min, int64_t max);
// A finite decimal number in [min, max]; with min_exclusive, min itself is
// refused too (for values that must be > 0). nan and inf are refused.
StatusOr<double> ParseDoubleOption(std::string_view option,
                                   std::string_view text, double min,
                                   double max, bool min_exclusive = false);
// A non-empty list whose items are all among `accepted` (duplicates
// dropped, order kept).
StatusOr<std::vector<std::string>> ParseChoiceListOption(
    std::string_view option, std::string_view text,
    const std::vector<std::string>& accepted);
// One value among `accepted`.
StatusOr<std::string> ParseChoiceOption(
    std::string_view option, std::string_view text,
    const std::vector<std::string>& accepted);

}  // namespace strata::bench

#endif  // STRATA_BENCH_PARSE_H_
