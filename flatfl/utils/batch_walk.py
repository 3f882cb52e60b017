"""The one walk through a nested batch, for analysis and training alike: the samples of a batch (slicing, counting)
and its tensors moved to a device.

A batch is a tree of containers with tensors and other values at its leaves. The containers walked, and rebuilt as
their own types, are:

* a Mapping: a ``dict`` as a dict; a ``collections.UserDict`` (a Hugging Face ``BatchEncoding``) as a copy of
  itself, its other attributes kept and its items replaced; any other Mapping (``OrderedDict``, ...) through its
  type called with a dict of the new items, or as a plain dict when its type cannot be built that way;
* a namedtuple (its type called with the new fields), and any other tuple or list (its type called with the new
  items, or a plain tuple or list when that fails);
* a dataclass instance: a copy of itself with every field replaced (frozen ones and those without ``init`` too).

Anything else (a number, a string, an object of another kind) is a leaf, kept as it is: tensors inside it are not
seen. :func:`map_tensors` rebuilds a batch, :func:`leaves` lists its leaves; :func:`tensors`,
:func:`count_samples`, :func:`slice_samples` and :func:`to_device` stand on them. A batch's number of samples is the
first dimension of its first tensor with at least one dimension (Mapping values, items and fields in order, depth
first); slicing a batch slices every tensor whose first dimension is that number and keeps the others whole (a 0-d
tensor, a per-batch table)."""
from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

__all__ = ["map_tensors", "leaves", "tensors", "count_samples", "slice_samples", "to_device"]


def _parts(x) -> dict | list | None:
    """The parts of a container ``x`` (a Mapping's items, a dataclass's fields by name; a tuple's or a list's
    items), or None when ``x`` is a leaf."""
    if isinstance(x, Mapping):
        return dict(x.items())
    if isinstance(x, (tuple, list)):
        return list(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return None


def _built(make: Callable[[], Any], plain):
    """``make()``, or ``plain`` when the container's type cannot be built from its parts."""
    try:
        return make()
    except Exception:  # a user's type with another constructor: the plain container holds the same parts
        return plain


def _rebuilt(x, parts: dict | list):
    """The container ``x`` as its own type with ``parts`` (from :func:`_parts`, each replaced) in place of its own."""
    if isinstance(x, Mapping):
        if type(x) is dict:
            return parts
        if isinstance(x, UserDict):
            new = copy.copy(x)
            new.data = parts
            return new
        return _built(lambda: type(x)(parts), parts)
    if isinstance(x, tuple):
        if type(x) is tuple:
            return tuple(parts)
        if hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*parts)
        return _built(lambda: type(x)(parts), tuple(parts))
    if isinstance(x, list):
        return parts if type(x) is list else _built(lambda: type(x)(parts), parts)
    new = copy.copy(x)  # a dataclass
    for name, value in parts.items():
        object.__setattr__(new, name, value)  # a frozen dataclass's fields too
    return new


def map_tensors(batch, fn: Callable[[torch.Tensor], Any]):
    """``batch`` with every tensor ``t`` in it replaced by ``fn(t)``, each container rebuilt as its own type (see
    the module docstring); leaves that are not tensors kept as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    parts = _parts(batch)
    if parts is None:
        return batch
    if isinstance(parts, dict):
        return _rebuilt(batch, {k: map_tensors(v, fn) for k, v in parts.items()})
    return _rebuilt(batch, [map_tensors(v, fn) for v in parts])


def leaves(batch) -> Iterator:
    """The leaves of ``batch`` (its tensors and its other values), depth first, in the order of its Mapping values,
    items and fields."""
    parts = None if isinstance(batch, torch.Tensor) else _parts(batch)
    if parts is None:
        yield batch
        return
    for part in (parts.values() if isinstance(parts, dict) else parts):
        yield from leaves(part)


def tensors(batch) -> Iterator[torch.Tensor]:
    """The tensors in ``batch``, in the order of :func:`leaves`."""
    return (x for x in leaves(batch) if isinstance(x, torch.Tensor))


def count_samples(batch) -> int | None:
    """The number of samples in ``batch``: the first dimension of its first tensor with at least one dimension;
    None when it holds none."""
    return next((int(t.shape[0]) for t in tensors(batch) if t.dim() >= 1), None)


def slice_samples(batch, start: int, stop: int, samples: int | None = None):
    """The samples ``start:stop`` of ``batch`` as a batch of the same structure: every tensor whose first dimension
    is the batch's number of samples (``samples``, else :func:`count_samples`) sliced, the rest kept whole."""
    n = count_samples(batch) if samples is None else samples
    return map_tensors(batch, lambda t: t[start:stop] if t.dim() >= 1 and t.shape[0] == n else t)


def to_device(batch, device):
    """``batch`` with every tensor moved to ``device``, its containers rebuilt as their own types."""
    return map_tensors(batch, lambda t: t.to(device))
