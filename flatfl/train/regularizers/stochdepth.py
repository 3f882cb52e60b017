"""Stochastic depth (Huang et al. ECCV 2016) as a local regularizer (FedAlign baseline; algorithms.md §19).

:meth:`StochDepth.prepare_model` sets each residual block's survival probability linearly from 1.0 (first block) to
``--survival-last`` (last block) with :func:`flatfl.models.set_stochastic_depth`. The blocks do the rest: in
training one Bernoulli(p) draw per block and forward pass keeps or drops the residual branch (torch's global
generator, seeded by the engine per client and round); in eval mode a block computes relu(shortcut + p * branch), so
the server model is evaluated (and its Hessian measured) as the expected network. The survival values are recorded
in the model's spec, so a checkpoint rebuilds the same evaluation network. The data loss is the plain CE.

A wrapped ResNet (MOON's projection-head model) gets the schedule on its inner network.

``--survival-last``: default 0.9, the FedAlign paper's rho_L (Sec. 3.2); the FedAlign code's argparse default
``stoch_depth`` is 0.5. Models without residual blocks raise :class:`ConfigError`.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ...models.resnet import set_stochastic_depth
from ..components import REGULARIZERS, HParam
from .base import Regularizer


@REGULARIZERS.register
class StochDepth(Regularizer):
    name = "stochdepth"
    display_name = "StochDepth"
    summary = "stochastic depth: residual blocks dropped at random, survival 1.0 -> --survival-last"
    hparams = (HParam("survival_last", 0.9, "stochastic depth: survival probability of the last residual block "
                      "(linear from 1.0 at the first)", check="unit"),)

    #: each block's keep/drop draw is one per forward for a client's whole batch: one client at a time
    batchable = False

    @classmethod
    def prepare_model(cls, model: nn.Module, hp: dict[str, Any]) -> nn.Module:
        # the ResNet itself, or the one inside a wrapper (MOON's projection-head model)
        resnet = next((m for m in model.modules() if callable(getattr(m, "residual_blocks", None))), model)
        set_stochastic_depth(resnet, hp["survival_last"])  # ConfigError for models without residual blocks
        return model
