"""The one device resolver: a user's device string (cpu, cuda, cuda:N, mps) as a torch.device, or one clear error.

Every command and library entry (training, checkpoint loading, every analysis, report --compute-missing, reproduce
and sweep's preflight) goes through :func:`resolve_device`, so a device that cannot be used reads the same
everywhere."""
from __future__ import annotations

import torch

from ..errors import ConfigError

DEVICE_CHOICES = "cpu, cuda, cuda:N or mps"
DEVICE_TYPES = ("cpu", "cuda", "mps")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` (cpu, cuda, cuda:N, mps, or a torch.device) as a torch.device; a ConfigError saying why it cannot
    be used otherwise: an unknown string, no CUDA, a GPU index this machine lacks, no MPS."""
    name = str(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {name!r}: use {DEVICE_CHOICES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {name!r} asked for, but this machine has {count} GPU(s): "
                              f"use cuda:0 to cuda:{count - 1}")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"device {name!r} asked for, but MPS is not available on this machine")
    return dev
