"""strata.Engine checkpoints and strata.Communicator on one rank: a saved
checkpoint loads back bit for bit, into the same engine or a fresh one, and
training goes on from it exactly as it did after the save; the arguments a
caller can get wrong raise strata's exceptions with its message."""

import os
import tempfile
import unittest

import strata

try:
    import numpy as np
    import engine_case as case
except ImportError:  # pragma: no cover - python3-numpy is a test package
    np = None

SAVED_AT = 3


@unittest.skipIf(np is None, "needs numpy")
class CheckpointTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = os.path.join(self.tmp.name, "ckpt")

    def tearDown(self):
        self.tmp.cleanup()

    def saved_run(self, comm=None, params=False):
        """SAVED_AT steps, a save, 2 more steps: the engine, the masters at
        the save and after the 2 steps, and the checkpoint's path."""
        eng = case.make_engine(comm=comm)
        case.train(eng, 0, SAVED_AT)
        at_save = case.masters(eng)
        path = eng.save_checkpoint(self.dir, SAVED_AT, params=params)
        case.train(eng, SAVED_AT, 2)
        after = case.masters(eng)
        self.assertFalse(np.array_equal(at_save, after))
        return eng, at_save, after, path

    def test_round_trip_into_a_fresh_engine_then_training_goes_on(self):
        eng, at_save, after, path = self.saved_run()
        eng.close()
        self.assertEqual(os.path.basename(path), "step-%012d" % SAVED_AT)
        self.assertTrue(os.path.isdir(path))
        # A fresh engine with other initial values: the load replaces them.
        fresh = case.make_engine(init=False)
        loaded = fresh.load_checkpoint(self.dir)
        self.assertEqual(loaded, path)
        np.testing.assert_array_equal(case.masters(fresh), at_save)
        case.train(fresh, SAVED_AT, 2)
        np.testing.assert_array_equal(case.masters(fresh), after)
        fresh.close()

    def test_factored_optimizers_resume_bit_for_bit(self):
        """Adafactor's and SM3's statistics per row and column travel in the
        checkpoint: a fresh engine goes on exactly as the saving one."""
        for algo in ("adafactor", "sm3"):
            with self.subTest(algo=algo):
                where = os.path.join(self.tmp.name, algo)
                eng = case.make_engine(algo=algo)
                case.train(eng, 0, SAVED_AT)
                at_save = case.masters(eng)
                eng.save_checkpoint(where, SAVED_AT)
                case.train(eng, SAVED_AT, 2)
                after = case.masters(eng)
                self.assertFalse(np.array_equal(at_save, after))
                eng.close()
                fresh = case.make_engine(init=False, algo=algo)
                fresh.load_checkpoint(where)
                np.testing.assert_array_equal(case.masters(fresh), at_save)
                case.train(fresh, SAVED_AT, 2)
                np.testing.assert_array_equal(case.masters(fresh), after)
                fresh.close()

    def test_load_into_the_same_engine_and_with_params(self):
        eng, at_save, after, path = self.saved_run(params=True)
        # By the checkpoint's own path, a pathlib path.
        import pathlib
        self.assertEqual(eng.load_checkpoint(pathlib.Path(path)), path)
        np.testing.assert_array_equal(case.masters(eng), at_save)
        case.train(eng, SAVED_AT, 2)
        np.testing.assert_array_equal(case.masters(eng), after)
        eng.close()

    def test_single_communicator_changes_nothing(self):
        comm = strata.Communicator("single")
        self.assertEqual((comm.rank, comm.size, comm.backend),
                         (0, 1, "single"))
        self.assertIn("single", repr(comm))
        comm.barrier()
        eng, at_save, after, _ = self.saved_run(comm=comm)
        self.assertEqual((eng.rank, eng.world_size), (0, 1))
        plain = case.make_engine()
        case.train(plain, 0, SAVED_AT + 2)
        np.testing.assert_array_equal(case.masters(plain), after)
        plain.close()
        del comm  # the engine keeps it alive
        eng.load_checkpoint(self.dir)
        np.testing.assert_array_equal(case.masters(eng), at_save)
        eng.close()

    def test_keep_prunes_older_checkpoints(self):
        eng = case.make_engine()
        paths = []
        for step in range(4):
            case.train(eng, step, 1)
            paths.append(eng.save_checkpoint(self.dir, step + 1, keep=2))
        self.assertTrue(os.path.isdir(paths[-1]))
        self.assertTrue(os.path.isdir(paths[-2]))
        self.assertFalse(os.path.exists(paths[0]))
        self.assertFalse(os.path.exists(paths[1]))
        self.assertEqual(eng.load_checkpoint(self.dir), paths[-1])
        eng.close()

    def test_refused_arguments(self):
        eng = case.make_engine()
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"save_checkpoint: step -1 is negative"):
            eng.save_checkpoint(self.dir, -1)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"save_checkpoint: keep 0 is below 1"):
            eng.save_checkpoint(self.dir, 1, keep=0)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"save_checkpoint: dir is empty"):
            eng.save_checkpoint("", 1)
        with self.assertRaises(TypeError):
            eng.save_checkpoint(12, 1)
        with self.assertRaises(TypeError):
            eng.save_checkpoint(self.dir, 1, True)  # params is keyword-only
        self.assertFalse(os.path.exists(self.dir))
        # A directory that cannot be made: rank 0's Begin fails.
        blocker = os.path.join(self.tmp.name, "file")
        with open(blocker, "w") as f:
            f.write("x")
        with self.assertRaises(strata.Error) as e:
            eng.save_checkpoint(os.path.join(blocker, "ckpt"), 1)
        self.assertIn("strata.Engine.save_checkpoint: ", str(e.exception))
        with self.assertRaises(strata.Error) as e:
            eng.load_checkpoint(os.path.join(self.tmp.name, "none"))
        self.assertIn("strata.Engine.load_checkpoint: ", str(e.exception))
        self.assertEqual(e.exception.code, "NotFound")
        # A checkpoint of other tensors is refused, naming the tensor.
        eng.save_checkpoint(self.dir, 1)
        other = strata.Engine(case.config(), device="host",
                              device_memory_bytes=64 << 20)
        other.register("w", [30, 99], dtype="bfloat16")
        other.register("b", list(case.B_SHAPE), dtype="bfloat16")
        other.start()
        with self.assertRaisesRegex(strata.Error, r"\bw\b"):
            other.load_checkpoint(self.dir)
        other.close()
        eng.close()
        with self.assertRaisesRegex(strata.Error, "closed engine"):
            eng.save_checkpoint(self.dir, 2)
        with self.assertRaisesRegex(strata.Error, "closed engine"):
            eng.load_checkpoint(self.dir)


class CommunicatorTest(unittest.TestCase):
    def test_refused_arguments(self):
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"backend 'gloo' is not known; accepted"):
            strata.Communicator("gloo")
        for t in (0.0, -1.0, 2e6, float("nan")):
            with self.assertRaisesRegex(strata.InvalidArgumentError,
                                        r"timeout_s .* out of range"):
                strata.Communicator(timeout_s=t)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"mpi_library and mpi_comm are for "
                                    r"backend 'mpi'"):
            strata.Communicator("single", mpi_library="x.so")
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"mpi_library is empty"):
            strata.Communicator("mpi", mpi_library="")
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"mpi_library and mpi_comm are for "
                                    r"backend 'mpi'"):
            strata.Communicator("single", mpi_comm=1234)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"mpi_comm's address is 0"):
            strata.Communicator("mpi", mpi_comm=0)

    def test_nccl_arguments_and_its_absence(self):
        one = strata.Communicator("single")
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"bootstrap, cuda_ordinal, nccl_comm and "
                                    r"nccl_ranks are for backend 'nccl'"):
            strata.Communicator("single", bootstrap=one)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"give nccl_comm or bootstrap, not both"):
            strata.Communicator("nccl", bootstrap=one, nccl_comm=1234)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"nccl_ranks needs nccl_comm"):
            strata.Communicator("nccl", nccl_ranks=[0])
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"nccl_comm is 0"):
            strata.Communicator("nccl", nccl_comm=0)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"cuda_ordinal -1 is negative"):
            strata.Communicator("nccl", cuda_ordinal=-1)
        with self.assertRaises(TypeError):
            strata.Communicator("nccl", bootstrap="mpi")
        # One rank: a communicator where a GPU and NCCL are, else
        # unavailable with the reason.
        try:
            comm = strata.Communicator("nccl", bootstrap=one, timeout_s=30)
        except strata.Error as e:
            self.assertEqual(e.code, "Unavailable")
            self.assertIn("strata.Communicator: ", str(e))
        else:
            self.assertEqual((comm.backend, comm.size), ("nccl", 1))

    def test_mpi_library_that_cannot_load(self):
        with tempfile.TemporaryDirectory() as d:
            missing = os.path.join(d, "libnothing.so")
            with self.assertRaises(strata.Error) as e:
                strata.Communicator("mpi", mpi_library=missing)
        self.assertEqual(e.exception.code, "Unavailable")
        self.assertIn("strata.Communicator: ", str(e.exception))
        self.assertIn("libnothing.so", str(e.exception))

    def test_engine_checks_the_config_against_the_communicator(self):
        comm = strata.Communicator("single")
        cfg = ('{"strata": {"world_size": 2, "rank": 1, "zero_stage": 2}}')
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"must agree"):
            strata.Engine(cfg, device="host", comm=comm)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"comm"):
            strata.Engine(cfg, device="host")
        with self.assertRaises(TypeError):
            strata.Engine("{}", device="host", comm="mpi")


if __name__ == "__main__":
    unittest.main()
