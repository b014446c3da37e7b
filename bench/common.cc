#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/bench.h"
#include "strata/config.h"
#include "strata/host_buffer.h"

namespace strata::bench {

extern const char kGitRevision[];  // revision.cc, generated at build time

namespace {
std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

std::string ReadFirstMatch(const char* path, std::string_view key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) == 0) {
      auto colon = line.find(':');
      if (colon == std::string::npos) return line;
      auto v = line.substr(colon + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  }
  return "";
}
}  // namespace

bool RegisterCommand(const Command& command) {
  Registry().push_back(command);
  std::sort(Registry().begin(), Registry().end(),
            [](const Command& a, const Command& b) {
              return std::string_view(a.name) < std::string_view(b.name);
            });
  return true;
}

const std::vector<Command>& Commands() { return Registry(); }

nlohmann::json MachineInfo() {
  nlohmann::json j;
  struct utsname u {};
  if (uname(&u) == 0) {
    j["hostname"] = u.nodename;
    j["kernel"] = std::string(u.sysname) + " " + u.release;
    j["arch"] = u.machine;
  }
  j["cpu_model"] = ReadFirstMatch("/proc/cpuinfo", "model name");
  j["cpus_online"] = sysconf(_SC_NPROCESSORS_ONLN);
  struct sysinfo si {};
  if (sysinfo(&si) == 0) {
    j["memory_bytes"] = static_cast<uint64_t>(si.totalram) * si.mem_unit;
  }
  j["strata_version"] = STRATA_VERSION_STRING;
  j["git_revision"] = std::string(kGitRevision);
  return j;
}

nlohmann::json FilesystemInfo(const std::string& path) {
  nlohmann::json j;
  j["path"] = path;
  // The longest mount point that prefixes the real path names the fs.
  char real[4096];
  std::string rp = realpath(path.c_str(), real) ? real : path;
  std::ifstream mounts("/proc/self/mounts");
  std::string dev, mnt, type, rest, best_mnt;
  while (mounts >> dev >> mnt >> type && std::getline(mounts, rest)) {
    const bool prefix =
        rp.compare(0, mnt.size(), mnt) == 0 &&
        (rp.size() == mnt.size() || mnt == "/" || rp[mnt.size()] == '/');
    if (prefix && mnt.size() >= best_mnt.size()) {
      best_mnt = mnt;
      j["filesystem"] = type;
      j["device"] = dev;
      j["mount_point"] = mnt;
    }
  }
  struct statfs sf {};
  if (statfs(path.c_str(), &sf) == 0) {
    j["free_bytes"] = static_cast<uint64_t>(sf.f_bavail) * sf.f_bsize;
  }
  return j;
}

// ---- Exit statuses ---------------------------------------------------------

std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints --help on stdout and errors on stderr; its own codes
    // (104..114) become the tool's one usage status.
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  return std::nullopt;
}

namespace {
void PrintError(std::string_view command, const std::string& message) {
  std::fprintf(stderr, "strata-bench %.*s: %s\n",
               static_cast<int>(command.size()), command.data(),
               message.c_str());
}

volatile sig_atomic_t g_signal = 0;

void OnSignal(int sig) {
  if (g_signal == 0) g_signal = sig;
}

struct sigaction g_old_int {};
struct sigaction g_old_term {};
}  // namespace

int UsageError(std::string_view command, const Status& status) {
  PrintError(command, status.ToString());
  return kExitUsage;
}

int Fail(std::string_view command, const Status& status) {
  if (const int sig = InterruptSignal(); sig != 0) {
    PrintError(command, std::string("interrupted by SIG") + sigabbrev_np(sig) +
                            "; removed what the run created");
    return 128 + sig;
  }
  PrintError(command, status.ToString());
  return kExitFailure;
}

int FailCheck(std::string_view command, const Status& status) {
  if (status.code() == StatusCode::kInvalidArgument && InterruptSignal() == 0) {
    return UsageError(command, status);
  }
  return Fail(command, status);
}

int RunCommand(std::string_view command, CLI::App& app, int argc, char** argv,
               const std::function<Status()>& parse,
               const std::function<Status(RunGuard&)>& check,
               const std::function<Status(RunGuard&)>& run_and_report) {
  if (auto code = ParseCommandLine(app, argc, argv)) return *code;
  if (Status s = parse(); !s.ok()) return UsageError(command, s);
  RunGuard guard;
  if (Status s = check(guard); !s.ok()) return FailCheck(command, s);
  if (Status s = run_and_report(guard); !s.ok()) return Fail(command, s);
  return kExitOk;
}

// ---- Signals and cleanup ---------------------------------------------------

RunGuard::RunGuard() {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocking call returns EINTR
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

RunGuard::~RunGuard() {
  for (const std::string& f : files_) ::unlink(f.c_str());
  for (const std::string& t : trees_) {
    std::error_code ec;  // remove_all removes links, never what they name
    std::filesystem::remove_all(t, ec);
  }
  locks_.clear();
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
}

void RunGuard::RemoveOnExit(std::string path) {
  files_.push_back(std::move(path));
}

void RunGuard::RemoveTreeOnExit(std::string dir) {
  trees_.push_back(std::move(dir));
}

void RunGuard::Keep(const std::string& path) {
  files_.erase(std::remove(files_.begin(), files_.end(), path), files_.end());
}

void RunGuard::AdoptLock(DirLock lock) { locks_.push_back(std::move(lock)); }

int InterruptSignal() { return g_signal; }

Status CheckInterrupted() {
  if (const int sig = g_signal; sig != 0) {
    return Status(StatusCode::kAborted,
                  std::string("interrupted by SIG") + sigabbrev_np(sig));
  }
  return Status::Ok();
}

// ---- Child processes -------------------------------------------------------

std::optional<std::string> FindOnPath(std::string_view name) {
  if (name.empty()) return std::nullopt;
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string_view::npos) {
    if (executable(std::string(name))) return std::string(name);
    return std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const size_t colon = rest.find(':');
    std::string dir(rest.substr(0, colon));
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + std::string(name);
    if (executable(candidate)) return candidate;
    if (colon == std::string_view::npos) break;
    rest.remove_prefix(colon + 1);
  }
  return std::nullopt;
}

namespace {

// One spawned child: killed and reaped on destruction if still running.
class Child {
 public:
  explicit Child(pid_t pid) : pid_(pid) {}
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { Kill(); }

  // Reaps without blocking; true once the child is gone.
  bool TryReap(int* status) {
    if (pid_ <= 0) return true;
    const pid_t r = ::waitpid(pid_, status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      pid_ = -1;
      return true;
    }
    return false;
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

 private:
  pid_t pid_;
};

void SleepMs(int ms) {
  struct timespec ts {
    0, ms * 1000000L
  };
  ::nanosleep(&ts, nullptr);
}

}  // namespace

StatusOr<ChildResult> RunChild(const std::vector<std::string>& argv,
                               const std::vector<std::string>& env) {
  if (argv.empty()) return Status::InvalidArgument("RunChild: empty argv");
  // The child's environment: ours, less the names `env` sets, then `env`.
  std::vector<std::string_view> names;
  for (const std::string& e : env) {
    const size_t eq = e.find('=');
    if (eq == 0 || eq == std::string::npos) {
      return Status::InvalidArgument("RunChild: environment entry '" + e +
                                     "' is not NAME=VALUE");
    }
    names.emplace_back(e.data(), eq + 1);  // "NAME="
  }
  std::vector<char*> child_env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (std::none_of(names.begin(), names.end(), [&](std::string_view n) {
          return entry.substr(0, n.size()) == n;
        })) {
      child_env.push_back(*e);
    }
  }
  for (const std::string& e : env)
    child_env.push_back(const_cast<char*>(e.c_str()));
  child_env.push_back(nullptr);
  STRATA_RETURN_IF_ERROR(CheckInterrupted());
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::FromErrno(errno, "pipe2");
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, write_end.get(), 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  // The child starts with default SIGINT/SIGTERM and nothing blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults, none;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int err = ::posix_spawnp(&pid, args[0], &actions, &attr, args.data(),
                                 child_env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (err != 0) return Status::FromErrno(err, "cannot run " + argv[0]);
  Child child(pid);
  write_end.reset();
  ChildResult result;
  bool eof = false;
  int status = 0;
  while (true) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());  // ~Child kills and reaps
    if (!eof) {
      struct pollfd p {
        read_end.get(), POLLIN, 0
      };
      const int r = ::poll(&p, 1, 50);
      if (r < 0 && errno != EINTR) return Status::FromErrno(errno, "poll");
      if (r > 0) {
        char buf[4096];
        const ssize_t n = ::read(read_end.get(), buf, sizeof buf);
        if (n > 0) {
          result.out.append(buf, static_cast<size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          eof = true;
        }
      }
      continue;
    }
    if (child.TryReap(&status)) break;
    SleepMs(10);
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// ---- Up-front checks -------------------------------------------------------

StatusOr<JsonOutput> JsonOutput::Prepare(std::string_view option,
                                         const std::string& path) {
  const std::string opt(option);
  if (path.empty()) {
    return Status::InvalidArgument(opt + ": empty path");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument(opt + ": " + path +
                                     " is a directory; give a file path");
    }
    if (!S_ISREG(st.st_mode)) {
      return Status::InvalidArgument(opt + ": " + path +
                                     " exists and is not a regular file");
    }
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos
                              ? "."
                              : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string base =
      slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.empty()) {
    return Status::InvalidArgument(opt + ": " + path + " names no file");
  }
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0 || !S_ISDIR(dst.st_mode)) {
    return Status::InvalidArgument(opt + ": directory " + dir + " of " + path +
                                   " does not exist");
  }
  struct statfs sf {};
  if (::statfs(dir.c_str(), &sf) == 0 &&
      (sf.f_type == PROC_SUPER_MAGIC || sf.f_type == SYSFS_MAGIC)) {
    return Status::InvalidArgument(opt + ": " + path +
                                   " is in /proc or /sys, not a place for a "
                                   "results file");
  }
  JsonOutput out;
  out.path_ = path;
  std::string temp = dir + "/." + base + ".tmp-XXXXXX";
  const int fd = ::mkostemp(temp.data(), O_CLOEXEC);
  if (fd < 0) {
    return Status::FromErrno(errno, opt + ": cannot create a file in " + dir +
                                        " (for " + path + ")");
  }
  out.fd_.reset(fd);
  out.temp_ = std::move(temp);
  return out;
}

JsonOutput::JsonOutput(JsonOutput&& other) noexcept
    : path_(std::move(other.path_)),
      temp_(std::exchange(other.temp_, std::string())),
      fd_(std::move(other.fd_)) {}

JsonOutput& JsonOutput::operator=(JsonOutput&& other) noexcept {
  if (this != &other) {
    if (!temp_.empty()) ::unlink(temp_.c_str());
    path_ = std::move(other.path_);
    temp_ = std::exchange(other.temp_, std::string());
    fd_ = std::move(other.fd_);
  }
  return *this;
}

JsonOutput::~JsonOutput() {
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

Status JsonOutput::Commit(const nlohmann::json& j) {
  if (!fd_) return Status::FailedPrecondition("JsonOutput: not prepared");
  const std::string text = j.dump(2) + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n =
        ::write(fd_.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno(errno, "write " + temp_);
    done += static_cast<size_t>(n);
  }
  if (::fchmod(fd_.get(), 0644) != 0 || ::fsync(fd_.get()) != 0) {
    return Status::FromErrno(errno, "write " + temp_);
  }
  fd_.reset();
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    return Status::FromErrno(errno, "rename " + temp_ + " to " + path_);
  }
  temp_.clear();
  return Status::Ok();
}

StatusOr<DirLock> DirLock::Acquire(const std::string& dir,
                                   const std::string& name) {
  StatusOr<FileLock> lock = FileLock::Acquire(dir + "/" + name);
  if (lock.status().code() == StatusCode::kBusy) {
    // "held by pid N (lock P)" in the benchmark's words.
    std::string_view holder = lock.status().message();
    constexpr std::string_view kHeld = "held by ";
    if (holder.starts_with(kHeld)) holder.remove_prefix(kHeld.size());
    return Status(StatusCode::kBusy,
                  dir + " is in use by " + std::string(holder) +
                      "; wait for it or give this run another --dir",
                  lock.status().sys_errno());
  }
  if (!lock.ok()) return lock.status();
  DirLock out;
  out.lock_ = std::move(*lock);
  return out;
}

StatusOr<uint64_t> FreeBytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) {
    return Status::FromErrno(errno, "statvfs " + path);
  }
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

std::optional<uint64_t> MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

Status CheckMemory(std::string_view what, uint64_t bytes) {
  const auto avail = MemAvailableBytes();
  if (avail && bytes > *avail) {
    return Status::OutOfMemory(
        std::string(what) + " need " + FormatBytes(bytes) + " (" +
        std::to_string(bytes) + " bytes) of memory, but " + "only " +
        std::to_string(*avail) + " bytes are available (MemAvailable)");
  }
  return Status::Ok();
}

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// ---- Reporting -------------------------------------------------------------

Table::Table(std::vector<std::string> header) {
  rows_.push_back(std::move(header));
}

void Table::AddRow(std::vector<std::string> row) {
  rows_.push_back(std::move(row));
}

std::string Table::ToString() const {
  std::vector<size_t> width;
  for (const auto& r : rows_) {
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (size_t i = 0; i < r.size(); ++i) {
      width[i] = std::max(width[i], r[i].size());
    }
  }
  std::ostringstream os;
  for (size_t ri = 0; ri < rows_.size(); ++ri) {
    const auto& r = rows_[ri];
    for (size_t i = 0; i < r.size(); ++i) {
      if (i) os << "  ";
      os << std::string(width[i] - r[i].size(), ' ') << r[i];
    }
    os << "\n";
    if (ri == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      os << std::string(total >= 2 ? total - 2 : 0, '-') << "\n";
    }
  }
  return os.str();
}

Progress::Progress(size_t total) : total_(total), tty_(isatty(2) != 0) {}

void Progress::Step(std::string_view what) {
  ++done_;
  if (!tty_) return;
  std::fprintf(stderr, "\r\033[K[%zu/%zu] %.*s", done_, total_,
               static_cast<int>(what.size()), what.data());
  std::fflush(stderr);
}

Progress::~Progress() {
  if (tty_ && done_ > 0) std::fprintf(stderr, "\r\033[K");
}

void AddSwapIoOptions(CLI::App& app, SwapIoFlags& f) {
  app.add_option("--engine", f.engine, "I/O engine: auto, uring, aio, psync")
      ->capture_default_str();
  app.add_option("--queue-depth", f.queue_depth,
                 "I/O requests in flight, 1..1024")
      ->capture_default_str();
  app.add_option("--block-size", f.block_size,
                 "swap block and largest I/O, a multiple of 4 KiB, 64K..64M")
      ->capture_default_str();
}

StatusOr<SwapIoConfig> ParseSwapIoFlags(const SwapIoFlags& f) {
  SwapIoConfig c;
  STRATA_ASSIGN_OR_RETURN(std::string engine,
                          ParseChoiceOption("--engine", f.engine,
                                            {"auto", "uring", "aio", "psync"}));
  STRATA_ASSIGN_OR_RETURN(c.engine, ParseIoBackend(engine));
  STRATA_ASSIGN_OR_RETURN(
      int64_t qd, ParseIntOption("--queue-depth", f.queue_depth, 1, 1024));
  c.queue_depth = static_cast<uint32_t>(qd);
  STRATA_ASSIGN_OR_RETURN(
      c.block_size,
      ParseSizeOption("--block-size", f.block_size, 64 << 10, 64 << 20));
  if (c.block_size % 4096 != 0) {
    return Status::InvalidArgument(
        "--block-size: " + std::to_string(c.block_size) +
        " bytes is not a multiple of 4 KiB");
  }
  return c;
}

void AddDeviceOption(CLI::App& app, std::string& device) {
  app.add_option("--device", device,
                 "auto (GPU when one works), cuda or host; auto defers to "
                 "STRATA_DEVICE")
      ->capture_default_str();
}

StatusOr<std::string> ParseDeviceOption(const std::string& device) {
  return ParseChoiceOption("--device", device, {"auto", "cuda", "host"});
}

DeviceChoice DeviceChoiceOf(const std::string& device) {
  if (device == "cuda") return DeviceChoice::kCuda;
  if (device == "host") return DeviceChoice::kHostEmulated;
  return DeviceChoice::kAuto;
}

// ---- The I/O engine's mixed rate ------------------------------------------

namespace {

// One pass: `reads` blocks read from the file's start and `writes` written
// after them, interleaved in proportion (alternating when equal),
// queue_depth in flight. Returns its seconds.
StatusOr<double> MixedPass(IoEngine& engine, FileId file, const SwapIoConfig& c,
                           HostBuffer& buf, uint64_t reads, uint64_t writes) {
  const uint64_t total = reads + writes;
  uint64_t next = 0, read = 0;  // requests submitted, reads among them
  std::vector<IoCompletion> done(c.queue_depth);
  auto submit = [&](uint64_t slot) -> Status {
    // A read while the reads lag their share of the requests so far.
    const bool write = read * total >= (next + 1) * reads;
    const uint64_t b = write ? next - read : read;
    read += write ? 0 : 1;
    ++next;
    IoRequest r{file, ((write ? reads : 0) + b) * c.block_size,
                buf.span().subspan(slot * c.block_size, c.block_size),
                write ? IoOp::kWrite : IoOp::kRead, slot};
    return engine.Submit({&r, 1});
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t s = 0; s < c.queue_depth && next < total; ++s) {
    STRATA_RETURN_IF_ERROR(submit(s));
  }
  while (engine.in_flight() > 0) {
    STRATA_ASSIGN_OR_RETURN(size_t n, engine.Reap(done, 1));
    for (size_t i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(done[i].status);
      if (next < total) {
        STRATA_RETURN_IF_ERROR(CheckInterrupted());
        STRATA_RETURN_IF_ERROR(submit(done[i].tag));
      }
    }
  }
  return SecondsSince(t0);
}

}  // namespace

StatusOr<double> MeasureIo(const std::string& dir, const std::string& scratch,
                           const SwapIoConfig& c, double read_share,
                           uint64_t bytes, RunGuard& guard) {
  read_share = std::clamp(read_share, 0.0, 1.0);
  const uint64_t blocks = std::clamp<uint64_t>(
      bytes / c.block_size, 2, (uint64_t{1} << 30) / c.block_size);
  uint64_t reads = static_cast<uint64_t>(
      std::llround(read_share * static_cast<double>(blocks)));
  if (read_share > 0) reads = std::max<uint64_t>(reads, 1);
  if (read_share < 1) reads = std::min(reads, blocks - 1);
  const uint64_t writes = read_share < 1 ? blocks - reads : 0;
  const std::string path = dir + "/" + scratch;
  guard.RemoveOnExit(path);
  IoEngineOptions io;
  io.backend = c.engine;
  io.queue_depth = c.queue_depth;
  STRATA_ASSIGN_OR_RETURN(auto engine, NewIoEngine(io));
  STRATA_ASSIGN_OR_RETURN(
      FileId file, engine->Open(path, {.create = true, .truncate = true}));
  STRATA_RETURN_IF_ERROR(
      engine->Allocate(file, (reads + writes) * c.block_size));
  HostBufferOptions bo;
  bo.prefault = true;
  STRATA_ASSIGN_OR_RETURN(
      HostBuffer buf, HostBuffer::Allocate(c.queue_depth * c.block_size, bo));
  std::memset(buf.data(), 0x5a, buf.size());
  const std::span<std::byte> whole = buf.span();
  STRATA_RETURN_IF_ERROR(engine->RegisterBuffers({&whole, 1}));
  // The blocks read are written first, so reads touch the device.
  for (uint64_t off = 0; off < reads * c.block_size; off += c.block_size) {
    STRATA_RETURN_IF_ERROR(
        engine->WriteAt(file, off, buf.span().first(c.block_size)));
  }
  STRATA_RETURN_IF_ERROR(engine->Sync(file));
  double best = 1e30;
  for (int pass = 0; pass < 3; ++pass) {  // the best of three passes
    STRATA_ASSIGN_OR_RETURN(double s,
                            MixedPass(*engine, file, c, buf, reads, writes));
    best = std::min(best, s);
  }
  STRATA_RETURN_IF_ERROR(engine->Close(file));
  ::unlink(path.c_str());
  return static_cast<double>((reads + writes) * c.block_size) / best;
}

StatusOr<double> MeasureMixedIo(const std::string& dir,
                                const std::string& scratch,
                                const SwapIoConfig& c, uint64_t bytes,
                                RunGuard& guard) {
  return MeasureIo(dir, scratch, c, 0.5, bytes, guard);
}

}  // namespace strata::bench
