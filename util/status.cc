#include "strata/status.h"

#include <cerrno>
#include <cstring>
#include <string>

namespace strata {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kOutOfMemory:
      return "OutOfMemory";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kNotSupported:
      return "NotSupported";
    case StatusCode::kBusy:
      return "Busy";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string_view message, int sys_errno) {
  if (code != StatusCode::kOk) {
    state_ =
        std::make_unique<State>(State{code, sys_errno, std::string(message)});
  }
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) {
    state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  }
  return *this;
}

Status Status::FromErrno(int err, std::string_view context) {
  StatusCode code;
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      code = StatusCode::kNoSpace;
      break;
    case ENOMEM:
      code = StatusCode::kOutOfMemory;
      break;
    case EBUSY:
    case EWOULDBLOCK:
      code = StatusCode::kBusy;
      break;
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EEXIST:
      code = StatusCode::kAlreadyExists;
      break;
    case EPERM:
    case EACCES:
      code = StatusCode::kPermissionDenied;
      break;
    case EINVAL:
      code = StatusCode::kInvalidArgument;
      break;
    case ENOSYS:
    case EOPNOTSUPP:
      code = StatusCode::kNotSupported;
      break;
    default:
      code = StatusCode::kIoError;
      break;
  }
  std::string msg(context);
  msg += ": ";
  msg += std::strerror(err);
  msg += " (errno ";
  msg += std::to_string(err);
  msg += ")";
  return Status(code, msg, err);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(state_->code));
  s += ": ";
  s += state_->message;
  return s;
}

Status Status::WithContext(std::string_view prefix) const& {
  Status copy(*this);
  return std::move(copy).WithContext(prefix);
}

Status Status::WithContext(std::string_view prefix) && {
  if (state_) {
    std::string msg(prefix);
    msg += ": ";
    msg += state_->message;
    state_->message = std::move(msg);
  }
  return std::move(*this);
}

}  // namespace strata
