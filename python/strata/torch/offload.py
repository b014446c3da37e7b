"""``strata.torch.offload``: a torch module whose parameters rest in strata.

The parameters live in a ``strata.Engine`` (host memory or NVMe, as the config
says); the module keeps empty placeholders. Each submodule fetches its own
parameters just before its forward and lets them go after it; backward
fetches them again where autograd needs them; each gradient is handed to the
engine as soon as backward produces it; ``step()`` is the engine's optimizer.
docs/python.md describes the mechanism and its limits.
"""

import functools
import json
import os

import torch

from strata import _strata

__all__ = ["offload", "Offloaded"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _storage_ptr(t):
    if hasattr(t, "untyped_storage"):  # torch 2.x
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()  # torch 1.13


class _Saved:
    """What autograd keeps instead of a view of a fetched parameter."""

    __slots__ = ("pid", "size", "stride", "offset")

    def __init__(self, pid, size, stride, offset):
        self.pid, self.size, self.stride, self.offset = pid, size, stride, offset


class _Use(torch.autograd.Function):
    """The working copy of one parameter as a node of the graph: its first
    use in a forward.

    forward returns the fetched tensor and a token: an fp32 tensor of the
    parameter's shape that holds no memory (stride 0), through which the
    parameter's later uses in the same forward (a weight tied between
    modules, a module called twice: _Reuse) send their gradients back.
    Autograd adds those up (in fp32) and runs backward once, after every
    later use's, so the engine gets one gradient per parameter per backward,
    the sum of its uses, as a leaf parameter's .grad would be. The input is
    the placeholder parameter, only so that autograd records the node; it
    receives no gradient.
    """

    @staticmethod
    def forward(ctx, placeholder, owner, pid, tensor):
        ctx.owner, ctx.pid = owner, pid
        # No zeros made for an output that got no gradient (a parameter
        # used once leaves its token without one).
        ctx.set_materialize_grads(False)
        return tensor, owner._zero.expand(tensor.shape)

    @staticmethod
    def backward(ctx, grad, later):
        if later is not None:
            # The same sum, in the same order, as the engine makes of
            # separate hand-overs: the later uses' (backward's order), then
            # this one's, in fp32.
            grad = later if grad is None else later + grad.float()
        if grad is not None:
            ctx.owner._hand_over(ctx.pid, grad)
        return None, None, None, None


class _Reuse(torch.autograd.Function):
    """A later use of a parameter in the same forward (see _Use): returns the
    fetched tensor; its gradient goes back through the first use's token."""

    @staticmethod
    def forward(ctx, token, tensor):
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad.float(), None


class Offloaded:
    """A model whose parameters rest in a strata engine (see ``offload``)."""

    def __init__(self, model, config, device=None, device_memory_bytes=0,
                 comm=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "strata.torch.offload: model must be a torch.nn.Module, got "
                + type(model).__name__
            )
        if getattr(model, "_strata_offloaded", None) is not None:
            raise ValueError(
                "strata.torch.offload: this model is offloaded already; "
                "close() the first Offloaded before offloading it again"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "host"
        self.engine = _strata.Engine(
            _config_text(config),
            device=device,
            device_memory_bytes=device_memory_bytes,
            comm=comm,
        )
        try:
            self._setup(model)
        except BaseException:
            self.engine.close()
            raise

    def _setup(self, model):
        eng = self.engine
        if eng.working_dtype not in _DTYPES:
            raise ValueError(
                "strata.torch.offload: the config's working dtype is "
                + eng.working_dtype
                + "; the engine keeps parameters in bfloat16 or float16 "
                "(strata.working_dtype, or DeepSpeed's bf16 / fp16 sections)"
            )
        self.dtype = _DTYPES[eng.working_dtype]
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if eng.device_kind == "cuda"
            else torch.device("cpu")
        )
        self.model = model
        self.ids = {}  # qualified name -> engine tensor id
        self._params = []  # (name, parameter, shape), by tensor id
        by_param = {}
        for name, p in model.named_parameters():
            if p.is_sparse or not p.is_floating_point():
                raise TypeError(
                    "strata.torch.offload: parameter %s is %s%s; the engine "
                    "keeps dense floating-point parameters"
                    % (name, "sparse " if p.is_sparse else "", p.dtype)
                )
            if not p.requires_grad:
                raise ValueError(
                    "strata.torch.offload: parameter %s does not require "
                    "grad; the engine trains every parameter it holds "
                    "(keep frozen weights outside the offloaded model)" % name
                )
            shape = tuple(p.shape) or (1,)
            if p.numel() == 0:
                raise ValueError(
                    "strata.torch.offload: parameter %s is empty" % name
                )
            pid = eng.register(name, list(shape))
            self.ids[name] = pid
            by_param[id(p)] = pid
            self._params.append((name, p, tuple(p.shape)))
        if not self._params:
            raise ValueError("strata.torch.offload: the model has no parameters")
        eng.start()
        for pid, (_, p, _) in enumerate(self._params):
            eng.set_initial_values(
                pid, p.detach().to("cpu", torch.float32).contiguous()
            )
        # Each module's own parameters, by attribute name.
        self._owned = {}
        for m in model.modules():
            own = [
                (attr, by_param[id(p)])
                for attr, p in m._parameters.items()
                if p is not None
            ]
            if own:
                self._owned[m] = own
        # The model keeps placeholders; floating buffers take the working
        # dtype, as the parameters do.
        for _, p, _ in self._params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        for m in model.modules():
            for k, b in m._buffers.items():
                if b is not None:
                    m._buffers[k] = b.to(
                        self.device,
                        self.dtype if b.is_floating_point() else b.dtype,
                    )
        self._active = {}  # id -> [count, tensor] while a module runs
        self._live = {}  # storage address of a fetched tensor -> id
        self._tokens = {}  # id -> its first use's token, while forward runs
        # The tokens' one element (made once: no kernel per use on a GPU).
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        self._handles = []
        for m in self._owned:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            try:
                with torch.autograd.graph.saved_tensors_hooks(
                    self._pack, self._unpack
                ):
                    return original(*args, **kwargs)
            except BaseException:
                self._reset()  # forward hooks of the failed modules never ran
                raise
            finally:
                # Uses in the next forward hand their gradients over apart.
                self._tokens.clear()

        model.forward = forward
        model._strata_offloaded = self

    # ---- hooks ----

    def _view(self, pid, pin):
        """The pin as a tensor of the parameter's shape (waits for the
        data); the tensor holds the pin, which is released with it."""
        t = torch.from_dlpack(pin)
        pin.release()
        shape = self._params[pid][2]
        return t.view(shape) if tuple(t.shape) != shape else t

    def _pre(self, module, inputs):
        self._check_open()
        own = self._owned[module]
        need = list(dict.fromkeys(
            pid for _, pid in own if pid not in self._active))
        # Every fetch is issued before the first wait.
        pins = [self.engine.fetch(pid) for pid in need]
        for pid, pin in zip(need, pins):
            t = self._view(pid, pin)
            self._active[pid] = [0, t]
            self._live[_storage_ptr(t)] = pid
        for attr, pid in own:
            entry = self._active[pid]
            entry[0] += 1
            p = module._parameters[attr]
            if not torch.is_grad_enabled():
                module._parameters[attr] = entry[1]
            elif pid in self._tokens:
                module._parameters[attr] = _Reuse.apply(self._tokens[pid],
                                                        entry[1])
            else:
                used, self._tokens[pid] = _Use.apply(p, self, pid, entry[1])
                module._parameters[attr] = used

    def _post(self, module, inputs, output):
        for attr, pid in self._owned[module]:
            module._parameters[attr] = self._params[pid][1]
            entry = self._active.get(pid)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] <= 0:
                del self._active[pid]
                self._live.pop(_storage_ptr(entry[1]), None)

    def _reset(self):
        """Puts every placeholder back and drops what modules held."""
        for m, own in self._owned.items():
            for attr, pid in own:
                m._parameters[attr] = self._params[pid][1]
        self._active.clear()
        self._live.clear()

    def _pack(self, t):
        if not self._live or t.layout != torch.strided:
            return t
        try:
            ptr = _storage_ptr(t)
        except (RuntimeError, NotImplementedError):
            return t
        pid = self._live.get(ptr)
        if pid is None or t.dtype != self.dtype:
            return t
        offset = (t.data_ptr() - ptr) // t.element_size()
        return _Saved(pid, tuple(t.size()), tuple(t.stride()), offset)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        base = self._view(saved.pid, self.engine.fetch(saved.pid))
        return base.as_strided(saved.size, saved.stride, saved.offset)

    def _hand_over(self, pid, grad):
        if self.engine.closed:
            raise _strata.Error(
                "strata.torch.offload: a gradient arrived after close()"
            )
        if grad.dtype != self.dtype and grad.dtype != torch.float32:
            grad = grad.to(self.dtype)
        grad = grad.contiguous()
        if grad.is_cuda:
            self.engine.add_grad(
                pid, grad, stream=torch.cuda.current_stream().cuda_stream
            )
        else:
            self.engine.add_grad(pid, grad)

    def _check_open(self):
        if self.engine.closed:
            raise _strata.Error(
                "strata.torch.offload: the model's engine is closed "
                "(close() was called)"
            )

    # ---- the trainer's side ----

    def begin_step(self, lr=None, loss_scale=0.0, max_grad_norm=0.0):
        """Optional, before the last micro-batch's backward, with the
        arguments ``step()`` will get (``max_grad_norm`` 0): the engine
        updates each unit, or takes its gradient's statistics, as soon as
        backward has handed over all of its parameters' gradients, and
        ``step()`` does the rest, to the same results. Until ``step()``
        returns each parameter may receive one gradient: the uses of a
        parameter within one forward (tied weights, a module called twice)
        hand over their sum once, but a backward through two forwards (their
        losses added) makes backward raise."""
        if lr is None:
            raise TypeError("Offloaded.begin_step() needs lr=")
        self._check_open()
        self.engine.begin_step(
            lr=lr, loss_scale=loss_scale, max_grad_norm=max_grad_norm
        )

    def step(self, lr=None, loss_scale=0.0, max_grad_norm=0.0):
        """The engine's optimizer step over every parameter (a
        ``strata.StepResult``). ``lr`` is required: the schedule is the
        caller's. ``loss_scale`` 0 is the engine's own scale
        (``loss_scale`` property: multiply the loss by it before backward)."""
        if lr is None:
            raise TypeError("Offloaded.step() needs lr=")
        self._check_open()
        return self.engine.step(
            lr=lr, loss_scale=loss_scale, max_grad_norm=max_grad_norm
        )

    @property
    def loss_scale(self):
        """The scale to multiply the next step's loss by (1 unless the
        config's fp16 section asks for loss scaling)."""
        self._check_open()
        return self.engine.loss_scale

    def zero_grad(self, set_to_none=True):
        """Nothing to do: gradients live in the engine until step()."""

    def stats(self):
        self._check_open()
        return self.engine.stats()

    def state_dict(self):
        """The fp32 master of every parameter, by qualified name."""
        self._check_open()
        out = {}
        for pid, (name, _, shape) in enumerate(self._params):
            t = torch.empty(shape, dtype=torch.float32)
            self.engine.read_master(pid, t.view(-1) if shape else t.view(1))
            out[name] = t
        return out

    def save_checkpoint(self, dir, step, params=False, keep=None):
        """Between steps: the engine's checkpoint ``step`` of the directory
        ``dir``, tensors named by the parameters' qualified names (see
        ``Engine.save_checkpoint``); returns its path. With several ranks
        every rank calls it alike."""
        self._check_open()
        return self.engine.save_checkpoint(dir, step, params=params, keep=keep)

    def load_checkpoint(self, path):
        """The engine's state from a checkpoint of a model with the same
        parameter names and shapes, saved at any world size (see
        ``Engine.load_checkpoint``); returns the path loaded."""
        self._check_open()
        return self.engine.load_checkpoint(path)

    def parameters(self):
        """The model's (placeholder) parameters."""
        return self.model.parameters()

    def close(self):
        """Removes the hooks and closes the engine; the model keeps its
        placeholders (load ``state_dict()`` into a fresh model to keep the
        weights)."""
        if self.engine.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model.__dict__.pop("forward", None)
        self.model._strata_offloaded = None
        self._reset()
        self.engine.close()

    @property
    def closed(self):
        return self.engine.closed

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _config_text(config):
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, os.PathLike):
        with open(config) as f:
            return f.read()
    if isinstance(config, str):
        return config
    raise TypeError(
        "strata.torch.offload: config must be a dict, JSON text or a "
        "path (os.PathLike), got " + type(config).__name__
    )


def offload(model, config, device=None, device_memory_bytes=0, comm=None):
    """Moves ``model``'s parameters into a strata engine made from
    ``config`` (a strata config or DeepSpeed ds_config: a dict, JSON text, or
    a pathlib path). ``device``: 'host' (host-emulated; CPU tensors), 'cuda',
    or None (cuda when torch sees a GPU, else host). ``comm``: a
    ``strata.Communicator`` when each of several processes trains its own
    replica on its own data (the config says world_size, rank and
    zero_stage). Returns an ``Offloaded``: call the model (or the Offloaded)
    as usual, ``backward()``, then ``step(lr=...)``."""
    return Offloaded(model, config, device, device_memory_bytes, comm)
