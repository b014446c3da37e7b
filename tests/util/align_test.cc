#include "util/align.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace strata {
namespace {

bool OnLine(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kCacheLine == 0;
}

TEST(AlignTest, RoundUp) {
  EXPECT_EQ(RoundUp(0, 64), 0u);
  EXPECT_EQ(RoundUp(1, 64), 64u);
  EXPECT_EQ(RoundUp(64, 64), 64u);
  EXPECT_EQ(RoundUp(65, 4096), 4096u);
}

// Large blocks are where glibc's malloc returns 16 bytes past a page, so
// sizes on both sides of its mmap threshold, and every growth of a vector.
TEST(AlignTest, LineAlignedVectorStartsOnALine) {
  for (size_t n : {size_t{1}, size_t{3}, size_t{1000}, size_t{1} << 20}) {
    LineAlignedVector<double> d(n, 1.5);
    LineAlignedVector<float> f(n + 1, 2.5f);
    EXPECT_TRUE(OnLine(d.data())) << n;
    EXPECT_TRUE(OnLine(f.data())) << n;
    EXPECT_EQ(d.back(), 1.5);
    EXPECT_EQ(f.back(), 2.5f);
  }
  LineAlignedVector<uint8_t> grown;
  for (size_t i = 0; i < 100000; ++i) {
    grown.push_back(static_cast<uint8_t>(i));
    ASSERT_TRUE(OnLine(grown.data())) << i;
  }
  for (size_t i = 0; i < grown.size(); ++i) {
    ASSERT_EQ(grown[i], static_cast<uint8_t>(i)) << i;
  }
}

TEST(AlignTest, AllocatorOfAnotherTypeIsTheSame) {
  AlignedAllocator<float> f;
  AlignedAllocator<double> d(f);
  EXPECT_TRUE(f == d);
  double* p = d.allocate(7);
  EXPECT_TRUE(OnLine(p));
  d.deallocate(p, 7);
  AlignedAllocator<char, 4096> page;
  char* q = page.allocate(1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q) % 4096, 0u);
  page.deallocate(q, 1);
}

}  // namespace
}  // namespace strata
