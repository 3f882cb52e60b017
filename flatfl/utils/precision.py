"""A run's floating type (``precision``) and how float32 products are computed on a GPU: recorded settings, never
torch's defaults.

``precision`` (``--precision float32|float64``, a run setting and an analysis setting) is the floating type of the
model, the data, the algorithm's state and every product: ``float32`` (the default, the papers' GPU runs) or
``float64`` (the CPU presets: the same command gives the same numbers on any CPU to about 1e-12, where float32
rounding flips discrete choices such as max-pool arguments, clipping and ReLU signs, which then steer training;
docs/reproductions.md, "Same numbers"). It changes numbers, so it is part of a run's identity; a run recorded
without it ran in float32.

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

import contextlib

from ..errors import ConfigError

FLOAT32_MATMUL = ("full", "tf32")
#: a run's floating types (``--precision``); a run recorded without one ran in float32
PRECISIONS = ("float32", "float64")


def check_precision(value, flag: str = "--precision") -> str:
    if value not in PRECISIONS:
        raise ConfigError(f"{flag} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def check_analysis_precision(value) -> str | None:
    """An analysis' ``--precision``: None (the run's) or one of :data:`PRECISIONS`."""
    return None if value is None else check_precision(value)


def torch_dtype(precision: str):
    """The torch floating type of a precision name."""
    import torch

    return {"float32": torch.float32, "float64": torch.float64}[check_precision(precision)]


@contextlib.contextmanager
def computing_in(precision: str):
    """torch's default floating type set to ``precision`` inside the block (what a network built, a state
    allocated or a tensor made from Python numbers there gets), restored after it."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(precision))
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def gpu_precision_notice(precision: str, device) -> str | None:
    """The one line said when float64 runs on a GPU: allowed but slow (GPUs compute float64 at a fraction of their
    float32 rate); None otherwise. A ConfigError line on a device without float64 (Apple's ``mps``)."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if precision != "float64" or kind == "cpu":
        return None
    if kind == "mps":
        raise ConfigError("--precision float64 is not available on mps (no float64 on Apple GPUs): use "
                          "--precision float32 or --device cpu")
    return (f"notice: --precision float64 on {device} is allowed but slow: a GPU computes float64 many times slower "
            "than float32 (the GPU presets use --precision float32)")


def check_float32_matmul(value, flag: str = "--float32-matmul") -> str:
    if value not in FLOAT32_MATMUL:
        raise ConfigError(f"{flag} must be one of {', '.join(FLOAT32_MATMUL)}, got {value!r}")
    return value


def set_float32_matmul(mode: str) -> None:
    """Set how this process computes float32 products and convolutions on CUDA (module docstring): ``full`` or
    ``tf32``, for matrix products, cuDNN convolutions and cuDNN RNNs together (torch refuses a mix of its old and
    new switches, so only the new ones are used where torch has them)."""
    import torch

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
    import torch

    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision") and hasattr(backends.cudnn, "conv"):
        matmul = backends.cuda.matmul.fp32_precision == "tf32"
        conv = backends.cudnn.conv.fp32_precision == "tf32"
    else:
        matmul, conv = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    if matmul == conv:
        return "tf32" if matmul else "full"
    return "mixed"
