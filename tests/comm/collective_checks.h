// Every collective of a Communicator checked against a reference computed
// here, on any number of ranks: the single-rank suite, the MPI worker (run
// under mpirun) and the NCCL suite share it. Values are small integers, so
// fp32, bf16 and fp16 sums are exact whatever the order of the ranks.
#ifndef STRATA_TESTS_COMM_COLLECTIVE_CHECKS_H_
#define STRATA_TESTS_COMM_COLLECTIVE_CHECKS_H_

#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"

namespace strata::testing {

struct CheckReport {
  int checks = 0;
  std::vector<std::string> failures;  // one line each, naming the case
};

// All-gather (also in place), reduce-scatter and all-reduce (sum and max,
// also in place), broadcast, overflow agreement (inf and NaN through max)
// and a barrier, for fp32, bf16 and fp16 and two uneven count patterns.
// With `host` on host buffers; with `device` on that device's memory on one
// of its streams (stream-ordered).
CheckReport CheckCollectives(Communicator& comm, bool host, Device* device);

// Bad arguments come back as kInvalidArgument on every rank before any
// communication, and leave the communicator usable.
CheckReport CheckArgumentErrors(Communicator& comm);

// Duplicate: the copy has the same rank, size and timeout, and two threads
// running all-reduces on the original and the copy, with their calls
// interleaved differently on each rank (rank-dependent pauses), each get
// their own sums.
CheckReport CheckDuplicate(Communicator& comm);

}  // namespace strata::testing

#endif  // STRATA_TESTS_COMM_COLLECTIVE_CHECKS_H_
