"""Where a number came from: the digests that tie a result file to the weights it measured and the run it belongs
to, so that every reader can check what it reads against the run it reads it for.

* :func:`state_digest`: SHA-256 of a model's weights (a state dict: names, shapes, dtypes and values). A
  checkpoint's ``state_dict`` and the model rebuilt from it give the same digest.
* :func:`settings_digest`: SHA-256 of a run's training settings (its ``config``) without those that change no number
  (:data:`flatfl.utils.run_identity.NO_NUMBER_SETTINGS`); ``without`` leaves out more (``seed``, to compare the seeds
  of one row). :func:`is_settings_digest` also accepts the digest files of earlier versions recorded.
* :func:`json_digest`: SHA-256 of any JSON-safe value (a model spec).
* :func:`short`: the first 12 hex digits, as messages show a digest.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

from .run_identity import NO_NUMBER_SETTINGS, differing_keys, without_settings

__all__ = ["state_digest", "settings_digest", "is_settings_digest", "json_digest", "short", "differing_settings"]

# the settings earlier versions left out of the digest they recorded (clients.pt of older runs carries it)
_EARLIER_DIGEST_FREE = ("out", "device", "data_dir", "threads", "eval_batch_size", "parallel_clients", "cuda_graphs",
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
    return without_settings(config, (*NO_NUMBER_SETTINGS, *without))


def settings_digest(config: Mapping, without: Iterable[str] = ()) -> str:
    """sha256 of a run's training settings (``config`` less the settings that change no number and ``without``)."""
    return json_digest(_training_settings(config, without))


def is_settings_digest(config: Mapping, digest: str) -> bool:
    """Whether ``digest`` is ``config``'s settings digest, as this version or an earlier one recorded it."""
    return digest in (settings_digest(config), json_digest(without_settings(config, _EARLIER_DIGEST_FREE)))


def differing_settings(a: Mapping, b: Mapping, without: Iterable[str] = ()) -> list[str]:
    """The training settings (see :func:`settings_digest`) in which two run configs differ, sorted."""
    return differing_keys(_training_settings(a, without), _training_settings(b, without))


def short(digest) -> str:
    return str(digest)[:12] if digest else "none"
