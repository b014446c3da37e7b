// NewDevice's choice (options, STRATA_DEVICE) and NewCudaDevice's behaviour
// where CUDA does not work (docs/reliability.md row 11).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <optional>
#include <string>

#include "strata/device.h"

namespace strata {
namespace {

// Sets STRATA_DEVICE for one test and restores it.
class ScopedDeviceEnv {
 public:
  explicit ScopedDeviceEnv(const char* value) {
    if (const char* old = getenv("STRATA_DEVICE")) old_ = old;
    if (value) {
      setenv("STRATA_DEVICE", value, 1);
    } else {
      unsetenv("STRATA_DEVICE");
    }
  }
  ~ScopedDeviceEnv() {
    if (old_) {
      setenv("STRATA_DEVICE", old_->c_str(), 1);
    } else {
      unsetenv("STRATA_DEVICE");
    }
  }

 private:
  std::optional<std::string> old_;
};

// A small budget: the default takes all free GPU memory but a reserve, which
// would starve the next device made here, or another test process on the
// same GPU.
DeviceOptions Small() {
  DeviceOptions o;
  o.memory_budget_bytes = 16 << 20;
  return o;
}

// Whether this machine has a working GPU decides what auto and cuda give.
// Asked before a test makes its own device.
bool CudaWorks() { return NewCudaDevice(Small()).ok(); }

TEST(NewCudaDeviceTest, FailsWithAReasonOrGivesACudaDevice) {
  auto d = NewCudaDevice(Small());
  if (d.ok()) {
    EXPECT_EQ((*d)->kind(), DeviceKind::kCuda);
    EXPECT_EQ((*d)->name().rfind("cuda:0", 0), 0u) << (*d)->name();
    return;
  }
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable)
      << d.status().ToString();
  EXPECT_FALSE(d.status().message().empty());
  // Stable across calls, and nothing was left half-initialized.
  auto again = NewCudaDevice(Small());
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().ToString(), d.status().ToString());
}

TEST(NewCudaDeviceTest, BadOrdinalIsUnavailable) {
  DeviceOptions o;
  o.cuda_ordinal = 1000;
  o.memory_budget_bytes = 16 << 20;
  auto d = NewCudaDevice(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
}

TEST(NewDeviceTest, EnvironmentHostGivesHost) {
  ScopedDeviceEnv env("host");
  std::string why;
  auto d = NewDevice({}, &why);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->kind(), DeviceKind::kHostEmulated);
  EXPECT_NE(why.find("STRATA_DEVICE=host"), std::string::npos) << why;
}

TEST(NewDeviceTest, AutoTakesCudaWhenItWorksElseSaysWhyNot) {
  ScopedDeviceEnv env(nullptr);
  const bool cuda = CudaWorks();
  std::string why;
  auto d = NewDevice(Small(), &why);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  if (cuda) {
    EXPECT_EQ((*d)->kind(), DeviceKind::kCuda);
  } else {
    EXPECT_EQ((*d)->kind(), DeviceKind::kHostEmulated);
    EXPECT_NE(why.find("because CUDA is unavailable: "), std::string::npos)
        << why;
    EXPECT_NE(why.find(std::string(NewCudaDevice(Small()).status().message())),
              std::string::npos)
        << why;
  }
}

TEST(NewDeviceTest, EnvironmentCudaFailsInsteadOfFallingBack) {
  ScopedDeviceEnv env("cuda");
  const bool cuda = CudaWorks();
  auto d = NewDevice(Small());
  if (cuda) {
    ASSERT_TRUE(d.ok());
    EXPECT_EQ((*d)->kind(), DeviceKind::kCuda);
  } else {
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(d.status().message().find("STRATA_DEVICE=cuda"),
              std::string::npos)
        << d.status().ToString();
  }
}

TEST(NewDeviceTest, BadEnvironmentValueIsAnError) {
  ScopedDeviceEnv env("tpu");
  auto d = NewDevice({});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("STRATA_DEVICE='tpu'"),
            std::string::npos);
}

TEST(NewDeviceTest, ExplicitOptionWinsOverEnvironment) {
  ScopedDeviceEnv env("cuda");
  DeviceOptions o;
  o.choice = DeviceChoice::kHostEmulated;
  std::string why;
  auto d = NewDevice(o, &why);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->kind(), DeviceKind::kHostEmulated);
  EXPECT_NE(why.find("DeviceOptions::choice"), std::string::npos) << why;
}

}  // namespace
}  // namespace strata
