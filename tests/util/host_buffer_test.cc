#include "strata/host_buffer.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "util/host_alloc_faults.h"

namespace strata {
namespace {

TEST(HostBufferTest, ExactSizeAlignedAndWritable) {
  for (size_t bytes :
       {size_t{1}, size_t{4095}, size_t{4097}, size_t{3} << 20}) {
    auto buf = HostBuffer::Allocate(bytes);
    ASSERT_TRUE(buf.ok()) << buf.status().ToString();
    EXPECT_EQ(buf->size(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 4096, 0u);
    std::memset(buf->data(), 0xab, bytes);
    EXPECT_EQ(buf->data()[bytes - 1], std::byte{0xab});
  }
}

TEST(HostBufferTest, EmptyBufferIsValid) {
  auto buf = HostBuffer::Allocate(0);
  ASSERT_TRUE(buf.ok());
  EXPECT_TRUE(buf->empty());
  EXPECT_EQ(buf->data(), nullptr);
}

TEST(HostBufferTest, PinnedBytesAreCountedAndReturned) {
  const uint64_t before = HostBuffer::TotalPinnedBytes();
  {
    auto buf = HostBuffer::Allocate(64 << 10);
    ASSERT_TRUE(buf.ok());
    if (buf->pinned()) {
      EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before + (64 << 10));
    }
    HostBuffer moved = std::move(*buf);
    EXPECT_TRUE(buf->empty());
    EXPECT_EQ(moved.size(), size_t{64} << 10);
  }
  EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before);
}

struct CountingRegistration : HostRegistration {
  explicit CountingRegistration(int* live) : live_(live) { ++*live_; }
  ~CountingRegistration() override { --*live_; }
  int* live_;
};

TEST(HostBufferTest, RegistrationReleasedWithBuffer) {
  int live = 0;
  {
    auto buf = HostBuffer::Allocate(8192);
    ASSERT_TRUE(buf.ok());
    buf->AttachRegistration(std::make_unique<CountingRegistration>(&live));
    EXPECT_EQ(live, 1);
    HostBuffer other = std::move(*buf);
    EXPECT_EQ(live, 1);
    EXPECT_NE(other.registration(), nullptr);
  }
  EXPECT_EQ(live, 0);
}

// A device registration page-locks the range (the CUDA backend skips the
// mlock), so it counts as pinned, once, while it is attached.
TEST(HostBufferTest, RegisteredBytesCountAsPinnedOnce) {
  int live = 0;
  const uint64_t before = HostBuffer::TotalPinnedBytes();
  HostBufferOptions o;
  o.pin = false;
  {
    auto buf = HostBuffer::Allocate(5000, o);  // counted in whole pages
    ASSERT_TRUE(buf.ok());
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before);
    buf->AttachRegistration(std::make_unique<CountingRegistration>(&live));
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before + 8192);
    buf->AttachRegistration(std::make_unique<CountingRegistration>(&live));
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before + 8192);
    HostBuffer moved = std::move(*buf);
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before + 8192);
    moved.AttachRegistration(nullptr);
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before);
    moved.AttachRegistration(std::make_unique<CountingRegistration>(&live));
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before + 8192);
  }
  EXPECT_EQ(live, 0);
  EXPECT_EQ(HostBuffer::TotalPinnedBytes(), before);
}

TEST(HostBufferTest, PeakPinnedBytesHoldsTheMostSinceTheLastReset) {
  int live = 0;
  HostBuffer::ResetPeakPinnedBytes();
  const uint64_t base = HostBuffer::TotalPinnedBytes();
  EXPECT_EQ(HostBuffer::PeakPinnedBytes(), base);
  HostBufferOptions o;
  o.pin = false;
  {
    auto a = HostBuffer::Allocate(1 << 20, o);
    auto b = HostBuffer::Allocate(2 << 20, o);
    ASSERT_TRUE(a.ok() && b.ok());
    a->AttachRegistration(std::make_unique<CountingRegistration>(&live));
    b->AttachRegistration(std::make_unique<CountingRegistration>(&live));
    *a = HostBuffer();  // the peak stays where both were held
    EXPECT_EQ(HostBuffer::TotalPinnedBytes(), base + (2 << 20));
  }
  EXPECT_EQ(HostBuffer::TotalPinnedBytes(), base);
  EXPECT_EQ(HostBuffer::PeakPinnedBytes(), base + (3 << 20));
  HostBuffer::ResetPeakPinnedBytes();
  EXPECT_EQ(HostBuffer::PeakPinnedBytes(), base);
}

// Note [Colored large buffers]: equal-sized large buffers allocated one
// after another are never a multiple of 64 KiB apart, so arrays an
// optimizer updates together do not alias in the memory's banks.
TEST(HostBufferTest, SuccessiveLargeBuffersHaveDistinctColors) {
  HostBufferOptions o;
  o.pin = false;
  std::vector<HostBuffer> bufs;
  std::set<uintptr_t> colors;
  for (int k = 0; k < 16; ++k) {
    auto b = HostBuffer::Allocate(size_t{4} << 20, o);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const auto addr = reinterpret_cast<uintptr_t>(b->data());
    EXPECT_EQ(addr % 4096, 0u);
    EXPECT_EQ(b->size(), size_t{4} << 20);
    std::memset(b->data(), 0x5a, b->size());  // the whole size is usable
    colors.insert(addr / 4096 % 16);
    bufs.push_back(std::move(b).value());
  }
  EXPECT_EQ(colors.size(), 16u);
}

TEST(HostBufferTest, UnpinnedWhenNotAsked) {
  HostBufferOptions o;
  o.pin = false;
  auto buf = HostBuffer::Allocate(4096, o);
  ASSERT_TRUE(buf.ok());
  EXPECT_FALSE(buf->pinned());
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Drops CAP_IPC_LOCK from the effective set (root bypasses RLIMIT_MEMLOCK
// with it), then caps locked memory at 64 KiB.
bool LimitMemlock() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  if (syscall(SYS_capset, &hdr, data) != 0) return false;
  rlimit lim{64 << 10, 64 << 10};
  return setrlimit(RLIMIT_MEMLOCK, &lim) == 0;
}

// Row 8 of the fault matrix: page-locking refused by RLIMIT_MEMLOCK.
TEST(HostBufferTest, LowMemlockLimitContinuesUnpinnedOrFailsWhenRequired) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer runtimes intercept mlock and report success";
#endif
  const pid_t pid = fork();
  if (pid == 0) {
    if (!LimitMemlock()) _exit(77);
    auto soft = HostBuffer::Allocate(4 << 20);
    if (!soft.ok() || soft->pinned() || soft->size() != (4u << 20)) _exit(1);
    std::memset(soft->data(), 1, soft->size());  // usable
    HostBufferOptions strict;
    strict.require_pin = true;
    auto hard = HostBuffer::Allocate(4 << 20, strict);
    if (hard.ok() || hard.status().code() != StatusCode::kOutOfMemory) {
      _exit(2);
    }
    if (hard.status().ToString().find("ulimit -l") == std::string::npos) {
      _exit(3);
    }
    auto small = HostBuffer::Allocate(16 << 10);  // under the limit
    _exit(small.ok() && small->pinned() ? 0 : 4);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot drop CAP_IPC_LOCK";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// docs/reliability.md row 9 at its source: a refused host allocation is
// kOutOfMemory saying how much was asked and what the system has, leaks
// nothing, and does not poison the next allocation.
TEST(HostBufferOomTest, TransientFailureIsOutOfMemoryThenTheNextSucceeds) {
  const uint64_t pinned_before = HostBuffer::TotalPinnedBytes();
  internal::ScopedHostAllocFaults faults(1, /*persistent=*/false);
  auto a = HostBuffer::Allocate(3 << 20);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(a.status().message().find("3145728 bytes"), std::string::npos)
      << a.status().ToString();
  EXPECT_NE(a.status().message().find("available"), std::string::npos)
      << a.status().ToString();
  EXPECT_EQ(HostBuffer::TotalPinnedBytes(), pinned_before);
  auto b = HostBuffer::Allocate(3 << 20);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->size(), 3u << 20);
  EXPECT_EQ(internal::HostAllocFaults::seen(), 2u);
  EXPECT_EQ(internal::HostAllocFaults::failed(), 1u);
}

TEST(HostBufferOomTest, PersistentFailureLastsUntilDisarmed) {
  {
    internal::ScopedHostAllocFaults faults(2, /*persistent=*/true);
    auto first = HostBuffer::Allocate(4096);
    EXPECT_TRUE(first.ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(HostBuffer::Allocate(4096).status().code(),
                StatusCode::kOutOfMemory);
    }
    EXPECT_EQ(internal::HostAllocFaults::failed(), 3u);
  }
  EXPECT_TRUE(HostBuffer::Allocate(4096).ok());
  // An empty buffer maps nothing, so nothing can fail.
  internal::ScopedHostAllocFaults faults(1, /*persistent=*/true);
  EXPECT_TRUE(HostBuffer::Allocate(0).ok());
}

}  // namespace
}  // namespace strata
