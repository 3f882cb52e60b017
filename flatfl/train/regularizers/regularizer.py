"""The regularizer interface: what a local step's data loss is.

A :class:`Regularizer` decides the data part of the local objective. The default :meth:`Regularizer.forward` runs
the model, takes the mean cross-entropy and adds :meth:`penalty` (MAN's activation norm, ASD's distillation, ...).
Regularizers that change the forward pass itself (Mixup mixes inputs, GradAug adds sub-networks) override
``forward``. Because the whole data loss is computed inside the optimizer's closure, SAM-type optimizers see the
regularizer in both their ascent and descent passes.

Clients train in cohorts of N (:class:`~flatfl.train.context.Cohort`; N = 1 is one at a time): a step's data loss
is one value per client, (M,), computed from one batched forward pass of the stacked network (``step.model(x)``:
(M, B, ...) -> (M, B, K)).

Lifecycle: ``attach(network)`` on each working network (the model, and each stacked network built from it: install
hooks, switch modes); ``start_cohort(cohort)`` / ``end_cohort(cohort)`` around a cohort's local training (build a
teacher, read label frequencies).

:meth:`Regularizer.cohort_refusal` says why the regularizer cannot train the clients of a model together (None when
it can); the engine then trains one client at a time, with a notice.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..components import REGULARIZERS, Component
from ..context import Cohort, StepContext


def per_client_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each client's mean cross-entropy: logits (M, B, K), labels (M, B) -> (M,)."""
    if logits.shape[0] == 1:
        return F.cross_entropy(logits[0], y[0]).reshape(1)
    m, b = y.shape
    return F.cross_entropy(logits.reshape(m * b, -1), y.reshape(-1), reduction="none").view(m, b).mean(1)


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities (log-softmaxes) of the same shape (..., K) -> (...):
    sum_c p_c * (log p_c - log q_c), p = exp(log_p). The distillation terms of ASD, GradAug, FedNTD and FedGMT."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class Regularizer(Component):
    kind: ClassVar[str] = "regularizer"

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        self.hp = dict(hp)
        for k, v in hp.items():
            setattr(self, k, v)
        self.num_classes = num_classes
        self.config = config

    @classmethod
    def prepare_model(cls, model: nn.Module, hp: dict[str, Any]) -> nn.Module:
        """Change the architecture before training if needed (StochDepth sets block survival). Default: no-op."""
        return model

    def cohort_refusal(self, model: nn.Module) -> str | None:
        """Why the clients of ``model`` cannot train together under this regularizer (channel-stacked), or None."""
        return None

    def attach(self, model: nn.Module) -> None:
        """Called once with each working network (the model; a stacked network) before it trains."""

    def record(self) -> dict:
        """What config.json records of this regularizer as the run set it up (e.g. the modules it hooked), once
        attached; empty (nothing recorded) by default."""
        return {}

    def start_cohort(self, cohort: Cohort) -> None:
        """Called before a cohort's local training in a round."""

    def end_cohort(self, cohort: Cohort) -> None:
        """Called after a cohort's local training in a round."""

    def forward(self, step: StepContext) -> torch.Tensor:
        """Each client's data loss on its batch, (M,): mean cross-entropy plus this regularizer's penalty. Sets
        ``step.logits``."""
        step.logits = step.model(step.x)
        loss = per_client_cross_entropy(step.logits, step.y)
        pen = self.penalty(step)
        return loss if pen is None else loss + pen

    def penalty(self, step: StepContext) -> torch.Tensor | None:
        """The penalty of each client, (M,), or None."""
        return None


@REGULARIZERS.register
class NoRegularizer(Regularizer):
    name = "none"
    summary = "no regularizer: the mean cross-entropy"
