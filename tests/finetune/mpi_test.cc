// strata-finetune under mpirun: 2 data-parallel ranks of --batch B train as
// one rank of --batch 2B (the same loss curve, stages 1 to 3, states and
// stage 3's parameters on host and on NVMe), a ZeRO stage the engine
// refuses with several ranks exits 2 on
// every rank naming it, an error on one rank stops both, and checkpoints
// saved on 2 ranks resume on 2 (bit for bit) and on 1.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/comm/mpi_run.h"
#include "tests/util/scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using strata::testing::ScratchDir;

struct Outcome {
  int code = -1;
  std::string out;  // stdout and stderr of every rank
};

// Runs `argv` in `cwd`, its output collected in a file outside `cwd`.
Outcome Exec(std::vector<std::string> argv, const std::string& cwd,
             const std::string& log) {
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::chdir(cwd.c_str()) != 0) ::_exit(120);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execv(cargv[0], cargv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome o;
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(log);
  o.out.assign(std::istreambuf_iterator<char>(in), {});
  return o;
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

// The JSON at `path` (discarded when it cannot be read or parsed).
nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

std::vector<double> Losses(const std::string& json_path) {
  const auto j = ReadJson(json_path);
  if (j.is_discarded() || !j.contains("losses")) return {};
  return j["losses"].get<std::vector<double>>();
}

// How many lines of `out` contain both `a` and `b`.
int Lines(const std::string& out, const std::string& a, const std::string& b) {
  int n = 0;
  size_t at = 0;
  while (at < out.size()) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(at, end - at);
    if (line.find(a) != std::string::npos && line.find(b) != std::string::npos)
      ++n;
    at = end + 1;
  }
  return n;
}

class FinetuneMpiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("STRATA_COMM_MPI_LIBRARY", STRATA_TEST_MPI_PLUGIN, 1);
#if defined(__SANITIZE_ADDRESS__)
    // Open MPI leaves allocations of its own at exit, most in plugins it
    // has unloaded, which LeakSanitizer cannot name to suppress: the ranks
    // (not this process, which read its options at start) skip the leak
    // check. The single-rank CLI tests leak-check the trainer.
    const char* asan = std::getenv("ASAN_OPTIONS");
    setenv("ASAN_OPTIONS",
           (std::string(asan ? asan : "") + ":detect_leaks=0").c_str(), 1);
#endif
    data_ = logs_.path() + "/text.txt";
    std::ofstream f(data_);
    for (int i = 0; i < 50; ++i) f << "a small corpus for a tiny model. ";
  }
  // The CLI test's tiny model, 8 steps, one CPU thread per rank.
  std::vector<std::string> Tiny(int batch) const {
    return {"--device",  "host",
            "--layers",  "2",
            "--embd",    "32",
            "--heads",   "2",
            "--context", "32",
            "--seq-len", "16",
            "--batch",   std::to_string(batch),
            "--steps",   "8",
            "--threads", "1",
            "--data",    data_};
  }
  Outcome Single(std::vector<std::string> args) {
    args.insert(args.begin(), STRATA_FINETUNE_PATH);
    return Exec(args, cwd_.path(), logs_.path() + "/single.txt");
  }
  Outcome Mpirun(int ranks, const std::vector<std::string>& args) {
    const strata::testing::MpiLaunch launch(STRATA_TEST_MPIEXEC, ranks);
    std::vector<std::string> argv = launch.Argv();
    argv.push_back(STRATA_FINETUNE_PATH);
    argv.insert(argv.end(), args.begin(), args.end());
    return Exec(argv, cwd_.path(), logs_.path() + "/mpirun.txt");
  }
  // 2 ranks of batch 2 against 1 rank of batch 4, with `extra` flags.
  void ExpectSameCurve(const std::vector<std::string>& extra, int stage = 2) {
    std::vector<std::string> one = Tiny(4);
    one.insert(one.end(), extra.begin(), extra.end());
    one.insert(one.end(), {"--json", "one.json"});
    const Outcome a = Single(one);
    ASSERT_EQ(a.code, 0) << a.out;
    std::vector<std::string> two = Tiny(2);
    two.insert(two.end(), extra.begin(), extra.end());
    two.insert(two.end(), {"--json", "two.json"});
    const Outcome b = Mpirun(2, two);
    ASSERT_EQ(b.code, 0) << b.out;
    // Rank 0 alone reports: one summary, one JSON.
    EXPECT_EQ(Lines(b.out, "strata-finetune:", "steps of"), 1) << b.out;
    EXPECT_EQ(Entries(cwd_.path()),
              (std::set<std::string>{"one.json", "two.json"}));
    const std::vector<double> l1 = Losses(cwd_.path() + "/one.json");
    const std::vector<double> l2 = Losses(cwd_.path() + "/two.json");
    ASSERT_EQ(l1.size(), 8u);
    ASSERT_EQ(l2.size(), 8u);
    // Not bit-identical: one rank averages its 4 x 16 token losses in one
    // sum, two ranks each average 2 x 16 and the mean of the two is taken,
    // and the gradients likewise (fp32, another order of additions). Those
    // differences (~1e-7 relative) move the fp32 masters by as little, and
    // now and then one bf16 working weight rounds the other way (2^-8
    // relative): the curves differ by at most 1e-5 here. Every rank on the
    // same sequences, or rank 0's own loss reported, moves the loss by
    // 5e-3 to 3e-2 within 8 steps.
    for (size_t i = 0; i < l1.size(); ++i) {
      EXPECT_NEAR(l1[i], l2[i], 1e-3) << "step " << i + 1;
    }
    std::printf("losses, 1 rank of batch 4 vs 2 ranks of batch 2:\n");
    for (size_t i = 0; i < l1.size(); ++i) {
      std::printf("  %zu  %.6f  %.6f  %+.2e\n", i + 1, l1[i], l2[i],
                  l2[i] - l1[i]);
    }
    const auto j = ReadJson(cwd_.path() + "/two.json");
    ASSERT_FALSE(j.is_discarded());
    EXPECT_EQ(j["config"]["data_parallel"]["ranks"], 2);
    EXPECT_EQ(j["config"]["data_parallel"]["zero_stage"], stage);
    EXPECT_EQ(j["config"]["data_parallel"]["global_batch"], 4);
    EXPECT_EQ(j["config"]["data_parallel"]["comm"], "mpi");
    EXPECT_TRUE(j["config"]["data_parallel"].contains("comm_memory"));
    EXPECT_EQ(j["tokens_per_step"], 4 * 16);
  }
  ScratchDir cwd_, logs_, nvme_;
  std::string data_;
};

TEST_F(FinetuneMpiTest, TwoRanksTrainAsOneRankOfTwiceTheBatch) {
  ExpectSameCurve({});
}

TEST_F(FinetuneMpiTest, TwoRanksWithStatesOnNvmeTrainAsOneRank) {
  ExpectSameCurve({"--nvme", nvme_.path()});
  const auto j = ReadJson(cwd_.path() + "/two.json");
  EXPECT_EQ(j["config"]["engine"]["optimizer_states"], "nvme");
  EXPECT_GT(j["engine"]["nvme_write_bytes"].get<uint64_t>(), 0u);
  // Each rank's swap directory is gone with its engine.
  EXPECT_TRUE(Entries(nvme_.path()).empty());
}

TEST_F(FinetuneMpiTest, TwoRanksOfZeroStage1TrainAsOneRank) {
  const std::string config = logs_.path() + "/stage1.json";
  std::ofstream(config) << R"({"zero_optimization": {"stage": 1,
              "offload_optimizer": {"device": "cpu"}},
            "strata": {"partition_bytes": 65536}})";
  ExpectSameCurve({"--config", config}, 1);
}

// Stage 3: each rank keeps its shard of the parameters (in host memory,
// then on NVMe) and the engine gathers them at each fetch.
TEST_F(FinetuneMpiTest, TwoRanksOfZeroStage3TrainAsOneRank) {
  const std::string config = logs_.path() + "/stage3.json";
  std::ofstream(config) << R"({"zero_optimization": {"stage": 3,
              "offload_param": {"device": "cpu"},
              "offload_optimizer": {"device": "cpu"}},
            "strata": {"partition_bytes": 65536}})";
  ExpectSameCurve({"--config", config}, 3);
  const auto j = ReadJson(cwd_.path() + "/two.json");
  EXPECT_EQ(j["config"]["engine"]["params"], "host");
}

// The engine's NCCL path (collectives on device memory), over MPI on the
// host-emulated device.
TEST_F(FinetuneMpiTest, TwoRanksWithCollectivesOnDeviceTrainAsOneRank) {
  const std::string config = logs_.path() + "/stage3.json";
  std::ofstream(config) << R"({"zero_optimization": {"stage": 3,
              "offload_param": {"device": "cpu"},
              "offload_optimizer": {"device": "cpu"}},
            "strata": {"partition_bytes": 65536, "comm_memory": "device"}})";
  ExpectSameCurve({"--config", config}, 3);
  const auto j = ReadJson(cwd_.path() + "/two.json");
  EXPECT_EQ(j["config"]["data_parallel"]["comm_memory"], "device");
}

TEST_F(FinetuneMpiTest, TwoRanksOfZeroStage3OnNvmeTrainAsOneRank) {
  const std::string config = logs_.path() + "/stage3.json";
  std::ofstream(config) << R"({"zero_optimization": {"stage": 3},
            "strata": {"partition_bytes": 65536}})";
  ExpectSameCurve({"--config", config, "--nvme", nvme_.path()}, 3);
  const auto j = ReadJson(cwd_.path() + "/two.json");
  EXPECT_EQ(j["config"]["engine"]["params"], "nvme");
  EXPECT_TRUE(Entries(nvme_.path()).empty());
}

// Clipping off, so the trainer calls BeginStep: with stages 2 and 3 each
// rank's engine takes its shard's gradient statistics during backward, and
// Adafactor's statistics pass over its part of each matrix, and the two
// ranks still train as one.
TEST_F(FinetuneMpiTest, TwoRanksTakeTheirStatisticsDuringBackward) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string config = logs_.path() + "/adafactor.json";
    std::ofstream(config) << R"({"zero_optimization": {"stage": )" << stage
                          << (stage == 3
                                  ? R"(, "offload_param": {"device": "cpu"})"
                                  : "")
                          << R"(, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "Adafactor",
              "params": {"lr": 3e-3, "scale_parameter": false,
                "relative_step": false}},
            "strata": {"partition_bytes": 65536}})";
    ExpectSameCurve({"--config", config, "--max-grad-norm", "0"}, stage);
    const auto j = ReadJson(cwd_.path() + "/two.json");
    ASSERT_FALSE(j.is_discarded());
    EXPECT_EQ(j["config"]["engine"]["optimizer"]["type"], "adafactor");
    EXPECT_GT(j["engine"]["early_statistics"].get<uint64_t>(), 0u);
    EXPECT_EQ(j["engine"]["early_units"].get<uint64_t>(), 0u);
  }
}

// An error on one rank only (its swap directory cannot be made) stops
// both ranks with the same status, the other saying so, without waiting
// for the communicator's timeout.
TEST_F(FinetuneMpiTest, AnErrorOnOneRankStopsEveryRankWithItsStatus) {
  std::ofstream(nvme_.path() + "/rank-1") << "not a directory";
  std::vector<std::string> args = Tiny(2);
  args.insert(args.end(), {"--nvme", nvme_.path(), "--json", "run.json",
                           "--comm-timeout", "120"});
  const auto t0 = std::chrono::steady_clock::now();
  const Outcome o = Mpirun(2, args);
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_EQ(o.code, 2) << o.out;
  EXPECT_EQ(Lines(o.out, "strata-finetune: rank 1: ", "--nvme"), 1) << o.out;
  EXPECT_EQ(Lines(o.out, "strata-finetune: rank 0: ", "another rank refused"),
            1)
      << o.out;
  // Not the communicator's timeout: the bound leaves mpirun's start and
  // the model's setup on a loaded machine half the timeout.
  EXPECT_LT(s, 60) << o.out;
  EXPECT_TRUE(Entries(cwd_.path()).empty());
  EXPECT_EQ(Entries(nvme_.path()), (std::set<std::string>{"rank-1"}));
}

TEST_F(FinetuneMpiTest, StagesTheEngineRefusesExit2OnEveryRankNamingThem) {
  struct Case {
    std::string config, says;
  };
  const std::vector<Case> cases = {
      {R"({"zero_optimization": {"stage": 3},
           "strata": {"partition_bytes": 65536}})",
       "zero_stage 3 and params on the device"},
      {R"({"strata": {"zero_stage": 0, "partition_bytes": 65536}})",
       "zero_stage 0"}};
  for (const Case& c : cases) {
    const std::string config = logs_.path() + "/config.json";
    std::ofstream(config) << c.config;
    std::vector<std::string> args = Tiny(2);
    args.insert(args.end(), {"--config", config, "--json", "run.json"});
    const Outcome o = Mpirun(2, args);
    EXPECT_EQ(o.code, 2) << c.config << ": " << o.out;
    for (const char* rank :
         {"strata-finetune: rank 0: ", "strata-finetune: rank 1: "}) {
      EXPECT_EQ(Lines(o.out, rank, c.says), 1) << c.config << ": " << o.out;
      EXPECT_EQ(Lines(o.out, rank, "--config"), 1) << c.config << ": " << o.out;
    }
    EXPECT_TRUE(Entries(cwd_.path()).empty()) << c.config;
  }
}

// Saved on 2 ranks (rank 0 writes), resumed on 2: the resumed steps are
// those of the uninterrupted run, bit for bit; the export is written once.
TEST_F(FinetuneMpiTest, SavesAndResumesOnTwoRanksBitForBit) {
  std::vector<std::string> full = Tiny(2);
  full.insert(full.end(), {"--json", "full.json"});
  const Outcome f = Mpirun(2, full);
  ASSERT_EQ(f.code, 0) << f.out;
  std::vector<std::string> first = Tiny(2);
  first.insert(first.end(), {"--checkpoint-dir", "ckpt", "--stop-after", "4",
                             "--json", "a.json"});
  const Outcome a = Mpirun(2, first);
  ASSERT_EQ(a.code, 0) << a.out;
  std::vector<std::string> second = Tiny(2);
  second.insert(second.end(),
                {"--checkpoint-dir", "ckpt", "--resume", "--export",
                 "m.safetensors", "--json", "b.json"});
  const Outcome b = Mpirun(2, second);
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(Entries(cwd_.path()),
            (std::set<std::string>{"full.json", "a.json", "b.json", "ckpt",
                                   "m.safetensors"}));
  const std::vector<double> lf = Losses(cwd_.path() + "/full.json");
  const std::vector<double> la = Losses(cwd_.path() + "/a.json");
  const std::vector<double> lb = Losses(cwd_.path() + "/b.json");
  ASSERT_EQ(lf.size(), 8u);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(la[i], lf[i]) << "step " << i + 1;
    EXPECT_EQ(lb[i], lf[i + 4]) << "step " << i + 5;
  }
}

// A checkpoint of 2 ranks of batch 2 resumes on 1 rank of batch 4 (the same
// global batch, so the same data order) and trains as the 1-rank run would
// have, within the tolerance of the curve tests; another global batch is
// refused on every rank, naming it.
TEST_F(FinetuneMpiTest, ACheckpointOfTwoRanksResumesOnOneOfTheSameGlobalBatch) {
  std::vector<std::string> full = Tiny(4);
  full.insert(full.end(), {"--json", "full.json"});
  const Outcome f = Single(full);
  ASSERT_EQ(f.code, 0) << f.out;
  std::vector<std::string> first = Tiny(2);
  first.insert(first.end(), {"--checkpoint-dir", "ckpt", "--stop-after", "4"});
  const Outcome a = Mpirun(2, first);
  ASSERT_EQ(a.code, 0) << a.out;
  std::vector<std::string> other = Tiny(3);
  other.insert(other.end(), {"--checkpoint-dir", "ckpt", "--resume"});
  const Outcome refused = Mpirun(2, other);
  EXPECT_EQ(refused.code, 2) << refused.out;
  for (const char* rank :
       {"strata-finetune: rank 0: ", "strata-finetune: rank 1: "}) {
    EXPECT_EQ(Lines(refused.out, rank, "trained with batch 4"), 1)
        << refused.out;
  }
  std::vector<std::string> second = Tiny(4);
  second.insert(second.end(),
                {"--checkpoint-dir", "ckpt", "--resume", "--json", "b.json"});
  const Outcome b = Single(second);
  ASSERT_EQ(b.code, 0) << b.out;
  const std::vector<double> lf = Losses(cwd_.path() + "/full.json");
  const std::vector<double> lb = Losses(cwd_.path() + "/b.json");
  ASSERT_EQ(lf.size(), 8u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(lb[i], lf[i + 4], 1e-3) << "step " << i + 5;
  }
}

}  // namespace
