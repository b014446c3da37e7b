// strata-bench as a user meets it: the built binary run as a child process
// with an argument vector (no shell), in a fresh scratch directory, with bad
// and hostile input. Each case checks the exit status (docs/bench.md: 0 ok,
// 1 failure at run time, 2 bad usage, 128 + signal when interrupted), the
// message on stderr, and that the directory holds nothing the run created.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "strata/cpu_adam.h"
#include "tests/util/scratch_dir.h"

#ifndef STRATA_BENCH_PATH
#error "STRATA_BENCH_PATH must name the strata-bench binary"
#endif

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using strata::kCpuAdafactorFusedRowCols;
using strata::kCpuBlock8Elems;
using strata::testing::ScratchDir;

// What is in `dir` (names only).
std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

// Whether a file named `name` exists anywhere under `dir`.
bool FoundUnder(const std::string& dir, const std::string& name) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().filename() == name) return true;
  }
  return false;
}

struct Outcome {
  int code = -1;  // exit status, or 128 + signal
  std::string out;
  std::string err;
};

// A started strata-bench: its stdout and stderr go to files in `logs`.
class Bench {
 public:
  // Runs in `cwd` with `env` added to the environment. When `prepare` is
  // given, the forked child runs it first (before exec); a non-zero return
  // exits the child with that status.
  Bench(const std::vector<std::string>& args, const std::string& cwd,
        const std::vector<std::string>& env = {},
        int (*prepare)(const std::string&) = nullptr,
        const std::string& prepare_arg = "") {
    static int counter = 0;
    const std::string tag =
        std::to_string(::getpid()) + "-" + std::to_string(counter++);
    out_path_ =
        (fs::temp_directory_path() / ("strata-cli-out-" + tag)).string();
    err_path_ =
        (fs::temp_directory_path() / ("strata-cli-err-" + tag)).string();
    std::vector<std::string> argv = {STRATA_BENCH_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    std::vector<std::string> envs;
    for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
    envs.insert(envs.end(), env.begin(), env.end());
    std::vector<char*> cenv;
    for (auto& e : envs) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);  // its own group: signals reach only it
      if (prepare != nullptr) {
        if (int rc = prepare(prepare_arg); rc != 0) ::_exit(rc);
      }
      const int o =
          ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int e =
          ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (o < 0 || e < 0 || ::chdir(cwd.c_str()) != 0) ::_exit(120);
      ::dup2(o, 1);
      ::dup2(e, 2);
      ::execve(cargv[0], cargv.data(), cenv.data());
      ::_exit(127);
    }
  }
  ~Bench() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::unlink(out_path_.c_str());
    ::unlink(err_path_.c_str());
  }

  pid_t pid() const { return pid_; }

  // Whether it has exited (reaps it then).
  bool Done() {
    if (pid_ <= 0) return true;
    const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) pid_ = -1;
    return pid_ <= 0;
  }

  Outcome Wait() {
    if (pid_ > 0) {
      ::waitpid(pid_, &status_, 0);
      pid_ = -1;
    }
    Outcome o;
    o.code =
        WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
    std::ifstream out(out_path_), err(err_path_);
    o.out.assign(std::istreambuf_iterator<char>(out), {});
    o.err.assign(std::istreambuf_iterator<char>(err), {});
    return o;
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
  std::string out_path_, err_path_;
};

Outcome RunBench(const std::vector<std::string>& args, const std::string& cwd,
                 const std::vector<std::string>& env = {}) {
  Bench b(args, cwd, env);
  return b.Wait();
}

// Waits until `pred` holds or `seconds` pass.
template <class Pred>
bool WaitFor(Pred pred, double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

// One live process of /proc: its pid, name, state and parent, and its
// command line (NULs between the arguments).
struct Proc {
  pid_t pid = 0;
  std::string comm;
  char state = 0;
  pid_t ppid = 0;
  std::string cmdline;
};

// The contents of a file of /proc/<pid>, or "" when the process went away
// before or while it was read: the read then fails with ESRCH, which a
// std::ifstream would turn into an exception in the middle of a test.
std::string ReadProcFile(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = ::read(fd, buf, sizeof buf)) != 0) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      out.clear();
      break;
    }
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

std::vector<Proc> Processes() {
  std::vector<Proc> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string s = ReadProcFile(e.path() / "stat");
    const size_t open = s.find('('), close = s.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    Proc p;
    p.pid = std::stoi(name);
    p.comm = s.substr(open + 1, close - open - 1);
    int ppid = 0;
    if (std::sscanf(s.c_str() + close + 2, "%c %d", &p.state, &ppid) != 2) {
      continue;
    }
    p.ppid = ppid;
    p.cmdline = ReadProcFile(e.path() / "cmdline");
    out.push_back(std::move(p));
  }
  return out;
}

// Processes other than this test, zombies aside, whose command line
// mentions `needle`.
// Each as "pid (comm) state, parent ppid".
std::vector<std::string> ProcessesMentioning(const std::string& needle) {
  std::vector<std::string> out;
  for (const Proc& p : Processes()) {
    if (p.pid != ::getpid() && p.state != 'Z' &&
        p.cmdline.find(needle) != std::string::npos) {
      out.push_back(std::to_string(p.pid) + " (" + p.comm + ") " + p.state +
                    ", parent " + std::to_string(p.ppid));
    }
  }
  return out;
}

// A listing for a failure message: the items between braces.
template <class Items>
std::string Listing(const Items& items) {
  std::string s = "{";
  for (const auto& i : items) s += (s.size() > 1 ? ", " : "") + i;
  return s + "}";
}

// Whether `parent` has a child named `comm`.
bool HasChildNamed(pid_t parent, const std::string& comm) {
  for (const Proc& p : Processes()) {
    if (p.ppid == parent && p.comm == comm) return true;
  }
  return false;
}

bool HaveFio() {
  const char* path = std::getenv("PATH");
  std::string rest = path ? path : "";
  size_t start = 0;
  while (start <= rest.size()) {
    size_t colon = rest.find(':', start);
    if (colon == std::string::npos) colon = rest.size();
    const std::string f = rest.substr(start, colon - start) + "/fio";
    if (::access(f.c_str(), X_OK) == 0) return true;
    start = colon + 1;
  }
  return false;
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The result rows of a `strata-bench adam` JSON file that carry a bound:
// every row but grad_stats's.
std::vector<nlohmann::json> BoundRows(const std::string& path) {
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  std::vector<nlohmann::json> rows;
  for (const auto& row : j["results"]) {
    if (row["optimizer"] != "grad_stats") rows.push_back(row);
  }
  return rows;
}

// A small, fast io run in `dir` (no fio unless asked).
std::vector<std::string> SmallIo(const std::string& dir, bool fio = false) {
  std::vector<std::string> a = {
      "io",   "--dir",         dir,  "--size",   "1M",    "--block-size",
      "64K",  "--queue-depth", "2",  "--engine", "psync", "--rw",
      "read", "--pattern",     "seq"};
  if (!fio) a.push_back("--no-fio");
  return a;
}

const std::vector<std::string> kSmallAdam = {
    "adam", "--params", "64K", "--threads",  "1",     "--torch",
    "off",  "--reps",   "1",   "--variants", "scalar"};

// A small, fast tiers run in `dir`.
std::vector<std::string> SmallTiers(const std::string& dir) {
  return {"tiers", "--dir",         dir, "--size",   "8M",    "--reps",
          "2",     "--queue-depth", "4", "--engine", "psync", "--device",
          "host"};
}

const std::vector<std::string> kSmallCopy = {
    "copy",   "--device",   "host", "--sizes",      "4K,64K", "--memory",
    "pinned", "--min-time", "0.01", "--directions", "h2d"};

// One rank (no mpirun), every collective, two sizes.
const std::vector<std::string> kSmallComm = {"comm",    "--backend", "single",
                                             "--sizes", "4K,64K",    "--iters",
                                             "2",       "--warmup",  "1"};

std::vector<std::string> With(std::vector<std::string> base,
                              const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// ---- Bad usage: exit 2, the option named, nothing created ------------------

struct UsageCase {
  std::vector<std::string> args;
  std::string message;  // a part of stderr
};

void ExpectUsageErrors(const std::vector<UsageCase>& cases) {
  for (const UsageCase& c : cases) {
    ScratchDir d;
    std::string line;
    for (const auto& a : c.args) line += "'" + a + "' ";
    const Outcome o = RunBench(c.args, d.path());
    EXPECT_EQ(o.code, 2) << line << "\n" << o.err;
    EXPECT_TRUE(Has(o.err, c.message))
        << line << "\nwant: " << c.message << "\ngot: " << o.err;
    EXPECT_TRUE(Entries(d.path()).empty()) << line;
    EXPECT_FALSE(Has(o.out, "GB/s")) << line << ": ran anyway";
  }
}

TEST(BenchCliTest, SizesTooLargeFor64BitsAreUsageErrors) {
  const std::string big = "99999999999999999999999";
  ExpectUsageErrors({
      {{"io", "--size", big}, "--size"},
      {{"io", "--size", big}, "64 bits"},
      {{"io", "--block-size", big}, "--block-size"},
      {{"io", "--block-size", "1M," + big}, "64 bits"},
      {{"io", "--queue-depth", big}, "--queue-depth"},
      {{"adam", "--params", big}, "--params"},
      {{"copy", "--sizes", big}, "--sizes"},
      {{"copy", "--sizes", "4K," + big}, "64 bits"},
      {{"io", "--size", "16777216T"}, "64 bits"},
      {{"io", "--size", "99999999999T"}, "--size"},
      {{"adam", "--params", "8388608T"}, "--params"},
      {{"adam", "--params", "16777216T"}, "64 bits"},
      {{"copy", "--sizes", "8388608T"}, "--sizes"},
      {{"step", "--params", big}, "--params"},
      {{"step", "--params", "0"}, "--params"},
      {{"step", "--queue-depth", "0"}, "--queue-depth"},
      {{"step", "--block-size", "5000"}, "--block-size"},
      {{"step", "--cases", ""}, "--cases"},
      {{"step", "--cases", "gpu"}, "--cases"},
      {{"step", "--moments", "fp16"}, "--moments"},
      {{"step", "--optimizer", "lamb"}, "--optimizer"},
      {{"step", "--grads", "device"}, "--grads"},
      {{"step", "--optimizer", "adamw,adafactor", "--moments", "fp32,int8"},
       "--moments int8 with --optimizer adafactor"},
      {{"step", "--engine", "bogus"}, "--engine"},
      {{"step", "--threads", "-1"}, "--threads"},
      {{"step", "--begin-step", "yes"}, "--begin-step"},
      {{"checkpoint", "--params", "0"}, "--params"},
      {{"checkpoint", "--params", big}, "--params"},
      {{"checkpoint", "--reps", "0"}, "--reps"},
      {{"checkpoint", "--queue-depth", "0"}, "--queue-depth"},
      {{"checkpoint", "--engine", "bogus"}, "--engine"},
      {{"tiers", "--size", big}, "--size"},
      {{"tiers", "--size", big}, "64 bits"},
      {{"tiers", "--budget", big}, "--budget"},
      {{"tiers", "--block-size", big}, "--block-size"},
      {{"io", "--block-size", "17179869184G"}, "64 bits"},
  });
}

TEST(BenchCliTest, BadNumbersAreUsageErrors) {
  ExpectUsageErrors({
      {{"adam", "--threads", "-3"}, "--threads: -3 is out of range 0..4096"},
      {{"adam", "--threads", "abc"}, "--threads: 'abc' is not a whole number"},
      {{"adam", "--threads", "99999999999"}, "--threads"},
      {{"adam", "--threads", "99999999999999999999999"}, "--threads"},
      {{"adam", "--threads", "4096"}, "CPUs this process may use"},
      {{"adam", "--threads", "1,1.5"}, "--threads"},
      {{"adam", "--reps", "0"}, "--reps: 0 is out of range 1..1000"},
      {{"adam", "--reps", "x"}, "--reps"},
      {{"adam", "--scale-parameter", "yes"},
       "--scale-parameter: 'yes' is not one of on, off"},
      {{"adam", "--carry-param-sq", "1"},
       "--carry-param-sq: '1' is not one of on, off"},
      {{"adam", "--block8-sweeps", "3"},
       "--block8-sweeps: '3' is not one of auto, 1, 2"},
      {{"adam", "--block8-sweeps", "0"}, "--block8-sweeps"},
      {{"io", "--queue-depth", "0"},
       "--queue-depth: 0 is out of range 1..1024"},
      {{"io", "--queue-depth", "1025"}, "--queue-depth"},
      {{"io", "--queue-depth", "-1"}, "--queue-depth"},
      {{"copy", "--warmup", "-1"}, "--warmup"},
      {{"copy", "--min-time", "nan"}, "--min-time"},
      {{"copy", "--min-time", "inf"}, "--min-time"},
      {{"copy", "--min-time", "-1"}, "--min-time"},
      {{"copy", "--min-time", "0"}, "--min-time"},
      {{"copy", "--min-time", "abc"}, "--min-time"},
      {{"copy", "--link-gbps", "-1"}, "--link-gbps"},
      {{"copy", "--link-gbps", "0"}, "--link-gbps"},
      {{"copy", "--link-gbps", "nan"}, "--link-gbps"},
      {{"copy", "--pageable-gbps", "inf"}, "--pageable-gbps"},
      {{"copy", "--latency-us", "-1"}, "--latency-us"},
      {{"copy", "--sizes", "0"}, "--sizes: 0 B is out of range"},
      {{"copy", "--sizes", "4K,0"}, "--sizes"},
  });
}

TEST(BenchCliTest, TiersBadValuesNameTheirOption) {
  ExpectUsageErrors({
      {{"tiers", "--size", "0"}, "--size: 0 B is out of range"},
      {{"tiers", "--size", "128K"}, "--size: 128 KiB is out of range"},
      {{"tiers", "--size", "1000000"},
       "--size: 1000000 bytes is not a multiple of 4 KiB"},
      {{"tiers", "--size", "abc"}, "--size"},
      {{"tiers", "--dir", ""}, "--dir: empty path"},
      {{"tiers", "--device", "tpu"}, "--device: 'tpu'"},
      {{"tiers", "--engine", "floppy"}, "--engine: 'floppy'"},
      {{"tiers", "--engine", "memory"}, "--engine"},
      {{"tiers", "--queue-depth", "0"},
       "--queue-depth: 0 is out of range 1..1024"},
      {{"tiers", "--queue-depth", "x"}, "--queue-depth"},
      {{"tiers", "--block-size", "32K"},
       "--block-size: 32 KiB is out of range"},
      {{"tiers", "--block-size", "100000"},
       "--block-size: 100000 bytes is not a multiple of 4 KiB"},
      {{"tiers", "--budget", "1K"}, "--budget: 1 KiB is out of range"},
      {{"tiers", "--size", "1G", "--budget", "1G"},
       "--budget: 1 GiB is out of range"},
      {{"tiers", "--budget", "lots"}, "--budget"},
      {{"tiers", "--reps", "0"}, "--reps: 0 is out of range 1..100"},
      {{"tiers", "--reps", "101"}, "--reps"},
      {{"tiers", "--bogus"}, "bogus"},
  });
}

TEST(BenchCliTest, CommBadValuesNameTheirOption) {
  ExpectUsageErrors({
      {{"comm", "--backend", "tcp"}, "--backend: 'tcp'"},
      {{"comm", "--backend", ""}, "--backend"},
      {{"comm", "--ops", "broadcast"}, "--ops: 'broadcast' is not one of"},
      {{"comm", "--ops", "all-reduce,bogus"}, "--ops"},
      {{"comm", "--ops", ","}, "--ops: empty list"},
      {{"comm", "--sizes", ""}, "--sizes: empty list"},
      {{"comm", "--sizes", "0"}, "--sizes: 0 B is out of range"},
      {{"comm", "--sizes", "512"}, "--sizes: 512 B is out of range"},
      {{"comm", "--sizes", "17G"}, "--sizes: 17 GiB is out of range"},
      {{"comm", "--sizes", "99999999999999999999999"}, "64 bits"},
      {{"comm", "--sizes", "4K,lots"}, "--sizes"},
      {{"comm", "--sizes", "1025"},
       "--sizes: 1025 bytes is not a multiple of 4 bytes"},
      {{"comm", "--sizes", "4K,1026"}, "float32"},
      {{"comm", "--sizes", "1027", "--type", "bfloat16"},
       "--sizes: 1027 bytes is not a multiple of 2 bytes"},
      {{"comm", "--type", "float16"}, "--type: 'float16'"},
      {{"comm", "--type", "int8"}, "--type"},
      {{"comm", "--iters", "0"}, "--iters: 0 is out of range 1..100000"},
      {{"comm", "--iters", "100001"}, "--iters"},
      {{"comm", "--iters", "x"}, "--iters"},
      {{"comm", "--warmup", "-1"}, "--warmup: -1 is out of range 0..1000"},
      {{"comm", "--warmup", "1001"}, "--warmup"},
      {{"comm", "--timeout", "0"}, "--timeout"},
      {{"comm", "--timeout", "-1"}, "--timeout"},
      {{"comm", "--timeout", "nan"}, "--timeout"},
      {{"comm", "--timeout", "inf"}, "--timeout"},
      {{"comm", "--timeout", "1e7"}, "--timeout"},
      {{"comm", "--json", "/proc/strata-x.json"}, "--json"},
      {{"comm", "--bogus"}, "bogus"},
      {{"comm", "--ops", "stage3-fetch,bogus"}, "--ops: 'bogus'"},
      {{"comm", "--comm-memory", "gpu"}, "--comm-memory: 'gpu'"},
      {{"comm", "--backend", "nccl", "--ops", "stage3-fetch"},
       "--ops: stage3-fetch runs the engine"},
  });
}

TEST(BenchCliTest, EmptyListsAreUsageErrors) {
  ExpectUsageErrors({
      {{"io", "--rw", ""}, "--rw: empty list"},
      {{"io", "--rw", ","}, "--rw: empty list"},
      {{"io", "--pattern", ","}, "--pattern: empty list"},
      {{"io", "--block-size", ""}, "--block-size: empty list"},
      {{"io", "--queue-depth", ","}, "--queue-depth: empty list"},
      {{"io", "--engine", ","}, "--engine: empty list"},
      {{"adam", "--moments", ""}, "--moments: empty list"},
      {{"adam", "--threads", ","}, "--threads: empty list"},
      {{"adam", "--variants", ","}, "--variants: empty list"},
      {{"copy", "--sizes", ""}, "--sizes: empty list"},
      {{"copy", "--directions", ""}, "--directions: empty list"},
      {{"copy", "--memory", ","}, "--memory: empty list"},
  });
}

TEST(BenchCliTest, BadChoicesAndUnknownOptionsAreUsageErrors) {
  ExpectUsageErrors({
      {{"io", "--bogus"}, "bogus"},
      {{"adam", "--bogus", "1"}, "bogus"},
      {{"copy", "--bogus"}, "bogus"},
      {{"io", "--size"}, "--size"},
      {{"bogus"}, "unknown command"},
      {{"io", "--rw", "read,sideways"}, "--rw: 'sideways' is not one of"},
      {{"io", "--engine", "floppy"}, "--engine: 'floppy'"},
      {{"io", "--engine", "auto"}, "--engine: 'auto'"},
      {{"adam", "--optimizer", "sgd"}, "--optimizer"},
      {{"adam", "--moments", "fp16"}, "--moments"},
      {{"adam", "--working", "fp32"}, "--working"},
      {{"adam", "--torch", "maybe"}, "--torch"},
      {{"copy", "--device", "tpu"}, "--device"},
  });
}

TEST(BenchCliTest, HelpExitsZero) {
  ScratchDir d;
  for (const char* cmd :
       {"io", "adam", "copy", "step", "comm", "tiers", "checkpoint"}) {
    const Outcome o = RunBench({cmd, "--help"}, d.path());
    EXPECT_EQ(o.code, 0) << cmd;
    EXPECT_TRUE(Has(o.out, "--json")) << cmd;
  }
  EXPECT_EQ(RunBench({"--help"}, d.path()).code, 0);
  EXPECT_EQ(RunBench({}, d.path()).code, 2);
  EXPECT_TRUE(Entries(d.path()).empty());
}

TEST(BenchCliTest, IoSizeProblemsNameSize) {
  ExpectUsageErrors({
      {{"io", "--size", "0"}, "--size: 0 B is out of range"},
      {{"io", "--size", "5000"},
       "--size: 5000 bytes is not a multiple of 4 KiB"},
      {{"io", "--size", "1M", "--block-size", "768K"},
       "--size: 1 MiB is not a whole number of blocks of 768 KiB"},
      {{"io", "--size", "1M", "--block-size", "2M"}, "--size"},
      {{"io", "--block-size", "5000"}, "--block-size"},
  });
}

TEST(BenchCliTest, DsConfigWithoutSequentialRowsIsRefusedUpFront) {
  ExpectUsageErrors({
      {{"io", "--pattern", "rand", "--emit-ds-config"}, "--emit-ds-config"},
      {{"io", "--rw", "read", "--emit-ds-config"}, "--emit-ds-config"},
  });
}

TEST(BenchCliTest, JsonPathsThatCannotWorkAreRefusedBeforeWork) {
  ScratchDir d;
  const std::string sub = d.path() + "/sub";
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  const std::vector<std::pair<std::string, std::string>> paths = {
      {sub, "is a directory"},
      {"/proc/strata-x.json", "/proc"},
      {d.path() + "/missing/x.json", "does not exist"}};
  for (const auto& [path, message] : paths) {
    for (const auto& base :
         {SmallIo(sub), kSmallAdam, kSmallCopy, SmallTiers(sub)}) {
      const Outcome o = RunBench(With(base, {"--json", path}), d.path());
      EXPECT_EQ(o.code, 2) << base[0] << " --json '" << path << "'\n" << o.err;
      EXPECT_TRUE(Has(o.err, "--json")) << o.err;
      EXPECT_TRUE(Has(o.err, message)) << o.err;
      EXPECT_FALSE(Has(o.out, "GB/s")) << "ran before refusing: " << o.out;
      EXPECT_TRUE(Entries(sub).empty()) << path;
      EXPECT_EQ(Entries(d.path()), std::set<std::string>{"sub"}) << path;
    }
  }
}

TEST(BenchCliTest, MissingDirIsAUsageError) {
  ScratchDir d;
  for (const auto& args :
       {SmallIo(d.path() + "/nope"), SmallTiers(d.path() + "/nope")}) {
    const Outcome o = RunBench(args, d.path());
    EXPECT_EQ(o.code, 2) << args[0] << "\n" << o.err;
    EXPECT_TRUE(Has(o.err, "--dir")) << o.err;
    EXPECT_TRUE(Entries(d.path()).empty());
  }
}

// ---- Happy paths: the JSON carries the command and its configuration -------

// stage3-fetch on one rank: a row per size beside its all-gather, the
// shapes in the configuration, and nothing left but the JSON.
TEST(BenchCliTest, CommStage3FetchReportsItsRatioAndShape) {
  ScratchDir d;
  const std::string json = d.path() + "/comm.json";
  const Outcome o = RunBench(
      {"comm", "--backend", "single", "--ops", "stage3-fetch", "--sizes",
       "4K,1M", "--iters", "2", "--warmup", "0", "--json", json},
      d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "stage3-fetch")) << o.out;
  EXPECT_TRUE(Has(o.out, "ratio")) << o.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_TRUE(j["config"].contains("stage3"));
  const auto& shapes = j["config"]["stage3"]["shapes"];
  ASSERT_EQ(shapes.size(), 2u);
  // 4 KiB is one tensor; 1 MiB is eight of 128 KiB, each its own unit.
  EXPECT_EQ(shapes[0].value("tensors", 0), 1);
  EXPECT_EQ(shapes[1].value("tensors", 0), 8);
  EXPECT_EQ(shapes[1].value("unit_bytes", 0), 128 << 10);
  EXPECT_EQ(shapes[1].value("gathered_bytes", 0), 1 << 20);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& r : j["results"]) {
    EXPECT_EQ(r.value("op", ""), "stage3-fetch");
    EXPECT_GT(r.value("ratio", 0.0), 0.0) << r.dump();
    EXPECT_GT(r.value("paired_ratio", 0.0), 0.0) << r.dump();
    EXPECT_EQ(r["fetch_seconds"].size(), 2u);
    EXPECT_EQ(r["allgather_seconds"].size(), 2u);
    EXPECT_EQ(r.value("pass_h2d_bytes", 0),
              r["shape"].value("gathered_bytes", 1));
    EXPECT_GE(r.value("checked_tensors", 0), 1);
  }
  EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"comm.json"}));
}

TEST(BenchCliTest, EveryJsonNamesItsCommandAndConfig) {
  ScratchDir d;
  struct Case {
    std::vector<std::string> args;
    std::string command;
    std::vector<std::string> config_keys;
  };
  const std::vector<Case> cases = {
      {SmallIo(d.path()),
       "io",
       {"dir", "file", "size", "engines", "block_sizes", "queue_depths", "rw",
        "patterns", "direct", "fio", "fio_requested", "fio_huge_pages", "thp",
        "keep_file", "emit_ds_config"}},
      {kSmallAdam,
       "adam",
       {"params", "threads", "variants", "moments", "optimizers", "grad_dtype",
        "working_dtype", "reps", "torch", "bound_isa"}},
      {kSmallCopy,
       "copy",
       {"device", "sizes", "directions", "memory", "min_time_s", "warmup",
        "link_gbps", "pageable_gbps", "latency_us"}},
      {{"step", "--params", "4M", "--dir", d.path(), "--reps", "1", "--threads",
        "1", "--engine", "psync", "--queue-depth", "4", "--moments",
        "fp32,int8"},
       "step",
       {"params", "cases", "moments", "optimizers", "grads", "sm3_momentum",
        "tensor_cols", "dir", "engine", "queue_depth", "block_size", "threads",
        "reps", "tensor_elems"}},
      {{"checkpoint", "--params", "2M", "--dir", d.path(), "--reps", "1",
        "--engine", "psync", "--queue-depth", "4"},
       "checkpoint",
       {"params", "dir", "engine", "engine_used", "queue_depth", "block_size",
        "reps", "tensor_elems", "saved_roles"}},
      {SmallTiers(d.path()),
       "tiers",
       {"size", "dir", "engine", "queue_depth", "block_size", "threads",
        "device", "budget", "reps", "tensor_bytes", "staging_buffer_bytes"}},
      {kSmallComm,
       "comm",
       {"backend", "ops", "sizes", "type", "iters", "warmup", "timeout_s"}}};
  for (const Case& c : cases) {
    const std::string json = d.path() + "/" + c.command + ".json";
    const Outcome o = RunBench(With(c.args, {"--json", json}), d.path());
    ASSERT_EQ(o.code, 0) << c.command << "\n" << o.err;
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << json;
    EXPECT_EQ(j.value("command", ""), c.command);
    EXPECT_FALSE(j.contains("tool"));
    ASSERT_TRUE(j.contains("config"));
    for (const auto& k : c.config_keys) {
      EXPECT_TRUE(j["config"].contains(k)) << c.command << " config." << k;
    }
    EXPECT_FALSE(j["results"].empty()) << c.command;
    if (c.command != "step") continue;
    // The sample the update rate came from: at least one parameter, at
    // most the step's.
    for (const auto& r : j["results"]) {
      EXPECT_GT(r.value("update_sample_params", uint64_t{0}), 0u) << r.dump();
      EXPECT_LE(r.value("update_sample_params", uint64_t{0}),
                r.value("params", uint64_t{0}))
          << r.dump();
      // A small step's sample of its own size fits beside its engine.
      EXPECT_EQ(r.value("update_sampled", ""), "beside_engine") << r.dump();
      EXPECT_EQ(r.value("update_sample_params", uint64_t{0}),
                r.value("params", uint64_t{0}))
          << r.dump();
    }
  }
  EXPECT_EQ(
      Entries(d.path()),
      (std::set<std::string>{"io.json", "adam.json", "copy.json", "step.json",
                             "checkpoint.json", "tiers.json", "comm.json"}));
}

// strata-bench step runs each optimizer over the cases: Adafactor and SM3
// (without momentum) keep the master alone per element, so the step moves
// 4 bytes a parameter each way where AdamW's fp32 moments move 12, and the
// NVMe case's reads say so.
TEST(BenchCliTest, StepRunsEachOptimizerWithItsStateBytes) {
  ScratchDir d;
  const std::string json = d.path() + "/step.json";
  const Outcome o =
      RunBench({"step", "--params", "4M", "--dir", d.path(), "--reps", "1",
                "--threads", "1", "--engine", "psync", "--queue-depth", "4",
                "--optimizer", "adamw,adafactor,sm3", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "adafactor")) << o.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["config"]["optimizers"],
            nlohmann::json({"adamw", "adafactor", "sm3"}));
  ASSERT_EQ(j["results"].size(), 6u);  // two cases each
  for (const auto& r : j["results"]) {
    const std::string opt = r.value("optimizer", "");
    const double want = opt == "adamw" ? 12.0 : 4.0;
    EXPECT_DOUBLE_EQ(r.value("state_bytes_per_param", 0.0), want) << r.dump();
    const uint64_t params = r.value("params", uint64_t{0});
    const auto& stats = r["engine_stats"];
    if (r.value("case", "") == "nvme") {
      // Every step (the warm-up ones too) read the state whole.
      const uint64_t read = stats.value("nvme_read_bytes", uint64_t{0});
      const uint64_t per_step = static_cast<uint64_t>(want) * params;
      EXPECT_GT(read, 0u) << r.dump();
      EXPECT_EQ(read % per_step, 0u) << r.dump();
    }
  }
  EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"step.json"}));
}

// With --grads nvme every case's step reads the gradients back from the
// drive (AdamW and SM3 once, Adafactor twice: its statistics, then the
// update) beside the nvme case's states, and its I/O bound counts them: the
// bytes the JSON says a step moves are the engine's own, step for step.
// With --begin-step on Adafactor's statistics pass runs as the gradients
// are added, and its step reads them once.
TEST(BenchCliTest, StepWithGradientsOnNvmeCountsTheirReads) {
  for (const std::string begin : {"off", "on"}) {
    SCOPED_TRACE("--begin-step " + begin);
    ScratchDir d;
    const std::string json = d.path() + "/step.json";
    const Outcome o =
        RunBench({"step",     "--params",    "4M",
                  "--dir",    d.path(),      "--reps",
                  "1",        "--threads",   "1",
                  "--engine", "psync",       "--queue-depth",
                  "4",        "--optimizer", "adamw,adafactor,sm3",
                  "--grads",  "nvme",        "--begin-step",
                  begin,      "--json",      json},
                 d.path());
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_TRUE(Has(o.out, "gradients on nvme")) << o.out;
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    EXPECT_EQ(j["config"].value("grads", ""), "nvme");
    EXPECT_EQ(j["config"].value("begin_step", false), begin == "on");
    // No case moves as many reads as writes: no even-split rate is taken.
    EXPECT_FALSE(j["limits"].contains("io_mixed_bytes_per_s")) << j["limits"];
    EXPECT_FALSE(Has(o.out, "as many reads as writes")) << o.out;
    ASSERT_EQ(j["results"].size(), 6u);
    for (const auto& r : j["results"]) {
      const std::string opt = r.value("optimizer", "");
      const bool nvme = r.value("case", "") == "nvme";
      const uint64_t params = r.value("params", uint64_t{0});
      const uint64_t state = (opt == "adamw" ? 12 : 4) * params;
      const bool two = opt == "adafactor" && begin == "off";
      const uint64_t grads = (two ? 2 : 1) * 4 * params;
      const uint64_t read = r.value("io_read_bytes", uint64_t{0});
      EXPECT_EQ(read, (nvme ? state : 0) + grads) << r.dump();
      EXPECT_EQ(r.value("io_write_bytes", uint64_t{1}), nvme ? state : 0)
          << r.dump();
      EXPECT_GT(r.value("io_s", 0.0), 0.0) << r.dump();
      EXPECT_GT(r.value("io_bytes_per_s", 0.0), 0.0) << r.dump();
      // Every step (the warm-up ones too) read exactly that, and with
      // --begin-step on Adafactor's one matrix passed during each step's
      // hand-over.
      const auto& stats = r["engine_stats"];
      const uint64_t engine_read = stats.value("nvme_read_bytes", uint64_t{0});
      EXPECT_GT(engine_read, 0u) << r.dump();
      EXPECT_EQ(engine_read % read, 0u) << r.dump();
      const uint64_t steps = stats.value("steps", uint64_t{0});
      EXPECT_GE(steps, 2u) << r.dump();
      EXPECT_EQ(stats.value("early_passes", uint64_t{9}),
                opt == "adafactor" && begin == "on" ? steps : 0u)
          << r.dump();
    }
    EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"step.json"}));
  }
}

// --begin-step on: the engine takes each tensor's gradient stats (and
// Adafactor's statistics) before each timed step, the warm-up steps' too,
// and nothing is updated early; the JSON says so.
TEST(BenchCliTest, StepBeginStepTakesTheStatisticsBeforeTheStep) {
  ScratchDir d;
  const std::string json = d.path() + "/step.json";
  const Outcome o =
      RunBench({"step", "--params", "4M", "--cases", "host", "--reps", "2",
                "--threads", "1", "--optimizer", "adamw,adafactor",
                "--begin-step", "on", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["config"].value("begin_step", false), true);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& r : j["results"]) {
    // One tensor of 4 Mi elements (1024 rows of 4096): a unit a step.
    const auto& stats = r["engine_stats"];
    const uint64_t steps = stats.value("steps", uint64_t{0});
    EXPECT_GE(steps, 2u) << r.dump();
    EXPECT_EQ(stats.value("early_statistics", uint64_t{0}), steps) << r.dump();
    EXPECT_EQ(stats.value("early_units", uint64_t{1}), 0u) << r.dump();
    EXPECT_GT(r.value("update_params_per_s", 0.0), 0.0) << r.dump();
    // The whole optimizer, as the section the engine config reads: AdamW's
    // lr and betas, Adafactor's relative step (its lr then null).
    const auto& opt = r["optimizer_config"];
    EXPECT_EQ(opt["type"], r["optimizer"]) << r.dump();
    if (r["optimizer"] == "adamw") {
      EXPECT_EQ(opt["params"]["lr"], 1e-4) << r.dump();
      EXPECT_EQ(opt["params"]["betas"], nlohmann::json::array({0.9, 0.999}));
    } else {
      EXPECT_TRUE(opt["params"]["lr"].is_null()) << r.dump();
      EXPECT_EQ(opt["params"]["relative_step"], true) << r.dump();
    }
  }
  EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"step.json"}));
}

// strata-bench step bounds each timed step by the faster of the rates
// sampled just before and just after it (the first step's "before" sampled
// ahead of it), so that a step is never timed against samples from one side
// of a swing in the machine's rates; the case's rate is the fastest sample.
TEST(BenchCliTest, StepBoundsEachStepByTheSamplesAroundIt) {
  ScratchDir d;
  const std::string json = d.path() + "/step.json";
  const int reps = 3;
  const Outcome o =
      RunBench({"step", "--params", "4M", "--dir", d.path(), "--reps",
                std::to_string(reps), "--threads", "1", "--engine", "psync",
                "--queue-depth", "4", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_EQ(j["results"].size(), 2u);  // nvme and host
  for (const auto& r : j["results"]) {
    const bool nvme = r.value("case", "") == "nvme";
    const auto& steps = r["reps"];
    const auto& samples = r["rate_samples"];
    ASSERT_EQ(steps.size(), static_cast<size_t>(reps)) << r.dump();
    ASSERT_EQ(samples.size(), static_cast<size_t>(reps + 1)) << r.dump();
    double fastest = 0;
    for (const auto& x : samples) {
      EXPECT_GT(x.value("update_params_per_s", 0.0), 0.0) << r.dump();
      EXPECT_EQ(x.contains("io_bytes_per_s"), nvme) << r.dump();
      fastest = std::max(fastest, x.value("update_params_per_s", 0.0));
    }
    EXPECT_DOUBLE_EQ(r.value("update_params_per_s", 0.0), fastest);
    std::vector<double> paired;
    for (int k = 0; k < reps; ++k) {
      const auto& before = samples[k];
      const auto& after = samples[k + 1];
      for (const char* rate : {"update_params_per_s", "io_bytes_per_s"}) {
        if (!before.contains(rate)) continue;
        EXPECT_DOUBLE_EQ(
            steps[k].value(rate, 0.0),
            std::max(before.value(rate, 0.0), after.value(rate, 0.0)))
            << rate << " of step " << k << ": " << r.dump();
      }
      paired.push_back(steps[k].value("bound_s", 0.0) /
                       steps[k].value("step_s", 1.0));
    }
    std::sort(paired.begin(), paired.end());
    EXPECT_DOUBLE_EQ(r.value("paired_efficiency", 0.0), paired[1]) << r.dump();
  }
}

// A git revision as the build records it: 7 to 40 hex digits, "-dirty"
// after them for a modified tree, or "unknown". (Not std::regex: GCC 12
// warns inside <regex> under the sanitizers, and warnings are errors.)
bool IsRevision(std::string rev) {
  if (rev == "unknown") return true;
  const std::string dirty = "-dirty";
  if (rev.ends_with(dirty)) rev.resize(rev.size() - dirty.size());
  return rev.size() >= 7 && rev.size() <= 40 &&
         rev.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// The /proc/diskstats name of the device holding `path`, as the kernel
// counts it; empty when it has no line there (tmpfs, overlay).
std::string DiskStatsName(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  std::ifstream in("/proc/diskstats");
  unsigned ma = 0, mi = 0;
  std::string name, rest;
  while (in >> ma >> mi >> name && std::getline(in, rest)) {
    if (ma == major(st.st_dev) && mi == minor(st.st_dev)) return name;
  }
  return "";
}

// The device's mean request size beside each side's figure: present where
// the test file's device has a /proc/diskstats line (and requests reached
// it), positive, and absent otherwise; never a reason to fail.
void ExpectDeviceRequestSizes(const std::string& dir, const Outcome& o,
                              const nlohmann::json& j) {
  const std::string device = DiskStatsName(dir);
  EXPECT_TRUE(Has(o.out, "dev KiB")) << o.out;
  EXPECT_TRUE(Has(o.out, "fio dev KiB")) << o.out;
  // Buffered I/O (a filesystem that refuses O_DIRECT) may be served from
  // the page cache with no request at all.
  const bool direct = !Has(o.err, "refuses O_DIRECT");
  if (device.empty()) {
    EXPECT_TRUE(Has(o.out, "request sizes not shown")) << o.out;
    EXPECT_FALSE(j["filesystem"].contains("diskstats")) << j["filesystem"];
  } else {
    EXPECT_TRUE(Has(o.out, "device: " + device + " (")) << o.out;
    EXPECT_EQ(j["filesystem"]["diskstats"].value("name", ""), device);
  }
  ASSERT_FALSE(j["results"].empty());
  for (const auto& r : j["results"]) {
    for (const char* k : {"device_request_kib", "fio_device_request_kib"}) {
      if (device.empty()) {
        EXPECT_FALSE(r.contains(k)) << k << " without a device: " << r;
        continue;
      }
      const bool side_ran =
          std::string(k) == "device_request_kib" || r.contains("fio_gbps");
      if (direct && side_ran) {
        EXPECT_TRUE(r.contains(k)) << k << ": " << r;
      }
      if (!r.contains(k)) continue;
      const double kib = r[k];
      EXPECT_GT(kib, 0) << k;
      EXPECT_TRUE(std::isfinite(kib)) << k;
    }
    if (!r.contains("fio_gbps")) {
      EXPECT_FALSE(r.contains("fio_device_request_kib")) << r;
    }
  }
}

TEST(BenchCliTest, IoReportsTheDevicesRequestSizeBesideEachSide) {
  ScratchDir d;
  const std::string json = d.path() + "/io.json";
  // Both directions: reads and writes are counted apart.
  std::vector<std::string> args = {
      "io",           "--dir", d.path(),        "--size",    "1M",
      "--block-size", "64K",   "--queue-depth", "2",         "--engine",
      "psync",        "--rw",  "read,write",    "--pattern", "seq",
      "--json",       json};
  if (!HaveFio()) args.push_back("--no-fio");
  const Outcome o = RunBench(args, d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["config"]["fio_huge_pages"], HaveFio());
  EXPECT_EQ(j["results"].size(), 2u);
  ExpectDeviceRequestSizes(d.path(), o, j);
  EXPECT_EQ(Entries(d.path()), std::set<std::string>{"io.json"});
}

// Run in the forked child before exec: a private mount namespace with a
// tmpfs over `dir` (no block device under it).
int RunOnTmpfs(const std::string& dir) {
  if (::unshare(CLONE_NEWNS) != 0) return 77;
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return 77;
  }
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=16m") != 0) return 77;
  return 0;
}

TEST(BenchCliTest, IoWithoutABlockDeviceRunsAndLeavesRequestSizesOut) {
  ScratchDir d;
  // The JSON goes outside the tmpfs, so that the test reads it afterwards.
  ScratchDir out;
  const std::string json = out.path() + "/io.json";
  Bench b(With(SmallIo(d.path(), HaveFio()), {"--json", json}), d.path(), {},
          RunOnTmpfs, d.path());
  const Outcome o = b.Wait();
  if (o.code == 77) GTEST_SKIP() << "no mount namespace here (needs root)";
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "request sizes not shown")) << o.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["filesystem"].value("filesystem", ""), "tmpfs");
  EXPECT_FALSE(j["filesystem"].contains("diskstats"));
  for (const auto& r : j["results"]) {
    EXPECT_FALSE(r.contains("device_request_kib")) << r;
    EXPECT_FALSE(r.contains("fio_device_request_kib")) << r;
    EXPECT_GT(r["gbps"].get<double>(), 0) << r;
  }
}

// Every row and key docs/bench.md promises, and an efficiency that is a
// ratio to a real reference (never a speed).
TEST(BenchCliTest, TiersJsonHasEveryRowAndItsEfficiency) {
  ScratchDir d;
  const std::string json = d.path() + "/t.json";
  const Outcome o =
      RunBench(With(SmallTiers(d.path()), {"--json", json}), d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "e2e_fetch")) << o.out;
  EXPECT_TRUE(Has(o.out, "efficiency")) << o.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j.value("command", ""), "tiers");
  for (const char* k : {"machine", "filesystem", "device", "io_engine",
                        "config", "results", "reps", "engine_stats"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  // The commit the binary was built from (taken at build time, marked
  // -dirty for a modified tree), or unknown outside a git checkout.
  const std::string rev = j["machine"].value("git_revision", "");
  EXPECT_TRUE(IsRevision(rev)) << rev;
  // Every repetition's passes, each one measured.
  ASSERT_EQ(j["reps"].size(), 2u) << j["reps"].dump();
  for (const auto& rep : j["reps"]) {
    for (const char* k : {"nvme_write_gbps", "nvme_read_gbps", "h2d_gbps",
                          "d2h_gbps", "e2e_fetch_gbps", "e2e_writeback_gbps"}) {
      EXPECT_GT(rep.value(k, 0.0), 0) << k << " " << rep.dump();
    }
  }
  EXPECT_EQ(j["config"]["size"], 8u << 20);
  EXPECT_EQ(j["config"]["device"], "host");
  EXPECT_EQ(j["config"]["reps"], 2);
  EXPECT_LT(j["config"]["budget"].get<uint64_t>(), 8u << 20);
  std::set<std::string> hops;
  for (const auto& r : j["results"]) {
    const std::string hop = r["hop"];
    hops.insert(hop);
    EXPECT_GT(r["bytes"].get<uint64_t>(), 0u) << hop;
    EXPECT_GT(r["seconds"].get<double>(), 0) << hop;
    EXPECT_GT(r["gbps"].get<double>(), 0) << hop;
    if (hop.rfind("e2e_", 0) != 0) continue;
    for (const char* k : {"slowest_hop", "slowest_hop_gbps", "efficiency",
                          "crosses", "paired_efficiency", "paired_ratios"}) {
      EXPECT_TRUE(r.contains(k)) << hop << "." << k;
    }
    // One ratio per repetition: its own pass over its own slowest hop, and
    // the paired figure is one of them (the median, nearest rank).
    const std::string rate =
        hop == "e2e_fetch" ? "e2e_fetch_gbps" : "e2e_writeback_gbps";
    const std::vector<std::string> crossed =
        hop == "e2e_fetch"
            ? std::vector<std::string>{"nvme_read_gbps", "h2d_gbps"}
            : std::vector<std::string>{"nvme_write_gbps", "d2h_gbps"};
    ASSERT_EQ(r["paired_ratios"].size(), j["reps"].size()) << r.dump();
    bool paired_is_one = false;
    for (size_t i = 0; i < j["reps"].size(); ++i) {
      const auto& rep = j["reps"][i];
      const double slowest = std::min(rep[crossed[0]].get<double>(),
                                      rep[crossed[1]].get<double>());
      const double ratio = r["paired_ratios"][i];
      EXPECT_NEAR(ratio, rep[rate].get<double>() / slowest, 1e-9 * ratio)
          << hop << " rep " << i;
      paired_is_one = paired_is_one || ratio == r["paired_efficiency"];
    }
    EXPECT_TRUE(paired_is_one) << r.dump();
    const std::vector<std::string> own =
        hop == "e2e_fetch"
            ? std::vector<std::string>{"nvme_read_bytes", "h2d_bytes",
                                       "fetch_hits",      "prefetch_hits",
                                       "cache_hits",      "stall_seconds"}
            : std::vector<std::string>{"nvme_write_bytes", "d2h_bytes"};
    for (const auto& k : own) EXPECT_TRUE(r.contains(k)) << hop << "." << k;
    const double eff = r["efficiency"];
    // Positive and finite; how close to 1 is a timing, the benchmark's
    // business on an idle machine, not a test's on a shared one.
    EXPECT_GT(eff, 0) << hop;
    EXPECT_TRUE(std::isfinite(eff)) << hop;
    if (hop == "e2e_fetch") {
      // Read from NVMe: at most one of the 8 tensors still on the device.
      EXPECT_GE(r["bytes"].get<uint64_t>(), 7u << 20) << r.dump();
      EXPECT_LE(r["cache_hits"].get<uint64_t>(), 1u) << r.dump();
    } else {
      // Every fp32 gradient byte written to NVMe.
      EXPECT_EQ(r["bytes"].get<uint64_t>(), 16u << 20) << r.dump();
    }
  }
  EXPECT_EQ(hops, (std::set<std::string>{"nvme_write", "nvme_read", "h2d",
                                         "d2h", "e2e_fetch", "e2e_writeback"}));
  EXPECT_EQ(Entries(d.path()), std::set<std::string>{"t.json"});
}

TEST(BenchCliTest, AdamThreadsZeroMeansAllCpusAndReportsWhatRan) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o = RunBench(
      {"adam", "--params", "64K", "--threads", "0", "--torch", "off", "--reps",
       "1", "--variants", "scalar", "--moments", "fp32", "--json", json},
      d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["threads"].get<int>(), CPU_COUNT(&set)) << row.dump();
  }
}

// Every bound kernel's figure is in each row; each pass has its bytes, its
// fastest kernel, that kernel's GB/s and fused_prefetch's distance
// (af_passes for Adafactor); the bound is every pass at its fastest kernel, so
// no single kernel is faster, and a one-pass row's bound is its fastest
// kernel's; with one repetition the paired ratio is the ratio. Each pass's
// own time, as the step measured it, stands beside its bound.
void CheckBoundRows(uint64_t n, uint64_t cols, size_t af_passes) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o =
      RunBench({"adam", "--params", std::to_string(n), "--threads", "1",
                "--torch", "off", "--reps", "1", "--variants", "scalar",
                "--moments", "fp32,int8", "--optimizer", "adamw,adafactor",
                "--cols", std::to_string(cols), "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  const std::vector<nlohmann::json> rows = BoundRows(json);
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    const size_t passes =
        row["optimizer"].get<std::string>() == "adafactor" ? af_passes : 1u;
    const double f = row["bound_fused_gbps"].get<double>();
    const double fp = row["bound_fused_prefetch_gbps"].get<double>();
    const double fp32 = row["bound_fused_prefetch_32_gbps"].get<double>();
    const double fs = row["bound_fused_step_gbps"].get<double>();
    const double fl = row["bound_fused_lines_gbps"].get<double>();
    const double st = row["bound_stream_gbps"].get<double>();
    const double best = std::max({f, fp, fp32, fs, fl, st});
    EXPECT_GT(std::min({f, fp, fp32, fs, fl, st}), 0.0);
    const double bound = row["bound_gbps"].get<double>();
    EXPECT_GE(bound, best * (1 - 1e-9));
    const auto& bytes = row["bound_pass_bytes_per_param"];
    const auto& kernels = row["bound_pass_kernel"];
    const auto& gbps = row["bound_pass_gbps"];
    const auto& ahead = row["bound_prefetch_elems"];
    const auto& compiled = row["bound_step_compiled"];
    ASSERT_TRUE(bytes.is_array() && kernels.is_array() && gbps.is_array() &&
                ahead.is_array() && compiled.is_array());
    ASSERT_EQ(compiled.size(), passes);
    EXPECT_EQ(row["bound_step_prefetch_elems"].get<uint64_t>(), 512u);
    ASSERT_EQ(bytes.size(), passes);
    ASSERT_EQ(kernels.size(), passes);
    ASSERT_EQ(gbps.size(), passes);
    ASSERT_EQ(ahead.size(), passes);
    // The passes add up to the row's bytes and the bound's seconds.
    double sum_bytes = 0, seconds = 0;
    for (size_t p = 0; p < passes; ++p) {
      sum_bytes += bytes[p].get<double>();
      ASSERT_GT(gbps[p].get<double>(), 0.0);
      seconds += n * bytes[p].get<double>() / 1e9 / gbps[p].get<double>();
      const std::string k = kernels[p].get<std::string>();
      EXPECT_TRUE(k == "fused" || k == "fused_prefetch" ||
                  k == "fused_prefetch_32" || k == "fused_step" ||
                  k == "fused_lines" || k == "stream")
          << k;
      // Every optimizer's pass has a fused_step compiled for its shape.
      EXPECT_TRUE(compiled[p].get<bool>()) << p;
      const uint64_t e = ahead[p].get<uint64_t>();
      EXPECT_TRUE(e >= 256 && e <= 4096 && e % 64 == 0) << e;
    }
    EXPECT_NEAR(sum_bytes, row["bound_bytes_per_param"].get<double>(), 1e-9);
    EXPECT_NEAR(seconds, row["bound_seconds"].get<double>(), seconds * 1e-9);
    // The step's own time of each pass: each the best over the repetitions,
    // so together no more than the best step; GB/s and the ratio from it.
    const auto& names = row["pass_names"];
    const auto& pass_s = row["pass_seconds"];
    const auto& pass_gbps = row["pass_gbps"];
    const auto& pass_ratio = row["pass_ratio_to_bound"];
    const auto& pass_paired = row["pass_paired_ratio_to_bound"];
    ASSERT_EQ(names.size(), passes);
    ASSERT_EQ(pass_paired.size(), passes);
    ASSERT_EQ(pass_s.size(), passes);
    ASSERT_EQ(pass_gbps.size(), passes);
    ASSERT_EQ(pass_ratio.size(), passes);
    double step_s = 0;
    for (size_t p = 0; p < passes; ++p) {
      const double ps = pass_s[p].get<double>();
      ASSERT_GT(ps, 0.0);
      step_s += ps;
      const double b = bytes[p].get<double>();
      EXPECT_NEAR(pass_gbps[p].get<double>(), n * b / 1e9 / ps,
                  1e-9 * pass_gbps[p].get<double>());
      const double bound_s = n * b / 1e9 / gbps[p].get<double>();
      EXPECT_NEAR(pass_ratio[p].get<double>(), bound_s / ps,
                  1e-9 * bound_s / ps);
      // One repetition: its own pass bound over its own pass.
      EXPECT_NEAR(pass_paired[p].get<double>(), bound_s / ps,
                  1e-9 * bound_s / ps);
    }
    EXPECT_LE(step_s, row["seconds"].get<double>());
    if (passes == 3) {
      EXPECT_EQ(names, nlohmann::json({"statistics", "update rms", "update"}));
    } else if (passes == 2) {
      EXPECT_EQ(names, nlohmann::json({"statistics", "update"}));
    } else {
      EXPECT_EQ(names, nlohmann::json({"step"}));
    }
    // No two of these rows move the same arrays: each bound is the row's
    // own, three samples of each kernel in its one repetition.
    EXPECT_EQ(row["bound_rows"],
              nlohmann::json::array({row["optimizer"].get<std::string>() + " " +
                                     row["moment_dtype"].get<std::string>()}));
    EXPECT_EQ(row["bound_samples"].get<int>(), 3);
    // One repetition: its own bound over its own step is the row's ratio.
    const double ratio = row["ratio_to_bound"].get<double>();
    EXPECT_NEAR(row["paired_ratio_to_bound"].get<double>(), ratio,
                ratio * 1e-9);
    const std::string kernel = row["bound_kernel"].get<std::string>();
    bool same = true;
    for (const auto& k : kernels) same = same && k == kernels[0];
    EXPECT_EQ(kernel, same ? kernels[0].get<std::string>() : "mixed");
    if (passes == 1) {
      EXPECT_NEAR(bound, best, best * 1e-9);
      EXPECT_EQ(kernel, best == f      ? "fused"
                        : best == fp   ? "fused_prefetch"
                        : best == fp32 ? "fused_prefetch_32"
                        : best == fs   ? "fused_step"
                        : best == fl   ? "fused_lines"
                                       : "stream");
    }
  }
  EXPECT_EQ(rows.size(), 3u);  // adamw fp32 and int8, adafactor
  // Adafactor's passes in their own table.
  EXPECT_TRUE(Has(o.out, "each pass of a multi-pass step")) << o.out;
  EXPECT_EQ(Has(o.out, "update rms"), af_passes == 3) << o.out;
}

TEST(BenchCliTest, AdamRowsCarryEveryBoundKernel) {
  // Adafactor's update RMS rides in its statistics pass on rows of up to
  // kCpuAdafactorFusedRowCols columns, and takes a pass of its own beyond.
  for (const auto& [n, cols, af_passes] :
       {std::tuple<uint64_t, uint64_t, size_t>{65536, 256, 2},
        {2 * (kCpuAdafactorFusedRowCols + 16), kCpuAdafactorFusedRowCols + 16,
         3}}) {
    SCOPED_TRACE("cols " + std::to_string(cols));
    CheckBoundRows(n, cols, af_passes);
  }
}

// Each row of the Adam family carries its in-cache rate: one thread over as
// many of the first elements as take 256 KiB of the row's arrays (whole
// 8-bit blocks, or 64 elements), and that rate times the row's threads as
// its arithmetic ceiling. Adafactor and SM3 rows have none.
TEST(BenchCliTest, AdamRowsCarryTheirInCacheRate) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o =
      RunBench({"adam", "--params", "64K", "--threads", "1,2", "--torch", "off",
                "--reps", "1", "--variants", "scalar", "--moments", "fp32,int8",
                "--optimizer", "adamw,sm3", "--cols", "256", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "cache Gp/s")) << o.out;
  const std::vector<nlohmann::json> rows = BoundRows(json);
  ASSERT_EQ(rows.size(), 6u);  // adamw fp32, int8; sm3 fp32; two counts
  std::set<int> threads;
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    threads.insert(row["threads"].get<int>());
    if (row["optimizer"] == "sm3") {
      EXPECT_TRUE(row["cache_sample_params"].is_null());
      EXPECT_TRUE(row["cache_params_per_s_per_thread"].is_null());
      EXPECT_TRUE(row["cache_ceiling_params_per_s"].is_null());
      continue;
    }
    const bool int8 = row["moment_dtype"] == "int8";
    const uint64_t unit = int8 ? kCpuBlock8Elems : 64;
    const auto fits = static_cast<uint64_t>(
        256.0 * 1024 / row["bound_bytes_per_param"].get<double>());
    const uint64_t sample = row["cache_sample_params"].get<uint64_t>();
    EXPECT_EQ(sample, fits / unit * unit);
    EXPECT_EQ(sample, int8 ? 14336u : 8704u);  // 18 and 30 bytes a param
    const double one = row["cache_params_per_s_per_thread"].get<double>();
    EXPECT_GT(one, 0.0);
    EXPECT_NEAR(row["cache_ceiling_params_per_s"].get<double>(),
                one * row["threads"].get<int>(), one * 1e-9);
  }
  EXPECT_EQ(threads, (std::set<int>{1, 2}));
}

// The in-cache sample steps arrays of its own (Note [The in-cache rate]).
// Over a view of the row's 8-bit states its scales fell on the row's codes;
// after twelve steps of the run's constant gradient those bytes read as
// scales near 3.4e38, the sample's weights became NaN, and Adafactor, next
// over the same weights, refused its step for their NaN sum of squares.
TEST(BenchCliTest, AdamInCacheSampleLeavesTheRowsArraysAlone) {
  ScratchDir d;
  const Outcome o =
      RunBench({"adam", "--params", "64K", "--threads", "1", "--torch", "off",
                "--reps", "11", "--variants", "scalar", "--moments", "int8",
                "--optimizer", "adamw,adafactor", "--cols", "256"},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_FALSE(Has(o.err, "param_sq")) << o.err;
  EXPECT_TRUE(Has(o.out, "adafactor")) << o.out;
}

// --block8-sweeps: the int8 rows say which form of the update each variant
// ran (auto: the variant's own, two on avx2, one elsewhere), the other rows
// null, and the config records the option as given. Every variant the CPU
// supports runs (the default --variants).
TEST(BenchCliTest, AdamInt8RowsSayTheirSweeps) {
  for (const std::string sweeps : {"auto", "1", "2"}) {
    SCOPED_TRACE(sweeps);
    ScratchDir d;
    const std::string json = d.path() + "/a.json";
    const Outcome o =
        RunBench({"adam", "--params", "8K", "--threads", "1", "--torch", "off",
                  "--reps", "1", "--moments", "fp32,int8", "--block8-sweeps",
                  sweeps, "--json", json},
                 d.path());
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_TRUE(Has(o.out, sweeps == "auto" ? "int8 in each variant's own"
                           : sweeps == "1"  ? "int8 in 1 sweep,"
                                            : "int8 in 2 sweeps"))
        << o.out;
    std::ifstream in(json);
    const nlohmann::json j = nlohmann::json::parse(in);
    if (sweeps == "auto") {
      EXPECT_EQ(j["config"]["block8_sweeps"], "auto");
    } else {
      EXPECT_EQ(j["config"]["block8_sweeps"], std::stoi(sweeps));
    }
    const std::vector<nlohmann::json> rows = BoundRows(json);
    ASSERT_EQ(rows.size(), 2 * j["config"]["variants"].size());
    for (const auto& row : rows) {
      SCOPED_TRACE(row.dump());
      if (row["moment_dtype"] != "int8") {
        EXPECT_TRUE(row["block8_sweeps"].is_null());
        continue;
      }
      const int own = row["variant"] == "avx2" ? 2 : 1;
      EXPECT_EQ(row["block8_sweeps"].get<int>(),
                sweeps == "auto" ? own : std::stoi(sweeps));
    }
  }
}

// Adam and AdamW with fp32 moments move the same arrays, and Adagrad other
// ones: the first two share one bound, the best of both rows' samples, and
// each row's ratio is that bound over its own best step; Adagrad keeps its
// own.
TEST(BenchCliTest, AdamRowsOverTheSameArraysShareTheirBound) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o =
      RunBench({"adam", "--params", "64K", "--threads", "1", "--torch", "off",
                "--reps", "2", "--variants", "scalar", "--moments", "fp32",
                "--optimizer", "adam,adamw,adagrad", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  const std::vector<nlohmann::json> rows = BoundRows(json);
  ASSERT_EQ(rows.size(), 3u);
  const nlohmann::json both = {"adam fp32", "adamw fp32"};
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    const bool adagrad = row["optimizer"] == "adagrad";
    EXPECT_EQ(row["bound_rows"],
              adagrad ? nlohmann::json({"adagrad fp32"}) : both);
    // Two repetitions, three samples each, of every row sharing it.
    EXPECT_EQ(row["bound_samples"].get<int>(), adagrad ? 6 : 12);
    const double bound_s = row["bound_seconds"].get<double>();
    const double ratio = row["ratio_to_bound"].get<double>();
    EXPECT_NEAR(ratio, bound_s / row["seconds"].get<double>(), ratio * 1e-9);
  }
  EXPECT_EQ(rows[0]["bound_seconds"], rows[1]["bound_seconds"]);
  EXPECT_EQ(rows[0]["bound_gbps"], rows[1]["bound_gbps"]);
  EXPECT_NE(rows[0]["bound_seconds"], rows[2]["bound_seconds"]);
}

// The best variant's rows set against that thread count's fp32-moment
// AdamW row: params/s, and the ceilings the bounds and the bytes put on that
// figure; without an fp32 AdamW row there is no comparison.
TEST(BenchCliTest, AdamComparesTheBestVariantWithFp32AdamW) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o =
      RunBench({"adam", "--params", "64K", "--threads", "1", "--torch", "off",
                "--reps", "1", "--moments", "fp32,int8", "--optimizer",
                "adamw,adafactor", "--cols", "256", "--json", json},
               d.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Has(o.out, "against fp32-moment AdamW")) << o.out;
  const std::vector<nlohmann::json> rows = BoundRows(json);
  const nlohmann::json* ref = nullptr;
  for (const auto& row : rows) {
    if (row.contains("speedup_vs_fp32_adamw") && row["optimizer"] == "adamw" &&
        row["moment_dtype"] == "fp32") {
      ref = &row;
    }
  }
  ASSERT_NE(ref, nullptr);
  size_t compared = 0;
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    if (row["variant"] != (*ref)["variant"]) {
      EXPECT_FALSE(row.contains("speedup_vs_fp32_adamw"));
      continue;
    }
    ++compared;
    const double speedup = row["params_per_s"].get<double>() /
                           (*ref)["params_per_s"].get<double>();
    const double by_bound = (*ref)["bound_seconds"].get<double>() /
                            row["bound_seconds"].get<double>();
    const double by_bytes = (*ref)["bytes_per_param"].get<double>() /
                            row["bytes_per_param"].get<double>();
    EXPECT_NEAR(row["speedup_vs_fp32_adamw"].get<double>(), speedup,
                speedup * 1e-9);
    EXPECT_NEAR(row["bound_speedup_vs_fp32_adamw"].get<double>(), by_bound,
                by_bound * 1e-9);
    EXPECT_NEAR(row["bytes_speedup_vs_fp32_adamw"].get<double>(), by_bytes,
                by_bytes * 1e-9);
    if (row["optimizer"] == "adamw" && row["moment_dtype"] == "int8") {
      EXPECT_NEAR(by_bytes, 30.0 / row["bytes_per_param"].get<double>(), 1e-9);
      EXPECT_GT(by_bytes, 1.6);  // 30 against about 18 bytes
    }
    if (row["optimizer"] != "adafactor") {
      EXPECT_FALSE(row.contains("update_pass_speedup_vs_fp32_adamw"));
      continue;
    }
    // Its update pass alone (what an engine's step pays once the
    // statistics ran during backward): 14 bytes a parameter (the fp32
    // gradient, the master read and written, the bf16 working copy).
    const double n = row["params"].get<double>();
    const double pass_s = row["pass_seconds"].back().get<double>();
    const double upd = n / pass_s / (*ref)["params_per_s"].get<double>();
    EXPECT_NEAR(row["update_pass_speedup_vs_fp32_adamw"].get<double>(), upd,
                upd * 1e-9);
    EXPECT_NEAR(row["update_pass_bytes_speedup_vs_fp32_adamw"].get<double>(),
                30.0 / 14.0, 1e-9);
    EXPECT_GT(row["update_pass_bound_speedup_vs_fp32_adamw"].get<double>(),
              by_bound);
  }
  EXPECT_EQ(compared, 3u);  // adamw fp32 and int8, adafactor
  EXPECT_TRUE(Has(o.out, "adafactor, update pass")) << o.out;

  const Outcome lion = RunBench(
      {"adam", "--params", "16K", "--threads", "1", "--torch", "off", "--reps",
       "1", "--moments", "fp32", "--optimizer", "lion", "--json", json},
      d.path());
  ASSERT_EQ(lion.code, 0) << lion.err;
  EXPECT_FALSE(Has(lion.out, "against fp32-moment AdamW")) << lion.out;
  for (const auto& row : BoundRows(json)) {
    EXPECT_FALSE(row.contains("speedup_vs_fp32_adamw")) << row.dump();
  }
}

// --scale-parameter off runs Adafactor without scale_parameter: its
// statistics pass no longer reads the weights (4 bytes a parameter less,
// with fp32 gradients), and the row's options and the run's configuration
// say so. With it on, --carry-param-sq on (the default) hands each step
// the sum of squares the last one returned, which spares that pass the
// weights too; off, the pass reads them.
TEST(BenchCliTest, AdamScaleParameterOffDropsTheWeightsFromStatistics) {
  ScratchDir d;
  struct Case {
    bool scale, carry;
    const char* header;
  };
  for (const Case& c :
       {Case{true, false, "adafactor scale_parameter on, param_sq summed"},
        Case{true, true, "adafactor scale_parameter on, param_sq carried"},
        Case{false, true, "adafactor scale_parameter off"}}) {
    SCOPED_TRACE(c.header);
    const std::string json = d.path() + "/sp.json";
    const Outcome o =
        RunBench(With(kSmallAdam, {"--optimizer", "adafactor", "--cols", "256",
                                   "--scale-parameter", c.scale ? "on" : "off",
                                   "--carry-param-sq", c.carry ? "on" : "off",
                                   "--json", json}),
                 d.path());
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_TRUE(Has(o.out, c.header)) << o.out;
    std::ifstream in(json);
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j["config"]["scale_parameter"].get<bool>(), c.scale);
    EXPECT_EQ(j["config"]["carry_param_sq"].get<bool>(), c.carry);
    const std::vector<nlohmann::json> rows = BoundRows(json);
    ASSERT_EQ(rows.size(), 1u);
    const nlohmann::json& row = rows[0];
    EXPECT_EQ(row["options"]["adafactor"]["scale_parameter"].get<bool>(),
              c.scale);
    // fp32 gradient, bf16 working copy: statistics 4 (+4 the weights when
    // they are summed), the update 4 + 4 + 4 + 2.
    const bool reads_weights = c.scale && !c.carry;
    EXPECT_EQ(row["bound_pass_bytes_per_param"],
              nlohmann::json({reads_weights ? 8.0 : 4.0, 14.0}));
    EXPECT_NEAR(row["bytes_per_param"].get<double>(),
                reads_weights ? 22.0 : 18.0, 0.1);
  }
}

// fused_step is compiled for the shape of every pass the optimizers make
// (bench/bound.h kBoundStepShapes); a pass without one would run the slower
// kernel that reads its shape at run time, and the bound would loosen.
TEST(BenchCliTest, AdamEveryPassHasAStepBoundCompiledForItsShape) {
  ScratchDir d;
  struct Case {
    const char* optimizers;
    const char* moments;
    const char* cols;
    const char* grad;
    const char* working;
  };
  const Case cases[] = {
      {"adam,adamw,adagrad,lion,adafactor,sm3", "fp32,bf16,int8", "256", "fp32",
       "bf16"},
      {"adam,adamw,adagrad,lion,adafactor,sm3", "fp32,bf16,int8", "256", "bf16",
       "none"},
      {"sm3", "fp32,bf16", "0", "fp16", "fp16"},  // SM3 over a vector
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.optimizers) + " grad " + c.grad + " working " +
                 c.working + " cols " + c.cols);
    const std::string json = d.path() + "/s.json";
    const Outcome o = RunBench(
        {"adam",    "--params",  "16K",     "--threads",   "1",
         "--torch", "off",       "--reps",  "1",           "--variants",
         "scalar",  "--moments", c.moments, "--optimizer", c.optimizers,
         "--cols",  c.cols,      "--grad",  c.grad,        "--working",
         c.working, "--json",    json},
        d.path());
    ASSERT_EQ(o.code, 0) << o.err;
    const std::vector<nlohmann::json> rows = BoundRows(json);
    for (const auto& row : rows) {
      for (const auto& compiled : row["bound_step_compiled"]) {
        EXPECT_TRUE(compiled.get<bool>()) << row.dump();
      }
    }
    EXPECT_GT(rows.size(), 1u);
  }
}

// ---- Hostile paths: no shell, ever -----------------------------------------

TEST(BenchCliTest, ShellMetacharactersInDirAreJustPaths) {
  ScratchDir d;
  const bool fio = HaveFio();
  for (const std::string name : {"a b", "q'uote\"s", "x;touch PWNED;y",
                                 "$(touch PWNED)", "`touch PWNED`", "c:olon"}) {
    const std::string sub = d.path() + "/" + name;
    ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0) << name;
    const Outcome o = RunBench(SmallIo(sub, fio), d.path());
    EXPECT_EQ(o.code, 0) << name << "\n" << o.err;
    if (fio) {
      EXPECT_TRUE(Has(o.out, "beside fio")) << name << "\n" << o.out;
      EXPECT_FALSE(Has(o.out, "fio not run")) << name;
    }
    EXPECT_TRUE(Entries(sub).empty()) << name;
  }
  EXPECT_FALSE(FoundUnder(d.path(), "PWNED"));
  EXPECT_FALSE(fs::exists("PWNED"));
}

// ---- Space and memory, checked up front
// --------------------------------------

TEST(BenchCliTest, SizeLargerThanFreeSpaceIsRefusedUpFront) {
  ScratchDir d;
  struct statvfs s {};
  ASSERT_EQ(::statvfs(d.path().c_str(), &s), 0);
  // More than the whole filesystem, not just its free space: tests running
  // beside this one free and take space, and once one freed more than a
  // margin over the free space between this statvfs and the bench's, the
  // bench began a fill of that size.
  const uint64_t fs_bytes = static_cast<uint64_t>(s.f_blocks) * s.f_frsize;
  const uint64_t quantum = uint64_t{4} << 20;
  const uint64_t size = (fs_bytes / quantum + 16) * quantum;
  const Outcome o = RunBench(
      {"io", "--dir", d.path(), "--size", std::to_string(size), "--no-fio"},
      d.path());
  EXPECT_EQ(o.code, 1) << o.err;
  EXPECT_TRUE(Has(o.err, "--size")) << o.err;
  EXPECT_TRUE(Has(o.err, "does not fit")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

// Run in the forked child before exec: a private mount namespace with a
// 2 MiB tmpfs over `dir`, so the bench sees a nearly full filesystem.
int RunOnTinyTmpfs(const std::string& dir) {
  if (::unshare(CLONE_NEWNS) != 0) return 77;
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return 77;
  }
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=2m") != 0) return 77;
  return 0;
}

TEST(BenchCliTest, FullTmpfsIsRefusedAndLeftEmpty) {
  ScratchDir d;
  Bench b({"io", "--dir", d.path(), "--size", "8M", "--block-size", "1M",
           "--no-fio"},
          d.path(), {}, RunOnTinyTmpfs, d.path());
  const Outcome o = b.Wait();
  if (o.code == 77) GTEST_SKIP() << "no mount namespace here (needs root)";
  EXPECT_EQ(o.code, 1) << o.err;
  EXPECT_TRUE(Has(o.err, "does not fit")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

TEST(BenchCliTest, MemoryNeedsAreCheckedBeforeAllocating) {
  ScratchDir d;
  const Outcome adam = RunBench(
      {"adam", "--params", "1T", "--threads", "1", "--torch", "off"}, d.path());
  EXPECT_EQ(adam.code, 1) << adam.err;
  EXPECT_TRUE(Has(adam.err, "MemAvailable")) << adam.err;
  const Outcome copy =
      RunBench({"copy", "--device", "host", "--sizes", "1T"}, d.path());
  EXPECT_EQ(copy.code, 1) << copy.err;
  EXPECT_TRUE(Has(copy.err, "MemAvailable")) << copy.err;
  const Outcome io =
      RunBench({"io", "--dir", d.path(), "--size", "1G", "--block-size", "1G",
                "--queue-depth", "1024", "--no-fio"},
               d.path());
  EXPECT_EQ(io.code, 1) << io.err;
  EXPECT_TRUE(Has(io.err, "MemAvailable")) << io.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

TEST(BenchCliTest, TiersSpaceAndMemoryAreCheckedBeforeWork) {
  ScratchDir d;
  struct statvfs s {};
  ASSERT_EQ(::statvfs(d.path().c_str(), &s), 0);
  const uint64_t free_bytes = static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
  // More than the whole filesystem, not the free space plus a margin: see
  // SizeLargerThanFreeSpaceIsRefusedUpFront.
  const uint64_t fs_bytes = static_cast<uint64_t>(s.f_blocks) * s.f_frsize;
  const uint64_t gib = uint64_t{1} << 30;
  const Outcome disk = RunBench({"tiers", "--dir", d.path(), "--size",
                                 std::to_string((fs_bytes / gib + 1) * gib)},
                                d.path());
  EXPECT_EQ(disk.code, 1) << disk.err;
  EXPECT_TRUE(Has(disk.err, "does not fit")) << disk.err;
  EXPECT_TRUE(Entries(d.path()).empty());
  // 6 bytes of RAM per byte of --size: a size whose swap files fit but
  // whose host arrays do not.
  uint64_t avail = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string key, unit;
    uint64_t kib = 0;
    while (in >> key >> kib >> unit) {
      if (key == "MemAvailable:") avail = kib * 1024;
    }
  }
  ASSERT_GT(avail, 0u);
  const uint64_t size = (avail / 6 / gib + 1) * gib;
  if (5 * size > free_bytes) GTEST_SKIP() << "not enough disk to reach RAM";
  const Outcome ram = RunBench(
      {"tiers", "--dir", d.path(), "--size", std::to_string(size)}, d.path());
  EXPECT_EQ(ram.code, 1) << ram.err;
  EXPECT_TRUE(Has(ram.err, "MemAvailable")) << ram.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

// ---- Signals: 128 + signal, nothing left, no child left ---------------------

void ExpectInterruptCleans(int sig, bool during_fio) {
  if (during_fio && !HaveFio()) GTEST_SKIP() << "fio is not installed";
  ScratchDir d;
  std::vector<std::string> args = {
      "io", "--dir",         d.path(), "--size",   "64M",  "--block-size",
      "1M", "--queue-depth", "4",      "--engine", "psync"};
  if (!during_fio) args.push_back("--no-fio");
  Bench b(args, d.path());
  const std::string data = d.path() + "/strata-bench-io.dat";
  // What the run said, for a failure before the signal.
  auto said = [&] {
    if (b.pid() > 0) ::kill(b.pid(), SIGKILL);
    const Outcome o = b.Wait();
    return "exit " + std::to_string(o.code) + ", stderr: " + o.err;
  };
  if (during_fio) {
    if (!WaitFor([&] { return HasChildNamed(b.pid(), "fio"); }, 30)) {
      FAIL() << "fio never started; " << said();
    }
  } else if (!WaitFor([&] { return fs::exists(data); }, 30)) {
    FAIL() << "the data file never appeared; " << said();
  }
  if (b.Done()) FAIL() << "finished before the signal; " << said();
  ASSERT_EQ(::kill(b.pid(), sig), 0);
  const Outcome o = b.Wait();
  EXPECT_EQ(o.code, 128 + sig) << o.err;
  EXPECT_TRUE(Has(o.err, "interrupted by SIG")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty())
      << "left behind: " << Listing(Entries(d.path())) << "; stderr: " << o.err;
  const std::vector<std::string> left = ProcessesMentioning(d.path());
  EXPECT_TRUE(left.empty())
      << "survived: " << Listing(left) << "; stderr: " << o.err;
}

// Interrupted while the engine and the hops hold swap files in their
// subdirectories of --dir (`settle_ms` after the engine's appeared: while it
// starts, or during the timed passes): all of it goes.
void ExpectTiersInterruptCleans(int sig, int settle_ms) {
  ScratchDir d;
  Bench b({"tiers", "--dir", d.path(), "--size", "32M", "--reps", "100",
           "--queue-depth", "4", "--engine", "psync", "--device", "host"},
          d.path());
  const std::string engine_dir = d.path() + "/strata-bench-tiers-engine";
  ASSERT_TRUE(WaitFor([&] { return !Entries(engine_dir).empty(); }, 60))
      << "the engine's swap space never appeared";
  std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
  ASSERT_FALSE(b.Done()) << "finished before the signal";
  ASSERT_EQ(::kill(b.pid(), sig), 0);
  const Outcome o = b.Wait();
  EXPECT_EQ(o.code, 128 + sig) << o.err;
  EXPECT_TRUE(Has(o.err, "interrupted by SIG")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

// Interrupted while checkpoints are being saved and loaded: the swap space,
// the checkpoint directory and the scratch file all go.
TEST(BenchCliTest, SigtermDuringCheckpointsLeavesTheDirEmpty) {
  ScratchDir d;
  Bench b({"checkpoint", "--dir", d.path(), "--params", "8M", "--reps", "100",
           "--queue-depth", "4", "--engine", "psync"},
          d.path());
  const std::string ckpt = d.path() + "/strata-bench-checkpoint.d";
  ASSERT_TRUE(WaitFor([&] { return fs::exists(ckpt + "/latest"); }, 60))
      << "no checkpoint was ever published";
  ASSERT_FALSE(b.Done()) << "finished before the signal";
  ASSERT_EQ(::kill(b.pid(), SIGTERM), 0);
  const Outcome o = b.Wait();
  EXPECT_EQ(o.code, 128 + SIGTERM) << o.err;
  EXPECT_TRUE(Has(o.err, "interrupted by SIG")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

TEST(BenchCliTest, SigintDuringTiersLeavesTheDirEmpty) {
  ExpectTiersInterruptCleans(SIGINT, 1000);
}
TEST(BenchCliTest, SigtermDuringTiersLeavesTheDirEmpty) {
  ExpectTiersInterruptCleans(SIGTERM, 0);
}

TEST(BenchCliTest, SigintDuringFillRemovesTheFile) {
  ExpectInterruptCleans(SIGINT, false);
}
TEST(BenchCliTest, SigtermDuringFillRemovesTheFile) {
  ExpectInterruptCleans(SIGTERM, false);
}
TEST(BenchCliTest, SigintDuringFioKillsFioAndRemovesTheFile) {
  ExpectInterruptCleans(SIGINT, true);
}
TEST(BenchCliTest, SigtermDuringFioKillsFioAndRemovesTheFile) {
  ExpectInterruptCleans(SIGTERM, true);
}

TEST(BenchCliTest, SigintDuringTheTorchLookupExits130) {
  ScratchDir d;
  // A stand-in interpreter that announces itself and hangs.
  const std::string py = d.path() + "/fake python";
  const std::string started = d.path() + "/started";
  {
    std::ofstream f(py);
    f << "#!/bin/sh\necho $$ > '" << started << "'\nexec sleep 30\n";
  }
  ASSERT_EQ(::chmod(py.c_str(), 0700), 0);
  const std::string json = d.path() + "/a.json";
  Bench b(
      {"adam", "--params", "64K", "--threads", "1", "--reps", "1", "--variants",
       "scalar", "--moments", "fp32", "--torch", "auto", "--json", json},
      d.path(), {"STRATA_PYTHON=" + py});
  ASSERT_TRUE(WaitFor([&] { return fs::exists(started); }, 30));
  ASSERT_TRUE(WaitFor([&] { return fs::file_size(started) > 0; }, 5));
  pid_t child = 0;
  std::ifstream(started) >> child;
  ASSERT_EQ(::kill(b.pid(), SIGINT), 0);
  const Outcome o = b.Wait();
  EXPECT_EQ(o.code, 130) << o.err;
  EXPECT_FALSE(Has(o.err, "no python3 with torch")) << o.err;
  EXPECT_TRUE(Has(o.err, "interrupted by SIGINT")) << o.err;
  EXPECT_FALSE(fs::exists(json)) << "a JSON from an interrupted run";
  EXPECT_TRUE(WaitFor([&] { return ::kill(child, 0) != 0; }, 5))
      << "the interpreter survived";
  EXPECT_EQ(Entries(d.path()),
            (std::set<std::string>{"fake python", "started"}));
}

// ---- Two runs, one directory
// -------------------------------------------------

TEST(BenchCliTest, SecondRunOnABusyDirFailsNamingTheHolder) {
  ScratchDir d;
  Bench first({"io", "--dir", d.path(), "--size", "64M", "--block-size", "1M",
               "--queue-depth", "4", "--engine", "psync", "--no-fio"},
              d.path());
  const std::string lock = d.path() + "/strata-bench-io.lock";
  ASSERT_TRUE(WaitFor([&] { return fs::exists(lock); }, 30));
  const Outcome second = RunBench(SmallIo(d.path()), d.path());
  EXPECT_EQ(second.code, 1) << second.err;
  EXPECT_TRUE(Has(second.err, "in use by pid " + std::to_string(first.pid())))
      << second.err;
  const Outcome o = first.Wait();
  EXPECT_EQ(o.code, 0) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

// ---- The optimizer's variant switch -----------------------------------------

TEST(BenchCliTest, BogusVariantVariableIsNamedWithAcceptedValues) {
  ScratchDir d;
  const Outcome o = RunBench({"adam", "--params", "64K", "--threads", "1",
                              "--torch", "off", "--reps", "1"},
                             d.path(), {"STRATA_CPU_ADAM_VARIANT=bogus"});
  EXPECT_EQ(o.code, 2) << o.err;
  EXPECT_TRUE(Has(o.err, "STRATA_CPU_ADAM_VARIANT")) << o.err;
  EXPECT_TRUE(Has(o.err, "'bogus'")) << o.err;
  EXPECT_TRUE(Has(o.err, "auto, scalar, avx2, avx512 or avx512bf16")) << o.err;
  EXPECT_TRUE(Entries(d.path()).empty());
}

TEST(BenchCliTest, BoundIgnoresTheForcedVariant) {
  ScratchDir d;
  const std::string json = d.path() + "/a.json";
  const Outcome o =
      RunBench({"adam", "--params", "64K", "--threads", "1", "--torch", "off",
                "--reps", "1", "--moments", "fp32", "--json", json},
               d.path(), {"STRATA_CPU_ADAM_VARIANT=scalar"});
  ASSERT_EQ(o.code, 0) << o.err;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  const std::string isa = j["config"]["bound_isa"];
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) {
    EXPECT_NE(isa, "scalar");
  }
  for (const auto& row : j["results"]) {
    if (row.contains("bound_isa")) {
      EXPECT_EQ(row["bound_isa"], isa);
    }
    if (row["optimizer"] == "grad_stats") {
      EXPECT_EQ(row["variant"], "scalar");
    }
  }
}

}  // namespace
