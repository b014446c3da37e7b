// strata-finetune as a user runs it: the built binary in a fresh directory
// (an argument vector, no shell). A tiny run writes its JSON and loss plot
// and nothing else; bad flags, files and configs exit 2 naming the flag.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/swap/test_util.h"

namespace {

namespace fs = std::filesystem;
using strata::testing::ScratchDir;

struct Outcome {
  int code = -1;
  std::string err;
};

// Runs strata-finetune in `cwd`; stderr goes to a file outside it.
Outcome RunFinetune(const std::vector<std::string>& args,
                    const std::string& cwd, const std::string& logs) {
  std::vector<std::string> argv = {STRATA_FINETUNE_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::string err = logs + "/err.txt";
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int o = ::open("/dev/null", O_WRONLY);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (o < 0 || e < 0 || ::chdir(cwd.c_str()) != 0) ::_exit(120);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ::execv(cargv[0], cargv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome out;
  out.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(err);
  out.err.assign(std::istreambuf_iterator<char>(in), {});
  return out;
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.insert(e.path().filename().string());
  }
  return out;
}

class FinetuneCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = logs_.path() + "/text.txt";
    std::ofstream f(data_);
    for (int i = 0; i < 50; ++i) f << "a small corpus for a tiny model. ";
  }
  std::vector<std::string> Tiny() const {
    return {"--device", "host", "--layers",  "2",  "--embd",    "32",
            "--heads",  "2",    "--context", "32", "--seq-len", "16",
            "--batch",  "2",    "--steps",   "3",  "--data",    data_};
  }
  ScratchDir cwd_, logs_;
  std::string data_;
};

TEST_F(FinetuneCliTest, ATinyRunWritesItsJsonAndPlotAndNothingElse) {
  std::vector<std::string> args = Tiny();
  args.insert(args.end(), {"--json", "run.json", "--plot", "loss.svg"});
  const Outcome o = RunFinetune(args, cwd_.path(), logs_.path());
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(Entries(cwd_.path()),
            (std::set<std::string>{"run.json", "loss.svg"}));
  std::ifstream in(cwd_.path() + "/run.json");
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  for (const char* k :
       {"loss_first", "loss_last", "steps", "tokens_per_s", "model_state_bytes",
        "device_budget_bytes", "peak_device_bytes"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  EXPECT_EQ(j["steps"], 3);
  EXPECT_EQ(j["config"]["model"]["n_layer"], 2);
  EXPECT_EQ(j["config"]["batch"], 2);
  EXPECT_EQ(j["config"]["seq_len"], 16);
  EXPECT_EQ(j["losses"].size(), 3u);
  EXPECT_LE(j["peak_device_bytes"].get<uint64_t>(),
            j["device_budget_bytes"].get<uint64_t>());
  std::ifstream svg(cwd_.path() + "/loss.svg");
  std::string head(5, '\0');
  svg.read(head.data(), 5);
  EXPECT_EQ(head, "<svg ");
}

TEST_F(FinetuneCliTest, SavesStopsResumesAndExports) {
  std::vector<std::string> args = Tiny();
  // Tiny() trains 3 steps: 2, then the last after resuming.
  args.insert(args.end(), {"--checkpoint-dir", "ckpt", "--stop-after", "2",
                           "--json", "a.json"});
  const Outcome first = RunFinetune(args, cwd_.path(), logs_.path());
  ASSERT_EQ(first.code, 0) << first.err;
  std::vector<std::string> again = Tiny();
  again.insert(again.end(), {"--checkpoint-dir", "ckpt", "--resume", "--export",
                             "m.safetensors", "--json", "b.json"});
  const Outcome second = RunFinetune(again, cwd_.path(), logs_.path());
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_EQ(
      Entries(cwd_.path()),
      (std::set<std::string>{"a.json", "b.json", "ckpt", "m.safetensors"}));
  std::ifstream in(cwd_.path() + "/b.json");
  const auto j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["resumed_from_step"], 2);
  EXPECT_EQ(j["steps"], 1);
  EXPECT_EQ(j["step_records"][0]["step"], 3);
  // The step's parts are within its wall time.
  const double compute = j["step_records"][0]["compute_seconds"];
  const double optimizer = j["step_records"][0]["optimizer_seconds"];
  EXPECT_GT(compute, 0);
  EXPECT_GT(optimizer, 0);
  EXPECT_LE(compute + optimizer, j["step_records"][0]["seconds"].get<double>());
  EXPECT_EQ(j["checkpoints"].size(), 1u);
  EXPECT_EQ(j["config"]["checkpoint"]["resume"], true);
}

// The optimizer a config names is the run's: its lr is the schedule's peak
// unless --lr is given (a note then says which wins), and its weight decay
// replaces the example's 0.01. The JSON records the optimizer as a
// DeepSpeed section.
TEST_F(FinetuneCliTest, TheConfigsOptimizerIsTheRunsAndTheJsonSaysSo) {
  const std::string config = logs_.path() + "/lion.json";
  std::ofstream(config) << R"({"zero_optimization": {"stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"}},
      "strata": {"partition_bytes": 65536},
      "optimizer": {"type": "Lion", "params":
        {"lr": 2e-4, "betas": [0.9, 0.98], "weight_decay": 0.05}}})";
  struct Case {
    std::vector<std::string> extra;
    std::string type;
    double lr, weight_decay;
    bool note;  // "gives way to --lr"
  };
  for (const Case& c :
       {Case{{}, "adamw", 3e-3, 0.01, false},
        Case{{"--config", config}, "lion", 2e-4, 0.05, false},
        Case{{"--config", config, "--lr", "1e-3"}, "lion", 1e-3, 0.05, true}}) {
    SCOPED_TRACE(c.extra.empty() ? "no config" : c.extra.back());
    std::vector<std::string> args = Tiny();
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    args.insert(args.end(), {"--json", "run.json"});
    const Outcome o = RunFinetune(args, cwd_.path(), logs_.path());
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_EQ(o.err.find("gives way to --lr") != std::string::npos, c.note)
        << o.err;
    std::ifstream in(cwd_.path() + "/run.json");
    const auto j = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    EXPECT_DOUBLE_EQ(j["config"]["lr"].get<double>(), c.lr);
    const auto& opt = j["config"]["engine"]["optimizer"];
    EXPECT_EQ(opt["type"], c.type);
    EXPECT_DOUBLE_EQ(opt["params"]["lr"].get<double>(), c.lr);
    EXPECT_DOUBLE_EQ(opt["params"]["weight_decay"].get<double>(),
                     c.weight_decay);
    if (c.type == "lion") {
      EXPECT_DOUBLE_EQ(opt["params"]["betas"][1].get<double>(), 0.98);
    }
    EXPECT_EQ(j["config"]["engine"]["moments"], "fp32");
    fs::remove(cwd_.path() + "/run.json");
  }
}

TEST_F(FinetuneCliTest, BadFlagsFilesAndConfigsExit2NamingThem) {
  const std::string bad_config = logs_.path() + "/bad.json";
  std::ofstream(bad_config) << R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_pth": "/x"}}})";
  const std::string zero_lr = logs_.path() + "/zero-lr.json";
  std::ofstream(zero_lr) << R"({"optimizer": {"type": "AdamW",
      "params": {"lr": 0}}})";
  struct Case {
    std::vector<std::string> extra;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--dtype", "fp8"}, "--dtype"},
      {{"--recompute", "sometimes"}, "--recompute"},
      {{"--device", "tpu"}, "--device"},
      {{"--data", "/nonexistent/corpus"}, "--data"},
      {{"--device-budget", "12Q"}, "--device-budget"},
      {{"--device-budget", "1K"}, "--device-budget"},
      {{"--json", "/nonexistent/dir/run.json"}, "--json"},
      {{"--nvme", "/nonexistent/dir"}, "--nvme"},
      {{"--config", bad_config}, "nvme_pth"},
      {{"--config", "/nonexistent.json"}, "--config"},
      {{"--seq-len", "64"}, "--seq-len"},
      {{"--lr", "-1"}, "--lr"},
      {{"--config", zero_lr}, "--config: the optimizer's lr is 0"},
      {{"--vocab", "v.json"}, "--merges"},
      {{"--weights", "/nonexistent.safetensors"}, "--weights"},
      {{"--resume"}, "--checkpoint-dir"},
      {{"--checkpoint-dir", "/nonexistent/dir/ckpt"}, "--checkpoint-dir"},
      {{"--checkpoint-dir", "c", "--resume"}, "--resume"},
      {{"--checkpoint-dir", "c", "--keep", "0"}, "--keep"},
      {{"--export-dtype", "fp8"}, "--export-dtype"},
      {{"--export", "/nonexistent/dir/m.safetensors"}, "--export"},
      {{"--stop-after", "-1"}, "--stop-after"},
      {{"--comm", "tcp"}, "--comm"},
      {{"--comm", "nccl"}, "--comm nccl"},  // Tiny() runs on --device host
      {{"--comm-timeout", "0"}, "--comm-timeout"},
      {{"--no-such-flag"}, "no-such-flag"}};
  for (const Case& c : cases) {
    std::vector<std::string> args = Tiny();
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    const Outcome o = RunFinetune(args, cwd_.path(), logs_.path());
    EXPECT_EQ(o.code, 2) << c.extra[0] << ": " << o.err;
    EXPECT_NE(o.err.find(c.says), std::string::npos)
        << c.extra[0] << ": " << o.err;
    EXPECT_TRUE(Entries(cwd_.path()).empty()) << c.extra[0];
  }
}

}  // namespace
