"""One rank of test_engine_mpi's caller-communicator case: MPI is the
caller's (mpi4py), and strata.Communicator takes a communicator the caller
made, MPI_COMM_WORLD split with the ranks reversed, once as the mpi4py
object and once as its MPI_Comm's address. strata's ranks must be the
split's, not the world's; an engine of zero_stage 2 trains over it, and
both ranks end with the same masters. Prints "rank R: ok" (R the world
rank)."""

import sys

import numpy as np
from mpi4py import MPI

import engine_case as case
import strata


def main():
    world = MPI.COMM_WORLD
    reversed_ranks = world.Split(0, world.size - 1 - world.rank)
    want = world.size - 1 - world.rank
    by_object = strata.Communicator("mpi", timeout_s=120,
                                    mpi_comm=reversed_ranks)
    by_address = strata.Communicator(
        "mpi", timeout_s=120, mpi_comm=MPI._addressof(reversed_ranks))
    # strata duplicated it: the caller may free its own.
    reversed_ranks.Free()
    for comm in (by_object, by_address):
        assert (comm.rank, comm.size) == (want, world.size), \
            (comm.rank, comm.size, want)
        comm.barrier()
    eng = case.make_engine(by_object, world.size, want, 2)
    case.train(eng, 0, 2, want, world.size)
    mine = case.masters(eng)
    everyone = world.allgather(mine.tobytes())
    for other in everyone:
        np.testing.assert_array_equal(np.frombuffer(other, np.float32), mine)
    eng.close()
    print("rank %d: ok" % world.rank, flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # every failure reaches mpirun's status
        print("rank %d: FAIL %r" % (MPI.COMM_WORLD.rank, e), flush=True)
        sys.exit(1)
