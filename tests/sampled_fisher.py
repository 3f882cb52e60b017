"""Test support: a curvature kind that draws random numbers, the Fisher with labels sampled from the model,
``(1 / N) sum_i g_i(y~_i) g_i(y~_i)^T`` (``y~_i`` drawn from softmax(model(x_i)), ``g_i(y)`` sample i's gradient of
cross-entropy at label y), written on :class:`~flatfl.analysis.operators.loss_curvature.LossCurvature` as the contract
asks of a randomized kind: ``randomness = "per-sample"``, each sample's label drawn from its
:meth:`~flatfl.analysis.operators.loss_curvature.LossCurvature.sample_generator`, so the map is fixed and the same over
ranks. :func:`registered` registers it for the length of a block (tests/rank_jobs.py's ``curvatures`` job and
tests/test_curvature_kinds.py), so that the registry the other tests read stays the built-in one."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from flatfl.analysis.operators.kinds import register_curvature, unregister_curvature
from flatfl.analysis.operators.loss_curvature import LossCurvature
from flatfl.analysis.operators.products import ProductMethod

NAME = "sampled-fisher"


class SampledLabels(ProductMethod):
    """``F V``: per product, each batch's labels drawn (the same every time: one generator per sample) and the
    per-sample gradients at them, one sample at a time."""

    name = "sampled-labels"

    def __init__(self, op: "SampledFisherOperator") -> None:
        super().__init__(op.terms, op.block_size)
        self.op = op

    @property
    def preferred_block_size(self) -> int:
        return 8

    def labels(self) -> list[torch.Tensor]:
        """Each batch's sampled labels, in order."""
        terms, out, index = self.terms, [], 0
        with torch.no_grad():
            for inputs, _ in terms.batches:
                probs = torch.softmax(terms.model(inputs), dim=1).cpu()
                out.append(torch.cat([torch.multinomial(p, 1, generator=self.op.sample_generator(index + j))
                                      for j, p in enumerate(probs)]).to(terms.device))
                index += len(probs)
        return out

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        terms = self.terms
        out = torch.zeros_like(rows)
        with terms.model_mode():
            for (inputs, _), labels in zip(terms.batches, self.labels()):
                for x, y in zip(inputs, labels):
                    with torch.enable_grad():
                        loss = F.cross_entropy(terms.model(x[None]), y[None])
                        grads = torch.autograd.grad(loss, terms.params, allow_unused=True)
                    g = torch.cat([(d if d is not None else torch.zeros_like(p)).reshape(-1)
                                   for d, p in zip(grads, terms.params)])
                    out.add_(torch.outer(rows @ g, g), alpha=1.0 / terms.num_samples)
        return out


class SampledFisherOperator(LossCurvature):
    """The Fisher with labels sampled from the model's softmax (module docstring); ``(inputs, targets)`` batches
    under cross-entropy, the targets unused."""

    randomness = "per-sample"

    def __init__(self, model, batches, loss_fn=None, params=None, mode="eval", cache_bytes=None, block_size=None, *,
                 loss=None, seed: int = 0) -> None:
        self.seed = seed
        super().__init__(model, batches, loss_fn, params, mode, cache_bytes, block_size, loss=loss)

    def product_method(self) -> ProductMethod:
        self.terms.second_order = False
        return SampledLabels(self)


@contextlib.contextmanager
def registered():
    """The kind registered as ``sampled-fisher`` within the block."""
    register_curvature(NAME, SampledFisherOperator, title="sampled Fisher", full_name="Fisher of sampled labels",
                       description="(1/N) sum_i g_i g_i^T at labels drawn from the model, per sample from the seed")
    try:
        yield NAME
    finally:
        unregister_curvature(NAME)
