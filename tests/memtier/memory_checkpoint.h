// A checkpoint kept in memory: a CheckpointWriter and CheckpointReader pair
// that checks the writer contract (alignment, placements inside tensors and
// extents, every element of a written role covered once) and serves reads by
// placements, so the engine's streaming is tested without a filesystem.
// Writes complete on other threads, as the real writer's do.
#ifndef STRATA_TESTS_MEMTIER_MEMORY_CHECKPOINT_H_
#define STRATA_TESTS_MEMTIER_MEMORY_CHECKPOINT_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "strata/checkpoint.h"

namespace strata::testing {

struct MemoryCheckpoint {
  struct Extent {
    StateRole role;
    std::vector<std::byte> data;
    std::vector<StatePlacement> places;
  };
  std::vector<CheckpointTensor> tensors;
  std::vector<Extent> extents;
  std::map<std::string, std::string> blobs;
  bool committed = false;

  size_t ElemSize(StateRole role, uint32_t tensor) const {
    return role == StateRole::kParam ? ElementSize(tensors[tensor].dtype) : 4;
  }
  uint64_t Numel(uint32_t tensor) const {
    uint64_t n = 1;
    for (int64_t d : tensors[tensor].shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};

class MemoryCheckpointWriter final : public CheckpointWriter {
 public:
  explicit MemoryCheckpointWriter(MemoryCheckpoint* out) : out_(out) {}
  ~MemoryCheckpointWriter() override { Drain(); }

  StatusOr<uint32_t> AddTensor(const CheckpointTensor& t) override {
    std::lock_guard<std::mutex> l(mu_);
    out_->tensors.push_back(t);
    return static_cast<uint32_t>(out_->tensors.size() - 1);
  }

  Status WriteExtent(StateRole role, std::span<const std::byte> data,
                     std::vector<StatePlacement> places,
                     std::function<void(Status)> done) override {
    if (reinterpret_cast<uintptr_t>(data.data()) % kCheckpointAlign != 0 ||
        data.size() % kCheckpointAlign != 0) {
      return Status::InvalidArgument("memory checkpoint: unaligned extent");
    }
    std::lock_guard<std::mutex> l(mu_);
    for (const StatePlacement& p : places) {
      if (p.tensor >= out_->tensors.size() ||
          p.tensor_offset + p.elems > out_->Numel(p.tensor) ||
          (p.extent_offset + p.elems) * out_->ElemSize(role, p.tensor) >
              data.size()) {
        return Status::InvalidArgument("memory checkpoint: bad placement");
      }
    }
    // Copied and completed on another thread, later.
    pending_.push_back(std::async(
        std::launch::async, [this, role, data, places = std::move(places),
                             done = std::move(done)]() mutable {
          {
            std::lock_guard<std::mutex> g(mu_);
            out_->extents.push_back(
                {role, std::vector<std::byte>(data.begin(), data.end()),
                 std::move(places)});
          }
          done(Status::Ok());
        }));
    return Status::Ok();
  }

  Status PutBlob(std::string_view name, std::string_view bytes) override {
    std::lock_guard<std::mutex> l(mu_);
    out_->blobs[std::string(name)] = std::string(bytes);
    return Status::Ok();
  }

  StatusOr<std::string> Commit() override {
    Drain();
    // Coverage: every element of each written role exactly once.
    std::map<std::pair<int, uint32_t>, std::vector<uint8_t>> seen;
    for (const auto& e : out_->extents) {
      for (const StatePlacement& p : e.places) {
        auto& v = seen[{static_cast<int>(e.role), p.tensor}];
        v.resize(out_->Numel(p.tensor));
        for (uint64_t i = 0; i < p.elems; ++i) {
          if (v[p.tensor_offset + i]++ != 0) {
            return Status::InvalidArgument("memory checkpoint: overlap");
          }
        }
      }
    }
    for (const auto& [key, v] : seen) {
      for (uint8_t c : v) {
        if (c != 1) return Status::InvalidArgument("memory checkpoint: gap");
      }
    }
    out_->committed = true;
    return std::string("memory");
  }

 private:
  void Drain() {
    std::vector<std::future<void>> p;
    {
      std::lock_guard<std::mutex> l(mu_);
      p.swap(pending_);
    }
    for (auto& f : p) f.wait();
  }

  MemoryCheckpoint* out_;
  std::mutex mu_;
  std::vector<std::future<void>> pending_;
};

class MemoryCheckpointReader final : public CheckpointReader {
 public:
  explicit MemoryCheckpointReader(const MemoryCheckpoint* in) : in_(in) {}

  // The Read call (counting from 0) that fails with kCorruption; -1: none.
  int fail_read = -1;
  std::atomic<int> reads{0};

  const std::string& path() const override { return path_; }
  int64_t step() const override { return 0; }
  const std::vector<CheckpointTensor>& tensors() const override {
    return in_->tensors;
  }
  StatusOr<uint32_t> Find(std::string_view name) const override {
    for (uint32_t i = 0; i < in_->tensors.size(); ++i) {
      if (in_->tensors[i].name == name) return i;
    }
    return Status::NotFound("memory checkpoint: no " + std::string(name));
  }
  bool HasRole(StateRole role) const override {
    for (const auto& e : in_->extents) {
      if (e.role == role) return true;
    }
    return false;
  }
  StatusOr<std::string> Blob(std::string_view name) const override {
    auto it = in_->blobs.find(std::string(name));
    if (it == in_->blobs.end()) {
      return Status::NotFound("memory checkpoint: no blob");
    }
    return it->second;
  }

  Status Read(StateRole role, std::span<const StatePlacement> want,
              std::span<std::byte> out) override {
    if (reads++ == fail_read) {
      return Status::Corruption("memory checkpoint: injected corruption");
    }
    for (const StatePlacement& w : want) {
      const size_t es = in_->ElemSize(role, w.tensor);
      if ((w.extent_offset + w.elems) * es > out.size()) {
        return Status::InvalidArgument("memory checkpoint: out too small");
      }
      uint64_t filled = 0;
      for (const auto& e : in_->extents) {
        if (e.role != role) continue;
        for (const StatePlacement& s : e.places) {
          if (s.tensor != w.tensor) continue;
          const uint64_t b = std::max(s.tensor_offset, w.tensor_offset);
          const uint64_t end =
              std::min(s.tensor_offset + s.elems, w.tensor_offset + w.elems);
          if (b >= end) continue;
          std::memcpy(
              out.data() + (w.extent_offset + b - w.tensor_offset) * es,
              e.data.data() + (s.extent_offset + b - s.tensor_offset) * es,
              (end - b) * es);
          filled += end - b;
        }
      }
      if (filled != w.elems) {
        return Status::Corruption("memory checkpoint: elements missing");
      }
    }
    return Status::Ok();
  }
  Status Verify() override { return Status::Ok(); }

 private:
  const MemoryCheckpoint* in_;
  std::string path_ = "memory";
};

}  // namespace strata::testing

#endif  // STRATA_TESTS_MEMTIER_MEMORY_CHECKPOINT_H_
