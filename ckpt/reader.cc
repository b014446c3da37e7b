// CheckpointReader: opens a checkpoint after checking its manifest and
// files, and reads placements of it, verifying every extent before use.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/paths.h"
#include "strata/async_io.h"
#include "strata/checkpoint.h"

namespace strata {

namespace ckpt {

StatusOr<std::string> ReadLatest(CheckpointFs& fs, const std::string& dir) {
  const std::string path = JoinPath(dir, kLatestName);
  STRATA_ASSIGN_OR_RETURN(std::string text, fs.ReadSmall(path));
  std::string name = text;
  if (!name.empty() && name.back() == '\n') name.pop_back();
  if (ParseStepDirName(name) < 0) {
    if (name.size() > 64) name = name.substr(0, 64) + "...";
    return Status::Corruption(path + ": names '" + name +
                              "', which is not a checkpoint step-<N>");
  }
  return name;
}

}  // namespace ckpt

namespace {

using ckpt::ExtentRecord;
using ckpt::JoinPath;

// An aligned buffer for direct reads, grown on demand.
class Bounce {
 public:
  std::span<std::byte> Get(size_t bytes) {
    if (bytes > size_) {
      buf_.reset(
          static_cast<std::byte*>(std::aligned_alloc(kCheckpointAlign, bytes)));
      size_ = buf_ ? bytes : 0;
    }
    return buf_ ? std::span<std::byte>(buf_.get(), bytes)
                : std::span<std::byte>();
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> buf_;
  size_t size_ = 0;
};

class Reader final : public CheckpointReader {
 public:
  Reader(std::unique_ptr<CheckpointFs> owned_fs, CheckpointFs* fs)
      : owned_fs_(std::move(owned_fs)), fs_(fs) {}
  ~Reader() override {
    for (auto& f : files_) f.reset();  // before a private fs goes
  }

  Status Open(const std::string& path) {
    StatusOr<std::string> latest = ckpt::ReadLatest(*fs_, path);
    if (latest.ok()) {
      dir_ = JoinPath(path, *latest);
    } else if (latest.status().code() == StatusCode::kNotFound) {
      dir_ = path;
    } else {
      return latest.status();
    }
    const std::string mpath = JoinPath(dir_, ckpt::kManifestName);
    StatusOr<std::string> text = fs_->ReadSmall(mpath);
    if (!text.ok()) {
      if (text.status().code() == StatusCode::kNotFound && !latest.ok()) {
        return Status::NotFound("no checkpoint at " + path + ": neither " +
                                JoinPath(path, ckpt::kLatestName) + " nor " +
                                mpath + " exists");
      }
      return text.status();
    }
    STRATA_ASSIGN_OR_RETURN(manifest_, ckpt::ParseManifest(*text, mpath));
    const int64_t dir_step = ckpt::ParseStepDirName(ckpt::BaseName(dir_));
    if (dir_step >= 0 && dir_step != manifest_.step) {
      return Status::Corruption(
          mpath + ": records step " + std::to_string(manifest_.step) +
          ", but its directory is step " + std::to_string(dir_step) +
          " (the manifest of another checkpoint)");
    }
    for (const ckpt::FileRecord& rec : manifest_.files) {
      const std::string fpath = JoinPath(dir_, rec.name);
      const auto r = static_cast<size_t>(rec.role);
      STRATA_ASSIGN_OR_RETURN(files_[r], fs_->Open(fpath));
      paths_[r] = fpath;
      STRATA_ASSIGN_OR_RETURN(uint64_t size, files_[r]->Size());
      if (size != rec.size) {
        return Status::Corruption(fpath + ": " + std::to_string(size) +
                                  " bytes, but the manifest records " +
                                  std::to_string(rec.size));
      }
    }
    for (const CheckpointTensor& t : manifest_.tensors) {
      elems_.push_back(ckpt::TensorElems(t, t.name).value_or(0));
      by_name_.emplace(t.name, static_cast<uint32_t>(by_name_.size()));
    }
    for (auto& role : index_) role.resize(manifest_.tensors.size());
    for (size_t i = 0; i < manifest_.extents.size(); ++i) {
      const ExtentRecord& e = manifest_.extents[i];
      for (const StatePlacement& p : e.placements) {
        index_[static_cast<size_t>(e.role)][p.tensor].push_back(
            {p.tensor_offset, p.elems, i, p.extent_offset});
      }
    }
    for (auto& role : index_) {
      for (auto& pieces : role) {
        std::sort(pieces.begin(), pieces.end(),
                  [](const Piece& a, const Piece& b) {
                    return a.tensor_offset < b.tensor_offset;
                  });
      }
    }
    return Status::Ok();
  }

  const std::string& path() const override { return dir_; }
  int64_t step() const override { return manifest_.step; }
  const std::vector<CheckpointTensor>& tensors() const override {
    return manifest_.tensors;
  }
  StatusOr<uint32_t> Find(std::string_view name) const override {
    auto it = by_name_.find(std::string(name));
    if (it == by_name_.end()) {
      return Status::NotFound("checkpoint " + dir_ + " has no tensor '" +
                              std::string(name) + "'");
    }
    return it->second;
  }
  bool HasRole(StateRole role) const override {
    const auto r = static_cast<size_t>(role);
    return r < files_.size() && files_[r] != nullptr;
  }
  StatusOr<std::string> Blob(std::string_view name) const override {
    for (const ckpt::BlobRecord& b : manifest_.blobs) {
      if (b.name == name) return b.bytes;
    }
    return Status::NotFound("checkpoint " + dir_ + " has no blob '" +
                            std::string(name) + "'");
  }

  Status Read(StateRole role, std::span<const StatePlacement> placements,
              std::span<std::byte> out) override {
    if (!HasRole(role)) {
      return Status::NotFound("checkpoint " + dir_ + " stores no " +
                              std::string(StateRoleName(role)) + " state");
    }
    const auto r = static_cast<size_t>(role);
    STRATA_RETURN_IF_ERROR(ckpt::CheckPlacements(manifest_.tensors, elems_,
                                                 role, out.size(), placements,
                                                 "Read placements"));
    if (placements.empty()) return Status::Ok();
    const size_t esize = ckpt::StoredElemBytes(
        role, manifest_.tensors[placements[0].tensor].dtype);

    // Fast path: one stored extent with exactly these placements.
    if (reinterpret_cast<uintptr_t>(out.data()) % kCheckpointAlign == 0) {
      const StatePlacement& p0 = placements[0];
      const auto& pieces = index_[r][p0.tensor];
      auto it = std::lower_bound(
          pieces.begin(), pieces.end(), p0.tensor_offset,
          [](const Piece& p, uint64_t v) { return p.tensor_offset < v; });
      if (it != pieces.end() && it->tensor_offset == p0.tensor_offset) {
        const ExtentRecord& e = manifest_.extents[it->extent];
        if (out.size() >= e.bytes && SamePlacements(e.placements, placements)) {
          return ReadExtent(e, out.first(e.bytes));
        }
      }
    }

    // Otherwise: every extent holding a part, whole, through a bounce
    // buffer, verified before its bytes are copied out.
    struct Copy {
      size_t extent;
      uint64_t src;  // element in the extent
      uint64_t dst;  // element in `out`
      uint64_t elems;
    };
    std::vector<Copy> copies;
    for (const StatePlacement& p : placements) {
      const auto& pieces = index_[r][p.tensor];
      const uint64_t begin = p.tensor_offset;
      const uint64_t end = p.tensor_offset + p.elems;
      // The last piece starting at or before `begin`.
      auto it = std::upper_bound(
          pieces.begin(), pieces.end(), begin,
          [](uint64_t v, const Piece& q) { return v < q.tensor_offset; });
      if (it != pieces.begin()) --it;
      for (; it != pieces.end() && it->tensor_offset < end; ++it) {
        const uint64_t lo = std::max(begin, it->tensor_offset);
        const uint64_t hi = std::min(end, it->tensor_offset + it->elems);
        if (lo >= hi) continue;
        copies.push_back({it->extent,
                          it->extent_offset + (lo - it->tensor_offset),
                          p.extent_offset + (lo - begin), hi - lo});
      }
    }
    std::sort(copies.begin(), copies.end(),
              [](const Copy& a, const Copy& b) { return a.extent < b.extent; });
    Bounce bounce;
    for (size_t i = 0; i < copies.size();) {
      const ExtentRecord& e = manifest_.extents[copies[i].extent];
      std::span<std::byte> buf = bounce.Get(e.bytes);
      if (buf.empty()) {
        return Status::OutOfMemory("no " + std::to_string(e.bytes) +
                                   " bytes to read an extent of " + paths_[r] +
                                   " into");
      }
      STRATA_RETURN_IF_ERROR(ReadExtent(e, buf));
      size_t k = i;
      for (; k < copies.size() && copies[k].extent == copies[i].extent; ++k) {
        std::memcpy(out.data() + copies[k].dst * esize,
                    buf.data() + copies[k].src * esize,
                    copies[k].elems * esize);
      }
      i = k;
    }
    return Status::Ok();
  }

  Status Verify() override {
    Bounce bounce;
    for (const ExtentRecord& e : manifest_.extents) {
      std::span<std::byte> buf = bounce.Get(e.bytes);
      if (buf.empty()) {
        return Status::OutOfMemory("no " + std::to_string(e.bytes) +
                                   " bytes to verify an extent into");
      }
      STRATA_RETURN_IF_ERROR(ReadExtent(e, buf));
    }
    return Status::Ok();
  }

 private:
  struct Piece {
    uint64_t tensor_offset;
    uint64_t elems;
    size_t extent;  // index into manifest_.extents
    uint64_t extent_offset;
  };

  static bool SamePlacements(const std::vector<StatePlacement>& a,
                             std::span<const StatePlacement> b) {
    return a.size() == b.size() &&
           std::equal(a.begin(), a.end(), b.begin(),
                      [](const StatePlacement& x, const StatePlacement& y) {
                        return x.tensor == y.tensor &&
                               x.tensor_offset == y.tensor_offset &&
                               x.extent_offset == y.extent_offset &&
                               x.elems == y.elems;
                      });
  }

  // Reads extent `e` into `buf` (its size, aligned) and checks its checksum.
  Status ReadExtent(const ExtentRecord& e, std::span<std::byte> buf) {
    const auto r = static_cast<size_t>(e.role);
    const std::string& path = paths_[r];
    IoTicket ticket;
    files_[r]->Read(e.offset, buf, ticket.Setter());
    Status s = ticket.Wait();
    if (!s.ok()) {
      if (s.message().find(path) == std::string::npos) {
        s = std::move(s).WithContext("read " + path + " at offset " +
                                     std::to_string(e.offset));
      }
      return s;
    }
    const uint64_t got = Xxh3(buf);
    if (got != e.xxh3) {
      return Status::Corruption(path + " at offset " +
                                std::to_string(e.offset) + ": the " +
                                std::to_string(e.bytes) +
                                "-byte extent there does not match its "
                                "checksum (data changed after it was written)");
    }
    return Status::Ok();
  }

  std::unique_ptr<CheckpointFs> owned_fs_;  // first: destroyed last
  CheckpointFs* const fs_;
  std::string dir_;
  ckpt::Manifest manifest_;
  std::vector<uint64_t> elems_;
  std::unordered_map<std::string, uint32_t> by_name_;
  std::array<std::unique_ptr<CheckpointFs::File>, kNumStateRoles> files_;
  std::array<std::string, kNumStateRoles> paths_;
  // Per role, per tensor: the stored pieces by tensor offset.
  std::array<std::vector<std::vector<Piece>>, kNumStateRoles> index_;
};

}  // namespace

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& path, CheckpointFs* fs) {
  std::unique_ptr<CheckpointFs> owned;
  if (fs == nullptr) {
    STRATA_ASSIGN_OR_RETURN(owned, NewPosixCheckpointFs());
    fs = owned.get();
  }
  auto reader = std::make_unique<Reader>(std::move(owned), fs);
  STRATA_RETURN_IF_ERROR(reader->Open(path));
  return std::unique_ptr<CheckpointReader>(std::move(reader));
}

}  // namespace strata
