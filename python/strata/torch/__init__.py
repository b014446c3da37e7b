"""PyTorch front end of strata (docs/python.md).

``Adam``, ``AdamW``, ``Adagrad`` and ``Lion`` are ``torch.optim.Optimizer``
subclasses that run strata's fused CPU kernel on CPU tensors: drop-ins for
``torch.optim.Adam`` / ``AdamW`` / ``Adagrad``, lion-pytorch's ``Lion``, and
DeepSpeed's ``DeepSpeedCPUAdam`` / ``DeepSpeedCPUAdagrad`` /
``DeepSpeedCPULion`` (``CPUAdam``, ``CPUAdagrad`` and ``CPULion`` take their
constructors' arguments). Tensors reach the kernel through DLPack; the
package does not link libtorch.

``offload(model, config)`` keeps a model's parameters in a strata engine
(host memory or NVMe), fetched around each submodule's forward and backward.
"""

from strata.torch.offload import Offloaded, offload
from strata.torch.optim import (Adagrad, Adam, AdamW, CPUAdagrad, CPUAdam,
                                CPULion, Lion)

__all__ = ["Adagrad", "Adam", "AdamW", "CPUAdagrad", "CPUAdam", "CPULion",
           "Lion", "Offloaded", "offload"]
