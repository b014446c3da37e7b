// One conformance suite for every Device backend: ordering, events, memory
// budget, stream-ordered reuse, copies, conversions and GEMM, wrapped native
// streams, external memory, host events and TryAllocate. Built twice
// (tests/gpu/CMakeLists.txt): the host-emulated backends (also behind a
// DeviceWrapper, so that it forwards every call), and CUDA, whose
// cases skip with the factory's reason when no GPU works, or fail when
// STRATA_REQUIRE_CUDA=1 says a GPU is there (so that a GPU run whose CUDA
// cases all skipped cannot pass for a tested one).
//
// Determinism: no test sleeps to order work. A Gate is a host function
// enqueued on a stream that blocks it until the test opens the gate, so
// "work not yet run" is a state the test controls.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gpu/host_work.h"
#include "strata/device.h"
#include "tests/gpu/conversion_reference.h"

namespace strata {
namespace {

// A DeviceWrapper that owns its target: every call goes through the
// wrapper's forwarding.
class OwningWrapper final : public DeviceWrapper {
 public:
  explicit OwningWrapper(std::unique_ptr<Device> target)
      : DeviceWrapper(target.get()), owned_(std::move(target)) {}

 private:
  std::unique_ptr<Device> owned_;
};

// The host-emulated device with LaunchHostWork composed from host events,
// host functions and a worker thread, as the CUDA backend does it
// (gpu/host_work.h), so that composition is tested without a GPU.
class ComposedHostWork final : public DeviceWrapper {
 public:
  explicit ComposedHostWork(std::unique_ptr<Device> target)
      : DeviceWrapper(target.get()), owned_(std::move(target)), runner_(this) {}
  Status LaunchHostWork(Stream& stream, HostFunction fn) override {
    return runner_.Launch(stream, std::move(fn));
  }

 private:
  std::unique_ptr<Device> owned_;
  internal::HostWorkRunner runner_;  // last: stops before the device goes
};

StatusOr<std::unique_ptr<Device>> MakeDevice(const std::string& backend,
                                             uint64_t budget) {
  DeviceOptions o;
  o.memory_budget_bytes = budget;
  if (backend == "cuda") return NewCudaDevice(o);
  if (backend == "host-wrapped" || backend == "host-composed-work") {
    auto d = NewHostEmulatedDevice(o);
    if (!d.ok()) return d;
    if (backend == "host-composed-work") {
      return std::unique_ptr<Device>(new ComposedHostWork(std::move(*d)));
    }
    return std::unique_ptr<Device>(new OwningWrapper(std::move(*d)));
  }
  if (backend == "host-throttled") {
    // Slow enough that a missing dependency would let later work overtake.
    o.emulated_link_bytes_per_s = 2'000'000'000;
    o.emulated_copy_latency_ns = 20'000;
  }
  return NewHostEmulatedDevice(o);
}

bool CudaRequired() {
  const char* v = getenv("STRATA_REQUIRE_CUDA");
  return v != nullptr && std::string(v) == "1";
}

// Blocks a stream until Open(); opens itself on destruction so a failing
// test never leaves a stream blocked.
class Gate {
 public:
  Gate() : future_(promise_.get_future().share()) {}
  ~Gate() { Open(); }
  Status Close(Device& d, Stream& s) {
    auto f = future_;
    return d.LaunchHostFunc(s, [f] { f.wait(); });
  }
  void Open() {
    if (!open_) promise_.set_value();
    open_ = true;
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_;
  bool open_ = false;
};

class DeviceConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { Init(64 << 20); }

  void Init(uint64_t budget) {
    streams_.clear();
    device_.reset();
    auto d = MakeDevice(GetParam(), budget);
    if (!d.ok() && GetParam() == "cuda" &&
        d.status().code() == StatusCode::kUnavailable && !CudaRequired()) {
      GTEST_SKIP() << "CUDA backend unavailable: " << d.status().ToString();
    }
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    device_ = std::move(*d);
  }

  Stream& NewStream(StreamKind kind = StreamKind::kCompute) {
    auto s = device_->NewStream({kind});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    streams_.push_back(std::move(*s));
    return *streams_.back();
  }

  std::unique_ptr<Event> NewEvent() {
    auto e = device_->NewEvent();
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  }

  DeviceMemory Alloc(size_t bytes, Stream& s) {
    auto m = device_->Allocate(bytes, s);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::move(*m) : DeviceMemory();
  }

  HostBuffer Pinned(size_t bytes) {
    auto b = device_->AllocatePinnedHost(bytes, {});
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return std::move(*b);
  }

  bool Done(const Event& e) {
    auto q = device_->QueryEvent(e);
    EXPECT_TRUE(q.ok()) << q.status().ToString();
    return q.ok() && *q;
  }

  // Enqueues a copy host -> `d` -> host on `s`.
  void CopyThrough(Stream& s, DeviceMemory& d, const std::byte* from,
                   std::byte* to, size_t n) {
    ASSERT_TRUE(
        device_->CopyAsync(s, d.data(), from, n, CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(
        device_->CopyAsync(s, to, d.data(), n, CopyKind::kDeviceToHost).ok());
  }

  // True when a host function enqueued on `other` runs to completion now,
  // whatever holds other streams.
  bool OtherStreamGoesOn(Stream& other) {
    bool ran = false;
    EXPECT_TRUE(device_->LaunchHostFunc(other, [&ran] { ran = true; }).ok());
    EXPECT_TRUE(device_->SynchronizeStream(other).ok());
    return ran;
  }

  // A host event, or null after GTEST_SKIP when the backend has none (CUDA
  // without stream memory operations) and no GPU is required.
  std::unique_ptr<HostEvent> NewHostEvent() {
    auto e = device_->NewHostEvent();
    if (!e.ok() && e.status().code() == StatusCode::kNotSupported &&
        !CudaRequired()) {
      [&] { GTEST_SKIP() << e.status().ToString(); }();
      return nullptr;
    }
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }

  // Declared first: destroyed last, after the streams.
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Stream>> streams_;
};

void Fill(std::byte* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

TEST_P(DeviceConformanceTest, StreamRunsWorkInOrder) {
  Stream& s = NewStream();
  const size_t n = 1 << 20;
  DeviceMemory a = Alloc(n, s), b = Alloc(n, s);
  HostBuffer in = Pinned(n), out = Pinned(n);
  // Each step overwrites what the previous one wrote; only in-order
  // execution leaves exactly the expected bytes.
  for (int round = 0; round < 8; ++round) {
    Fill(in.data(), n, round);
    ASSERT_TRUE(
        device_->CopyAsync(s, a.data(), in.data(), n, CopyKind::kHostToDevice)
            .ok());
    ASSERT_TRUE(device_->MemsetAsync(s, a.at(100), round, 1000).ok());
    ASSERT_TRUE(
        device_->CopyAsync(s, b.data(), a.data(), n, CopyKind::kDeviceToDevice)
            .ok());
    ASSERT_TRUE(device_->MemsetAsync(s, a.data(), 0xee, n).ok());
    ASSERT_TRUE(
        device_->CopyAsync(s, out.data(), b.data(), n, CopyKind::kDeviceToHost)
            .ok());
    ASSERT_TRUE(device_->SynchronizeStream(s).ok());
    std::memset(in.data() + 100, round, 1000);
    ASSERT_EQ(std::memcmp(out.data(), in.data(), n), 0) << "round " << round;
  }
}

TEST_P(DeviceConformanceTest, CrossStreamWaitOrdersWork) {
  Stream& producer = NewStream(StreamKind::kCopy);
  Stream& consumer = NewStream(StreamKind::kCopy);
  const size_t n = (4 << 20) + 3;
  DeviceMemory x = Alloc(n, producer);
  x.RecordUse(consumer);
  HostBuffer in = Pinned(n), out = Pinned(n);
  Fill(in.data(), n, 1);
  std::memset(out.data(), 0, n);
  ASSERT_TRUE(device_->MemsetAsync(producer, x.data(), 0, n).ok());
  ASSERT_TRUE(device_->SynchronizeStream(producer).ok());

  auto ready = NewEvent();
  auto consumed = NewEvent();
  Gate gate;
  ASSERT_TRUE(gate.Close(*device_, producer).ok());
  ASSERT_TRUE(
      device_
          ->CopyAsync(producer, x.data(), in.data(), n, CopyKind::kHostToDevice)
          .ok());
  ASSERT_TRUE(device_->RecordEvent(*ready, producer).ok());
  ASSERT_TRUE(device_->WaitEvent(consumer, *ready).ok());
  ASSERT_TRUE(device_
                  ->CopyAsync(consumer, out.data(), x.data(), n,
                              CopyKind::kDeviceToHost)
                  .ok());
  ASSERT_TRUE(device_->RecordEvent(*consumed, consumer).ok());
  // The producer is gated, so neither event can be complete.
  EXPECT_FALSE(Done(*ready));
  EXPECT_FALSE(Done(*consumed));
  gate.Open();
  ASSERT_TRUE(device_->SynchronizeEvent(*consumed).ok());
  EXPECT_TRUE(Done(*ready));
  EXPECT_TRUE(Done(*consumed));
  EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0)
      << "the consumer copied before the producer's copy finished";
}

TEST_P(DeviceConformanceTest, EventQuerySemantics) {
  Stream& a = NewStream();
  Stream& b = NewStream();
  Stream& c = NewStream();
  auto e = NewEvent();
  EXPECT_TRUE(Done(*e)) << "a never-recorded event is complete";
  EXPECT_TRUE(device_->SynchronizeEvent(*e).ok());
  EXPECT_TRUE(device_->WaitEvent(c, *e).ok());  // no-op

  Gate gate;
  ASSERT_TRUE(gate.Close(*device_, a).ok());
  ASSERT_TRUE(device_->RecordEvent(*e, a).ok());
  EXPECT_FALSE(Done(*e));
  // c waits for the record on gated a ...
  ASSERT_TRUE(device_->WaitEvent(c, *e).ok());
  auto c_done = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*c_done, c).ok());
  // ... and a later record on idle b supersedes it for queries only.
  ASSERT_TRUE(device_->RecordEvent(*e, b).ok());
  ASSERT_TRUE(device_->SynchronizeStream(b).ok());
  EXPECT_TRUE(Done(*e)) << "the latest record decides";
  EXPECT_FALSE(Done(*c_done)) << "a wait keeps the record it captured";
  gate.Open();
  ASSERT_TRUE(device_->SynchronizeStream(c).ok());
  EXPECT_TRUE(Done(*c_done));
}

TEST_P(DeviceConformanceTest, HostFuncsRunInStreamOrder) {
  Stream& s = NewStream();
  std::vector<int> order;  // written by the stream only, read after sync
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(
        device_->LaunchHostFunc(s, [&order, i] { order.push_back(i); }).ok());
  }
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST_P(DeviceConformanceTest, BudgetExhaustionSaysWhatAndHowMuch) {
  Init(1 << 20);
  if (IsSkipped()) return;
  Stream& s = NewStream();
  DeviceMemory a = Alloc(768 << 10, s);
  auto b = device_->Allocate(512 << 10, s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  const std::string msg(b.status().message());
  EXPECT_NE(msg.find("asked for 524288 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("262144 bytes (256.00 KiB) free"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("budget of 1048576 bytes"), std::string::npos) << msg;
  EXPECT_EQ(device_->Allocate(2 << 20, s).status().code(),
            StatusCode::kOutOfMemory);
  const DeviceMemoryStats st = device_->memory_stats();
  EXPECT_EQ(st.failed_allocations, 2u);
  EXPECT_EQ(st.in_use_bytes, 768u << 10);
  EXPECT_EQ(st.budget_bytes, 1u << 20);
  a.Reset();
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  EXPECT_TRUE(device_->Allocate(1 << 20, s).ok()) << "freed memory returns";
}

TEST_P(DeviceConformanceTest, OddSizesAndOffsetsCopyExactly) {
  Stream& s = NewStream(StreamKind::kCopy);
  const size_t cap = (1 << 20) + 4096;
  DeviceMemory d1 = Alloc(cap, s), d2 = Alloc(cap, s);
  HostBuffer src = Pinned(cap), dst = Pinned(cap);
  std::vector<std::byte> pageable_src(cap), pageable_dst(cap);
  Fill(src.data(), cap, 3);
  std::memcpy(pageable_src.data(), src.data(), cap);
  const size_t sizes[] = {1, 3, 255, 257, 4095, 4097, (1 << 20) + 13};
  const size_t offsets[] = {0, 1, 7, 255, 4093};
  for (bool pinned : {true, false}) {
    std::byte* in = pinned ? src.data() : pageable_src.data();
    std::byte* out = pinned ? dst.data() : pageable_dst.data();
    for (size_t n : sizes) {
      for (size_t off : offsets) {
        if (off + n + 11 > cap) continue;
        SCOPED_TRACE("pinned " + std::to_string(pinned) + " bytes " +
                     std::to_string(n) + " offset " + std::to_string(off));
        ASSERT_TRUE(device_->MemsetAsync(s, d1.data(), 0x11, cap).ok());
        ASSERT_TRUE(device_->MemsetAsync(s, d2.data(), 0x22, cap).ok());
        std::memset(out, 0x33, cap);
        ASSERT_TRUE(
            device_
                ->CopyAsync(s, d1.at(off), in + off, n, CopyKind::kHostToDevice)
                .ok());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, d2.at(off + 11), d1.at(off), n,
                                    CopyKind::kDeviceToDevice)
                        .ok());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, out + 5, d2.at(off + 11 - 5), n + 10,
                                    CopyKind::kDeviceToHost)
                        .ok());
        ASSERT_TRUE(device_->SynchronizeStream(s).ok());
        // 5 guard bytes of d2's fill either side, the payload in between.
        for (size_t i = 0; i < 5; ++i) {
          ASSERT_EQ(out[i + 5], std::byte{0x22});
          ASSERT_EQ(out[n + 10 + i], std::byte{0x22});
        }
        ASSERT_EQ(std::memcmp(out + 10, in + off, n), 0);
        ASSERT_EQ(out[4], std::byte{0x33}) << "host bytes before the copy";
        ASSERT_EQ(out[n + 15], std::byte{0x33}) << "host bytes after it";
      }
    }
  }
}

TEST_P(DeviceConformanceTest, PageableDeviceToHostIsDoneOnReturn) {
  Stream& s = NewStream(StreamKind::kCopy);
  const size_t n = 1 << 20;
  DeviceMemory d = Alloc(n, s);
  std::vector<std::byte> out(n, std::byte{0});
  ASSERT_TRUE(device_->MemsetAsync(s, d.data(), 0x5a, n).ok());
  ASSERT_TRUE(
      device_->CopyAsync(s, out.data(), d.data(), n, CopyKind::kDeviceToHost)
          .ok());
  // No synchronization: CUDA's contract for pageable destinations.
  EXPECT_EQ(out[0], std::byte{0x5a});
  EXPECT_EQ(out[n - 1], std::byte{0x5a});
}

TEST_P(DeviceConformanceTest, PinnedHostMemoryIsExactAndRegistered) {
  for (size_t n : {size_t{1}, size_t{4097}, size_t{3} << 20}) {
    HostBuffer b = Pinned(n);
    EXPECT_EQ(b.size(), n);
    EXPECT_NE(b.registration(), nullptr);
  }
  auto plain = HostBuffer::Allocate(8192);
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE(device_->RegisterHostBuffer(*plain).ok());
  EXPECT_NE(plain->registration(), nullptr);
  ASSERT_TRUE(device_->RegisterHostBuffer(*plain).ok()) << "re-registering";
}

TEST_P(DeviceConformanceTest, RejectsForeignPointersAndHandles) {
  Stream& s = NewStream();
  DeviceMemory d = Alloc(4096, s);
  std::vector<std::byte> host(8192);
  EXPECT_EQ(device_
                ->CopyAsync(s, host.data(), host.data() + 4096, 16,
                            CopyKind::kHostToDevice)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      device_->CopyAsync(s, d.data(), d.data(), 16, CopyKind::kHostToDevice)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->MemsetAsync(s, d.at(0) + (64 << 20), 0, 1).code(),
            StatusCode::kInvalidArgument);
  auto other = NewHostEmulatedDevice({});
  ASSERT_TRUE(other.ok());
  auto foreign = (*other)->NewStream({});
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ(device_->MemsetAsync(**foreign, d.data(), 0, 16).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->Allocate(16, **foreign).status().code(),
            StatusCode::kInvalidArgument);
}

// Operands a CUDA kernel or cuBLAS would fault on (misaligned elements,
// overlapping ranges, sizes that wrap) are refused before anything is
// enqueued, by every backend alike: on a GPU such a fault is sticky and ends
// the context.
TEST_P(DeviceConformanceTest, RejectsMisalignedOverlappingAndOversizedWork) {
  Stream& s = NewStream();
  DeviceMemory d = Alloc(1 << 20, s);
  ConvertArgs c;
  c.src = d.at(1);  // fp32 at an odd address
  c.src_type = ElementType::kFloat32;
  c.dst = d.at(4096);
  c.dst_type = ElementType::kFloat16;
  c.count = 16;
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), StatusCode::kInvalidArgument);
  c.src = d.at(0);
  c.dst = d.at(4097);  // fp16 at an odd address
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), StatusCode::kInvalidArgument);
  c.dst = d.at(32);  // overlaps the source's 64 bytes
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), StatusCode::kInvalidArgument);
  c.dst = d.at(0);  // in place, but fp32 -> fp16 changes the element size
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), StatusCode::kInvalidArgument);
  c.dst_type = ElementType::kFloat32;  // in place, fp32 -> fp32 (a scale)
  c.scale = 2;
  EXPECT_TRUE(device_->ConvertAsync(s, c).ok());
  c.count = size_t{1} << 62;  // the byte size wraps to 0
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(
      device_->CopyAsync(s, d.at(100), d.at(0), 200, CopyKind::kDeviceToDevice)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      device_->CopyAsync(s, d.at(200), d.at(0), 200, CopyKind::kDeviceToDevice)
          .ok());

  GemmArgs g;
  g.m = g.n = g.k = 4;
  g.lda = g.ldb = g.ldc = 4;
  g.a = d.at(0);
  g.b = d.at(1024);
  g.c = d.at(2050);  // fp32 C at a 2-byte boundary
  EXPECT_EQ(device_->GemmAsync(s, g).code(), StatusCode::kInvalidArgument);
  g.c = d.at(2048);
  g.a = d.at(2);
  EXPECT_EQ(device_->GemmAsync(s, g).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
}

// Note [Stream-ordered reuse] in gpu/stream_ordered_pool.h.
TEST_P(DeviceConformanceTest, FreedBlockIsReusedOnlyAfterItsStreamsFinish) {
  Init(1 << 20);
  if (IsSkipped()) return;
  Stream& alloc_stream = NewStream();
  Stream& user = NewStream();
  Stream& other = NewStream();
  const size_t n = 1 << 20;  // the whole budget: reuse must be this block
  HostBuffer in = Pinned(n), out = Pinned(n);
  Fill(in.data(), n, 9);
  Gate gate;
  {
    DeviceMemory m = Alloc(n, alloc_stream);
    m.RecordUse(user);
    ASSERT_TRUE(gate.Close(*device_, user).ok());
    ASSERT_TRUE(
        device_
            ->CopyAsync(user, m.data(), in.data(), n, CopyKind::kHostToDevice)
            .ok());
  }  // freed while `user` still has a queued write into it
  DeviceMemoryStats st = device_->memory_stats();
  EXPECT_EQ(st.pending_free_bytes, n);
  EXPECT_EQ(st.in_use_bytes, 0u);

  auto next = std::async(std::launch::async,
                         [&] { return device_->Allocate(n, other); });
  // While the gate is closed the allocation cannot be satisfied.
  EXPECT_EQ(next.wait_for(std::chrono::milliseconds(20)),
            std::future_status::timeout);
  gate.Open();
  StatusOr<DeviceMemory> m2 = next.get();
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_GE(device_->memory_stats().reuse_waits, 1u);
  // The earlier owner's write is complete before the new owner gets it.
  ASSERT_TRUE(
      device_
          ->CopyAsync(other, out.data(), m2->data(), n, CopyKind::kDeviceToHost)
          .ok());
  ASSERT_TRUE(device_->SynchronizeStream(other).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0);
  m2->Reset();

  // Idle streams: the block comes back without a wait.
  ASSERT_TRUE(device_->SynchronizeStream(other).ok());
  const uint64_t waits = device_->memory_stats().reuse_waits;
  DeviceMemory m3 = Alloc(n, alloc_stream);
  EXPECT_EQ(m3.size(), n);
  EXPECT_EQ(device_->memory_stats().reuse_waits, waits);
}

TEST_P(DeviceConformanceTest, ConversionsMatchCpuReferenceBitForBit) {
  using strata::testing::Decode16;
  using strata::testing::FormatOf;
  using strata::testing::Round16;
  Stream& s = NewStream();
  // Every 16-bit pattern and tricky fp32 values, an odd count.
  std::vector<float> f32;
  for (uint32_t p = 0; p <= 0xffff; ++p) {
    f32.push_back(std::bit_cast<float>(p << 16));
    f32.push_back(static_cast<float>(
        Decode16(static_cast<uint16_t>(p), strata::testing::kHalf)));
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 20001; ++i)
    f32.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  const size_t n = f32.size();
  std::vector<uint16_t> all16(0x10000 + 3);
  for (uint32_t p = 0; p < all16.size(); ++p) all16[p] = p & 0xffff;

  DeviceMemory df = Alloc(n * 4, s), dh = Alloc(n * 2, s),
               dback = Alloc(all16.size() * 4, s);
  HostBuffer hf = Pinned(n * 4), hh = Pinned(n * 2),
             hback = Pinned(all16.size() * 4);
  std::memcpy(hf.data(), f32.data(), n * 4);
  for (ElementType t : {ElementType::kFloat16, ElementType::kBFloat16}) {
    for (float scale : {1.0f, 1024.0f, 1.0f / 3}) {
      SCOPED_TRACE(std::string(ElementTypeName(t)) + " scale " +
                   std::to_string(scale));
      ASSERT_TRUE(device_
                      ->CopyAsync(s, df.data(), hf.data(), n * 4,
                                  CopyKind::kHostToDevice)
                      .ok());
      ASSERT_TRUE(device_
                      ->ConvertAsync(s, {df.data(), ElementType::kFloat32,
                                         dh.data(), t, n, scale})
                      .ok());
      ASSERT_TRUE(device_
                      ->CopyAsync(s, hh.data(), dh.data(), n * 2,
                                  CopyKind::kDeviceToHost)
                      .ok());
      ASSERT_TRUE(device_->SynchronizeStream(s).ok());
      const auto* got = reinterpret_cast<const uint16_t*>(hh.data());
      for (size_t i = 0; i < n; ++i) {
        const float x = f32[i] * scale;  // fp32 product, as the contract says
        const uint16_t want = Round16(x, FormatOf(t));
        if (std::isnan(x)) {
          ASSERT_TRUE(std::isnan(Decode16(got[i], FormatOf(t)))) << i;
        } else {
          ASSERT_EQ(got[i], want) << "x=" << x << " i=" << i;
        }
      }
      // Back: every pattern to fp32, scaled.
      std::memcpy(hh.data(), all16.data(), all16.size() * 2);
      ASSERT_TRUE(device_
                      ->CopyAsync(s, dh.data(), hh.data(), all16.size() * 2,
                                  CopyKind::kHostToDevice)
                      .ok());
      ASSERT_TRUE(device_
                      ->ConvertAsync(
                          s, {dh.data(), t, dback.data(), ElementType::kFloat32,
                              all16.size(), 1.0f / scale})
                      .ok());
      ASSERT_TRUE(device_
                      ->CopyAsync(s, hback.data(), dback.data(),
                                  all16.size() * 4, CopyKind::kDeviceToHost)
                      .ok());
      ASSERT_TRUE(device_->SynchronizeStream(s).ok());
      const auto* back = reinterpret_cast<const float*>(hback.data());
      for (size_t i = 0; i < all16.size(); ++i) {
        const float want = static_cast<float>(Decode16(all16[i], FormatOf(t))) *
                           (1.0f / scale);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(back[i])) << i;
        } else {
          ASSERT_EQ(std::bit_cast<uint32_t>(back[i]),
                    std::bit_cast<uint32_t>(want))
              << "pattern " << all16[i];
        }
      }
    }
  }
}

// C = alpha op(A) op(B) + beta C against a double-precision loop.
TEST_P(DeviceConformanceTest, GemmMatchesReference) {
  Stream& s = NewStream();
  const int64_t m = 37, n = 19, k = 23;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (ElementType t :
       {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16}) {
    for (GemmOp op_a : {GemmOp::kNoTranspose, GemmOp::kTranspose}) {
      for (GemmOp op_b : {GemmOp::kNoTranspose, GemmOp::kTranspose}) {
        SCOPED_TRACE(std::string(ElementTypeName(t)) + " opA " +
                     std::to_string(int(op_a)) + " opB " +
                     std::to_string(int(op_b)));
        const int64_t ar = op_a == GemmOp::kNoTranspose ? m : k;
        const int64_t ac = op_a == GemmOp::kNoTranspose ? k : m;
        const int64_t br = op_b == GemmOp::kNoTranspose ? k : n;
        const int64_t bc = op_b == GemmOp::kNoTranspose ? n : k;
        const int64_t lda = ar + 3, ldb = br + 1, ldc = m + 2;
        const size_t es = ElementSize(t);
        // Values exactly representable in every type, so inputs agree.
        std::vector<float> a(lda * ac), b(ldb * bc), c(ldc * n);
        for (auto& v : a) v = std::round(u(rng) * 64) / 64;
        for (auto& v : b) v = std::round(u(rng) * 64) / 64;
        for (auto& v : c) v = std::round(u(rng) * 64) / 64;
        auto pack = [&](const std::vector<float>& v, ElementType ty) {
          std::vector<std::byte> out(v.size() * ElementSize(ty));
          for (size_t i = 0; i < v.size(); ++i) {
            if (ty == ElementType::kFloat32) {
              std::memcpy(&out[i * 4], &v[i], 4);
            } else {
              const auto f = ty == ElementType::kFloat16
                                 ? strata::testing::kHalf
                                 : strata::testing::kBf16;
              const uint16_t h = Round16(v[i], f);
              std::memcpy(&out[i * 2], &h, 2);
            }
          }
          return out;
        };
        const auto pa = pack(a, t), pb = pack(b, t);
        const auto pc = pack(c, ElementType::kFloat32);
        DeviceMemory da = Alloc(pa.size(), s), db = Alloc(pb.size(), s),
                     dc = Alloc(pc.size(), s);
        HostBuffer h = Pinned(pa.size() + pb.size() + pc.size());
        std::memcpy(h.data(), pa.data(), pa.size());
        std::memcpy(h.data() + pa.size(), pb.data(), pb.size());
        std::memcpy(h.data() + pa.size() + pb.size(), pc.data(), pc.size());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, da.data(), h.data(), pa.size(),
                                    CopyKind::kHostToDevice)
                        .ok());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, db.data(), h.data() + pa.size(),
                                    pb.size(), CopyKind::kHostToDevice)
                        .ok());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, dc.data(),
                                    h.data() + pa.size() + pb.size(), pc.size(),
                                    CopyKind::kHostToDevice)
                        .ok());
        GemmArgs g;
        g.op_a = op_a;
        g.op_b = op_b;
        g.m = m;
        g.n = n;
        g.k = k;
        g.alpha = 0.5f;
        g.beta = -2.0f;
        g.ab_type = t;
        g.c_type = ElementType::kFloat32;
        g.a = da.data();
        g.lda = lda;
        g.b = db.data();
        g.ldb = ldb;
        g.c = dc.data();
        g.ldc = ldc;
        Status st = device_->GemmAsync(s, g);
        if (st.code() == StatusCode::kUnavailable && !CudaRequired()) {
          // The copies from `h` must finish before it is unmapped.
          ASSERT_TRUE(device_->SynchronizeStream(s).ok());
          GTEST_SKIP() << "GEMM unavailable: " << st.ToString();
        }
        ASSERT_TRUE(st.ok()) << st.ToString();
        std::vector<float> got(c.size());
        ASSERT_TRUE(device_
                        ->CopyAsync(s, got.data(), dc.data(), pc.size(),
                                    CopyKind::kDeviceToHost)
                        .ok());
        ASSERT_TRUE(device_->SynchronizeStream(s).ok());
        (void)es;
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t i = 0; i < m; ++i) {
            double acc = 0, mag = 0;
            for (int64_t p = 0; p < k; ++p) {
              const double av = op_a == GemmOp::kNoTranspose ? a[i + p * lda]
                                                             : a[p + i * lda];
              const double bv = op_b == GemmOp::kNoTranspose ? b[p + j * ldb]
                                                             : b[j + p * ldb];
              acc += av * bv;
              mag += std::fabs(av * bv);
            }
            const double want = 0.5 * acc - 2.0 * c[i + j * ldc];
            // fp32 accumulation of exactly representable products.
            ASSERT_NEAR(got[i + j * ldc], want, 1e-5 + 1e-6 * mag)
                << i << "," << j;
          }
        }
        // Padding rows of C are untouched.
        EXPECT_EQ(got[m], c[m]);
      }
    }
  }
}

// ---- Native streams and events ----------------------------------------------

TEST_P(DeviceConformanceTest, WrappedNativeStreamSharesTheQueueNotItsLife) {
  Stream& s = NewStream();
  EXPECT_TRUE(s.owns_native_stream());
  EXPECT_EQ(s.device_kind(), device_->kind());
  auto w = device_->WrapNativeStream(s.native_handle(), StreamKind::kCopy);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_FALSE((*w)->owns_native_stream());
  EXPECT_EQ((*w)->native_handle(), s.native_handle());
  EXPECT_EQ((*w)->kind(), StreamKind::kCopy);

  const size_t n = 1 << 20;
  DeviceMemory m = Alloc(n, s);
  m.RecordUse(**w);
  HostBuffer in = Pinned(n), out = Pinned(n);
  Fill(in.data(), n, 4);
  Gate gate;
  ASSERT_TRUE(gate.Close(*device_, s).ok());
  // Enqueued through the wrapper after the owner's gate: one queue, one
  // order.
  ASSERT_TRUE(
      device_->CopyAsync(**w, m.data(), in.data(), n, CopyKind::kHostToDevice)
          .ok());
  auto copied = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*copied, **w).ok());
  EXPECT_FALSE(Done(*copied)) << "work on the wrapper overtook the owner's";
  ASSERT_TRUE(
      device_->LaunchHostFunc(**w, [] {}).ok());  // more queued behind it

  // Destroying the wrapper neither waits for the gated queue nor ends it.
  m.Reset();  // records its free on both streams first
  auto destroyed = std::async(std::launch::async, [&w] { w->reset(); });
  const bool returned_gated =
      destroyed.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  gate.Open();
  destroyed.get();
  EXPECT_TRUE(returned_gated) << "destroying a wrapper waited for its queue";
  ASSERT_TRUE(device_->SynchronizeEvent(*copied).ok());

  DeviceMemory m2 = Alloc(n, s);
  ASSERT_TRUE(
      device_->CopyAsync(s, m2.data(), in.data(), n, CopyKind::kHostToDevice)
          .ok());
  ASSERT_TRUE(
      device_->CopyAsync(s, out.data(), m2.data(), n, CopyKind::kDeviceToHost)
          .ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0)
      << "the native stream stopped working with its wrapper";
}

TEST_P(DeviceConformanceTest, EventsHaveDistinctNativeHandles) {
  auto a = NewEvent();
  auto b = NewEvent();
  EXPECT_NE(a->native_handle(), nullptr);
  EXPECT_NE(a->native_handle(), b->native_handle());
  EXPECT_EQ(a->device_kind(), device_->kind());
}

// ---- External device memory
// ---------------------------------------------------

TEST_P(DeviceConformanceTest, ExternalMemoryIsDeviceMemoryWhileRegistered) {
  // Device memory this device did not allocate: another device's, of the
  // same backend (another cudaMalloc on CUDA).
  auto other = MakeDevice(GetParam(), 1 << 20);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto other_stream = (*other)->NewStream({});
  ASSERT_TRUE(other_stream.ok());
  const size_t n = 64 << 10;
  auto foreign = (*other)->Allocate(n, **other_stream);
  ASSERT_TRUE(foreign.ok());

  Stream& s = NewStream();
  DeviceMemory d = Alloc(n, s);
  HostBuffer in = Pinned(n), out = Pinned(n);
  Fill(in.data(), n, 12);
  const auto kInvalid = StatusCode::kInvalidArgument;
  EXPECT_EQ(
      device_
          ->CopyAsync(s, foreign->data(), in.data(), n, CopyKind::kHostToDevice)
          .code(),
      kInvalid)
      << "unregistered memory is not this device's";

  auto ext = device_->RegisterExternalMemory(foreign->data(), n);
  ASSERT_TRUE(ext.ok()) << ext.status().ToString();
  EXPECT_EQ(ext->size(), n);
  EXPECT_EQ(device_->memory_stats().external_ranges, 1u);
  // Overlaps, the pool, null, empty and wrapping ranges are refused.
  EXPECT_EQ(
      device_->RegisterExternalMemory(foreign->at(16), 16).status().code(),
      kInvalid);
  EXPECT_EQ(device_->RegisterExternalMemory(d.data(), 16).status().code(),
            kInvalid);
  EXPECT_EQ(device_->RegisterExternalMemory(nullptr, 16).status().code(),
            kInvalid);
  EXPECT_EQ(device_->RegisterExternalMemory(foreign->data(), 0).status().code(),
            kInvalid);
  EXPECT_EQ(
      device_->RegisterExternalMemory(foreign->at(n), SIZE_MAX).status().code(),
      kInvalid);

  // Copies, memsets and conversions take it as device memory.
  ASSERT_TRUE(
      device_->CopyAsync(s, ext->data(), in.data(), n, CopyKind::kHostToDevice)
          .ok());
  ASSERT_TRUE(
      device_->CopyAsync(s, d.data(), ext->data(), n, CopyKind::kDeviceToDevice)
          .ok());
  ASSERT_TRUE(device_->MemsetAsync(s, ext->at(100), 0x7c, 50).ok());
  ASSERT_TRUE(
      device_->CopyAsync(s, out.data(), ext->data(), n, CopyKind::kDeviceToHost)
          .ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  std::vector<std::byte> want(in.data(), in.data() + n);
  std::memset(want.data() + 100, 0x7c, 50);
  EXPECT_EQ(std::memcmp(out.data(), want.data(), n), 0);
  ASSERT_TRUE(
      device_->CopyAsync(s, out.data(), d.data(), n, CopyKind::kDeviceToHost)
          .ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0);

  ConvertArgs c{ext->data(), ElementType::kFloat32,
                d.data(),    ElementType::kFloat16,
                n / 4,       1.0f};
  EXPECT_TRUE(device_->ConvertAsync(s, c).ok());
  // The checks that protect a context hold inside it too: straddling its
  // end, a host end inside it, misaligned elements, overlap.
  EXPECT_EQ(
      device_
          ->CopyAsync(s, ext->at(n - 8), in.data(), 16, CopyKind::kHostToDevice)
          .code(),
      kInvalid);
  EXPECT_EQ(
      device_->CopyAsync(s, d.data(), ext->data(), 16, CopyKind::kHostToDevice)
          .code(),
      kInvalid);
  c.src = ext->at(2);
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), kInvalid);
  c.src = ext->data();
  c.dst = ext->at(64);
  c.count = 64;
  EXPECT_EQ(device_->ConvertAsync(s, c).code(), kInvalid);
  EXPECT_EQ(device_
                ->CopyAsync(s, ext->at(10), ext->data(), 64,
                            CopyKind::kDeviceToDevice)
                .code(),
            kInvalid);
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());

  // Moved, then unregistered: refused again.
  ExternalDeviceMemory moved = std::move(*ext);
  EXPECT_TRUE(ext->empty());
  EXPECT_EQ(moved.data(), foreign->data());
  moved.Reset();
  EXPECT_EQ(device_->memory_stats().external_ranges, 0u);
  EXPECT_EQ(device_->MemsetAsync(s, foreign->data(), 0, 16).code(), kInvalid);
}

// ---- Host events
// --------------------------------------------------------------

TEST_P(DeviceConformanceTest, HostEventHoldsAStreamUntilHostWorkIsDone) {
  std::unique_ptr<HostEvent> he = NewHostEvent();
  if (IsSkipped() || he == nullptr) return;
  Stream& s = NewStream(StreamKind::kCopy);
  Stream& other = NewStream();
  const size_t n = 1 << 20;
  DeviceMemory d = Alloc(n, s);
  HostBuffer in = Pinned(n), out = Pinned(n);
  std::memset(in.data(), 0, n);
  EXPECT_EQ(he->generation(), 0u);
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 1).ok());
  CopyThrough(s, d, in.data(), out.data(), n);
  auto done = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*done, s).ok());
  EXPECT_FALSE(Done(*done));
  // Other streams go on meanwhile.
  EXPECT_TRUE(OtherStreamGoesOn(other));
  EXPECT_FALSE(Done(*done));
  // Long host work (an optimizer step) on another thread, then the signal.
  std::thread worker([&] {
    Fill(in.data(), n, 21);
    he->Signal(1);
  });
  ASSERT_TRUE(device_->SynchronizeEvent(*done).ok());
  worker.join();
  EXPECT_EQ(he->generation(), 1u);
  EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0)
      << "the copy did not wait for the host's writes";
}

TEST_P(DeviceConformanceTest, HostEventGenerationsServeEveryStep) {
  std::unique_ptr<HostEvent> he = NewHostEvent();
  if (IsSkipped() || he == nullptr) return;
  Stream& s = NewStream();
  auto e = NewEvent();
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 2).ok());
  ASSERT_TRUE(device_->RecordEvent(*e, s).ok());
  he->Signal(1);
  EXPECT_EQ(he->generation(), 1u);
  EXPECT_FALSE(Done(*e)) << "generation 1 released a wait for 2";
  he->Signal(2);
  ASSERT_TRUE(device_->SynchronizeEvent(*e).ok());
  he->Signal(1);
  EXPECT_EQ(he->generation(), 2u) << "a signal never lowers the generation";
  // Reached generations enqueue nothing.
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 1).ok());
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 2).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  // One event, reused step after step.
  int steps = 0;  // written by the stream only, read after sync
  for (uint64_t step = 3; step < 8; ++step) {
    ASSERT_TRUE(device_->WaitHostEvent(s, *he, step).ok());
    ASSERT_TRUE(device_->LaunchHostFunc(s, [&steps] { ++steps; }).ok());
    std::thread([&he, step] { he->Signal(step); }).join();
    ASSERT_TRUE(device_->SynchronizeStream(s).ok());
    EXPECT_EQ(steps, static_cast<int>(step - 2));
  }
  EXPECT_EQ(device_->WaitHostEvent(s, *he, 7 + (uint64_t{1} << 31)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(device_->WaitHostEvent(s, *he, 6 + (uint64_t{1} << 31)).ok());
  he->Signal(6 + (uint64_t{1} << 31));
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
}

TEST_P(DeviceConformanceTest, HostEventSignalledFromAHostFunction) {
  std::unique_ptr<HostEvent> he = NewHostEvent();
  if (IsSkipped() || he == nullptr) return;
  Stream& a = NewStream();
  Stream& b = NewStream();
  Gate gate;
  ASSERT_TRUE(gate.Close(*device_, a).ok());
  HostEvent* raw = he.get();
  ASSERT_TRUE(device_->LaunchHostFunc(a, [raw] { raw->Signal(1); }).ok());
  ASSERT_TRUE(device_->WaitHostEvent(b, *he, 1).ok());
  auto e = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*e, b).ok());
  EXPECT_FALSE(Done(*e));
  gate.Open();
  ASSERT_TRUE(device_->SynchronizeEvent(*e).ok());
  ASSERT_TRUE(device_->SynchronizeStream(a).ok());
}

TEST_P(DeviceConformanceTest, AbandonOrDestructionReleasesWaitingStreams) {
  std::unique_ptr<HostEvent> he = NewHostEvent();
  if (IsSkipped() || he == nullptr) return;
  Stream& s = NewStream();
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 1).ok());
  he->Abandon();
  EXPECT_TRUE(he->abandoned());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  ASSERT_TRUE(device_->WaitHostEvent(s, *he, 5).ok());  // enqueues nothing
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());

  std::unique_ptr<HostEvent> dropped = NewHostEvent();
  ASSERT_NE(dropped, nullptr);
  ASSERT_TRUE(device_->WaitHostEvent(s, *dropped, 3).ok());
  dropped.reset();  // breaks the REQUIRES; must not hang or crash
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());

  // A new event (on CUDA, on the dropped event's word) waits as it should.
  std::unique_ptr<HostEvent> fresh = NewHostEvent();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->generation(), 0u);
  EXPECT_FALSE(fresh->abandoned());
  ASSERT_TRUE(device_->WaitHostEvent(s, *fresh, 1).ok());
  auto e = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*e, s).ok());
  EXPECT_FALSE(Done(*e));
  fresh->Signal(1);
  ASSERT_TRUE(device_->SynchronizeEvent(*e).ok());
}

TEST_P(DeviceConformanceTest, HostFunctionsMayBeMoveOnly) {
  Stream& s = NewStream();
  std::promise<int> promise;
  std::future<int> result = promise.get_future();
  auto value = std::make_unique<int>(42);
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(s,
                                   [promise = std::move(promise),
                                    value = std::move(value)]() mutable {
                                     promise.set_value(*value);
                                   })
                  .ok());
  EXPECT_EQ(result.get(), 42);
  EXPECT_EQ(device_->LaunchHostFunc(s, std::function<void()>()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->LaunchHostFunc(s, HostFunction()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
}

// ---- Stream-ordered host work
// -----------------------------------------------------

// True, after GTEST_SKIP, when the backend has no host work (CUDA without
// host events) and no GPU is required.
bool SkipWithoutHostWork(const Status& st) {
  if (st.code() != StatusCode::kNotSupported || CudaRequired()) return false;
  [&] { GTEST_SKIP() << st.ToString(); }();
  return true;
}

// Host work between copies: it sees what the copies before it wrote, the
// copies after it see what it wrote, it may run long (here: until the test
// lets it finish) while other streams go on.
TEST_P(DeviceConformanceTest, HostWorkRunsInStreamOrder) {
  Stream& s = NewStream();
  Stream& other = NewStream();
  const size_t n = 1 << 16;
  DeviceMemory d = Alloc(n, s);
  HostBuffer in = Pinned(n), mid = Pinned(n), out = Pinned(n);
  Fill(in.data(), n, 11);
  std::memset(mid.data(), 0, n);
  CopyThrough(s, d, in.data(), mid.data(), n);
  std::byte* m = mid.data();
  const Status st = device_->LaunchHostWork(s, [m, n] {
    for (size_t i = 0; i < n; ++i) m[i] = ~m[i];
  });
  if (SkipWithoutHostWork(st)) {
    ASSERT_TRUE(device_->SynchronizeStream(s).ok());
    return;
  }
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::promise<void> release;
  std::shared_future<void> hold = release.get_future().share();
  ASSERT_TRUE(device_->LaunchHostWork(s, [hold] { hold.wait(); }).ok());
  CopyThrough(s, d, mid.data(), out.data(), n);
  auto done = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(*done, s).ok());
  EXPECT_TRUE(OtherStreamGoesOn(other)) << "another stream waited for it";
  EXPECT_FALSE(Done(*done)) << "work after host work did not wait for it";
  release.set_value();
  ASSERT_TRUE(device_->SynchronizeEvent(*done).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out.data()[i], ~in.data()[i]) << "byte " << i;
  }
}

TEST_P(DeviceConformanceTest, HostWorkKeepsOrderAndSurvivesThrows) {
  Stream& s = NewStream();
  std::vector<int> order;  // written by the host work only, read after sync
  std::promise<int> promise;
  std::future<int> result = promise.get_future();
  Status st =
      device_->LaunchHostWork(s, [promise = std::move(promise),
                                  value = std::make_unique<int>(42)]() mutable {
        promise.set_value(*value);
      });
  if (SkipWithoutHostWork(st)) return;
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (int i = 0; i < 20; ++i) {
    if (i == 10) {
      ASSERT_TRUE(
          device_->LaunchHostWork(s, [] { throw std::runtime_error("boom"); })
              .ok());
    }
    ASSERT_TRUE(
        device_->LaunchHostWork(s, [&order, i] { order.push_back(i); }).ok());
  }
  EXPECT_EQ(device_->LaunchHostWork(s, HostFunction()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  EXPECT_EQ(result.get(), 42);
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
}

// ---- TryAllocate
// ----------------------------------------------------------------

TEST_P(DeviceConformanceTest, TryAllocateAnswersAtOnce) {
  Init(1 << 20);
  if (IsSkipped()) return;
  Stream& s = NewStream();
  Stream& user = NewStream();
  Gate gate;
  {
    DeviceMemory m = Alloc(1 << 20, s);
    m.RecordUse(user);
    ASSERT_TRUE(gate.Close(*device_, user).ok());
  }  // pending until `user` passes the gate
  auto busy = device_->TryAllocate(512 << 10, s);
  ASSERT_FALSE(busy.ok());
  EXPECT_EQ(busy.status().code(), StatusCode::kBusy);
  EXPECT_NE(busy.status().message().find("pending frees"), std::string::npos)
      << busy.status().ToString();
  EXPECT_EQ(device_->TryAllocate(2 << 20, s).status().code(),
            StatusCode::kOutOfMemory)
      << "not even pending frees could make room";
  DeviceMemoryStats st = device_->memory_stats();
  EXPECT_EQ(st.busy_allocations, 1u);
  EXPECT_EQ(st.failed_allocations, 1u);
  EXPECT_EQ(st.reuse_waits, 0u);
  gate.Open();
  // The free's events on both streams have completed after these.
  ASSERT_TRUE(device_->SynchronizeStream(user).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  auto m2 = device_->TryAllocate(1 << 20, s);
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_EQ(device_->memory_stats().allocations, 2u);
  auto empty = device_->TryAllocate(0, s);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

#ifdef STRATA_TEST_CUDA_BACKEND
INSTANTIATE_TEST_SUITE_P(Cuda, DeviceConformanceTest,
                         ::testing::Values("cuda"));
#else
std::string HostParamName(const ::testing::TestParamInfo<std::string>& p) {
  std::string s = p.param;
  for (auto& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
}
INSTANTIATE_TEST_SUITE_P(Host, DeviceConformanceTest,
                         ::testing::Values("host", "host-throttled",
                                           "host-wrapped",
                                           "host-composed-work"),
                         HostParamName);
#endif

}  // namespace
}  // namespace strata
