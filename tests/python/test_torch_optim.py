"""strata.torch.Adam/AdamW/Adagrad/Lion against torch.optim (and a Lion
reference written as lion-pytorch's): trajectories, state_dict round trips
both ways, bf16 moments, working copies, and bad inputs."""

import copy
import unittest

import strata

try:
    import torch
    import strata.torch as storch
except ImportError:  # pragma: no cover - python3-torch is a test package
    torch = None

STEPS = 100


def make_groups(seed):
    """Three parameter groups with their own hyper-parameters, as a model
    with decayed, undecayed and differently tuned weights has. Weights are
    drawn away from zero (|w| >= 0.5) and the learning rates keep 100 steps
    from moving them across it: a weight that crosses zero has no meaningful
    relative error (its value is a cancellation)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [[(64, 33), (33,)], [(17, 5, 3)], [(1000,), (7, 7)]]
    hyper = [dict(lr=2e-3, weight_decay=0.1),
             dict(lr=3e-3, weight_decay=0.0, betas=(0.8, 0.99)),
             dict(lr=1e-3, weight_decay=0.01, eps=1e-6)]
    groups = []
    for group_shapes, h in zip(shapes, hyper):
        params = []
        for s in group_shapes:
            w = torch.randn(s, generator=gen)
            params.append(torch.nn.Parameter(w.sign() * (0.5 + w.abs())))
        groups.append(dict(params=params, **h))
    return groups


def clone_groups(groups):
    return [dict(g, params=[torch.nn.Parameter(p.detach().clone())
                            for p in g["params"]]) for g in groups]


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def set_grads(opts, step, seed=1234):
    """The same gradient for the same parameter of each optimizer."""
    gen = torch.Generator().manual_seed(seed + step)
    for ps in zip(*[params_of(o) for o in opts]):
        g = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = g.clone()


def max_rel_err(a, b):
    """max |a - b| / |b| over the elements where b is a normal float (a
    moment may underflow or be exactly zero)."""
    a = a.detach().double().flatten()
    b = b.detach().double().flatten()
    normal = b.abs() >= torch.finfo(torch.float32).tiny
    if not bool(normal.any()):
        return 0.0
    return ((a - b).abs()[normal] / b.abs()[normal]).max().item()


@unittest.skipIf(torch is None, "needs torch")
class TrajectoryTest(unittest.TestCase):
    def run_pair(self, ours, theirs, steps):
        for step in range(steps):
            set_grads([ours, theirs], step)
            ours.step()
            theirs.step()

    def assert_close(self, ours, theirs, tol, moments=True):
        worst = 0.0
        for p, q in zip(params_of(ours), params_of(theirs)):
            worst = max(worst, max_rel_err(p, q))
            if moments and p in ours.state:
                s, t = ours.state[p], theirs.state[q]
                self.assertEqual(int(s["step"].item()), int(t["step"].item()))
                worst = max(worst, max_rel_err(s["exp_avg"], t["exp_avg"]))
                worst = max(worst, max_rel_err(s["exp_avg_sq"], t["exp_avg_sq"]))
        self.assertLessEqual(worst, tol)
        return worst

    def test_adamw_100_steps_param_groups_weight_decay(self):
        groups = make_groups(0)
        ours = storch.AdamW(clone_groups(groups), betas=(0.9, 0.999),
                            threads=2)
        theirs = torch.optim.AdamW(clone_groups(groups), betas=(0.9, 0.999))
        self.run_pair(ours, theirs, STEPS)
        self.assert_close(ours, theirs, 1e-6)

    def test_adam_l2_matches_torch_adam(self):
        groups = make_groups(1)
        ours = storch.Adam(clone_groups(groups), threads=2)
        theirs = torch.optim.Adam(clone_groups(groups))
        self.run_pair(ours, theirs, 30)
        self.assert_close(ours, theirs, 1e-6)

    def test_lr_schedule_and_params_without_grad(self):
        groups = make_groups(2)
        ours = storch.AdamW(clone_groups(groups), threads=1)
        theirs = torch.optim.AdamW(clone_groups(groups))
        sched = [torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.5)
                 for o in (ours, theirs)]
        for step in range(12):
            set_grads([ours, theirs], step)
            for o in (ours, theirs):
                params_of(o)[1].grad = None  # never stepped
                o.step()
            for s in sched:
                s.step()
        self.assert_close(ours, theirs, 1e-6)
        self.assertNotIn(params_of(ours)[1], ours.state)

    def test_bf16_moments(self):
        groups = make_groups(3)
        ours = storch.AdamW(clone_groups(groups), moment_dtype=torch.bfloat16,
                            threads=2)
        theirs = torch.optim.AdamW(clone_groups(groups))
        self.run_pair(ours, theirs, 20)
        for p in params_of(ours):
            self.assertEqual(ours.state[p]["exp_avg"].dtype, torch.bfloat16)
            self.assertEqual(ours.state[p]["exp_avg_sq"].dtype, torch.bfloat16)
        # bf16 moments round to 8 bits of mantissa: the weights stay within
        # lr-sized differences of fp32 training, not bitwise.
        for p, q in zip(params_of(ours), params_of(theirs)):
            self.assertLess((p - q).abs().max().item(), 2e-2)
        # Its state_dict loads into torch (which casts the moments to fp32).
        torch_copy = torch.optim.AdamW(clone_groups(groups))
        torch_copy.load_state_dict(ours.state_dict())
        q = params_of(torch_copy)[0]
        self.assertEqual(torch_copy.state[q]["exp_avg"].dtype, torch.float32)

    def test_working_copy_written_in_the_same_pass(self):
        groups = make_groups(4)
        ours = storch.AdamW(clone_groups(groups), threads=2)
        theirs = torch.optim.AdamW(clone_groups(groups))
        for dtype in (torch.bfloat16, torch.float16):
            working = [[torch.zeros(p.shape, dtype=dtype) for p in g["params"]]
                       for g in ours.param_groups]
            for step in range(5):
                set_grads([ours, theirs], step)
                ours.step(fp16_param_groups=working)
                theirs.step()
                for p, w in zip(params_of(ours), sum(working, [])):
                    self.assertTrue(torch.equal(w, p.detach().to(dtype)))
        self.assert_close(ours, theirs, 1e-6)

    def test_deepspeed_signature(self):
        groups = make_groups(5)
        ours = storch.CPUAdam(clone_groups(groups), lr=1e-3, weight_decay=0.01,
                              adamw_mode=True)
        self.assertIsInstance(ours, storch.AdamW)
        theirs = torch.optim.AdamW(clone_groups(groups), lr=1e-3,
                                   weight_decay=0.01)
        self.run_pair(ours, theirs, 5)
        self.assert_close(ours, theirs, 1e-6)
        self.assertIsInstance(storch.CPUAdam(clone_groups(groups),
                                             adamw_mode=False), storch.Adam)


def with_hyper(groups, hyper):
    """The groups' parameters with other per-group hyper-parameters."""
    return [dict(params=g["params"], **h) for g, h in zip(groups, hyper)]


if torch is not None:
    class LionReference(torch.optim.Optimizer):
        """lion-pytorch's Lion update, op by op, on torch tensors."""

        def __init__(self, params, lr=1e-4, betas=(0.9, 0.99),
                     weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas,
                                          weight_decay=weight_decay))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                lr, wd = group["lr"], group["weight_decay"]
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                    exp_avg = state["exp_avg"]
                    p.data.mul_(1 - lr * wd)
                    update = exp_avg.clone().mul_(beta1).add(
                        p.grad, alpha=1 - beta1).sign_()
                    p.add_(update, alpha=-lr)
                    exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


# Adagrad moves a weight by about lr / sqrt(t) a step (20 lr in 100 steps):
# these keep the weights of make_groups away from zero.
ADAGRAD_HYPER = [dict(lr=5e-3, weight_decay=0.1, lr_decay=0.01),
                 dict(lr=3e-3, initial_accumulator_value=0.5),
                 dict(lr=2e-3, weight_decay=0.01, eps=1e-6)]
LION_HYPER = [dict(lr=2e-4, weight_decay=0.1),
              dict(lr=1e-4, betas=(0.8, 0.95)),
              dict(lr=3e-4, weight_decay=0.01)]


@unittest.skipIf(torch is None, "needs torch")
class AdagradLionTest(unittest.TestCase):
    def run_and_compare(self, ours, theirs, keys, steps, tol):
        for step in range(steps):
            set_grads([ours, theirs], step)
            ours.step()
            theirs.step()
        worst = 0.0
        for p, q in zip(params_of(ours), params_of(theirs)):
            worst = max(worst, max_rel_err(p, q))
            for key in keys:
                worst = max(worst, max_rel_err(ours.state[p][key],
                                               theirs.state[q][key]))
        self.assertLessEqual(worst, tol)

    def test_adagrad_100_steps_matches_torch(self):
        groups = with_hyper(make_groups(20), ADAGRAD_HYPER)
        ours = storch.Adagrad(clone_groups(groups), threads=2,
                              initial_accumulator_value=0.25)
        theirs = torch.optim.Adagrad(clone_groups(groups),
                                     initial_accumulator_value=0.25)
        # State exists before the first step, as torch's does, filled with
        # the constructor's value (torch ignores group 1's own 0.5 there).
        for p, q in zip(params_of(ours), params_of(theirs)):
            self.assertTrue(torch.equal(ours.state[p]["sum"],
                                        theirs.state[q]["sum"]))
            self.assertTrue(torch.equal(ours.state[p]["sum"],
                                        torch.full(p.shape, 0.25)))
        self.run_and_compare(ours, theirs, ["sum"], STEPS, 1e-6)

    def handover(self, groups, first, make_second, reference, steps):
        """first and reference train `steps` steps; second, made on a copy
        of first's weights, loads first's state_dict and goes on `steps`
        more beside reference. Returns second."""
        for step in range(steps):
            set_grads([first, reference], step)
            first.step()
            reference.step()
        second_groups = clone_groups(groups)
        for g, src in zip(second_groups, first.param_groups):
            for p, q in zip(g["params"], src["params"]):
                p.data.copy_(q.detach())
        second = make_second(second_groups)
        second.load_state_dict(copy.deepcopy(first.state_dict()))
        for step in range(steps, 2 * steps):
            set_grads([second, reference], step)
            second.step()
            reference.step()
        for p, q in zip(params_of(second), params_of(reference)):
            self.assertLessEqual(max_rel_err(p, q), 1e-6)
        return second

    def test_adagrad_state_dict_both_ways(self):
        groups = with_hyper(make_groups(21), ADAGRAD_HYPER)
        for first_cls, second_cls in ((torch.optim.Adagrad, storch.Adagrad),
                                      (storch.Adagrad, torch.optim.Adagrad)):
            reference = torch.optim.Adagrad(clone_groups(groups))
            second = self.handover(groups, first_cls(clone_groups(groups)),
                                   second_cls, reference, 5)
            for p, q in zip(params_of(second), params_of(reference)):
                self.assertLessEqual(
                    max_rel_err(second.state[p]["sum"],
                                reference.state[q]["sum"]), 1e-6)
                self.assertEqual(int(second.state[p]["step"].item()), 10)

    def test_lion_100_steps_matches_reference(self):
        groups = with_hyper(make_groups(22), LION_HYPER)
        ours = storch.Lion(clone_groups(groups), threads=2)
        theirs = LionReference(clone_groups(groups))
        self.run_and_compare(ours, theirs, ["exp_avg"], STEPS, 1e-6)

    def test_lion_loads_a_state_without_step(self):
        groups = with_hyper(make_groups(23), LION_HYPER)
        second = self.handover(groups, LionReference(clone_groups(groups)),
                               storch.Lion,
                               LionReference(clone_groups(groups)), 5)
        for p in params_of(second):  # counted from the load
            self.assertEqual(int(second.state[p]["step"].item()), 5)

    def test_bf16_state_and_deepspeed_constructors(self):
        groups = with_hyper(make_groups(24), ADAGRAD_HYPER)
        ours = storch.CPUAdagrad(clone_groups(groups), lr=2e-3,
                                 fp32_optimizer_states=False)
        self.assertIsInstance(ours, storch.Adagrad)
        theirs = torch.optim.Adagrad(clone_groups(groups), lr=2e-3)
        for step in range(10):
            set_grads([ours, theirs], step)
            ours.step()
            theirs.step()
        for p, q in zip(params_of(ours), params_of(theirs)):
            self.assertEqual(ours.state[p]["sum"].dtype, torch.bfloat16)
            self.assertLess((p - q).abs().max().item(), 2e-2)
        lion = storch.CPULion(clone_groups(groups), lr=1e-3,
                              fp32_optimizer_states=False)
        self.assertIsInstance(lion, storch.Lion)
        set_grads([lion], 0)
        lion.step()
        p = params_of(lion)[0]
        self.assertEqual(lion.state[p]["exp_avg"].dtype, torch.bfloat16)
        with self.assertRaisesRegex(ValueError, "amsgrad=True"):
            storch.CPUAdagrad(clone_groups(groups), amsgrad=True)

    def test_refused_options_and_ranges(self):
        p = [torch.nn.Parameter(torch.zeros(4))]
        with self.assertRaisesRegex(ValueError, "strata.torch.Adagrad: "
                                    "maximize=True is not supported"):
            storch.Adagrad(p, maximize=True)
        with self.assertRaisesRegex(ValueError, "Invalid lr_decay value"):
            storch.Adagrad(p, lr_decay=-1)
        with self.assertRaisesRegex(ValueError, "Invalid beta parameter at "
                                    "index 1"):
            storch.Lion(p, betas=(0.9, 1.0))
        with self.assertRaisesRegex(TypeError, "strata.torch.Lion: "
                                    "moment_dtype"):
            storch.Lion(p, moment_dtype=torch.float16)
        lion = storch.Lion(p)
        lion.close()
        p[0].grad = torch.zeros(4)
        with self.assertRaisesRegex(strata.Error, "after close"):
            lion.step()


@unittest.skipIf(torch is None, "needs torch")
class StateDictTest(unittest.TestCase):
    def roundtrip(self, first_cls, second_cls, first_kw, second_kw):
        """first trains 10 steps, hands its state_dict to second, both go on
        10 steps beside a reference that never switched."""
        groups = make_groups(6)
        first = first_cls(clone_groups(groups), **first_kw)
        reference = torch.optim.AdamW(clone_groups(groups))
        for step in range(10):
            set_grads([first, reference], step)
            first.step()
            reference.step()
        saved = copy.deepcopy(first.state_dict())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            self.assertIn(key, saved["state"][0])
        second_groups = clone_groups(groups)
        for g, src in zip(second_groups, first.param_groups):
            for p, q in zip(g["params"], src["params"]):
                p.data.copy_(q.detach())
        second = second_cls(second_groups, **second_kw)
        second.load_state_dict(saved)
        for step in range(10, 20):
            set_grads([second, reference], step)
            second.step()
            reference.step()
        for p, q in zip(params_of(second), params_of(reference)):
            self.assertLessEqual(max_rel_err(p, q), 1e-6)
            self.assertEqual(int(second.state[p]["step"].item()), 20)
        return second

    def test_torch_to_strata(self):
        second = self.roundtrip(torch.optim.AdamW, storch.AdamW, {},
                                dict(threads=2))
        p = params_of(second)[0]
        self.assertTrue(torch.is_tensor(second.state[p]["step"]))

    def test_strata_to_torch(self):
        self.roundtrip(storch.AdamW, torch.optim.AdamW, dict(threads=2), {})

    def test_strata_to_strata_bf16_converts_loaded_moments(self):
        groups = make_groups(7)
        first = torch.optim.AdamW(clone_groups(groups))
        set_grads([first], 0)
        first.step()
        second = storch.AdamW(clone_groups(groups),
                              moment_dtype=torch.bfloat16)
        second.load_state_dict(first.state_dict())
        set_grads([second], 1)
        second.step()
        p = params_of(second)[0]
        self.assertEqual(second.state[p]["exp_avg"].dtype, torch.bfloat16)
        self.assertEqual(int(second.state[p]["step"].item()), 2)

    def test_amsgrad_state_is_refused(self):
        groups = make_groups(8)
        first = torch.optim.AdamW(clone_groups(groups), amsgrad=True)
        second = storch.AdamW(clone_groups(groups))
        second.load_state_dict(first.state_dict())
        set_grads([second], 0)
        with self.assertRaisesRegex(ValueError, "amsgrad=True is not "
                                    "supported"):
            second.step()


@unittest.skipIf(torch is None, "needs torch")
class BadInputTest(unittest.TestCase):
    def test_refused_options(self):
        p = [torch.nn.Parameter(torch.zeros(4))]
        with self.assertRaisesRegex(ValueError, "amsgrad=True is not "
                                    "supported"):
            storch.AdamW(p, amsgrad=True)
        with self.assertRaisesRegex(ValueError, "maximize=True"):
            storch.Adam(p, maximize=True)
        with self.assertRaisesRegex(ValueError, "Invalid beta parameter at "
                                    "index 1"):
            storch.AdamW(p, betas=(0.9, 1.0))
        with self.assertRaisesRegex(TypeError, "moment_dtype"):
            storch.AdamW(p, moment_dtype=torch.float16)

    def test_wrong_param_dtype(self):
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        with self.assertRaisesRegex(TypeError, r"parameter 0 of group 0 is "
                                    r"torch.float64.*float32"):
            storch.AdamW([p])

    def test_non_contiguous_param(self):
        base = torch.randn(8, 4)
        p = torch.nn.Parameter(base.t())  # a transposed view
        self.assertFalse(p.is_contiguous())
        before = p.detach().clone()
        opt = storch.AdamW([p])
        p.grad = torch.ones(4, 8)
        with self.assertRaisesRegex(ValueError, r"parameter 0 of group 0: "
                                    r"master is not contiguous"):
            opt.step()
        self.assertTrue(torch.equal(p.detach(), before))

    def test_non_contiguous_grad(self):
        p = torch.nn.Parameter(torch.randn(4, 8))
        before = p.detach().clone()
        opt = storch.AdamW([p])
        p.grad = torch.ones(8, 4).t()
        with self.assertRaisesRegex(ValueError, "grad is not contiguous"):
            opt.step()
        self.assertTrue(torch.equal(p.detach(), before))

    def test_wrong_working_copy(self):
        p = torch.nn.Parameter(torch.randn(16))
        opt = storch.AdamW([p])
        p.grad = torch.ones(16)
        with self.assertRaisesRegex(TypeError, "working has dtype float32; "
                                    "accepted: float16 or bfloat16"):
            opt.step(fp16_param_groups=[torch.zeros(16)])
        with self.assertRaisesRegex(ValueError, "working has 15 elements"):
            opt.step(fp16_param_groups=[torch.zeros(15,
                                                    dtype=torch.bfloat16)])
        with self.assertRaisesRegex(ValueError, "fp16_param_groups has 2 "
                                    "groups"):
            opt.step(fp16_param_groups=[[], []])

    def test_low_level_int_tensor_and_used_capsule(self):
        n = 32
        p, g, m, v = (torch.zeros(n) for _ in range(4))
        with strata.CpuOptimizer(threads=1) as opt:
            with self.assertRaisesRegex(TypeError, "grad has dtype int64"):
                opt.step(p, torch.zeros(n, dtype=torch.int64), m, v, step=1,
                         lr=1e-3)
            capsule = torch.utils.dlpack.to_dlpack(g)
            torch.utils.dlpack.from_dlpack(capsule)  # consumes it
            with self.assertRaisesRegex(ValueError, "already consumed"):
                opt.step(p, capsule, m, v, step=1, lr=1e-3)
            # bf16 moments and gradient straight from torch.
            mb = torch.zeros(n, dtype=torch.bfloat16)
            vb = torch.zeros(n, dtype=torch.bfloat16)
            self.assertTrue(opt.step(p, torch.ones(n, dtype=torch.bfloat16),
                                     mb, vb, step=1, lr=1e-3))
            self.assertTrue(bool((p < 0).all()))

    def test_closed_optimizer(self):
        p = torch.nn.Parameter(torch.randn(16))
        opt = storch.AdamW([p])
        p.grad = torch.ones(16)
        opt.step()
        opt.close()
        before = p.detach().clone()
        with self.assertRaisesRegex(strata.Error, r"step\(\) after close"):
            opt.step()
        self.assertTrue(torch.equal(p.detach(), before))


def factored_reference():
    """The NumPy reference of Adafactor the C++ suites use."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "..", "cpu_adam"))
    import factored_reference as ref
    return ref


@unittest.skipIf(torch is None, "needs torch")
class AdafactorTest(unittest.TestCase):
    """strata.torch.Adafactor against the NumPy reference of HF's algorithm
    (transformers is not a test package), its state keys and round trips."""

    SHAPES = [(30, 100), (50,)]
    CONFIGS = [
        ({}, {}),  # HF's defaults: relative step, scale_parameter
        (dict(lr=0.02, relative_step=False, beta1=0.9, clip_threshold=0.5,
              decay_rate=-0.7, weight_decay=0.01, eps=(1e-30, 2e-3)),
         {"lr": "0.02", "relative_step": "0", "beta1": "0.9",
          "clip_threshold": "0.5", "decay_rate": "-0.7",
          "weight_decay": "0.01", "eps2": "2e-3"}),
    ]

    def grads(self, shape, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=gen) for _ in range(steps)]

    def test_matches_the_numpy_reference(self):
        ref = factored_reference()
        import numpy as np
        steps = 6
        for kwargs, kw in self.CONFIGS:
            with self.subTest(kwargs=kwargs):
                gen = torch.Generator().manual_seed(3)
                params = [torch.nn.Parameter(torch.randn(s, generator=gen))
                          for s in self.SHAPES]
                init = [p.detach().clone() for p in params]
                grads = [self.grads(s, steps, 10 + i)
                         for i, s in enumerate(self.SHAPES)]
                opt = storch.Adafactor(params, threads=2, **kwargs)
                for t in range(steps):
                    for p, g in zip(params, grads):
                        p.grad = g[t].clone()
                    opt.step()
                for p, p0, g in zip(params, init, grads):
                    rows, cols = ((p.shape[0], p.shape[1]) if p.dim() == 2
                                  else (0, p.numel()))
                    rp, rstats, rm = ref.adafactor(
                        p0.numpy().ravel().copy(),
                        [x.numpy().ravel() for x in g], rows, cols, steps,
                        kw)
                    np.testing.assert_allclose(p.detach().numpy().ravel(),
                                               rp.ravel(), rtol=1e-5,
                                               atol=1e-7)
                    st = opt.state[p]
                    self.assertEqual(st["step"], steps)
                    if rows:
                        got = torch.cat([st["exp_avg_sq_row"],
                                         st["exp_avg_sq_col"]])
                    else:
                        got = st["exp_avg_sq"]
                        rstats = rstats[1:]  # the reference's unused row
                    np.testing.assert_allclose(got.numpy(), rstats,
                                               rtol=1e-5)
                    if "beta1" in kwargs:
                        np.testing.assert_allclose(
                            st["exp_avg"].numpy().ravel(), rm.ravel(),
                            rtol=1e-5, atol=1e-9)
                    else:
                        self.assertNotIn("exp_avg", st)

    def test_state_dict_round_trips_with_hfs_keys(self):
        kwargs = self.CONFIGS[1][0]
        gen = torch.Generator().manual_seed(5)
        a = [torch.nn.Parameter(torch.randn(s, generator=gen))
             for s in self.SHAPES]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        opt_a = storch.Adafactor(a, threads=1, **kwargs)
        grads = [self.grads(s, 6, 20 + i) for i, s in enumerate(self.SHAPES)]
        for t in range(3):
            for p, g in zip(a, grads):
                p.grad = g[t].clone()
            opt_a.step()
        sd = opt_a.state_dict()
        self.assertEqual(set(sd["state"][0]),
                         {"step", "exp_avg", "exp_avg_sq_row",
                          "exp_avg_sq_col"})
        self.assertEqual(set(sd["state"][1]),
                         {"step", "exp_avg", "exp_avg_sq"})
        self.assertIn("_stats", opt_a.state[a[0]])  # the live state kept it
        for q, p in zip(b, a):
            q.data.copy_(p.detach())
        opt_b = storch.Adafactor(b, threads=2, **kwargs)
        opt_b.load_state_dict(copy.deepcopy(sd))
        for t in range(3, 6):
            for ps, g in zip(zip(a, b), grads):
                for p in ps:
                    p.grad = g[t].clone()
            opt_a.step()
            opt_b.step()
        for p, q in zip(a, b):
            self.assertTrue(torch.equal(p.detach(), q.detach()))
        self.assertEqual(opt_b.state[b[0]]["step"], 6)
        # The loaded statistics were packed into one array again.
        st = opt_b.state[b[0]]
        self.assertEqual(st["exp_avg_sq_col"].data_ptr(),
                         st["_stats"][a[0].shape[0]:].data_ptr())

    def test_refusals(self):
        p = torch.nn.Parameter(torch.zeros(2, 3, 4))
        opt = storch.Adafactor([p])
        p.grad = torch.ones_like(p)
        with self.assertRaisesRegex(ValueError,
                                    r"parameter 0 of group 0: a 3-dimens"):
            opt.step()
        with self.assertRaisesRegex(ValueError, "relative_step"):
            storch.Adafactor([p], lr=1e-3)
        with self.assertRaisesRegex(ValueError, "warmup_init"):
            storch.Adafactor([p], lr=1e-3, relative_step=False,
                             warmup_init=True)
        q = torch.nn.Parameter(torch.zeros(4, 4))
        q.grad = torch.ones_like(q)
        with self.assertRaisesRegex(ValueError, "clip_threshold"):
            storch.Adafactor([q], clip_threshold=0.0).step()


if __name__ == "__main__":
    unittest.main()
