"""One rank of test_engine_mpi: trains engine_case's tensors over a
strata.Communicator('mpi') with zero_stage argv[2], saves a checkpoint into
argv[1] at step engine_case's SAVED_AT (rank 0 writes), trains 2 more steps,
then loads the checkpoint back; a save that fails on rank 0 and a load of
nothing raise on every rank. Then the same 5 steps with begin_step end with
the same masters bit for bit. Writes its masters at the save and at the end
into argv[1]/rank-R-{saved,final}.f32 and prints "rank R: ok"."""

import os
import sys

import numpy as np

import engine_case as case
import strata

SAVED_AT = 3


def main():
    out, stage = sys.argv[1], int(sys.argv[2])
    comm = strata.Communicator("mpi", timeout_s=120)
    rank, size = comm.rank, comm.size
    assert comm.backend == "mpi", comm.backend
    # A config whose rank is not the communicator's is refused on each rank,
    # alone: Engine::Create checks before any collective.
    try:
        case.make_engine(comm, size, (rank + 1) % size, stage)
        raise AssertionError("a config with another rank was accepted")
    except strata.InvalidArgumentError as e:
        assert "must agree" in str(e), str(e)
    eng = case.make_engine(comm, size, rank, stage)
    assert (eng.rank, eng.world_size) == (rank, size)
    case.train(eng, 0, SAVED_AT, rank, size)
    saved = case.masters(eng)
    # Rank 0 cannot make the directory (argv[1]/blocker is a file, made by
    # the test): every rank raises, naming rank 0, and the ranks go on.
    try:
        eng.save_checkpoint(os.path.join(out, "blocker", "ckpt"), SAVED_AT)
        raise AssertionError("a save under a file was accepted")
    except strata.Error as e:
        assert "rank 0" in str(e) and "save_checkpoint" in str(e), str(e)
    try:
        eng.load_checkpoint(os.path.join(out, "none"))
        raise AssertionError("a load of nothing was accepted")
    except strata.Error as e:
        assert e.code == "NotFound", (e.code, str(e))
    path = eng.save_checkpoint(os.path.join(out, "ckpt"), SAVED_AT)
    # Every rank learns the path; rank 0 wrote it.
    assert os.path.basename(path) == "step-%012d" % SAVED_AT, path
    case.train(eng, SAVED_AT, 2, rank, size)
    final = case.masters(eng)
    # The fetched working copy (with zero_stage 3 gathered from the ranks'
    # shards) is the master rounded to bf16.
    if not np.array_equal(case.working(eng), case.to_bf16_bits(final)):
        raise AssertionError("the working copy is not the master rounded")
    if np.array_equal(saved, final):
        raise AssertionError("the steps after the save changed nothing")
    loaded = eng.load_checkpoint(os.path.join(out, "ckpt"))
    assert loaded == path, (loaded, path)
    if not np.array_equal(case.masters(eng), saved):
        raise AssertionError("the masters loaded are not the saved ones")
    saved.tofile(os.path.join(out, "rank-%d-saved.f32" % rank))
    final.tofile(os.path.join(out, "rank-%d-final.f32" % rank))
    eng.close()
    # begin_step before each step's hand-overs: each rank's engine takes its
    # shard's gradient statistics as they are reduced, to the same masters
    # bit for bit.
    begun = case.make_engine(comm, size, rank, stage)
    case.train(begun, 0, SAVED_AT + 2, rank, size, begin_step=True)
    if not np.array_equal(case.masters(begun), final):
        raise AssertionError("begin_step changed the masters")
    if begun.stats()["early_statistics"] == 0:
        raise AssertionError("no statistics were taken during the steps")
    begun.close()
    print("rank %d: ok" % rank, flush=True)


if __name__ == "__main__":
    main()
