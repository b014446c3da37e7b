// The checkpoint manifest (MANIFEST.json): what a checkpoint holds and the
// checksums that prove it, in memory and as text. Internal to ckpt/; the
// parser is exposed here for the writer, the reader and the fuzz target.
//
// Text: a JSON object, a newline, then one line "xxh3 <16 hex digits>\n"
// holding the XXH3-64 of every byte before it (docs/checkpoints.md).
#ifndef STRATA_CKPT_MANIFEST_H_
#define STRATA_CKPT_MANIFEST_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/checkpoint.h"
#include "strata/status.h"
#include "util/checksum.h"

namespace strata::ckpt {

inline constexpr std::string_view kFormatName = "strata-checkpoint";
inline constexpr int64_t kFormatVersion = 1;
inline constexpr std::string_view kManifestName = "MANIFEST.json";
inline constexpr std::string_view kLatestName = "latest";
// A manifest larger than this is refused before it is read (bytes).
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;
// Limits the parser enforces (so a hostile manifest cannot make it allocate
// without bound or overflow): dimensions per tensor, name length in bytes,
// elements per tensor, blob bytes in all.
inline constexpr size_t kMaxDims = 16;
inline constexpr size_t kMaxNameBytes = 4096;
inline constexpr uint64_t kMaxElems = uint64_t{1} << 56;
inline constexpr uint64_t kMaxBlobBytes = uint64_t{256} << 20;

struct FileRecord {
  StateRole role = StateRole::kMaster;
  std::string name;  // DataFileName(role)
  uint64_t size = 0;
  uint64_t xxh3 = 0;  // FileChecksum of its extents
};

struct ExtentRecord {
  StateRole role = StateRole::kMaster;
  uint64_t offset = 0;  // bytes, a multiple of kCheckpointAlign
  uint64_t bytes = 0;   // a multiple of kCheckpointAlign, > 0
  uint64_t xxh3 = 0;    // of the extent's bytes
  std::vector<StatePlacement> placements;
};

struct BlobRecord {
  std::string name;
  std::string bytes;
};

struct Manifest {
  int64_t step = 0;
  std::vector<CheckpointTensor> tensors;
  std::vector<FileRecord> files;      // at most one per role
  std::vector<ExtentRecord> extents;  // by role, then by offset
  std::vector<BlobRecord> blobs;      // names unique
};

// "master.bin", ...: the data file of a role.
std::string DataFileName(StateRole role);
// "step-<N>" with N zero-padded to 12 digits.
std::string StepDirName(int64_t step);
// The step of a "step-<N>" name, or -1 when `name` is not one.
int64_t ParseStepDirName(std::string_view name);

// Bytes per element of `role` for a tensor of working type `dtype`.
size_t StoredElemBytes(StateRole role, ElementType dtype);

// XXH3-64 of the extents' checksums (little-endian 64-bit words) in order.
uint64_t FileChecksum(std::span<const ExtentRecord* const> extents);
// Elements of a tensor (product of its shape); kInvalidArgument when a
// dimension is <= 0 or the product exceeds kMaxElems. `what` names it.
StatusOr<uint64_t> TensorElems(const CheckpointTensor& tensor,
                               std::string_view what);

// Checks that `role`'s extents cover every element of every tensor exactly
// once; the error (kCorruption for a reader, the caller re-codes it) names
// the tensor and the first element range missing or covered twice.
Status CheckCoverage(const std::vector<CheckpointTensor>& tensors,
                     StateRole role,
                     std::span<const ExtentRecord* const> extents);

// Validates an extent's placements against the tensors and the extent's
// size: in range, no overflow, one element type for all. `where` prefixes
// the message (a JSON path, or the caller's words). kInvalidArgument.
Status CheckPlacements(const std::vector<CheckpointTensor>& tensors,
                       const std::vector<uint64_t>& tensor_elems,
                       StateRole role, uint64_t extent_bytes,
                       std::span<const StatePlacement> placements,
                       std::string_view where);

// True when `name` is valid UTF-8 (the manifest stores names as JSON
// strings).
bool IsUtf8(std::string_view name);

// The manifest's text, trailing checksum line included.
std::string SerializeManifest(const Manifest& manifest);

// Parses and validates a manifest's text: its checksum line, the JSON, every
// field (types, ranges, names), every extent inside its file and aligned,
// extents of a file contiguous from offset 0 to its size, the file checksums,
// every placement inside its tensor and extent, and full coverage of every
// stored role. Never asserts, whatever the input; allocations are bounded by
// the input's size. Errors are kCorruption: "<file>: <JSON path>: <what>".
StatusOr<Manifest> ParseManifest(std::string_view text, std::string_view file);

}  // namespace strata::ckpt

#endif  // STRATA_CKPT_MANIFEST_H_
