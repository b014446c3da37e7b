// Reading and writing the safetensors format, in which Hugging Face publishes
// checkpoints (GPT-2's among them):
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  a UTF-8 JSON object: for each tensor
//                "name": {"dtype": "F32", "shape": [d0, d1, ...],
//                         "data_offsets": [begin, end]}
//              and optionally "__metadata__": {"key": "value", ...}
//   [rest]     the data buffer; offsets are relative to its start, the data
//              is little-endian and row-major (C order)
//
// The reader validates the whole header when it opens a file, so that a bad
// file fails there with a message naming the file and the tensor rather than
// later in a read: the header length against the file size and a 100 MB
// bound, the JSON (no duplicate keys at any level), each entry's fields and
// dtype, size == product(shape) * itemsize without overflow, and that the
// tensors tile the data buffer exactly (no overlap, no hole, no trailing
// bytes), as the format's specification requires. Tensor data is read with
// pread into the caller's memory (no mmap, so a file truncated while open is
// an error, not a SIGBUS).
//
// The writer streams: it writes the header first and then each tensor's bytes
// in the declared order, so a model can be exported block by block without
// holding it whole in memory. It writes to "<path>.tmp" and renames on
// Finish, so a reader never sees a half-written file under the final name.
#ifndef STRATA_EXAMPLES_FINETUNE_IO_SAFETENSORS_H_
#define STRATA_EXAMPLES_FINETUNE_IO_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::finetune {

// The element types of the format that this reader accepts. Others (U16,
// U32, U64, the F8 variants) are rejected with a message listing these.
enum class SafetensorsDType : uint8_t {
  kF64,
  kF32,
  kF16,   // IEEE binary16
  kBF16,  // the upper 16 bits of a binary32
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,  // one byte, 0 or 1
};

// "F32", "BF16", ...: the spelling of the format.
std::string_view SafetensorsDTypeName(SafetensorsDType dtype);
// The dtype spelled `name`; kInvalidArgument listing the accepted names.
StatusOr<SafetensorsDType> SafetensorsDTypeFromName(std::string_view name);
// Bytes per element: 8, 4, 2 or 1.
size_t SafetensorsDTypeSize(SafetensorsDType dtype);

// "[2, 3]": a shape as error messages print it.
std::string FormatShape(std::span<const int64_t> shape);

// Converts n = dst.size() elements of `dtype` (little-endian, src.size() ==
// n * SafetensorsDTypeSize(dtype)) to fp32. fp16 and bf16 convert exactly;
// F64 and the integers round to nearest. kInvalidArgument when the sizes
// disagree.
Status ConvertToFloat32(SafetensorsDType dtype, std::span<const std::byte> src,
                        std::span<float> dst);

// One tensor of an open file.
struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  uint64_t data_begin = 0;     // offset in the data buffer, bytes
  uint64_t data_end = 0;       // one past the last byte

  uint64_t bytes() const { return data_end - data_begin; }
  int64_t numel() const;  // product of shape; 1 for a scalar
};

// The validated header of a safetensors file.
struct SafetensorsHeader {
  // Every tensor, in the order of their data (ascending data_begin).
  std::vector<SafetensorsTensorInfo> tensors;
  // "__metadata__" (empty when the header has none).
  std::map<std::string, std::string> metadata;
};

// Validates the JSON header `text` of a file whose data buffer (what follows
// the header) is `data_size` bytes, as SafetensorsFile::Open does once it has
// read them (Open's own check, so that a header held in memory, such as a
// fuzzer's input, is held to the same rules). kCorruption with `path`, the
// tensor and the offending value in the message.
StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view text,
                                                   uint64_t data_size,
                                                   const std::string& path);

// A validated safetensors file, open for reading. Move-only; owns its file
// descriptor. Thread-compatible, and the const reads may run concurrently
// (pread shares no file offset).
class SafetensorsFile final {
 public:
  // Opens and validates `path`. kNotFound / kPermissionDenied / kIoError from
  // the OS; kCorruption for a file that is not valid safetensors, with the
  // path, the tensor and the offending value in the message.
  static StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Every tensor, in the order of their data (ascending data_begin).
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  // The tensor called `name`, or nullptr.
  const SafetensorsTensorInfo* Find(std::string_view name) const;
  // "__metadata__" (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }
  // File offset of the data buffer: 8 + header length.
  uint64_t data_offset() const { return data_offset_; }

  // Reads the raw bytes of `name` (out.size() must equal its bytes()).
  // kNotFound for an unknown name, kInvalidArgument for a size mismatch,
  // kIoError / kCorruption (file shrank) from the read.
  Status ReadRaw(std::string_view name, std::span<std::byte> out) const;
  // Reads out.size() bytes of `name` from byte `offset` within it (a range
  // past its end is kOutOfRange), for streaming a large tensor in pieces.
  Status ReadRaw(std::string_view name, uint64_t offset,
                 std::span<std::byte> out) const;
  // Reads `name` converted to fp32 (out.size() must equal its numel()),
  // through a bounded staging buffer for the 16-bit and 64-bit types.
  Status ReadFloat32(std::string_view name, std::span<float> out) const;
  StatusOr<std::vector<float>> ReadFloat32(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  Status ReadAt(uint64_t file_offset, std::span<std::byte> out,
                std::string_view what) const;
  StatusOr<const SafetensorsTensorInfo*> Lookup(std::string_view name) const;

  std::string path_;
  int fd_ = -1;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> tensors_[i]
  std::map<std::string, std::string> metadata_;
};

// What the writer is told about one tensor before any data.
struct SafetensorsTensorSpec {
  std::string name;  // non-empty, not "__metadata__", unique
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;  // each dimension >= 0
};

// Writes one safetensors file. Declare every tensor at Create, then hand
// each tensor's bytes with Write in the declared order (in one or several
// calls per tensor), then Finish. Move-only; thread-compatible. Destroying an
// unfinished writer removes its temporary file.
class SafetensorsWriter final {
 public:
  // Validates the specs (names, shapes, size overflow) and writes the header
  // into "<path>.tmp". The header is padded with spaces so that the data
  // buffer starts at a multiple of 8 bytes.
  static StatusOr<SafetensorsWriter> Create(
      const std::string& path, std::vector<SafetensorsTensorSpec> specs,
      const std::map<std::string, std::string>& metadata = {});

  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // Appends bytes of the current tensor; a call may not run past its end
  // (kInvalidArgument naming the tensor and the sizes).
  Status Write(std::span<const std::byte> bytes);
  // Checks that every declared byte was written, fsyncs and renames the
  // temporary file to the final path.
  Status Finish();

 private:
  SafetensorsWriter() = default;
  void Abandon();

  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  std::vector<SafetensorsTensorSpec> specs_;
  std::vector<uint64_t> sizes_;
  size_t current_ = 0;         // index of the tensor being written
  uint64_t current_done_ = 0;  // bytes of it written so far
};

// One tensor with its bytes, for WriteSafetensors.
struct SafetensorsTensorData {
  SafetensorsTensorSpec spec;
  std::span<const std::byte> data;
};

// Writes a whole file in one call (tests, small exports).
Status WriteSafetensors(
    const std::string& path, std::span<const SafetensorsTensorData> tensors,
    const std::map<std::string, std::string>& metadata = {});

}  // namespace strata::finetune

#endif  // STRATA_EXAMPLES_FINETUNE_IO_SAFETENSORS_H_
