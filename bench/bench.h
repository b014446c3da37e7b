// strata-bench: one binary, one subcommand per tier (io, adam, copy, ...).
// Each subcommand lives in its own file and registers itself with
// STRATA_BENCH_COMMAND; this header also holds what they share.
//
// Every command has one shape: parse the options into a config (every value
// checked, bench/parse.h), check what can be checked before any work (output
// paths, free space, memory), run to results, report (a table on stdout, a
// JSON document with --json). And one exit convention (docs/bench.md):
//   0    ok (also --help)
//   1    failure at run time: the command line is fine, but this machine or
//        this run cannot do it (no space or memory, directory in use, I/O or
//        device errors)
//   2    bad usage: an option, value or path on the command line cannot work
//        (CLI11's own parse errors included)
//   128 + signal number when interrupted: 130 for SIGINT, 143 for SIGTERM
#ifndef STRATA_BENCH_BENCH_H_
#define STRATA_BENCH_BENCH_H_

#include <sys/types.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/parse.h"
#include "bench/report.h"
#include "strata/device.h"
#include "strata/io_engine.h"
#include "strata/status.h"
#include "util/file_lock.h"
#include "util/unique_handle.h"

namespace strata::bench {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

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

// ---- Exit statuses
// -----------------------------------------------------------

// Seconds from `since` to now, on the steady clock every command times with.
inline double SecondsSince(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// --device of the commands that use a device: auto (a GPU when one works,
// deferring to STRATA_DEVICE), cuda or host. Parse checks the value and
// names the option; DeviceChoiceOf maps a checked value.
void AddDeviceOption(CLI::App& app, std::string& device);
StatusOr<std::string> ParseDeviceOption(const std::string& device);
DeviceChoice DeviceChoiceOf(const std::string& device);

// Parses argv with `app`. nullopt: go on. Otherwise the exit status to
// return: 0 after --help, 2 after a parse error (CLI11's message printed).
std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv);

// Prints "strata-bench <command>: <status>" on stderr; returns 2.
int UsageError(std::string_view command, const Status& status);

// Prints "strata-bench <command>: <status>" on stderr; returns 1, or
// 128 + the signal when the run was interrupted (the message then says so).
int Fail(std::string_view command, const Status& status);

class RunGuard;

// The swap-space I/O options of the commands that drive the engine's NVMe
// path (step, tiers): --engine, --queue-depth and --block-size, as given and
// as checked.
struct SwapIoFlags {
  std::string engine = "auto";
  std::string queue_depth = "32";
  std::string block_size = "1M";
};
struct SwapIoConfig {
  IoBackend engine = IoBackend::kAuto;
  uint32_t queue_depth = 32;
  uint64_t block_size = 1 << 20;
};
void AddSwapIoOptions(CLI::App& app, SwapIoFlags& f);
// Each value checked, the option named in the message: the engine one of
// auto, uring, aio, psync; the queue depth 1..1024; the block size a multiple
// of 4 KiB in 64 KiB..64 MiB.
StatusOr<SwapIoConfig> ParseSwapIoFlags(const SwapIoFlags& f);

// The I/O engine's rate, bytes/s, moving reads and writes at once,
// `read_share` of the blocks reads (0..1, at least one block of each kind
// the share asks for), with `io`'s engine, block size and queue depth,
// through a scratch file `scratch` in `dir` of about `bytes` (at most 1
// GiB); best of three passes. An offloaded step moves its own share (its
// states' reads and writes, and its gradients' reads when they rest on
// NVMe).
StatusOr<double> MeasureIo(const std::string& dir, const std::string& scratch,
                           const SwapIoConfig& io, double read_share,
                           uint64_t bytes, RunGuard& guard);
// MeasureIo with equal reads and writes (what an offloaded step and a
// checkpoint of NVMe-resident state do).
StatusOr<double> MeasureMixedIo(const std::string& dir,
                                const std::string& scratch,
                                const SwapIoConfig& io, uint64_t bytes,
                                RunGuard& guard);

// The one shape of every command, with its exit statuses: parses argv into
// the flags `app` binds (--help: 0, CLI11 errors: 2), then `parse` (a
// failure is 2), then, under a RunGuard, `check` (FailCheck) and
// `run_and_report` (Fail). Each step keeps its results in the caller's
// locals.
int RunCommand(std::string_view command, CLI::App& app, int argc, char** argv,
               const std::function<Status()>& parse,
               const std::function<Status(RunGuard&)>& check,
               const std::function<Status(RunGuard&)>& run_and_report);

// A failed up-front check: 2 for kInvalidArgument (a path or value on the
// command line, or an environment variable, cannot work), else as Fail.
int FailCheck(std::string_view command, const Status& status);

// ---- Signals and cleanup
// -----------------------------------------------------

// An exclusive lock on `dir`: <dir>/<name>, holding our pid, flock()ed.
// kBusy naming the holder's pid when another process has it. The lock file
// is removed on destruction while still held; an acquirer that finds the
// path gone or replaced after its flock starts over, so two processes never
// both hold it.
class DirLock {
 public:
  static StatusOr<DirLock> Acquire(const std::string& dir,
                                   const std::string& name);

 private:
  FileLock lock_;  // util/file_lock.h: the lock and its removal
};

// Scope of one run: installs SIGINT and SIGTERM handlers that only record
// the signal (the measuring loops poll Interrupted() and return kAborted;
// blocking waits on children poll it too), and removes the files registered
// with RemoveOnExit when it goes, on every return path, before it releases
// the locks it adopted (so no run that waited for the lock sees our files
// go). The handlers before it are restored on destruction. One at a time per
// process; not thread-safe (the commands are single-threaded drivers).
class RunGuard {
 public:
  RunGuard();
  ~RunGuard();
  RunGuard(const RunGuard&) = delete;
  RunGuard& operator=(const RunGuard&) = delete;

  // Register before creating the file, so that no exit path misses it.
  void RemoveOnExit(std::string path);
  // A directory the run creates, removed with everything under it.
  void RemoveTreeOnExit(std::string dir);
  // Forgets `path` (the user asked to keep it).
  void Keep(const std::string& path);
  // Holds `lock` until after the files are removed.
  void AdoptLock(DirLock lock);

 private:
  std::vector<std::string> files_;
  std::vector<std::string> trees_;
  std::vector<DirLock> locks_;
};

// The signal that interrupted the run, 0 when none.
int InterruptSignal();

// kAborted ("interrupted by SIGINT") once a signal arrived, else OK.
Status CheckInterrupted();

// ---- Child processes (no shell, ever)
// -----------------------------------------

// The full path of executable `name` on $PATH (or `name` itself when it has
// a '/' and is executable); nullopt when none.
std::optional<std::string> FindOnPath(std::string_view name);

struct ChildResult {
  int exit_code = -1;  // -1 when the child died of a signal
  std::string out;     // its stdout
};

// Runs argv (argv[0] searched on $PATH) with an argument vector, stdin and
// stderr on /dev/null and stdout captured through a pipe, and reaps it. The
// child inherits this process's environment, with each "NAME=VALUE" of `env`
// set (replacing NAME's inherited value); an entry without a name and '=' is
// kInvalidArgument. When a signal interrupts the run meanwhile, the child is
// killed and reaped and the result is kAborted.
StatusOr<ChildResult> RunChild(const std::vector<std::string>& argv,
                               const std::vector<std::string>& env = {});

// ---- Up-front checks
// ---------------------------------------------------------

// --json FILE, checked before any work and written only at the end: Prepare
// refuses a directory, a path in /proc or /sys, a missing directory, and
// creates a hidden temporary file beside `path` (so that writability is
// known now). Commit writes the document there and renames it over `path`;
// a run that ends without Commit leaves nothing behind.
class JsonOutput {
 public:
  // kInvalidArgument when `path` cannot be a JSON file; other codes from
  // the OS.
  static StatusOr<JsonOutput> Prepare(std::string_view option,
                                      const std::string& path);
  JsonOutput() = default;
  JsonOutput(JsonOutput&& other) noexcept;
  JsonOutput& operator=(JsonOutput&& other) noexcept;
  ~JsonOutput();

  bool active() const { return fd_.valid(); }
  const std::string& path() const { return path_; }
  Status Commit(const nlohmann::json& j);

 private:
  std::string path_;
  std::string temp_;
  UniqueFd fd_;
};

// Bytes free to an unprivileged user on the filesystem holding `path`.
StatusOr<uint64_t> FreeBytes(const std::string& path);

// MemAvailable of /proc/meminfo, in bytes; nullopt when unknown.
std::optional<uint64_t> MemAvailableBytes();

// kOutOfMemory naming `what` when `bytes` exceeds MemAvailable.
Status CheckMemory(std::string_view what, uint64_t bytes);

// CPUs this process may run on (its affinity mask), at least 1.
int UsableCpus();

// a * b, or nullopt on 64-bit overflow.
std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b);

// ---- Reporting
// ---------------------------------------------------------------

// Facts about this machine for the JSON: host name, kernel, CPU model and
// count, memory, strata version and git revision.
nlohmann::json MachineInfo();

// The filesystem type holding `path` ("ext4", "xfs", "tmpfs", ...), and the
// block device under it when there is one.
nlohmann::json FilesystemInfo(const std::string& path);

// An aligned, right-justified text table for stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void AddRow(std::vector<std::string> row);
  // Whether any row was added under the header.
  bool HasRows() const { return rows_.size() > 1; }
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

}  // namespace strata::bench

#endif  // STRATA_BENCH_BENCH_H_
