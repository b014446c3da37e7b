// strata-bench: one binary, one subcommand per tier (io, adam, copy, ...).
// Each subcommand lives in its own file and registers itself with
// STRATA_BENCH_COMMAND; this header also holds what they share: machine
// facts for the JSON, an aligned table for stdout, progress on stderr when it
// is a terminal, percentiles, and size parsing.
#ifndef STRATA_BENCH_BENCH_H_
#define STRATA_BENCH_BENCH_H_

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

// Runs a subcommand; argv[0] is the subcommand's name. Returns an exit code.
using CommandFn = int (*)(int argc, char** argv);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

bool RegisterCommand(const Command& command);
const std::vector<Command>& Commands();

#define STRATA_BENCH_COMMAND(name, summary, fn)                 \
  [[maybe_unused]] static const bool strata_bench_registered_ = \
      ::strata::bench::RegisterCommand({name, summary, fn})

// Facts about this machine for the JSON: host name, kernel, CPU model and
// count, memory, strata version and git revision.
nlohmann::json MachineInfo();

// The filesystem type holding `path` ("ext4", "xfs", "tmpfs", ...), and the
// block device under it when there is one.
nlohmann::json FilesystemInfo(const std::string& path);

// Writes `j` (pretty-printed) to `path`.
Status WriteJson(const std::string& path, const nlohmann::json& j);

// Prints "<command>: <status>" on stderr and returns 1, a failed run's exit
// status.
int Fail(std::string_view command, const Status& status);

// An aligned, right-justified text table for stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void AddRow(std::vector<std::string> row);
  std::string ToString() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// One-line progress on stderr, redrawn in place; silent unless stderr is a
// terminal.
class Progress {
 public:
  explicit Progress(size_t total);
  void Step(std::string_view what);
  ~Progress();

 private:
  size_t total_;
  size_t done_ = 0;
  bool tty_;
};

// The p-th percentile (0..100) by nearest rank; sorts `v`. 0 for empty.
double Percentile(std::vector<double>& v, double p);

// Parses "4096", "4K", "1M", "2G", "1T" (powers of 1024; "KB"/"KiB" too).
StatusOr<uint64_t> ParseSize(std::string_view s);
// Parses a comma-separated list of sizes.
StatusOr<std::vector<uint64_t>> ParseSizeList(std::string_view s);
// Splits a comma-separated list.
std::vector<std::string> SplitList(std::string_view s);
// "1 MiB", "4 KiB", "512 B"...
std::string FormatBytes(uint64_t bytes);
// Fixed notation with `digits` decimals.
std::string Fixed(double v, int digits);

}  // namespace strata::bench

#endif  // STRATA_BENCH_BENCH_H_
