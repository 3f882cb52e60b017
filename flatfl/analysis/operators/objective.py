"""Any objective for the Hessian: ``loss(model, batch) -> scalar`` over batches of any structure (docs/analysis.md,
"Any objective").

The criterion path (``loss_fn(model(inputs), targets)`` over ``(inputs, targets)`` pairs) covers classifiers; a
``loss`` function covers everything else: a HuggingFace-style dict ``{"input_ids": ..., "labels": ...}``, a tuple of
several inputs, a model that computes its own loss. The objective is the **sample-weighted mean** over batches,
as for the criterion (docs/analysis-protocols.md §1): ``L = sum_b (n_b / N) loss(model, batch_b)``, where a batch's
``n_b`` is the first dimension of its first tensor with at least one dimension (Mapping values, tuple and list
items, dataclass fields in order, depth first: :mod:`flatfl.utils.batch_walk`). The loss must be the mean over its
batch for that weighting to give the mean over all samples.

* :func:`loss_batches`: the evaluation set of a ``loss`` as a list of batches on a device: one dict or tuple is one
  batch; a list, a DataLoader or any other iterable holds batches;
* :func:`batch_samples`: a batch's ``n_b``;
* :func:`move`: a batch of any structure (dict, Mapping such as a tokenizer's ``BatchEncoding``, tuple, namedtuple,
  list, dataclass) with its tensors on a device, each container rebuilt as its own type;
* :func:`load_loss`: ``--loss module:function`` (or ``path/to/file.py:function``) imported as ``--model-factory``
  is (flatfl/models/factory.py): only the named module is imported, nothing is called until the analysis runs; each
  call then puts back what the loss changed of the process (:mod:`flatfl.utils.user_code`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from ...errors import ConfigError
from ...utils.batch_walk import count_samples, to_device

__all__ = ["loss_batches", "batch_samples", "move", "load_loss", "LOSS_DATA"]

#: what the evaluation set of a ``loss`` may be, as error messages name it
LOSS_DATA = ("one batch (a dict, or a tuple, of tensors of any structure), or a list of batches or a DataLoader "
             "that yields them")


def batch_samples(batch, index: int = 0) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor with at least one dimension
    (:func:`flatfl.utils.batch_walk.count_samples`)."""
    n = count_samples(batch)
    if n is None:
        raise ConfigError(f"batch {index} holds no tensor with a batch dimension ({_kind(batch)}): the Hessian weighs "
                          "each batch by its number of samples, the first dimension of its first tensor")
    if n == 0:
        raise ConfigError(f"batch {index} is empty: every batch needs at least one sample")
    return n


def move(x, device):
    """``x`` with every tensor moved to ``device``, its containers rebuilt as their own types
    (:func:`flatfl.utils.batch_walk.to_device`)."""
    return to_device(x, device)


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, Mapping):
        return f"a {type(x).__name__} with keys {', '.join(map(repr, list(x)[:4]))}"
    if x is None:
        return "None"
    return f"a {type(x).__name__}"


def loss_batches(data, device=None, *, one_batch: bool = False) -> list:
    """The evaluation set of a ``loss``: a list of batches (moved to ``device`` when given).

    ``one_batch=True`` (``hessian(data=batch, loss=fn)``): ``data`` is one batch, whatever its structure. Otherwise a
    dict (any Mapping) or a tuple is one batch, and a list, a DataLoader or any other iterable yields batches.
    """
    if data is None:
        raise ConfigError(f"the data must be {LOSS_DATA}; got None")
    if one_batch or isinstance(data, (Mapping, tuple)):
        items = [data]
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        raise ConfigError(f"the data must be {LOSS_DATA}; got a {type(data).__name__} (a dataset of single samples): "
                          "wrap it in a DataLoader, e.g. DataLoader(dataset, batch_size=128)")
    elif isinstance(data, (torch.Tensor, str, bytes)) or not hasattr(data, "__iter__"):
        raise ConfigError(f"the data must be {LOSS_DATA}; got {_kind(data)}")
    else:
        items = data
    from .batches import bounded

    batches = []
    for i, batch in enumerate(bounded(items)):
        batch_samples(batch, i)  # checked now: one line for a batch without samples
        batches.append(move(batch, device) if device is not None else batch)
    if not batches:
        raise ConfigError(f"the data is empty (no batch); give {LOSS_DATA}")
    return batches


def load_loss(spec: str) -> Callable:
    """The function ``spec`` names (``module:function``: the current directory is searched first, then
    ``sys.path``; ``path/to/file.py:function``: that file's folder first), imported, not called. The same rules as
    ``--model-factory``: nothing but the named module is imported."""
    import inspect

    from ...models.factory import import_function
    from ...utils.user_code import guarded

    fn = import_function(spec, "--loss", "my_losses:lm_loss")
    if inspect.isclass(fn):
        raise ConfigError(f"--loss {spec}: {fn.__name__} is a class; name a function loss(model, batch) -> the "
                          "batch's mean loss (a criterion class such as CrossEntropyLoss is not one)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: checked when it is first called
        return guarded(fn, f"the loss {spec}")
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(f"--loss {spec}: the loss is called as loss(model, batch), but {spec.rsplit(':', 1)[1]}"
                          f"{signature} cannot take those two arguments") from None
    return guarded(fn, f"the loss {spec}")  # what it changes of the process (folder, grad mode, streams) put back
