"""A curvature operator over data shards on several ranks (docs/distributed.md; docs/analysis-protocols.md §1).

Under torchrun every rank holds the whole model and one shard of the evaluation samples. The curvature of the
sample-weighted mean loss over all N samples is the sample-weighted sum of the shards' curvatures::

    H v = sum_r (n_r / N) H_r v          (H_r: the curvature of rank r's mean loss over its n_r samples)

so :class:`DistributedOperator` wraps the operator of this rank's shard (any
:class:`~flatfl.analysis.operators.linear_operator.CurvatureOperator` that is such a sum: every kind of
:class:`~flatfl.analysis.operators.loss_curvature.LossCurvature`, whose contract says so) and every product is one
all-reduce of the scaled local products. A kind's shard is told so before any product
(:meth:`~flatfl.analysis.operators.loss_curvature.LossCurvature.as_shard`): what it measures to choose how products
are computed (the finite-difference step and its stated error) is measured over the whole set, the same on every
rank; a kind that draws random numbers draws them per sample from its seed, which the ranks agree on, so that every
rank applies the same map. Every rank then holds the same ``H V`` (an all-reduce leaves the same sum on every rank), the
estimators run unchanged on every rank from the same seeds and take the same steps: no estimator knows of ranks.
The block size the estimators ask for is agreed (the smallest over the ranks), so that every rank calls the same
products in the same order.

:func:`shard_batches` cuts the evaluation set into contiguous ranges of samples, as equal as the count allows
(unequal shards when it does not divide), slicing a batch where a range ends; :func:`over_ranks` builds the
operator of a command or of the Python API: the plain operator in one process, else this rank's shard wrapped,
once the ranks have found that they hold the same evaluation set and weights (:func:`flatfl.utils.ranks.agree`);
``flatfl hessian-clients`` deals its clients out to the ranks instead, by the world's own rule
(:meth:`flatfl.utils.ranks.World.dealt`; each client's operator stays whole on one rank).
A Hessian in ``train`` mode (batch statistics, per-batch random state) keeps whole batches, so it is refused over
several ranks.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import ConfigError
from ...utils import ranks
from ...utils.batch_walk import leaves, slice_samples
from .linear_operator import CurvatureOperator, DerivedOperator
from .loss_curvature import RANDOMNESS
from .objective import batch_samples

__all__ = ["DistributedOperator", "shard_batches", "shard_ranges", "over_ranks"]


def shard_ranges(sizes: list[int], ranks: int) -> list[tuple[int, int]]:
    """Each rank's range ``[start, stop)`` of the samples of batches of ``sizes``: contiguous, sizes differing by at
    most one sample."""
    total = int(sum(sizes))
    if total < ranks:
        raise ConfigError(f"the evaluation set has {total} sample{'s' if total != 1 else ''}, fewer than the {ranks} "
                          "ranks it is split over: use more samples or fewer ranks")
    base, extra = divmod(total, ranks)
    bounds = [0]
    for r in range(ranks):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return list(zip(bounds, bounds[1:]))


def shard_batches(batches: list, rank: int, ranks: int, *, objective: bool = False) -> list:
    """Rank ``rank``'s batches of ``batches`` (``(inputs, targets)`` pairs, or with ``objective`` batches of any
    structure, sized by :func:`~flatfl.analysis.operators.objective.batch_samples`): the samples of its range of
    :func:`shard_ranges`, a batch sliced where the range starts or stops inside it."""
    sizes = [batch_samples(b, i) for i, b in enumerate(batches)] if objective else [len(t) for _, t in batches]
    start, stop = shard_ranges(sizes, ranks)[rank]
    out, offset = [], 0
    for batch, n in zip(batches, sizes):
        a, b = max(start - offset, 0), min(stop - offset, n)
        if a < b:
            out.append(batch if (a, b) == (0, n) else slice_samples(batch, a, b, n))
        offset += n
    return out


class DistributedOperator(DerivedOperator):
    """The curvature of the mean loss over every rank's samples, from ``local``: this rank's operator of the mean
    loss over its ``num_samples`` samples (see the module docstring). ``loss()`` and ``gradient()`` are reduced the
    same way; the layout members (``param_shapes``, ``param_names``, ``unflatten``, ``flatten``) are ``local``'s."""

    def __init__(self, local: CurvatureOperator, num_samples: int, world: ranks.World | None = None) -> None:
        world = world if world is not None else ranks.world()  # the ranks whose shards these are
        self.op = local
        self.dim, self.dtype, self.device = local.dim, local.dtype, local.device
        counts = ranks.all_gather_objects(int(num_samples))
        self.shard_samples = [int(c) for c in counts]
        self.num_samples = int(sum(self.shard_samples))
        self.scale = int(num_samples) / self.num_samples
        self.param_names = local.param_names
        randomness = getattr(local, "randomness", None)  # the curvature contract's point 3 (loss_curvature.py)
        if randomness not in RANDOMNESS:
            raise ConfigError(f"{type(local).__name__} declares randomness = {randomness!r}: over several ranks an "
                              "operator draws its random numbers per sample from its seed (randomness = "
                              "'per-sample'), so that every rank applies the same map")
        if randomness is not None:
            ranks.agree({"curvature seed": int(local.seed)})
        as_shard = getattr(local, "as_shard", None)  # a model's curvature: one shard of the evaluation set
        if callable(as_shard):
            as_shard(self.whole, sum(self.shard_samples[:world.rank]))
        self.hvps = 0
        self.on_hvp: Callable[[int], None] | None = None
        # every rank must push the same blocks: the smallest preferred block (and limit) of all ranks
        self._block = ranks.all_reduce_min(int(local.preferred_block_size))
        limit = getattr(local, "block_limit", None)  # a model's operator: the most vectors one pass takes
        self._limit = ranks.all_reduce_min(int(limit())) if callable(limit) else None

    @property
    def world_size(self) -> int:
        return len(self.shard_samples)

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        return self.op.param_shapes

    @property
    def preferred_block_size(self) -> int:
        return self._block

    def block_limit(self) -> int:
        return self._limit if self._limit is not None else self._block

    @property
    def products(self) -> str | None:
        return self.op.products

    @property
    def product_error(self) -> float | None:
        """The stated relative error of a product (finite differences: measured on the first product over the
        whole evaluation set, the same on every rank), else None."""
        return self.op.product_error

    def product_error_along(self, V: torch.Tensor) -> float | None:
        """Measured over the whole evaluation set (every rank the same number, its products counted here too)."""
        error = self.op.product_error_along(V)
        if error is not None:
            self.hvps += 2 * V.shape[1]
        return error

    def whole(self, quantity: torch.Tensor) -> torch.Tensor:
        """A quantity of this rank's mean loss (a gradient, a product) as the whole evaluation set's: scaled by the
        shard's share of the samples and summed over the ranks, into a new tensor."""
        return ranks.all_reduce_sum(quantity.mul(self.scale))

    @property
    def params(self):
        return self.op.params

    def unflatten(self, vector: torch.Tensor):
        return self.op.unflatten(vector)

    def flatten(self, tensors):
        return self.op.flatten(tensors)

    def release(self) -> None:
        self.op.release()

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        out = self.whole(self.op.matmat(V))
        self.hvps += V.shape[1]
        if self.on_hvp is not None:
            self.on_hvp(V.shape[1])
        return out

    def exact_trace(self, seed: int = 0):
        """The exact trace over every rank's samples (the shard's, summed by its share: the local operator was told
        it is a shard)."""
        return self.op.exact_trace(seed)

    def loss(self) -> float:
        """The mean loss over every rank's samples."""
        total = torch.tensor([self.op.loss() * self.scale], dtype=torch.float64, device=self.device)
        return float(ranks.all_reduce_sum(total).item())

    def gradient(self) -> torch.Tensor:
        """The flat gradient of the mean loss over every rank's samples."""
        return self.whole(self.op.gradient())


def over_ranks(build: Callable[[list], CurvatureOperator], batches: list, *, objective: bool = False,
               mode: str = "eval", world: ranks.World | None = None) -> CurvatureOperator:
    """The operator of a command or of the Python API: ``build(batches)`` in a world of one; over several ranks
    (``world``: a command's; None: this process's, :func:`flatfl.utils.ranks.world`), ``build`` of this rank's
    shard (:func:`shard_batches`) in a :class:`DistributedOperator`. ``batches`` is the whole evaluation set as a
    list (the same on every rank)."""
    w = world if world is not None else ranks.world()
    if not w.distributed:
        return build(batches)
    if mode != "eval":
        raise ConfigError(f"a Hessian in {mode!r} mode keeps whole batches (batch statistics, random state per batch) "
                          "and runs in one process: use mode='eval' over several ranks")
    batches = list(batches)
    mine = shard_batches(batches, w.rank, w.size, objective=objective)
    local = build(mine)
    # before any product: every rank holds the same evaluation set and the same weights (a rank given other data or
    # another checkpoint would mix its numbers into the others'). Compared leaf by leaf: digest follows dicts, lists
    # and tuples only, and would read a UserDict or a dataclass by its repr (which names the device, elides values)
    ranks.agree({"evaluation data": ranks.digest([list(leaves(b)) for b in batches]),
                 "weights": ranks.fingerprint(local.param_names, list(getattr(local, "params", None) or []))})
    return DistributedOperator(local, local.num_samples, w)
