"""Where a number came from: the digests that tie a result file to the weights it measured and the run it belongs
to, so that every reader can check what it reads against the run it reads it for.

* :func:`state_digest`: SHA-256 of a model's weights (a state dict: names, shapes, dtypes and values). A
  checkpoint's ``state_dict`` and the model rebuilt from it give the same digest.
* :func:`settings_digest`: SHA-256 of a run's training settings (its ``config``) without those that change no number
  (:data:`PLACE_SETTINGS`: where and how fast it ran, what it saved); ``without`` leaves out more (``seed``, to
  compare the seeds of one row).
* :func:`json_digest`: SHA-256 of any JSON-safe value (a model spec).
* :func:`short`: the first 12 hex digits, as messages show a digest.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

__all__ = ["state_digest", "settings_digest", "json_digest", "short", "PLACE_SETTINGS", "differing_settings"]

# run settings that change no weight: where the run ran, how fast, where it wrote, what else it saved
PLACE_SETTINGS = ("out", "device", "data_dir", "threads", "eval_batch_size", "parallel_clients", "cuda_graphs",
                  "eval_every", "checkpoint_every", "save_clients", "quiet")


def state_digest(state: Mapping) -> str:
    """sha256 of a state dict's tensors (names, shapes, dtypes and values, in order)."""
    import torch

    h = hashlib.sha256()
    for name, t in list(state.items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()


def json_digest(value) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys, no spaces; non-JSON values by their str)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _training_settings(config: Mapping, without: Iterable[str] = ()) -> dict:
    drop = set(PLACE_SETTINGS) | set(without)
    return {k: v for k, v in (config or {}).items() if k not in drop}


def settings_digest(config: Mapping, without: Iterable[str] = ()) -> str:
    """sha256 of a run's training settings (``config`` less :data:`PLACE_SETTINGS` and ``without``)."""
    return json_digest(_training_settings(config, without))


def differing_settings(a: Mapping, b: Mapping, without: Iterable[str] = ()) -> list[str]:
    """The training settings (see :func:`settings_digest`) in which two run configs differ, sorted."""
    a, b = _training_settings(a, without), _training_settings(b, without)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def short(digest) -> str:
    return str(digest)[:12] if digest else "none"
