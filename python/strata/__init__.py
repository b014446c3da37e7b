"""strata: tiered memory for training huge models, from Python.

The CPU optimizer on any DLPack array (NumPy, torch) is ``strata.CpuOptimizer``;
the engine (parameters, optimizer states and gradients across device, host
and NVMe) is ``strata.Engine``, alone or as one of several data-parallel
ranks over a ``strata.Communicator``; the PyTorch optimizers and ``offload`` are in
``strata.torch`` (imported on demand, so that
``import strata`` needs no torch). See docs/python.md.
"""

from strata._strata import (
    Communicator,
    CpuOptimizer,
    Engine,
    Error,
    InvalidArgumentError,
    Pin,
    StepResult,
    best_variant,
    state_bytes,
    version,
)

# The version of the libstrata this package loaded (the library and the
# package are built and installed together, so they agree).
__version__ = version()

__all__ = [
    "Communicator",
    "CpuOptimizer",
    "Engine",
    "Error",
    "InvalidArgumentError",
    "Pin",
    "StepResult",
    "best_variant",
    "state_bytes",
    "version",
    "__version__",
]
