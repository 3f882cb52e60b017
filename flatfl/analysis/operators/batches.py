"""The evaluation set of an operator or a surface: one ``(inputs, targets)`` batch, a list of them, or a DataLoader,
made a list of batches on a device (:func:`as_batches`), anything else refused in one line."""
from __future__ import annotations

import torch

from ...errors import ConfigError
from ...utils.batch_walk import to_device

__all__ = ["ACCEPTED_DATA", "MAX_UNSIZED_BATCHES", "as_batches", "bounded"]


#: what an evaluation set may be, as error messages name it
ACCEPTED_DATA = "one (inputs, targets) batch, a list of such batches, or a DataLoader that yields them"


#: the most batches read from an evaluation set without a length (a generator, an iterable dataset's loader): an
#: endless one would otherwise be read until memory runs out
MAX_UNSIZED_BATCHES = 10_000


def bounded(items):
    """``items`` as it is when it has a length; else its first :data:`MAX_UNSIZED_BATCHES` batches, and a
    ConfigError line when it yields more (all are kept in memory: an endless loader would never end)."""
    try:
        len(items)  # a DataLoader of an IterableDataset has __len__, and raises TypeError from it
    except TypeError:
        pass
    else:
        yield from items
        return
    for i, batch in enumerate(items):
        if i == MAX_UNSIZED_BATCHES:
            raise ConfigError(f"the data has no length and yielded more than {MAX_UNSIZED_BATCHES:,} batches (an "
                              "endless loader?); every batch is kept, so give a finite DataLoader or a list, e.g. "
                              "list(itertools.islice(loader, N))")
        yield batch


def as_batches(data, device: torch.device | str | None = None) -> list[tuple]:
    """The evaluation set ``data`` as a list of ``(inputs, targets)`` batches (moved to ``device`` when given).

    ``data`` is one batch ``(x, y)`` (PyHessian's ``data=``), a list of batches, or any iterable of them (a
    ``DataLoader``, PyHessian's ``dataloader=``; read once). A batch is a pair whose targets hold one entry per input
    (``len(targets)`` is the batch size); the inputs are a tensor or anything the model takes (a tuple or dict of
    tensors). Anything else is a :class:`ConfigError` line naming what was given and the accepted forms.
    """
    if _is_single_batch(data):
        items = [data]
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        raise ConfigError(f"the data must be {ACCEPTED_DATA}; got a {type(data).__name__} (a dataset of single "
                          "samples): wrap it in a DataLoader, e.g. DataLoader(dataset, batch_size=128)")
    elif data is None or isinstance(data, (torch.Tensor, str, bytes, dict)) or not hasattr(data, "__iter__"):
        raise ConfigError(f"the data must be {ACCEPTED_DATA}; got {_describe(data)}")
    else:
        items = data
    batches = []
    for i, batch in enumerate(bounded(items)):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigError(f"batch {i} is {_describe(batch)}, not an (inputs, targets) pair; the data must be "
                              f"{ACCEPTED_DATA}")
        inputs, targets = batch
        if isinstance(targets, torch.Tensor) and targets.dim() == 0 or not hasattr(targets, "__len__"):
            raise ConfigError(f"batch {i}: the targets are {_describe(targets)}, not one entry per input; the data "
                              f"must be {ACCEPTED_DATA}")
        if len(targets) == 0:
            raise ConfigError(f"batch {i} is empty: every batch needs at least one sample")
        if isinstance(inputs, torch.Tensor) and (inputs.dim() == 0 or inputs.shape[0] != len(targets)):
            raise ConfigError(f"batch {i} has {_describe(inputs)} but {len(targets)} targets: the inputs' first "
                              "dimension is the batch")
        if device is not None:
            inputs, targets = to_device(inputs, device), to_device(targets, device)
        batches.append((inputs, targets))
    if not batches:
        raise ConfigError(f"the data is empty (no batch); give {ACCEPTED_DATA}")
    return batches


def _is_single_batch(data) -> bool:
    """``(x, y)`` with tensor targets: one batch (a list of batches never has a tensor as its second item)."""
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], torch.Tensor)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} item{'s' if len(x) != 1 else ''}"
    if isinstance(x, dict):
        return f"a dict with keys {', '.join(map(repr, list(x)[:4]))}"
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
