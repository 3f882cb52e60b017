"""Random vectors where the estimators use them, and the memory a block of vectors may take.

* :func:`seeded_generator`: a generator on a device, seeded; :func:`random_block`: k Rademacher or Gaussian rows;
* :func:`free_memory`: free bytes on a device (CUDA's free memory, else available RAM)."""
from __future__ import annotations

import torch

__all__ = ["seeded_generator", "random_block", "free_memory"]


def free_memory(device: torch.device) -> int:
    """Free memory (bytes) for the block of a batched product: CUDA's free memory, else available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX systems
        return 4 * 2**30


def seeded_generator(seed: int, device) -> torch.Generator:
    """A random generator on ``device`` seeded with ``seed``: estimators draw their random vectors where they are
    used (no host-to-device copy per block). The same seed gives the same vectors on every CPU; a CUDA generator
    gives another stream than the CPU's, so hessian.json records where the vectors were drawn."""
    device = torch.device(device)
    try:
        return torch.Generator(device=device).manual_seed(int(seed))
    except RuntimeError:  # pragma: no cover - a device without its own generator: draw on the CPU
        return torch.Generator().manual_seed(int(seed))


def random_block(kind: str, dim: int, k: int, generator: torch.Generator, dtype, device) -> torch.Tensor:
    """k random vectors as rows, shape (k, dim): ``"rademacher"`` (+-1) or ``"gaussian"`` (standard normal).

    Drawn on the generator's device (see :func:`seeded_generator`) and moved only if that is not ``device``.
    """
    where = generator.device
    if kind == "rademacher":
        block = torch.randint(0, 2, (k, dim), generator=generator, device=where).mul_(2).sub_(1)
    elif kind == "gaussian":
        block = torch.randn(k, dim, generator=generator, dtype=torch.float64, device=where)
    else:  # pragma: no cover - internal misuse
        raise ValueError(kind)
    block = block.to(dtype=dtype)
    return block if block.device == torch.device(device) else block.to(device)
