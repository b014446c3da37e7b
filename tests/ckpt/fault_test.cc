// Checkpoints under faults: a writer crashing at every operation followed by
// a power loss (MemFs), failing once at every operation, killed with SIGKILL
// at random moments and at armed points; and damaged checkpoints (bit flips,
// truncation, missing files, a stale manifest) refused with the file named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "tests/ckpt/test_fs.h"
#include "tests/ckpt/test_util.h"
#include "tests/swap/test_util.h"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr const char* kDir = "/ck";

CheckpointWriterOptions Options(const std::string& dir, int64_t step,
                                CheckpointFs* fs, int keep = 1) {
  CheckpointWriterOptions o;
  o.dir = dir;
  o.step = step;
  o.keep = keep;
  o.fs = fs;
  return o;
}

// A MemFs holding a complete checkpoint of step 1, all of it durable, and
// the spare left by pruning step 0: the faulted write of step 2 writes over
// the spare's files (CheckpointWriterOptions::recycle), so every fault also
// lands in a recycled write.
std::unique_ptr<MemFs> FsWithStep1() {
  auto mem = std::make_unique<MemFs>();
  EXPECT_TRUE(WriteState(Options(kDir, 0, mem.get())).ok());
  EXPECT_TRUE(WriteState(Options(kDir, 1, mem.get())).ok());
  auto names = mem->List(kDir);
  EXPECT_TRUE(names.ok() && std::find(names->begin(), names->end(),
                                      ".tmp-spare") != names->end());
  return mem;
}

// Temporary entries other than the spare, which is kept on purpose.
bool HasTemporaries(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    if (n.rfind(".tmp-", 0) == 0 && n != ".tmp-spare") return true;
  }
  return false;
}

// After a fault: "latest" loads and is exactly step 1's or step 2's state;
// a new writer removes what is left and commits.
void ExpectOldOrNewThenRecover(MemFs& mem, int64_t n) {
  auto r = CheckpointReader::Open(kDir, &mem);
  ASSERT_TRUE(r.ok()) << "fault at operation " << n << ": "
                      << r.status().ToString();
  const int64_t step = ExpectState(**r);
  EXPECT_TRUE(step == 1 || step == 2) << step;
  EXPECT_TRUE((*r)->Verify().ok()) << "fault at operation " << n;
  r->reset();
  Status s = WriteState(Options(kDir, 3, &mem));
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto names = mem.List(kDir);
  ASSERT_TRUE(names.ok());
  EXPECT_FALSE(HasTemporaries(*names)) << "fault at operation " << n;
  auto r3 = CheckpointReader::Open(kDir, &mem);
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(ExpectState(**r3), 3);
}

// Operations a full write of step 2 over step 1 makes.
int64_t OpsOfSecondWrite() {
  auto mem = FsWithStep1();
  const int64_t before = mem->ops();
  EXPECT_TRUE(WriteState(Options(kDir, 2, mem.get())).ok());
  return mem->ops() - before;
}

TEST(CheckpointFaultTest, CrashAtEveryOperationThenPowerLoss) {
  const int64_t total = OpsOfSecondWrite();
  ASSERT_GT(total, 20);
  int old_state = 0, new_state = 0;
  for (int64_t n = 0; n <= total; ++n) {
    SCOPED_TRACE("crash at operation " + std::to_string(n) + " of " +
                 std::to_string(total));
    auto mem = FsWithStep1();
    mem->CrashAt(mem->ops() + n);
    WriteState(Options(kDir, 2, mem.get())).IgnoreError();
    std::mt19937_64 rng(static_cast<uint64_t>(n));
    mem->PowerLoss(rng);
    {
      auto r = CheckpointReader::Open(kDir, mem.get());
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ((*r)->step() == 1 ? old_state : new_state)++;
    }
    ExpectOldOrNewThenRecover(*mem, n);
    if (HasFailure()) return;
  }
  // Both outcomes happened: the sweep crossed the commit point.
  EXPECT_GT(old_state, 0);
  EXPECT_GT(new_state, 0);
}

TEST(CheckpointFaultTest, FailureAtEveryOperation) {
  const int64_t total = OpsOfSecondWrite();
  for (int64_t n = 0; n < total; ++n) {
    SCOPED_TRACE("failure at operation " + std::to_string(n));
    auto mem = FsWithStep1();
    mem->FailAt(mem->ops() + n);
    Status s = WriteState(Options(kDir, 2, mem.get()));
    if (!s.ok()) {
      // The message says which operation on which file failed.
      EXPECT_THAT(std::string(s.message()), HasSubstr("/ck"));
    }
    ExpectOldOrNewThenRecover(*mem, n);
    if (HasFailure()) return;
  }
}

// ---- Real files, writers killed -----------------------------------------

// Runs a writer of steps first, first+1, ... in a child process over
// `dir`; the hook may kill it. Returns the child's pid.
pid_t ForkWriter(
    const std::string& dir, int64_t first, int64_t last, int keep,
    std::function<bool(std::string_view, const std::string&, bool)> kill_here) {
  const pid_t child = ::fork();
  if (child != 0) return child;
  auto posix = NewPosixCheckpointFs();
  if (!posix.ok()) ::_exit(3);
  ProbeFs probe(posix->get(),
                [&](std::string_view op, const std::string& p, bool after) {
                  if (kill_here && kill_here(op, p, after)) ::raise(SIGKILL);
                });
  for (int64_t step = first; step <= last; ++step) {
    if (!WriteState(Options(dir, step, &probe, keep)).ok()) ::_exit(2);
  }
  ::_exit(0);
}

void ExpectLoadsOneOf(const std::string& dir, int64_t lo, int64_t hi,
                      int64_t* step_out = nullptr) {
  auto r = CheckpointReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const int64_t step = ExpectState(**r);
  EXPECT_GE(step, lo);
  EXPECT_LE(step, hi);
  EXPECT_TRUE((*r)->Verify().ok());
  if (step_out != nullptr) *step_out = step;
}

struct ArmedPoint {
  const char* name;
  std::function<bool(std::string_view, const std::string&, bool)> hit;
  int64_t expect;  // the step "latest" must name afterwards
};

TEST(CheckpointFaultTest, WriterKilledAtArmedPoints) {
  auto ends = [](const std::string& p, std::string_view tail) {
    return p.size() >= tail.size() &&
           p.compare(p.size() - tail.size(), tail.size(), tail) == 0;
  };
  const std::vector<ArmedPoint> points = {
      {"after data, before fsync",
       [](std::string_view op, const std::string&, bool after) {
         return op == "sync" && !after;
       },
       1},
      {"after the data fsync",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "sync" && after && ends(p, "param.bin");
       },
       1},
      {"after the manifest",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "write_small" && after && ends(p, "MANIFEST.json");
       },
       1},
      {"after the rename",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "rename" && after && ends(p, "step-000000000002");
       },
       1},
      {"before the latest pointer",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "rename" && !after && ends(p, "/latest");
       },
       1},
      {"after the latest pointer",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "rename" && after && ends(p, "/latest");
       },
       2},
      {"while writing over the spare",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "overwrite" && after && ends(p, "exp_avg.bin");
       },
       1},
      {"while pruning into the spare",
       [&](std::string_view op, const std::string& p, bool after) {
         return op == "rename" && !after && ends(p, ".tmp-spare");
       },
       2},
  };
  for (const ArmedPoint& point : points) {
    SCOPED_TRACE(point.name);
    ScratchDir dir;
    // Step 0's files become the spare that step 2 writes over.
    ASSERT_TRUE(WriteState(Options(dir.path(), 0, nullptr, 1)).ok());
    ASSERT_TRUE(WriteState(Options(dir.path(), 1, nullptr, 1)).ok());
    const pid_t child = ForkWriter(dir.path(), 2, 2, 1, point.hit);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the armed point was not reached: " << status;
    int64_t step = 0;
    ExpectLoadsOneOf(dir.path(), point.expect, point.expect, &step);
    ASSERT_TRUE(WriteState(Options(dir.path(), 3, nullptr, 1)).ok());
    for (const auto& e : fs::directory_iterator(dir.path())) {
      const std::string n = e.path().filename().string();
      EXPECT_TRUE(n.rfind(".tmp-", 0) != 0 || n == ".tmp-spare") << e.path();
    }
    ExpectLoadsOneOf(dir.path(), 3, 3);
  }
}

TEST(CheckpointFaultTest, WriterKilledAtRandomMoments) {
  ScratchDir dir;
  ASSERT_TRUE(WriteState(Options(dir.path(), 1, nullptr, 2)).ok());
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int64_t latest = 1;
  for (int round = 0; round < 12; ++round) {
    const pid_t child =
        ForkWriter(dir.path(), latest + 1, latest + 1000, 2, nullptr);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 60000));
    ::kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    int64_t step = 0;
    ExpectLoadsOneOf(dir.path(), latest, latest + 1000, &step);
    latest = step;
    if (HasFailure()) return;
  }
}

// ---- Damaged checkpoints (row 14) ------------------------------------------

class CheckpointCorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(WriteState(Options(dir_.path(), 1, nullptr, 2)).ok());
    ASSERT_TRUE(WriteState(Options(dir_.path(), 2, nullptr, 2)).ok());
  }
  std::string Step(int s) const {
    return dir_.File(s == 1 ? "step-000000000001" : "step-000000000002");
  }
  static void FlipBit(const std::string& path, uint64_t byte) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(byte));
    char c = 0;
    f.get(c);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(byte));
    f.put(c);
  }
  // Open fails with `code` and a message naming `file`.
  void ExpectOpenRefused(StatusCode code, const std::string& file) {
    auto r = CheckpointReader::Open(dir_.path());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(file));
  }
  ScratchDir dir_;
};

TEST_F(CheckpointCorruptionTest, BitFlipInDataIsCaughtWithFileAndOffset) {
  const std::string file = Step(2) + "/exp_avg.bin";
  FlipBit(file, 16384 + 100);  // inside the second extent (16 KiB each)
  auto r = CheckpointReader::Open(dir_.path());
  ASSERT_TRUE(r.ok());  // sizes and manifest are intact
  Status v = (*r)->Verify();
  EXPECT_EQ(v.code(), StatusCode::kCorruption);
  EXPECT_THAT(std::string(v.message()), HasSubstr(file + " at offset 16384"));
  // A read that needs that extent is refused too, on both paths.
  const auto pieces = Cut(ModelTensors(), StateRole::kExpAvg, Layout{});
  AlignedBuf out(pieces[1].elems * 4);
  Status s = (*r)->Read(StateRole::kExpAvg, pieces[1].placements, out.span());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_THAT(std::string(s.message()), HasSubstr(file));
  const auto small = Cut(ModelTensors(), StateRole::kExpAvg, Layout{100, 1});
  AlignedBuf out2(small[42].elems * 4);
  s = (*r)->Read(StateRole::kExpAvg, small[42].placements, out2.span());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  // Other roles are still readable.
  const auto master = Cut(ModelTensors(), StateRole::kMaster, Layout{});
  AlignedBuf out3(master[1].elems * 4);
  EXPECT_TRUE(
      (*r)->Read(StateRole::kMaster, master[1].placements, out3.span()).ok());
}

TEST_F(CheckpointCorruptionTest, BitFlipInTheManifest) {
  const std::string file = Step(2) + "/MANIFEST.json";
  FlipBit(file, fs::file_size(file) / 2);
  ExpectOpenRefused(StatusCode::kCorruption, file);
}

TEST_F(CheckpointCorruptionTest, TruncatedDataFile) {
  const std::string file = Step(2) + "/master.bin";
  fs::resize_file(file, fs::file_size(file) - 4096);
  ExpectOpenRefused(StatusCode::kCorruption, file);
}

TEST_F(CheckpointCorruptionTest, TruncatedManifest) {
  const std::string file = Step(2) + "/MANIFEST.json";
  fs::resize_file(file, fs::file_size(file) - 30);
  ExpectOpenRefused(StatusCode::kCorruption, file);
}

TEST_F(CheckpointCorruptionTest, MissingDataFile) {
  const std::string file = Step(2) + "/param.bin";
  fs::remove(file);
  ExpectOpenRefused(StatusCode::kNotFound, file);
}

TEST_F(CheckpointCorruptionTest, MissingManifest) {
  const std::string file = Step(2) + "/MANIFEST.json";
  fs::remove(file);
  ExpectOpenRefused(StatusCode::kNotFound, file);
}

TEST_F(CheckpointCorruptionTest, StaleManifest) {
  const std::string file = Step(2) + "/MANIFEST.json";
  fs::copy_file(Step(1) + "/MANIFEST.json", file,
                fs::copy_options::overwrite_existing);
  ExpectOpenRefused(StatusCode::kCorruption, file);
  // The stale manifest's checksums would not match the data either.
  fs::rename(Step(2), dir_.File("step-000000000001x"));
  fs::remove_all(Step(1));
  fs::rename(dir_.File("step-000000000001x"), Step(1));
  std::ofstream(dir_.File("latest"), std::ios::trunc) << "step-000000000001\n";
  auto r = CheckpointReader::Open(dir_.path());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  Status v = (*r)->Verify();
  EXPECT_EQ(v.code(), StatusCode::kCorruption);
  EXPECT_THAT(std::string(v.message()), HasSubstr(Step(1) + "/"));
}

TEST_F(CheckpointCorruptionTest, LatestNamingNothing) {
  std::ofstream(dir_.File("latest"), std::ios::trunc) << "../../etc\n";
  ExpectOpenRefused(StatusCode::kCorruption, dir_.File("latest"));
  std::ofstream(dir_.File("latest"), std::ios::trunc) << "step-000000000009\n";
  ExpectOpenRefused(StatusCode::kNotFound,
                    dir_.File("step-000000000009/MANIFEST.json"));
}

TEST(CheckpointMemFsTest, BitFlipsAnywhereInTheManifestAreRefused) {
  MemFs mem;
  ASSERT_TRUE(WriteState(Options(kDir, 1, &mem)).ok());
  const std::string file =
      std::string(kDir) + "/step-000000000001/MANIFEST.json";
  auto text = mem.ReadSmall(file);
  ASSERT_TRUE(text.ok());
  for (uint64_t bit = 0; bit < text->size() * 8; bit += 997) {
    ASSERT_TRUE(mem.FlipBit(file, bit));
    auto r = CheckpointReader::Open(kDir, &mem);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << "bit " << bit;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(file));
    ASSERT_TRUE(mem.FlipBit(file, bit));
  }
  EXPECT_TRUE(CheckpointReader::Open(kDir, &mem).ok());
}

}  // namespace
}  // namespace strata::testing
