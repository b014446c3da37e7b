"""torch.optim optimizers that step with strata's fused CPU kernel.

Each parameter's state is what the matching torch optimizer keeps ('step' as
a 0-dim float tensor; 'exp_avg' and 'exp_avg_sq' for Adam/AdamW, 'sum' for
Adagrad, 'exp_avg' for Lion as lion-pytorch keeps it; Adafactor's as
transformers' Adafactor keeps it), in tensors this optimizer owns, so
state_dict() / load_state_dict() are interchangeable with torch's. step()
hands the parameter, its gradient and the state to the kernel through DLPack
(no copy), which updates them in place in one multi-threaded pass.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch.optim.optimizer import Optimizer
from torch.utils.dlpack import to_dlpack

from strata import _strata

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_WORKING_DTYPES = (torch.float16, torch.bfloat16)
# Distinct hyper-parameter sets each get a kernel object (a thread arena);
# past this many the least recently used is closed.
_MAX_KERNELS = 8


def _closed_error(what: str) -> Exception:
    e = _strata.Error(f"{what} after close(): the optimizer's threads are freed")
    e.code = "FailedPrecondition"
    return e


def _with_context(e: Exception, context: str) -> Exception:
    """The same kind of exception as `e`, its message prefixed by `context`."""
    new = type(e)(f"{context}: {e}")
    if hasattr(e, "code"):
        new.code = e.code
    return new


def _as_state(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A state tensor as the kernel takes it: on the CPU, of `dtype`,
    contiguous (after load_state_dict torch casts floating state to the
    parameter's dtype); `t` itself when it already is."""
    if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to(device="cpu", dtype=dtype,
                memory_format=torch.contiguous_format)


def _check_ranges(lr, weight_decay, betas=None, eps=None) -> None:
    """torch.optim's range checks, with its messages."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        for i, beta in enumerate(betas[:2]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: "
                                 f"{beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class _StrataOptimizer(Optimizer):
    """A torch.optim optimizer over fp32 CPU parameters whose update is one
    of strata's fused kernels.

    Subclasses set the class attributes below and call _setup() from their
    torch-shaped __init__. Thread contract: like torch's optimizers, one
    object is used by one thread at a time.
    """

    # strata's algorithm name and the class name in messages.
    _algo = "adamw"
    _name = "strata.torch.AdamW"
    # (state key in torch's state_dict, the kernel's argument), in order.
    _state_keys = (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
    # Flags torch's class has that the kernel cannot honor when True.
    _refused_flags = ("amsgrad", "maximize", "capturable", "differentiable")

    def _setup(self, params, defaults, moment_dtype, threads, **flags):
        for flag, value in flags.items():
            if value:
                raise ValueError(self._refusal(flag))
        if moment_dtype not in _MOMENT_DTYPES:
            raise TypeError(
                f"{self._name}: moment_dtype={moment_dtype}; accepted "
                "torch.float32 or torch.bfloat16")
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(
                f"{self._name}: threads={threads!r}; accepted an int >= 0 "
                "(0 = all cores)")
        self._moment_dtype = moment_dtype
        self._threads = threads
        self._kernels: Dict[tuple, _strata.CpuOptimizer] = {}
        self._closed = False
        Optimizer.__init__(self, params, defaults)

    # The kernel's hyper-parameters for a group: (betas, eps, weight_decay,
    # bias_correction), hashable.
    def _kernel_key(self, group) -> tuple:
        beta1, beta2 = group["betas"]
        return ((float(beta1), float(beta2)), float(group["eps"]),
                float(group["weight_decay"]),
                bool(group.get("bias_correction", True)))

    # The learning rate the kernel gets at `step` (1-based).
    def _lr(self, group, step: int) -> float:
        return float(group["lr"])

    # What a state tensor holds before the first step.
    def _initial_state_value(self, group) -> float:
        return 0.0

    def _refusal(self, flag: str) -> str:
        return (f"{self._name}: {flag}=True is not supported (strata's fused "
                f"kernel implements plain {self._algo}); use torch.optim for it")

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_moment_dtype", torch.float32)
        self.__dict__.setdefault("_threads", 0)
        self.__dict__.setdefault("_kernels", {})
        self.__dict__.setdefault("_closed", False)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.dtype != torch.float32:
                raise TypeError(
                    f"{self._name}: parameter {i} of group "
                    f"{len(self.param_groups) - 1} is {p.dtype}; strata's CPU "
                    "optimizer updates float32 parameters (keep fp32 master "
                    "weights and pass a working copy to step())")

    @property
    def moment_dtype(self) -> torch.dtype:
        return self._moment_dtype

    def close(self) -> None:
        """Frees the kernels' threads; step() raises strata.Error after it."""
        for k in self._kernels.values():
            k.close()
        self._kernels.clear()
        self._closed = True

    def _kernel(self, group) -> "_strata.CpuOptimizer":
        # A group loaded from a torch state_dict may carry flags strata
        # cannot honor.
        for flag in self._refused_flags:
            if group.get(flag, False):
                raise ValueError(self._refusal(flag))
        key = self._kernel_key(group)
        kernel = self._kernels.pop(key, None)
        if kernel is None:
            if len(self._kernels) >= _MAX_KERNELS:
                oldest = next(iter(self._kernels))
                self._kernels.pop(oldest).close()
            kernel = self._new_kernel(key)
        self._kernels[key] = kernel  # most recently used last
        return kernel

    # A kernel for the hyper-parameters `key` (_kernel_key's).
    def _new_kernel(self, key: tuple) -> "_strata.CpuOptimizer":
        betas, eps, weight_decay, bias_correction = key
        return _strata.CpuOptimizer(
            algo=self._algo, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, threads=self._threads)

    def _state_of(self, p: torch.Tensor, group) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            for key, _ in self._state_keys:
                state[key] = torch.full(p.shape,
                                        self._initial_state_value(group),
                                        dtype=self._moment_dtype)
            return state
        # After load_state_dict: torch casts floating state to the
        # parameter's dtype, and a state_dict may hold a plain-number step.
        for key, _ in self._state_keys:
            state[key] = _as_state(state[key], self._moment_dtype)
        step = state.get("step", 0)  # lion-pytorch's state has none
        if not torch.is_tensor(step):
            state["step"] = torch.tensor(float(step))
        return state

    @staticmethod
    def _working_groups(fp16_param_groups) -> Optional[List[List]]:
        # DeepSpeedCPUAdam's forms: a tensor (one group of one parameter), a
        # list of tensors (one group), a list of lists (one per group).
        if fp16_param_groups is None:
            return None
        if torch.is_tensor(fp16_param_groups):
            return [[fp16_param_groups]]
        groups = list(fp16_param_groups)
        if groups and not isinstance(groups[0], (list, tuple)):
            return [groups]
        return [list(g) for g in groups]

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One update of every parameter that has a gradient.

        fp16_param_groups (as DeepSpeedCPUAdam's): per group, per parameter, a
        float16 or bfloat16 CPU tensor that receives the updated weights in
        the same pass (a working copy); None skips it.
        """
        if self._closed:
            raise _closed_error(f"{self._name}.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        working = self._working_groups(fp16_param_groups)
        if working is not None and len(working) != len(self.param_groups):
            raise ValueError(
                f"{self._name}.step: fp16_param_groups has {len(working)} "
                f"groups; the optimizer has {len(self.param_groups)}")
        for gi, group in enumerate(self.param_groups):
            kernel = self._kernel(group)
            params = group["params"]
            if working is not None and len(working[gi]) != len(params):
                raise ValueError(
                    f"{self._name}.step: fp16_param_groups[{gi}] has "
                    f"{len(working[gi])} tensors; group {gi} has "
                    f"{len(params)} parameters")
            for pi, p in enumerate(params):
                if p.grad is None:
                    continue
                self._step_one(kernel, group, p, gi, pi,
                               None if working is None else working[gi][pi])
        return loss

    # What an error of parameter pi of group gi says first; a sparse
    # gradient is refused here.
    def _context(self, grad: torch.Tensor, gi: int, pi: int) -> str:
        context = f"{self._name}.step: parameter {pi} of group {gi}"
        if grad.is_sparse:
            raise RuntimeError(f"{context}: sparse gradients are not supported")
        return context

    def _step_one(self, kernel, group, p, gi, pi, working) -> None:
        grad = p.grad
        context = self._context(grad, gi, pi)
        state = self._state_of(p, group)
        step_t = state["step"]
        step = int(step_t.item()) + 1
        moments = {arg: to_dlpack(state[key]) for key, arg in self._state_keys}
        try:
            kernel.step(to_dlpack(p), to_dlpack(grad), **moments, step=step,
                        lr=self._lr(group, step),
                        working=(None if working is None else
                                 to_dlpack(working)),
                        check_overflow=False)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _with_context(e, context) from e
        step_t += 1


class _StrataAdamBase(_StrataOptimizer):
    """Adam / AdamW with strata's fused kernel."""

    _default_weight_decay = 1e-2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=None, amsgrad=False, *, maximize=False,
                 foreach=None, capturable=False, differentiable=False,
                 fused=None, moment_dtype=torch.float32, bias_correction=True,
                 threads=0):
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        _check_ranges(lr, weight_decay, betas=betas, eps=eps)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach,
                        capturable=False, differentiable=False, fused=fused,
                        bias_correction=bias_correction)
        self._setup(params, defaults, moment_dtype, threads, amsgrad=amsgrad,
                    maximize=maximize, capturable=capturable,
                    differentiable=differentiable)


class AdamW(_StrataAdamBase):
    """torch.optim.AdamW (decoupled weight decay) with strata's kernel.

    Same arguments as torch.optim.AdamW (weight_decay defaults to 1e-2);
    amsgrad, maximize, capturable and differentiable must be False; foreach
    and fused are accepted and ignored (the kernel is always fused). Extra
    keyword arguments:
      moment_dtype: torch.float32 (default) or torch.bfloat16 moments.
      bias_correction: False gives DeepSpeed's bias_correction=False.
      threads: the kernel's threads, 0 (default) = all cores.
    """

    _algo = "adamw"
    _name = "strata.torch.AdamW"
    _default_weight_decay = 1e-2


class Adam(_StrataAdamBase):
    """torch.optim.Adam (L2 weight decay on the gradient) with strata's kernel.

    Arguments as AdamW's, with torch.optim.Adam's default weight_decay=0.
    """

    _algo = "adam"
    _name = "strata.torch.Adam"
    _default_weight_decay = 0.0


class Adagrad(_StrataOptimizer):
    """torch.optim.Adagrad with strata's kernel.

    Same arguments as torch.optim.Adagrad (lr_decay is applied to the
    learning rate each step, as torch does); maximize must be False; foreach
    is accepted and ignored. The state is torch's ('step', 'sum'), created
    at construction as torch creates it. Extra keyword arguments:
    moment_dtype (torch.float32 or torch.bfloat16 'sum') and threads.
    """

    _algo = "adagrad"
    _name = "strata.torch.Adagrad"
    _state_keys = (("sum", "exp_avg_sq"),)
    _refused_flags = ("maximize",)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0,
                 initial_accumulator_value=0, eps=1e-10, foreach=None, *,
                 maximize=False, moment_dtype=torch.float32, threads=0):
        _check_ranges(lr, weight_decay, eps=eps)
        if not 0.0 <= lr_decay:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}")
        if not 0.0 <= initial_accumulator_value:
            raise ValueError("Invalid initial_accumulator_value value: "
                             f"{initial_accumulator_value}")
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps,
                        weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value,
                        foreach=foreach, maximize=False)
        self._setup(params, defaults, moment_dtype, threads,
                    maximize=maximize)
        # As torch.optim.Adagrad: the state exists from construction, its
        # 'sum' filled with the constructor's initial_accumulator_value (a
        # group's own value is not used for it, as in torch).
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0)
                state["sum"] = torch.full(p.shape,
                                          float(initial_accumulator_value),
                                          dtype=self._moment_dtype)

    def _kernel_key(self, group) -> tuple:
        return ((0.9, 0.999), float(group["eps"]),
                float(group["weight_decay"]), True)

    def _lr(self, group, step: int) -> float:
        return float(group["lr"]) / (1 + (step - 1) * group["lr_decay"])

    def _initial_state_value(self, group) -> float:
        return float(group["initial_accumulator_value"])


class Lion(_StrataOptimizer):
    """Lion (Chen et al. 2023) with strata's kernel, as lion-pytorch's Lion:
    decoupled weight decay, the sign of the interpolated momentum as the
    update, state 'exp_avg' (and 'step').

    Arguments: lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, and the extra
    keyword arguments moment_dtype (torch.float32 or torch.bfloat16) and
    threads.
    """

    _algo = "lion"
    _name = "strata.torch.Lion"
    _state_keys = (("exp_avg", "exp_avg"),)
    _refused_flags = ()

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 *, moment_dtype=torch.float32, threads=0):
        _check_ranges(lr, weight_decay, betas=betas)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        self._setup(params, defaults, moment_dtype, threads)

    def _kernel_key(self, group) -> tuple:
        beta1, beta2 = group["betas"]
        return ((float(beta1), float(beta2)), 1e-8,
                float(group["weight_decay"]), True)


class Adafactor(_StrataOptimizer):
    """transformers.optimization.Adafactor with strata's kernel (Shazeer and
    Stern 2018; docs/cpu_adam.md): the same arguments and defaults, the same
    state keys ('step' as an int, 'exp_avg' with beta1, 'exp_avg_sq_row' and
    'exp_avg_sq_col' for a matrix, 'exp_avg_sq' for a vector), so that
    state_dict() / load_state_dict() are interchangeable with it.

    The kernel keeps a matrix's row and column statistics in one array: the
    two state tensors are views of it (a loaded state_dict's are packed into
    one again at the next step). Parameters of one or two dimensions only:
    HF's factors of a higher-dimensional tensor are per leading index while
    its RMS and clipping are over the whole tensor, which one kernel call
    does not give. Extra keyword argument: threads.
    """

    _algo = "adafactor"
    _name = "strata.torch.Adafactor"
    _state_keys = ()
    _refused_flags = ()

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3),
                 clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True,
                 warmup_init=False, *, threads=0):
        if lr is not None and relative_step:
            raise ValueError(f"{self._name}: a fixed lr cannot be combined "
                             "with relative_step=True")
        if warmup_init and not relative_step:
            raise ValueError(f"{self._name}: warmup_init=True needs "
                             "relative_step=True")
        defaults = dict(lr=lr, eps=eps, clip_threshold=clip_threshold,
                        decay_rate=decay_rate, beta1=beta1,
                        weight_decay=weight_decay,
                        scale_parameter=scale_parameter,
                        relative_step=relative_step, warmup_init=warmup_init)
        self._setup(params, defaults, torch.float32, threads)

    def _kernel_key(self, group) -> tuple:
        eps1, eps2 = group["eps"]
        beta1 = group["beta1"]
        return (float(eps1), float(eps2), float(group["clip_threshold"]),
                float(group["decay_rate"]),
                None if beta1 is None else float(beta1),
                float(group["weight_decay"]), bool(group["scale_parameter"]),
                bool(group["relative_step"]), bool(group["warmup_init"]))

    def _new_kernel(self, key: tuple) -> "_strata.CpuOptimizer":
        (eps1, eps2, clip, decay, beta1, weight_decay, scale_parameter,
         relative_step, warmup_init) = key
        section = {"type": "adafactor",
                   "params": {"eps": [eps1, eps2], "clip_threshold": clip,
                              "decay_rate": decay, "beta1": beta1,
                              "weight_decay": weight_decay,
                              "scale_parameter": scale_parameter,
                              "relative_step": relative_step,
                              "warmup_init": warmup_init}}
        if not relative_step:
            section["params"]["lr"] = 0.0  # each step's lr is the group's
        return _strata.CpuOptimizer.from_config(section, threads=self._threads)

    @staticmethod
    def _shape(p: torch.Tensor, context: str) -> Tuple[int, int]:
        # (rows, cols) as the kernel takes them: rows 0 for a vector.
        if p.dim() == 2:
            return p.shape[0], p.shape[1]
        if p.dim() <= 1:
            return 0, p.numel()
        raise ValueError(
            f"{context}: a {p.dim()}-dimensional parameter {tuple(p.shape)}; "
            "strata's Adafactor takes vectors and matrices (reshape it, or "
            "use transformers' Adafactor for it)")

    def _stats_of(self, state: dict, p: torch.Tensor, rows: int) -> torch.Tensor:
        # The kernel's array of statistics, the state tensors views of it.
        if rows == 0:
            keys, shapes = ("exp_avg_sq",), (p.shape,)
            sizes, lead = (p.numel(),), 1  # one unused row statistic first
        else:
            keys = ("exp_avg_sq_row", "exp_avg_sq_col")
            shapes, sizes, lead = (p.shape[:-1], p.shape[-1:]), (
                p.shape[0], p.shape[1]), 0
        buf = state.get("_stats")
        views = [state.get(k) for k in keys]
        if buf is not None and all(
                v is not None and v.data_ptr() == buf[o:].data_ptr()
                for v, o in zip(views, (lead, lead + sizes[0]))):
            return buf
        buf = torch.zeros(lead + sum(sizes), dtype=torch.float32)
        offset = lead
        for key, shape, size, old in zip(keys, shapes, sizes, views):
            view = buf[offset:offset + size].view(shape)
            if old is not None:  # from load_state_dict, or HF's own
                view.copy_(old.reshape(shape))
            state[key] = view
            offset += size
        state["_stats"] = buf
        return buf

    def _step_one(self, kernel, group, p, gi, pi, working) -> None:
        grad = p.grad
        context = self._context(grad, gi, pi)
        rows, cols = self._shape(p, context)
        state = self.state[p]
        step = int(state.get("step", 0)) + 1
        stats = self._stats_of(state, p, rows)
        exp_avg = None
        if group["beta1"] is not None:
            m = state.get("exp_avg")
            if m is None:
                m = torch.zeros_like(p, memory_format=torch.contiguous_format)
            else:
                m = _as_state(m, torch.float32)
                if m.shape != p.shape:
                    m = m.view(p.shape)
            state["exp_avg"] = m
            exp_avg = to_dlpack(m)
        lr = 0.0 if group["relative_step"] else float(group["lr"])
        try:
            kernel.step(to_dlpack(p), to_dlpack(grad), exp_avg,
                        to_dlpack(stats), step=step, lr=lr, rows=rows,
                        cols=cols,
                        working=(None if working is None else
                                 to_dlpack(working)),
                        check_overflow=False)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _with_context(e, context) from e
        state["step"] = step

    def state_dict(self):
        # HF's keys only: the packed array is the views' storage. (torch's
        # state_dict holds the live state dicts: filter, do not pop.)
        sd = super().state_dict()
        sd["state"] = {k: {key: v for key, v in s.items() if key != "_stats"}
                       for k, s in sd["state"].items()}
        return sd


def CPUAdam(model_params, lr=1e-3, bias_correction=True,
            betas: Tuple[float, float] = (0.9, 0.999), eps=1e-8,
            weight_decay=0.0, amsgrad=False, adamw_mode=True,
            fp32_optimizer_states=True, *, threads=0):
    """DeepSpeedCPUAdam's constructor: AdamW (adamw_mode) or Adam.

    fp32_optimizer_states=False keeps the moments in bfloat16 (DeepSpeed
    keeps them in the parameters' dtype, which for strata's fp32 master
    weights would change nothing).
    """
    cls = AdamW if adamw_mode else Adam
    return cls(model_params, lr=lr, betas=betas, eps=eps,
               weight_decay=weight_decay, amsgrad=amsgrad,
               bias_correction=bias_correction,
               moment_dtype=(torch.float32 if fp32_optimizer_states else
                             torch.bfloat16),
               threads=threads)


def CPUAdagrad(model_params, lr=1e-2, eps=1e-10, weight_decay=0,
               amsgrad=False, fp32_optimizer_states=True, *, threads=0):
    """DeepSpeedCPUAdagrad's constructor (amsgrad must be False)."""
    if amsgrad:
        raise ValueError("strata.torch.CPUAdagrad: amsgrad=True is not "
                         "supported")
    return Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay,
                   moment_dtype=(torch.float32 if fp32_optimizer_states else
                                 torch.bfloat16),
                   threads=threads)


def CPULion(model_params, lr=1e-3, betas: Tuple[float, float] = (0.9, 0.999),
            weight_decay=0, fp32_optimizer_states=True, *, threads=0):
    """DeepSpeedCPULion's constructor."""
    return Lion(model_params, lr=lr, betas=betas, weight_decay=weight_decay,
                moment_dtype=(torch.float32 if fp32_optimizer_states else
                              torch.bfloat16),
                threads=threads)
