#include "ckpt/manifest.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

namespace strata {

std::string_view StateRoleName(StateRole role) {
  switch (role) {
    case StateRole::kMaster:
      return "master";
    case StateRole::kExpAvg:
      return "exp_avg";
    case StateRole::kExpAvgSq:
      return "exp_avg_sq";
    case StateRole::kParam:
      return "param";
  }
  return "unknown";
}

ElementType StateRoleType(StateRole role, ElementType dtype) {
  return role == StateRole::kParam ? dtype : ElementType::kFloat32;
}

namespace ckpt {
namespace {

using Json = nlohmann::json;

// Nesting deeper than a manifest ever has is refused before parsing.
constexpr int kMaxDepth = 8;

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

bool ParseHex64(std::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    const int d = HexDigit(c);
    if (d < 0) return false;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

std::string HexEncode(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(bytes.size() * 2, '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out[2 * i] = kDigits[b >> 4];
    out[2 * i + 1] = kDigits[b & 15];
  }
  return out;
}

// The manifest names dtypes as ElementTypeName does ("float32", "float16",
// "bfloat16"): those names are part of the format and must not change.
std::string_view ElementTypeJsonName(ElementType t) {
  return ElementTypeName(t);
}

// Depth of the deepest nesting of [ and { outside strings, stopping early
// once it passes kMaxDepth.
bool NestingWithin(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

// Reads typed fields out of the JSON tree, remembering the first error with
// its JSON path. Every accessor returns a neutral value after an error, so
// that the reading code can go on without checks at each step.
class Reader {
 public:
  explicit Reader(std::string_view file) : file_(file) {}

  bool ok() const { return error_.empty(); }
  Status status() const {
    return Status::Corruption(std::string(file_) + ": " + error_);
  }
  void Fail(const std::string& path, const std::string& what) {
    if (error_.empty()) error_ = path + ": " + what;
  }

  // `j` is an object holding exactly `keys` (each required).
  bool Object(const Json& j, const std::string& path,
              std::initializer_list<std::string_view> keys) {
    if (!ok()) return false;
    if (!j.is_object()) {
      Fail(path, "expected an object");
      return false;
    }
    for (std::string_view k : keys) {
      if (!j.contains(std::string(k))) {
        Fail(Join(path, k), "missing");
        return false;
      }
    }
    for (const auto& item : j.items()) {
      if (std::find(keys.begin(), keys.end(), item.key()) == keys.end()) {
        Fail(Join(path, item.key()), "unknown key");
        return false;
      }
    }
    return true;
  }
  const Json* Array(const Json& obj, std::string_view key,
                    const std::string& path) {
    if (!ok()) return nullptr;
    const Json& j = obj.at(std::string(key));
    if (!j.is_array()) {
      Fail(Join(path, key), "expected an array");
      return nullptr;
    }
    return &j;
  }
  uint64_t U64(const Json& obj, std::string_view key, const std::string& path,
               uint64_t max) {
    if (!ok()) return 0;
    return U64Of(obj.at(std::string(key)), Join(path, key), max);
  }
  uint64_t U64Of(const Json& j, const std::string& path, uint64_t max) {
    if (!ok()) return 0;
    if (!j.is_number_unsigned()) {
      Fail(path, "expected an unsigned integer");
      return 0;
    }
    const uint64_t v = j.get<uint64_t>();
    if (v > max) {
      Fail(path, std::to_string(v) + " is out of range [0, " +
                     std::to_string(max) + "]");
      return 0;
    }
    return v;
  }
  std::string String(const Json& obj, std::string_view key,
                     const std::string& path, size_t max_bytes) {
    if (!ok()) return {};
    const Json& j = obj.at(std::string(key));
    if (!j.is_string()) {
      Fail(Join(path, key), "expected a string");
      return {};
    }
    const auto& s = j.get_ref<const std::string&>();
    if (s.size() > max_bytes) {
      Fail(Join(path, key),
           "longer than " + std::to_string(max_bytes) + " bytes");
      return {};
    }
    return s;
  }
  uint64_t Checksum(const Json& obj, std::string_view key,
                    const std::string& path) {
    const std::string s = String(obj, key, path, 16);
    uint64_t v = 0;
    if (ok() && !ParseHex64(s, &v)) {
      Fail(Join(path, key), "expected 16 lowercase hex digits");
    }
    return v;
  }
  StateRole Role(const Json& obj, std::string_view key,
                 const std::string& path) {
    const std::string s = String(obj, key, path, 16);
    for (int r = 0; r < kNumStateRoles; ++r) {
      if (s == StateRoleName(static_cast<StateRole>(r))) {
        return static_cast<StateRole>(r);
      }
    }
    if (ok()) {
      Fail(Join(path, key),
           "'" + s + "' is not master, exp_avg, exp_avg_sq or param");
    }
    return StateRole::kMaster;
  }

  static std::string Join(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
  }
  static std::string Index(const std::string& path, size_t i) {
    return path + "[" + std::to_string(i) + "]";
  }

 private:
  std::string_view file_;
  std::string error_;
};

void ReadTensors(Reader& r, const Json& root, Manifest* m) {
  const Json* arr = r.Array(root, "tensors", "");
  if (arr == nullptr) return;
  m->tensors.reserve(arr->size());
  for (size_t i = 0; i < arr->size() && r.ok(); ++i) {
    const std::string path = Reader::Index("tensors", i);
    const Json& t = (*arr)[i];
    if (!r.Object(t, path, {"name", "shape", "dtype"})) return;
    CheckpointTensor tensor;
    tensor.name = r.String(t, "name", path, kMaxNameBytes);
    if (r.ok() && tensor.name.empty()) r.Fail(path + ".name", "empty");
    const Json* shape = r.Array(t, "shape", path);
    if (shape == nullptr) return;
    if (shape->empty() || shape->size() > kMaxDims) {
      r.Fail(path + ".shape",
             "expected 1 to " + std::to_string(kMaxDims) + " dimensions");
      return;
    }
    for (size_t d = 0; d < shape->size() && r.ok(); ++d) {
      const uint64_t v =
          r.U64Of((*shape)[d], Reader::Index(path + ".shape", d), kMaxElems);
      tensor.shape.push_back(static_cast<int64_t>(v));
    }
    const std::string dtype = r.String(t, "dtype", path, 16);
    bool known = false;
    for (ElementType e : {ElementType::kFloat32, ElementType::kFloat16,
                          ElementType::kBFloat16}) {
      if (dtype == ElementTypeJsonName(e)) {
        tensor.dtype = e;
        known = true;
      }
    }
    if (r.ok() && !known) {
      r.Fail(path + ".dtype",
             "'" + dtype + "' is not float32, float16 or bfloat16");
    }
    if (!r.ok()) return;
    StatusOr<uint64_t> elems = TensorElems(tensor, path + ".shape");
    if (!elems.ok()) {
      r.Fail(path + ".shape", std::string(elems.status().message()));
      return;
    }
    m->tensors.push_back(std::move(tensor));
  }
}

void ReadFiles(Reader& r, const Json& root, Manifest* m) {
  const Json* arr = r.Array(root, "files", "");
  if (arr == nullptr) return;
  if (arr->size() > static_cast<size_t>(kNumStateRoles)) {
    r.Fail("files", "more than one file per role");
    return;
  }
  for (size_t i = 0; i < arr->size() && r.ok(); ++i) {
    const std::string path = Reader::Index("files", i);
    const Json& f = (*arr)[i];
    if (!r.Object(f, path, {"role", "name", "size", "xxh3"})) return;
    FileRecord rec;
    rec.role = r.Role(f, "role", path);
    rec.name = r.String(f, "name", path, kMaxNameBytes);
    rec.size = r.U64(f, "size", path, uint64_t{INT64_MAX});
    rec.xxh3 = r.Checksum(f, "xxh3", path);
    if (!r.ok()) return;
    if (rec.name != DataFileName(rec.role)) {
      r.Fail(path + ".name", "'" + rec.name + "' is not " +
                                 DataFileName(rec.role) +
                                 ", the data file of its role");
      return;
    }
    for (const FileRecord& other : m->files) {
      if (other.role == rec.role) {
        r.Fail(path + ".role", "a second file for role " +
                                   std::string(StateRoleName(rec.role)));
        return;
      }
    }
    m->files.push_back(std::move(rec));
  }
}

void ReadExtents(Reader& r, const Json& root, Manifest* m) {
  const Json* arr = r.Array(root, "extents", "");
  if (arr == nullptr) return;
  m->extents.reserve(arr->size());
  for (size_t i = 0; i < arr->size() && r.ok(); ++i) {
    const std::string path = Reader::Index("extents", i);
    const Json& e = (*arr)[i];
    if (!r.Object(e, path, {"role", "offset", "bytes", "xxh3", "placements"})) {
      return;
    }
    ExtentRecord rec;
    rec.role = r.Role(e, "role", path);
    rec.offset = r.U64(e, "offset", path, uint64_t{INT64_MAX});
    rec.bytes = r.U64(e, "bytes", path, uint64_t{INT64_MAX});
    rec.xxh3 = r.Checksum(e, "xxh3", path);
    const Json* pls = r.Array(e, "placements", path);
    if (pls == nullptr) return;
    rec.placements.reserve(pls->size());
    for (size_t k = 0; k < pls->size() && r.ok(); ++k) {
      const std::string pp = Reader::Index(path + ".placements", k);
      const Json& p = (*pls)[k];
      if (!r.Object(p, pp,
                    {"tensor", "tensor_offset", "extent_offset", "elems"})) {
        return;
      }
      StatePlacement pl;
      pl.tensor = static_cast<uint32_t>(r.U64(p, "tensor", pp, UINT32_MAX));
      pl.tensor_offset = r.U64(p, "tensor_offset", pp, kMaxElems);
      pl.extent_offset = r.U64(p, "extent_offset", pp, kMaxElems);
      pl.elems = r.U64(p, "elems", pp, kMaxElems);
      rec.placements.push_back(pl);
    }
    m->extents.push_back(std::move(rec));
  }
}

void ReadBlobs(Reader& r, const Json& root, Manifest* m) {
  const Json* arr = r.Array(root, "blobs", "");
  if (arr == nullptr) return;
  uint64_t total = 0;
  for (size_t i = 0; i < arr->size() && r.ok(); ++i) {
    const std::string path = Reader::Index("blobs", i);
    const Json& b = (*arr)[i];
    if (!r.Object(b, path, {"name", "size", "xxh3", "hex"})) return;
    BlobRecord rec;
    rec.name = r.String(b, "name", path, kMaxNameBytes);
    const uint64_t size = r.U64(b, "size", path, kMaxBlobBytes);
    const uint64_t sum = r.Checksum(b, "xxh3", path);
    const std::string hex = r.String(b, "hex", path, 2 * kMaxBlobBytes);
    if (!r.ok()) return;
    total += size;
    if (total > kMaxBlobBytes) {
      r.Fail(path + ".size",
             "blobs exceed " + std::to_string(kMaxBlobBytes) + " bytes in all");
      return;
    }
    if (hex.size() != 2 * size) {
      r.Fail(path + ".hex", "holds " + std::to_string(hex.size() / 2) +
                                " bytes, size says " + std::to_string(size));
      return;
    }
    rec.bytes.resize(size);
    for (size_t k = 0; k < size; ++k) {
      const int hi = HexDigit(hex[2 * k]);
      const int lo = HexDigit(hex[2 * k + 1]);
      if (hi < 0 || lo < 0) {
        r.Fail(path + ".hex",
               "not lowercase hex at character " + std::to_string(2 * k));
        return;
      }
      rec.bytes[k] = static_cast<char>(hi << 4 | lo);
    }
    if (Xxh3(std::as_bytes(std::span(rec.bytes))) != sum) {
      r.Fail(path + ".xxh3", "does not match the blob's bytes");
      return;
    }
    for (const BlobRecord& other : m->blobs) {
      if (other.name == rec.name) {
        r.Fail(path + ".name", "'" + rec.name + "' given twice");
        return;
      }
    }
    m->blobs.push_back(std::move(rec));
  }
}

// The checks across fields: extents inside and tiling their files, file
// checksums, placements, coverage.
void CheckConsistency(Reader& r, const Manifest& m) {
  std::vector<uint64_t> elems;
  for (const CheckpointTensor& t : m.tensors) {
    elems.push_back(TensorElems(t, "").value_or(0));
  }
  for (size_t i = 0; i < m.tensors.size() && r.ok(); ++i) {
    for (size_t k = 0; k < i; ++k) {
      if (m.tensors[k].name == m.tensors[i].name) {
        r.Fail(Reader::Index("tensors", i) + ".name",
               "'" + m.tensors[i].name + "' given twice");
      }
    }
  }
  for (int role = 0; role < kNumStateRoles && r.ok(); ++role) {
    const auto sr = static_cast<StateRole>(role);
    const FileRecord* file = nullptr;
    size_t file_index = 0;
    for (size_t i = 0; i < m.files.size(); ++i) {
      if (m.files[i].role == sr) {
        file = &m.files[i];
        file_index = i;
      }
    }
    std::vector<const ExtentRecord*> extents;
    uint64_t next = 0;
    for (size_t i = 0; i < m.extents.size() && r.ok(); ++i) {
      const ExtentRecord& e = m.extents[i];
      if (e.role != sr) continue;
      const std::string path = Reader::Index("extents", i);
      if (file == nullptr) {
        r.Fail(path + ".role",
               "no file is listed for role " + std::string(StateRoleName(sr)));
        return;
      }
      if (e.bytes == 0 || e.bytes % kCheckpointAlign != 0) {
        r.Fail(path + ".bytes", std::to_string(e.bytes) +
                                    " is not a positive multiple of " +
                                    std::to_string(kCheckpointAlign));
        return;
      }
      if (e.offset != next) {
        r.Fail(path + ".offset", std::to_string(e.offset) +
                                     " does not follow the previous " +
                                     "extent of " + file->name +
                                     ", which ends at " + std::to_string(next));
        return;
      }
      if (e.bytes > file->size || e.offset > file->size - e.bytes) {
        r.Fail(path, "bytes [" + std::to_string(e.offset) + ", +" +
                         std::to_string(e.bytes) + ") lie beyond the " +
                         std::to_string(file->size) + " bytes of " +
                         file->name);
        return;
      }
      next = e.offset + e.bytes;
      if (e.placements.empty()) {
        r.Fail(path + ".placements", "empty");
        return;
      }
      Status s = CheckPlacements(m.tensors, elems, sr, e.bytes, e.placements,
                                 path + ".placements");
      if (!s.ok()) {
        r.Fail(path, std::string(s.message()));
        return;
      }
      extents.push_back(&e);
    }
    if (!r.ok() || file == nullptr) continue;
    const std::string fpath = Reader::Index("files", file_index);
    if (extents.empty()) {
      r.Fail(fpath, file->name + " holds no extent");
      return;
    }
    if (next != file->size) {
      r.Fail(fpath + ".size", std::to_string(file->size) +
                                  " bytes, but its extents end at " +
                                  std::to_string(next));
      return;
    }
    if (FileChecksum(extents) != file->xxh3) {
      r.Fail(fpath + ".xxh3",
             "does not match the checksums of " + file->name + "'s extents");
      return;
    }
    Status s = CheckCoverage(m.tensors, sr, extents);
    if (!s.ok()) r.Fail("extents", std::string(s.message()));
  }
}

}  // namespace

std::string DataFileName(StateRole role) {
  return std::string(StateRoleName(role)) + ".bin";
}

std::string StepDirName(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%012lld", static_cast<long long>(step));
  return buf;
}

int64_t ParseStepDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() < kPrefix.size() + 12 || name.size() > kPrefix.size() + 18 ||
      name.substr(0, kPrefix.size()) != kPrefix) {
    return -1;
  }
  int64_t v = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');  // at most 18 digits: no overflow
  }
  return StepDirName(v) == name ? v : -1;
}

size_t StoredElemBytes(StateRole role, ElementType dtype) {
  return StateRoleType(role, dtype) == ElementType::kFloat32 ? 4 : 2;
}

uint64_t FileChecksum(std::span<const ExtentRecord* const> extents) {
  std::vector<unsigned char> words(extents.size() * 8);
  for (size_t i = 0; i < extents.size(); ++i) {
    for (int b = 0; b < 8; ++b) {
      words[i * 8 + b] =
          static_cast<unsigned char>(extents[i]->xxh3 >> (8 * b) & 0xff);
    }
  }
  return Xxh3(std::as_bytes(std::span(words)));
}

StatusOr<uint64_t> TensorElems(const CheckpointTensor& tensor,
                               std::string_view what) {
  if (tensor.shape.empty() || tensor.shape.size() > kMaxDims) {
    return Status::InvalidArgument(std::string(what) + ": expected 1 to " +
                                   std::to_string(kMaxDims) + " dimensions");
  }
  uint64_t n = 1;
  for (int64_t d : tensor.shape) {
    if (d <= 0) {
      return Status::InvalidArgument(std::string(what) + ": dimension " +
                                     std::to_string(d) + " is not > 0");
    }
    const auto u = static_cast<uint64_t>(d);
    if (u > kMaxElems || n > kMaxElems / u) {
      return Status::InvalidArgument(std::string(what) +
                                     ": more than 2^56 elements");
    }
    n *= u;
  }
  return n;
}

Status CheckPlacements(const std::vector<CheckpointTensor>& tensors,
                       const std::vector<uint64_t>& tensor_elems,
                       StateRole role, uint64_t extent_bytes,
                       std::span<const StatePlacement> placements,
                       std::string_view where) {
  std::optional<ElementType> type;
  for (size_t i = 0; i < placements.size(); ++i) {
    const StatePlacement& p = placements[i];
    const std::string path = std::string(where) + "[" + std::to_string(i) + "]";
    if (p.tensor >= tensors.size()) {
      return Status::InvalidArgument(
          path + ".tensor: " + std::to_string(p.tensor) +
          " is not the index of one of the " + std::to_string(tensors.size()) +
          " tensors");
    }
    const CheckpointTensor& t = tensors[p.tensor];
    const ElementType et = StateRoleType(role, t.dtype);
    if (type && *type != et) {
      return Status::InvalidArgument(
          path + ".tensor: '" + t.name + "' stores " +
          std::string(StateRoleName(role)) + " as " +
          std::string(ElementTypeJsonName(et)) +
          ", other placements of the same buffer as " +
          std::string(ElementTypeJsonName(*type)));
    }
    type = et;
    const uint64_t n = tensor_elems[p.tensor];
    if (p.elems == 0 || p.elems > n || p.tensor_offset > n - p.elems) {
      return Status::InvalidArgument(
          path + ": elements [" + std::to_string(p.tensor_offset) + ", +" +
          std::to_string(p.elems) + ") are not a non-empty range inside the " +
          std::to_string(n) + " elements of '" + t.name + "'");
    }
    const uint64_t esize = StoredElemBytes(role, t.dtype);
    const uint64_t cap = extent_bytes / esize;
    if (p.elems > cap || p.extent_offset > cap - p.elems) {
      return Status::InvalidArgument(
          path + ": elements [" + std::to_string(p.extent_offset) + ", +" +
          std::to_string(p.elems) + ") of the buffer lie beyond its " +
          std::to_string(extent_bytes) + " bytes");
    }
  }
  return Status::Ok();
}

Status CheckCoverage(const std::vector<CheckpointTensor>& tensors,
                     StateRole role,
                     std::span<const ExtentRecord* const> extents) {
  struct Piece {
    uint32_t tensor;
    uint64_t begin;
    uint64_t elems;
  };
  std::vector<Piece> pieces;
  for (const ExtentRecord* e : extents) {
    for (const StatePlacement& p : e->placements) {
      pieces.push_back({p.tensor, p.tensor_offset, p.elems});
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.tensor != b.tensor ? a.tensor < b.tensor : a.begin < b.begin;
  });
  const std::string rn(StateRoleName(role));
  size_t k = 0;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = TensorElems(tensors[t], "").value_or(0);
    uint64_t next = 0;
    for (; k < pieces.size() && pieces[k].tensor == t; ++k) {
      if (pieces[k].begin > next) break;
      if (pieces[k].begin < next) {
        return Status::InvalidArgument(
            rn + " of tensor '" + tensors[t].name + "': elements [" +
            std::to_string(pieces[k].begin) + ", " + std::to_string(next) +
            ") are stored twice");
      }
      next = pieces[k].begin + pieces[k].elems;
    }
    if (next != n) {
      const uint64_t end =
          k < pieces.size() && pieces[k].tensor == t ? pieces[k].begin : n;
      return Status::InvalidArgument(rn + " of tensor '" + tensors[t].name +
                                     "': elements [" + std::to_string(next) +
                                     ", " + std::to_string(end) +
                                     ") are not stored");
    }
  }
  return Status::Ok();
}

bool IsUtf8(std::string_view name) {
  try {
    (void)Json(std::string(name)).dump();
    return true;
  } catch (const Json::exception&) {
    return false;
  }
}

std::string SerializeManifest(const Manifest& m) {
  Json root = Json::object();
  root["format"] = kFormatName;
  root["version"] = kFormatVersion;
  root["step"] = static_cast<uint64_t>(m.step);
  root["align"] = static_cast<uint64_t>(kCheckpointAlign);
  Json tensors = Json::array();
  for (const CheckpointTensor& t : m.tensors) {
    Json shape = Json::array();
    for (int64_t d : t.shape) shape.push_back(static_cast<uint64_t>(d));
    tensors.push_back({{"name", t.name},
                       {"shape", std::move(shape)},
                       {"dtype", ElementTypeJsonName(t.dtype)}});
  }
  root["tensors"] = std::move(tensors);
  Json files = Json::array();
  for (const FileRecord& f : m.files) {
    files.push_back({{"role", StateRoleName(f.role)},
                     {"name", f.name},
                     {"size", f.size},
                     {"xxh3", Hex64(f.xxh3)}});
  }
  root["files"] = std::move(files);
  Json extents = Json::array();
  for (const ExtentRecord& e : m.extents) {
    Json pls = Json::array();
    for (const StatePlacement& p : e.placements) {
      pls.push_back({{"tensor", p.tensor},
                     {"tensor_offset", p.tensor_offset},
                     {"extent_offset", p.extent_offset},
                     {"elems", p.elems}});
    }
    extents.push_back({{"role", StateRoleName(e.role)},
                       {"offset", e.offset},
                       {"bytes", e.bytes},
                       {"xxh3", Hex64(e.xxh3)},
                       {"placements", std::move(pls)}});
  }
  root["extents"] = std::move(extents);
  Json blobs = Json::array();
  for (const BlobRecord& b : m.blobs) {
    blobs.push_back({{"name", b.name},
                     {"size", b.bytes.size()},
                     {"xxh3", Hex64(Xxh3(std::as_bytes(std::span(b.bytes))))},
                     {"hex", HexEncode(b.bytes)}});
  }
  root["blobs"] = std::move(blobs);
  std::string text = root.dump(1) + "\n";
  text += "xxh3 " + Hex64(Xxh3(std::as_bytes(std::span(text)))) + "\n";
  return text;
}

StatusOr<Manifest> ParseManifest(std::string_view text, std::string_view file) {
  const std::string f(file);
  if (text.size() > kMaxManifestBytes) {
    return Status::Corruption(f + ": larger than " +
                              std::to_string(kMaxManifestBytes) + " bytes");
  }
  // The last line: "xxh3 <16 hex>\n".
  constexpr size_t kTail = 5 + 16 + 1;
  if (text.size() < kTail || text.back() != '\n' ||
      text.substr(text.size() - kTail, 5) != "xxh3 " ||
      (text.size() > kTail && text[text.size() - kTail - 1] != '\n')) {
    return Status::Corruption(
        f +
        ": does not end with its checksum line 'xxh3 <16 hex digits>' "
        "(truncated or not a manifest)");
  }
  uint64_t want = 0;
  if (!ParseHex64(text.substr(text.size() - kTail + 5, 16), &want)) {
    return Status::Corruption(f + ": checksum line is not 16 hex digits");
  }
  const std::string_view body = text.substr(0, text.size() - kTail);
  const uint64_t got = Xxh3(std::as_bytes(std::span(body)));
  if (got != want) {
    return Status::Corruption(f + ": checksum " + Hex64(got) +
                              " of the contents does not match the " +
                              Hex64(want) + " recorded in it");
  }
  if (!NestingWithin(body, kMaxDepth)) {
    return Status::Corruption(f + ": JSON nested deeper than " +
                              std::to_string(kMaxDepth) + " levels");
  }
  Json root;
  try {
    root = Json::parse(body.begin(), body.end(), nullptr,
                       /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    std::string what = e.what();
    const size_t start = what.find("] ");
    if (start != std::string::npos) what = what.substr(start + 2);
    return Status::Corruption(f + ": invalid JSON: " + what);
  }
  Reader r(file);
  Manifest m;
  if (r.Object(root, "",
               {"format", "version", "step", "align", "tensors", "files",
                "extents", "blobs"})) {
    const std::string format = r.String(root, "format", "", 64);
    if (r.ok() && format != kFormatName) {
      r.Fail("format", "'" + format + "' is not " + std::string(kFormatName));
    }
    const uint64_t version = r.U64(root, "version", "", UINT32_MAX);
    if (r.ok() && version != static_cast<uint64_t>(kFormatVersion)) {
      r.Fail("version", std::to_string(version) + " is not " +
                            std::to_string(kFormatVersion) +
                            ", the version this build reads");
    }
    m.step = static_cast<int64_t>(r.U64(root, "step", "", INT64_MAX));
    const uint64_t align = r.U64(root, "align", "", UINT32_MAX);
    if (r.ok() && align != kCheckpointAlign) {
      r.Fail("align", std::to_string(align) + " is not " +
                          std::to_string(kCheckpointAlign));
    }
    ReadTensors(r, root, &m);
    ReadFiles(r, root, &m);
    ReadExtents(r, root, &m);
    ReadBlobs(r, root, &m);
    if (r.ok()) CheckConsistency(r, m);
  }
  if (!r.ok()) return r.status();
  return m;
}

}  // namespace ckpt
}  // namespace strata
