// The swap directory lock against three processes. A holds the directory; B
// has opened the lock file and is about to flock it when A shuts down
// (unlinking the file); C then opens the directory through a fresh lock
// file; only after that is B granted its flock, on A's unlinked file. B must
// see that the file it locked is no longer the lock and give way (kBusy,
// since C owns the directory), instead of also believing it owns it.
//
// B is held between open and flock deterministically: this test binary
// defines flock() itself, which the library's call binds to; in B it
// reports "about to flock" and waits for the go before the real system call.
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "strata/swap_space.h"
#include "tests/swap/test_util.h"

namespace {
int g_gate_out = -1;  // B: write a byte here before its first flock
int g_gate_in = -1;   // B: then read a byte from here
}  // namespace

extern "C" int flock(int fd, int op) {
  if (g_gate_out >= 0) {
    char c = 'b';
    (void)!::write(g_gate_out, &c, 1);
    (void)!::read(g_gate_in, &c, 1);
    g_gate_out = g_gate_in = -1;  // only the first flock waits
  }
  return static_cast<int>(::syscall(SYS_flock, fd, op));
}

namespace strata {
namespace {

using testing::ScratchDir;

SwapSpaceOptions Options(const std::string& dir) {
  SwapSpaceOptions o;
  o.dirs = {dir};
  o.capacity_bytes = 1 << 20;
  o.block_bytes = 64 << 10;
  o.queue_depth = 2;
  return o;
}

struct Pipe {
  int r = -1, w = -1;
  Pipe() {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    r = fds[0];
    w = fds[1];
  }
  void Put() const {
    char c = 'x';
    (void)!::write(w, &c, 1);
  }
  void Get() const {
    char c;
    (void)!::read(r, &c, 1);
  }
};

int ExitCode(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A, B and C are children of this (single-threaded) test process, so that
// each is a clean process with no descriptor or thread of the others.
TEST(SwapLockTest, ThreeProcessesNeverBothOwnTheDirectory) {
  ScratchDir dir;
  const SwapSpaceOptions o = Options(dir.path());
  Pipe a_owns, a_quit, a_done, b_at_flock, b_go, c_owns, c_quit;
  const pid_t a = ::fork();
  if (a == 0) {
    auto s = SwapSpace::Open(o);
    if (!s.ok()) ::_exit(3);
    a_owns.Put();
    a_quit.Get();
    s->reset();  // shut down: the lock file is unlinked, the lock dropped
    a_done.Put();
    ::_exit(0);
  }
  a_owns.Get();
  const pid_t b = ::fork();
  if (b == 0) {
    g_gate_out = b_at_flock.w;
    g_gate_in = b_go.r;
    auto s = SwapSpace::Open(o);
    // 0: refused because C owns the directory; 1: B believes it owns it too.
    ::_exit(s.ok() ? 1 : s.status().code() == StatusCode::kBusy ? 0 : 2);
  }
  b_at_flock.Get();  // B has opened A's lock file and waits to flock it
  a_quit.Put();
  a_done.Get();
  const pid_t c = ::fork();
  if (c == 0) {
    auto s = SwapSpace::Open(o);
    if (!s.ok()) ::_exit(3);
    c_owns.Put();
    c_quit.Get();  // hold the directory until told
    ::_exit(0);
  }
  c_owns.Get();
  b_go.Put();  // now B's flock is granted, on A's unlinked file
  EXPECT_EQ(ExitCode(b), 0) << "1: two processes owned the directory";
  c_quit.Put();
  EXPECT_EQ(ExitCode(c), 0);
  EXPECT_EQ(ExitCode(a), 0);
  // And after C, the directory is free for the next user.
  auto next = SwapSpace::Open(o);
  EXPECT_TRUE(next.ok()) << next.status().ToString();
}

}  // namespace
}  // namespace strata
