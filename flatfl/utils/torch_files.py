"""Reading the torch files flatfl writes (checkpoints, ``data.pt``, ``resume.pt``, ``clients.pt``, eigenvectors),
bounded: what ``torch.load(weights_only=True)`` returns runs no code, yet its plain part (dicts, lists, tuples) can
hold a list shared by reference at every level (``a = [a, a]`` forty times: a file of a few KB that 2^40 values
expand to). A later walk (a digest, JSON) would never end. :func:`check_nesting` measures the payload once, each
shared container counted every time it is met yet walked only once, and refuses one nested deeper than
:data:`MAX_PAYLOAD_DEPTH` or larger than :data:`MAX_PAYLOAD_NODES` values, before anything else reads it.

:func:`load_weights_only` holds back torch's warnings (flatfl's error is the one line), and :func:`plain_pickle`
tells a plain pickle (not a torch zip file) from other unreadable files, so the caller can say so in its own words
instead of quoting torch's advice to load with ``weights_only=False``.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ..errors import CheckpointError

__all__ = ["MAX_PAYLOAD_DEPTH", "MAX_PAYLOAD_NODES", "load_weights_only", "plain_pickle", "PLAIN_PICKLE",
           "check_nesting"]

#: the deepest nesting of dicts, lists and tuples read (flatfl's files nest a handful of levels)
MAX_PAYLOAD_DEPTH = 64
#: the most plain values (containers, numbers, strings; a tensor is one) read, shared ones counted each time they
#: are met: flatfl's largest payload is a checkpoint's partition (one index per training example)
MAX_PAYLOAD_NODES = 10_000_000
#: the words that say a file is a plain pickle (after "PATH is not a ...")
PLAIN_PICKLE = "a plain pickle: flatfl loads weights only"

_CONTAINERS = (dict, list, tuple, set, frozenset)


def load_weights_only(path):
    """``torch.load(path, map_location="cpu", weights_only=True)`` with torch's warnings held back (a pickle
    protocol it did not write, ...); failures are torch's, for the caller to name."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def plain_pickle(path) -> bool:
    """Whether ``path`` starts as a pickle does (its protocol opcode), not as the zip file ``torch.save`` writes."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


class _Refused(Exception):
    pass


def _measure(value, depth: int, memo: dict, on_path: set) -> tuple[int, int]:
    """(values, levels) of ``value``: each shared container measured once (``memo``, by id), counted every time."""
    key = id(value)
    if key in memo:
        nodes, levels = memo[key]
        if depth + levels - 1 > MAX_PAYLOAD_DEPTH:
            raise _Refused
        return nodes, levels
    if depth > MAX_PAYLOAD_DEPTH or key in on_path:  # a container inside itself never ends either
        raise _Refused
    on_path.add(key)
    children = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
    nodes, levels = 1, 1
    for child in children:
        if isinstance(child, _CONTAINERS):
            n, deep = _measure(child, depth + 1, memo, on_path)
            nodes, levels = nodes + n, max(levels, deep + 1)
        else:
            nodes += 1
        if nodes > MAX_PAYLOAD_NODES:
            raise _Refused
    on_path.discard(key)
    memo[key] = (nodes, levels)
    return nodes, levels


def check_nesting(payload, path, error=CheckpointError) -> None:
    """``error`` (one line naming ``path`` and the top-level key) when the loaded ``payload`` nests dicts, lists and
    tuples deeper than :data:`MAX_PAYLOAD_DEPTH` or holds more than :data:`MAX_PAYLOAD_NODES` values in all (a
    tensor is one value). Linear in the file's size: a shared container is walked once."""
    memo: dict = {}
    total = 0
    items = payload.items() if isinstance(payload, dict) else [("the payload", payload)]
    for key, value in items:
        try:
            if isinstance(value, _CONTAINERS):
                total += _measure(value, 2, memo, set())[0]
            total += 1
            if total > MAX_PAYLOAD_NODES:
                raise _Refused
        except _Refused:
            name = key if isinstance(key, str) and key.isprintable() and len(key) <= 40 else "a value"
            raise error(f"{Path(path)}: {name} nested too deeply or too large: not flatfl's") from None
