"""PyTorch front end of strata (docs/python.md).

``Adam`` and ``AdamW`` are ``torch.optim.Optimizer`` subclasses that run
strata's fused CPU kernel on CPU tensors: drop-ins for ``torch.optim.Adam`` /
``torch.optim.AdamW`` and for DeepSpeed's ``DeepSpeedCPUAdam`` (``CPUAdam``
takes its constructor's arguments). Tensors reach the kernel through DLPack;
the package does not link libtorch.
"""

from strata.torch.optim import Adam, AdamW, CPUAdam

__all__ = ["Adam", "AdamW", "CPUAdam"]
