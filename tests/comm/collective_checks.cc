#include "tests/comm/collective_checks.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "util/half.h"

namespace strata::testing {
namespace {

uint16_t HalfBits(float f) {
  if (std::isnan(f)) return 0x7e00u;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) |
                               HalfMagnitudeFromFloatBits(u & 0x7fffffffu));
}

// Encodes `v` (integers, inf or NaN) as `type`.
std::vector<std::byte> Encode(CommType type, const std::vector<float>& v) {
  const size_t es = CommTypeSize(type);
  std::vector<std::byte> out(v.size() * es);
  for (size_t i = 0; i < v.size(); ++i) {
    if (type == CommType::kFloat32) {
      std::memcpy(&out[i * es], &v[i], 4);
    } else {
      const uint16_t b =
          type == CommType::kBFloat16
              ? static_cast<uint16_t>(std::bit_cast<uint32_t>(v[i]) >> 16)
              : HalfBits(v[i]);
      std::memcpy(&out[i * es], &b, 2);
    }
  }
  return out;
}

// Equal as values: NaN matches NaN, otherwise the bits.
bool SameValues(CommType type, const std::vector<std::byte>& got,
                const std::vector<float>& want) {
  const std::vector<std::byte> w = Encode(type, want);
  if (got.size() != w.size()) return false;
  const size_t es = CommTypeSize(type);
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      uint32_t bits = 0;
      std::memcpy(&bits, &got[i * es], es);
      const bool nan = type == CommType::kFloat32
                           ? std::isnan(std::bit_cast<float>(bits))
                       : type == CommType::kBFloat16
                           ? (bits & 0x7f80u) == 0x7f80u && (bits & 0x7fu)
                           : (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu);
      if (!nan) return false;
    } else if (std::memcmp(&got[i * es], &w[i * es], es) != 0) {
      return false;
    }
  }
  return true;
}

// Buffers on the host or on a device; the same calls either way.
class Place {
 public:
  Place(Device* device, Stream* stream) : device_(device), stream_(stream) {}
  CommPlace place() const { return {device_, stream_}; }

  // A buffer holding `bytes` (at least 1, so the pointer is never null).
  struct Buffer {
    std::vector<std::byte> host;
    DeviceMemory dev;
    std::byte* data() {
      return dev.empty() ? host.data() : static_cast<std::byte*>(dev.data());
    }
  };
  StatusOr<Buffer> Make(const std::vector<std::byte>& init) {
    Buffer b;
    const size_t n = std::max<size_t>(init.size(), 1);
    if (device_ == nullptr) {
      b.host = init;
      b.host.resize(n);
      return b;
    }
    STRATA_ASSIGN_OR_RETURN(b.dev, device_->Allocate(n, *stream_));
    if (!init.empty()) {
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream_, b.dev.data(),
                                                init.data(), init.size(),
                                                CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*stream_));
    }
    return b;
  }
  StatusOr<std::vector<std::byte>> Read(Buffer& b, size_t offset,
                                        size_t bytes) {
    std::vector<std::byte> out(bytes);
    if (device_ == nullptr) {
      if (bytes > 0) std::memcpy(out.data(), b.host.data() + offset, bytes);
      return out;
    }
    if (bytes > 0) {
      STRATA_RETURN_IF_ERROR(device_->CopyAsync(*stream_, out.data(),
                                                b.dev.at(offset), bytes,
                                                CopyKind::kDeviceToHost));
    }
    STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*stream_));
    return out;
  }

 private:
  Device* device_;
  Stream* stream_;
};

class Checker {
 public:
  Checker(Communicator& comm, Place& place, CheckReport& report)
      : comm_(comm), place_(place), report_(report) {}

  void Run(CommType type, const std::vector<size_t>& counts) {
    type_ = type;
    counts_ = counts;
    prefix_ = std::string(CommTypeName(type)) + " counts " + CountsText();
    AllGather(false);
    AllGather(true);
    ReduceScatter(ReduceOp::kSum);
    ReduceScatter(ReduceOp::kMax);
    AllReduce(ReduceOp::kSum, false);
    AllReduce(ReduceOp::kMax, true);
    Broadcast();
  }
  void Overflow(CommType type) {
    type_ = type;
    prefix_ = std::string(CommTypeName(type)) + " overflow";
    const int n = comm_.size(), r = comm_.rank();
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    // Rank 0 overflowed to inf, the last rank to NaN (on one rank both).
    std::vector<float> v = {r == 0 ? inf : 1.0f, r == n - 1 ? nan : 2.0f};
    std::vector<float> want = {inf, nan};
    Expect("max all-reduce", Reduce(v, want, ReduceOp::kMax, true));
  }

 private:
  std::string CountsText() const {
    std::string s = "{";
    for (size_t c : counts_) s += (s.size() > 1 ? "," : "") + std::to_string(c);
    return s + "}";
  }
  size_t Offset(size_t r) const {
    return std::accumulate(counts_.begin(), counts_.begin() + r, size_t{0});
  }
  size_t Total() const { return Offset(counts_.size()); }
  static float V(int rank, size_t i) {
    return static_cast<float>((rank * 7 + static_cast<int>(i)) % 32);
  }
  static float W(int rank, size_t j) {
    return static_cast<float>((rank + 1) * static_cast<int>(j % 5)) - 2;
  }

  void Expect(const std::string& what, const Status& s) {
    ++report_.checks;
    if (!s.ok()) {
      report_.failures.push_back("rank " + std::to_string(comm_.rank()) + ": " +
                                 prefix_ + " " + what + ": " + s.ToString());
    }
  }
  Status Compare(Place::Buffer& b, size_t offset, const std::vector<float>& w) {
    const size_t es = CommTypeSize(type_);
    STRATA_ASSIGN_OR_RETURN(auto got,
                            place_.Read(b, offset * es, w.size() * es));
    if (!SameValues(type_, got, w)) {
      return Status::Corruption("result differs from the reference");
    }
    return Status::Ok();
  }

  void AllGather(bool in_place) {
    const int me = comm_.rank();
    std::vector<float> mine(counts_[me]), all(Total(), -1.0f), want(Total());
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = V(me, i);
    for (size_t r = 0; r < counts_.size(); ++r) {
      for (size_t i = 0; i < counts_[r]; ++i) want[Offset(r) + i] = V(r, i);
    }
    if (in_place) {
      for (size_t i = 0; i < mine.size(); ++i) all[Offset(me) + i] = mine[i];
    }
    const size_t es = CommTypeSize(type_);
    Expect(in_place ? "in-place all-gather" : "all-gather", [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(auto send, place_.Make(Encode(type_, mine)));
      STRATA_ASSIGN_OR_RETURN(auto recv, place_.Make(Encode(type_, all)));
      const void* src = in_place ? recv.data() + Offset(me) * es : send.data();
      STRATA_ASSIGN_OR_RETURN(
          CommWork w,
          comm_.AllGather(src, recv.data(), counts_, type_, place_.place()));
      STRATA_RETURN_IF_ERROR(w.Wait());
      return Compare(recv, 0, want);
    }());
  }

  void ReduceScatter(ReduceOp op) {
    const int me = comm_.rank(), n = comm_.size();
    std::vector<float> send(Total()), want(counts_[me]);
    for (size_t j = 0; j < send.size(); ++j) send[j] = W(me, j);
    for (size_t k = 0; k < want.size(); ++k) {
      float acc = W(0, Offset(me) + k);
      for (int r = 1; r < n; ++r) {
        const float x = W(r, Offset(me) + k);
        acc = op == ReduceOp::kSum ? acc + x : std::max(acc, x);
      }
      want[k] = acc;
    }
    Expect(std::string("reduce-scatter ") + std::string(ReduceOpName(op)),
           [&]() -> Status {
             STRATA_ASSIGN_OR_RETURN(auto s, place_.Make(Encode(type_, send)));
             STRATA_ASSIGN_OR_RETURN(
                 auto recv, place_.Make(Encode(
                                type_, std::vector<float>(want.size(), -1))));
             STRATA_ASSIGN_OR_RETURN(
                 CommWork w, comm_.ReduceScatter(s.data(), recv.data(), counts_,
                                                 type_, op, place_.place()));
             STRATA_RETURN_IF_ERROR(w.Wait());
             return Compare(recv, 0, want);
           }());
  }

  // An all-reduce of `v` whose result must be `want`.
  Status Reduce(const std::vector<float>& v, const std::vector<float>& want,
                ReduceOp op, bool in_place) {
    STRATA_ASSIGN_OR_RETURN(auto s, place_.Make(Encode(type_, v)));
    STRATA_ASSIGN_OR_RETURN(
        auto recv,
        place_.Make(Encode(type_, std::vector<float>(v.size(), -1))));
    void* dst = in_place ? s.data() : recv.data();
    STRATA_ASSIGN_OR_RETURN(
        CommWork w,
        comm_.AllReduce(s.data(), dst, v.size(), type_, op, place_.place()));
    STRATA_RETURN_IF_ERROR(w.Wait());
    return Compare(in_place ? s : recv, 0, want);
  }

  void AllReduce(ReduceOp op, bool in_place) {
    const int me = comm_.rank(), n = comm_.size();
    const size_t count = Total() + 3;
    std::vector<float> v(count), want(count);
    for (size_t j = 0; j < count; ++j) {
      v[j] = W(me, j);
      float acc = W(0, j);
      for (int r = 1; r < n; ++r) {
        acc = op == ReduceOp::kSum ? acc + W(r, j) : std::max(acc, W(r, j));
      }
      want[j] = acc;
    }
    Expect(std::string(in_place ? "in-place " : "") + "all-reduce " +
               std::string(ReduceOpName(op)),
           Reduce(v, want, op, in_place));
  }

  void Broadcast() {
    const int me = comm_.rank(), root = comm_.size() - 1;
    const size_t count = Total() + 1;
    std::vector<float> v(count, -1.0f), want(count);
    for (size_t i = 0; i < count; ++i) {
      want[i] = V(root, i);
      if (me == root) v[i] = want[i];
    }
    Expect("broadcast", [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(auto b, place_.Make(Encode(type_, v)));
      STRATA_ASSIGN_OR_RETURN(
          CommWork w,
          comm_.Broadcast(b.data(), count, type_, root, place_.place()));
      STRATA_RETURN_IF_ERROR(w.Wait());
      return Compare(b, 0, want);
    }());
  }

  Communicator& comm_;
  Place& place_;
  CheckReport& report_;
  CommType type_ = CommType::kFloat32;
  std::vector<size_t> counts_;
  std::string prefix_;
};

void CheckOn(Communicator& comm, Place& place, CheckReport& report) {
  const int n = comm.size();
  // The engine's cut (the last shard shorter), and one with an empty part.
  std::vector<size_t> uneven(n);
  for (int r = 0; r < n; ++r) uneven[r] = static_cast<size_t>((r * 3 + 2) % 5);
  Checker checker(comm, place, report);
  for (CommType t :
       {CommType::kFloat32, CommType::kBFloat16, CommType::kFloat16}) {
    checker.Run(t, ShardCounts(3 * static_cast<size_t>(n) + 1, n));
    checker.Run(t, uneven);
    checker.Overflow(t);
  }
  ++report.checks;
  if (Status s = comm.Barrier(); !s.ok()) {
    report.failures.push_back("barrier: " + s.ToString());
  }
}

}  // namespace

CheckReport CheckCollectives(Communicator& comm, bool host, Device* device) {
  CheckReport report;
  if (host) {
    Place place(nullptr, nullptr);
    CheckOn(comm, place, report);
  }
  if (device != nullptr) {
    auto stream = device->NewStream({});
    if (!stream.ok()) {
      report.failures.push_back("NewStream: " + stream.status().ToString());
      return report;
    }
    {
      Place place(device, stream->get());
      CheckOn(comm, place, report);
    }
    (void)device->SynchronizeStream(**stream);
  }
  return report;
}

CheckReport CheckArgumentErrors(Communicator& comm) {
  CheckReport report;
  const int n = comm.size();
  std::vector<float> a(64), b(64);
  std::vector<size_t> counts(n, 1), wrong(n + 1, 1);
  auto expect = [&](const std::string& what, const StatusOr<CommWork>& r) {
    ++report.checks;
    if (r.ok() || r.status().code() != StatusCode::kInvalidArgument) {
      report.failures.push_back(
          what + ": expected InvalidArgument, got " +
          (r.ok() ? std::string("OK") : r.status().ToString()));
    }
  };
  expect("all-gather with size()+1 counts",
         comm.AllGather(a.data(), b.data(), wrong, CommType::kFloat32));
  expect("reduce-scatter with size()+1 counts",
         comm.ReduceScatter(a.data(), b.data(), wrong, CommType::kFloat32,
                            ReduceOp::kSum));
  expect("reduce-scatter of bytes",
         comm.ReduceScatter(a.data(), b.data(), counts, CommType::kByte,
                            ReduceOp::kSum));
  expect(
      "all-reduce of bytes",
      comm.AllReduce(a.data(), b.data(), 4, CommType::kByte, ReduceOp::kMax));
  expect(
      "all-reduce into a null buffer",
      comm.AllReduce(a.data(), nullptr, 4, CommType::kFloat32, ReduceOp::kSum));
  expect("all-reduce with overlapping buffers",
         comm.AllReduce(a.data(), a.data() + 1, 4, CommType::kFloat32,
                        ReduceOp::kSum));
  expect("reduce-scatter with overlapping buffers",
         comm.ReduceScatter(a.data(), a.data(), counts, CommType::kFloat32,
                            ReduceOp::kSum));
  expect(
      "all-gather with send inside recv elsewhere",
      comm.AllGather(reinterpret_cast<std::byte*>(b.data() + comm.rank()) + 2,
                     b.data(), counts, CommType::kFloat32));
  expect("broadcast from root size()",
         comm.Broadcast(a.data(), 4, CommType::kFloat32, n));
  expect("broadcast from root -1",
         comm.Broadcast(a.data(), 4, CommType::kFloat32, -1));
  CommPlace half;
  half.stream = reinterpret_cast<Stream*>(&a);  // never dereferenced
  expect("a CommPlace with a stream and no device",
         comm.Broadcast(a.data(), 4, CommType::kFloat32, 0, half));
  ++report.checks;
  if (!comm.status().ok()) {
    report.failures.push_back("argument errors broke the communicator: " +
                              comm.status().ToString());
  }
  return report;
}

CheckReport CheckDuplicate(Communicator& comm) {
  CheckReport report;
  const std::string me = "rank " + std::to_string(comm.rank()) + ": ";
  StatusOr<Communicator> dup = comm.Duplicate();
  ++report.checks;
  if (!dup.ok()) {
    report.failures.push_back(me + "Duplicate: " + dup.status().ToString());
    return report;
  }
  ++report.checks;
  if (dup->rank() != comm.rank() || dup->size() != comm.size() ||
      dup->timeout_s() != comm.timeout_s() ||
      dup->backend() != comm.backend()) {
    report.failures.push_back(me + "the duplicate is another group");
  }
  // Thread k sums k + 1 + rank + i over the ranks, on its own communicator.
  constexpr int kRounds = 40;
  auto run = [&](Communicator& c, int k, std::vector<std::string>* bad) {
    for (int i = 0; i < kRounds; ++i) {
      if ((i + comm.rank() + k) % 3 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      float x = static_cast<float>(k + 1 + comm.rank() + i), y = 0;
      auto w = c.AllReduce(&x, &y, 1, CommType::kFloat32, ReduceOp::kSum);
      const Status st = w.ok() ? w->Wait() : w.status();
      const int n = c.size();
      const float want = static_cast<float>(n * (k + 1 + i) + n * (n - 1) / 2);
      if (!st.ok() || y != want) {
        bad->push_back("thread " + std::to_string(k) + " round " +
                       std::to_string(i) + ": " +
                       (st.ok()
                            ? std::to_string(y) + " != " + std::to_string(want)
                            : st.ToString()));
        return;
      }
    }
  };
  std::vector<std::string> bad0, bad1;
  std::thread other([&] { run(*dup, 1, &bad1); });
  run(comm, 0, &bad0);
  other.join();
  report.checks += 2 * kRounds;
  for (const auto* v : {&bad0, &bad1}) {
    for (const std::string& f : *v) report.failures.push_back(me + f);
  }
  return report;
}

}  // namespace strata::testing
