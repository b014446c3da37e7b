"""torch.optim optimizers that step with strata's fused CPU kernel.

Each parameter's state is what torch.optim.Adam/AdamW keep ('step' as a
0-dim float tensor, 'exp_avg', 'exp_avg_sq'), in tensors this optimizer owns,
so state_dict() / load_state_dict() are interchangeable with torch's. step()
hands the parameter, its gradient and the two moments to the kernel through
DLPack (no copy), which updates them in place in one multi-threaded pass.
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


class _StrataAdamBase(Optimizer):
    """Adam / AdamW over fp32 CPU parameters with strata's fused kernel.

    Thread contract: like torch's optimizers, one object is used by one thread
    at a time.
    """

    # Set by the subclasses: strata's algorithm name, the class name in
    # messages, and the torch.optim class's default weight decay.
    _algo = "adamw"
    _name = "strata.torch.AdamW"
    _default_weight_decay = 1e-2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=None, amsgrad=False, *, maximize=False,
                 foreach=None, capturable=False, differentiable=False,
                 fused=None, moment_dtype=torch.float32, bias_correction=True,
                 threads=0):
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for flag, value in (("amsgrad", amsgrad), ("maximize", maximize),
                            ("capturable", capturable),
                            ("differentiable", differentiable)):
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach,
                        capturable=False, differentiable=False, fused=fused,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)

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
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag, False):
                raise ValueError(self._refusal(flag))
        beta1, beta2 = group["betas"]
        key = (float(beta1), float(beta2), float(group["eps"]),
               float(group["weight_decay"]),
               bool(group.get("bias_correction", True)))
        kernel = self._kernels.pop(key, None)
        if kernel is None:
            if len(self._kernels) >= _MAX_KERNELS:
                oldest = next(iter(self._kernels))
                self._kernels.pop(oldest).close()
            kernel = _strata.CpuOptimizer(
                algo=self._algo, betas=key[0:2], eps=key[2],
                weight_decay=key[3], bias_correction=key[4],
                threads=self._threads)
        self._kernels[key] = kernel  # most recently used last
        return kernel

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=self._moment_dtype)
            state["exp_avg_sq"] = torch.zeros(p.shape,
                                              dtype=self._moment_dtype)
            return state
        # After load_state_dict: torch casts floating state to the
        # parameter's dtype, and a state_dict may hold a plain-number step.
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            if (t.dtype != self._moment_dtype or t.device.type != "cpu" or
                    not t.is_contiguous()):
                state[key] = t.to(device="cpu", dtype=self._moment_dtype,
                                  memory_format=torch.contiguous_format)
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]))
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
            lr = group["lr"]
            params = group["params"]
            if working is not None and len(working[gi]) != len(params):
                raise ValueError(
                    f"{self._name}.step: fp16_param_groups[{gi}] has "
                    f"{len(working[gi])} tensors; group {gi} has "
                    f"{len(params)} parameters")
            for pi, p in enumerate(params):
                if p.grad is None:
                    continue
                self._step_one(kernel, p, lr, gi, pi,
                               None if working is None else working[gi][pi])
        return loss

    def _step_one(self, kernel, p, lr, gi, pi, working) -> None:
        grad = p.grad
        context = f"{self._name}.step: parameter {pi} of group {gi}"
        if grad.is_sparse:
            raise RuntimeError(f"{context}: sparse gradients are not supported")
        state = self._state_of(p)
        step_t = state["step"]
        try:
            kernel.step(to_dlpack(p), to_dlpack(grad),
                        to_dlpack(state["exp_avg"]),
                        to_dlpack(state["exp_avg_sq"]),
                        step=int(step_t.item()) + 1, lr=float(lr),
                        working=(None if working is None else
                                 to_dlpack(working)),
                        check_overflow=False)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _with_context(e, context) from e
        step_t += 1


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
