// strata-bench comm under mpirun on two ranks (paths from CMake): the
// stage3-fetch rows beside their all-gather, and the configuration a run
// needs to be reproduced, in the JSON rank 0 writes; nothing else is left.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/comm/mpi_run.h"
#include "tests/util/scratch_dir.h"

namespace {

using strata::testing::ScratchDir;

// mpirun -np `ranks` strata-bench `args`..., its output collected.
strata::testing::MpiRun RunBenchUnderMpi(int ranks,
                                         const std::vector<std::string>& args) {
  const strata::testing::MpiLaunch launch(STRATA_TEST_MPIEXEC, ranks);
  std::vector<std::string> argv = launch.Argv();
  argv.push_back(STRATA_BENCH_PATH);
  argv.insert(argv.end(), args.begin(), args.end());
  return strata::testing::RunArgv(argv);
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

TEST(BenchMpiTest, Stage3FetchOnTwoRanksReportsRatiosAndConfig) {
  ScratchDir d;
  const std::string json = d.path() + "/comm.json";
  const auto r = RunBenchUnderMpi(
      2, {"comm", "--ops", "stage3-fetch,all-gather", "--sizes", "64K,1M",
          "--iters", "3", "--warmup", "1", "--json", json});
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j.value("command", ""), "comm");
  EXPECT_EQ(j.value("ranks", 0), 2);
  const auto& c = j["config"];
  EXPECT_EQ(c.value("backend", ""), "mpi");
  EXPECT_EQ(c.value("iters", 0), 3);
  EXPECT_EQ(c.value("warmup", -1), 1);
  ASSERT_TRUE(c.contains("stage3")) << c.dump();
  EXPECT_EQ(c["stage3"].value("ranks", 0), 2);
  EXPECT_EQ(c["stage3"].value("comm_memory", ""), "host");
  ASSERT_EQ(c["stage3"]["shapes"].size(), 2u);
  for (const auto& s : c["stage3"]["shapes"]) {
    for (const char* k :
         {"size", "tensors", "tensor_bytes", "units", "unit_bytes",
          "shard_bytes", "partition_bytes", "staging_buffer_bytes",
          "staging_buffer_count", "rounds_per_unit", "prefetch_bytes",
          "device_budget_bytes", "device_budget_units"}) {
      EXPECT_TRUE(s.contains(k)) << k << " in " << s.dump();
    }
    // Two ranks: each sends half of every unit.
    EXPECT_EQ(2 * s.value("shard_bytes", 0), s.value("unit_bytes", 1));
    // Room for a few units: at most half of them, at least two.
    EXPECT_LE(s.value("device_budget_units", 0),
              std::max(2, s.value("units", 0) / 2));
  }
  // 1 MiB: eight units of 128 KiB, a device budget of four.
  EXPECT_EQ(c["stage3"]["shapes"][1].value("units", 0), 8);
  EXPECT_EQ(c["stage3"]["shapes"][1].value("device_budget_bytes", 0),
            512 << 10);
  int stage3_rows = 0, gather_rows = 0;
  for (const auto& row : j["results"]) {
    if (row.value("op", "") == "all-gather") ++gather_rows;
    if (row.value("op", "") != "stage3-fetch") continue;
    ++stage3_rows;
    EXPECT_GT(row.value("ratio", 0.0), 0.0) << row.dump();
    EXPECT_GT(row.value("paired_ratio", 0.0), 0.0) << row.dump();
    EXPECT_EQ(row["paired_ratios"].size(), 3u) << row.dump();
    EXPECT_GT(row.value("allgather_mean_seconds", 0.0), 0.0) << row.dump();
    EXPECT_EQ(row.value("pass_h2d_bytes", 0),
              row["shape"].value("gathered_bytes", 1));
    EXPECT_EQ(row.value("checked_tensors", 0), 2);
  }
  EXPECT_EQ(stage3_rows, 2);
  EXPECT_EQ(gather_rows, 2);
  EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"comm.json"}));
}

// A bad value fails every rank as a usage error, before any work.
// The engine's device-memory path (NCCL's), over MPI on the host-emulated
// device: the same checked fetches.
TEST(BenchMpiTest, Stage3FetchWithCollectivesOnDevice) {
  ScratchDir d;
  const std::string json = d.path() + "/comm.json";
  const auto r = RunBenchUnderMpi(
      2, {"comm", "--ops", "stage3-fetch", "--sizes", "1M", "--iters", "2",
          "--warmup", "1", "--comm-memory", "device", "--json", json});
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("collectives on device memory"), std::string::npos)
      << r.out;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["config"]["stage3"].value("comm_memory", ""), "device");
  ASSERT_EQ(j["results"].size(), 1u) << j.dump();
  const auto& row = j["results"][0];
  EXPECT_GT(row.value("ratio", 0.0), 0.0) << row.dump();
  EXPECT_EQ(row.value("pass_h2d_bytes", 0),
            row["shape"].value("gathered_bytes", 1));
  EXPECT_EQ(row.value("checked_tensors", 0), 2);
  EXPECT_EQ(Entries(d.path()), (std::set<std::string>{"comm.json"}));
}

TEST(BenchMpiTest, BadOptionFailsEveryRankWithItsName) {
  ScratchDir d;
  const auto r =
      RunBenchUnderMpi(2, {"comm", "--ops", "stage3-fetch", "--iters", "0"});
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("--iters: 0 is out of range"), std::string::npos)
      << r.out;
}

}  // namespace
