#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "bench/bench.h"
#include "strata/config.h"

#ifndef STRATA_GIT_REVISION
#define STRATA_GIT_REVISION "unknown"
#endif

namespace strata::bench {

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
  j["git_revision"] = STRATA_GIT_REVISION;
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

int Fail(std::string_view command, const Status& status) {
  std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(command.size()),
               command.data(), status.ToString().c_str());
  return 1;
}

Status WriteJson(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) return Status::FromErrno(errno, "cannot open " + path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return Status::IoError("cannot write " + path);
  return Status::Ok();
}

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

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  size_t idx = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return v[std::min(idx, v.size() - 1)];
}

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
  if (pos == 0) return Status::InvalidArgument("bad size '" + t + "'");
  uint64_t n = std::stoull(t.substr(0, pos));
  std::string suffix = t.substr(pos);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(c));
  uint64_t mult = 1;
  if (suffix.empty() || suffix == "B") {
    mult = 1;
  } else if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    mult = uint64_t{1} << 10;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    mult = uint64_t{1} << 20;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    mult = uint64_t{1} << 30;
  } else if (suffix == "T" || suffix == "TB" || suffix == "TIB") {
    mult = uint64_t{1} << 40;
  } else {
    return Status::InvalidArgument("bad size suffix in '" + t + "'");
  }
  return n * mult;
}

std::vector<std::string> SplitList(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string_view::npos) comma = s.size();
    if (comma > start) out.emplace_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

StatusOr<std::vector<uint64_t>> ParseSizeList(std::string_view s) {
  std::vector<uint64_t> out;
  for (const auto& item : SplitList(s)) {
    STRATA_ASSIGN_OR_RETURN(uint64_t v, ParseSize(item));
    out.push_back(v);
  }
  if (out.empty()) return Status::InvalidArgument("empty list");
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + " " + kUnits[u];
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace strata::bench
