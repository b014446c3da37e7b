#include "examples/finetune/io/gpt2_checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <set>
#include <utility>

namespace strata::finetune {
namespace {

constexpr std::string_view kPrefix = "transformer.";
constexpr std::string_view kLmHead = "lm_head.weight";
// How many names of each kind an error lists before it only counts.
constexpr size_t kListed = 8;

std::string_view Unprefixed(std::string_view name) {
  if (name.starts_with(kPrefix)) name.remove_prefix(kPrefix.size());
  return name;
}

// The block index of "h.N.<rest>", with *rest set; -1 for other names.
int64_t BlockIndex(std::string_view name, std::string_view* rest) {
  if (!name.starts_with("h.")) return -1;
  name.remove_prefix(2);
  int64_t n = -1;
  auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), n);
  if (ec != std::errc() || p == name.data() || p == name.data() + name.size() ||
      *p != '.' || n < 0) {
    return -1;
  }
  // "h.01." is not a block name HF writes; keep the spelling canonical.
  if (name[0] == '0' && p - name.data() > 1) return -1;
  *rest = std::string_view(p + 1, name.data() + name.size() - p - 1);
  return n;
}

bool IsMaskBuffer(std::string_view unprefixed) {
  std::string_view rest;
  return BlockIndex(unprefixed, &rest) >= 0 &&
         (rest == "attn.bias" || rest == "attn.masked_bias");
}

std::string ListNames(std::string_view what,
                      const std::vector<std::string>& names) {
  std::string s = std::to_string(names.size()) + " " + std::string(what) + " (";
  for (size_t i = 0; i < names.size() && i < kListed; ++i) {
    if (i) s += ", ";
    s += names[i];
  }
  if (names.size() > kListed) s += ", ...";
  return s + ")";
}

// OK when lm_head.weight holds exactly wte.weight's bytes.
Status CheckTiedHead(const SafetensorsFile& file, const std::string& wte_name) {
  const SafetensorsTensorInfo* head = file.Find(kLmHead);
  const SafetensorsTensorInfo* wte = file.Find(wte_name);
  const std::string untied =
      file.path() + ": lm_head.weight differs from " + wte_name +
      "; the model ties its LM head to the token embedding, so an untied head "
      "cannot be loaded";
  if (head->shape != wte->shape || head->dtype != wte->dtype) {
    return Status::InvalidArgument(
        untied + " (" + FormatShape(head->shape) + " " +
        std::string(SafetensorsDTypeName(head->dtype)) + " against " +
        FormatShape(wte->shape) + " " +
        std::string(SafetensorsDTypeName(wte->dtype)) + ")");
  }
  constexpr size_t kChunk = 1 << 20;
  std::vector<std::byte> a(std::min<uint64_t>(kChunk, wte->bytes()));
  std::vector<std::byte> b(a.size());
  for (uint64_t off = 0; off < wte->bytes(); off += kChunk) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(kChunk, wte->bytes() - off));
    STRATA_RETURN_IF_ERROR(file.ReadRaw(wte_name, off, std::span(a).first(n)));
    STRATA_RETURN_IF_ERROR(file.ReadRaw(kLmHead, off, std::span(b).first(n)));
    if (std::memcmp(a.data(), b.data(), n) != 0) {
      return Status::InvalidArgument(untied + " (first difference in bytes " +
                                     std::to_string(off) + ".." +
                                     std::to_string(off + n) + ")");
    }
  }
  return Status::Ok();
}

// The file's name for `unprefixed`, with or without the prefix, or nullptr.
const SafetensorsTensorInfo* FindEither(const SafetensorsFile& file,
                                        std::string_view unprefixed) {
  if (const auto* t = file.Find(unprefixed)) return t;
  return file.Find(std::string(kPrefix) + std::string(unprefixed));
}

}  // namespace

std::string ToString(const Gpt2Dims& d) {
  return "n_layer=" + std::to_string(d.n_layer) +
         " n_embd=" + std::to_string(d.n_embd) +
         " vocab=" + std::to_string(d.vocab) +
         " n_ctx=" + std::to_string(d.n_ctx);
}

int64_t Gpt2ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<Gpt2ParamSpec> Gpt2ParameterSpecs(const Gpt2Dims& d) {
  const int64_t c = d.n_embd;
  std::vector<Gpt2ParamSpec> specs;
  specs.push_back({"wte.weight", {d.vocab, c}});
  specs.push_back({"wpe.weight", {d.n_ctx, c}});
  for (int64_t l = 0; l < d.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    specs.push_back({h + "ln_1.weight", {c}});
    specs.push_back({h + "ln_1.bias", {c}});
    specs.push_back({h + "attn.c_attn.weight", {c, 3 * c}});
    specs.push_back({h + "attn.c_attn.bias", {3 * c}});
    specs.push_back({h + "attn.c_proj.weight", {c, c}});
    specs.push_back({h + "attn.c_proj.bias", {c}});
    specs.push_back({h + "ln_2.weight", {c}});
    specs.push_back({h + "ln_2.bias", {c}});
    specs.push_back({h + "mlp.c_fc.weight", {c, 4 * c}});
    specs.push_back({h + "mlp.c_fc.bias", {4 * c}});
    specs.push_back({h + "mlp.c_proj.weight", {4 * c, c}});
    specs.push_back({h + "mlp.c_proj.bias", {c}});
  }
  specs.push_back({"ln_f.weight", {c}});
  specs.push_back({"ln_f.bias", {c}});
  return specs;
}

StatusOr<Gpt2CheckpointMap> MapGpt2Checkpoint(const SafetensorsFile& file,
                                              const Gpt2Dims& dims) {
  Gpt2CheckpointMap map;
  map.dims = dims;
  std::map<std::string, std::vector<int64_t>, std::less<>> expected;
  for (Gpt2ParamSpec& s : Gpt2ParameterSpecs(dims)) {
    expected.emplace(std::move(s.name), std::move(s.shape));
  }
  std::vector<std::string> unexpected, misshaped, twice;
  bool has_head = false;
  for (const SafetensorsTensorInfo& t : file.tensors()) {
    const std::string_view base = Unprefixed(t.name);
    if (t.name == kLmHead) {
      has_head = true;
      continue;
    }
    if (IsMaskBuffer(base)) {
      map.ignored.push_back(t.name);
      continue;
    }
    auto it = expected.find(base);
    if (it == expected.end()) {
      unexpected.push_back(t.name + " " + FormatShape(t.shape));
      continue;
    }
    if (!map.tensor_of.emplace(std::string(base), t.name).second) {
      twice.push_back(std::string(base));
      continue;
    }
    if (t.shape != it->second) {
      misshaped.push_back(t.name + " " + FormatShape(t.shape) + " (expected " +
                          FormatShape(it->second) + ")");
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, shape] : expected) {
    if (!map.tensor_of.contains(name)) {
      missing.push_back(name + " " + FormatShape(shape));
    }
  }
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty() ||
      !twice.empty()) {
    std::string msg = file.path() + " does not fit a GPT-2 model with " +
                      ToString(dims) + ":";
    if (!missing.empty()) msg += " " + ListNames("missing", missing) + ";";
    if (!misshaped.empty())
      msg += " " + ListNames("mis-shaped", misshaped) + ";";
    if (!unexpected.empty()) {
      msg += " " + ListNames("unexpected", unexpected) + ";";
    }
    if (!twice.empty()) {
      msg += " " + ListNames("present with and without 'transformer.'", twice) +
             ";";
    }
    msg.pop_back();
    return Status::InvalidArgument(msg);
  }
  if (has_head) {
    STRATA_RETURN_IF_ERROR(CheckTiedHead(file, map.tensor_of["wte.weight"]));
    map.ignored.emplace_back(kLmHead);
  }
  return map;
}

StatusOr<Gpt2Dims> InferGpt2Dims(const SafetensorsFile& file) {
  const SafetensorsTensorInfo* wte = FindEither(file, "wte.weight");
  const SafetensorsTensorInfo* wpe = FindEither(file, "wpe.weight");
  if (wte == nullptr || wpe == nullptr || wte->shape.size() != 2 ||
      wpe->shape.size() != 2) {
    return Status::InvalidArgument(
        file.path() +
        " is not a GPT-2 checkpoint: it needs 2-D tensors wte.weight [vocab, "
        "n_embd] and wpe.weight [n_ctx, n_embd] (optionally prefixed "
        "'transformer.')");
  }
  Gpt2Dims d;
  d.vocab = wte->shape[0];
  d.n_embd = wte->shape[1];
  d.n_ctx = wpe->shape[0];
  // Bounded before anything is sized by them: a shape of [0, 2^62] holds no
  // bytes, so the safetensors reader accepts it, but 4 * n_embd overflows.
  for (const auto& [what, v] :
       {std::pair<const char*, int64_t>{"wte.weight's vocab (dim 0)", d.vocab},
        {"wte.weight's n_embd (dim 1)", d.n_embd},
        {"wpe.weight's n_ctx (dim 0)", d.n_ctx}}) {
    if (v < 1 || v > kMaxGpt2Dim) {
      return Status::InvalidArgument(
          file.path() + ": " + what + " " + std::to_string(v) +
          " is out of range; accepted: 1.." + std::to_string(kMaxGpt2Dim));
    }
  }
  std::set<int64_t> blocks;
  for (const SafetensorsTensorInfo& t : file.tensors()) {
    std::string_view rest;
    const int64_t n = BlockIndex(Unprefixed(t.name), &rest);
    if (n >= kMaxGpt2Layers) {
      // One stray name must not make the model (and the list of the
      // tensors it expects) that many blocks deep.
      return Status::InvalidArgument(file.path() + ": tensor " + t.name +
                                     " names block " + std::to_string(n) +
                                     "; accepted: blocks 0.." +
                                     std::to_string(kMaxGpt2Layers - 1));
    }
    if (n >= 0) blocks.insert(n);
  }
  // One past the highest block: a gap then shows up as missing tensors.
  d.n_layer = blocks.empty() ? 0 : *blocks.rbegin() + 1;
  return d;
}

Status ReadGpt2Parameter(const SafetensorsFile& file,
                         const Gpt2CheckpointMap& map, std::string_view param,
                         std::span<float> out) {
  auto it = map.tensor_of.find(param);
  if (it == map.tensor_of.end()) {
    return Status::NotFound("'" + std::string(param) +
                            "' is not a GPT-2 parameter of a model with " +
                            ToString(map.dims));
  }
  return file.ReadFloat32(it->second, out);
}

}  // namespace strata::finetune
