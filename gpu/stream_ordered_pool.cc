#include "gpu/stream_ordered_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <utility>

#include "gpu/cpu_kernels.h"
#include "util/log.h"

namespace strata {

// ---- DeviceMemory (declared in strata/device.h) -----------------------------

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      offset_(std::exchange(other.offset_, 0)),
      reserved_(std::exchange(other.reserved_, 0)),
      streams_(std::move(other.streams_)) {
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  other.streams_.clear();
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    offset_ = std::exchange(other.offset_, 0);
    reserved_ = std::exchange(other.reserved_, 0);
    streams_ = std::move(other.streams_);
    other.streams_.clear();
  }
  return *this;
}

void DeviceMemory::RecordUse(Stream& stream) {
  if (pool_ == nullptr) return;
  if (std::find(streams_.begin(), streams_.end(), &stream) == streams_.end()) {
    streams_.push_back(&stream);
  }
}

void DeviceMemory::Reset() noexcept {
  if (pool_ != nullptr) pool_->Free(*this);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  offset_ = 0;
  reserved_ = 0;
  streams_.clear();
}

// ---- ExternalDeviceMemory (declared in strata/device.h) ---------------------

ExternalDeviceMemory::ExternalDeviceMemory(
    ExternalDeviceMemory&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)) {
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
}

ExternalDeviceMemory& ExternalDeviceMemory::operator=(
    ExternalDeviceMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void ExternalDeviceMemory::Reset() noexcept {
  if (pool_ != nullptr) pool_->Unregister(data_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

namespace internal {
namespace {

// "1536 bytes (1.50 KiB)": exact for people who compare, readable for others.
std::string Bytes(uint64_t n) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  std::string s = std::to_string(n) + " bytes";
  if (n >= 1024) {
    double v = static_cast<double>(n) / 1024;
    int u = 0;
    while (v >= 1024 && u < 3) {
      v /= 1024;
      ++u;
    }
    char buf[48];
    std::snprintf(buf, sizeof buf, " (%.2f %s)", v, kUnits[u]);
    s += buf;
  }
  return s;
}

}  // namespace

StreamOrderedPool::StreamOrderedPool(Device* device, std::byte* base,
                                     uint64_t budget, std::string device_name)
    : device_(device),
      base_(base),
      budget_(budget),
      device_name_(std::move(device_name)),
      planner_(budget) {
  stats_.budget_bytes = planner_.capacity();
}

StreamOrderedPool::~StreamOrderedPool() {
  std::deque<std::shared_ptr<PendingFree>> pending;
  {
    MutexLock lock(&mu_);
    if (stats_.in_use_bytes != 0) {
      STRATA_LOG_ERROR(
          "{}: destroyed with {} of device memory still allocated; those "
          "DeviceMemory objects now dangle",
          device_name_, Bytes(stats_.in_use_bytes));
    }
    pending.swap(pending_);
  }
  // The events' streams may already be gone (a stream drains when
  // destroyed), so these waits usually return at once; they keep the region
  // alive until queued work that touches it is done.
  for (auto& p : pending) {
    for (auto& e : p->events) device_->SynchronizeEvent(*e).IgnoreError();
  }
}

StatusOr<DeviceMemory> StreamOrderedPool::Allocate(size_t bytes,
                                                   Stream& stream) {
  return AllocateImpl(bytes, stream, /*wait=*/true);
}

StatusOr<DeviceMemory> StreamOrderedPool::TryAllocate(size_t bytes,
                                                      Stream& stream) {
  return AllocateImpl(bytes, stream, /*wait=*/false);
}

StatusOr<DeviceMemory> StreamOrderedPool::AllocateImpl(size_t bytes,
                                                       Stream& stream,
                                                       bool wait) {
  DeviceMemory m;
  if (bytes == 0) return m;
  for (;;) {
    std::shared_ptr<PendingFree> oldest;
    {
      MutexLock lock(&mu_);
      ReclaimLocked();
      if (auto offset = planner_.Allocate(bytes)) {
        m.pool_ = this;
        m.data_ = base_ + *offset;
        m.size_ = bytes;
        m.offset_ = *offset;
        m.reserved_ = BlockPlanner::RoundUp(bytes);
        m.streams_.push_back(&stream);
        stats_.in_use_bytes += m.reserved_;
        stats_.peak_in_use_bytes =
            std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
        ++stats_.allocations;
        return m;
      }
      if (pending_.empty()) {
        ++stats_.failed_allocations;
        return Status::OutOfMemory(OutOfMemoryMessage(bytes));
      }
      if (!wait) {
        // Room that pending frees could give back, fragmentation aside.
        if (planner_.free_bytes() + stats_.pending_free_bytes <
            BlockPlanner::RoundUp(bytes)) {
          ++stats_.failed_allocations;
          return Status::OutOfMemory(OutOfMemoryMessage(bytes));
        }
        ++stats_.busy_allocations;
        return Status(StatusCode::kBusy,
                      device_name_ + ": " + Bytes(bytes) +
                          " of device memory would have to wait for " +
                          Bytes(stats_.pending_free_bytes) +
                          " of pending frees (TryAllocate does not wait)");
      }
      oldest = pending_.front();
      ++stats_.reuse_waits;
    }
    // Outside mu_: this blocks until the streams reach the free.
    for (auto& e : oldest->events) {
      STRATA_RETURN_IF_ERROR(device_->SynchronizeEvent(*e).WithContext(
          "waiting for freed device memory to become reusable"));
    }
  }
}

void StreamOrderedPool::Free(DeviceMemory& memory) noexcept {
  auto pending = std::make_shared<PendingFree>();
  pending->offset = memory.offset_;
  pending->bytes = memory.reserved_;
  Status failed;
  for (Stream* s : memory.streams_) {
    auto event = device_->NewEvent();
    if (!event.ok()) {
      failed = event.status();
      break;
    }
    failed = device_->RecordEvent(**event, *s);
    if (!failed.ok()) break;
    pending->events.push_back(std::move(*event));
  }
  if (!failed.ok()) {
    // Without events the only safe order is to wait for the streams now.
    pending->events.clear();
    for (Stream* s : memory.streams_) {
      Status st = device_->SynchronizeStream(*s);
      if (!st.ok()) {
        STRATA_LOG_ERROR(
            "{}: cannot order the free of {} at offset {} ({}; then {}); the "
            "block is leaked",
            device_name_, Bytes(pending->bytes), pending->offset,
            failed.ToString(), st.ToString());
        MutexLock lock(&mu_);
        stats_.in_use_bytes -= pending->bytes;
        ++stats_.frees;
        return;
      }
    }
  }
  MutexLock lock(&mu_);
  stats_.in_use_bytes -= pending->bytes;
  ++stats_.frees;
  if (pending->events.empty()) {
    planner_.Free(pending->offset, pending->bytes);
  } else {
    stats_.pending_free_bytes += pending->bytes;
    pending_.push_back(std::move(pending));
  }
}

void StreamOrderedPool::ReclaimLocked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    bool done = true;
    for (auto& e : (*it)->events) {
      auto q = device_->QueryEvent(*e);
      // An error (a failed CUDA context) keeps the block pending: it is not
      // known to be idle. The error itself surfaces on the next sync.
      if (!q.ok() || !*q) {
        done = false;
        break;
      }
    }
    if (done) {
      planner_.Free((*it)->offset, (*it)->bytes);
      stats_.pending_free_bytes -= (*it)->bytes;
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

DeviceMemoryStats StreamOrderedPool::stats() const {
  DeviceMemoryStats s;
  {
    MutexLock lock(&mu_);
    s = stats_;
    s.free_bytes = planner_.free_bytes();
    s.largest_free_block = planner_.largest_free_block();
  }
  MutexLock lock(&external_mu_);
  s.external_ranges = external_.size();
  return s;
}

namespace {

std::string Range(const void* p, size_t bytes) {
  char range[96];
  std::snprintf(range, sizeof range, "[%p, +%zu bytes)", p, bytes);
  return range;
}

}  // namespace

StatusOr<ExternalDeviceMemory> StreamOrderedPool::RegisterExternal(
    void* data, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(data);
  const auto lo = reinterpret_cast<uintptr_t>(base_);
  const std::string what = "external device memory " + Range(data, bytes);
  if (data == nullptr || bytes == 0) {
    return Status::InvalidArgument(what + ": null or empty");
  }
  if (a + bytes < a) {
    return Status::InvalidArgument(what + ": its end wraps around");
  }
  if (a < lo + budget_ && lo < a + bytes) {
    return Status::InvalidArgument(what + " overlaps the memory pool of " +
                                   device_name_ +
                                   "; allocate from it or register elsewhere");
  }
  MutexLock lock(&external_mu_);
  if (OverlapsExternalLocked(a, bytes)) {
    return Status::InvalidArgument(
        what +
        " overlaps a range registered already; register the enclosing "
        "allocation once");
  }
  external_[a] = a + bytes;
  ExternalDeviceMemory m;
  m.pool_ = this;
  m.data_ = data;
  m.size_ = bytes;
  return m;
}

void StreamOrderedPool::Unregister(const void* data) noexcept {
  MutexLock lock(&external_mu_);
  external_.erase(reinterpret_cast<uintptr_t>(data));
}

bool StreamOrderedPool::OverlapsExternalLocked(uintptr_t a, size_t n) const {
  // Ranges are disjoint: only the last one starting before a + n can reach
  // past a.
  auto it = external_.lower_bound(a + n);
  if (it == external_.begin()) return false;
  --it;
  return it->second > a;
}

std::string StreamOrderedPool::OutOfMemoryMessage(size_t bytes) const {
  return device_name_ + ": out of device memory: asked for " + Bytes(bytes) +
         " (" + std::to_string(BlockPlanner::RoundUp(bytes)) +
         " after rounding to 256), " + Bytes(planner_.free_bytes()) +
         " free (largest free block " + Bytes(planner_.largest_free_block()) +
         "), " + Bytes(stats_.in_use_bytes) + " in use, of a budget of " +
         Bytes(planner_.capacity()) +
         "; raise DeviceOptions::memory_budget_bytes or free blocks first";
}

Status StreamOrderedPool::CheckInside(const void* p, size_t bytes,
                                      std::string_view what) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const auto lo = reinterpret_cast<uintptr_t>(base_);
  if (p != nullptr && a >= lo && a - lo <= budget_ &&
      bytes <= budget_ - (a - lo)) {
    return Status::Ok();
  }
  size_t external_ranges;
  {
    MutexLock lock(&external_mu_);
    if (p != nullptr && a + bytes >= a) {
      auto it = external_.upper_bound(a);
      if (it != external_.begin() && a + bytes <= std::prev(it)->second) {
        return Status::Ok();
      }
    }
    external_ranges = external_.size();
  }
  char region[64];
  std::snprintf(region, sizeof region, "%p", static_cast<const void*>(base_));
  return Status::InvalidArgument(
      std::string(what) + " " + Range(p, bytes) + " is not device memory of " +
      device_name_ + " (region " + region + ", " + std::to_string(budget_) +
      " bytes, nor inside one of " + std::to_string(external_ranges) +
      " registered external ranges)");
}

Status StreamOrderedPool::CheckOutside(const void* p, size_t bytes,
                                       std::string_view what) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const auto lo = reinterpret_cast<uintptr_t>(base_);
  if (p == nullptr && bytes > 0) {
    return Status::InvalidArgument(std::string(what) + " is null");
  }
  if (a + bytes < a) {
    return Status::InvalidArgument(std::string(what) + " " + Range(p, bytes) +
                                   ": its end wraps around");
  }
  const bool in_pool = !(a + bytes <= lo || a >= lo + budget_);
  bool external = false;
  if (!in_pool) {
    MutexLock lock(&external_mu_);
    external = OverlapsExternalLocked(a, bytes);
  }
  if (!in_pool && !external) return Status::Ok();
  return Status::InvalidArgument(
      std::string(what) + " is device memory" +
      (external ? " (registered external memory)" : "") +
      "; expected host memory");
}

Status StreamOrderedPool::CheckCopy(const void* dst, const void* src,
                                    size_t bytes, CopyKind kind) const {
  switch (kind) {
    case CopyKind::kHostToDevice:
      STRATA_RETURN_IF_ERROR(CheckOutside(src, bytes, "h2d source"));
      return CheckInside(dst, bytes, "h2d destination");
    case CopyKind::kDeviceToHost:
      STRATA_RETURN_IF_ERROR(CheckInside(src, bytes, "d2h source"));
      return CheckOutside(dst, bytes, "d2h destination");
    case CopyKind::kDeviceToDevice: {
      STRATA_RETURN_IF_ERROR(CheckInside(src, bytes, "d2d source"));
      STRATA_RETURN_IF_ERROR(CheckInside(dst, bytes, "d2d destination"));
      const auto d = reinterpret_cast<uintptr_t>(dst);
      const auto s = reinterpret_cast<uintptr_t>(src);
      if (d < s + bytes && s < d + bytes) {
        return Status::InvalidArgument(
            "d2d copy of " + std::to_string(bytes) +
            " bytes between overlapping ranges (offset " +
            std::to_string(static_cast<int64_t>(d - s)) + ")");
      }
      return Status::Ok();
    }
  }
  return Status::InvalidArgument("unknown copy kind");
}

namespace {

Status CheckAligned(const void* p, ElementType type, std::string_view what) {
  if (reinterpret_cast<uintptr_t>(p) % ElementSize(type) == 0) {
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string(what) + " is not aligned to its " +
                                 std::string(ElementTypeName(type)) +
                                 " elements");
}

}  // namespace

Status StreamOrderedPool::CheckConvert(const ConvertArgs& args) const {
  const size_t src_elem = ElementSize(args.src_type);
  const size_t dst_elem = ElementSize(args.dst_type);
  if (args.count > SIZE_MAX / std::max(src_elem, dst_elem)) {
    return Status::InvalidArgument("conversion of " +
                                   std::to_string(args.count) +
                                   " elements: the byte size wraps around");
  }
  const size_t src_bytes = args.count * src_elem;
  const size_t dst_bytes = args.count * dst_elem;
  STRATA_RETURN_IF_ERROR(CheckInside(args.src, src_bytes, "convert source"));
  STRATA_RETURN_IF_ERROR(
      CheckInside(args.dst, dst_bytes, "convert destination"));
  STRATA_RETURN_IF_ERROR(
      CheckAligned(args.src, args.src_type, "convert source"));
  STRATA_RETURN_IF_ERROR(
      CheckAligned(args.dst, args.dst_type, "convert destination"));
  const auto s = reinterpret_cast<uintptr_t>(args.src);
  const auto d = reinterpret_cast<uintptr_t>(args.dst);
  const bool in_place = s == d && src_elem == dst_elem;
  if (!in_place && d < s + src_bytes && s < d + dst_bytes) {
    return Status::InvalidArgument(
        "conversion source and destination overlap (only an in-place "
        "conversion between types of one size may)");
  }
  return Status::Ok();
}

Status StreamOrderedPool::CheckGemm(const GemmArgs& g) const {
  STRATA_RETURN_IF_ERROR(CheckGemmArgs(g));
  if (g.m == 0 || g.n == 0) return Status::Ok();
  const size_t ab = ElementSize(g.ab_type);
  const bool ta = g.op_a == GemmOp::kTranspose;
  const bool tb = g.op_b == GemmOp::kTranspose;
  if (g.k > 0) {
    STRATA_RETURN_IF_ERROR(CheckInside(
        g.a, MatrixSpanBytes(ta ? g.k : g.m, ta ? g.m : g.k, g.lda, ab),
        "GEMM A"));
    STRATA_RETURN_IF_ERROR(CheckInside(
        g.b, MatrixSpanBytes(tb ? g.n : g.k, tb ? g.k : g.n, g.ldb, ab),
        "GEMM B"));
    STRATA_RETURN_IF_ERROR(CheckAligned(g.a, g.ab_type, "GEMM A"));
    STRATA_RETURN_IF_ERROR(CheckAligned(g.b, g.ab_type, "GEMM B"));
  }
  STRATA_RETURN_IF_ERROR(CheckInside(
      g.c, MatrixSpanBytes(g.m, g.n, g.ldc, ElementSize(g.c_type)), "GEMM C"));
  return CheckAligned(g.c, g.c_type, "GEMM C");
}

}  // namespace internal
}  // namespace strata
