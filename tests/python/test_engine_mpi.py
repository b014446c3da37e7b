"""strata.Engine over strata.Communicator('mpi') on 2 ranks (mpirun, from
STRATA_TEST_MPIEXEC): mpi_engine_worker.py trains on each rank with its own
gradients, zero_stage 2 and 3; both ranks end with the same masters bit for
bit, those of one engine trained alone on the mean gradient; the checkpoint
the 2 ranks saved loads into one engine bit for bit and training goes on
from it as it did on the 2 ranks."""

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

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.environ.get("STRATA_TEST_MPIEXEC")
SAVED_AT = 3


@unittest.skipIf(np is None, "needs numpy")
@unittest.skipIf(not MPIEXEC, "STRATA_TEST_MPIEXEC is not set (no mpirun)")
class TwoRanksTest(unittest.TestCase):
    def run_ranks(self, out, stage):
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [MPIEXEC, "-np", "2", "--oversubscribe", "--bind-to", "none",
               "--mca", "btl", "self,vader,tcp", sys.executable,
               os.path.join(HERE, "mpi_engine_worker.py"), out, str(stage)]
        r = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=240)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("rank 0: ok", r.stdout)
        self.assertIn("rank 1: ok", r.stdout)

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

    def test_zero_stage_2(self):
        self.check_stage(2)

    def test_zero_stage_3(self):
        self.check_stage(3)


if __name__ == "__main__":
    unittest.main()
