// Checkpoints of the training state: crash-safe, streamed, and stored by
// tensor name and global shape, so that one written with one partition
// layout loads into another.
//
// A checkpoint directory holds checkpoints named "step-<N>" (N zero-padded to
// 12 digits, so that names sort by step) and a file "latest" naming the newest
// complete one. A checkpoint is written under a temporary name
// (".tmp-step-<N>-<pid>"): its data files, fsynced; then its manifest
// (MANIFEST.json, carrying its own checksum and one per file and per extent),
// fsynced; then the directory is fsynced, renamed to its final name, and the
// parent fsynced; only then is "latest" replaced (written to a temporary file,
// fsynced, renamed, parent fsynced). A crash at any moment leaves "latest"
// naming either the old or the new checkpoint, each complete. Temporary
// directories of writers that are gone are removed by the next writer (a
// lock file in the directory, held with flock, says which writer is alive).
// After a commit, checkpoints beyond CheckpointWriterOptions::keep are
// removed, oldest first; the one "latest" names never is.
//
// Data: each role (StateRole) has one data file, an append-only sequence of
// extents. An extent is one buffer handed to WriteExtent: a run of elements
// of that role, with placements saying which elements of which tensors it
// holds. Each extent starts at an offset aligned to kCheckpointAlign, so that
// it can be written and read with direct I/O straight from the caller's
// buffer; each has an XXH3-64 checksum, verified on every read before a
// byte of it is used. A file's checksum is the XXH3-64 of its extents'
// checksums in file order.
//
// Thread contract: CheckpointWriter and CheckpointReader are thread-safe;
// WriteExtent and Read may be called from several threads at once.
#ifndef STRATA_CHECKPOINT_H_
#define STRATA_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/device.h"
#include "strata/export.h"
#include "strata/status.h"

namespace strata {

class AsyncIo;

// Alignment of every extent in a data file, and of the buffers and sizes that
// WriteExtent accepts (bytes).
inline constexpr size_t kCheckpointAlign = 4096;

// The state a checkpoint stores for each trainable parameter.
enum class StateRole : uint8_t {
  kMaster,    // fp32 master weights
  kExpAvg,    // fp32 first moment
  kExpAvgSq,  // fp32 second moment
  kParam,     // the working-precision copy (its tensor's dtype); optional
};
inline constexpr int kNumStateRoles = 4;
// "master", "exp_avg", "exp_avg_sq", "param".
STRATA_EXPORT std::string_view StateRoleName(StateRole role);
// The element type a role is stored in, for a tensor of working dtype `dtype`.
STRATA_EXPORT ElementType StateRoleType(StateRole role, ElementType dtype);

// A tensor as a checkpoint knows it: by name and global shape.
struct CheckpointTensor {
  std::string name;
  std::vector<int64_t> shape;
  ElementType dtype = ElementType::kBFloat16;  // working precision
};

// Elements [tensor_offset, tensor_offset + elems) of tensor `tensor` (an index
// into the tensors added or listed) sit at element `extent_offset` of an
// extent (or of a buffer to fill).
struct StatePlacement {
  uint32_t tensor = 0;
  uint64_t tensor_offset = 0;
  uint64_t extent_offset = 0;
  uint64_t elems = 0;
};

// The filesystem a checkpoint is written through: POSIX in production, an
// in-memory model that forgets what was not synced in the crash tests.
// Data files are written and read asynchronously; everything else blocks.
// Paths are plain strings that no shell ever sees.
class STRATA_EXPORT CheckpointFs {
 public:
  virtual ~CheckpointFs() = default;

  class File {
   public:
    virtual ~File() = default;
    // `buf`'s address and size, and `offset`, are multiples of
    // kCheckpointAlign for writes. `done` runs exactly once, on any thread,
    // with OK only when every byte was transferred; `buf` must stay valid
    // until then. A read past the end of the file is kCorruption.
    virtual void Write(uint64_t offset, std::span<const std::byte> buf,
                       std::function<void(Status)> done) = 0;
    virtual void Read(uint64_t offset, std::span<std::byte> buf,
                      std::function<void(Status)> done) = 0;
    // Durable: returns once every completed write is on stable storage.
    virtual Status Sync() = 0;
    virtual StatusOr<uint64_t> Size() = 0;
  };

  // Creates a new file (kAlreadyExists if there is one), mode 0600.
  virtual StatusOr<std::unique_ptr<File>> Create(const std::string& path) = 0;
  // Opens an existing file to write over its bytes (kNotFound if absent):
  // its space is reused, and Sync cuts it to the end of what was written
  // through this handle. The writer uses it for the files of a pruned
  // checkpoint (CheckpointWriterOptions::recycle). The default is
  // kNotSupported, and the writer then creates new files.
  virtual StatusOr<std::unique_ptr<File>> Overwrite(const std::string& path);
  virtual StatusOr<std::unique_ptr<File>> Open(const std::string& path) = 0;
  // Small whole files (the manifest, "latest"). WriteSmall creates or
  // truncates, writes and fsyncs.
  virtual StatusOr<std::string> ReadSmall(const std::string& path) = 0;
  virtual Status WriteSmall(const std::string& path, std::string_view data) = 0;
  // Atomically replaces `to` (a file or an empty directory) by `from`.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  virtual Status SyncDir(const std::string& dir) = 0;
  // Creates a directory (OK if it exists), mode 0700.
  virtual Status MakeDir(const std::string& path) = 0;
  // Removes a file, or a directory and everything under it (no symlink is
  // followed). OK if absent.
  virtual Status RemoveAll(const std::string& path) = 0;
  // Names in a directory (no "." or ".."), kNotFound if it is absent.
  virtual StatusOr<std::vector<std::string>> List(const std::string& dir) = 0;

  // Held while a writer works in a directory; released when destroyed.
  class Lock {
   public:
    virtual ~Lock() = default;
  };
  // Takes the writers' lock of `dir` (POSIX: an flock on a lock file in it,
  // which also excludes a second writer of the same process). kBusy naming
  // the holder's pid when it is taken.
  virtual StatusOr<std::unique_ptr<Lock>> LockDir(const std::string& dir) = 0;
};

// POSIX files with the data path on `io` (not owned; it must outlive the
// returned object and every file opened through it). `io` null: a private
// AsyncIo with the default options.
STRATA_EXPORT StatusOr<std::unique_ptr<CheckpointFs>> NewPosixCheckpointFs(
    AsyncIo* io = nullptr);

struct CheckpointWriterOptions {
  std::string dir;   // the checkpoint directory; created if missing
  int64_t step = 0;  // >= 0; names the checkpoint
  // Complete checkpoints kept after a commit, this one included; >= 1.
  int keep = 2;
  // The data files of the checkpoint a commit prunes are kept aside (one
  // checkpoint's worth, in a temporary entry of `dir`) and the next save
  // writes over them instead of creating files. Writing over space a file
  // already has is faster than allocating it (on ext4 the new extents must
  // be converted and committed), and renaming takes the deletion, a large
  // part of a commit, out of the save. Costs the space of one more
  // checkpoint between saves; a published checkpoint is never written to.
  // Default on.
  bool recycle = true;
  // Not owned; must outlive the writer. Null: NewPosixCheckpointFs().
  CheckpointFs* fs = nullptr;
};

// One checkpoint being written. Destroying it before Commit returns (or
// after a failed Commit) waits for its writes and removes its temporary
// directory; the checkpoint directory is then as it was.
class STRATA_EXPORT CheckpointWriter {
 public:
  // Locks `dir` (kBusy naming the other writer's pid while another process
  // writes there), removes temporary directories of writers that are gone,
  // and creates this checkpoint's. kAlreadyExists if "step-<N>" exists and
  // is the one "latest" names; one that "latest" does not name (a commit
  // cut short between its rename and "latest", or a checkpoint superseded)
  // is replaced by this one at Commit.
  static StatusOr<std::unique_ptr<CheckpointWriter>> Begin(
      const CheckpointWriterOptions& options);
  virtual ~CheckpointWriter() = default;

  // Declares a tensor (unique name, every dimension > 0); all of them
  // before the first WriteExtent. Returns its index for placements.
  virtual StatusOr<uint32_t> AddTensor(const CheckpointTensor& tensor) = 0;

  // Appends `data` to `role`'s file at the next aligned offset and records
  // its placements (validated: inside the tensor and inside `data`, the
  // element type being StateRoleType of each tensor's dtype, which must be
  // the same for all of them; placements non-empty). `data`'s address and
  // size must be positive multiples
  // of kCheckpointAlign (pad the buffer; the padding is stored and
  // checksummed with the rest). `data` stays valid until `done` runs (once,
  // on any thread). A refused call returns the error and `done` never runs.
  // A role written at least once must, by Commit, cover every element of
  // every tensor exactly once with its extents (Commit fails with
  // kFailedPrecondition naming the first range missing or stored twice).
  // After a refused or failed write, later calls return that error.
  virtual Status WriteExtent(StateRole role, std::span<const std::byte> data,
                             std::vector<StatePlacement> placements,
                             std::function<void(Status)> done) = 0;

  // A named blob of bytes (the trainer's and the engine's small state: step
  // count, loss scale, data position, random state), stored checksummed.
  virtual Status PutBlob(std::string_view name, std::string_view bytes) = 0;

  // Waits for every extent, checks coverage, syncs, writes the manifest,
  // publishes the checkpoint and replaces "latest", then prunes to `keep`.
  // Returns the checkpoint's path. The first error of any write is returned
  // here and nothing is published.
  virtual StatusOr<std::string> Commit() = 0;

 protected:
  CheckpointWriter() = default;
};

// A complete checkpoint, opened for reading.
class STRATA_EXPORT CheckpointReader {
 public:
  // `path`: a checkpoint directory ("step-<N>"), or a directory of
  // checkpoints, whose "latest" is opened. Verifies the manifest's own
  // checksum, its contents (every extent inside its file, every placement
  // inside its tensor and extent, full coverage of every stored role) and
  // every data file's presence and size; a failure is kCorruption or
  // kNotFound naming the file. Does not read the data (Read and Verify do).
  // `fs` as for the writer.
  static StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& path, CheckpointFs* fs = nullptr);
  virtual ~CheckpointReader() = default;

  virtual const std::string& path() const = 0;  // the checkpoint's directory
  virtual int64_t step() const = 0;
  virtual const std::vector<CheckpointTensor>& tensors() const = 0;
  // Index of a tensor by name, or kNotFound.
  virtual StatusOr<uint32_t> Find(std::string_view name) const = 0;
  virtual bool HasRole(StateRole role) const = 0;
  virtual StatusOr<std::string> Blob(std::string_view name) const = 0;

  // Fills `out` with the placements' elements of `role` (StateRoleType of
  // the tensors' dtype; placements index tensors()), reading and verifying
  // every extent that holds them; bytes of `out` no placement covers are
  // left as they are, except on the fast path: when one stored extent has
  // exactly these placements, `out` is aligned and holds at least the
  // extent's bytes, the extent is read straight into `out` (its padding
  // and gaps included). A checksum mismatch is kCorruption naming the file
  // and the offset; after any error `out`'s contents are unspecified and
  // must not be used.
  virtual Status Read(StateRole role,
                      std::span<const StatePlacement> placements,
                      std::span<std::byte> out) = 0;
  // Reads and verifies every extent of every file.
  virtual Status Verify() = 0;

 protected:
  CheckpointReader() = default;
};

}  // namespace strata

#endif  // STRATA_CHECKPOINT_H_
