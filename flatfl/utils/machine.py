"""The machine a run or an analysis computed on: CPU model, the vector instructions torch's kernels use, the BLAS,
torch's build and the GPU where one was used.

Recorded beside the numbers (config.json's and hessian.json's ``machine``, the report's scale line) so that a
difference between two reports can be told from an install problem: in float32 another CPU (another instruction
set, another BLAS) rounds differently, and on a chaotic run the difference grows to another accuracy; in float64 it
stays about 1e-12 (docs/reproductions.md, "Same numbers"). The machine changes no number in float64, so it is no
part of a run's identity (:mod:`flatfl.utils.run_identity`).
"""
from __future__ import annotations

import platform
import re

__all__ = ["machine", "cpu_model", "machine_label"]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name: /proc/cpuinfo's first ``model name`` (Linux), else ``platform.processor()``, else
    the architecture."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _build_setting(config: str, key: str) -> str | None:
    """``KEY=value`` of torch's build settings (``torch.__config__.show()``)."""
    m = re.search(rf"\b{re.escape(key)}=([^,\s]+)", config)
    return m.group(1) if m else None


def machine(device=None) -> dict:
    """``{"cpu", "cpu_capability", "blas", "torch_build", "gpu"?}``: the CPU model, the instruction set torch's CPU
    kernels run (AVX2, AVX512...), the BLAS torch was built with, torch's version and build (CUDA version or cpu),
    and the GPU's name when ``device`` is a CUDA device."""
    import torch

    config = torch.__config__.show()
    capability = None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    cuda = torch.version.cuda
    out = {"cpu": cpu_model(), "cpu_capability": capability or "unknown",
           "blas": _build_setting(config, "BLAS_INFO") or "unknown",
           "torch_build": f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU only'})"}
    if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def machine_label(records) -> str:
    """What the report's scale line says of the machines ``records`` (dicts holding :func:`machine`'s keys, e.g.
    config.json's ``environment``) ran on: 'CPU (capability), BLAS, torch build' and 'GPU', several joined by '/';
    '' for none (runs of versions that did not record it)."""
    records = [m for m in records if isinstance(m, dict) and m.get("cpu")]
    if not records:
        return ""

    def one(m) -> str:
        text = f"{m.get('cpu', '?')} ({m.get('cpu_capability', '?')}), BLAS {m.get('blas', '?')}, torch " \
               f"{m.get('torch_build', '?')}"
        return text + (f", GPU {m['gpu']}" if m.get("gpu") else "")

    return "/".join(sorted({one(m) for m in records}))
