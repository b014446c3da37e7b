"""strata.Engine and strata.torch.offload on the host-emulated device (and
on CUDA where torch sees a GPU): a model trained with its parameters and
optimizer states on NVMe (a temp directory) under a device budget below the
model gives the losses of the same model trained in plain torch; bad inputs
raise clear exceptions."""

import copy
import os
import tempfile
import unittest

import strata

try:
    import torch
    import strata.torch as storch
except ImportError:  # pragma: no cover - python3-torch is a test package
    torch = None

STEPS = 12
LR = 2e-3
WEIGHT_DECAY = 0.01
KIB = 1024


def engine_config(nvme_dir, budget_bytes, **extra):
    strata_keys = {
        "params": "nvme",
        "optimizer_states": "nvme",
        "grads": "host",
        "nvme_paths": [nvme_dir],
        "device_budget_bytes": budget_bytes,
        "partition_bytes": 64 * KIB,
        "persistence_threshold_bytes": 0,
        # A temp directory may be tmpfs, which refuses O_DIRECT.
        "io": {"backend": "psync", "direct_io": False},
        "optimizer": {"weight_decay": WEIGHT_DECAY},
    }
    strata_keys.update(extra)
    return {"strata": strata_keys}


def make_mlp(seed):
    """A 3-layer MLP: 300,040 parameters, 600,080 bytes in bf16; its largest
    layer holds 512 x 512 weights (512 KiB in bf16)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 8),
    )


def batches(n, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=gen),
             torch.randn(32, 8, generator=gen)) for _ in range(n)]


def train_torch_mixed(model, data):
    """Plain torch with what the engine does: fp32 master weights under
    torch.optim.AdamW, forward and backward on a bf16 copy, the master
    rounded to bf16 after each step."""
    master = model
    work = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR,
                            weight_decay=WEIGHT_DECAY)
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(work(x.bfloat16()).float(), y)
        loss.backward()
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad = pw.grad.float()
            pw.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), work.parameters()):
                pw.copy_(pm)
        losses.append(loss.item())
    return losses, {k: v.detach().clone()
                    for k, v in master.named_parameters()}


def train_torch_fp32(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=LR,
                            weight_decay=WEIGHT_DECAY)
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_offloaded(off, data, begin_step=False):
    """A step per batch; with begin_step, Offloaded.begin_step before each
    forward and backward."""
    losses = []
    for x, y in data:
        if begin_step:
            off.begin_step(lr=LR)
        loss = torch.nn.functional.mse_loss(off(x.bfloat16()).float(), y)
        loss.backward()
        r = off.step(lr=LR)
        assert r.applied
        off.zero_grad()
        losses.append(loss.item())
    return losses


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class OffloadTrainingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="strata-offload-")
        self.addCleanup(self.tmp.cleanup)

    def check_same_losses_as_torch(self, device):
        """Trains make_mlp under a device budget below the model, on the
        host-emulated device ('host') or the GPU ('cuda'), against plain
        torch on the same torch device."""
        on = torch.device("cuda" if device == "cuda" else "cpu")
        data = [(x.to(on), y.to(on)) for x, y in batches(STEPS)]
        ref_losses, ref_master = train_torch_mixed(make_mlp(0).to(on), data)
        fp32_losses = train_torch_fp32(make_mlp(0).to(on), data)

        model = make_mlp(0)
        model_bytes = sum(p.numel() for p in model.parameters()) * 2
        budget = 576 * KIB
        self.assertLess(budget, model_bytes)
        cfg = engine_config(self.tmp.name, budget)
        with storch.offload(model, cfg, device=device) as off:
            self.assertEqual(off.device.type, on.type)
            # The model keeps no copy of its weights.
            for p in model.parameters():
                self.assertEqual(p.numel(), 0)
            losses = train_offloaded(off, data)
            stats = off.stats()
            masters = off.state_dict()
            self.assertEqual(off.engine.live_pins, 0)

        self.assertEqual(stats["steps"], STEPS)
        self.assertGreater(stats["nvme"]["resident_bytes"], 0)
        self.assertGreater(stats["nvme_read_bytes"], 0)
        self.assertGreater(stats["evictions"], 0)
        self.assertLessEqual(stats["device"]["peak_bytes"], budget)
        # The same arithmetic as the mixed-precision torch run (AdamW in
        # strata's kernel agrees with torch's within 1e-6 relative; a bf16
        # rounding that flips now and then is all that can differ).
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            self.assertAlmostEqual(a, b, delta=2e-3 * abs(b) + 1e-4,
                                   msg="loss of step %d" % i)
        for name, ref in ref_master.items():
            torch.testing.assert_close(masters[name], ref.cpu(), rtol=1e-3,
                                       atol=2e-4, msg=name)
        # And it learns what fp32 torch learns, within bf16's precision.
        for i, (a, b) in enumerate(zip(losses, fp32_losses)):
            self.assertAlmostEqual(a, b, delta=3e-2 * abs(b),
                                   msg="loss of step %d vs fp32" % i)
        self.assertLess(losses[-1], losses[0])

    def test_same_losses_as_torch_under_a_small_budget(self):
        self.check_same_losses_as_torch("host")

    def test_same_losses_as_torch_on_a_gpu(self):
        """The CUDA path: parameters fetched into CUDA memory that torch
        computes on, gradients handed over on torch's current stream.
        STRATA_REQUIRE_CUDA=1 (a GPU machine's check) makes a missing GPU a
        failure rather than a skip."""
        if not torch.cuda.is_available():
            if os.environ.get("STRATA_REQUIRE_CUDA") == "1":
                self.fail("STRATA_REQUIRE_CUDA=1 but torch sees no GPU")
            self.skipTest("torch sees no GPU")
        self.check_same_losses_as_torch("cuda")

    def test_begin_step_changes_no_loss_and_no_master(self):
        """Offloaded.begin_step before each forward and backward: the engine
        takes each unit's gradient statistics as backward hands its
        gradients over, and the losses and masters are step()'s alone, bit
        for bit."""
        data = batches(4)
        runs = []
        for begin in (False, True):
            d = os.path.join(self.tmp.name, "begun" if begin else "alone")
            os.mkdir(d)
            with storch.offload(make_mlp(0), engine_config(d, 768 * KIB),
                                device="host") as off:
                losses = train_offloaded(off, data, begin_step=begin)
                runs.append((losses, off.state_dict(), off.stats()))
        (losses, masters, stats), (b_losses, b_masters, b_stats) = runs
        self.assertEqual(b_losses, losses)
        for k in masters:
            torch.testing.assert_close(b_masters[k], masters[k], rtol=0,
                                       atol=0, msg=k)
        self.assertEqual(stats["early_statistics"], 0)
        self.assertGreaterEqual(b_stats["early_statistics"], len(data))

        with self.assertRaisesRegex(TypeError, "lr="):
            off.begin_step()

    def test_begin_step_with_tied_weights_and_a_module_called_twice(self):
        """A parameter shared by two modules, and a module called twice:
        their uses within one forward hand over their sum once (autograd adds them in fp32, as the engine adds separate
        hand-overs), so begin_step takes a weight tied between two modules
        and a module called twice: the losses and masters of step() alone,
        bit for bit, and of plain torch within bf16's rounding. A backward
        through two forwards hands a parameter over twice and is refused
        after begin_step, naming the rule."""
        torch.manual_seed(3)
        a = torch.nn.Linear(16, 16)
        b = torch.nn.Linear(16, 16)
        b.weight = a.weight  # tied

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = a, b

            def forward(self, x):
                return self.b(torch.tanh(self.a(self.a(x))))

        data = [(x[:, :16], y[:, :4].repeat(1, 4)) for x, y in batches(4)]
        ref_losses, _ = train_torch_mixed(copy.deepcopy(Net()), data)
        runs = []
        for begin in (False, True):
            d = os.path.join(self.tmp.name, "tied-%d" % begin)
            os.mkdir(d)
            with storch.offload(copy.deepcopy(Net()),
                                engine_config(d, 64 * KIB),
                                device="host") as off:
                # The tied weight is registered once, under its first name.
                self.assertEqual(sorted(off.ids),
                                 ["a.bias", "a.weight", "b.bias"])
                losses = train_offloaded(off, data, begin_step=begin)
                runs.append((losses, off.state_dict()))
        (losses, masters), (b_losses, b_masters) = runs
        self.assertEqual(b_losses, losses)
        for k in masters:
            torch.testing.assert_close(b_masters[k], masters[k], rtol=0,
                                       atol=0, msg=k)
        for a_, b_ in zip(losses, ref_losses):
            self.assertAlmostEqual(a_, b_, delta=5e-3 * abs(b_) + 1e-4)

        lin = torch.nn.Linear(16, 16)
        d = os.path.join(self.tmp.name, "two-forwards")
        os.mkdir(d)
        with storch.offload(torch.nn.Sequential(lin),
                            engine_config(d, 64 * KIB),
                            device="host") as off:
            off.begin_step(lr=LR)
            x = torch.randn(4, 16).bfloat16()
            loss = off(x).float().sum() + off(x).float().sum()
            with self.assertRaisesRegex(strata.Error, "last gradient"):
                loss.backward()

    def test_checkpoint_round_trip_and_comm(self):
        """A checkpoint saved mid-run (over a 'single' communicator) loads
        into an offload of a freshly initialized model: the same masters bit
        for bit, and the next steps give the same losses and masters as the
        run that went on."""
        data = batches(5)
        ckpt = os.path.join(self.tmp.name, "ckpt")
        first = os.path.join(self.tmp.name, "first")
        second = os.path.join(self.tmp.name, "second")
        os.mkdir(first)
        os.mkdir(second)
        comm = strata.Communicator("single")
        with storch.offload(make_mlp(0), engine_config(first, 768 * KIB),
                            device="host", comm=comm) as off:
            self.assertEqual(off.engine.world_size, 1)
            train_offloaded(off, data[:3])
            at_save = off.state_dict()
            path = off.save_checkpoint(ckpt, 3, params=True)
            want_losses = train_offloaded(off, data[3:])
            want = off.state_dict()
        with storch.offload(make_mlp(5), engine_config(second, 768 * KIB),
                            device="host") as off:
            self.assertEqual(off.load_checkpoint(ckpt), path)
            got = off.state_dict()
            for k in at_save:
                torch.testing.assert_close(got[k], at_save[k], rtol=0, atol=0)
            losses = train_offloaded(off, data[3:])
            got = off.state_dict()
        self.assertEqual(losses, want_losses)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
            self.assertFalse(torch.equal(want[k], at_save[k]), k)
        off.close()
        with self.assertRaisesRegex(strata.Error, "closed"):
            off.save_checkpoint(ckpt, 4)

    def test_eval_without_grad_and_state_dict(self):
        model = make_mlp(1)
        expect = {k: v.detach().clone() for k, v in model.named_parameters()}
        x = torch.randn(4, 64)
        with torch.no_grad():
            want = copy.deepcopy(model).to(torch.bfloat16)(x.bfloat16())
        with storch.offload(model, engine_config(self.tmp.name, 768 * KIB),
                            device="host") as off:
            self.assertEqual(off.dtype, torch.bfloat16)
            with torch.no_grad():
                got = off(x.bfloat16())
            torch.testing.assert_close(got, want)
            masters = off.state_dict()
            self.assertEqual(off.engine.live_pins, 0)
        self.assertEqual(set(masters), set(expect))
        for k in expect:
            torch.testing.assert_close(masters[k], expect[k], rtol=0, atol=0)


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class EngineBindingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="strata-engine-")
        self.addCleanup(self.tmp.cleanup)
        cfg = engine_config(self.tmp.name, 256 * KIB)
        import json
        self.eng = strata.Engine(json.dumps(cfg), device="host")
        self.addCleanup(self.eng.close)
        self.w = self.eng.register("w", [8, 16])
        self.eng.start()
        self.values = torch.randn(8, 16)
        self.eng.set_initial_values(self.w, self.values)

    def test_fetch_add_grad_step(self):
        eng = self.eng
        self.assertEqual(eng.device_kind, "host-emulated")
        self.assertEqual(eng.tensor(self.w), ("w", (8, 16), "bfloat16"))
        with eng.fetch(self.w) as pin:
            self.assertEqual(pin.dtype, "bfloat16")
            self.assertEqual(pin.shape, (8, 16))
            t = torch.from_dlpack(pin)
        self.assertEqual(t.dtype, torch.bfloat16)
        torch.testing.assert_close(t, self.values.bfloat16())
        self.assertEqual(eng.live_pins, 1)  # the tensor holds it
        del t
        self.assertEqual(eng.live_pins, 0)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            eng.add_grad(self.w, torch.full((8, 16), 0.5, dtype=dtype))
        r = eng.step(lr=0.1)
        self.assertTrue(r.applied)
        self.assertEqual(r.step, 1)
        self.assertAlmostEqual(r.grad_norm, 1.5 * (8 * 16) ** 0.5, places=4)
        out = torch.empty(8, 16)
        eng.read_master(self.w, out)
        # AdamW's first step moves each weight by lr against the gradient.
        torch.testing.assert_close(
            out, self.values * (1 - 0.1 * WEIGHT_DECAY) - 0.1,
            rtol=1e-5, atol=1e-5)

    def test_the_engine_owns_a_dynamic_loss_scale(self):
        import json
        cfg = engine_config(self.tmp.name + "/fp16", 256 * KIB)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4,
                       "hysteresis": 1}
        os.makedirs(self.tmp.name + "/fp16")
        eng = strata.Engine(json.dumps(cfg), device="host")
        self.addCleanup(eng.close)
        w = eng.register("w", [8, 16])
        eng.start()
        self.assertEqual(eng.loss_scale, 16.0)
        g = torch.full((8, 16), 0.5 * eng.loss_scale)
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    "differs from the engine's"):
            eng.step(lr=0.1, loss_scale=2.0)
        g[0, 0] = float("inf")
        eng.add_grad(w, g)
        r = eng.step(lr=0.1)
        self.assertFalse(r.applied)
        self.assertEqual(r.loss_scale, 16.0)
        self.assertEqual(eng.loss_scale, 8.0)
        eng.add_grad(w, torch.full((8, 16), 0.5 * eng.loss_scale))
        r = eng.step(lr=0.1)
        self.assertTrue(r.applied)
        self.assertEqual(r.loss_scale, 8.0)
        self.assertAlmostEqual(r.grad_norm, 0.5 * (8 * 16) ** 0.5, places=4)
        self.assertEqual(eng.stats()["loss_scale"], 8.0)

    def test_bad_inputs(self):
        eng = self.eng
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            eng.add_grad(self.w, torch.zeros(16, 8).t())
        with self.assertRaisesRegex(TypeError, "int64"):
            eng.add_grad(self.w, torch.zeros(8, 16, dtype=torch.int64))
        with self.assertRaisesRegex(ValueError, "128 elements"):
            eng.add_grad(self.w, torch.zeros(8, 15))
        with self.assertRaisesRegex(TypeError, "DLPack"):
            eng.add_grad(self.w, [0.0] * 128)
        with self.assertRaises(strata.InvalidArgumentError) as cm:
            eng.fetch(5)
        self.assertEqual(cm.exception.code, "InvalidArgument")
        self.assertIn("not registered", str(cm.exception))
        with self.assertRaises(strata.Error) as cm:
            eng.register("late", [4])
        self.assertIn("after Start", str(cm.exception))
        with self.assertRaisesRegex(TypeError, "float64"):
            eng.read_master(self.w, torch.empty(8, 16, dtype=torch.float64))
        # Nothing was corrupted: the master is the initial values.
        out = torch.empty(8, 16)
        eng.read_master(self.w, out)
        torch.testing.assert_close(out, self.values, rtol=0, atol=0)

    def test_released_pin_and_closed_engine(self):
        pin = self.eng.fetch(self.w)
        t = torch.from_dlpack(pin)
        pin.release()
        with self.assertRaisesRegex(strata.Error, "released pin"):
            pin.wait()
        self.eng.close()
        self.assertTrue(self.eng.closed)
        # The tensor still reads the engine's memory: the engine is
        # destroyed only with the last view.
        torch.testing.assert_close(t, self.values.bfloat16())
        for call in (lambda: self.eng.fetch(self.w),
                     lambda: self.eng.step(lr=1.0),
                     lambda: self.eng.add_grad(self.w, torch.zeros(8, 16)),
                     lambda: self.eng.stats()):
            with self.assertRaisesRegex(strata.Error, "closed engine") as cm:
                call()
            self.assertEqual(cm.exception.code, "FailedPrecondition")
        del t
        self.eng.close()  # twice is fine

    def test_bad_config_names_its_path(self):
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    "strata.prefetch_byte"):
            strata.Engine('{"strata": {"prefetch_byte": 1}}', device="host")
        with self.assertRaisesRegex(ValueError, "accepted 'auto'"):
            strata.Engine("{}", device="tpu")


@unittest.skipIf(torch is None, "needs torch (python3-torch)")
class OffloadMisuseTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="strata-offload-")
        self.addCleanup(self.tmp.cleanup)
        self.cfg = engine_config(self.tmp.name, 768 * KIB)

    def test_closed(self):
        model = make_mlp(2)
        off = storch.offload(model, self.cfg, device="host")
        off.close()
        self.assertTrue(off.closed)
        with self.assertRaisesRegex(strata.Error, "closed"):
            off.step(lr=1e-3)
        with self.assertRaisesRegex(strata.Error, "closed"):
            off.state_dict()
        # The hooks are gone: the model is left with its placeholders.
        with self.assertRaises(RuntimeError):
            model(torch.randn(2, 64).bfloat16())

    def test_bad_models_and_configs(self):
        with self.assertRaisesRegex(TypeError, "torch.nn.Module"):
            storch.offload(object(), self.cfg, device="host")
        frozen = make_mlp(3)
        frozen[0].weight.requires_grad_(False)
        with self.assertRaisesRegex(ValueError, "0.weight does not require"):
            storch.offload(frozen, self.cfg, device="host")
        with self.assertRaisesRegex(ValueError, "working dtype is float32"):
            storch.offload(make_mlp(3), {"strata": {"working_dtype": "fp32"}},
                           device="host")
        with self.assertRaisesRegex(strata.InvalidArgumentError,
                                    "strata.optimizer.wieght_decay"):
            storch.offload(make_mlp(3),
                           {"strata": {"optimizer": {"wieght_decay": 0.1}}},
                           device="host")
        with self.assertRaisesRegex(TypeError, "config must be"):
            storch.offload(make_mlp(3), 42, device="host")
        model = make_mlp(4)
        with storch.offload(model, self.cfg, device="host"):
            with self.assertRaisesRegex(ValueError, "offloaded already"):
                storch.offload(model, self.cfg, device="host")

    def test_budget_too_small_for_a_layer(self):
        cfg = engine_config(self.tmp.name, 64 * KIB)
        with storch.offload(make_mlp(5), cfg, device="host") as off:
            with self.assertRaises(strata.Error) as cm:
                off(torch.randn(2, 64).bfloat16())
            self.assertEqual(cm.exception.code, "OutOfMemory")
            # The failed forward held nothing back.
            self.assertEqual(off.engine.live_pins, 0)
            for p in off.parameters():
                self.assertEqual(p.numel(), 0)


if __name__ == "__main__":
    unittest.main()
