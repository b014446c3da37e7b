// Conformance suite: the same contract checked against every backend present
// on this machine (io_uring, libaio, the thread pool, memory), with O_DIRECT
// on and off.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "strata/io_engine.h"
#include "swap/backend.h"
#include "tests/swap/test_util.h"

namespace strata {
namespace {

using testing::FirstMismatch;
using testing::MustAllocate;
using testing::ScratchDir;
using testing::Stamp;

struct Param {
  IoBackend backend;
  bool direct;
};

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return std::string(IoBackendName(info.param.backend)) +
         (info.param.direct ? "_direct" : "_buffered");
}

// One request per `block` bytes of `buf`, at the same offset in `file`,
// tagged with its index.
std::vector<IoRequest> BlockRequests(FileId file, std::span<std::byte> buf,
                                     size_t block, IoOp op) {
  std::vector<IoRequest> reqs;
  for (size_t i = 0; i * block < buf.size(); ++i) {
    reqs.push_back({file, i * block, buf.subspan(i * block, block), op, i});
  }
  return reqs;
}

class IoEngineTest : public ::testing::TestWithParam<Param> {
 protected:
  static IoEngineOptions Options() {
    IoEngineOptions o;
    o.backend = GetParam().backend;
    o.direct_io = GetParam().direct;
    o.queue_depth = 8;
    return o;
  }

  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const IoEngineOptions o = Options();
    auto e = NewIoEngine(o);
    if (!e.ok() && e.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << IoBackendName(o.backend)
                   << " unavailable here: " << e.status().ToString();
    }
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(e).value();
    auto f = engine_->Open(dir_.File("data"), {.create = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = *f;
    align_ = std::max<size_t>(engine_->alignment(file_), 1);
  }

  ScratchDir dir_;
  std::unique_ptr<IoEngine> engine_;
  FileId file_ = 0;
  size_t align_ = 1;
};

TEST_P(IoEngineTest, RoundTripsOffsetStampedData) {
  constexpr size_t kBlock = 64 << 10;
  constexpr size_t kBlocks = 32;
  HostBuffer w = MustAllocate(kBlock * kBlocks);
  HostBuffer r = MustAllocate(kBlock * kBlocks);
  Stamp(w.span(), 0, 0x1234);
  std::vector<IoRequest> reqs =
      BlockRequests(file_, w.span(), kBlock, IoOp::kWrite);
  ASSERT_TRUE(engine_->Submit(reqs).ok());
  std::vector<IoCompletion> done(kBlocks);
  size_t got = 0;
  std::vector<bool> seen(kBlocks);
  while (got < kBlocks) {
    auto n = engine_->Reap(std::span(done).subspan(got), 1);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    for (size_t i = got; i < got + *n; ++i) {
      ASSERT_TRUE(done[i].status.ok()) << done[i].status.ToString();
      EXPECT_EQ(done[i].bytes, kBlock);
      seen[done[i].tag] = true;
    }
    got += *n;
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), kBlocks);
  EXPECT_EQ(engine_->in_flight(), 0u);
  ASSERT_TRUE(engine_->Sync(file_).ok());
  // Read back in reverse order to catch offset mix-ups.
  for (size_t i = kBlocks; i-- > 0;) {
    ASSERT_TRUE(
        engine_->ReadAt(file_, i * kBlock, r.span().subspan(i * kBlock, kBlock))
            .ok());
  }
  EXPECT_EQ(FirstMismatch(r.span(), 0, 0x1234), -1);
  auto size = engine_->FileSize(file_);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, kBlock * kBlocks);
}

TEST_P(IoEngineTest, AwkwardSizesAndTails) {
  // Buffered files take any size; direct ones any multiple of the alignment.
  std::vector<size_t> sizes;
  if (align_ == 1) {
    sizes = {1, 7, 511, 4095, 4097, (1 << 20) + 3};
  } else {
    sizes = {align_, 3 * align_, (1 << 20) + align_, (2 << 20) - align_};
  }
  uint64_t offset = 0;
  for (size_t s : sizes) {
    HostBuffer w = MustAllocate(s);
    HostBuffer r = MustAllocate(s);
    Stamp(w.span(), offset, 77);
    ASSERT_TRUE(engine_->WriteAt(file_, offset, w.span()).ok()) << s;
    ASSERT_TRUE(engine_->ReadAt(file_, offset, r.span()).ok()) << s;
    EXPECT_EQ(FirstMismatch(r.span(), offset, 77), -1) << s;
    offset += (s + align_ - 1) / align_ * align_ + align_;
  }
}

TEST_P(IoEngineTest, ManyRequestsBeyondQueueDepth) {
  // 256 random-offset requests with a queue depth of 8: the engine queues the
  // rest and every one completes once.
  constexpr size_t kReq = 4096;
  constexpr size_t kCount = 256;
  HostBuffer w = MustAllocate(kReq * kCount);
  Stamp(w.span(), 0, 99);
  ASSERT_TRUE(engine_->WriteAt(file_, 0, w.span()).ok());
  HostBuffer r = MustAllocate(kReq * kCount);
  std::vector<size_t> order(kCount);
  for (size_t i = 0; i < kCount; ++i) order[i] = i;
  std::mt19937 rng(42);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<IoRequest> reqs;
  for (size_t i : order) {
    reqs.push_back(
        {file_, i * kReq, r.span().subspan(i * kReq, kReq), IoOp::kRead, i});
  }
  ASSERT_TRUE(engine_->Submit(reqs).ok());
  EXPECT_EQ(engine_->in_flight(), kCount);
  std::vector<IoCompletion> done(16);
  size_t total = 0;
  while (engine_->in_flight() > 0) {
    auto n = engine_->Reap(done, 4);
    ASSERT_TRUE(n.ok());
    for (size_t i = 0; i < *n; ++i) ASSERT_TRUE(done[i].status.ok());
    total += *n;
  }
  EXPECT_EQ(total, kCount);
  EXPECT_EQ(FirstMismatch(r.span(), 0, 99), -1);
}

TEST_P(IoEngineTest, ReapWithZeroPollsWithoutBlocking) {
  std::vector<IoCompletion> done(4);
  auto n = engine_->Reap(done, 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0u);
}

TEST_P(IoEngineTest, MisalignedDirectRequestRefusedBeforeSubmit) {
  if (align_ == 1) GTEST_SKIP() << "buffered file: no alignment rule";
  HostBuffer b = MustAllocate(4 * align_);
  const IoRequest bad[] = {
      {file_, 1, b.span().subspan(0, align_), IoOp::kWrite, 0},
      {file_, 0, b.span().subspan(1, align_), IoOp::kWrite, 0},
      {file_, 0, b.span().subspan(0, align_ + 1), IoOp::kWrite, 0}};
  for (const IoRequest& r : bad) {
    Status s = engine_->Submit({&r, 1});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.ToString().find("aligned"), std::string::npos);
    EXPECT_EQ(engine_->in_flight(), 0u);
  }
  // A batch with one bad request queues nothing.
  const IoRequest batch[] = {
      {file_, 0, b.span().subspan(0, align_), IoOp::kWrite, 0}, bad[0]};
  EXPECT_FALSE(engine_->Submit(batch).ok());
  EXPECT_EQ(engine_->in_flight(), 0u);
}

TEST_P(IoEngineTest, ReadPastEndOfFileIsCorruption) {
  HostBuffer b = MustAllocate(2 * std::max<size_t>(align_, 4096));
  Stamp(b.span(), 0, 5);
  const size_t half = b.size() / 2;
  ASSERT_TRUE(engine_->WriteAt(file_, 0, b.span().subspan(0, half)).ok());
  Status s = engine_->ReadAt(file_, 0, b.span());
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.ToString().find("end of file"), std::string::npos);
  EXPECT_NE(s.ToString().find(dir_.File("data")), std::string::npos);
}

TEST_P(IoEngineTest, UnknownFileAndClosedFileAreErrors) {
  HostBuffer b = MustAllocate(4096);
  EXPECT_EQ(engine_->ReadAt(file_ + 17, 0, b.span()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(engine_->Close(file_).ok());
  EXPECT_EQ(engine_->ReadAt(file_, 0, b.span()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Open(dir_.File("missing/x"), {}).status().code(),
            StatusCode::kNotFound);
}

TEST_P(IoEngineTest, ConcurrentSubmittersWithOwnEngines) {
  // The contract: one engine per submitting thread. Four threads write and
  // read back disjoint regions of one file.
  constexpr size_t kRegion = 256 << 10;
  std::vector<std::thread> threads;
  std::vector<Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      IoEngineOptions o;
      o.backend = engine_->backend();
      o.direct_io = GetParam().direct;
      o.queue_depth = 4;
      auto e = NewIoEngine(o);
      if (!e.ok()) {
        results[t] = e.status();
        return;
      }
      auto f = (*e)->Open(dir_.File("data"), {});
      if (!f.ok()) {
        results[t] = f.status();
        return;
      }
      auto w = HostBuffer::Allocate(kRegion);
      auto r = HostBuffer::Allocate(kRegion);
      const uint64_t off = t * kRegion;
      Stamp(w->span(), off, t);
      for (int rep = 0; rep < 4 && results[t].ok(); ++rep) {
        results[t] = (*e)->WriteAt(*f, off, w->span());
        if (results[t].ok()) results[t] = (*e)->ReadAt(*f, off, r->span());
        if (results[t].ok() && FirstMismatch(r->span(), off, t) != -1) {
          results[t] = Status::Corruption("mismatch");
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(IoEngineFactoryTest, ProbeChoosesAWorkingBackendAndSaysWhy) {
  auto e = NewIoEngine({});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const IoBackend b = (*e)->backend();
  EXPECT_TRUE(b == IoBackend::kUring || b == IoBackend::kAio ||
              b == IoBackend::kThreads);
  if (b != IoBackend::kUring) {
    EXPECT_NE((*e)->fallback_reason().find("io_uring"), std::string::npos);
  } else {
    EXPECT_TRUE((*e)->fallback_reason().empty());
  }
}

TEST(IoEngineFactoryTest, RejectsBadOptionsAndNames) {
  IoEngineOptions o;
  o.queue_depth = 0;
  EXPECT_EQ(NewIoEngine(o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseIoBackend("nvme").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseIoBackend("io_uring"), IoBackend::kUring);
  EXPECT_EQ(*ParseIoBackend("threads"), IoBackend::kThreads);
}

// docs/reliability.md row 17: an engine destroyed with requests queued beyond
// its queue depth, none reaped, drains them all before it returns (their
// buffers are the caller's, so nothing may touch them afterwards): every
// write is on disk, every read has landed, and a fresh engine reads back
// exactly what was written. Under TSan and ASan this also checks that no
// completion races the destructor or writes into freed memory.
TEST_P(IoEngineTest, DestroyedWithRequestsInFlightDrainsThem) {
  constexpr size_t kBlock = 16 << 10;
  constexpr size_t kBlocks = 64;  // eight times the queue depth
  HostBuffer w = MustAllocate(kBlock * kBlocks);
  Stamp(w.span(), 0, 0x77);
  std::vector<IoRequest> reqs =
      BlockRequests(file_, w.span(), kBlock, IoOp::kWrite);
  ASSERT_TRUE(engine_->Submit(reqs).ok());
  engine_.reset();

  auto e = NewIoEngine(Options());
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto f = (*e)->Open(dir_.File("data"), {});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  HostBuffer r = MustAllocate(kBlock * kBlocks);
  std::memset(r.data(), 0, r.size());
  ASSERT_TRUE(
      (*e)->Submit(BlockRequests(*f, r.span(), kBlock, IoOp::kRead)).ok());
  e->reset();  // the reads drain too
  EXPECT_EQ(FirstMismatch(r.span(), 0, 0x77), -1);
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest,
                         ::testing::Values(Param{IoBackend::kUring, true},
                                           Param{IoBackend::kUring, false},
                                           Param{IoBackend::kAio, true},
                                           Param{IoBackend::kThreads, true},
                                           Param{IoBackend::kThreads, false},
                                           Param{IoBackend::kMemory, true},
                                           Param{IoBackend::kMemory, false}),
                         ParamName);

}  // namespace
}  // namespace strata
