"""GradAug: self-distillation into randomly slimmed, randomly resized sub-networks (Yang et al. NeurIPS 2020, as a
FedAlign baseline: FedAlign paper Eq. 2; algorithms.md §19).

Per batch::

    loss = CE(F(x), y) + mu * sum_{i=1..n} KL( softmax(F(x)).detach() || softmax(F_{w_i}(T_i(x))) )

F is the full network; the n sub-networks run at widths {omega} plus n - 1 widths uniform in [omega, 1], widest
first, each on the batch bilinearly resized (``align_corners=True``) to a resolution drawn uniformly from
{s, 7s/8, 6s/8, 5s/8} rounded (s the input size: {32, 28, 24, 20} on CIFAR as in the FedAlign code, {8, 7, 6, 5} on
the 8x8 digits). KL is the batch mean of the per-sample KL. All terms form one loss, so one optimizer step (and SAM's
two passes) covers them; the FedAlign code backpropagates them one by one into the same step, which gives the same
gradient.

Defaults: the FedAlign paper's Table 1 setting, n = 2 sub-networks (``--num-subnets``), omega = 0.8 (``--width``)
and mu = 1.75 (``--gradaug-mu``). The FedAlign code's argparse defaults are num_subnets 3, width 0.25 (shared with
FedAlign), mult 1.0; pass those flags to reproduce them.

The network must be slimmable as a whole (``set_width(w, stages="all")``): flatfl's ResNets. Other models raise
:class:`ConfigError` at ``attach``. The width is restored to 1.0 after every batch, also on errors. Random widths and
resolutions come from torch's global generator, which the engine seeds per client and round.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.slimmable import check_width
from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .base import Regularizer
from .fedalign import WIDTH_HELP

RESOLUTION_EIGHTHS = (8, 7, 6, 5)


def resolutions(size: int) -> list[int]:
    """The candidate input sizes round(size * k / 8), k = 8, 7, 6, 5 (duplicates and sizes < 1 dropped)."""
    out: list[int] = []
    for k in RESOLUTION_EIGHTHS:
        r = int(size * k / 8 + 0.5)
        if r >= 1 and r not in out:
            out.append(r)
    return out


def batch_kl(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean_i KL(softmax(target_i) || softmax(student_i)) (torch's KLDivLoss with reduction='batchmean')."""
    log_t = F.log_softmax(target_logits, dim=1)
    log_s = F.log_softmax(student_logits, dim=1)
    return (log_t.exp() * (log_t - log_s)).sum(1).mean()


@REGULARIZERS.register
class GradAug(Regularizer):
    name = "gradaug"
    display_name = "GradAug"
    summary = "GradAug: CE + mu * KL of slimmed, resized sub-networks to the full network's prediction"
    hparams = (
        HParam("num_subnets", 2, "GradAug sub-networks per batch: the minimum width plus num_subnets-1 random ones",
               check="positive"),
        HParam("width", 0.8, WIDTH_HELP, check="unit"),
        HParam("mu", 1.75, "GradAug weight of the sub-networks' KL terms", flag="gradaug-mu", check="nonnegative"),
    )

    #: every client draws its own sub-network widths and input sizes per step: one client at a time
    batchable = False

    def attach(self, model: nn.Module) -> None:
        check_width(self.width)
        if not callable(getattr(model, "set_width", None)):
            raise ConfigError(f"gradaug needs a slimmable network (resnet20, resnet56, resnet18); "
                              f"{type(model).__name__} cannot run at reduced width")
        model.set_width(self.width, stages="all")  # raises ConfigError when e.g. GroupNorm cannot split
        model.set_width(1.0)

    def sample_widths(self) -> list[float]:
        """[omega] + (n - 1) draws from U[omega, 1], sorted widest first."""
        extra = (self.width + (1.0 - self.width) * torch.rand(self.num_subnets - 1, dtype=torch.float64)).tolist()
        return sorted([self.width] + extra, reverse=True)

    def forward(self, step: StepContext) -> torch.Tensor:
        return self.client_loss(step).reshape(1)

    def client_loss(self, step: StepContext) -> torch.Tensor:
        """The one client's loss (GradAug trains one client at a time: ``batchable`` is False)."""
        model, x, y = step.single()
        logits = model(x)
        step.logits = logits.unsqueeze(0)
        loss = F.cross_entropy(logits, y)
        if not self.mu:
            return loss
        target = logits.detach()
        sizes = resolutions(x.shape[-1])
        kl_total = 0.0
        try:
            for w in self.sample_widths():
                model.set_width(w, stages="all")
                r = sizes[int(torch.randint(len(sizes), ()))]
                xr = x if r == x.shape[-1] else F.interpolate(x, size=(r, r), mode="bilinear", align_corners=True)
                kl_total = kl_total + batch_kl(target, model(xr))
        finally:
            model.set_width(1.0)
        step.scratch["gradaug_kl"] = kl_total.detach()
        return loss + self.mu * kl_total
