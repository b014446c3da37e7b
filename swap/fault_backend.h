// FaultInjectingBackend: a BackendWrapper that makes chosen operations fail
// or come back short, for the fault matrix (docs/reliability.md). The plan is
// shared with the test, which keeps changing it while the engine owns the
// backend.
//
// A rule matches operations of one kind (or both); the nth matching operation
// and the count-1 after it fault. count = kForever makes a persistent fault;
// count = 1 a transient one.
//
// Thread-safe: FaultPlan is guarded by its own mutex.
#ifndef STRATA_SWAP_FAULT_BACKEND_H_
#define STRATA_SWAP_FAULT_BACKEND_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "swap/backend.h"
#include "util/mutex.h"

namespace strata::swap {

struct FaultRule {
  static constexpr uint64_t kForever = UINT64_MAX;
  enum class Kind {
    kError,  // the operation returns -err without reaching the target
    kShort,  // the operation transfers at most short_bytes
  };
  Kind kind = Kind::kError;
  std::optional<IoOp> op;  // nullopt: reads and writes
  int err = 5;             // EIO
  uint64_t nth = 1;        // 1-based index of the first matching op to fault
  uint64_t count = 1;      // how many consecutive matching ops fault
  uint32_t short_bytes = 4096;
};

class FaultPlan {
 public:
  void Add(const FaultRule& rule) STRATA_EXCLUDES(mu_);
  void Clear() STRATA_EXCLUDES(mu_);
  // Errno returned by open() of a file with O_DIRECT (0: none).
  void FailDirectOpen(int err) STRATA_EXCLUDES(mu_);
  void FailFallocate(int err) STRATA_EXCLUDES(mu_);
  void FailFsync(int err) STRATA_EXCLUDES(mu_);

  // Faults injected so far.
  uint64_t injected() const STRATA_EXCLUDES(mu_);

  // Used by the backend. Returns the rule that faults `op`, if any.
  std::optional<FaultRule> Match(IoOp op) STRATA_EXCLUDES(mu_);
  int direct_open_errno() const STRATA_EXCLUDES(mu_);
  int fallocate_errno() const STRATA_EXCLUDES(mu_);
  int fsync_errno() const STRATA_EXCLUDES(mu_);

 private:
  struct Entry {
    FaultRule rule;
    uint64_t seen = 0;  // matching ops seen
  };
  mutable Mutex mu_;
  std::vector<Entry> rules_ STRATA_GUARDED_BY(mu_);
  uint64_t injected_ STRATA_GUARDED_BY(mu_) = 0;
  int direct_open_errno_ STRATA_GUARDED_BY(mu_) = 0;
  int fallocate_errno_ STRATA_GUARDED_BY(mu_) = 0;
  int fsync_errno_ STRATA_GUARDED_BY(mu_) = 0;
};

class FaultInjectingBackend final : public BackendWrapper {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> target,
                        std::shared_ptr<FaultPlan> plan)
      : BackendWrapper(std::move(target)), plan_(std::move(plan)) {}

  int OpenFile(const std::string& path, int flags, mode_t mode) override;
  int Fallocate(int fd, uint64_t bytes) override;
  int Fsync(int fd) override;
  StatusOr<size_t> Submit(std::span<const RawOp> ops) override;
  StatusOr<size_t> Wait(std::span<RawResult> out, size_t min) override;

 private:
  std::shared_ptr<FaultPlan> plan_;
  std::deque<RawResult> injected_;  // results of faulted ops
  size_t target_in_flight_ = 0;
};

// An engine over `backend` (e.g. NewMemoryBackend or a real one) wrapped with
// fault injection driven by `plan`.
std::unique_ptr<IoEngine> NewFaultInjectingEngine(
    std::unique_ptr<Backend> backend, std::shared_ptr<FaultPlan> plan,
    const IoEngineOptions& options);

}  // namespace strata::swap

#endif  // STRATA_SWAP_FAULT_BACKEND_H_
