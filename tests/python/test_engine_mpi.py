"""strata.Engine over strata.Communicator('mpi') on 2 ranks (mpirun, from
STRATA_TEST_MPIEXEC): mpi_engine_worker.py trains on each rank with its own
gradients, zero_stage 2 and 3; both ranks end with the same masters bit for
bit, those of one engine trained alone on the mean gradient; the checkpoint
the 2 ranks saved loads into one engine bit for bit and training goes on
from it as it did on the 2 ranks. The same for strata.torch.offload of an
MLP (mpi_offload_worker.py), each rank on its half of every batch, against
one offload that accumulates both halves' gradients, each halved: the same
masters within 1e-6, the 2 ranks' checkpoint loaded bit for bit. And a
communicator the caller made with mpi4py (mpi_comm_worker.py)."""

import os
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
    import engine_case as case
except ImportError:  # pragma: no cover - python3-numpy is a test package
    np = None

try:
    import torch
    import strata.torch as storch
except ImportError:  # pragma: no cover - python3-torch is a test package
    torch = None

try:
    import mpi4py as MPI4PY  # only to know the worker can import it
except ImportError:  # pragma: no cover - python3-mpi4py is a test package
    MPI4PY = None

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.environ.get("STRATA_TEST_MPIEXEC")
SAVED_AT = 3


@unittest.skipIf(np is None, "needs numpy")
@unittest.skipIf(not MPIEXEC, "STRATA_TEST_MPIEXEC is not set (no mpirun)")
class TwoRanksTest(unittest.TestCase):
    def run_ranks(self, out, stage, worker="mpi_engine_worker.py"):
        with open(os.path.join(out, "blocker"), "w") as f:
            f.write("not a directory")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        # A session directory of the job's own: Open MPI 4 shares one per
        # user otherwise, which a job ending beside this one can remove
        # while this one starts (ctest -j).
        with tempfile.TemporaryDirectory() as session:
            cmd = [MPIEXEC, "-np", "2", "--oversubscribe", "--bind-to",
                   "none", "--mca", "btl", "self,vader,tcp",
                   "--mca", "orte_tmpdir_base", session, sys.executable,
                   os.path.join(HERE, worker), out, str(stage)]
            r = subprocess.run(cmd, cwd=HERE, env=env,
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               timeout=240)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("rank 0: ok", r.stdout)
        self.assertIn("rank 1: ok", r.stdout)
        if worker != "mpi_engine_worker.py":
            return None

        def read(rank, what):
            return np.fromfile(
                os.path.join(out, "rank-%d-%s.f32" % (rank, what)), np.float32)
        return [read(0, "saved"), read(1, "saved")], \
            [read(0, "final"), read(1, "final")]

    def check_stage(self, stage):
        with tempfile.TemporaryDirectory() as out:
            saved, final = self.run_ranks(out, stage)
            np.testing.assert_array_equal(saved[0], saved[1])
            np.testing.assert_array_equal(final[0], final[1])
            # One engine on the mean gradient (rank 0 of 1: the rank terms
            # cancel).
            ref = case.make_engine(stage=stage)
            case.train(ref, 0, SAVED_AT)
            np.testing.assert_allclose(case.masters(ref), saved[0], rtol=0,
                                       atol=1e-6)
            case.train(ref, SAVED_AT, 2)
            want = case.masters(ref)
            np.testing.assert_allclose(want, final[0], rtol=0, atol=1e-6)
            self.assertGreater(
                np.count_nonzero(np.abs(want - np.concatenate(
                    [case.initial(t).ravel() for t in range(2)])) > 1e-3),
                want.size // 2, "the masters barely moved")
            ref.close()
            # The 2 ranks' checkpoint into one engine.
            one = case.make_engine(stage=stage, init=False)
            one.load_checkpoint(os.path.join(out, "ckpt"))
            np.testing.assert_array_equal(case.masters(one), saved[0])
            case.train(one, SAVED_AT, 2)
            np.testing.assert_allclose(case.masters(one), final[0], rtol=0,
                                       atol=1e-6)
            one.close()

    @unittest.skipIf(MPI4PY is None, "needs python3-mpi4py")
    def test_callers_mpi4py_communicator(self):
        with tempfile.TemporaryDirectory() as out:
            self.run_ranks(out, 2, worker="mpi_comm_worker.py")

    def test_zero_stage_2(self):
        self.check_stage(2)

    def test_zero_stage_3(self):
        self.check_stage(3)


    def check_offload(self, stage):
        import test_offload as t
        import mpi_offload_worker as w
        with tempfile.TemporaryDirectory() as out:
            self.run_ranks(out, stage, "mpi_offload_worker.py")

            def read(rank, what):
                return torch.load(
                    os.path.join(out, "rank-%d-%s.pt" % (rank, what)))
            saved, final = read(0, "saved"), read(0, "final")
            for k, v in read(1, "saved").items():
                torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
            for k, v in read(1, "final").items():
                torch.testing.assert_close(v, final[k], rtol=0, atol=0)
            # One rank on both halves, each half's loss halved (exact in
            # bf16), the gradients accumulated: the mean the ranks take.
            nvme = os.path.join(out, "nvme")
            os.mkdir(nvme)
            cfg = t.engine_config(nvme, 768 * t.KIB, zero_stage=stage,
                                  **w.params(stage))
            parts = [w.halves(r, 2) for r in range(2)]
            with storch.offload(t.make_mlp(0), cfg, device="host") as off:
                for s in range(w.STEPS):
                    for r in range(2):
                        x, y = parts[r][s]
                        loss = torch.nn.functional.mse_loss(
                            off(x.bfloat16()).float(), y) / 2
                        loss.backward()
                    self.assertTrue(off.step(lr=w.LR).applied)
                want = off.state_dict()
            for k in want:
                torch.testing.assert_close(final[k], want[k], rtol=0,
                                           atol=1e-6, msg=k)
                self.assertFalse(torch.equal(final[k], saved[k]), k)
            # The 2 ranks' checkpoint into one offload.
            with storch.offload(t.make_mlp(3), cfg, device="host") as off:
                off.load_checkpoint(os.path.join(out, "ckpt"))
                got = off.state_dict()
            for k in saved:
                torch.testing.assert_close(got[k], saved[k], rtol=0, atol=0)

    @unittest.skipIf(torch is None, "needs torch (python3-torch)")
    def test_offload_zero_stage_2(self):
        self.check_offload(2)

    @unittest.skipIf(torch is None, "needs torch (python3-torch)")
    def test_offload_zero_stage_3(self):
        self.check_offload(3)


if __name__ == "__main__":
    unittest.main()
