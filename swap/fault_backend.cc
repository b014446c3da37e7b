#include "swap/fault_backend.h"

#include <fcntl.h>

#include <algorithm>

namespace strata::swap {

void FaultPlan::Add(const FaultRule& rule) {
  MutexLock lock(&mu_);
  rules_.push_back({rule, 0});
}

void FaultPlan::Clear() {
  MutexLock lock(&mu_);
  rules_.clear();
  direct_open_errno_ = fallocate_errno_ = fsync_errno_ = 0;
}

void FaultPlan::FailDirectOpen(int err) {
  MutexLock lock(&mu_);
  direct_open_errno_ = err;
}

void FaultPlan::FailFallocate(int err) {
  MutexLock lock(&mu_);
  fallocate_errno_ = err;
}

void FaultPlan::FailFsync(int err) {
  MutexLock lock(&mu_);
  fsync_errno_ = err;
}

uint64_t FaultPlan::injected() const {
  MutexLock lock(&mu_);
  return injected_;
}

std::optional<FaultRule> FaultPlan::Match(IoOp op) {
  MutexLock lock(&mu_);
  std::optional<FaultRule> hit;
  for (Entry& e : rules_) {
    if (e.rule.op && *e.rule.op != op) continue;
    const uint64_t index = ++e.seen;  // 1-based
    const bool in_window =
        index >= e.rule.nth && (e.rule.count == FaultRule::kForever ||
                                index - e.rule.nth < e.rule.count);
    if (in_window && !hit) hit = e.rule;
  }
  if (hit) ++injected_;
  return hit;
}

int FaultPlan::direct_open_errno() const {
  MutexLock lock(&mu_);
  return direct_open_errno_;
}

int FaultPlan::fallocate_errno() const {
  MutexLock lock(&mu_);
  return fallocate_errno_;
}

int FaultPlan::fsync_errno() const {
  MutexLock lock(&mu_);
  return fsync_errno_;
}

int FaultInjectingBackend::OpenFile(const std::string& path, int flags,
                                    mode_t mode) {
  if ((flags & O_DIRECT) && plan_->direct_open_errno() != 0) {
    return -plan_->direct_open_errno();
  }
  return BackendWrapper::OpenFile(path, flags, mode);
}

int FaultInjectingBackend::Fallocate(int fd, uint64_t bytes) {
  if (int err = plan_->fallocate_errno(); err != 0) return -err;
  return BackendWrapper::Fallocate(fd, bytes);
}

int FaultInjectingBackend::Fsync(int fd) {
  if (int err = plan_->fsync_errno(); err != 0) return -err;
  return BackendWrapper::Fsync(fd);
}

StatusOr<size_t> FaultInjectingBackend::Submit(std::span<const RawOp> ops) {
  // One op at a time, so that faulted ops never split a forwarded batch.
  size_t accepted = 0;
  for (const RawOp& op : ops) {
    std::optional<FaultRule> rule = plan_->Match(op.op);
    if (rule && rule->kind == FaultRule::Kind::kError) {
      injected_.push_back({op.slot, -static_cast<int64_t>(rule->err)});
      SignalReady();
      ++accepted;
      continue;
    }
    RawOp fwd = op;
    if (rule && rule->kind == FaultRule::Kind::kShort) {
      fwd.len = std::min(fwd.len, rule->short_bytes);
    }
    STRATA_ASSIGN_OR_RETURN(size_t n, BackendWrapper::Submit({&fwd, 1}));
    if (n == 0) break;
    ++target_in_flight_;
    ++accepted;
  }
  return accepted;
}

StatusOr<size_t> FaultInjectingBackend::Wait(std::span<RawResult> out,
                                             size_t min) {
  size_t got = DrainResults(injected_, out);
  if (target_in_flight_ > 0 && got < out.size()) {
    const size_t need = got >= min ? 0 : std::min(min - got, target_in_flight_);
    STRATA_ASSIGN_OR_RETURN(size_t n,
                            BackendWrapper::Wait(out.subspan(got), need));
    target_in_flight_ -= n;
    got += n;
  }
  return got;
}

std::unique_ptr<IoEngine> NewFaultInjectingEngine(
    std::unique_ptr<Backend> backend, std::shared_ptr<FaultPlan> plan,
    const IoEngineOptions& options) {
  return NewIoEngineWithBackend(std::make_unique<FaultInjectingBackend>(
                                    std::move(backend), std::move(plan)),
                                options);
}

}  // namespace strata::swap
