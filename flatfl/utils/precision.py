"""How float32 matrix products and convolutions are computed on a GPU: a recorded setting, never torch's default.

On NVIDIA GPUs since Ampere, torch may run float32 matrix products and convolutions in TensorFloat-32 (a 10-bit
mantissa, about 1e-3 relative error per product). torch's defaults differ by kind: matrix products full float32,
cuDNN convolutions TF32. flatfl sets both, explicitly, for every run and every analysis:

* ``full`` (the default of training and of analysis): IEEE float32 everywhere, the numbers of the CPU up to the
  order of summation;
* ``tf32``: TF32 for both, faster on large convolutions and products, at about 1e-3 relative per product.

The setting is recorded where the numbers are (config.json's ``training_path``, hessian.json's settings). It has no
effect on a CPU or on float64 models.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

FLOAT32_MATMUL = ("full", "tf32")


def check_float32_matmul(value, flag: str = "--float32-matmul") -> str:
    if value not in FLOAT32_MATMUL:
        raise ConfigError(f"{flag} must be one of {', '.join(FLOAT32_MATMUL)}, got {value!r}")
    return value


def set_float32_matmul(mode: str) -> None:
    """Set how this process computes float32 products and convolutions on CUDA (module docstring): ``full`` or
    ``tf32``, for matrix products, cuDNN convolutions and cuDNN RNNs together (torch refuses a mix of its old and
    new switches, so only the new ones are used where torch has them)."""
    precision = {"full": "ieee", "tf32": "tf32"}[check_float32_matmul(mode)]
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision") and hasattr(backends.cudnn, "conv"):
        backends.cuda.matmul.fp32_precision = precision
        backends.cudnn.conv.fp32_precision = precision
        backends.cudnn.rnn.fp32_precision = precision
    else:  # an older torch: the legacy switches
        backends.cuda.matmul.allow_tf32 = precision == "tf32"
        backends.cudnn.allow_tf32 = precision == "tf32"


def float32_matmul_now() -> str:
    """The mode this process computes float32 products in now: ``full``, ``tf32``, or ``mixed`` (products and
    convolutions set differently, e.g. torch's own defaults)."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision") and hasattr(backends.cudnn, "conv"):
        matmul = backends.cuda.matmul.fp32_precision == "tf32"
        conv = backends.cudnn.conv.fp32_precision == "tf32"
    else:
        matmul, conv = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    if matmul == conv:
        return "tf32" if matmul else "full"
    return "mixed"
