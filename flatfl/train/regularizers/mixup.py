"""Mixup (Zhang et al. ICLR 2018) as a local regularizer (FedAlign baseline; docs/update-rules.md §19).

Per batch: lambda ~ Beta(gamma, gamma) and a random permutation pi of the batch; the model sees
x~ = lambda x + (1 - lambda) x[pi] and the loss is lambda CE(f(x~), y) + (1 - lambda) CE(f(x~), y[pi]).

``--mixup-gamma``: default 0.1, the FedAlign paper's value for its Table 1 (Sec. 3.2). The FedAlign code's argparse
default is 0.0, which it treats as lambda = 1, i.e. mixup off; flatfl keeps that meaning (gamma = 0 gives plain CE).
``step.logits`` are the logits of the mixed batch. Each client's lambda and permutation come from torch's global generator set to
that client's own stream (seeded per client and round), so clients trained together draw what they draw alone.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..components import REGULARIZERS, HParam
from ..context import StepContext, client_rng
from .regularizer import Regularizer, per_client_cross_entropy


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
    name, display_name = "mixup", "Mixup"
    summary = "Mixup: train on convex mixtures of batch pairs, lambda ~ Beta(gamma, gamma)"
    hparams = (HParam("gamma", 0.1, "Mixup Beta(gamma, gamma) concentration; 0 switches mixup off",
                      flag="mixup-gamma", check="nonnegative"),)

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._beta = beta_distribution(self.gamma)

    def forward(self, step: StepContext) -> torch.Tensor:
        m, b = step.y.shape
        draws = []
        for c in step.clients:  # each client's lambda and permutation from its own stream
            with client_rng(c):
                draws.append(sample_mix(self._beta, b))
        if m == 1 and draws[0][0] == 1.0:
            step.logits = step.model(step.x)
            return per_client_cross_entropy(step.logits, step.y)
        lam = torch.tensor([d[0] for d in draws], device=step.x.device, dtype=step.x.dtype)
        perm = torch.stack([d[1] for d in draws]).to(step.x.device)  # (M, B)
        other_x = torch.stack([step.x[k][perm[k]] for k in range(m)])
        other_y = torch.gather(step.y, 1, perm)
        if m == 1:  # one client: the single-batch formulas (the same numbers as before batching)
            lam0 = draws[0][0]
            mixed = (lam0 * step.x[0] + (1.0 - lam0) * other_x[0]).unsqueeze(0)
            step.logits = step.model(mixed)
            loss = mixup_loss(step.logits[0], step.y[0], other_y[0], lam0).reshape(1)
        else:
            shape = (m,) + (1,) * (step.x.dim() - 1)
            mixed = lam.view(shape) * step.x + (1.0 - lam.view(shape)) * other_x
            step.logits = step.model(mixed)
            loss = lam * per_client_cross_entropy(step.logits, step.y) + \
                (1.0 - lam) * per_client_cross_entropy(step.logits, other_y)
        step.scratch["mixup_lambda"] = lam
        step.scratch["mixup_perm"] = perm
        return loss
