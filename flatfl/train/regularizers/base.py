"""The regularizer interface: what a local step's data loss is.

A :class:`Regularizer` decides the data part of the local objective. The default :meth:`Regularizer.forward` runs
the model, takes the mean cross-entropy and adds :meth:`penalty` (MAN's activation norm, ASD's distillation, ...).
Regularizers that change the forward pass itself (Mixup mixes inputs, GradAug adds sub-networks) override
``forward``. Because the whole data loss is computed inside the optimizer's closure, SAM-type optimizers see the
regularizer in both their ascent and descent passes.

Lifecycle: ``attach(model)`` once, on the working model (install hooks, switch modes); ``start_client(cctx)`` /
``end_client(cctx)`` around each client's local training (build a teacher, read label frequencies).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..components import REGULARIZERS, Component
from ..context import ClientContext, StepContext


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

    def attach(self, model: nn.Module) -> None:
        """Called once with the working model before any training."""

    def start_client(self, cctx: ClientContext) -> None:
        """Called before client i's local training in a round."""

    def end_client(self, cctx: ClientContext) -> None:
        """Called after client i's local training in a round."""

    def forward(self, step: StepContext) -> torch.Tensor:
        """The data loss of one batch: mean cross-entropy plus this regularizer's penalty. Sets ``step.logits``."""
        step.logits = step.model(step.x)
        loss = F.cross_entropy(step.logits, step.y)
        pen = self.penalty(step)
        return loss if pen is None else loss + pen

    def penalty(self, step: StepContext) -> torch.Tensor | None:
        return None


@REGULARIZERS.register
class NoRegularizer(Regularizer):
    name = "none"
    summary = "no regularizer: the mean cross-entropy"
