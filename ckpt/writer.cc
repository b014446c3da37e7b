// CheckpointWriter: streams extents into per-role data files of a temporary
// directory, then publishes it crash-safely (docs/checkpoints.md).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/paths.h"
#include "strata/checkpoint.h"
#include "util/log.h"
#include "util/mutex.h"

namespace strata {
namespace {

using ckpt::BlobRecord;
using ckpt::ExtentRecord;
using ckpt::FileRecord;
using ckpt::JoinPath;

// Steps have at most 18 digits in a directory name.
constexpr int64_t kMaxStep = 999'999'999'999'999'999;

class Writer final : public CheckpointWriter {
 public:
  Writer(const CheckpointWriterOptions& options,
         std::unique_ptr<CheckpointFs> owned_fs)
      : owned_fs_(std::move(owned_fs)),
        fs_(options.fs != nullptr ? options.fs : owned_fs_.get()),
        options_(options),
        name_(ckpt::StepDirName(options.step)),
        final_(JoinPath(options.dir, name_)),
        tmp_(JoinPath(options.dir, std::string(ckpt::kTmpPrefix) + name_ + "-" +
                                       std::to_string(::getpid()))) {}

  ~Writer() override {
    bool published;
    std::array<std::unique_ptr<CheckpointFs::File>, kNumStateRoles> files;
    {
      MutexLock lock(&mu_);
      if (phase_ == Phase::kOpen) phase_ = Phase::kFailed;
      while (pending_ > 0) cv_.Wait(&mu_);
      published = phase_ == Phase::kPublished;
      for (size_t r = 0; r < files.size(); ++r) {
        files[r] = std::move(files_[r].file);
      }
    }
    for (auto& f : files) f.reset();  // closed outside the lock
    if (!published && began_) {
      // Best effort: a writer that crashed here leaves what the next one
      // removes.
      fs_->RemoveAll(tmp_).IgnoreError();
      fs_->SyncDir(options_.dir).IgnoreError();
    }
    lock_.reset();  // last: the directory is as it was
  }

  Status Begin() {
    const CheckpointWriterOptions& o = options_;
    StatusOr<std::vector<std::string>> names = fs_->List(o.dir);
    if (names.status().code() == StatusCode::kNotFound) {
      STRATA_RETURN_IF_ERROR(fs_->MakeDir(o.dir));
      // The new directory's entry must survive a power loss too.
      STRATA_RETURN_IF_ERROR(fs_->SyncDir(ckpt::ParentDir(o.dir)));
    } else if (!names.ok()) {
      return names.status();
    }
    STRATA_ASSIGN_OR_RETURN(lock_, fs_->LockDir(o.dir));
    // Holding the lock, every temporary entry is a dead writer's.
    STRATA_ASSIGN_OR_RETURN(names, fs_->List(o.dir));
    bool removed = false;
    bool spare = false;
    for (const std::string& n : *names) {
      if (n.rfind(ckpt::kTmpPrefix, 0) != 0) continue;
      if (n == ckpt::kSpareName && o.recycle) {
        spare = true;
        continue;
      }
      STRATA_RETURN_IF_ERROR(fs_->RemoveAll(JoinPath(o.dir, n)));
      STRATA_LOG_WARN("removed {}, left by a checkpoint writer that is gone",
                      JoinPath(o.dir, n));
      removed = true;
    }
    if (removed) STRATA_RETURN_IF_ERROR(fs_->SyncDir(o.dir));
    if (std::find(names->begin(), names->end(), name_) != names->end()) {
      StatusOr<std::string> latest = ckpt::ReadLatest(*fs_, o.dir);
      if (!latest.ok() && latest.status().code() != StatusCode::kNotFound) {
        return latest.status();
      }
      if (latest.ok() && *latest == name_) {
        return Status::AlreadyExists("checkpoint " + final_ +
                                     " exists and is the latest; write "
                                     "another step or remove it");
      }
      // Never published ("latest" names another): a commit that did not
      // finish, or one superseded. This checkpoint replaces it.
      replace_ = true;
    }
    began_ = true;
    if (spare) return AdoptSpare();
    return fs_->MakeDir(tmp_);
  }

  // Note [Recycled files]: the spare becomes this writer's temporary
  // directory, and WriteExtent writes over the data files it finds there.
  // Only a pruned checkpoint's files become a spare, after the commit that
  // pruned it was published, so no checkpoint a reader may load is ever
  // written to; a crash leaves the spare or this writer's temporary
  // directory, which the next writer adopts or removes. The spare's manifest
  // goes first, so nothing in the directory describes the old data, and the
  // files this checkpoint does not write go at Commit.
  Status AdoptSpare() {
    STRATA_RETURN_IF_ERROR(
        fs_->Rename(JoinPath(options_.dir, ckpt::kSpareName), tmp_));
    STRATA_RETURN_IF_ERROR(fs_->RemoveAll(JoinPath(tmp_, ckpt::kManifestName)));
    STRATA_ASSIGN_OR_RETURN(recycled_, fs_->List(tmp_));
    return Status::Ok();
  }

  bool Recycled(const std::string& name) const {
    return std::find(recycled_.begin(), recycled_.end(), name) !=
           recycled_.end();
  }

  StatusOr<uint32_t> AddTensor(const CheckpointTensor& tensor) override
      STRATA_EXCLUDES(mu_) {
    const std::string what = "tensor '" + tensor.name + "'";
    if (tensor.name.empty() || tensor.name.size() > ckpt::kMaxNameBytes ||
        !ckpt::IsUtf8(tensor.name)) {
      return Status::InvalidArgument("tensor name must be UTF-8 of 1 to " +
                                     std::to_string(ckpt::kMaxNameBytes) +
                                     " bytes");
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t elems,
                            ckpt::TensorElems(tensor, what + " shape"));
    MutexLock lock(&mu_);
    if (phase_ != Phase::kOpen || extents_started_) {
      return Status::FailedPrecondition(
          "AddTensor(" + what + ") after the first WriteExtent or Commit");
    }
    for (const CheckpointTensor& t : tensors_) {
      if (t.name == tensor.name) {
        return Status::AlreadyExists(what + " was added already");
      }
    }
    if (tensors_.size() >= UINT32_MAX) {
      return Status::OutOfRange("more than 2^32 - 1 tensors");
    }
    tensors_.push_back(tensor);
    elems_.push_back(elems);
    return static_cast<uint32_t>(tensors_.size() - 1);
  }

  Status WriteExtent(StateRole role, std::span<const std::byte> data,
                     std::vector<StatePlacement> placements,
                     std::function<void(Status)> done) override
      STRATA_EXCLUDES(mu_) {
    const auto r = static_cast<size_t>(role);
    if (r >= static_cast<size_t>(kNumStateRoles)) {
      return Status::InvalidArgument("unknown state role " + std::to_string(r));
    }
    if (data.empty() || data.size() % kCheckpointAlign != 0 ||
        reinterpret_cast<uintptr_t>(data.data()) % kCheckpointAlign != 0) {
      return Status::InvalidArgument(
          "WriteExtent: buffer at " +
          std::to_string(reinterpret_cast<uintptr_t>(data.data())) + " of " +
          std::to_string(data.size()) +
          " bytes; address and size must be positive multiples of " +
          std::to_string(kCheckpointAlign));
    }
    if (placements.empty()) {
      return Status::InvalidArgument("WriteExtent: no placements");
    }
    const std::string path = JoinPath(tmp_, ckpt::DataFileName(role));
    bool create = false;
    {
      MutexLock lock(&mu_);
      STRATA_RETURN_IF_ERROR(WritableLocked());
      STRATA_RETURN_IF_ERROR(ckpt::CheckPlacements(tensors_, elems_, role,
                                                   data.size(), placements,
                                                   "WriteExtent placements"));
      extents_started_ = true;
      RoleFile& f = files_[r];
      while (f.state == FileState::kCreating) cv_.Wait(&mu_);
      if (f.state == FileState::kNone) {
        f.state = FileState::kCreating;
        create = true;
      }
    }
    if (create) {
      // Outside the lock: creating is I/O.
      StatusOr<std::unique_ptr<CheckpointFs::File>> file =
          Status::NotFound(path);
      if (Recycled(ckpt::DataFileName(role))) {
        file = fs_->Overwrite(path);
        if (file.status().code() == StatusCode::kNotSupported) {
          Status removed = fs_->RemoveAll(path);
          file = removed.ok() ? fs_->Create(path) : removed;
        }
      } else {
        file = fs_->Create(path);
      }
      MutexLock lock(&mu_);
      RoleFile& f = files_[r];
      if (file.ok()) {
        f.file = std::move(*file);
        f.state = FileState::kOpen;
      } else {
        f.state = FileState::kFailed;
        f.error = file.status();
        RecordErrorLocked(file.status());
      }
      cv_.SignalAll();
    }
    // Checksummed before the write is issued; the buffer is the caller's
    // until `done` runs.
    const uint64_t sum = Xxh3(data);
    CheckpointFs::File* file;
    uint64_t offset;
    {
      MutexLock lock(&mu_);
      RoleFile& f = files_[r];
      if (f.state != FileState::kOpen) return f.error;
      STRATA_RETURN_IF_ERROR(WritableLocked());
      offset = f.next_offset;
      f.next_offset += data.size();
      ExtentRecord e;
      e.role = role;
      e.offset = offset;
      e.bytes = data.size();
      e.xxh3 = sum;
      e.placements = std::move(placements);
      extents_.push_back(std::move(e));
      file = f.file.get();
      ++pending_;
    }
    file->Write(
        offset, data, [this, done = std::move(done), path, offset](Status s) {
          if (!s.ok() && s.message().find(path) == std::string::npos) {
            s = std::move(s).WithContext("write " + path + " at offset " +
                                         std::to_string(offset));
          }
          Status copy = s;
          done(std::move(s));
          MutexLock lock(&mu_);
          if (!copy.ok()) RecordErrorLocked(copy);
          --pending_;
          cv_.SignalAll();  // under the lock: ~Writer may follow
        });
    return Status::Ok();
  }

  Status PutBlob(std::string_view name, std::string_view bytes) override
      STRATA_EXCLUDES(mu_) {
    if (name.empty() || name.size() > ckpt::kMaxNameBytes ||
        !ckpt::IsUtf8(name)) {
      return Status::InvalidArgument("blob name must be UTF-8 of 1 to " +
                                     std::to_string(ckpt::kMaxNameBytes) +
                                     " bytes");
    }
    MutexLock lock(&mu_);
    STRATA_RETURN_IF_ERROR(WritableLocked());
    uint64_t total = bytes.size();
    for (const BlobRecord& b : blobs_) {
      if (b.name == name) {
        return Status::AlreadyExists("blob '" + std::string(name) +
                                     "' was put already");
      }
      total += b.bytes.size();
    }
    if (total > ckpt::kMaxBlobBytes) {
      return Status::OutOfRange(
          "blob '" + std::string(name) + "': blobs would hold " +
          std::to_string(total) + " bytes, more than the " +
          std::to_string(ckpt::kMaxBlobBytes) + " allowed");
    }
    blobs_.push_back({std::string(name), std::string(bytes)});
    return Status::Ok();
  }

  StatusOr<std::string> Commit() override STRATA_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (phase_ != Phase::kOpen) {
        return Status::FailedPrecondition("Commit of " + final_ +
                                          " after Commit");
      }
      phase_ = Phase::kCommitting;
      while (pending_ > 0) cv_.Wait(&mu_);
      if (!first_error_.ok()) {
        phase_ = Phase::kFailed;
        return first_error_;
      }
    }
    // Every write has finished: the state below is this thread's alone.
    Status s = Publish();
    MutexLock lock(&mu_);
    phase_ = s.ok() || published_ ? Phase::kPublished : Phase::kFailed;
    if (!s.ok()) return s;
    return final_;
  }

 private:
  enum class Phase { kOpen, kCommitting, kPublished, kFailed };
  enum class FileState { kNone, kCreating, kOpen, kFailed };
  struct RoleFile {
    FileState state = FileState::kNone;
    std::unique_ptr<CheckpointFs::File> file;
    uint64_t next_offset = 0;
    Status error;
  };

  Status WritableLocked() const STRATA_REQUIRES(mu_) {
    if (!first_error_.ok()) return first_error_;
    if (phase_ != Phase::kOpen) {
      return Status::FailedPrecondition("checkpoint " + final_ +
                                        " is committing or committed");
    }
    return Status::Ok();
  }
  void RecordErrorLocked(const Status& s) STRATA_REQUIRES(mu_) {
    if (first_error_.ok()) first_error_ = s;
  }

  // Syncs the data, writes the manifest and publishes (see the header's
  // protocol). On failure before "latest" changed, the checkpoint directory
  // is left as it was (the destructor removes the temporary directory).
  Status Publish() STRATA_NO_THREAD_SAFETY_ANALYSIS {
    ckpt::Manifest m;
    m.step = options_.step;
    m.tensors = tensors_;
    std::sort(extents_.begin(), extents_.end(),
              [](const ExtentRecord& a, const ExtentRecord& b) {
                return a.role != b.role ? a.role < b.role : a.offset < b.offset;
              });
    for (size_t r = 0; r < files_.size(); ++r) {
      RoleFile& f = files_[r];
      if (f.state != FileState::kOpen) continue;
      const auto role = static_cast<StateRole>(r);
      std::vector<const ExtentRecord*> extents;
      for (const ExtentRecord& e : extents_) {
        if (e.role == role) extents.push_back(&e);
      }
      Status cover = ckpt::CheckCoverage(tensors_, role, extents);
      if (!cover.ok()) {
        return Status::FailedPrecondition("Commit of " + final_ + ": " +
                                          std::string(cover.message()));
      }
      const std::string path = JoinPath(tmp_, ckpt::DataFileName(role));
      STRATA_RETURN_IF_ERROR(f.file->Sync());
      STRATA_ASSIGN_OR_RETURN(uint64_t size, f.file->Size());
      if (size != f.next_offset) {
        return Status::IoError(path + ": " + std::to_string(size) +
                               " bytes after writing " +
                               std::to_string(f.next_offset));
      }
      f.file.reset();
      m.files.push_back(
          {role, ckpt::DataFileName(role), size, ckpt::FileChecksum(extents)});
    }
    // Note [Recycled files]: what this checkpoint did not write goes.
    for (const std::string& n : recycled_) {
      bool written = false;
      for (size_t r = 0; r < files_.size(); ++r) {
        written |= files_[r].state == FileState::kOpen &&
                   n == ckpt::DataFileName(static_cast<StateRole>(r));
      }
      if (!written) STRATA_RETURN_IF_ERROR(fs_->RemoveAll(JoinPath(tmp_, n)));
    }
    m.extents = std::move(extents_);
    m.blobs = std::move(blobs_);
    const std::string& dir = options_.dir;
    STRATA_RETURN_IF_ERROR(fs_->WriteSmall(JoinPath(tmp_, ckpt::kManifestName),
                                           ckpt::SerializeManifest(m)));
    STRATA_RETURN_IF_ERROR(fs_->SyncDir(tmp_));
    std::string aside;
    if (replace_) {
      // The unpublished checkpoint of the same name goes first; a crash
      // from here on leaves it under a temporary name, removed later.
      aside = JoinPath(dir, std::string(ckpt::kTmpPrefix) + "old-" + name_ +
                                "-" + std::to_string(::getpid()));
      STRATA_RETURN_IF_ERROR(fs_->Rename(final_, aside));
    }
    STRATA_RETURN_IF_ERROR(fs_->Rename(tmp_, final_));
    Status s = fs_->SyncDir(dir);
    const std::string latest_tmp =
        JoinPath(dir, std::string(ckpt::kTmpPrefix) + "latest-" +
                          std::to_string(::getpid()));
    if (s.ok()) s = fs_->WriteSmall(latest_tmp, name_ + "\n");
    if (s.ok()) s = fs_->Rename(latest_tmp, JoinPath(dir, ckpt::kLatestName));
    if (!s.ok()) {
      // "latest" still names the old checkpoint: take the new one back.
      fs_->RemoveAll(latest_tmp).IgnoreError();
      fs_->RemoveAll(final_).IgnoreError();
      fs_->SyncDir(dir).IgnoreError();
      return s;
    }
    published_ = true;
    s = fs_->SyncDir(dir);
    if (!s.ok()) {
      return std::move(s).WithContext("checkpoint " + final_ +
                                      " was published, but may not survive "
                                      "a power loss");
    }
    if (!aside.empty()) Remove(aside);
    Prune();
    return Status::Ok();
  }

  // Removes a published checkpoint: renamed to a temporary name first, so
  // that a crash midway leaves nothing that looks like a checkpoint.
  void Remove(const std::string& path) {
    Status s = fs_->RemoveAll(path);
    if (!s.ok()) STRATA_LOG_WARN("checkpoint prune: {}", s.ToString());
  }

  void Prune() {
    StatusOr<std::vector<std::string>> names = fs_->List(options_.dir);
    if (!names.ok()) {
      STRATA_LOG_WARN("checkpoint prune: {}", names.status().ToString());
      return;
    }
    std::vector<std::pair<int64_t, std::string>> steps;
    for (const std::string& n : *names) {
      const int64_t step = ckpt::ParseStepDirName(n);
      if (step >= 0 && n != name_) steps.emplace_back(step, n);
    }
    std::sort(steps.rbegin(), steps.rend());
    bool removed = false;
    bool spared = false;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (i + 1 < static_cast<size_t>(options_.keep)) continue;  // kept
      // Note [Recycled files]: one pruned checkpoint is kept as the spare
      // (a writer adopted any earlier one at Begin).
      const bool keep_spare = options_.recycle && !spared;
      const std::string aside =
          keep_spare ? JoinPath(options_.dir, ckpt::kSpareName)
                     : JoinPath(options_.dir, std::string(ckpt::kTmpPrefix) +
                                                  "prune-" + steps[i].second);
      Status s = fs_->Rename(JoinPath(options_.dir, steps[i].second), aside);
      if (!s.ok()) {
        STRATA_LOG_WARN("checkpoint prune: {}", s.ToString());
        continue;
      }
      if (keep_spare) {
        spared = true;
      } else {
        Remove(aside);
      }
      removed = true;
    }
    if (removed) {
      Status s = fs_->SyncDir(options_.dir);
      if (!s.ok()) STRATA_LOG_WARN("checkpoint prune: {}", s.ToString());
    }
  }

  std::unique_ptr<CheckpointFs> owned_fs_;  // first: destroyed last
  CheckpointFs* const fs_;
  const CheckpointWriterOptions options_;
  const std::string name_;   // step-<N>
  const std::string final_;  // <dir>/step-<N>
  const std::string tmp_;    // <dir>/.tmp-step-<N>-<pid>
  std::unique_ptr<CheckpointFs::Lock> lock_;
  bool began_ = false;
  bool replace_ = false;
  // Note [Recycled files]: the entries of the adopted spare.
  std::vector<std::string> recycled_;

  Mutex mu_;
  CondVar cv_;
  Phase phase_ STRATA_GUARDED_BY(mu_) = Phase::kOpen;
  bool published_ STRATA_GUARDED_BY(mu_) = false;
  bool extents_started_ STRATA_GUARDED_BY(mu_) = false;
  std::vector<CheckpointTensor> tensors_ STRATA_GUARDED_BY(mu_);
  std::vector<uint64_t> elems_ STRATA_GUARDED_BY(mu_);
  std::vector<ExtentRecord> extents_ STRATA_GUARDED_BY(mu_);
  std::vector<BlobRecord> blobs_ STRATA_GUARDED_BY(mu_);
  std::array<RoleFile, kNumStateRoles> files_ STRATA_GUARDED_BY(mu_);
  int64_t pending_ STRATA_GUARDED_BY(mu_) = 0;
  Status first_error_ STRATA_GUARDED_BY(mu_);
};

}  // namespace

StatusOr<std::unique_ptr<CheckpointFs::File>> CheckpointFs::Overwrite(
    const std::string& path) {
  return Status::NotSupported("overwrite " + path +
                              ": this file layer creates new files only");
}

StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Begin(
    const CheckpointWriterOptions& options) {
  if (options.dir.empty()) {
    return Status::InvalidArgument("CheckpointWriterOptions::dir is empty");
  }
  if (options.step < 0) {
    return Status::InvalidArgument("CheckpointWriterOptions::step " +
                                   std::to_string(options.step) +
                                   " is not >= 0");
  }
  if (options.step > kMaxStep) {
    return Status::InvalidArgument("CheckpointWriterOptions::step " +
                                   std::to_string(options.step) +
                                   " is more than " + std::to_string(kMaxStep));
  }
  if (options.keep < 1) {
    return Status::InvalidArgument("CheckpointWriterOptions::keep " +
                                   std::to_string(options.keep) +
                                   " is not >= 1");
  }
  std::unique_ptr<CheckpointFs> owned;
  if (options.fs == nullptr) {
    STRATA_ASSIGN_OR_RETURN(owned, NewPosixCheckpointFs());
  }
  auto writer = std::make_unique<Writer>(options, std::move(owned));
  STRATA_RETURN_IF_ERROR(writer->Begin());
  return std::unique_ptr<CheckpointWriter>(std::move(writer));
}

}  // namespace strata
