// AsyncIo over the engine: two priority queues, a completion thread that
// admits at most queue_depth requests into the engine (urgent first), sleeps
// in poll() on the backend's eventfd (which submitters also write to wake it),
// and runs each batch's callback when its last request finishes. The engine
// itself, with its one classifier of raw results, is used unchanged; only
// its non-blocking Poll is new.
#include "strata/async_io.h"

#include <poll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "swap/backend.h"
#include "util/log.h"
#include "util/mutex.h"

namespace strata {

struct IoTicket::State {
  Mutex mu;
  CondVar cv;
  bool done STRATA_GUARDED_BY(mu) = false;
  Status status STRATA_GUARDED_BY(mu);
};

IoTicket::IoTicket() : state_(std::make_shared<State>()) {}

// Signals under the lock: a waiter that holds the only other reference may
// destroy the state as soon as the lock is free.
void IoTicket::Set(Status status) const {
  MutexLock lock(&state_->mu);
  if (state_->done) return;
  state_->done = true;
  state_->status = std::move(status);
  state_->cv.SignalAll();
}

Status IoTicket::Wait() const {
  MutexLock lock(&state_->mu);
  while (!state_->done) state_->cv.Wait(&state_->mu);
  return state_->status;
}

bool IoTicket::ready() const {
  MutexLock lock(&state_->mu);
  return state_->done;
}

std::function<void(Status)> IoTicket::Setter() const {
  return [state = *this](Status s) { state.Set(std::move(s)); };
}

Status FirstError(std::span<const IoCompletion> completions) {
  for (const IoCompletion& c : completions) {
    if (!c.status.ok()) return c.status;
  }
  return Status::Ok();
}

IoBufferRegistration::IoBufferRegistration(
    IoBufferRegistration&& other) noexcept
    : io_(std::exchange(other.io_, nullptr)),
      index_(std::exchange(other.index_, -1)) {}

IoBufferRegistration& IoBufferRegistration::operator=(
    IoBufferRegistration&& other) noexcept {
  if (this != &other) {
    if (io_ != nullptr && index_ >= 0) io_->RemoveBuffer(index_);
    io_ = std::exchange(other.io_, nullptr);
    index_ = std::exchange(other.index_, -1);
  }
  return *this;
}

IoBufferRegistration::~IoBufferRegistration() {
  if (io_ != nullptr && index_ >= 0) io_->RemoveBuffer(index_);
}

IoTicket AsyncIo::Submit(std::span<const IoRequest> batch,
                         IoPriority priority) {
  IoTicket ticket;
  Status s = Submit(batch, priority, [ticket](std::span<IoCompletion> c) {
    ticket.Set(FirstError(c));
  });
  if (!s.ok()) ticket.Set(std::move(s));
  return ticket;
}

Status AsyncIo::SubmitGroups(std::span<const IoRequest> batch, size_t group,
                             IoPriority priority, IoGroupCallback done) {
  if (group == 0) {
    return Status::InvalidArgument("SubmitGroups with groups of 0 requests");
  }
  return Submit(batch, priority,
                [group, done = std::move(done)](std::span<IoCompletion> c) {
                  size_t g = 0;
                  do {
                    const size_t at = g * group;
                    done(g, c.subspan(at, std::min(group, c.size() - at)));
                    ++g;
                  } while (g * group < c.size());
                });
}

StatusOr<IoBufferRegistration> AsyncIo::RegisterBuffer(
    std::span<std::byte> buf) {
  if (buf.empty()) {
    return Status::InvalidArgument("RegisterBuffer of an empty buffer");
  }
  return IoBufferRegistration(this, AddBuffer(buf));
}

namespace swap {
namespace {

class AsyncIoImpl final : public AsyncIo {
 public:
  AsyncIoImpl(std::unique_ptr<IoEngine> owner, EngineCore* engine,
              uint32_t depth)
      : owner_(std::move(owner)),
        engine_(engine),
        depth_(depth),
        event_fd_(engine->completion_fd()),
        slots_(depth) {
    for (uint32_t i = depth; i-- > 0;) free_slots_.push_back(i);
    thread_ = std::thread([this] { Run(); });
  }

  ~AsyncIoImpl() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    SignalEventFd(event_fd_);
    thread_.join();
  }

  using AsyncIo::Submit;

  Status Submit(std::span<const IoRequest> batch, IoPriority priority,
                IoCallback done) override {
    return SubmitGroups(batch, std::max<size_t>(batch.size(), 1), priority,
                        [done = std::move(done)](
                            size_t, std::span<IoCompletion> c) { done(c); });
  }

  Status SubmitGroups(std::span<const IoRequest> batch, size_t group,
                      IoPriority priority, IoGroupCallback done) override {
    if (group == 0) {
      return Status::InvalidArgument("SubmitGroups with groups of 0 requests");
    }
    {
      MutexLock engine_lock(&engine_mu_);
      for (const IoRequest& r : batch) {
        STRATA_RETURN_IF_ERROR(engine_->Validate(r));
      }
    }
    // One Batch per group, sharing the caller's callback.
    auto shared = std::make_shared<IoGroupCallback>(std::move(done));
    const size_t groups =
        std::max<size_t>((batch.size() + group - 1) / group, 1);
    std::vector<Batch*> made(groups);
    for (size_t g = 0; g < groups; ++g) {
      const size_t n =
          std::min(group, batch.size() - std::min(batch.size(), g * group));
      made[g] = new Batch;
      made[g]->done = [shared, g](std::span<IoCompletion> c) {
        (*shared)(g, c);
      };
      made[g]->results.resize(n);
      made[g]->remaining = n;
    }
    {
      MutexLock lock(&mu_);
      if (stopping_) {
        for (Batch* b : made) delete b;
        return Status::FailedPrecondition(
            "I/O submitted while the AsyncIo shuts down");
      }
      if (batch.empty()) {
        empty_.push_back(made[0]);
      } else {
        auto& q = queues_[priority == IoPriority::kUrgent ? 0 : 1];
        for (size_t i = 0; i < batch.size(); ++i) {
          q.push_back(
              {batch[i], made[i / group], static_cast<uint32_t>(i % group)});
        }
      }
    }
    SignalEventFd(event_fd_);
    return Status::Ok();
  }

  StatusOr<FileId> Open(const std::string& path,
                        const OpenOptions& options) override {
    MutexLock lock(&engine_mu_);
    return engine_->Open(path, options);
  }
  Status Close(FileId file) override {
    MutexLock lock(&engine_mu_);
    return engine_->Close(file);
  }
  Status Allocate(FileId file, uint64_t bytes) override {
    MutexLock lock(&engine_mu_);
    return engine_->Allocate(file, bytes);
  }
  Status Sync(FileId file) override {
    MutexLock lock(&engine_mu_);
    return engine_->Sync(file);
  }
  size_t alignment(FileId file) const override {
    MutexLock lock(&engine_mu_);
    return engine_->alignment(file);
  }
  bool direct(FileId file) const override {
    MutexLock lock(&engine_mu_);
    return engine_->direct(file);
  }
  // The engine's identity never changes after construction.
  std::string_view name() const override {
    return IoBackendName(owner_->backend());
  }
  IoBackend backend() const override { return owner_->backend(); }
  std::string_view fallback_reason() const override {
    return owner_->fallback_reason();
  }
  uint32_t queue_depth() const override { return depth_; }
  bool OnCompletionThread() const override {
    return std::this_thread::get_id() ==
           thread_id_.load(std::memory_order_acquire);
  }

 private:
  int AddBuffer(std::span<std::byte> buf) override {
    MutexLock lock(&engine_mu_);
    return engine_->AddBuffer(buf);
  }
  void RemoveBuffer(int index) override {
    MutexLock lock(&engine_mu_);
    engine_->RemoveBuffer(index);
  }

  struct Batch {
    IoCallback done;
    std::vector<IoCompletion> results;
    size_t remaining = 0;
  };
  struct Queued {
    IoRequest req;
    Batch* batch;
    uint32_t index;
  };
  struct InFlight {
    Batch* batch = nullptr;
    uint32_t index = 0;
    uint64_t tag = 0;  // the caller's
  };

  // Records one request's result; runs the batch's callback after its last.
  static void Deliver(Batch* b, uint32_t index, IoCompletion c) {
    b->results[index] = std::move(c);
    if (--b->remaining == 0) {
      if (b->done) b->done(b->results);
      delete b;
    }
  }

  static IoCompletion Failed(uint64_t tag, Status status) {
    IoCompletion c;
    c.tag = tag;
    c.status = std::move(status);
    return c;
  }

  // The completion thread. Each turn reaps what the engine has finished,
  // refills the engine from the queues with the slots that freed, and only
  // then runs callbacks: a callback that takes time (the swap space verifies
  // a block's checksum in its own) never leaves the device idle.
  void Run() STRATA_EXCLUDES(mu_, engine_mu_) {
    thread_id_.store(std::this_thread::get_id(), std::memory_order_release);
    std::vector<Queued> admit;
    std::vector<Queued> cancelled;
    std::vector<Batch*> empty;
    std::vector<IoRequest> reqs;
    std::vector<IoCompletion> out(depth_);
    std::vector<InFlight> finished(depth_);
    for (;;) {
      uint64_t drained = 0;
      (void)!::eventfd_read(event_fd_, &drained);
      size_t n = 0;
      if (in_engine_ > 0) {
        MutexLock lock(&engine_mu_);
        auto polled = engine_->Poll(out);
        if (polled.ok()) {
          n = *polled;
        } else {
          STRATA_LOG_ONCE(ERROR, "strata io completion thread: {}",
                          polled.status().ToString());
        }
      }
      for (size_t i = 0; i < n; ++i) finished[i] = Release(out[i].tag);
      bool stop = false;
      {
        MutexLock lock(&mu_);
        stop = stopping_;
        empty.swap(empty_);
        for (auto& q : queues_) {
          while (!q.empty() && (stop || in_engine_ + admit.size() < depth_)) {
            (stop ? cancelled : admit).push_back(q.front());
            q.pop_front();
          }
        }
      }
      const bool progress =
          !admit.empty() || !cancelled.empty() || !empty.empty();
      if (!admit.empty()) SubmitToEngine(admit, reqs);
      admit.clear();
      for (size_t i = 0; i < n; ++i) {
        out[i].tag = finished[i].tag;
        Deliver(finished[i].batch, finished[i].index, std::move(out[i]));
      }
      for (Batch* b : empty) {
        if (b->done) b->done({});
        delete b;
      }
      empty.clear();
      for (Queued& q : cancelled) {
        Deliver(q.batch, q.index,
                Failed(q.req.tag,
                       Status::Aborted("request cancelled: the AsyncIo shut "
                                       "down before it was submitted")));
      }
      cancelled.clear();
      if (progress || n > 0) continue;
      if (stop && in_engine_ == 0) {
        MutexLock lock(&mu_);
        if (queues_[0].empty() && queues_[1].empty() && empty_.empty()) break;
        continue;
      }
      pollfd p{event_fd_, POLLIN, 0};
      while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
      }
    }
  }

  // Hands admitted requests to the engine under in-flight slots. A batch the
  // engine refuses (a file closed since Submit validated it) is retried one
  // request at a time, so that only the refused ones fail.
  void SubmitToEngine(std::vector<Queued>& admit, std::vector<IoRequest>& reqs)
      STRATA_EXCLUDES(engine_mu_) {
    reqs.clear();
    std::vector<uint32_t> slots;
    for (Queued& q : admit) {
      const uint32_t slot = free_slots_.back();
      free_slots_.pop_back();
      slots_[slot] = {q.batch, q.index, q.req.tag};
      IoRequest r = q.req;
      r.tag = slot;
      reqs.push_back(r);
      slots.push_back(slot);
      ++in_engine_;
    }
    Status s;
    {
      MutexLock lock(&engine_mu_);
      s = engine_->Submit(reqs);
    }
    if (s.ok()) return;
    for (size_t i = 0; i < reqs.size(); ++i) {
      Status one;
      {
        MutexLock lock(&engine_mu_);
        one = engine_->Submit({&reqs[i], 1});
      }
      if (one.ok()) continue;
      const InFlight f = Release(slots[i]);
      Deliver(f.batch, f.index, Failed(f.tag, std::move(one)));
    }
  }

  InFlight Release(uint64_t slot) {
    free_slots_.push_back(static_cast<uint32_t>(slot));
    --in_engine_;
    return slots_[slot];
  }

  std::unique_ptr<IoEngine> owner_;
  mutable Mutex engine_mu_;  // serializes every call into the engine
  EngineCore* const engine_ STRATA_PT_GUARDED_BY(engine_mu_);
  const uint32_t depth_;
  const int event_fd_;  // the backend's; owned by the engine

  Mutex mu_;
  std::deque<Queued> queues_[2] STRATA_GUARDED_BY(mu_);  // urgent, background
  std::vector<Batch*> empty_ STRATA_GUARDED_BY(mu_);     // empty batches
  bool stopping_ STRATA_GUARDED_BY(mu_) = false;

  // Completion thread only.
  std::vector<InFlight> slots_;
  std::vector<uint32_t> free_slots_;
  size_t in_engine_ = 0;

  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;
};

}  // namespace
}  // namespace swap

StatusOr<std::unique_ptr<AsyncIo>> AsyncIo::Create(
    std::unique_ptr<IoEngine> engine) {
  auto* core = dynamic_cast<swap::EngineCore*>(engine.get());
  if (core == nullptr) {
    return Status::InvalidArgument(
        "AsyncIo needs an engine made by NewIoEngine");
  }
  if (core->in_flight() != 0) {
    return Status::FailedPrecondition(
        "AsyncIo over an engine with requests in flight");
  }
  if (core->completion_fd() < 0) {
    return Status::Unavailable(
        "AsyncIo: the I/O backend has no completion eventfd (eventfd failed)");
  }
  // The engine's queue depth: the backend's capacity, which Submit never
  // exceeds, so the priority queues stay ahead of the engine's own.
  const uint32_t depth = core->capacity();
  return std::unique_ptr<AsyncIo>(
      new swap::AsyncIoImpl(std::move(engine), core, depth));
}

StatusOr<std::unique_ptr<AsyncIo>> AsyncIo::Create(
    const IoEngineOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto engine, NewIoEngine(options));
  return Create(std::move(engine));
}

}  // namespace strata
