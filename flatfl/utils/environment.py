"""What a run's numbers depend on besides its settings: library versions, torch's thread counts and the machine.

Written into every run's ``config.json`` (key ``environment``). Identical settings reproduce a run's numbers bit for
bit only with the same torch thread count and the same library versions on the same kind of machine: the thread
count changes the order of floating-point reductions. The machine (CPU model, the instructions torch's kernels use,
BLAS, torch's build, the GPU: :mod:`flatfl.utils.machine`) changes float32 numbers, not float64 ones beyond about
1e-12.
"""
from __future__ import annotations

import platform

__all__ = ["environment"]


def environment(device=None) -> dict:
    """Versions of flatfl, torch, numpy and Python, torch's intra-/inter-op thread counts and the machine (with
    the GPU's name when ``device`` is a CUDA device)."""
    import numpy as np
    import torch

    from ..version import __version__
    from .machine import machine

    return {"flatfl": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(), "machine": platform.machine(),
            "system": platform.system(), **machine(device)}
