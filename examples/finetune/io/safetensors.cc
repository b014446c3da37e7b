#include "examples/finetune/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "strata/cpu_adam.h"

namespace strata::finetune {
namespace {

using nlohmann::json;

// The reference implementation's bound; a larger length is a corrupt or
// hostile file, and would otherwise make the reader allocate it.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Staging for conversions: bounded so a 300 MB embedding does not double.
constexpr size_t kStageBytes = 4 << 20;

struct DTypeEntry {
  SafetensorsDType dtype;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeEntry, 10> kDTypes = {{
    {SafetensorsDType::kF64, "F64", 8},
    {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},
    {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kI8, "I8", 1},
    {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kBool, "BOOL", 1},
}};

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

// Element count times itemsize, or false on overflow.
bool ByteSize(const std::vector<int64_t>& shape, size_t itemsize,
              uint64_t* bytes) {
  uint64_t n = itemsize;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *bytes = n;
  return true;
}

template <typename T>
void ConvertLoop(std::span<const std::byte> src, std::span<float> dst) {
  for (size_t i = 0; i < dst.size(); ++i) {
    T v;
    std::memcpy(&v, src.data() + i * sizeof(T), sizeof(T));
    dst[i] = static_cast<float>(v);
  }
}

Status WriteAll(int fd, std::span<const std::byte> bytes,
                const std::string& path) {
  const std::byte* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "writing " + path);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Parses the header text. Duplicate keys are an error at any depth
// (nlohmann keeps the last silently, which would hide a tensor).
StatusOr<json> ParseHeader(std::string_view text, const std::string& path) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event,
                                   json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() &&
            !keys.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    return Status::Corruption(path +
                              ": the header is not valid JSON: " + e.what());
  }
  if (!duplicate.empty()) {
    return Status::Corruption(path + ": the header names " + Quote(duplicate) +
                              " twice");
  }
  if (!header.is_object()) {
    return Status::Corruption(path + ": the header is JSON but not an object");
  }
  return header;
}

StatusOr<SafetensorsTensorInfo> ParseEntry(const std::string& name,
                                           const json& entry,
                                           const std::string& path) {
  const std::string where = path + ": tensor " + Quote(name);
  if (name.empty()) return Status::Corruption(path + ": a tensor has no name");
  if (!entry.is_object()) {
    return Status::Corruption(where + ": entry is not a JSON object");
  }
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Status::Corruption(
          where + ": unknown field " + Quote(key) +
          " (a tensor has only dtype, shape and data_offsets)");
    }
  }
  SafetensorsTensorInfo info;
  info.name = name;
  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) {
    return Status::Corruption(where + ": dtype is missing or not a string");
  }
  auto dtype = SafetensorsDTypeFromName(dt->get<std::string>());
  if (!dtype.ok()) {
    return Status::Corruption(where + ": " +
                              std::string(dtype.status().message()));
  }
  info.dtype = *dtype;
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return Status::Corruption(where + ": shape is missing or not an array");
  }
  for (const json& d : *shape) {
    if (!d.is_number_unsigned() ||
        d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Status::Corruption(where + ": shape " + shape->dump() +
                                " has an entry that is not an integer >= 0");
    }
    info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  auto off = entry.find("data_offsets");
  if (off == entry.end() || !off->is_array() || off->size() != 2 ||
      !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
    return Status::Corruption(
        where + ": data_offsets must be [begin, end], two integers >= 0");
  }
  info.data_begin = (*off)[0].get<uint64_t>();
  info.data_end = (*off)[1].get<uint64_t>();
  if (info.data_end < info.data_begin) {
    return Status::Corruption(where + ": data_offsets " + off->dump() +
                              " end before they begin");
  }
  uint64_t want = 0;
  if (!ByteSize(info.shape, SafetensorsDTypeSize(info.dtype), &want)) {
    return Status::Corruption(where + ": shape " + FormatShape(info.shape) +
                              " overflows 64 bits of bytes");
  }
  if (want != info.bytes()) {
    return Status::Corruption(
        where + ": shape " + FormatShape(info.shape) + " of " +
        std::string(SafetensorsDTypeName(info.dtype)) + " is " +
        std::to_string(want) + " bytes but data_offsets " + off->dump() +
        " span " + std::to_string(info.bytes()));
  }
  return info;
}

}  // namespace

std::string FormatShape(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string_view SafetensorsDTypeName(SafetensorsDType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

StatusOr<SafetensorsDType> SafetensorsDTypeFromName(std::string_view name) {
  std::string accepted;
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) return e.dtype;
    accepted += accepted.empty() ? "" : ", ";
    accepted += e.name;
  }
  return Status::InvalidArgument("dtype " + Quote(name) +
                                 " is not supported (accepted: " + accepted +
                                 ")");
}

size_t SafetensorsDTypeSize(SafetensorsDType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 1;
}

int64_t SafetensorsTensorInfo::numel() const {
  // A zero dimension empties the tensor whatever the others are, and the
  // header check lets those be up to INT64_MAX: multiplying in order could
  // overflow before reaching the zero. Without one, the product is bounded by
  // the tensor's byte size.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status ConvertToFloat32(SafetensorsDType dtype, std::span<const std::byte> src,
                        std::span<float> dst) {
  const size_t itemsize = SafetensorsDTypeSize(dtype);
  if (src.size() != dst.size() * itemsize) {
    return Status::InvalidArgument(
        "ConvertToFloat32: " + std::to_string(src.size()) + " bytes of " +
        std::string(SafetensorsDTypeName(dtype)) + " are not " +
        std::to_string(dst.size()) + " elements");
  }
  switch (dtype) {
    case SafetensorsDType::kF32:
      if (!dst.empty()) std::memcpy(dst.data(), src.data(), src.size());
      return Status::Ok();
    case SafetensorsDType::kF16:
      return ConvertCpuArray(src.data(), CpuDType::kFloat16, dst.data(),
                             CpuDType::kFloat32, dst.size());
    case SafetensorsDType::kBF16:
      return ConvertCpuArray(src.data(), CpuDType::kBFloat16, dst.data(),
                             CpuDType::kFloat32, dst.size());
    case SafetensorsDType::kF64:
      ConvertLoop<double>(src, dst);
      break;
    case SafetensorsDType::kI64:
      ConvertLoop<int64_t>(src, dst);
      break;
    case SafetensorsDType::kI32:
      ConvertLoop<int32_t>(src, dst);
      break;
    case SafetensorsDType::kI16:
      ConvertLoop<int16_t>(src, dst);
      break;
    case SafetensorsDType::kI8:
      ConvertLoop<int8_t>(src, dst);
      break;
    case SafetensorsDType::kU8:
    case SafetensorsDType::kBool:
      ConvertLoop<uint8_t>(src, dst);
      break;
  }
  return Status::Ok();
}

// ---- Reader -----------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(std::exchange(o.fd_, -1)),
      data_offset_(o.data_offset_),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    data_offset_ = o.data_offset_;
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsFile::ReadAt(uint64_t file_offset, std::span<std::byte> out,
                               std::string_view what) const {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done,
                              static_cast<off_t>(file_offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "reading " + path_ + " (" +
                                          std::string(what) + ") at offset " +
                                          std::to_string(file_offset + done));
    }
    if (n == 0) {
      return Status::Corruption(path_ + ": file ends at offset " +
                                std::to_string(file_offset + done) +
                                " while reading " + std::string(what));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) return Status::FromErrno(errno, "opening " + path);
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0) {
    return Status::FromErrno(errno, "stat of " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(path + " is not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return Status::Corruption(path + ": " + std::to_string(file_size) +
                              " bytes, shorter than the 8-byte header length");
  }
  std::array<std::byte, 8> len_bytes;
  STRATA_RETURN_IF_ERROR(f.ReadAt(0, len_bytes, "the header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(len_bytes[i]);
  }
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    return Status::Corruption(
        path + ": header length " + std::to_string(header_len) +
        " is out of range (at most " + std::to_string(kMaxHeaderBytes) +
        " and at most the " + std::to_string(file_size - 8) +
        " bytes after the length field)");
  }
  std::string text(header_len, '\0');
  STRATA_RETURN_IF_ERROR(
      f.ReadAt(8, std::as_writable_bytes(std::span<char>(text)), "the header"));
  f.data_offset_ = 8 + header_len;
  STRATA_ASSIGN_OR_RETURN(
      SafetensorsHeader header,
      ParseSafetensorsHeader(text, file_size - f.data_offset_, path));
  f.tensors_ = std::move(header.tensors);
  f.metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    f.index_.emplace(f.tensors_[i].name, i);
  }
  return f;
}

StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view text,
                                                   uint64_t data_size,
                                                   const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(json header, ParseHeader(text, path));
  SafetensorsHeader h;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return Status::Corruption(path + ": __metadata__ is not an object");
      }
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) {
          return Status::Corruption(path + ": __metadata__ value " + Quote(k) +
                                    " is not a string");
        }
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(SafetensorsTensorInfo info,
                            ParseEntry(name, entry, path));
    if (info.data_end > data_size) {
      return Status::Corruption(
          path + ": tensor " + Quote(name) + ": data_offsets [" +
          std::to_string(info.data_begin) + ", " +
          std::to_string(info.data_end) + "] run past the " +
          std::to_string(data_size) + "-byte data buffer (file truncated?)");
    }
    h.tensors.push_back(std::move(info));
  }

  // The tensors must tile [0, data_size): sorted by begin (an empty tensor
  // before a non-empty one at the same offset), each begins where the
  // previous ended.
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
              return std::pair(a.data_begin, a.data_end) <
                     std::pair(b.data_begin, b.data_end);
            });
  uint64_t pos = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo& t : h.tensors) {
    if (t.data_begin < pos) {
      return Status::Corruption(path + ": tensors " + Quote(prev->name) +
                                " and " + Quote(t.name) + " overlap (bytes " +
                                std::to_string(t.data_begin) + ".." +
                                std::to_string(pos) + " of the data buffer)");
    }
    if (t.data_begin > pos) {
      return Status::Corruption(
          path + ": bytes " + std::to_string(pos) + ".." +
          std::to_string(t.data_begin) +
          " of the data buffer belong to no tensor (before " + Quote(t.name) +
          ")");
    }
    pos = t.data_end;
    prev = &t;
  }
  if (pos != data_size) {
    return Status::Corruption(path + ": " + std::to_string(data_size - pos) +
                              " trailing bytes after the last tensor (data "
                              "buffer " +
                              std::to_string(data_size) + " bytes, tensors " +
                              std::to_string(pos) + ")");
  }
  return h;
}

const SafetensorsTensorInfo* SafetensorsFile::Find(
    std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

StatusOr<const SafetensorsTensorInfo*> SafetensorsFile::Lookup(
    std::string_view name) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t == nullptr) {
    return Status::NotFound(path_ + ": no tensor " + Quote(name));
  }
  return t;
}

Status SafetensorsFile::ReadRaw(std::string_view name,
                                std::span<std::byte> out) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name));
  if (out.size() != t->bytes()) {
    return Status::InvalidArgument(path_ + ": tensor " + Quote(name) + " is " +
                                   std::to_string(t->bytes()) +
                                   " bytes, the buffer " +
                                   std::to_string(out.size()));
  }
  return ReadRaw(name, 0, out);
}

Status SafetensorsFile::ReadRaw(std::string_view name, uint64_t offset,
                                std::span<std::byte> out) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name));
  if (offset > t->bytes() || out.size() > t->bytes() - offset) {
    return Status::OutOfRange(
        path_ + ": tensor " + Quote(name) + " is " +
        std::to_string(t->bytes()) + " bytes; asked for " +
        std::to_string(out.size()) + " at byte " + std::to_string(offset));
  }
  return ReadAt(data_offset_ + t->data_begin + offset, out,
                "tensor " + Quote(name));
}

Status SafetensorsFile::ReadFloat32(std::string_view name,
                                    std::span<float> out) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name));
  if (static_cast<int64_t>(out.size()) != t->numel()) {
    return Status::InvalidArgument(
        path_ + ": tensor " + Quote(name) + " " + FormatShape(t->shape) +
        " has " + std::to_string(t->numel()) + " elements, the buffer " +
        std::to_string(out.size()));
  }
  if (t->dtype == SafetensorsDType::kF32) {
    return ReadRaw(name, std::as_writable_bytes(out));
  }
  const size_t itemsize = SafetensorsDTypeSize(t->dtype);
  const size_t per_chunk = kStageBytes / itemsize;
  std::vector<std::byte> stage(std::min(out.size(), per_chunk) * itemsize);
  for (size_t i = 0; i < out.size(); i += per_chunk) {
    const size_t n = std::min(per_chunk, out.size() - i);
    std::span<std::byte> raw(stage.data(), n * itemsize);
    STRATA_RETURN_IF_ERROR(ReadAt(data_offset_ + t->data_begin + i * itemsize,
                                  raw, "tensor " + Quote(name)));
    STRATA_RETURN_IF_ERROR(ConvertToFloat32(t->dtype, raw, out.subspan(i, n)));
  }
  return Status::Ok();
}

StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(
    std::string_view name) const {
  STRATA_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name));
  std::vector<float> v(static_cast<size_t>(t->numel()));
  STRATA_RETURN_IF_ERROR(ReadFloat32(name, std::span<float>(v)));
  return v;
}

// ---- Writer -----------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& o) noexcept
    : path_(std::move(o.path_)),
      tmp_path_(std::move(o.tmp_path_)),
      fd_(std::exchange(o.fd_, -1)),
      specs_(std::move(o.specs_)),
      sizes_(std::move(o.sizes_)),
      current_(o.current_),
      current_done_(o.current_done_) {}

SafetensorsWriter& SafetensorsWriter::operator=(
    SafetensorsWriter&& o) noexcept {
  if (this != &o) {
    Abandon();
    path_ = std::move(o.path_);
    tmp_path_ = std::move(o.tmp_path_);
    fd_ = std::exchange(o.fd_, -1);
    specs_ = std::move(o.specs_);
    sizes_ = std::move(o.sizes_);
    current_ = o.current_;
    current_done_ = o.current_done_;
  }
  return *this;
}

SafetensorsWriter::~SafetensorsWriter() { Abandon(); }

void SafetensorsWriter::Abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
}

StatusOr<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsTensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const SafetensorsTensorSpec& s : specs) {
    const std::string where = path + ": tensor " + Quote(s.name);
    if (s.name.empty() || s.name == "__metadata__") {
      return Status::InvalidArgument(where + ": not a valid tensor name");
    }
    if (header.contains(s.name)) {
      return Status::InvalidArgument(where + ": declared twice");
    }
    uint64_t bytes = 0;
    if (!ByteSize(s.shape, SafetensorsDTypeSize(s.dtype), &bytes) ||
        __builtin_add_overflow(offset, bytes, &bytes)) {
      return Status::InvalidArgument(where + ": shape " + FormatShape(s.shape) +
                                     " is negative or overflows");
    }
    header[s.name] = {{"dtype", SafetensorsDTypeName(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {offset, bytes}}};
    sizes.push_back(bytes - offset);
    offset = bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  SafetensorsWriter w;
  w.path_ = path;
  w.tmp_path_ = path + ".tmp";
  w.fd_ = ::open(w.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                 0644);
  if (w.fd_ < 0) return Status::FromErrno(errno, "creating " + w.tmp_path_);
  w.specs_ = std::move(specs);
  w.sizes_ = std::move(sizes);
  std::array<std::byte, 8> len;
  uint64_t n = text.size();
  for (std::byte& b : len) {
    b = static_cast<std::byte>(n & 0xff);
    n >>= 8;
  }
  STRATA_RETURN_IF_ERROR(WriteAll(w.fd_, len, w.tmp_path_));
  STRATA_RETURN_IF_ERROR(
      WriteAll(w.fd_, std::as_bytes(std::span<const char>(text)), w.tmp_path_));
  return w;
}

Status SafetensorsWriter::Write(std::span<const std::byte> bytes) {
  if (fd_ < 0) {
    return Status::FailedPrecondition(path_ + ": writer is finished or failed");
  }
  while (!bytes.empty()) {
    while (current_ < specs_.size() && current_done_ == sizes_[current_]) {
      ++current_;
      current_done_ = 0;
    }
    if (current_ == specs_.size()) {
      return Status::InvalidArgument(path_ + ": " +
                                     std::to_string(bytes.size()) +
                                     " bytes written past the last tensor");
    }
    const uint64_t room = sizes_[current_] - current_done_;
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(room, bytes.size()));
    STRATA_RETURN_IF_ERROR(WriteAll(fd_, bytes.first(n), tmp_path_));
    current_done_ += n;
    bytes = bytes.subspan(n);
  }
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (fd_ < 0) {
    return Status::FailedPrecondition(path_ + ": writer is finished or failed");
  }
  while (current_ < specs_.size() && current_done_ == sizes_[current_]) {
    ++current_;
    current_done_ = 0;
  }
  if (current_ < specs_.size()) {
    return Status::FailedPrecondition(
        path_ + ": tensor " + Quote(specs_[current_].name) + " has " +
        std::to_string(current_done_) + " of its " +
        std::to_string(sizes_[current_]) + " bytes written");
  }
  if (::fsync(fd_) != 0) {
    return Status::FromErrno(errno, "fsync of " + tmp_path_);
  }
  if (::close(std::exchange(fd_, -1)) != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return Status::FromErrno(err, "closing " + tmp_path_);
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return Status::FromErrno(err, "renaming " + tmp_path_ + " to " + path_);
  }
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path,
                        std::span<const SafetensorsTensorData> tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const SafetensorsTensorData& t : tensors) specs.push_back(t.spec);
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter w,
                          SafetensorsWriter::Create(path, specs, metadata));
  for (const SafetensorsTensorData& t : tensors) {
    uint64_t want = 0;
    ByteSize(t.spec.shape, SafetensorsDTypeSize(t.spec.dtype), &want);
    if (t.data.size() != want) {
      return Status::InvalidArgument(
          path + ": tensor " + Quote(t.spec.name) + " " +
          FormatShape(t.spec.shape) + " needs " + std::to_string(want) +
          " bytes, given " + std::to_string(t.data.size()));
    }
    STRATA_RETURN_IF_ERROR(w.Write(t.data));
  }
  return w.Finish();
}

}  // namespace strata::finetune
