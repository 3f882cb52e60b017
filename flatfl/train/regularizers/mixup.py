"""Mixup (Zhang et al. ICLR 2018) as a local regularizer (FedAlign baseline; algorithms.md §19).

Per batch: lambda ~ Beta(gamma, gamma) and a random permutation pi of the batch; the model sees
x~ = lambda x + (1 - lambda) x[pi] and the loss is lambda CE(f(x~), y) + (1 - lambda) CE(f(x~), y[pi]).

``--mixup-gamma``: default 0.1, the FedAlign paper's value for its Table 1 (Sec. 3.2). The FedAlign code's argparse
default is 0.0, which it treats as lambda = 1, i.e. mixup off; flatfl keeps that meaning (gamma = 0 gives plain CE).
``step.logits`` are the logits of the mixed batch. Lambda and the permutation come from torch's global generator,
which the engine seeds per client and round.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .base import Regularizer


def sample_mix(gamma: float, batch: int) -> tuple[float, torch.Tensor]:
    """(lambda, permutation): lambda ~ Beta(gamma, gamma), or 1.0 when gamma == 0 (mixup off)."""
    if gamma <= 0:
        return 1.0, torch.arange(batch)
    g = torch.tensor(float(gamma), dtype=torch.float64)
    lam = float(torch.distributions.Beta(g, g).sample())
    return lam, torch.randperm(batch)


def mixup_loss(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)


@REGULARIZERS.register
class Mixup(Regularizer):
    name = "mixup"
    summary = "Mixup: train on convex mixtures of batch pairs, lambda ~ Beta(gamma, gamma)"
    hparams = (HParam("gamma", 0.1, "Mixup Beta(gamma, gamma) concentration; 0 switches mixup off",
                      flag="mixup-gamma", check="nonnegative"),)

    def forward(self, step: StepContext) -> torch.Tensor:
        lam, perm = sample_mix(self.gamma, len(step.y))
        if lam == 1.0:
            step.logits = step.model(step.x)
            return F.cross_entropy(step.logits, step.y)
        perm = perm.to(step.x.device)
        mixed = lam * step.x + (1.0 - lam) * step.x[perm]
        step.logits = step.model(mixed)
        step.scratch["mixup_lambda"] = lam
        return mixup_loss(step.logits, step.y, step.y[perm], lam)
