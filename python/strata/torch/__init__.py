"""PyTorch front end of strata (docs/python.md).

``Adam`` and ``AdamW`` are ``torch.optim.Optimizer`` subclasses that run
strata's fused CPU kernel on CPU tensors: drop-ins for ``torch.optim.Adam`` /
``torch.optim.AdamW`` and for DeepSpeed's ``DeepSpeedCPUAdam`` (``CPUAdam``
takes its constructor's arguments). Tensors reach the kernel through DLPack;
the package does not link libtorch.

``offload(model, config)`` keeps a model's parameters in a strata engine
(host memory or NVMe), fetched around each submodule's forward and backward.
"""

from strata.torch.offload import Offloaded, offload
from strata.torch.optim import Adam, AdamW, CPUAdam

__all__ = ["Adam", "AdamW", "CPUAdam", "Offloaded", "offload"]
