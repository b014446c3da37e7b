"""strata.Engine.begin_step: announced before a step's hand-overs, the
engine takes each unit's gradient statistics (or updates it) as soon as its
gradients are in, and the step ends with the masters of a step without it,
bit for bit, for AdamW, Adafactor and SM3; its misuses raise strata's
exceptions with the rule they break."""

import tempfile
import unittest

import strata

try:
    import numpy as np
    import engine_case as case
except ImportError:  # pragma: no cover - python3-numpy is a test package
    np = None

STEPS = 3


@unittest.skipIf(np is None, "needs numpy")
class BeginStepTest(unittest.TestCase):
    def test_same_masters_with_statistics_taken_during_backward(self):
        for algo in ("adamw", "adafactor", "sm3"):
            with self.subTest(algo=algo):
                alone = case.make_engine(algo=algo)
                case.train(alone, 0, STEPS)
                begun = case.make_engine(algo=algo)
                case.train(begun, 0, STEPS, begin_step=True)
                np.testing.assert_array_equal(case.masters(begun),
                                              case.masters(alone))
                np.testing.assert_array_equal(case.working(begun),
                                              case.working(alone))
                self.assertEqual(alone.stats()["early_statistics"], 0)
                # Every unit, every step (no undo buffer: none updated).
                early = begun.stats()["early_statistics"]
                self.assertGreaterEqual(early, STEPS)
                self.assertEqual(early % STEPS, 0)
                self.assertEqual(begun.stats()["early_units"], 0)
                alone.close()
                begun.close()

    def test_adafactor_passes_gradients_on_nvme_as_they_are_added(self):
        # The statistics pass runs as the last hand-overs are added, before
        # the pieces are written: the same masters, and the step reads the
        # matrix's gradient from the drive once, not twice.
        read = {}
        results = {}
        for begin in (False, True):
            with tempfile.TemporaryDirectory(prefix="strata-grads-") as d:
                eng = case.make_engine(algo="adafactor", grads_dir=d)
                case.train(eng, 0, STEPS, begin_step=begin)
                stats = eng.stats()
                results[begin] = case.masters(eng)
                read[begin] = stats["nvme_read_bytes"]
                self.assertEqual(stats["early_passes"],
                                 STEPS if begin else 0)  # w, not b
                eng.close()
        np.testing.assert_array_equal(results[True], results[False])
        self.assertLess(read[True], read[False])

    def test_misuse_raises_naming_the_rule(self):
        eng = case.make_engine()
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    "max_grad_norm"):
            eng.begin_step(lr=case.LR, max_grad_norm=1.0)
        with self.assertRaises(TypeError):
            eng.begin_step(case.LR)  # keyword-only
        eng.begin_step(lr=case.LR)
        with self.assertRaisesRegex(strata.Error, "twice"):
            eng.begin_step(lr=case.LR)
        eng.add_grad(0, case.grad(0, 0, 0, 1))
        with self.assertRaisesRegex(strata.Error, "last gradient"):
            eng.add_grad(0, case.grad(0, 0, 0, 1))
        with self.assertRaisesRegex(strata.Error, "after its last gradient"):
            eng.fetch(0)
        with self.assertRaisesRegex(strata.InvalidArgumentError, "differ"):
            eng.step(lr=2 * case.LR)
        self.assertTrue(eng.step(lr=case.LR).applied)
        eng.close()
        with self.assertRaisesRegex(strata.Error, "closed engine"):
            eng.begin_step(lr=case.LR)


if __name__ == "__main__":
    unittest.main()
