"""The device an analysis runs on, checked: one clear error for an unknown, missing or unavailable device."""
from __future__ import annotations

import torch

from ..errors import ConfigError


def check_device(device: str) -> torch.device:
    """``device`` (cpu, cuda, cuda:N, mps) as a torch.device, or a ConfigError saying why it cannot be used."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r} (use cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device 'mps' asked for, but MPS is not available on this machine")
    return dev
