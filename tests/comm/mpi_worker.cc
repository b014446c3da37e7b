// Runs under mpirun (tests/comm/comm_mpi_test.cc starts it):
//   comm_mpi_worker <plugin> collectives
//       every collective on host memory and on the host-emulated device,
//       checked against the reference, the argument errors, and a
//       duplicate used beside the original from two threads; exit 0 when
//       all pass, 1 otherwise.
//   comm_mpi_worker <plugin> dead-rank <exit|kill|hang> <timeout_s>
//       one all-reduce on all ranks, then the last rank exits, is killed or
//       hangs while the others start a second one. A survivor prints
//       "rank R: failed after S s: <error>" and exits 3 (without
//       MPI_Finalize, which could wait for the dead peer).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "strata/comm.h"
#include "strata/device.h"
#include "tests/comm/collective_checks.h"

namespace strata {
namespace {

int Report(int rank, const testing::CheckReport& r, const char* what) {
  for (const auto& f : r.failures) std::printf("FAIL %s\n", f.c_str());
  std::printf("rank %d: %s: %d checks, %zu failures\n", rank, what, r.checks,
              r.failures.size());
  std::fflush(stdout);
  return r.failures.empty() ? 0 : 1;
}

int Collectives(Communicator& comm) {
  DeviceOptions o;
  o.choice = DeviceChoice::kHostEmulated;
  o.memory_budget_bytes = 16 << 20;
  o.host_compute_threads = 1;
  auto device = NewHostEmulatedDevice(o);
  if (!device.ok()) {
    std::printf("FAIL device: %s\n", device.status().ToString().c_str());
    return 1;
  }
  int rc = Report(comm.rank(), testing::CheckArgumentErrors(comm), "errors");
  rc |=
      Report(comm.rank(), testing::CheckCollectives(comm, true, device->get()),
             "collectives");
  rc |= Report(comm.rank(), testing::CheckDuplicate(comm), "duplicate");
  return rc;
}

int DeadRank(Communicator& comm, const std::string& how) {
  float x = 1, y = 0;
  auto first = comm.AllReduce(&x, &y, 1, CommType::kFloat32, ReduceOp::kSum);
  if (!first.ok() || !first->Wait().ok() || y != comm.size()) {
    std::printf("FAIL rank %d: the first all-reduce\n", comm.rank());
    return 1;
  }
  if (comm.rank() == comm.size() - 1) {
    if (how == "exit") _exit(0);
    if (how == "kill") raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto work = comm.AllReduce(&x, &y, 1, CommType::kFloat32, ReduceOp::kSum);
  Status s = work.ok() ? work->Wait() : work.status();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  if (s.ok()) {
    std::printf("FAIL rank %d: the all-reduce with a dead peer succeeded\n",
                comm.rank());
    return 1;
  }
  std::printf("rank %d: failed after %.1f s: %s\n", comm.rank(), secs,
              s.ToString().c_str());
  std::fflush(stdout);
  _exit(3);
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <plugin> collectives|dead-rank ...\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[2];
  strata::CommOptions o;
  o.backend = strata::CommBackendKind::kMpi;
  o.mpi_library = argv[1];
  if (mode == "dead-rank" && argc >= 5) o.timeout_s = std::atof(argv[4]);
  auto comm = strata::Communicator::Create(o);
  if (!comm.ok()) {
    std::printf("FAIL Create: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  if (mode == "collectives") return strata::Collectives(*comm);
  if (mode == "dead-rank" && argc >= 5) {
    return strata::DeadRank(*comm, argv[3]);
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
