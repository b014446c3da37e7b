#include "strata/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>

namespace strata {
namespace {

TEST(StatusTest, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.message().empty());
  EXPECT_EQ(sizeof(Status), sizeof(void*));
}

TEST(StatusTest, FromErrnoMapsCodesAndKeepsContext) {
  struct Case {
    int err;
    StatusCode code;
  } cases[] = {{ENOSPC, StatusCode::kNoSpace},
               {EDQUOT, StatusCode::kNoSpace},
               {ENOMEM, StatusCode::kOutOfMemory},
               {EIO, StatusCode::kIoError},
               {EWOULDBLOCK, StatusCode::kBusy},
               {ENOENT, StatusCode::kNotFound},
               {EPERM, StatusCode::kPermissionDenied},
               {EINVAL, StatusCode::kInvalidArgument},
               {ENOSYS, StatusCode::kNotSupported}};
  for (const auto& c : cases) {
    Status s = Status::FromErrno(c.err, "write /x offset 4096");
    EXPECT_EQ(s.code(), c.code) << c.err;
    EXPECT_EQ(s.sys_errno(), c.err);
    EXPECT_NE(s.ToString().find("write /x offset 4096"), std::string::npos);
    EXPECT_NE(s.ToString().find("errno " + std::to_string(c.err)),
              std::string::npos);
  }
}

TEST(StatusTest, CopyIsDeepAndContextPrefixes) {
  Status a = Status::IoError("disk");
  Status b = a;
  Status c = b.WithContext("swap-out of t0");
  EXPECT_EQ(a.message(), "disk");
  EXPECT_EQ(c.message(), "swap-out of t0: disk");
  EXPECT_EQ(c.code(), StatusCode::kIoError);
  EXPECT_TRUE(Status().WithContext("x").ok());
}

StatusOr<int> Half(int v) {
  if (v % 2) return Status::InvalidArgument("odd");
  return v / 2;
}

Status Quarter(int v, int* out) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(v));
  STRATA_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(StatusOrTest, ValueAndErrorPropagate) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Quarter(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Half(3).value_or(-1), -1);
}

struct Base {
  virtual ~Base() = default;
};
struct Derived : Base {};

TEST(StatusOrTest, ConvertsMoveOnlyValues) {
  StatusOr<std::unique_ptr<Base>> p = std::make_unique<Derived>();
  ASSERT_TRUE(p.ok());
  std::unique_ptr<Base> owned = std::move(p).value();
  EXPECT_NE(owned, nullptr);
}

Status FailIf(bool fail) { return fail ? Status::Busy("held") : Status::Ok(); }

Status Chain(bool fail) {
  STRATA_RETURN_IF_ERROR(FailIf(fail));
  return Status::Aborted("reached the end");
}

TEST(StatusTest, ReturnIfErrorStopsEarly) {
  EXPECT_EQ(Chain(true).code(), StatusCode::kBusy);
  EXPECT_EQ(Chain(false).code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace strata
