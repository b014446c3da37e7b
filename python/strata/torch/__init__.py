"""PyTorch front end of strata (docs/python.md).

``Adam``, ``AdamW``, ``Adagrad``, ``Lion`` and ``Adafactor`` are
``torch.optim.Optimizer`` subclasses that run strata's fused CPU kernel on CPU
tensors: drop-ins for ``torch.optim.Adam`` / ``AdamW`` / ``Adagrad``,
lion-pytorch's ``Lion``, transformers' ``Adafactor``, and
DeepSpeed's ``DeepSpeedCPUAdam`` / ``DeepSpeedCPUAdagrad`` /
``DeepSpeedCPULion`` (``CPUAdam``, ``CPUAdagrad`` and ``CPULion`` take their
constructors' arguments). Tensors reach the kernel through DLPack; the
package does not link libtorch.

``offload(model, config)`` keeps a model's parameters in a strata engine
(host memory or NVMe), fetched around each submodule's forward and backward.
"""

from strata.torch.offload import Offloaded, offload
from strata.torch.optim import (Adafactor, Adagrad, Adam, AdamW, CPUAdagrad,
                                CPUAdam, CPULion, Lion)

__all__ = ["Adafactor", "Adagrad", "Adam", "AdamW", "CPUAdagrad", "CPUAdam",
           "CPULion", "Lion", "Offloaded", "offload"]
