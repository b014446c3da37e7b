#include "gpu/host_work.h"

#include <deque>
#include <utility>

#include "gpu/host_func.h"

namespace strata::internal {

// Work handed over by host functions, taken by the worker. Shared with the
// host functions still queued on streams, which may fire after the runner
// has stopped. Thread-safe.
class HostWorkRunner::Queue {
 public:
  struct Item {
    HostFunction fn;
    std::shared_ptr<HostEvent> done;  // signalled when fn has returned
  };

  // False once stopped: the item is dropped, and destroying its event
  // abandons it, which releases the stream.
  bool Push(Item item) STRATA_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (stopped_) return false;
      items_.push_back(std::move(item));
    }
    cv_.Signal();
    return true;
  }

  // Blocks until an item is there (true) or the queue is stopped and
  // drained (false).
  bool Pop(Item* item) STRATA_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (!stopped_ && items_.empty()) cv_.Wait(&mu_);
    if (items_.empty()) return false;
    *item = std::move(items_.front());
    items_.pop_front();
    return true;
  }

  void Stop() STRATA_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      stopped_ = true;
    }
    cv_.SignalAll();
  }

 private:
  Mutex mu_;
  CondVar cv_;  // items_ or stopped_ changed
  std::deque<Item> items_ STRATA_GUARDED_BY(mu_);
  bool stopped_ STRATA_GUARDED_BY(mu_) = false;
};

HostWorkRunner::HostWorkRunner(Device* device)
    : device_(device), queue_(std::make_shared<Queue>()) {}

HostWorkRunner::~HostWorkRunner() {
  queue_->Stop();
  std::thread worker;
  {
    MutexLock lock(&mu_);
    worker = std::move(worker_);
  }
  if (worker.joinable()) worker.join();
}

Status HostWorkRunner::Launch(Stream& stream, HostFunction fn) {
  if (!fn) return Status::InvalidArgument("LaunchHostWork: empty function");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<HostEvent> event,
                          device_->NewHostEvent());
  // Shared: the worker may signal and drop it before WaitHostEvent below
  // has read it (the wait then enqueues nothing).
  std::shared_ptr<HostEvent> done(std::move(event));
  {
    MutexLock lock(&mu_);
    if (!worker_.joinable()) {
      worker_ = std::thread([queue = queue_] {
        Queue::Item item;
        while (queue->Pop(&item)) {
          RunHostFunction(item.fn);
          item.fn = nullptr;  // its captures go before the stream moves on
          item.done->Signal(1);
          item = {};
        }
      });
    }
  }
  // The host function only moves the item into the queue: it returns at
  // once, as CUDA asks.
  STRATA_RETURN_IF_ERROR(device_->LaunchHostFunc(
      stream,
      [queue = queue_, item = Queue::Item{std::move(fn), done}]() mutable {
        (void)queue->Push(std::move(item));
      }));
  return device_->WaitHostEvent(stream, *done, 1);
}

}  // namespace strata::internal
