// The single-rank backend (host memory and the host-emulated device), the
// Communicator's argument checks, and the backends that cannot be loaded.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "tests/comm/collective_checks.h"

namespace strata {
namespace {

std::string Failures(const testing::CheckReport& r) {
  std::string s;
  for (const auto& f : r.failures) s += f + "\n";
  return s;
}

TEST(ShardCountsTest, CutsAsTheEngineDoes) {
  EXPECT_EQ(ShardCounts(10, 3), (std::vector<size_t>{4, 4, 2}));
  EXPECT_EQ(ShardCounts(9, 3), (std::vector<size_t>{3, 3, 3}));
  EXPECT_EQ(ShardCounts(1, 3), (std::vector<size_t>{1, 0, 0}));
  EXPECT_EQ(ShardCounts(0, 2), (std::vector<size_t>{0, 0}));
  EXPECT_EQ(ShardCounts(5, 1), (std::vector<size_t>{5}));
}

TEST(CommNamesTest, NameEveryValue) {
  EXPECT_EQ(CommBackendName(CommBackendKind::kMpi), "mpi");
  EXPECT_EQ(CommTypeName(CommType::kBFloat16), "bfloat16");
  EXPECT_EQ(CommTypeSize(CommType::kFloat16), 2u);
  EXPECT_EQ(ReduceOpName(ReduceOp::kMax), "max");
}

TEST(SingleRankTest, DefaultIsOneRank) {
  auto comm = Communicator::Create();
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), CommBackendKind::kSingle);
  EXPECT_EQ(comm->timeout_s(), 300);
}

TEST(SingleRankTest, EveryCollectiveOnHostAndEmulatedDevice) {
  auto comm = Communicator::Create();
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  DeviceOptions o;
  o.choice = DeviceChoice::kHostEmulated;
  o.memory_budget_bytes = 16 << 20;
  auto device = NewHostEmulatedDevice(o);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  const auto r = testing::CheckCollectives(*comm, true, device->get());
  EXPECT_GT(r.checks, 50);
  EXPECT_TRUE(r.failures.empty()) << Failures(r);
}

TEST(SingleRankTest, DuplicateIsAnotherCommunicatorOfOneRank) {
  auto comm = Communicator::Create();
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  const auto r = testing::CheckDuplicate(*comm);
  EXPECT_GT(r.checks, 50);
  EXPECT_TRUE(r.failures.empty()) << Failures(r);
}

TEST(SingleRankTest, ArgumentErrors) {
  auto comm = Communicator::Create();
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  const auto r = testing::CheckArgumentErrors(*comm);
  EXPECT_TRUE(r.failures.empty()) << Failures(r);
}

TEST(SingleRankTest, TimeoutOutOfRangeIsRefused) {
  for (double t : {0.0, -1.0, 2e6}) {
    CommOptions o;
    o.timeout_s = t;
    auto comm = Communicator::Create(o);
    ASSERT_FALSE(comm.ok());
    EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(comm.status().ToString().find("timeout_s"), std::string::npos);
  }
}

TEST(SingleRankTest, WorkIsMoveOnlyAndDefaultIsDone) {
  CommWork w;
  EXPECT_TRUE(w.Done());
  EXPECT_TRUE(w.Wait().ok());
  auto comm = Communicator::Create();
  ASSERT_TRUE(comm.ok());
  float x = 3, y = 0;
  auto work = comm->AllReduce(&x, &y, 1, CommType::kFloat32, ReduceOp::kSum);
  ASSERT_TRUE(work.ok());
  CommWork moved = std::move(*work);
  EXPECT_TRUE(moved.Wait().ok());
  EXPECT_EQ(y, 3);
}

TEST(UnavailableBackendTest, MpiLibraryMissingIsAClearError) {
  CommOptions o;
  o.backend = CommBackendKind::kMpi;
  o.mpi_library = "/nonexistent/libstrata_comm_mpi.so";
  auto comm = Communicator::Create(o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(comm.status().ToString().find("MPI backend unavailable"),
            std::string::npos)
      << comm.status().ToString();
}

TEST(UnavailableBackendTest, NcclWithoutGpuOrBootstrapFails) {
  CommOptions o;
  o.backend = CommBackendKind::kNccl;
  auto comm = Communicator::Create(o);
  // No GPU here (kUnavailable), or a GPU but no bootstrap named
  // (kInvalidArgument): either way no communicator, and a reason.
  ASSERT_FALSE(comm.ok());
  EXPECT_FALSE(comm.status().message().empty());
}

}  // namespace
}  // namespace strata
