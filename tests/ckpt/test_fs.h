// Test filesystems for checkpoints (never part of the library):
//   MemFs    an in-memory CheckpointFs that remembers what is durable: per
//            file, its contents at its last Sync; per directory, its entries
//            at its last SyncDir. PowerLoss() reverts to that state (unsynced
//            data dropped or torn by 4 KiB sectors, unsynced creates and
//            renames undone). It can fail the Nth operation once, or "crash"
//            at it (that and every later operation fail).
//   ProbeFs  wraps another CheckpointFs and calls a hook before and after
//            each operation (to SIGKILL a writer at an armed point, or to
//            watch the reads a reader issues).
#ifndef STRATA_TESTS_CKPT_TEST_FS_H_
#define STRATA_TESTS_CKPT_TEST_FS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "strata/checkpoint.h"

namespace strata::testing {

class MemFs final : public CheckpointFs {
 public:
  static constexpr size_t kSector = 4096;

  MemFs() { nodes_.push_back(Node{true}); }  // the root, always durable

  // Operation `n` (counting from 0 since construction) and all later ones
  // fail with kIoError.
  void CrashAt(int64_t n) {
    std::lock_guard<std::mutex> l(mu_);
    crash_at_ = n;
  }
  // Operation `n` fails once.
  void FailAt(int64_t n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_at_ = n;
  }
  int64_t ops() const {
    std::lock_guard<std::mutex> l(mu_);
    return ops_;
  }
  bool crashed() const {
    std::lock_guard<std::mutex> l(mu_);
    return ops_ > crash_at_;
  }

  // The machine loses power: only what was made durable stays; data written
  // since a file's last Sync is dropped, or (randomly) partly kept sector by
  // sector. Clears the fault settings.
  void PowerLoss(std::mt19937_64& rng) {
    std::lock_guard<std::mutex> l(mu_);
    for (Node& n : nodes_) {
      n.entries = n.durable_entries;
      if (n.dir || n.data == n.durable) continue;
      std::string torn = n.durable;
      if (rng() % 2 == 0) {
        const size_t size = rng() % 2 ? n.data.size() : n.durable.size();
        torn.resize(size, '\0');
        for (size_t s = 0; s < size; s += kSector) {
          if (rng() % 2 == 0 || s >= n.data.size()) continue;
          const size_t len =
              std::min(kSector, std::min(size, n.data.size()) - s);
          std::memcpy(torn.data() + s, n.data.data() + s, len);
        }
      }
      n.data = n.durable = torn;
    }
    locks_.clear();
    crash_at_ = fail_at_ = INT64_MAX;
  }

  // Flips one bit of a file's contents, durable and current.
  bool FlipBit(const std::string& path, uint64_t bit) {
    std::lock_guard<std::mutex> l(mu_);
    const int id = ResolveLocked(path);
    if (id < 0 || nodes_[id].dir || bit / 8 >= nodes_[id].data.size()) {
      return false;
    }
    nodes_[id].data[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    nodes_[id].durable = nodes_[id].data;
    return true;
  }

  StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("create", path));
    auto [parent, name] = SplitLocked(path);
    if (parent < 0) return Status::NotFound("create " + path + ": no parent");
    if (nodes_[parent].entries.count(name)) {
      return Status::AlreadyExists("create " + path + ": exists");
    }
    const int id = NewNodeLocked(false);
    nodes_[parent].entries[name] = id;
    return std::unique_ptr<File>(new MemFile(this, id, path));
  }
  StatusOr<std::unique_ptr<File>> Overwrite(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("overwrite", path));
    const int id = ResolveLocked(path);
    if (id < 0) return Status::NotFound("overwrite " + path + ": not found");
    if (nodes_[id].dir) return Status::InvalidArgument(path + " is a dir");
    ++overwrites_;
    return std::unique_ptr<File>(new MemFile(this, id, path, true));
  }
  // Files opened with Overwrite so far.
  int overwrites() const {
    std::lock_guard<std::mutex> l(mu_);
    return overwrites_;
  }
  StatusOr<std::unique_ptr<File>> Open(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("open", path));
    const int id = ResolveLocked(path);
    if (id < 0) return Status::NotFound("open " + path + ": not found");
    if (nodes_[id].dir) return Status::InvalidArgument(path + " is a dir");
    return std::unique_ptr<File>(new MemFile(this, id, path));
  }
  StatusOr<std::string> ReadSmall(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("read", path));
    const int id = ResolveLocked(path);
    if (id < 0) return Status::NotFound("open " + path + ": not found");
    if (nodes_[id].dir) return Status::InvalidArgument(path + " is a dir");
    return nodes_[id].data;
  }
  Status WriteSmall(const std::string& path, std::string_view data) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("write", path));
    auto [parent, name] = SplitLocked(path);
    if (parent < 0) return Status::NotFound("write " + path + ": no parent");
    int id;
    auto it = nodes_[parent].entries.find(name);
    if (it == nodes_[parent].entries.end()) {
      id = NewNodeLocked(false);
      nodes_[parent].entries[name] = id;
    } else {
      id = it->second;
    }
    nodes_[id].data = nodes_[id].durable = std::string(data);
    return Status::Ok();
  }
  Status Rename(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("rename", from + " to " + to));
    auto [fp, fname] = SplitLocked(from);
    auto [tp, tname] = SplitLocked(to);
    if (fp < 0 || tp < 0 || !nodes_[fp].entries.count(fname)) {
      return Status::NotFound("rename " + from + ": not found");
    }
    auto it = nodes_[tp].entries.find(tname);
    if (it != nodes_[tp].entries.end() && nodes_[it->second].dir &&
        !nodes_[it->second].entries.empty()) {
      return Status::IoError("rename to " + to + ": not empty");
    }
    const int id = nodes_[fp].entries[fname];
    nodes_[fp].entries.erase(fname);
    nodes_[tp].entries[tname] = id;
    return Status::Ok();
  }
  Status SyncDir(const std::string& dir) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("syncdir", dir));
    const int id = ResolveLocked(dir);
    if (id < 0) return Status::NotFound("syncdir " + dir + ": not found");
    nodes_[id].durable_entries = nodes_[id].entries;
    return Status::Ok();
  }
  Status MakeDir(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("mkdir", path));
    auto [parent, name] = SplitLocked(path);
    if (parent < 0) return Status::NotFound("mkdir " + path + ": no parent");
    auto it = nodes_[parent].entries.find(name);
    if (it != nodes_[parent].entries.end()) {
      return nodes_[it->second].dir
                 ? Status::Ok()
                 : Status::AlreadyExists("mkdir " + path + ": a file");
    }
    const int id = NewNodeLocked(true);
    nodes_[parent].entries[name] = id;
    return Status::Ok();
  }
  Status RemoveAll(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("remove", path));
    auto [parent, name] = SplitLocked(path);
    if (parent >= 0) nodes_[parent].entries.erase(name);
    return Status::Ok();
  }
  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("list", dir));
    const int id = ResolveLocked(dir);
    if (id < 0 || !nodes_[id].dir) {
      return Status::NotFound("list " + dir + ": not found");
    }
    std::vector<std::string> names;
    for (const auto& [n, unused] : nodes_[id].entries) names.push_back(n);
    return names;
  }
  StatusOr<std::unique_ptr<Lock>> LockDir(const std::string& dir) override {
    std::lock_guard<std::mutex> l(mu_);
    STRATA_RETURN_IF_ERROR(TickLocked("lock", dir));
    if (!locks_.insert(dir).second) {
      return Status::Busy("checkpoint directory " + dir + " is locked");
    }
    return std::unique_ptr<Lock>(new MemLock(this, dir));
  }

 private:
  struct Node {
    bool dir = false;
    std::string data, durable;
    std::map<std::string, int> entries, durable_entries;
  };

  class MemFile final : public File {
   public:
    // `overwrite`: Sync cuts the file to the end of what was written.
    MemFile(MemFs* fs, int id, std::string path, bool overwrite = false)
        : fs_(fs), id_(id), path_(std::move(path)), overwrite_(overwrite) {}
    void Write(uint64_t offset, std::span<const std::byte> buf,
               std::function<void(Status)> done) override {
      Status s;
      {
        std::lock_guard<std::mutex> l(fs_->mu_);
        s = fs_->TickLocked("write", path_);
        if (s.ok()) {
          std::string& d = fs_->nodes_[id_].data;
          if (d.size() < offset + buf.size()) d.resize(offset + buf.size());
          std::memcpy(d.data() + offset, buf.data(), buf.size());
          end_ = std::max<uint64_t>(end_, offset + buf.size());
        }
      }
      done(s);
    }
    void Read(uint64_t offset, std::span<std::byte> buf,
              std::function<void(Status)> done) override {
      Status s;
      {
        std::lock_guard<std::mutex> l(fs_->mu_);
        s = fs_->TickLocked("read", path_);
        const std::string& d = fs_->nodes_[id_].data;
        if (s.ok() && offset + buf.size() > d.size()) {
          s = Status::Corruption("read " + path_ + " at offset " +
                                 std::to_string(offset) + ": past the end");
        }
        if (s.ok()) std::memcpy(buf.data(), d.data() + offset, buf.size());
      }
      done(s);
    }
    Status Sync() override {
      std::lock_guard<std::mutex> l(fs_->mu_);
      STRATA_RETURN_IF_ERROR(fs_->TickLocked("fsync", path_));
      if (overwrite_ && fs_->nodes_[id_].data.size() > end_) {
        fs_->nodes_[id_].data.resize(end_);
      }
      fs_->nodes_[id_].durable = fs_->nodes_[id_].data;
      return Status::Ok();
    }
    StatusOr<uint64_t> Size() override {
      std::lock_guard<std::mutex> l(fs_->mu_);
      STRATA_RETURN_IF_ERROR(fs_->TickLocked("stat", path_));
      return static_cast<uint64_t>(fs_->nodes_[id_].data.size());
    }

   private:
    MemFs* fs_;
    int id_;
    std::string path_;
    bool overwrite_;
    uint64_t end_ = 0;  // guarded by fs_->mu_
  };

  class MemLock final : public Lock {
   public:
    MemLock(MemFs* fs, std::string dir) : fs_(fs), dir_(std::move(dir)) {}
    ~MemLock() override {
      std::lock_guard<std::mutex> l(fs_->mu_);
      fs_->locks_.erase(dir_);
    }

   private:
    MemFs* fs_;
    std::string dir_;
  };

  Status TickLocked(const char* op, const std::string& path) {
    const int64_t n = ops_++;
    if (n >= crash_at_) {
      return Status::IoError(std::string(op) + " " + path +
                             ": crashed (injected)");
    }
    if (n == fail_at_) {
      return Status::IoError(std::string(op) + " " + path +
                             ": failed (injected)");
    }
    return Status::Ok();
  }
  int NewNodeLocked(bool dir) {
    nodes_.push_back(Node{dir});
    return static_cast<int>(nodes_.size() - 1);
  }
  static std::vector<std::string> Parts(const std::string& path) {
    std::vector<std::string> parts;
    size_t i = 0;
    while (i < path.size()) {
      size_t j = path.find('/', i);
      if (j == std::string::npos) j = path.size();
      if (j > i) parts.push_back(path.substr(i, j - i));
      i = j + 1;
    }
    return parts;
  }
  int WalkLocked(const std::vector<std::string>& parts, size_t n) const {
    int id = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!nodes_[id].dir) return -1;
      auto it = nodes_[id].entries.find(parts[i]);
      if (it == nodes_[id].entries.end()) return -1;
      id = it->second;
    }
    return id;
  }
  int ResolveLocked(const std::string& path) const {
    const auto parts = Parts(path);
    return WalkLocked(parts, parts.size());
  }
  // The parent directory's node (or -1) and the last name.
  std::pair<int, std::string> SplitLocked(const std::string& path) const {
    const auto parts = Parts(path);
    if (parts.empty()) return {-1, ""};
    const int parent = WalkLocked(parts, parts.size() - 1);
    if (parent < 0 || !nodes_[parent].dir) return {-1, parts.back()};
    return {parent, parts.back()};
  }

  mutable std::mutex mu_;
  std::vector<Node> nodes_;
  std::set<std::string> locks_;
  int64_t ops_ = 0;
  int overwrites_ = 0;
  int64_t crash_at_ = INT64_MAX;
  int64_t fail_at_ = INT64_MAX;
};

// Calls hook(op, path, after) around every operation of `base`.
class ProbeFs final : public CheckpointFs {
 public:
  using Hook = std::function<void(std::string_view op, const std::string& path,
                                  bool after)>;
  // Reads of data files report their buffer here (address, bytes).
  using ReadHook =
      std::function<void(const std::string& path, std::span<std::byte> buf)>;
  ProbeFs(CheckpointFs* base, Hook hook, ReadHook on_read = nullptr)
      : base_(base), hook_(std::move(hook)), on_read_(std::move(on_read)) {}

  StatusOr<std::unique_ptr<File>> Create(const std::string& path) override {
    return Wrap("create", path, base_->Create(path));
  }
  StatusOr<std::unique_ptr<File>> Overwrite(const std::string& path) override {
    return Wrap("overwrite", path, base_->Overwrite(path));
  }
  StatusOr<std::unique_ptr<File>> Open(const std::string& path) override {
    return Wrap("open", path, base_->Open(path));
  }
  StatusOr<std::string> ReadSmall(const std::string& path) override {
    return Around("read_small", path, [&] { return base_->ReadSmall(path); });
  }
  Status WriteSmall(const std::string& path, std::string_view data) override {
    return Around("write_small", path,
                  [&] { return base_->WriteSmall(path, data); });
  }
  Status Rename(const std::string& from, const std::string& to) override {
    return Around("rename", to, [&] { return base_->Rename(from, to); });
  }
  Status SyncDir(const std::string& dir) override {
    return Around("sync_dir", dir, [&] { return base_->SyncDir(dir); });
  }
  Status MakeDir(const std::string& path) override {
    return Around("make_dir", path, [&] { return base_->MakeDir(path); });
  }
  Status RemoveAll(const std::string& path) override {
    return Around("remove_all", path, [&] { return base_->RemoveAll(path); });
  }
  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    return Around("list", dir, [&] { return base_->List(dir); });
  }
  StatusOr<std::unique_ptr<Lock>> LockDir(const std::string& dir) override {
    return Around("lock", dir, [&] { return base_->LockDir(dir); });
  }

 private:
  class ProbeFile final : public File {
   public:
    ProbeFile(ProbeFs* fs, std::unique_ptr<File> base, std::string path)
        : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}
    void Write(uint64_t offset, std::span<const std::byte> buf,
               std::function<void(Status)> done) override {
      fs_->hook_("write", path_, false);
      base_->Write(offset, buf, std::move(done));
    }
    void Read(uint64_t offset, std::span<std::byte> buf,
              std::function<void(Status)> done) override {
      if (fs_->on_read_) fs_->on_read_(path_, buf);
      base_->Read(offset, buf, std::move(done));
    }
    Status Sync() override {
      return fs_->Around("sync", path_, [&] { return base_->Sync(); });
    }
    StatusOr<uint64_t> Size() override { return base_->Size(); }

   private:
    ProbeFs* fs_;
    std::unique_ptr<File> base_;
    std::string path_;
  };

  template <typename F>
  auto Around(std::string_view op, const std::string& path, F&& f)
      -> decltype(f()) {
    hook_(op, path, false);
    auto r = f();
    hook_(op, path, true);
    return r;
  }
  StatusOr<std::unique_ptr<File>> Wrap(std::string_view op,
                                       const std::string& path,
                                       StatusOr<std::unique_ptr<File>> file) {
    hook_(op, path, true);
    if (!file.ok()) return file.status();
    return std::unique_ptr<File>(new ProbeFile(this, std::move(*file), path));
  }

  CheckpointFs* base_;
  Hook hook_;
  ReadHook on_read_;
};

}  // namespace strata::testing

#endif  // STRATA_TESTS_CKPT_TEST_FS_H_
