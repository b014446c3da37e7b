"""strata.CpuOptimizer on NumPy arrays: the update, the working copy, the
overflow contract, and the errors a caller gets for bad arrays."""

import math
import os
import sys
import unittest

import strata

try:
    import numpy as np
except ImportError:  # pragma: no cover - python3-numpy is a test package
    np = None


class VersionTest(unittest.TestCase):
    def test_version_is_the_librarys(self):
        self.assertEqual(strata.__version__, strata.version())
        expected = os.environ.get("STRATA_EXPECTED_VERSION")
        if expected:
            self.assertEqual(strata.__version__, expected)
        self.assertEqual(strata._strata.__version__, strata.__version__)

    def test_exception_hierarchy(self):
        self.assertTrue(issubclass(strata.Error, RuntimeError))
        self.assertTrue(issubclass(strata.InvalidArgumentError, strata.Error))
        self.assertTrue(issubclass(strata.InvalidArgumentError, ValueError))

    def test_state_bytes(self):
        self.assertEqual(strata.state_bytes("float32", 10), 40)
        self.assertEqual(strata.state_bytes("bfloat16", 10), 20)
        with self.assertRaisesRegex(ValueError, "unknown dtype 'int8'"):
            strata.state_bytes("int8", 10)


def adamw_reference(p, g, m, v, step, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's update in float64 (for a loose comparison)."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = np.sqrt(v) / math.sqrt(bc2) + eps
    return p - (lr / bc1) * m / denom, m, v


@unittest.skipIf(np is None, "needs numpy")
class NumpyStepTest(unittest.TestCase):
    def setUp(self):
        rng = np.random.default_rng(7)
        self.n = 3000
        self.p = rng.standard_normal(self.n).astype(np.float32)
        self.grads = [rng.standard_normal(self.n).astype(np.float32)
                      for _ in range(5)]

    def test_adamw_matches_reference(self):
        p = self.p.copy()
        m = np.zeros(self.n, np.float32)
        v = np.zeros(self.n, np.float32)
        rp, rm, rv = (self.p.astype(np.float64), np.zeros(self.n),
                      np.zeros(self.n))
        with strata.CpuOptimizer("adamw", betas=(0.9, 0.99), eps=1e-8,
                                 weight_decay=0.1, threads=2) as opt:
            self.assertEqual(opt.algo, "adamw")
            self.assertEqual(opt.betas, (0.9, 0.99))
            for step, g in enumerate(self.grads, start=1):
                self.assertTrue(opt.step(p, g, m, v, step=step, lr=1e-2))
                rp, rm, rv = adamw_reference(rp, g.astype(np.float64), rm, rv,
                                             step, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        np.testing.assert_allclose(p, rp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(v, rv, rtol=1e-5, atol=1e-9)

    def test_block8_sweeps_give_the_same_state(self):
        n = 5000  # two whole 2048-element blocks and a partial one
        g = np.resize(self.grads[0], n)
        results = []
        for sweeps in (1, 2):
            p = np.resize(self.p, n).astype(np.float32)
            m = np.zeros(strata.state_bytes("block8", n), np.uint8)
            v = np.zeros(strata.state_bytes("block8", n), np.uint8)
            with strata.CpuOptimizer("adamw", weight_decay=0.01, threads=2,
                                     block8_sweeps=sweeps) as opt:
                self.assertEqual(opt.block8_sweeps, sweeps)
                for step in (1, 2):
                    self.assertTrue(opt.step(p, g, m, v, step=step, lr=1e-2))
            results.append((p, m, v))
        for a, b in zip(results[0], results[1]):
            np.testing.assert_array_equal(a, b)
        with strata.CpuOptimizer("adamw", variant="scalar") as opt:
            self.assertEqual(opt.block8_sweeps, 1)  # scalar's own
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    "block8_sweeps"):
            strata.CpuOptimizer("adamw", block8_sweeps=3)

    def test_adafactor_carries_the_weights_sum_of_squares(self):
        rows, cols = 30, 100
        p = self.p.copy()
        q = self.p.copy()
        stats_p = np.zeros(rows + cols, np.float32)
        stats_q = np.zeros(rows + cols, np.float32)
        with strata.CpuOptimizer("adafactor", threads=2) as opt:
            self.assertEqual(opt.last_param_sq, -1.0)
            carried = -1.0
            for step, g in enumerate(self.grads, start=1):
                self.assertTrue(opt.step(p, g, None, stats_p, step=step,
                                         lr=0.0, rows=rows, cols=cols))
                self.assertTrue(opt.step(q, g, None, stats_q, step=step,
                                         lr=0.0, rows=rows, cols=cols,
                                         param_sq=carried))
                carried = opt.last_param_sq
                want = float(np.sum(q.astype(np.float64) ** 2))
                self.assertAlmostEqual(carried / want, 1.0, delta=1e-12)
            with self.assertRaises(strata.InvalidArgumentError):
                opt.step(q, self.grads[0], None, stats_q, step=6, lr=0.0,
                         rows=rows, cols=cols, param_sq=float("nan"))
        np.testing.assert_allclose(q, p, rtol=1e-5, atol=1e-7)
        with strata.CpuOptimizer("adamw", threads=1) as opt:
            m = np.zeros(self.n, np.float32)
            v = np.zeros(self.n, np.float32)
            opt.step(p, self.grads[0], m, v, step=1, lr=1e-3, param_sq=5.0)
            self.assertEqual(opt.last_param_sq, -1.0)

    def test_from_config_takes_adafactors_parameters(self):
        sys.path.insert(0, os.path.join(os.path.dirname(
            os.path.abspath(__file__)), "..", "cpu_adam"))
        import factored_reference  # the NumPy reference of the C++ tests
        rows, cols = 30, 100
        section = {"type": "Adafactor",
                   "params": {"lr": 0.02, "eps": [1e-30, 2e-3],
                              "clip_threshold": 0.5, "decay_rate": -0.7,
                              "beta1": 0.9, "weight_decay": 0.01}}
        p = self.p.copy()
        stats = np.zeros(rows + cols, np.float32)
        m = np.zeros(self.n, np.float32)
        with strata.CpuOptimizer.from_config(section, threads=2) as opt:
            self.assertEqual(opt.algo, "adafactor")
            self.assertEqual(opt.lr, 0.02)
            self.assertEqual(opt.threads, 2)
            self.assertEqual(opt.adafactor, {
                "eps": (1e-30, 2e-3), "clip_threshold": 0.5,
                "decay_rate": -0.7, "beta1": 0.9,
                "relative_step": False,  # a given lr turns it off, as in HF
                "scale_parameter": True, "warmup_init": False})
            for step, g in enumerate(self.grads, start=1):
                self.assertTrue(opt.step(p, g, m, stats, step=step,
                                         lr=opt.lr, rows=rows, cols=cols))
        kw = {"lr": "0.02", "eps2": "2e-3", "clip_threshold": "0.5",
              "decay_rate": "-0.7", "beta1": "0.9", "weight_decay": "0.01",
              "relative_step": "0"}
        rp, rstats, rm = factored_reference.adafactor(
            self.p.copy(), self.grads, rows, cols, len(self.grads), kw)
        np.testing.assert_allclose(p, rp.ravel(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(stats, rstats, rtol=1e-5)
        np.testing.assert_allclose(m, rm.ravel(), rtol=1e-5, atol=1e-9)
        # JSON text works too; the constructor's optimizers have no lr.
        with strata.CpuOptimizer.from_config(
                '{"type": "sm3", "params": {"momentum": 0.8}}',
                variant="scalar") as opt:
            self.assertEqual((opt.algo, opt.betas[0], opt.lr),
                             ("sm3", 0.8, 1e-3))
            self.assertEqual(opt.variant, "scalar")
        with strata.CpuOptimizer("adafactor") as opt:
            self.assertIsNone(opt.lr)
            self.assertIsNone(opt.adafactor["beta1"])
            self.assertTrue(opt.adafactor["relative_step"])

    def test_capsule_and_reshaped_arrays_are_accepted(self):
        p = self.p.reshape(30, 100).copy()
        m = np.zeros((30, 100), np.float32)
        v = np.zeros(self.n, np.float32)
        with strata.CpuOptimizer(threads=1) as opt:
            self.assertTrue(opt.step(p, self.grads[0].__dlpack__(), m, v,
                                     step=1, lr=1e-3))
        self.assertFalse(np.array_equal(p.ravel(), self.p))

    def test_float16_working_copy_written_in_the_same_pass(self):
        p = self.p.copy()
        m = np.zeros(self.n, np.float32)
        v = np.zeros(self.n, np.float32)
        w = np.zeros(self.n, np.float16)
        with strata.CpuOptimizer(threads=1) as opt:
            opt.step(p, self.grads[0], m, v, step=1, lr=1e-3, working=w)
        np.testing.assert_array_equal(w, p.astype(np.float16))

    def test_overflow_writes_nothing(self):
        p = self.p.copy()
        m = np.zeros(self.n, np.float32)
        v = np.zeros(self.n, np.float32)
        g = self.grads[0].copy()
        g[17] = np.inf
        with strata.CpuOptimizer(threads=1) as opt:
            sum_sq, finite = opt.grad_stats(g)
            self.assertFalse(finite)
            self.assertFalse(opt.step(p, g, m, v, step=1, lr=1e-3))
            sum_sq, finite = opt.grad_stats(self.grads[0], scale=0.5)
            self.assertTrue(finite)
            self.assertAlmostEqual(
                sum_sq, float(np.sum((self.grads[0] * 0.5)**2, dtype=np.float64)),
                delta=1e-4 * sum_sq)
        np.testing.assert_array_equal(p, self.p)
        self.assertFalse(m.any() or v.any())


@unittest.skipIf(np is None, "needs numpy")
class BadInputTest(unittest.TestCase):
    def setUp(self):
        self.n = 256
        self.p = np.ones(self.n, np.float32)
        self.g = np.ones(self.n, np.float32)
        self.m = np.zeros(self.n, np.float32)
        self.v = np.zeros(self.n, np.float32)
        self.opt = strata.CpuOptimizer(threads=1)

    def tearDown(self):
        self.opt.close()

    def assertUntouched(self):
        np.testing.assert_array_equal(self.p, np.ones(self.n, np.float32))
        self.assertFalse(self.m.any() or self.v.any())

    def test_non_contiguous(self):
        g = np.ones(2 * self.n, np.float32)[::2]
        with self.assertRaisesRegex(ValueError, r"grad is not contiguous .*"
                                    r"strides \[2\]"):
            self.opt.step(self.p, g, self.m, self.v, step=1, lr=1e-3)
        self.assertUntouched()

    def test_wrong_dtype(self):
        with self.assertRaisesRegex(TypeError, "master has dtype float64; "
                                    "accepted: float32"):
            self.opt.step(self.p.astype(np.float64), self.g, self.m, self.v,
                          step=1, lr=1e-3)
        with self.assertRaisesRegex(TypeError, "grad has dtype int32"):
            self.opt.step(self.p, self.g.astype(np.int32), self.m, self.v,
                          step=1, lr=1e-3)
        self.assertUntouched()

    def test_not_an_array(self):
        with self.assertRaisesRegex(TypeError, "grad: expected an array that "
                                    "supports DLPack.* got list"):
            self.opt.step(self.p, [1.0] * self.n, self.m, self.v, step=1,
                          lr=1e-3)

    def test_wrong_length_and_missing_state(self):
        with self.assertRaisesRegex(ValueError, "grad has 255 elements; "
                                    "master has 256"):
            self.opt.step(self.p, self.g[:255], self.m, self.v, step=1,
                          lr=1e-3)
        with self.assertRaisesRegex(ValueError, "exp_avg_sq holds 1020 bytes"):
            self.opt.step(self.p, self.g, self.m, self.v[:255], step=1,
                          lr=1e-3)
        with self.assertRaisesRegex(ValueError, "exp_avg_sq is required"):
            self.opt.step(self.p, self.g, self.m, None, step=1, lr=1e-3)
        self.assertUntouched()

    def test_overlap(self):
        with self.assertRaisesRegex(ValueError, "exp_avg and exp_avg_sq "
                                    "overlap"):
            self.opt.step(self.p, self.g, self.m, self.m, step=1, lr=1e-3)

    def test_strata_status_becomes_exception(self):
        with self.assertRaises(strata.InvalidArgumentError) as cm:
            self.opt.step(self.p, self.g, self.m, self.v, step=1,
                          lr=float("nan"))
        self.assertEqual(cm.exception.code, "InvalidArgument")
        self.assertIn("lr", str(cm.exception))
        with self.assertRaisesRegex(ValueError, "beta"):
            strata.CpuOptimizer(betas=(1.5, 0.999))
        with self.assertRaisesRegex(ValueError, "adamw"):
            strata.CpuOptimizer(algo="sgd")
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"optimizer\.params\.beta\b"):
            strata.CpuOptimizer.from_config(
                {"type": "Adafactor", "params": {"beta": 0.9}})
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    r"optimizer\.params\.clip_threshold"):
            strata.CpuOptimizer.from_config(
                {"type": "Adafactor", "params": {"clip_threshold": 0}})
        with self.assertRaisesRegex(ValueError, "variant"):
            strata.CpuOptimizer.from_config({"type": "adamw"}, variant="x")
        with self.assertRaises(TypeError):  # not JSON-serializable
            strata.CpuOptimizer.from_config({"type": object()})
        self.assertUntouched()

    def test_closed(self):
        self.opt.close()
        self.assertTrue(self.opt.closed)
        with self.assertRaisesRegex(strata.Error, r"step\(\) on a closed "
                                    "optimizer") as cm:
            self.opt.step(self.p, self.g, self.m, self.v, step=1, lr=1e-3)
        self.assertEqual(cm.exception.code, "FailedPrecondition")
        self.assertIsInstance(cm.exception, RuntimeError)
        self.opt.close()  # idempotent
        self.assertUntouched()


if __name__ == "__main__":
    unittest.main()
