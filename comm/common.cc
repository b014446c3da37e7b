// What every backend shares: names, descriptions, host reductions.
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "comm/backend.h"
#include "util/half.h"

namespace strata {

std::string_view CommBackendName(CommBackendKind kind) {
  switch (kind) {
    case CommBackendKind::kSingle:
      return "single";
    case CommBackendKind::kMpi:
      return "mpi";
    case CommBackendKind::kNccl:
      return "nccl";
  }
  return "?";
}

std::string_view CommTypeName(CommType type) {
  switch (type) {
    case CommType::kByte:
      return "byte";
    case CommType::kFloat32:
      return "float32";
    case CommType::kBFloat16:
      return "bfloat16";
    case CommType::kFloat16:
      return "float16";
  }
  return "?";
}

size_t CommTypeSize(CommType type) {
  switch (type) {
    case CommType::kByte:
      return 1;
    case CommType::kFloat32:
      return 4;
    case CommType::kBFloat16:
    case CommType::kFloat16:
      return 2;
  }
  return 1;
}

std::string_view ReduceOpName(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : "max";
}

std::vector<size_t> ShardCounts(size_t total, int size) {
  const size_t n = static_cast<size_t>(size < 1 ? 1 : size);
  const size_t shard = (total + n - 1) / n;
  std::vector<size_t> counts(n);
  size_t left = total;
  for (size_t& c : counts) {
    c = left < shard ? left : shard;
    left -= c;
  }
  return counts;
}

namespace internal {

std::string_view CommOpName(CommOpKind kind) {
  switch (kind) {
    case CommOpKind::kAllGather:
      return "all-gather";
    case CommOpKind::kReduceScatter:
      return "reduce-scatter";
    case CommOpKind::kAllReduce:
      return "all-reduce";
    case CommOpKind::kBroadcast:
      return "broadcast";
    case CommOpKind::kBarrier:
      return "barrier";
  }
  return "?";
}

size_t CollectiveArgs::Offset(size_t i) const {
  size_t sum = 0;
  for (size_t r = 0; r < i && r < counts.size(); ++r) sum += counts[r];
  return sum;
}

std::string CollectiveArgs::Describe() const {
  std::string s(CommOpName(kind));
  if (kind == CommOpKind::kBarrier) return s;
  s += " (";
  if (kind == CommOpKind::kReduceScatter || kind == CommOpKind::kAllReduce) {
    s += std::string(ReduceOpName(op)) + ", ";
  }
  s += std::string(CommTypeName(type)) + ", " + std::to_string(Total()) +
       " elements";
  if (kind == CommOpKind::kBroadcast) s += ", root " + std::to_string(root);
  return s + ")";
}

StatusOr<std::unique_ptr<BackendRequest>> CommBackend::Enqueue(
    const CollectiveArgs& args, Stream&) {
  return Status::NotSupported(std::string(CommBackendName(kind())) +
                              " enqueues no " + args.Describe() +
                              " on a native stream");
}

StatusOr<std::unique_ptr<CommBackend>> CommBackend::StartDuplicate(
    std::unique_ptr<BackendRequest>*) {
  return Status::NotSupported(
      "the " + std::string(CommBackendName(kind())) +
      " backend cannot duplicate its communicator (make a second one)");
}

namespace {

float FromBf16(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }
uint16_t ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return Bf16FromFloatBits(u);
}
float FromHalf(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  if ((h & 0x7c00u) == 0x7c00u) {  // inf or NaN
    return std::bit_cast<float>(sign | 0x7f800000u | ((h & 0x3ffu) << 13));
  }
  return std::bit_cast<float>(sign | FloatBitsFromHalfMagnitude(h & 0x7fffu));
}
uint16_t ToHalf(float f) {
  if (std::isnan(f)) return 0x7e00u;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) |
                               HalfMagnitudeFromFloatBits(u & 0x7fffffffu));
}

// NaN wins, so that an overflow on any rank is seen by all.
float Combine(float a, float b, ReduceOp op) {
  if (op == ReduceOp::kSum) return a + b;
  if (std::isnan(a) || std::isnan(b)) return std::nanf("");
  return a > b ? a : b;
}

template <class T, class From, class To>
void ReduceAs(const void* in, void* inout, size_t count, ReduceOp op, From from,
              To to) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (size_t i = 0; i < count; ++i)
    b[i] = to(Combine(from(b[i]), from(a[i]), op));
}

}  // namespace

void ReduceHost(const void* in, void* inout, size_t count, CommType type,
                ReduceOp op) {
  switch (type) {
    case CommType::kFloat32:
      ReduceAs<float>(
          in, inout, count, op, [](float v) { return v; },
          [](float v) { return v; });
      return;
    case CommType::kBFloat16:
      ReduceAs<uint16_t>(in, inout, count, op, FromBf16, ToBf16);
      return;
    case CommType::kFloat16:
      ReduceAs<uint16_t>(in, inout, count, op, FromHalf, ToHalf);
      return;
    case CommType::kByte:
      return;  // refused before any backend sees it
  }
}

}  // namespace internal
}  // namespace strata
