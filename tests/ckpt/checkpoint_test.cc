// Checkpoints on real files: round trips in any layout, the fast path,
// keep/prune, refusals, the writer lock, and stale temporary directories.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tests/ckpt/test_fs.h"
#include "tests/ckpt/test_util.h"
#include "tests/swap/test_util.h"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

CheckpointWriterOptions Options(const std::string& dir, int64_t step,
                                int keep = 2, bool recycle = true) {
  CheckpointWriterOptions o;
  o.dir = dir;
  o.step = step;
  o.keep = keep;
  o.recycle = recycle;
  return o;
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    names.push_back(e.path().filename());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(CheckpointTest, RoundTripInTheWritersLayout) {
  ScratchDir dir;
  const Layout layout{3000, 5};
  ASSERT_TRUE(WriteState(Options(dir.path(), 7), layout).ok());
  auto r = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->step(), 7);
  EXPECT_EQ((*r)->path(), dir.File("step-000000000007"));
  EXPECT_EQ(ExpectState(**r, layout), 7);
  EXPECT_TRUE((*r)->Verify().ok());
  ASSERT_TRUE((*r)->Find("proj").ok());
  EXPECT_EQ(*(*r)->Find("proj"), 2u);
  EXPECT_EQ((*r)->Find("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*r)->Blob("nope").status().code(), StatusCode::kNotFound);
  const auto& t = (*r)->tensors()[2];
  EXPECT_EQ(t.name, "proj");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{5, 7, 11}));
  EXPECT_EQ(t.dtype, ElementType::kFloat16);
}

TEST(CheckpointTest, LoadsIntoAnyOtherLayout) {
  ScratchDir dir;
  ASSERT_TRUE(WriteState(Options(dir.path(), 3), Layout{4096, 0}).ok());
  // Opened as the checkpoint's own directory as well as through "latest".
  for (const std::string& path : {dir.path(), dir.File("step-000000000003")}) {
    auto r = CheckpointReader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (Layout other : {Layout{61, 0}, Layout{777, 3}, Layout{100000, 1},
                         Layout{5000, 4097}}) {
      EXPECT_EQ(ExpectState(**r, other), 3);
    }
  }
}

TEST(CheckpointTest, ReadsStraightIntoAnAlignedBufferWhenPlacementsMatch) {
  ScratchDir dir;
  const Layout layout{2048, 0};
  ASSERT_TRUE(WriteState(Options(dir.path(), 1), layout).ok());
  auto posix = NewPosixCheckpointFs();
  ASSERT_TRUE(posix.ok());
  std::vector<const std::byte*> reads;
  ProbeFs probe(
      posix->get(), [](std::string_view, const std::string&, bool) {},
      [&](const std::string&, std::span<std::byte> buf) {
        reads.push_back(buf.data());
      });
  auto r = CheckpointReader::Open(dir.path(), &probe);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Piece p = Cut(ModelTensors(), StateRole::kExpAvg, layout)[1];
  AlignedBuf out(p.elems * p.esize);
  ASSERT_TRUE((*r)->Read(StateRole::kExpAvg, p.placements, out.span()).ok());
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0], out.ptr.get());  // no bounce buffer
  // Another layout of the same elements goes through a bounce buffer.
  reads.clear();
  const Piece q = Cut(ModelTensors(), StateRole::kExpAvg, Layout{1000, 0})[2];
  AlignedBuf out2(q.elems * q.esize);
  ASSERT_TRUE((*r)->Read(StateRole::kExpAvg, q.placements, out2.span()).ok());
  ASSERT_FALSE(reads.empty());
  EXPECT_NE(reads[0], out2.ptr.get());
  EXPECT_EQ(ExpectState(**r, Layout{1000, 0}), 1);
}

// Pruned checkpoints go; with recycle (the default) the first of them is
// kept as the spare, whose files the next save writes over.
TEST(CheckpointTest, KeepsTheNewestAndPrunesTheRest) {
  for (bool recycle : {true, false}) {
    SCOPED_TRACE(recycle ? "recycle" : "no recycle");
    ScratchDir dir;
    std::vector<std::string> spare;
    if (recycle) spare.push_back(".tmp-spare");
    const auto with_spare = [&](std::vector<std::string> names) {
      names.insert(names.begin(), spare.begin(), spare.end());
      return names;
    };
    for (int64_t step : {1, 2, 3, 4}) {
      ASSERT_TRUE(WriteState(Options(dir.path(), step, 2, recycle)).ok());
    }
    EXPECT_EQ(Names(dir.path()),
              with_spare({"latest", "step-000000000003", "step-000000000004"}));
    // An older step written last is the latest and is kept; keep 1 prunes
    // every other.
    ASSERT_TRUE(WriteState(Options(dir.path(), 2, 1, recycle)).ok());
    EXPECT_EQ(Names(dir.path()), with_spare({"latest", "step-000000000002"}));
    auto r = CheckpointReader::Open(dir.path());
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(ExpectState(**r), 2);
    EXPECT_TRUE((*r)->Verify().ok());
  }
}

// A save after a prune writes over the spare's data files (the same
// inodes), cuts what they had beyond its data, drops the files it does not
// write, and loads like any other.
TEST(CheckpointTest, ASaveWritesOverThePrunedFiles) {
  ScratchDir dir;
  ASSERT_TRUE(WriteState(Options(dir.path(), 1, 1)).ok());
  ASSERT_TRUE(WriteState(Options(dir.path(), 2, 1)).ok());
  const std::string spare = dir.path() + "/.tmp-spare";
  ASSERT_TRUE(fs::exists(spare));
  // A file this checkpoint will not write, and a data file longer than
  // what it will write.
  std::ofstream(spare + "/extra.bin") << "stale";
  std::vector<std::pair<std::string, ino_t>> inodes;
  for (const auto& e : fs::directory_iterator(spare)) {
    if (e.path().extension() != ".bin" || e.path().filename() == "extra.bin")
      continue;
    fs::resize_file(e.path(), fs::file_size(e.path()) + (1 << 20));
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    inodes.emplace_back(e.path().filename().string(), st.st_ino);
  }
  ASSERT_FALSE(inodes.empty());
  ASSERT_TRUE(WriteState(Options(dir.path(), 3, 1)).ok());
  const std::string step3 = dir.path() + "/step-000000000003";
  for (const auto& [name, ino] : inodes) {
    struct stat st {};
    ASSERT_EQ(::stat((step3 + "/" + name).c_str(), &st), 0) << name;
    EXPECT_EQ(st.st_ino, ino) << name;
  }
  EXPECT_FALSE(fs::exists(step3 + "/extra.bin"));
  auto r = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ExpectState(**r), 3);
  EXPECT_TRUE((*r)->Verify().ok());  // the sizes are the data's
  // The spare now holds step 2's files.
  EXPECT_TRUE(fs::exists(spare));
}

TEST(CheckpointTest, RefusesToOverwriteTheLatest) {
  ScratchDir dir;
  ASSERT_TRUE(WriteState(Options(dir.path(), 5)).ok());
  auto w = CheckpointWriter::Begin(Options(dir.path(), 5));
  ASSERT_EQ(w.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(w.status().message()),
              HasSubstr("step-000000000005"));
  // An unpublished one of the same step (a commit that did not finish) is
  // replaced.
  ASSERT_TRUE(WriteState(Options(dir.path(), 6)).ok());
  ASSERT_TRUE(WriteState(Options(dir.path(), 5)).ok());
  auto r = CheckpointReader::Open(dir.path());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(ExpectState(**r), 5);
}

TEST(CheckpointTest, RefusesBadCalls) {
  ScratchDir dir;
  EXPECT_EQ(CheckpointWriter::Begin(Options("", 1)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckpointWriter::Begin(Options(dir.path(), -1)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckpointWriter::Begin(Options(dir.path(), 1, 0)).status().code(),
            StatusCode::kInvalidArgument);
  auto w = CheckpointWriter::Begin(Options(dir.path(), 1));
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->AddTensor({"x", {0}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*w)->AddTensor({"\xff\xfe", {1}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*w)->PutBlob("\xc0", "x").code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->AddTensor({"x", {10}, ElementType::kFloat32}).ok());
  EXPECT_EQ((*w)->AddTensor({"x", {10}}).status().code(),
            StatusCode::kAlreadyExists);
  ASSERT_TRUE((*w)->AddTensor({"y", {10}, ElementType::kBFloat16}).ok());
  AlignedBuf buf(4096);
  bool ran = false;
  auto done = [&](Status) { ran = true; };
  // Misaligned, outside the tensor, outside the buffer, mixed types.
  EXPECT_FALSE((*w)->WriteExtent(StateRole::kMaster, buf.span().subspan(8),
                                 {{0, 0, 0, 10}}, done)
                   .ok());
  EXPECT_FALSE(
      (*w)->WriteExtent(StateRole::kMaster, buf.span(), {{0, 5, 0, 10}}, done)
          .ok());
  EXPECT_FALSE((*w)->WriteExtent(StateRole::kMaster, buf.span(),
                                 {{0, 0, 1020, 10}}, done)
                   .ok());
  EXPECT_FALSE((*w)->WriteExtent(StateRole::kParam, buf.span(),
                                 {{0, 0, 0, 10}, {1, 0, 10, 10}}, done)
                   .ok());
  EXPECT_FALSE(ran);
  // Half of "x" only: Commit refuses and names what is missing.
  ASSERT_TRUE(
      (*w)->WriteExtent(StateRole::kMaster, buf.span(), {{0, 0, 0, 5}}, done)
          .ok());
  EXPECT_EQ((*w)->AddTensor({"z", {1}}).status().code(),
            StatusCode::kFailedPrecondition);
  auto c = (*w)->Commit();
  EXPECT_TRUE(ran);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("'x'"));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("[5, 10)"));
  w->reset();
  // Nothing was published and nothing is left behind.
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{});
  EXPECT_EQ(CheckpointReader::Open(dir.path()).status().code(),
            StatusCode::kNotFound);
}

TEST(CheckpointTest, RemovesStaleTemporaryDirectories) {
  ScratchDir dir;
  ASSERT_TRUE(WriteState(Options(dir.path(), 1)).ok());
  fs::create_directories(dir.File(".tmp-step-000000000002-999999/sub"));
  std::ofstream(dir.File(".tmp-step-000000000002-999999/sub/master.bin"))
      << "x";
  std::ofstream(dir.File(".tmp-latest-999999")) << "step-000000000002\n";
  // A symbolic link inside is removed, not followed.
  std::ofstream(dir.File("keep-me")) << "y";
  fs::create_directory_symlink(dir.path(),
                               dir.File(".tmp-step-000000000002-999999/link"));
  ASSERT_TRUE(WriteState(Options(dir.path(), 2)).ok());
  EXPECT_EQ(Names(dir.path()),
            (std::vector<std::string>{"keep-me", "latest", "step-000000000001",
                                      "step-000000000002"}));
}

TEST(CheckpointTest, SecondWriterOfADirectoryIsBusy) {
  ScratchDir dir;
  // Another process holds the directory (forked before this process starts
  // any thread: the child may start its own).
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto w = CheckpointWriter::Begin(Options(dir.path(), 1));
    char c = w.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    (void)!::read(go[0], &c, 1);
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  auto other = CheckpointWriter::Begin(Options(dir.path(), 2));
  EXPECT_EQ(other.status().code(), StatusCode::kBusy);
  EXPECT_THAT(std::string(other.status().message()),
              HasSubstr("pid " + std::to_string(child)));
  ASSERT_EQ(::write(go[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
  // Then this process, and a second writer in it.
  auto w = CheckpointWriter::Begin(Options(dir.path(), 2));
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(CheckpointWriter::Begin(Options(dir.path(), 3)).status().code(),
            StatusCode::kBusy);
}

}  // namespace
}  // namespace strata::testing
