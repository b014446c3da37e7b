// AsyncIo and the asynchronous SwapSpace calls: round trips on every backend,
// many submitting threads, callbacks exactly once, submitting from a
// callback, urgent requests overtaking queued background work (held
// deterministically by a gated backend, not by timing), shutdown with I/O in
// flight (row 17), additive buffer registration, misaligned buffers refused,
// grouped batches (each group finished alone, refused together), and handles
// that give their slots back when dropped.
#include "strata/async_io.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/swap_space.h"
#include "swap/backend.h"
#include "swap/swap_space_internal.h"
#include "tests/swap/test_util.h"

namespace strata {
namespace {

using testing::FirstMismatch;
using testing::MustAllocate;
using testing::ScratchDir;
using testing::Stamp;

constexpr size_t kPage = 4096;

// Holds every operation it is given until Open(); records the order in which
// operations reached it (by buffer address). All backend calls stay on the
// completion thread: Open only flags and wakes it.
class GatedBackend final : public swap::BackendWrapper {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    std::vector<const std::byte*> seen;  // in arrival order
  };

  GatedBackend(std::unique_ptr<swap::Backend> target,
               std::shared_ptr<Gate> gate)
      : BackendWrapper(std::move(target)), gate_(std::move(gate)) {}

  StatusOr<size_t> Submit(std::span<const swap::RawOp> ops) override {
    bool open;
    {
      std::lock_guard<std::mutex> lock(gate_->mu);
      for (const auto& op : ops) gate_->seen.push_back(op.buf);
      open = gate_->open;
      if (!open) held_.insert(held_.end(), ops.begin(), ops.end());
    }
    gate_->cv.notify_all();
    if (open) return BackendWrapper::Submit(ops);
    return ops.size();
  }

  StatusOr<size_t> Wait(std::span<swap::RawResult> out, size_t min) override {
    bool open;
    {
      std::lock_guard<std::mutex> lock(gate_->mu);
      open = gate_->open;
    }
    if (open && !held_.empty()) {
      STRATA_RETURN_IF_ERROR(BackendWrapper::Submit(held_).status());
      held_.clear();
    }
    if (!open) return size_t{0};
    return BackendWrapper::Wait(out, min);
  }

  static void Open(Gate& gate, int completion_fd) {
    {
      std::lock_guard<std::mutex> lock(gate.mu);
      gate.open = true;
    }
    swap::SignalEventFd(completion_fd);
  }

 private:
  std::shared_ptr<Gate> gate_;
  std::vector<swap::RawOp> held_;
};

// Counts callbacks and lets a test wait for a number of them.
class Latch {
 public:
  void Hit() {
    std::lock_guard<std::mutex> lock(mu_);
    ++hits_;
    cv_.notify_all();  // under the lock: the waiter may destroy the latch
  }
  void WaitFor(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return hits_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int hits_ = 0;
};

struct Gated {
  std::shared_ptr<GatedBackend::Gate> gate =
      std::make_shared<GatedBackend::Gate>();
  std::unique_ptr<AsyncIo> io;
  int completion_fd = -1;
  FileId file = 0;

  explicit Gated(uint32_t depth, const std::string& path) {
    IoEngineOptions o;
    o.backend = IoBackend::kMemory;
    o.queue_depth = depth;
    auto backend =
        std::make_unique<GatedBackend>(swap::NewMemoryBackend(o), gate);
    completion_fd = backend->CompletionFd();
    auto a =
        AsyncIo::Create(swap::NewIoEngineWithBackend(std::move(backend), o));
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    io = std::move(a).value();
    file = io->Open(path, {.create = true}).value();
  }
  void WaitSeen(size_t n) {
    std::unique_lock<std::mutex> lock(gate->mu);
    gate->cv.wait(lock, [&] { return gate->seen.size() >= n; });
  }
  void Open() { GatedBackend::Open(*gate, completion_fd); }
};

// An urgent read submitted behind many queued background writes is the next
// request the engine takes once a slot frees, and completes before almost
// all of them.
TEST(AsyncIoPriorityTest, UrgentReadOvertakesQueuedBackgroundWrites) {
  ScratchDir dir;
  Gated g(2, dir.File("prio"));
  constexpr int kWrites = 50;
  HostBuffer buf = MustAllocate((kWrites + 1) * kPage);
  std::mutex order_mu;
  std::vector<int> order;  // callbacks, in delivery order (-1: the urgent)
  Latch latch;
  auto record = [&](int who) {
    return [&, who](std::span<IoCompletion> c) {
      ASSERT_TRUE(FirstError(c).ok());
      {
        std::lock_guard<std::mutex> lock(order_mu);
        order.push_back(who);
      }
      latch.Hit();
    };
  };
  for (int i = 0; i < kWrites; ++i) {
    IoRequest w{g.file, uint64_t(i) * kPage,
                buf.span().subspan(i * kPage, kPage), IoOp::kWrite, 0};
    ASSERT_TRUE(g.io->Submit({&w, 1}, IoPriority::kBackground, record(i)).ok());
  }
  g.WaitSeen(2);  // the engine holds two writes; 48 wait in the queue
  IoRequest r{g.file, 0, buf.span().subspan(kWrites * kPage, kPage),
              IoOp::kRead, 0};
  ASSERT_TRUE(g.io->Submit({&r, 1}, IoPriority::kUrgent, record(-1)).ok());
  g.Open();
  latch.WaitFor(kWrites + 1);
  {
    std::lock_guard<std::mutex> lock(g.gate->mu);
    ASSERT_EQ(g.gate->seen.size(), size_t{kWrites + 1});
    EXPECT_EQ(g.gate->seen[2], buf.data() + kWrites * kPage)
        << "the urgent read was not the next request taken";
  }
  std::lock_guard<std::mutex> lock(order_mu);
  const auto at = std::find(order.begin(), order.end(), -1) - order.begin();
  EXPECT_LE(at, 3) << "urgent completed after " << at << " background writes";
}

// A grouped batch: each group's callback runs once its own requests are in,
// and by then the engine has been refilled from the queue with the slots the
// group freed (callbacks run after the refill, so a slow one never leaves
// the device idle). Depth 2, four writes in groups of two: when group 0's
// callback runs, all four writes have reached the engine.
TEST(AsyncIoGroupTest, AGroupFinishesAloneAfterTheEngineIsRefilled) {
  ScratchDir dir;
  Gated g(2, dir.File("groups"));
  HostBuffer buf = MustAllocate(4 * kPage);
  std::mutex mu;
  std::vector<std::pair<size_t, size_t>> seen_at;  // (group, engine's count)
  std::vector<std::vector<uint64_t>> tags(2);
  Latch latch;
  std::vector<IoRequest> reqs;
  for (uint64_t i = 0; i < 4; ++i) {
    reqs.push_back({g.file, i * kPage, buf.span().subspan(i * kPage, kPage),
                    IoOp::kWrite, 100 + i});
  }
  ASSERT_TRUE(g.io->SubmitGroups(reqs, 2, IoPriority::kBackground,
                                 [&](size_t group, std::span<IoCompletion> c) {
                                   size_t engine;
                                   {
                                     std::lock_guard<std::mutex> l(g.gate->mu);
                                     engine = g.gate->seen.size();
                                   }
                                   std::lock_guard<std::mutex> l(mu);
                                   seen_at.emplace_back(group, engine);
                                   for (const IoCompletion& x : c) {
                                     EXPECT_TRUE(x.status.ok());
                                     tags.at(group).push_back(x.tag);
                                   }
                                   latch.Hit();
                                 })
                  .ok());
  g.WaitSeen(2);  // group 0 in the engine, group 1 queued
  g.Open();
  latch.WaitFor(2);
  std::lock_guard<std::mutex> l(mu);
  ASSERT_EQ(seen_at.size(), 2u);
  EXPECT_EQ(seen_at[0], std::make_pair(size_t{0}, size_t{4}));
  EXPECT_EQ(seen_at[1].first, 1u);
  EXPECT_EQ(tags[0], (std::vector<uint64_t>{100, 101}));
  EXPECT_EQ(tags[1], (std::vector<uint64_t>{102, 103}));
}

// Row 17: destroyed with requests queued and in the kernel. Queued ones end
// kAborted, the ones the kernel holds complete, every callback runs exactly
// once, and the destructor returns only after all of them.
TEST(AsyncIoShutdownTest, QueuedAreCancelledInFlightCompleteEachOnce) {
  ScratchDir dir;
  Gated g(2, dir.File("shutdown"));
  constexpr int kBatches = 20;
  HostBuffer buf = MustAllocate(kBatches * kPage);
  std::vector<std::atomic<int>> calls(kBatches);
  std::atomic<int> ok{0}, aborted{0};
  Latch latch;
  for (int i = 0; i < kBatches; ++i) {
    // Reads read page 0, which the first write fills.
    IoRequest q{g.file, i % 2 ? 0 : uint64_t(i) * kPage,
                buf.span().subspan(i * kPage, kPage),
                i % 2 ? IoOp::kRead : IoOp::kWrite, 0};
    ASSERT_TRUE(g.io->Submit({&q, 1}, IoPriority::kBackground,
                             [&, i](std::span<IoCompletion> c) {
                               calls[i].fetch_add(1);
                               const Status s = FirstError(c);
                               if (s.ok()) {
                                 ok.fetch_add(1);
                               } else if (s.code() == StatusCode::kAborted) {
                                 aborted.fetch_add(1);
                               }
                               latch.Hit();
                             })
                    .ok());
  }
  g.WaitSeen(2);
  std::thread closer([&] { g.io.reset(); });
  latch.WaitFor(kBatches - 2);  // the queued ones, cancelled
  EXPECT_EQ(aborted.load(), kBatches - 2);
  g.Open();  // let the kernel's two finish
  closer.join();
  for (int i = 0; i < kBatches; ++i) EXPECT_EQ(calls[i].load(), 1) << i;
  EXPECT_EQ(ok.load(), 2);
}

struct BackendParam {
  IoBackend backend;
};

class AsyncIoTest : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    IoEngineOptions o;
    o.backend = GetParam();
    o.queue_depth = 8;
    auto io = AsyncIo::Create(o);
    if (!io.ok() && io.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << io.status().ToString();
    }
    ASSERT_TRUE(io.ok()) << io.status().ToString();
    io_ = std::move(io).value();
    auto f = io_->Open(dir_.File("data"), {.create = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = *f;
  }

  ScratchDir dir_;
  std::unique_ptr<AsyncIo> io_;
  FileId file_ = 0;
};

// Several threads each write their own region in batches and read it back,
// with tickets; every byte lands where it belongs.
TEST_P(AsyncIoTest, ManySubmittingThreadsRoundTrip) {
  constexpr int kThreads = 4, kBatches = 25, kPerBatch = 4;
  constexpr size_t kBlock = 16 << 10;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      HostBuffer w = MustAllocate(kPerBatch * kBlock);
      HostBuffer r = MustAllocate(kPerBatch * kBlock);
      for (int b = 0; b < kBatches; ++b) {
        const uint64_t base = (uint64_t(t) * kBatches + b) * kPerBatch * kBlock;
        Stamp(w.span(), base, 7);
        std::vector<IoRequest> reqs;
        for (int i = 0; i < kPerBatch; ++i) {
          reqs.push_back({file_, base + i * kBlock,
                          w.span().subspan(i * kBlock, kBlock), IoOp::kWrite,
                          uint64_t(i)});
        }
        const auto prio = b % 2 ? IoPriority::kUrgent : IoPriority::kBackground;
        if (!io_->Submit(reqs, prio).Wait().ok()) failures.fetch_add(1);
        for (auto& q : reqs) {
          q.op = IoOp::kRead;
          q.buf = r.span().subspan(q.tag * kBlock, kBlock);
        }
        if (!io_->Submit(reqs, prio).Wait().ok()) failures.fetch_add(1);
        if (FirstMismatch(r.span(), base, 7) != -1) failures.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// A callback may submit more I/O: a chain of ten write-then-read steps, each
// started from the previous one's callback.
TEST_P(AsyncIoTest, CallbackMaySubmitMore) {
  HostBuffer w = MustAllocate(kPage), r = MustAllocate(kPage);
  IoTicket done;
  std::atomic<int> steps{0};
  std::function<void(std::span<IoCompletion>)> step = [&](std::span<
                                                          IoCompletion>
                                                              c) {
    EXPECT_TRUE(io_->OnCompletionThread());
    if (Status s = FirstError(c); !s.ok()) return done.Set(s);
    const int n = steps.fetch_add(1);
    if (n == 10) return done.Set(Status::Ok());
    // Even steps write page n/2, odd ones read it back, and the next even
    // one checks what was read.
    const uint64_t at = uint64_t(n / 2) * kPage;
    if (n % 2 == 0 && n > 0 && FirstMismatch(r.span(), at - kPage, 3) != -1) {
      return done.Set(Status::Corruption("read back differs"));
    }
    IoRequest q{file_, at, n % 2 ? r.span() : w.span(),
                n % 2 ? IoOp::kRead : IoOp::kWrite, 0};
    if (n % 2 == 0) Stamp(w.span(), at, 3);
    if (Status s = io_->Submit({&q, 1}, IoPriority::kUrgent, step); !s.ok()) {
      done.Set(s);
    }
  };
  ASSERT_TRUE(io_->Submit({}, IoPriority::kUrgent, step).ok());
  ASSERT_TRUE(done.Wait().ok()) << done.Wait().ToString();
  EXPECT_EQ(steps.load(), 11);
  EXPECT_FALSE(io_->OnCompletionThread());
}

// Row 17 on a real ring: destroyed right after 64 batches were submitted
// against a queue depth of 8; each callback runs exactly once, with OK or
// kAborted, before the destructor returns.
TEST_P(AsyncIoTest, DestroyedWithRequestsInFlightRunsEveryCallbackOnce) {
  constexpr int kBatches = 64;
  HostBuffer buf = MustAllocate(kBatches * kPage);
  std::vector<std::atomic<int>> calls(kBatches);
  std::atomic<int> bad{0};
  for (int i = 0; i < kBatches; ++i) {
    IoRequest q{file_, uint64_t(i) * kPage,
                buf.span().subspan(i * kPage, kPage),
                i % 3 ? IoOp::kWrite : IoOp::kRead, 0};
    ASSERT_TRUE(
        io_->Submit({&q, 1},
                    i % 2 ? IoPriority::kUrgent : IoPriority::kBackground,
                    [&, i](std::span<IoCompletion> c) {
                      calls[i].fetch_add(1);
                      const Status s = FirstError(c);
                      // Reads past the end are kCorruption.
                      if (!s.ok() && s.code() != StatusCode::kAborted &&
                          s.code() != StatusCode::kCorruption) {
                        bad.fetch_add(1);
                      }
                    })
            .ok());
  }
  io_.reset();
  for (int i = 0; i < kBatches; ++i) EXPECT_EQ(calls[i].load(), 1) << i;
  EXPECT_EQ(bad.load(), 0);
}

// Registrations are additive: two users each register a buffer, one drops
// its registration, and I/O through both buffers still works.
TEST_P(AsyncIoTest, BufferRegistrationsAreAdditive) {
  HostBuffer a = MustAllocate(kPage), b = MustAllocate(kPage);
  auto ra = io_->RegisterBuffer(a.span());
  auto rb = io_->RegisterBuffer(b.span());
  ASSERT_TRUE(ra.ok() && rb.ok());
  if (GetParam() == IoBackend::kUring) {
    // Both in the ring at once, unless the kernel refused (logged).
    EXPECT_EQ(ra->registered(), rb->registered());
  } else {
    EXPECT_FALSE(ra->registered());
  }
  Stamp(a.span(), 0, 1);
  IoRequest w{file_, 0, a.span(), IoOp::kWrite, 0};
  ASSERT_TRUE(io_->Submit({&w, 1}, IoPriority::kUrgent).Wait().ok());
  *ra = IoBufferRegistration();  // unregister a
  IoRequest r{file_, 0, b.span(), IoOp::kRead, 0};
  ASSERT_TRUE(io_->Submit({&r, 1}, IoPriority::kUrgent).Wait().ok());
  EXPECT_EQ(FirstMismatch(b.span(), 0, 1), -1);
  ASSERT_TRUE(io_->Submit({&w, 1}, IoPriority::kUrgent).Wait().ok());
}

// Row 6: a misaligned request is refused at Submit, before anything is
// queued, and its callback never runs.
TEST_P(AsyncIoTest, MisalignedRequestRefusedAtSubmit) {
  if (io_->alignment(file_) <= 1) GTEST_SKIP() << "buffered file";
  HostBuffer buf = MustAllocate(2 * kPage);
  IoRequest bad{file_, 0, buf.span().subspan(1, kPage), IoOp::kWrite, 0};
  bool ran = false;
  Status s = io_->Submit({&bad, 1}, IoPriority::kUrgent,
                         [&](std::span<IoCompletion>) { ran = true; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.ToString().find("aligned"), std::string::npos);
  IoRequest good{file_, 0, buf.span().subspan(0, kPage), IoOp::kWrite, 0};
  ASSERT_TRUE(io_->Submit({&good, 1}, IoPriority::kUrgent).Wait().ok());
  EXPECT_FALSE(ran);
}

// Groups of three over ten requests: four callbacks, of 3, 3, 3 and 1
// completions, each once; the writes then read back through one group.
TEST_P(AsyncIoTest, GroupsCoverTheBatchEachOnce) {
  HostBuffer w = MustAllocate(10 * kPage), r = MustAllocate(10 * kPage);
  Stamp(w.span(), 0, 9);
  std::vector<IoRequest> reqs;
  for (uint64_t i = 0; i < 10; ++i) {
    reqs.push_back({file_, i * kPage, w.span().subspan(i * kPage, kPage),
                    IoOp::kWrite, i});
  }
  std::mutex mu;
  std::vector<std::vector<uint64_t>> groups(4);
  std::vector<int> calls(4, 0);
  Latch latch;
  ASSERT_TRUE(io_->SubmitGroups(reqs, 3, IoPriority::kUrgent,
                                [&](size_t g, std::span<IoCompletion> c) {
                                  std::lock_guard<std::mutex> l(mu);
                                  ++calls.at(g);
                                  for (const IoCompletion& x : c) {
                                    EXPECT_TRUE(x.status.ok());
                                    groups.at(g).push_back(x.tag);
                                  }
                                  latch.Hit();
                                })
                  .ok());
  latch.WaitFor(4);
  {
    std::lock_guard<std::mutex> l(mu);
    EXPECT_EQ(calls, (std::vector<int>{1, 1, 1, 1}));
    EXPECT_EQ(groups[0], (std::vector<uint64_t>{0, 1, 2}));
    EXPECT_EQ(groups[2], (std::vector<uint64_t>{6, 7, 8}));
    EXPECT_EQ(groups[3], (std::vector<uint64_t>{9}));
  }
  for (auto& q : reqs) {
    q.op = IoOp::kRead;
    q.buf = r.span().subspan(q.tag * kPage, kPage);
  }
  IoTicket read;
  ASSERT_TRUE(io_->SubmitGroups(reqs, 10, IoPriority::kUrgent,
                                [read](size_t, std::span<IoCompletion> c) {
                                  read.Set(FirstError(c));
                                })
                  .ok());
  ASSERT_TRUE(read.Wait().ok());
  EXPECT_EQ(FirstMismatch(r.span(), 0, 9), -1);
}

// All or nothing: one bad request in the last group refuses the whole
// batch, and no group's callback runs; a group size of 0 is refused; an
// empty batch is one empty group.
TEST_P(AsyncIoTest, GroupsAreRefusedTogether) {
  HostBuffer buf = MustAllocate(4 * kPage);
  std::vector<IoRequest> reqs;
  for (uint64_t i = 0; i < 4; ++i) {
    reqs.push_back({file_, i * kPage, buf.span().subspan(i * kPage, kPage),
                    IoOp::kWrite, i});
  }
  reqs[3].file = file_ + 1000;  // never opened
  std::atomic<int> ran{0};
  auto count = [&](size_t, std::span<IoCompletion>) { ran.fetch_add(1); };
  EXPECT_EQ(io_->SubmitGroups(reqs, 1, IoPriority::kUrgent, count).code(),
            StatusCode::kInvalidArgument);
  reqs[3].file = file_;
  EXPECT_EQ(io_->SubmitGroups(reqs, 0, IoPriority::kUrgent, count).code(),
            StatusCode::kInvalidArgument);
  IoTicket empty;
  ASSERT_TRUE(
      io_->SubmitGroups({}, 4, IoPriority::kUrgent,
                        [&, empty](size_t g, std::span<IoCompletion> c) {
                          EXPECT_EQ(g, 0u);
                          EXPECT_TRUE(c.empty());
                          empty.Set(Status::Ok());
                        })
          .ok());
  ASSERT_TRUE(empty.Wait().ok());
  ASSERT_TRUE(io_->Submit(reqs, IoPriority::kUrgent).Wait().ok());
  EXPECT_EQ(ran.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, AsyncIoTest,
                         ::testing::Values(IoBackend::kUring, IoBackend::kAio,
                                           IoBackend::kThreads,
                                           IoBackend::kMemory),
                         [](const auto& p) {
                           return std::string(IoBackendName(p.param));
                         });

// ---- SwapSpace over AsyncIo ------------------------------------------------

constexpr uint32_t kBlock = 64 << 10;

SwapSpaceOptions SpaceOptions(const std::string& dir,
                              std::shared_ptr<AsyncIo> io = nullptr) {
  SwapSpaceOptions o;
  o.dirs = {dir};
  o.capacity_bytes = 32 * kBlock;
  o.block_bytes = kBlock;
  o.queue_depth = 4;
  o.shared_io = std::move(io);
  return o;
}

TEST(SwapAsyncTest, DroppedHandlesGiveTheirSlotsBack) {
  ScratchDir d;
  auto s = SwapSpace::Open(SpaceOptions(d.path()));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const uint64_t all = (*s)->free_blocks();
  {
    std::vector<std::byte> data(5 * kBlock + 1);
    auto h = (*s)->Write(1, data);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ((*s)->free_blocks(), all - 6);
    SwapHandle moved = std::move(*h);
    EXPECT_FALSE(h->valid());
    EXPECT_EQ((*s)->free_blocks(), all - 6);
    auto a = (*s)->Allocate(2, 3 * kBlock);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*s)->free_blocks(), all - 9);
    moved = std::move(*a);  // frees the first handle's six
    EXPECT_EQ((*s)->free_blocks(), all - 3);
  }
  EXPECT_EQ((*s)->free_blocks(), all);
  // A handle may outlive its space.
  auto late = (*s)->Allocate(3, kBlock);
  ASSERT_TRUE(late.ok());
  s->reset();
  late->Reset();
}

TEST(SwapAsyncTest, MisalignedOrShortBufferRefusedBeforeIo) {
  ScratchDir d;
  auto s = SwapSpace::Open(SpaceOptions(d.path()));
  ASSERT_TRUE(s.ok());
  SwapSpace& sp = **s;
  auto h = sp.Allocate(1, 2 * kBlock + 100);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(sp.BufferBytes(*h, 0, 3), 2 * kBlock + sp.buffer_alignment());
  HostBuffer buf = MustAllocate(3 * kBlock + kPage);
  bool ran = false;
  auto cb = [&](Status) { ran = true; };
  Status st =
      sp.WriteAsync(*h, 0, 3, buf.span().subspan(8), IoPriority::kUrgent, cb);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.ToString().find("multiple of " +
                               std::to_string(sp.buffer_alignment())),
            std::string::npos)
      << st.ToString();
  st = sp.ReadAsync(*h, 0, 3, buf.span().subspan(0, 2 * kBlock),
                    IoPriority::kUrgent, cb);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.ToString().find("span at least"), std::string::npos);
  st = sp.ReadAsync(*h, 2, 2, buf.span(), IoPriority::kUrgent, cb);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(ran);
}

// Block ranges go straight between the disk and the caller's buffer; a
// shared AsyncIo serves two spaces and direct I/O at once; reading blocks
// never written is corruption, not stale data.
TEST(SwapAsyncTest, BlockRangesOverASharedAsyncIo) {
  ScratchDir d1, d2;
  IoEngineOptions eo;
  eo.queue_depth = 8;
  auto io = AsyncIo::Create(eo);
  ASSERT_TRUE(io.ok());
  std::shared_ptr<AsyncIo> shared = std::move(io).value();
  auto s1 = SwapSpace::Open(SpaceOptions(d1.path(), shared));
  auto s2 = SwapSpace::Open(SpaceOptions(d2.path(), shared));
  ASSERT_TRUE(s1.ok() && s2.ok()) << s1.status().ToString();
  EXPECT_EQ(&(*s1)->io(), &(*s2)->io());
  const uint64_t bytes = 6 * kBlock + 300;
  auto h = (*s1)->Allocate(9, bytes);
  ASSERT_TRUE(h.ok());
  HostBuffer src = MustAllocate((*s1)->BufferBytes(*h, 0, h->blocks()));
  Stamp(src.span().subspan(0, bytes), 0, 9);
  // Unwritten blocks do not verify.
  HostBuffer dst = MustAllocate(src.size());
  IoTicket t0;
  ASSERT_TRUE(
      (*s1)
          ->ReadAsync(*h, 0, 1, dst.span(), IoPriority::kUrgent, t0.Setter())
          .ok());
  EXPECT_EQ(t0.Wait().code(), StatusCode::kCorruption);
  // Write in two ranges, the second from the middle of the buffer.
  IoTicket a, b;
  ASSERT_TRUE((*s1)
                  ->WriteAsync(*h, 0, 4, src.span(), IoPriority::kBackground,
                               a.Setter())
                  .ok());
  ASSERT_TRUE(a.Wait().ok()) << a.Wait().ToString();
  ASSERT_TRUE((*s1)
                  ->WriteAsync(*h, 4, 3, src.span().subspan(4 * kBlock),
                               IoPriority::kBackground, b.Setter())
                  .ok());
  ASSERT_TRUE(b.Wait().ok()) << b.Wait().ToString();
  // Read blocks 2..6 into the start of another buffer.
  IoTicket c;
  ASSERT_TRUE(
      (*s1)
          ->ReadAsync(*h, 2, 5, dst.span(), IoPriority::kUrgent, c.Setter())
          .ok());
  ASSERT_TRUE(c.Wait().ok()) << c.Wait().ToString();
  EXPECT_EQ(
      FirstMismatch(dst.span().subspan(0, bytes - 2 * kBlock), 2 * kBlock, 9),
      -1);
  // The other space and raw I/O share the ring meanwhile.
  std::vector<std::byte> other(3 * kBlock);
  Stamp(other, 0, 4);
  auto h2 = (*s2)->Write(1, other);
  ASSERT_TRUE(h2.ok());
  std::vector<std::byte> back(other.size());
  ASSERT_TRUE((*s2)->Read(*h2, back).ok());
  EXPECT_EQ(back, other);
}

// The synchronous wrappers would wait for the completion thread itself.
TEST(SwapAsyncTest, SynchronousCallFromCallbackIsRefused) {
  ScratchDir d;
  auto s = SwapSpace::Open(SpaceOptions(d.path()));
  ASSERT_TRUE(s.ok());
  std::vector<std::byte> data(kBlock);
  auto h = (*s)->Write(1, data);
  ASSERT_TRUE(h.ok());
  HostBuffer buf = MustAllocate(kBlock);
  IoTicket inner;
  ASSERT_TRUE((*s)->ReadAsync(*h, 0, 1, buf.span(), IoPriority::kUrgent,
                              [&](Status) {
                                std::vector<std::byte> out(kBlock);
                                inner.Set((*s)->Read(*h, out));
                              })
                  .ok());
  EXPECT_EQ(inner.Wait().code(), StatusCode::kFailedPrecondition);
}

// Without synchronous_io the space holds no bounce blocks: the asynchronous
// calls work and the synchronous ones are refused, pinning nothing.
TEST(SwapAsyncTest, WithoutSynchronousIoOnlyTheAsynchronousCallsWork) {
  ScratchDir d;
  SwapSpaceOptions o = SpaceOptions(d.path());
  auto pinned_by_open = [&o]() -> uint64_t {
    const uint64_t before = HostBuffer::TotalPinnedBytes();
    auto s = SwapSpace::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return HostBuffer::TotalPinnedBytes() - before;
  };
  const uint64_t with_bounce = pinned_by_open();
  o.synchronous_io = false;
  const uint64_t without = pinned_by_open();
  if (with_bounce > 0) {  // 0 where mlock is refused
    EXPECT_EQ(with_bounce - without, uint64_t{o.queue_depth} * kBlock);
  }
  auto s = SwapSpace::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const uint64_t all = (*s)->free_blocks();
  std::vector<std::byte> data(kBlock);
  auto w = (*s)->Write(1, data);
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->free_blocks(), all);
  EXPECT_NE(w.status().ToString().find("synchronous_io"), std::string::npos)
      << w.status().ToString();
  auto h = (*s)->Allocate(1, 2 * kBlock);
  ASSERT_TRUE(h.ok());
  HostBuffer src = MustAllocate((*s)->BufferBytes(*h, 0, 2));
  Stamp(src.span().subspan(0, 2 * kBlock), 0, 5);
  IoTicket wt;
  ASSERT_TRUE(
      (*s)->WriteAsync(*h, 0, 2, src.span(), IoPriority::kUrgent, wt.Setter())
          .ok());
  ASSERT_TRUE(wt.Wait().ok()) << wt.Wait().ToString();
  std::vector<std::byte> out(2 * kBlock);
  EXPECT_EQ((*s)->Read(*h, out).code(), StatusCode::kFailedPrecondition);
  HostBuffer dst = MustAllocate(src.size());
  IoTicket rt;
  ASSERT_TRUE(
      (*s)->ReadAsync(*h, 0, 2, dst.span(), IoPriority::kUrgent, rt.Setter())
          .ok());
  ASSERT_TRUE(rt.Wait().ok()) << rt.Wait().ToString();
  EXPECT_EQ(FirstMismatch(dst.span().subspan(0, 2 * kBlock), 0, 5), -1);
}

// Row 17 for the swap space: destroyed with reads and writes in flight; every
// callback has run, once, when the destructor returns.
TEST(SwapAsyncTest, DestroyedWithOperationsInFlight) {
  ScratchDir d;
  auto s = SwapSpace::Open(SpaceOptions(d.path()));
  ASSERT_TRUE(s.ok());
  constexpr int kOps = 12;
  std::vector<SwapHandle> handles;
  HostBuffer buf = MustAllocate(kOps * 2 * kBlock);
  std::vector<std::byte> data(2 * kBlock);
  for (int i = 0; i < kOps / 2; ++i) {
    auto h = (*s)->Write(i, data);
    ASSERT_TRUE(h.ok());
    handles.push_back(std::move(*h));
  }
  for (int i = kOps / 2; i < kOps; ++i) {
    auto h = (*s)->Allocate(i, 2 * kBlock);
    ASSERT_TRUE(h.ok());
    handles.push_back(std::move(*h));
  }
  std::vector<std::atomic<int>> calls(kOps);
  for (int i = 0; i < kOps; ++i) {
    auto span = buf.span().subspan(i * 2 * kBlock, 2 * kBlock);
    auto cb = [&, i](Status st) {
      EXPECT_TRUE(st.ok()) << st.ToString();
      calls[i].fetch_add(1);
    };
    ASSERT_TRUE((i < kOps / 2 ? (*s)->ReadAsync(handles[i], 0, 2, span,
                                                IoPriority::kUrgent, cb)
                              : (*s)->WriteAsync(handles[i], 0, 2, span,
                                                 IoPriority::kBackground, cb))
                    .ok());
  }
  s->reset();
  for (int i = 0; i < kOps; ++i) EXPECT_EQ(calls[i].load(), 1) << i;
}

}  // namespace
}  // namespace strata
