"""A run's resume state (``resume.pt``) and the process RNG states: what a killed run needs to go on exactly where
it stopped. Model checkpoints are :mod:`flatfl.checkpoint` (the format shared with analysis)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checkpoint import refused_objects
from ..errors import CheckpointError
from ..utils.io import atomic_torch_save
from ..utils.torch_files import PLAIN_PICKLE, check_nesting, load_weights_only, plain_pickle

RESUME_FORMAT = "flatfl-resume"
RESUME_FORMAT_VERSION = 2


def save_resume_state(path: str | Path, state: dict) -> None:
    """Write ``resume.pt``: tensors and plain containers only, so that ``torch.load(weights_only=True)`` reads it."""
    atomic_torch_save(dict(state, format=RESUME_FORMAT, format_version=RESUME_FORMAT_VERSION), path)


def load_resume_state(path: str | Path) -> dict:
    """Read ``resume.pt`` without executing code (``weights_only=True``); every problem is one CheckpointError."""
    path = Path(path)
    try:
        st = load_weights_only(path)
    except Exception as e:
        if plain_pickle(path):
            raise CheckpointError(f"{path} is not a flatfl resume file ({PLAIN_PICKLE}); delete it to restart "
                                  "the run from round 0") from None
        if refused_objects(e):
            raise CheckpointError(f"{path} holds Python objects that flatfl will not load (it could run code): "
                                  "it is not from this flatfl version or was tampered with; delete it and rerun "
                                  "the training with --force to start over") from None
        raise CheckpointError(f"{path} is corrupt or truncated; delete it to restart the run from round 0") from None
    if not isinstance(st, dict) or st.get("format") != RESUME_FORMAT:
        raise CheckpointError(f"{path} is not a flatfl resume file (no flatfl header); delete it to restart the run")
    check_nesting(st, path)
    if st.get("format_version", 0) > RESUME_FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer flatfl (format {st['format_version']})")
    need = {"round": int, "theta": torch.Tensor, "buffers": dict, "latest": torch.Tensor, "latest_buffers": dict,
            "algorithm": dict, "metrics": list}
    for key, typ in need.items():
        if not isinstance(st.get(key), typ) or isinstance(st.get(key), bool):
            raise CheckpointError(f"{path} lacks a valid {key!r} entry; delete it to restart the run from round 0")
    if not torch.isfinite(st["theta"]).all():
        raise CheckpointError(f"{path} holds non-finite weights; delete it to restart the run from round 0")
    return st


def rng_state() -> dict:
    """The process's RNG states as tensors, ints and floats (loadable with ``weights_only=True``)."""
    import random

    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                       "gauss": None if gauss is None else float(gauss)}}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    import random

    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["internal"].tolist()), p["gauss"]))
