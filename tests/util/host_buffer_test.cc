#include "strata/host_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

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

TEST(HostBufferTest, UnpinnedWhenNotAsked) {
  HostBufferOptions o;
  o.pin = false;
  auto buf = HostBuffer::Allocate(4096, o);
  ASSERT_TRUE(buf.ok());
  EXPECT_FALSE(buf->pinned());
}

}  // namespace
}  // namespace strata
