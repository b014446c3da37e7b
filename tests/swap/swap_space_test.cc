#include "strata/swap_space.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "tests/swap/test_util.h"

namespace strata {
namespace {

using testing::FirstMismatch;
using testing::ScratchDir;
using testing::Stamp;

constexpr uint32_t kBlock = 64 << 10;

SwapSpaceOptions Options(std::vector<std::string> dirs, uint64_t capacity) {
  SwapSpaceOptions o;
  o.dirs = std::move(dirs);
  o.capacity_bytes = capacity;
  o.block_bytes = kBlock;
  o.queue_depth = 4;
  return o;
}

TEST(SwapSpaceTest, RoundTripsTensorsOfAwkwardSizesStripedOverDirs) {
  ScratchDir a, b;
  auto space = SwapSpace::Open(Options({a.path(), b.path()}, 64 * kBlock));
  ASSERT_TRUE(space.ok()) << space.status().ToString();
  SwapSpace& s = **space;
  EXPECT_EQ(s.files().size(), 2u);
  EXPECT_EQ(s.capacity_blocks(), 64u);
  const std::vector<size_t> sizes = {
      0, 1, 4095, kBlock, kBlock + 1, 5 * kBlock + 7, 3 * kBlock};
  std::vector<SwapHandle> handles;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<std::byte> data(sizes[i]);
    Stamp(data, 0, i + 1);
    auto h = s.Write(i, data);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles.push_back(std::move(h).value());
  }
  // Consecutive slots alternate files.
  const SwapHandle& big = handles[5];
  ASSERT_GE(big.blocks(), 2u);
  EXPECT_NE(s.SlotFile(big.slot(0)), s.SlotFile(big.slot(1)));
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<std::byte> out(sizes[i]);
    ASSERT_TRUE(s.Read(handles[i], out).ok()) << i;
    EXPECT_EQ(FirstMismatch(out, 0, i + 1), -1) << i;
  }
  const SwapStats st = s.stats();
  EXPECT_EQ(st.checksum_failures, 0u);
  EXPECT_EQ(st.bytes_written, st.bytes_read);
}

TEST(SwapSpaceTest, FreeReturnsBlocksAndFullSpaceIsNoSpace) {
  ScratchDir d;
  auto space = SwapSpace::Open(Options({d.path()}, 8 * kBlock));
  ASSERT_TRUE(space.ok());
  SwapSpace& s = **space;
  std::vector<std::byte> data(6 * kBlock);
  Stamp(data, 0, 3);
  auto h1 = s.Write(1, data);
  ASSERT_TRUE(h1.ok());
  EXPECT_EQ(s.free_blocks(), 2u);
  auto h2 = s.Write(2, data);
  ASSERT_FALSE(h2.ok());
  EXPECT_EQ(h2.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(h2.status().ToString().find("needs 6 blocks"), std::string::npos);
  EXPECT_EQ(s.free_blocks(), 2u);
  s.Free(std::move(*h1));
  EXPECT_EQ(s.free_blocks(), 8u);
  auto h3 = s.Write(3, data);
  ASSERT_TRUE(h3.ok());
  std::vector<std::byte> out(data.size());
  ASSERT_TRUE(s.Read(*h3, out).ok());
  EXPECT_EQ(FirstMismatch(out, 0, 3), -1);
}

TEST(SwapSpaceTest, FilesArePrivatePreallocatedAndRemovedOnShutdown) {
  ScratchDir d;
  std::string path;
  {
    auto space = SwapSpace::Open(Options({d.path()}, 4 * kBlock));
    ASSERT_TRUE(space.ok());
    path = (*space)->files()[0];
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    const uint64_t slot = (*space)->header_bytes() + kBlock;
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4 * slot);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 4 * slot);
    ASSERT_EQ(::stat((d.path() + "/strata-swap.lock").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/strata-swap.lock"));
}

TEST(SwapSpaceTest, StaleFilesOfACrashedRunAreRemoved) {
  ScratchDir d;
  const std::string stale = d.path() + "/strata-swap-999999.swp";
  { std::ofstream(stale) << "left by a crash"; }
  auto space = SwapSpace::Open(Options({d.path()}, kBlock));
  ASSERT_TRUE(space.ok());
  EXPECT_FALSE(std::filesystem::exists(stale));
}

TEST(SwapSpaceTest, RejectsBadOptions) {
  ScratchDir d;
  SwapSpaceOptions o = Options({}, kBlock);
  EXPECT_EQ(SwapSpace::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options({d.path()}, kBlock);
  o.block_bytes = 1000;
  EXPECT_EQ(SwapSpace::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options({d.path() + "/does-not-exist"}, kBlock);
  EXPECT_FALSE(SwapSpace::Open(o).ok());
}

TEST(SwapSpaceTest, ReadIntoWrongSizeIsRefused) {
  ScratchDir d;
  auto space = SwapSpace::Open(Options({d.path()}, 2 * kBlock));
  ASSERT_TRUE(space.ok());
  std::vector<std::byte> data(100);
  auto h = (*space)->Write(1, data);
  ASSERT_TRUE(h.ok());
  std::vector<std::byte> out(99);
  EXPECT_EQ((*space)->Read(*h, out).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
