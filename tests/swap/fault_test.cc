// The fault matrix of docs/reliability.md, rows 1-7, 14 and 15, for the NVMe
// tier. Each fault is injected either by FaultInjectingBackend (over the
// in-memory backend and over a real kernel backend), by the kernel itself
// (tmpfs size limit, seccomp filter, signals), or by editing the swap file.
// What must hold afterwards: a clear error, nothing marked valid that is not,
// nothing lost, and the engine still usable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/mount.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <vector>

#include "strata/async_io.h"
#include "strata/swap_space.h"
#include "swap/backend.h"
#include "swap/fault_backend.h"
#include "swap/swap_space_internal.h"
#include "tests/swap/test_util.h"
#include "util/host_alloc_faults.h"

namespace strata {
namespace {

using swap::FaultPlan;
using swap::FaultRule;
using testing::FirstMismatch;
using testing::MustAllocate;
using testing::ReadVia;
using testing::ScratchDir;
using testing::Stamp;
using testing::SwapPath;
using testing::SwapPathName;
using testing::WriteVia;

constexpr uint32_t kBlock = 64 << 10;
constexpr uint64_t kBlocks = 16;

// Runs `body` in a forked child; returns its exit status (77 = skip).
int RunInChild(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

enum class Under { kMemory, kKernel };

// Each injected fault runs under the in-memory and a kernel backend, through
// the synchronous wrappers and through the asynchronous calls.
class SwapFaultTest
    : public ::testing::TestWithParam<std::tuple<Under, SwapPath>> {
 protected:
  void SetUp() override {
    plan_ = std::make_shared<FaultPlan>();
    io_.queue_depth = 4;
    options_.dirs = {dir_.path()};
    options_.capacity_bytes = kBlocks * kBlock;
    options_.block_bytes = kBlock;
    options_.queue_depth = 4;
    options_.max_relocations = 2;
  }

  std::unique_ptr<swap::Backend> Inner() {
    if (std::get<0>(GetParam()) == Under::kMemory) {
      return swap::NewMemoryBackend(io_);
    }
    auto u = swap::NewUringBackend(io_);
    if (u.ok()) return std::move(u).value();
    return std::move(swap::NewThreadBackend(io_)).value();
  }

  std::unique_ptr<IoEngine> Engine() {
    return swap::NewFaultInjectingEngine(Inner(), plan_, io_);
  }

  std::unique_ptr<SwapSpace> Space() {
    auto s = swap::OpenSwapSpaceWithEngine(options_, Engine());
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  static std::vector<std::byte> Data(size_t bytes, uint64_t salt) {
    std::vector<std::byte> d(bytes);
    Stamp(d, 0, salt);
    return d;
  }

  static SwapPath Path() { return std::get<1>(GetParam()); }
  static StatusOr<SwapHandle> Write(SwapSpace& s, uint64_t id,
                                    std::span<const std::byte> data) {
    return WriteVia(Path(), s, id, data);
  }
  static Status Read(SwapSpace& s, const SwapHandle& h,
                     std::span<std::byte> out) {
    return ReadVia(Path(), s, h, out);
  }

  static void ExpectReadsBack(SwapSpace& s, const SwapHandle& h,
                              uint64_t salt) {
    std::vector<std::byte> out(h.bytes());
    Status st = Read(s, h, out);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(FirstMismatch(out, 0, salt), -1);
  }

  ScratchDir dir_;
  std::shared_ptr<FaultPlan> plan_;
  IoEngineOptions io_;
  SwapSpaceOptions options_;
};

// Row 1: ENOSPC on swap-out, at every block of a write in turn.
TEST_P(SwapFaultTest, NoSpaceOnWriteLeavesNothingValid) {
  auto s = Space();
  ASSERT_NE(s, nullptr);
  auto keep = Write(*s, 1, Data(2 * kBlock, 1));
  ASSERT_TRUE(keep.ok());
  const auto data = Data(5 * kBlock + 100, 2);
  const auto original = data;
  for (uint64_t nth = 1; nth <= 6; ++nth) {
    plan_->Clear();
    plan_->Add({.kind = FaultRule::Kind::kError,
                .op = IoOp::kWrite,
                .err = ENOSPC,
                .nth = nth});
    const uint64_t free_before = s->free_blocks();
    auto h = Write(*s, 2, data);
    ASSERT_FALSE(h.ok()) << nth;
    EXPECT_EQ(h.status().code(), StatusCode::kNoSpace) << h.status().ToString();
    EXPECT_NE(h.status().ToString().find("tensor 2"), std::string::npos);
    EXPECT_EQ(s->free_blocks(), free_before) << "slots leaked at nth " << nth;
    EXPECT_EQ(data, original);  // the source stays authoritative
  }
  plan_->Clear();
  ExpectReadsBack(*s, *keep, 1);
  auto h = Write(*s, 2, data);  // and the space still works
  ASSERT_TRUE(h.ok());
  ExpectReadsBack(*s, *h, 2);
}

// Row 1: preallocation failure says what was needed and what is free.
TEST_P(SwapFaultTest, PreallocationNoSpaceSaysBytesNeededAndFree) {
  plan_->FailFallocate(ENOSPC);
  auto s = swap::OpenSwapSpaceWithEngine(options_, Engine());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(s.status().ToString().find("needs"), std::string::npos);
  EXPECT_NE(s.status().ToString().find("bytes free"), std::string::npos);
}

// Row 2: a transient EIO on write is absorbed by rewriting the block to a
// fresh slot; the failed slot is retired.
TEST_P(SwapFaultTest, TransientWriteErrorRelocatesBlock) {
  const auto data = Data(4 * kBlock + 3, 9);
  for (uint64_t nth = 1; nth <= 5; ++nth) {
    auto s = Space();
    ASSERT_NE(s, nullptr);
    plan_->Clear();
    plan_->Add({.op = IoOp::kWrite, .err = EIO, .nth = nth, .count = 1});
    auto h = Write(*s, 3, data);
    ASSERT_TRUE(h.ok()) << nth << ": " << h.status().ToString();
    EXPECT_EQ(s->stats().relocations, 1u);
    EXPECT_EQ(s->stats().retired_slots, 1u);
    EXPECT_EQ(s->free_blocks(), kBlocks - 5 - 1);
    plan_->Clear();
    ExpectReadsBack(*s, *h, 9);
  }
}

// Row 2: a persistent EIO fails the write with file and offset, marks nothing
// valid, and never reports success.
TEST_P(SwapFaultTest, PersistentWriteErrorFailsWithFileAndOffset) {
  auto s = Space();
  ASSERT_NE(s, nullptr);
  plan_->Add(
      {.op = IoOp::kWrite, .err = EIO, .nth = 1, .count = FaultRule::kForever});
  auto h = Write(*s, 4, Data(3 * kBlock, 4));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kIoError);
  EXPECT_NE(h.status().ToString().find(s->files()[0]), std::string::npos);
  EXPECT_NE(h.status().ToString().find("offset"), std::string::npos);
  // Retired slots are out of use; the others are free again.
  EXPECT_EQ(s->free_blocks() + s->stats().retired_slots, kBlocks);
  EXPECT_GT(s->stats().retired_slots, 0u);
}

// Row 2: fsync errors surface and are not retried into a false success.
TEST_P(SwapFaultTest, FsyncErrorIsReported) {
  auto e = Engine();
  auto f = e->Open(dir_.File("sync"), {.create = true});
  ASSERT_TRUE(f.ok());
  plan_->FailFsync(EIO);
  Status st = e->Sync(*f);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.ToString().find("fsync"), std::string::npos);
  plan_->Clear();
  EXPECT_TRUE(e->Sync(*f).ok());
}

// Row 3: EIO on read names the tensor, and the failed block's bytes never
// reach the destination.
TEST_P(SwapFaultTest, ReadErrorNamesTensorAndCopiesNothingOfTheBlock) {
  auto s = Space();
  ASSERT_NE(s, nullptr);
  auto h = Write(*s, 7, Data(3 * kBlock, 7));
  ASSERT_TRUE(h.ok());
  plan_->Add({.op = IoOp::kRead, .err = EIO, .nth = 1, .count = 1});
  std::vector<std::byte> out(h->bytes(), std::byte{0xee});
  Status st = Read(*s, *h, out);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.ToString().find("tensor 7"), std::string::npos);
  for (size_t i = 0; i < kBlock; ++i) {
    ASSERT_EQ(out[i], std::byte{0xee}) << "byte " << i << " reached the caller";
  }
  plan_->Clear();
  ExpectReadsBack(*s, *h, 7);
}

// Row 4: short reads and writes are completed by resubmitting the rest.
TEST_P(SwapFaultTest, ShortTransfersAreResubmitted) {
  auto s = Space();
  ASSERT_NE(s, nullptr);
  plan_->Add({.kind = FaultRule::Kind::kShort,
              .nth = 1,
              .count = FaultRule::kForever,
              .short_bytes = 4096});
  auto h = Write(*s, 8, Data(2 * kBlock + 5000, 8));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ExpectReadsBack(*s, *h, 8);
  EXPECT_GT(plan_->injected(), 2 * (kBlock / 4096));
}

// Row 5: EINTR, EAGAIN and ECANCELED are retried a bounded number of times.
TEST_P(SwapFaultTest, InterruptedRequestsRetryThenGiveUp) {
  auto s = Space();
  ASSERT_NE(s, nullptr);
  plan_->Add({.err = EINTR, .nth = 1, .count = 3});
  plan_->Add({.err = ECANCELED, .nth = 9, .count = 2});
  plan_->Add({.err = EAGAIN, .nth = 5, .count = 3});
  auto h = Write(*s, 9, Data(4 * kBlock, 10));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ExpectReadsBack(*s, *h, 10);
  // Forever: reported after the bound, no hang, no assert.
  plan_->Clear();
  plan_->Add({.op = IoOp::kRead,
              .err = EAGAIN,
              .nth = 1,
              .count = FaultRule::kForever});
  std::vector<std::byte> out(h->bytes());
  Status st = Read(*s, *h, out);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("errno 11"), std::string::npos) << st.ToString();
}

// Row 6: a filesystem that refuses O_DIRECT gets buffered I/O, same data.
TEST_P(SwapFaultTest, DirectOpenRefusedFallsBackToBuffered) {
  plan_->FailDirectOpen(EINVAL);
  auto e = Engine();
  auto f = e->Open(dir_.File("nodirect"), {.create = true});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_FALSE(e->direct(*f));
  EXPECT_EQ(e->alignment(*f), 1u);
  std::vector<std::byte> w(12345), r(12345);
  Stamp(w, 3, 6);
  ASSERT_TRUE(e->WriteAt(*f, 3, w).ok());
  ASSERT_TRUE(e->ReadAt(*f, 3, r).ok());
  EXPECT_EQ(FirstMismatch(r, 3, 6), -1);
}

INSTANTIATE_TEST_SUITE_P(
    Fault, SwapFaultTest,
    ::testing::Combine(::testing::Values(Under::kMemory, Under::kKernel),
                       ::testing::Values(SwapPath::kSync, SwapPath::kAsync)),
    [](const auto& p) {
      return std::string(std::get<0>(p.param) == Under::kMemory ? "memory"
                                                                : "kernel") +
             "_" + SwapPathName(std::get<1>(p.param));
    });

// ---- Faults made by the kernel or by editing real swap files ---------------

class SwapFileFaultTest : public ::testing::TestWithParam<SwapPath> {
 protected:
  void SetUp() override {
    SwapSpaceOptions o;
    o.dirs = {dir_.path()};
    o.capacity_bytes = kBlocks * kBlock;
    o.block_bytes = kBlock;
    o.queue_depth = 4;
    auto s = SwapSpace::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    space_ = std::move(s).value();
  }

  // Overwrites bytes of the swap file behind the engine's back.
  void Poke(uint64_t offset, const void* bytes, size_t n) {
    const int fd = ::open(space_->files()[0].c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(offset)),
              static_cast<ssize_t>(n));
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }

  std::vector<std::byte> Peek(uint64_t offset, size_t n) {
    std::vector<std::byte> b(n);
    const int fd = ::open(space_->files()[0].c_str(), O_RDONLY);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::pread(fd, b.data(), n, static_cast<off_t>(offset)),
              static_cast<ssize_t>(n));
    ::close(fd);
    return b;
  }

  uint64_t SlotBytes() const { return space_->header_bytes() + kBlock; }

  StatusOr<SwapHandle> Write(uint64_t id, std::span<const std::byte> data) {
    return WriteVia(GetParam(), *space_, id, data);
  }
  Status Read(const SwapHandle& h, std::span<std::byte> out) {
    return ReadVia(GetParam(), *space_, h, out);
  }

  // Copies slot `from`'s header and payload over slot `to`'s.
  void CopySlot(const std::vector<std::byte>& header,
                const std::vector<std::byte>& payload, uint32_t to) {
    Poke(space_->HeaderOffset(to), header.data(), header.size());
    Poke(space_->SlotOffset(to), payload.data(), payload.size());
  }

  // Reads `h` and expects kCorruption mentioning `what`, with the file named
  // and the destination never holding the corrupt block's bytes.
  void ExpectCorruption(const SwapHandle& h, const std::string& what) {
    std::vector<std::byte> out(h.bytes(), std::byte{0xcd});
    Status st = Read(h, out);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
    EXPECT_NE(st.ToString().find(what), std::string::npos) << st.ToString();
    EXPECT_NE(st.ToString().find(space_->files()[0]), std::string::npos);
    if (h.blocks() == 1) {
      for (std::byte b : out) ASSERT_EQ(b, std::byte{0xcd});
    }
  }

  ScratchDir dir_;
  std::unique_ptr<SwapSpace> space_;
};

std::vector<std::byte> Stamped(size_t n, uint64_t salt) {
  std::vector<std::byte> d(n);
  Stamp(d, 0, salt);
  return d;
}

TEST_P(SwapFileFaultTest, BitFlipInPayload) {
  auto h = Write(1, Stamped(kBlock, 1));
  ASSERT_TRUE(h.ok());
  const uint64_t off = space_->SlotOffset(h->slot(0)) + 12345;
  auto b = Peek(off, 1);
  b[0] ^= std::byte{0x10};
  Poke(off, b.data(), 1);
  ExpectCorruption(*h, "checksum mismatch");
  EXPECT_EQ(space_->stats().checksum_failures, 1u);
}

TEST_P(SwapFileFaultTest, ZeroedHeaderSector) {
  auto h = Write(2, Stamped(1000, 2));
  ASSERT_TRUE(h.ok());
  std::vector<char> zeros(512, 0);
  Poke(space_->HeaderOffset(h->slot(0)), zeros.data(), zeros.size());
  ExpectCorruption(*h, "bad magic");
}

TEST_P(SwapFileFaultTest, WrongLengthInHeader) {
  auto h = Write(3, Stamped(1000, 3));
  ASSERT_TRUE(h.ok());
  const uint64_t bogus = 999;
  Poke(space_->HeaderOffset(h->slot(0)) +
           offsetof(swap::BlockHeader, payload_bytes),
       &bogus, sizeof bogus);
  ExpectCorruption(*h, "payload length");
}

TEST_P(SwapFileFaultTest, SwappedBlocksAreMisdirected) {
  auto h = Write(4, Stamped(2 * kBlock, 4));
  ASSERT_TRUE(h.ok());
  CopySlot(Peek(space_->HeaderOffset(h->slot(0)), space_->header_bytes()),
           Peek(space_->SlotOffset(h->slot(0)), kBlock), h->slot(1));
  ExpectCorruption(*h, "misdirected");
}

TEST_P(SwapFileFaultTest, StaleGenerationIsCaught) {
  auto h1 = Write(5, Stamped(kBlock, 5));
  ASSERT_TRUE(h1.ok());
  const uint32_t slot = h1->slot(0);
  auto old_header = Peek(space_->HeaderOffset(slot), space_->header_bytes());
  auto old_payload = Peek(space_->SlotOffset(slot), kBlock);
  space_->Free(std::move(*h1));
  auto h2 = Write(5, Stamped(kBlock, 55));
  ASSERT_TRUE(h2.ok());
  ASSERT_EQ(h2->slot(0), slot);             // lowest free slot is reused
  CopySlot(old_header, old_payload, slot);  // a lost write
  ExpectCorruption(*h2, "stale generation");
}

TEST_P(SwapFileFaultTest, TruncatedFileIsCorruptionNotAbort) {
  auto h = Write(6, Stamped(3 * kBlock, 6));
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(
      ::truncate(space_->files()[0].c_str(),
                 static_cast<off_t>(space_->SlotOffset(h->slot(2)) + 4096)),
      0);
  std::vector<std::byte> out(h->bytes());
  Status st = Read(*h, out);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.ToString().find("end of file"), std::string::npos);
}

TEST_P(SwapFileFaultTest, FuzzedHeadersNeverPassOrCrash) {
  auto h = Write(7, Stamped(5000, 7));
  ASSERT_TRUE(h.ok());
  const uint64_t base = space_->HeaderOffset(h->slot(0));
  const auto pristine = Peek(base, sizeof(swap::BlockHeader));
  std::mt19937_64 rng(20261121);
  for (int iter = 0; iter < 300; ++iter) {
    auto hdr = pristine;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % hdr.size();
      std::byte v{static_cast<unsigned char>(rng())};
      if (v == hdr[at]) v ^= std::byte{1};
      hdr[at] = v;
    }
    Poke(base, hdr.data(), hdr.size());
    std::vector<std::byte> out(h->bytes(), std::byte{0xcd});
    Status st = Read(*h, out);
    ASSERT_EQ(st.code(), StatusCode::kCorruption)
        << "iteration " << iter << ": " << st.ToString();
    for (std::byte b : out) ASSERT_EQ(b, std::byte{0xcd});
  }
  Poke(base, pristine.data(), pristine.size());
  std::vector<std::byte> out(h->bytes());
  ASSERT_TRUE(Read(*h, out).ok());
  EXPECT_EQ(FirstMismatch(out, 0, 7), -1);
}

// Row 15: a second engine on the same directory is refused, in this process
// and in another, and the first one's file is untouched.
TEST_P(SwapFileFaultTest, SecondUserOfDirectoryIsBusy) {
  auto h = Write(8, Stamped(2 * kBlock, 8));
  ASSERT_TRUE(h.ok());
  const std::string file = space_->files()[0];
  auto before = Peek(0, 2 * SlotBytes());
  SwapSpaceOptions o;
  o.dirs = {dir_.path()};
  o.capacity_bytes = kBlock;
  o.block_bytes = kBlock;
  auto second = SwapSpace::Open(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kBusy);
  EXPECT_NE(
      second.status().ToString().find("pid " + std::to_string(::getpid())),
      std::string::npos)
      << second.status().ToString();
  const int child = RunInChild([&] {
    auto s = SwapSpace::Open(o);
    return !s.ok() && s.status().code() == StatusCode::kBusy ? 0 : 1;
  });
  EXPECT_EQ(child, 0);
  EXPECT_EQ(Peek(0, 2 * SlotBytes()), before);
  std::vector<std::byte> out(h->bytes());
  ASSERT_TRUE(Read(*h, out).ok());
  EXPECT_EQ(FirstMismatch(out, 0, 8), -1);
}

INSTANTIATE_TEST_SUITE_P(Corruption, SwapFileFaultTest,
                         ::testing::Values(SwapPath::kSync, SwapPath::kAsync),
                         [](const auto& p) { return SwapPathName(p.param); });

// Row 9: host memory refused. The nth host allocation of Open fails, n swept
// from 1 until Open succeeds, once (transient) and for good (persistent):
// every failure is kOutOfMemory, leaves no swap file, lock or pinned bytes
// behind, and the next Open of the same directory works and round-trips.
TEST(SwapHostOomTest, EveryAllocationOfOpenFailsCleanly) {
  ScratchDir dir;
  SwapSpaceOptions o;
  o.dirs = {dir.path()};
  o.capacity_bytes = 8 * kBlock;
  o.block_bytes = kBlock;
  o.queue_depth = 4;
  const uint64_t pinned_before = HostBuffer::TotalPinnedBytes();
  for (bool persistent : {false, true}) {
    SCOPED_TRACE(persistent ? "persistent" : "transient");
    int failures = 0;
    for (uint64_t n = 1;; ++n) {
      SCOPED_TRACE("allocation " + std::to_string(n));
      StatusOr<std::unique_ptr<SwapSpace>> s = Status::Ok();
      uint64_t failed = 0;
      {
        internal::ScopedHostAllocFaults faults(n, persistent);
        s = SwapSpace::Open(o);
        failed = internal::HostAllocFaults::failed();
      }
      if (failed == 0) {
        // n is past the last allocation: Open succeeded untouched.
        ASSERT_TRUE(s.ok()) << s.status().ToString();
        break;
      }
      ++failures;
      ASSERT_FALSE(s.ok()) << "a failed allocation went unreported";
      EXPECT_EQ(s.status().code(), StatusCode::kOutOfMemory)
          << s.status().ToString();
      EXPECT_EQ(HostBuffer::TotalPinnedBytes(), pinned_before);
      for (const auto& entry :
           std::filesystem::directory_iterator(dir.path())) {
        EXPECT_EQ(entry.path().filename().string().rfind("strata-swap", 0),
                  std::string::npos)
            << "left behind: " << entry.path();
      }
      ASSERT_LT(n, 100u) << "Open never stops allocating";
    }
    EXPECT_GE(failures, 1) << "Open made no host allocation to fail";
    auto s = SwapSpace::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto h = (*s)->Write(3, Stamped(3 * kBlock, 3));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<std::byte> out(h->bytes());
    ASSERT_TRUE((*s)->Read(*h, out).ok());
    EXPECT_EQ(FirstMismatch(out, 0, 3), -1);
  }
}

// Row 1 for real: a 1 MiB tmpfs in a private mount namespace.
TEST(SwapKernelFaultTest, TinyTmpfsFailsAtPreallocation) {
  ScratchDir d;
  const int rc = RunInChild([&]() -> int {
    if (::unshare(CLONE_NEWNS) != 0) return 77;
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      return 77;
    }
    if (::mount("tmpfs", d.path().c_str(), "tmpfs", 0, "size=1m") != 0) {
      return 77;
    }
    SwapSpaceOptions o;
    o.dirs = {d.path()};
    o.block_bytes = kBlock;
    o.capacity_bytes = 4 << 20;
    auto s = SwapSpace::Open(o);
    if (s.ok() || s.status().code() != StatusCode::kNoSpace) return 1;
    const std::string msg = s.status().ToString();
    if (msg.find("needs") == std::string::npos ||
        msg.find("bytes free") == std::string::npos) {
      return 2;
    }
    // A space that fits works on the same tmpfs.
    o.capacity_bytes = 4 * kBlock;
    auto ok = SwapSpace::Open(o);
    if (!ok.ok()) return 3;
    std::vector<std::byte> data(3 * kBlock);
    Stamp(data, 0, 1);
    auto h = (*ok)->Write(1, data);
    if (!h.ok()) return 4;
    std::vector<std::byte> out(data.size());
    if (!(*ok)->Read(*h, out).ok() || out != data) return 5;
    return 0;
  });
  if (rc == 77) GTEST_SKIP() << "no mount namespace here (needs root)";
  EXPECT_EQ(rc, 0);
}

// Row 5 for real: a storm of signals without SA_RESTART while every kernel
// backend moves data.
std::atomic<uint64_t> g_alarms{0};
void OnAlarm(int) { g_alarms.fetch_add(1, std::memory_order_relaxed); }

TEST(SwapKernelFaultTest, SignalStormDoesNotLoseData) {
  struct sigaction sa {};
  sa.sa_handler = OnAlarm;
  sa.sa_flags = 0;  // no SA_RESTART: syscalls see EINTR
  struct sigaction old {};
  ASSERT_EQ(::sigaction(SIGALRM, &sa, &old), 0);
  itimerval it{{0, 100}, {0, 100}};
  ASSERT_EQ(::setitimer(ITIMER_REAL, &it, nullptr), 0);
  for (IoBackend b :
       {IoBackend::kUring, IoBackend::kAio, IoBackend::kThreads}) {
    IoEngineOptions o;
    o.backend = b;
    o.queue_depth = 8;
    auto e = NewIoEngine(o);
    if (!e.ok()) continue;
    ScratchDir d;
    auto f = (*e)->Open(d.File("storm"), {.create = true});
    ASSERT_TRUE(f.ok());
    HostBuffer w = MustAllocate(1 << 20), r = MustAllocate(1 << 20);
    for (int rep = 0; rep < 40; ++rep) {
      Stamp(w.span(), 0, rep);
      Status ws = (*e)->WriteAt(*f, 0, w.span());
      ASSERT_TRUE(ws.ok()) << IoBackendName(b) << ": " << ws.ToString();
      Status rs = (*e)->ReadAt(*f, 0, r.span());
      ASSERT_TRUE(rs.ok()) << IoBackendName(b) << ": " << rs.ToString();
      ASSERT_EQ(FirstMismatch(r.span(), 0, rep), -1) << IoBackendName(b);
    }
    // The same through an AsyncIo, whose completion thread sleeps in poll().
    auto a = AsyncIo::Create(o);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    auto af = (*a)->Open(d.File("storm-async"), {.create = true});
    ASSERT_TRUE(af.ok());
    for (int rep = 0; rep < 40; ++rep) {
      Stamp(w.span(), 0, rep + 100);
      IoRequest wr{*af, 0, w.span(), IoOp::kWrite, 0};
      Status ws = (*a)->Submit({&wr, 1}, IoPriority::kBackground).Wait();
      ASSERT_TRUE(ws.ok()) << IoBackendName(b) << ": " << ws.ToString();
      IoRequest rd{*af, 0, r.span(), IoOp::kRead, 0};
      Status rs = (*a)->Submit({&rd, 1}, IoPriority::kUrgent).Wait();
      ASSERT_TRUE(rs.ok()) << IoBackendName(b) << ": " << rs.ToString();
      ASSERT_EQ(FirstMismatch(r.span(), 0, rep + 100), -1) << IoBackendName(b);
    }
  }
  itimerval off{};
  ::setitimer(ITIMER_REAL, &off, nullptr);
  ::sigaction(SIGALRM, &old, nullptr);
  EXPECT_GT(g_alarms.load(), 0u);
}

// Row 7: io_uring (and libaio) refused by a seccomp filter, as in a
// container's default profile; the probe falls back and says why.
int ProbeUnderSeccomp(int uring_errno, int aio_errno, IoBackend expect) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) return 77;
  if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(uring_errno),
                       SCMP_SYS(io_uring_setup), 0) != 0) {
    return 77;
  }
  if (aio_errno != 0 && seccomp_rule_add(ctx, SCMP_ACT_ERRNO(aio_errno),
                                         SCMP_SYS(io_setup), 0) != 0) {
    return 77;
  }
  if (seccomp_load(ctx) != 0) return 77;
  seccomp_release(ctx);
  auto e = NewIoEngine({});
  if (!e.ok()) return 10;
  if ((*e)->backend() != expect) return 11;
  const std::string why((*e)->fallback_reason());
  if (why.find("io_uring") == std::string::npos) return 12;
  if (aio_errno != 0 && why.find("libaio") == std::string::npos) return 13;
  ScratchDir d;
  auto f = (*e)->Open(d.File("probe"), {.create = true});
  if (!f.ok()) return 14;
  auto w = HostBuffer::Allocate(256 << 10), r = HostBuffer::Allocate(256 << 10);
  Stamp(w->span(), 0, 17);
  if (!(*e)->WriteAt(*f, 0, w->span()).ok()) return 15;
  if (!(*e)->ReadAt(*f, 0, r->span()).ok()) return 16;
  if (FirstMismatch(r->span(), 0, 17) != -1) return 17;
  // An AsyncIo probes the same way and works over the fallback.
  auto a = AsyncIo::Create(IoEngineOptions{});
  if (!a.ok() || (*a)->backend() != expect) return 18;
  auto af = (*a)->Open(d.File("probe-async"), {.create = true});
  if (!af.ok()) return 19;
  IoRequest wr{*af, 0, w->span(), IoOp::kWrite, 0};
  IoRequest rd{*af, 0, r->span(), IoOp::kRead, 0};
  std::memset(r->data(), 0, r->size());
  if (!(*a)->Submit({&wr, 1}, IoPriority::kBackground).Wait().ok()) return 20;
  if (!(*a)->Submit({&rd, 1}, IoPriority::kUrgent).Wait().ok()) return 21;
  return FirstMismatch(r->span(), 0, 17) == -1 ? 0 : 22;
}

TEST(SwapKernelFaultTest, UringRefusedFallsBackToAio) {
  for (int err : {ENOSYS, EPERM, ENOMEM}) {
    const int rc =
        RunInChild([&] { return ProbeUnderSeccomp(err, 0, IoBackend::kAio); });
    if (rc == 77) GTEST_SKIP() << "seccomp unavailable";
    EXPECT_EQ(rc, 0) << "io_uring_setup -> errno " << err;
  }
}

TEST(SwapKernelFaultTest, UringAndAioRefusedFallBackToThreads) {
  const int rc = RunInChild(
      [] { return ProbeUnderSeccomp(ENOSYS, EPERM, IoBackend::kThreads); });
  if (rc == 77) GTEST_SKIP() << "seccomp unavailable";
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace strata
