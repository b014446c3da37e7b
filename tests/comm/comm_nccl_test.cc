// The NCCL backend on one rank, bootstrapped through a file: every
// collective on CUDA device memory. Skips without a GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "strata/comm.h"
#include "strata/device.h"
#include "tests/comm/collective_checks.h"

namespace strata {
namespace {

TEST(NcclSingleRankTest, EveryCollectiveOnDeviceMemory) {
  DeviceOptions d;
  d.choice = DeviceChoice::kCuda;
  d.memory_budget_bytes = 64 << 20;
  auto device = NewCudaDevice(d);
  if (!device.ok()) GTEST_SKIP() << "no GPU: " << device.status().ToString();
  const std::string id_file =
      ::testing::TempDir() + "strata-nccl-id-" + std::to_string(getpid());
  std::remove(id_file.c_str());
  CommOptions o;
  o.backend = CommBackendKind::kNccl;
  o.nccl_id_file = id_file;
  o.nccl_rank = 0;
  o.nccl_size = 1;
  o.timeout_s = 60;
  auto comm = Communicator::Create(o);
  std::remove(id_file.c_str());
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend(), CommBackendKind::kNccl);
  const auto r = testing::CheckCollectives(*comm, false, device->get());
  std::string failures;
  for (const auto& f : r.failures) failures += f + "\n";
  // Every check the same checker makes on host memory through the
  // single-rank backend ran on device memory through NCCL.
  auto single = Communicator::Create();
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  const int on_host = testing::CheckCollectives(*single, true, nullptr).checks;
  EXPECT_GT(on_host, 40);
  EXPECT_EQ(r.checks, on_host);
  EXPECT_TRUE(r.failures.empty()) << failures;
  const auto e = testing::CheckArgumentErrors(*comm);
  EXPECT_TRUE(e.failures.empty());
  // A duplicate (ncclCommSplit) is another communicator of the same rank
  // that runs every collective too; NCCL before 2.18 cannot make one.
  auto dup = comm->Duplicate();
  if (dup.ok()) {
    EXPECT_EQ(dup->size(), 1);
    EXPECT_EQ(dup->backend(), CommBackendKind::kNccl);
    const auto checked = testing::CheckCollectives(*dup, false, device->get());
    std::string dup_failures;
    for (const auto& f : checked.failures) dup_failures += f + "\n";
    EXPECT_TRUE(checked.failures.empty()) << dup_failures;
  } else {
    EXPECT_EQ(dup.status().code(), StatusCode::kNotSupported)
        << dup.status().ToString();
  }
  // Host memory is refused with the reason.
  float x = 1;
  auto host = comm->AllReduce(&x, &x, 1, CommType::kFloat32, ReduceOp::kSum);
  ASSERT_FALSE(host.ok());
  EXPECT_EQ(host.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
