// Checkpoint test helpers: a model's tensors, a deterministic training state
// per step, writing it with a given extent layout, and reading it back
// with another.
#ifndef STRATA_TESTS_CKPT_TEST_UTIL_H_
#define STRATA_TESTS_CKPT_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/checkpoint.h"

namespace strata::testing {

inline std::vector<CheckpointTensor> ModelTensors() {
  return {{"embed", {8, 1000}, ElementType::kBFloat16},
          {"norm", {3000}, ElementType::kFloat32},
          {"proj", {5, 7, 11}, ElementType::kFloat16},
          {"head", {2, 2100}, ElementType::kBFloat16}};
}

inline size_t RoleElemBytes(StateRole role, ElementType dtype) {
  return StateRoleType(role, dtype) == ElementType::kFloat32 ? 4 : 2;
}

inline uint64_t Elems(const CheckpointTensor& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The value of element `i` of tensor `t`'s `role` at `step`, as its bytes.
inline void ExpectedElem(int64_t step, StateRole role, uint32_t t, uint64_t i,
                         size_t esize, std::byte* out) {
  uint64_t x = (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(role) << 56) ^
               (static_cast<uint64_t>(t) << 48) ^ i;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  std::memcpy(out, &x, esize);
}

// A 4 KiB-aligned buffer.
struct AlignedBuf {
  explicit AlignedBuf(size_t bytes)
      : size((bytes + 4095) / 4096 * 4096),
        ptr(static_cast<std::byte*>(std::aligned_alloc(4096, size))) {
    std::memset(ptr.get(), 0xEE, size);
  }
  std::span<std::byte> span() { return {ptr.get(), size}; }
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  size_t size;
  std::unique_ptr<std::byte, Free> ptr;
};

// How a writer cuts each role into extents: runs of `extent_elems` elements
// over the tensors of one element type in order, each starting `lead`
// elements into its buffer.
struct Layout {
  uint64_t extent_elems = 4096;
  uint64_t lead = 0;
};

// One buffer and its placements, for WriteExtent or Read.
struct Piece {
  StateRole role;
  std::vector<StatePlacement> placements;
  size_t esize;
  uint64_t elems;  // extent_offset span used
};

inline std::vector<Piece> Cut(const std::vector<CheckpointTensor>& tensors,
                              StateRole role, const Layout& layout) {
  std::vector<Piece> pieces;
  for (size_t esize : {size_t{4}, size_t{2}}) {
    // Tensors whose role is stored with this element size, in order.
    Piece cur{role, {}, esize, layout.lead};
    for (uint32_t t = 0; t < tensors.size(); ++t) {
      if (RoleElemBytes(role, tensors[t].dtype) != esize) continue;
      // One buffer holds one element type: float16 and bfloat16 apart.
      if (!cur.placements.empty() &&
          tensors[cur.placements[0].tensor].dtype != tensors[t].dtype &&
          esize == 2) {
        pieces.push_back(cur);
        cur = Piece{role, {}, esize, layout.lead};
      }
      const uint64_t n = Elems(tensors[t]);
      for (uint64_t at = 0; at < n;) {
        const uint64_t room = layout.lead + layout.extent_elems - cur.elems;
        const uint64_t take = std::min(room, n - at);
        cur.placements.push_back({t, at, cur.elems, take});
        cur.elems += take;
        at += take;
        if (cur.elems == layout.lead + layout.extent_elems) {
          pieces.push_back(cur);
          cur = Piece{role, {}, esize, layout.lead};
        }
      }
    }
    if (!cur.placements.empty()) pieces.push_back(cur);
  }
  return pieces;
}

inline void Fill(int64_t step, const Piece& p, std::span<std::byte> buf) {
  for (const StatePlacement& pl : p.placements) {
    for (uint64_t i = 0; i < pl.elems; ++i) {
      ExpectedElem(step, p.role, pl.tensor, pl.tensor_offset + i, p.esize,
                   buf.data() + (pl.extent_offset + i) * p.esize);
    }
  }
}

inline constexpr StateRole kAllRoles[] = {
    StateRole::kMaster, StateRole::kExpAvg, StateRole::kExpAvgSq,
    StateRole::kParam};

// Writes the state of `step` with `layout`; returns Commit's status.
inline Status WriteState(const CheckpointWriterOptions& options,
                         const Layout& layout = {}) {
  STRATA_ASSIGN_OR_RETURN(auto w, CheckpointWriter::Begin(options));
  const auto tensors = ModelTensors();
  for (const auto& t : tensors)
    STRATA_RETURN_IF_ERROR(w->AddTensor(t).status());
  std::vector<AlignedBuf> bufs;
  std::vector<Piece> all;
  for (StateRole role : kAllRoles) {
    for (Piece& p : Cut(tensors, role, layout)) all.push_back(std::move(p));
  }
  bufs.reserve(all.size());
  for (const Piece& p : all) {
    bufs.emplace_back(p.elems * p.esize);
    Fill(options.step, p, bufs.back().span());
    STRATA_RETURN_IF_ERROR(w->WriteExtent(p.role, bufs.back().span(),
                                          p.placements, [](Status) {}));
  }
  STRATA_RETURN_IF_ERROR(
      w->PutBlob("trainer", "step=" + std::to_string(options.step)));
  return w->Commit().status();
}

// Reads every role of every tensor with `layout` and compares it with the
// state of the reader's step, bit for bit; returns the step.
inline int64_t ExpectState(CheckpointReader& r, const Layout& layout = {}) {
  const auto tensors = ModelTensors();
  EXPECT_EQ(r.tensors().size(), tensors.size());
  const int64_t step = r.step();
  for (StateRole role : kAllRoles) {
    EXPECT_TRUE(r.HasRole(role));
    for (const Piece& p : Cut(tensors, role, layout)) {
      AlignedBuf got(p.elems * p.esize), want(p.elems * p.esize);
      Fill(step, p, want.span());
      Status s = r.Read(role, p.placements, got.span());
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(std::memcmp(got.ptr.get(), want.ptr.get(), p.elems * p.esize),
                0)
          << "role " << StateRoleName(role) << " step " << step;
    }
  }
  StatusOr<std::string> blob = r.Blob("trainer");
  EXPECT_TRUE(blob.ok());
  if (blob.ok()) {
    EXPECT_EQ(*blob, "step=" + std::to_string(step));
  }
  return step;
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_CKPT_TEST_UTIL_H_
