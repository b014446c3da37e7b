// Status and StatusOr<T>: how every strata API reports failure. No exception
// crosses the API. A successful Status holds no allocation, so returning OK
// costs a null pointer.
//
// errno, io_uring/libaio results, cudaError_t and ncclResult_t are converted
// once, at the boundary where they are produced, with the context a user needs
// to act (file, offset, bytes, what was asked and what was free).
//
// Thread-compatible: a Status is a value; distinct objects may be used from
// distinct threads.
#ifndef STRATA_STATUS_H_
#define STRATA_STATUS_H_

#include <cassert>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "strata/export.h"

namespace strata {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong
  kNotFound,            // a named thing does not exist
  kAlreadyExists,       // a named thing exists already
  kOutOfMemory,         // host or device memory (or its budget) is exhausted
  kNoSpace,             // a filesystem is full (ENOSPC, EDQUOT)
  kIoError,             // a read or write failed (EIO and the like)
  kCorruption,          // data read back is not what was written
  kUnavailable,         // a backend cannot be used here (no GPU, no io_uring)
  kNotSupported,        // the operation is not implemented by this backend
  kBusy,                // a resource is held by someone else (a lock)
  kPermissionDenied,    // EPERM, EACCES
  kFailedPrecondition,  // the object is not in a state that allows this
  kOutOfRange,          // an offset or index past an end
  kAborted,             // the operation was abandoned (e.g. step skipped)
  kInternal,            // a bug in strata
};

// Returns a short stable name such as "IoError".
STRATA_EXPORT std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] STRATA_EXPORT Status final {
 public:
  Status() noexcept = default;  // OK
  Status(StatusCode code, std::string_view message, int sys_errno = 0);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string_view msg) {
    return Status(StatusCode::kInvalidArgument, msg);
  }
  static Status NotFound(std::string_view msg) {
    return Status(StatusCode::kNotFound, msg);
  }
  static Status AlreadyExists(std::string_view msg) {
    return Status(StatusCode::kAlreadyExists, msg);
  }
  static Status OutOfMemory(std::string_view msg) {
    return Status(StatusCode::kOutOfMemory, msg);
  }
  static Status NoSpace(std::string_view msg) {
    return Status(StatusCode::kNoSpace, msg);
  }
  static Status IoError(std::string_view msg) {
    return Status(StatusCode::kIoError, msg);
  }
  static Status Corruption(std::string_view msg) {
    return Status(StatusCode::kCorruption, msg);
  }
  static Status Unavailable(std::string_view msg) {
    return Status(StatusCode::kUnavailable, msg);
  }
  static Status NotSupported(std::string_view msg) {
    return Status(StatusCode::kNotSupported, msg);
  }
  static Status Busy(std::string_view msg) {
    return Status(StatusCode::kBusy, msg);
  }
  static Status FailedPrecondition(std::string_view msg) {
    return Status(StatusCode::kFailedPrecondition, msg);
  }
  static Status OutOfRange(std::string_view msg) {
    return Status(StatusCode::kOutOfRange, msg);
  }
  static Status Aborted(std::string_view msg) {
    return Status(StatusCode::kAborted, msg);
  }
  static Status Internal(std::string_view msg) {
    return Status(StatusCode::kInternal, msg);
  }
  // Maps an errno value to the closest code and appends strerror:
  // "<context>: <strerror> (errno N)". ENOSPC/EDQUOT -> kNoSpace,
  // ENOMEM -> kOutOfMemory, EBUSY/EWOULDBLOCK -> kBusy, ENOENT -> kNotFound,
  // EEXIST -> kAlreadyExists, EPERM/EACCES -> kPermissionDenied,
  // EINVAL -> kInvalidArgument, ENOSYS/EOPNOTSUPP -> kNotSupported,
  // anything else -> kIoError.
  static Status FromErrno(int err, std::string_view context);

  bool ok() const noexcept { return state_ == nullptr; }
  StatusCode code() const noexcept {
    return state_ ? state_->code : StatusCode::kOk;
  }
  // The errno this status came from, or 0.
  int sys_errno() const noexcept { return state_ ? state_->sys_errno : 0; }
  std::string_view message() const noexcept {
    return state_ ? std::string_view(state_->message) : std::string_view();
  }
  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithContext(std::string_view prefix) const&;
  Status WithContext(std::string_view prefix) &&;

  // Explicitly drops a status whose failure is acceptable at the call site.
  void IgnoreError() const noexcept {}

 private:
  struct State {
    StatusCode code;
    int sys_errno;
    std::string message;
  };
  std::unique_ptr<State> state_;  // null means OK
};

inline bool operator==(const Status& a, StatusCode c) { return a.code() == c; }

// Holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr final {
 public:
  using value_type = T;

  // A non-OK status. Passing OK is a bug; it becomes kInternal.
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "StatusOr built from an OK Status");
    if (status_.ok()) {
      status_ = Status::Internal("StatusOr constructed from OK status");
    }
  }
  template <typename U = T,
            typename = std::enable_if_t<
                std::is_constructible_v<T, U&&> &&
                !std::is_same_v<std::remove_cvref_t<U>, Status> &&
                !std::is_same_v<std::remove_cvref_t<U>, StatusOr<T>>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT

  StatusOr(const StatusOr&) = default;
  StatusOr& operator=(const StatusOr&) = default;
  StatusOr(StatusOr&&) noexcept = default;
  StatusOr& operator=(StatusOr&&) noexcept = default;

  bool ok() const noexcept { return status_.ok(); }
  const Status& status() const& noexcept { return status_; }
  Status status() && { return std::move(status_); }

  // REQUIRES: ok().
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? *value_ : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  Status status_;
  std::optional<T> value_;
};

namespace internal {
inline Status AsStatus(Status s) { return s; }
template <typename T>
inline Status AsStatus(StatusOr<T>&& s) {
  return std::move(s).status();
}
}  // namespace internal

}  // namespace strata

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define STRATA_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::strata::Status strata_status_ = (expr); \
    if (!strata_status_.ok()) [[unlikely]]    \
      return strata_status_;                  \
  } while (0)

// `lhs = value of expr` (a StatusOr), or returns its status.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr)                                  \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_sor_, __LINE__), lhs, \
                                expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) [[unlikely]]                         \
    return std::move(tmp).status();                   \
  lhs = std::move(tmp).value()

#endif  // STRATA_STATUS_H_
