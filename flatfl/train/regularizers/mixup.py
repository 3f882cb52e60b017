"""Mixup (Zhang et al. ICLR 2018) as a local regularizer (FedAlign baseline; algorithms.md §19).

Per batch: lambda ~ Beta(gamma, gamma) and a random permutation pi of the batch; the model sees
x~ = lambda x + (1 - lambda) x[pi] and the loss is lambda CE(f(x~), y) + (1 - lambda) CE(f(x~), y[pi]).

``--mixup-gamma``: default 0.1, the FedAlign paper's value for its Table 1 (Sec. 3.2). The FedAlign code's argparse
default is 0.0, which it treats as lambda = 1, i.e. mixup off; flatfl keeps that meaning (gamma = 0 gives plain CE).
``step.logits`` are the logits of the mixed batch. Lambda and the permutation come from torch's global generator,
which the engine seeds per client and round.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .base import Regularizer


def beta_distribution(gamma: float) -> torch.distributions.Beta | None:
    """Beta(gamma, gamma) in float64, or None for gamma == 0 (mixup off)."""
    if gamma <= 0:
        return None
    g = torch.tensor(float(gamma), dtype=torch.float64)
    return torch.distributions.Beta(g, g, validate_args=False)


def sample_mix(beta: torch.distributions.Beta | None, batch: int) -> tuple[float, torch.Tensor]:
    """(lambda, permutation): lambda ~ ``beta``, or 1.0 when ``beta`` is None (mixup off)."""
    if beta is None:
        return 1.0, torch.arange(batch)
    return float(beta.sample()), torch.randperm(batch)


def mixup_loss(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)


@REGULARIZERS.register
class Mixup(Regularizer):
    name = "mixup"
    display_name = "Mixup"
    summary = "Mixup: train on convex mixtures of batch pairs, lambda ~ Beta(gamma, gamma)"
    hparams = (HParam("gamma", 0.1, "Mixup Beta(gamma, gamma) concentration; 0 switches mixup off",
                      flag="mixup-gamma", check="nonnegative"),)

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._beta = beta_distribution(self.gamma)

    def forward(self, step: StepContext) -> torch.Tensor:
        lam, perm = sample_mix(self._beta, len(step.y))
        if lam == 1.0:
            step.logits = step.model(step.x)
            return F.cross_entropy(step.logits, step.y)
        perm = perm.to(step.x.device)
        mixed = lam * step.x + (1.0 - lam) * step.x[perm]
        step.logits = step.model(mixed)
        step.scratch["mixup_lambda"] = lam
        step.scratch["mixup_perm"] = perm
        return mixup_loss(step.logits, step.y, step.y[perm], lam)
