"""GradAug: self-distillation into randomly slimmed, randomly resized sub-networks (Yang et al. NeurIPS 2020, as a
FedAlign baseline: FedAlign paper Eq. 2; docs/update-rules.md §19).

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
:class:`ConfigError` at ``attach``. The width is restored to 1.0 after every batch, also on errors.

A step of a cohort of M clients (one at a time: M = 1): each client draws its widths and resolutions from its own
stream (:func:`client_rng`, seeded per client and round). A network of one client runs its sub-networks one after
another at their widths. A channel-stacked network (``--parallel-clients``) runs every client's sub-networks at once
(:class:`~flatfl.models.canvas.Canvas`): client k's t-th sub-network is slot t * M + k of the stacked network, at
its own width (channels beyond it zeroed after each BatchNorm), on its own resized batch in the top-left corner of a
full-size canvas (BatchNorm statistics and the global pool over that corner). Each slot computes its client's
slimmed sub-network on its resized batch, BatchNorm running statistics untouched, as a slimmed BatchNorm leaves
them. So a step costs one full pass and one canvas pass (one client alone: one full pass and n sub-network passes).
GroupNorm networks (their group statistics would span the canvas and the masked channels) and ``--width 1`` (every
sub-network is the full network, whose BatchNorm statistics move) train one client at a time. GroupNorm of more than
one group is refused at ``attach``: most random widths leave channel counts it cannot split (one client at a time
fails on them too).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.canvas import Canvas, canvas_refusal
from ...models.slimmable import check_width
from ...models.stacking import stacked_clients
from ..components import REGULARIZERS, HParam
from ..context import StepContext, client_rng
from .regularizer import Regularizer, kl_divergence, per_client_cross_entropy
from .fedalign import WIDTH_HELP

RESOLUTION_EIGHTHS = (8, 7, 6, 5)
MAX_SUBNETS = 100  # --num-subnets: one forward and backward pass each per batch, its activations held


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
    return kl_divergence(log_t, log_s).mean()


def clients_kl(log_target: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """:func:`batch_kl` of each client: log-softmaxed targets (M, B, K) and student logits (..., M, B, K) ->
    (..., M)."""
    log_s = F.log_softmax(student_logits, dim=-1)
    return kl_divergence(log_target, log_s).mean(-1)


@REGULARIZERS.register
class GradAug(Regularizer):
    name, display_name = "gradaug", "GradAug"
    summary = "GradAug: CE + mu * KL of slimmed, resized sub-networks to the full network's prediction"
    hparams = (
        HParam("num_subnets", 2, "GradAug sub-networks per batch: the minimum width plus num_subnets-1 random ones",
               check="positive", most=MAX_SUBNETS),
        HParam("width", 0.8, WIDTH_HELP, check="unit"),
        HParam("mu", 1.75, "GradAug weight of the sub-networks' KL terms", flag="gradaug-mu", check="nonnegative"),
    )

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._canvases: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stacked network -> its Canvas

    def cohort_refusal(self, model: nn.Module) -> str | None:
        if self.mu and check_width(self.width) == 1.0:
            return "at --width 1 every sub-network is the full network, whose BatchNorm statistics move with each"
        why = canvas_refusal(model)
        return None if why is None else f"its sub-networks cannot share one pass: {why}"

    def attach(self, model: nn.Module) -> None:
        check_width(self.width)
        if not callable(getattr(model, "set_width", None)):
            raise ConfigError(f"gradaug needs a slimmable network (resnet20, resnet56, resnet18); "
                              f"{type(model).__name__} cannot run at reduced width")
        model.set_width(self.width, stages="all")  # raises ConfigError when e.g. GroupNorm cannot split
        model.set_width(1.0)
        split = [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm) and m.num_groups > 1]
        if split and self.mu and self.width < 1.0:
            raise ConfigError(f"gradaug draws sub-network widths uniformly in [{self.width:g}, 1], and GroupNorm with "
                              f"{split[0]} groups cannot split most of them (use BatchNorm, or GroupNorm with 1 group)")

    def sample_widths(self) -> list[float]:
        """[omega] + (n - 1) draws from U[omega, 1], sorted widest first."""
        extra = (self.width + (1.0 - self.width) * torch.rand(self.num_subnets - 1, dtype=torch.float64)).tolist()
        return sorted([self.width] + extra, reverse=True)

    def forward(self, step: StepContext) -> torch.Tensor:
        """Each of the step's M clients' loss, (M,): one full pass, each client's draws from its own stream (the
        widths, then one resolution per sub-network: the order of a client alone), then the sub-networks' KL
        terms (:meth:`subnetworks_kl`)."""
        logits = step.model(step.x)
        step.logits = logits
        loss = per_client_cross_entropy(logits, step.y)
        if not self.mu:
            return loss
        sizes = resolutions(step.x.shape[-1])
        draws = []
        for c in step.clients:
            with client_rng(c):
                widths = self.sample_widths()
                draws.append((widths, torch.randint(len(sizes), (len(widths),)).tolist()))
        kl_total = self.subnetworks_kl(step, logits.detach(), draws, sizes)
        step.scratch["gradaug_kl"] = kl_total.detach()
        return loss + self.mu * kl_total

    def subnetworks_kl(self, step: StepContext, target: torch.Tensor, draws: list[tuple[list[float], list[int]]],
                       sizes: list[int]) -> torch.Tensor:
        """sum_t KL(softmax(target) || softmax(sub-network t)) of each client, (M,): on a channel-stacked network
        one canvas pass of every client's sub-networks (slot t * M + k: client k's t-th); on a network of one
        client (a canvas needs stacked layers) its sub-networks one after another at their widths, each on the
        bilinearly resized batch. The two agree up to summation order (``tests/test_canvas.py``)."""
        network, m = step.cohort.network, step.m
        if stacked_clients(network) == 1:
            model, x, _ = step.single()
            kl_total = 0.0
            try:
                for w, pick in zip(*draws[0]):
                    model.set_width(w, stages="all")
                    r = sizes[pick]
                    xr = x if r == x.shape[-1] else F.interpolate(x, size=(r, r), mode="bilinear", align_corners=True)
                    kl_total = kl_total + batch_kl(target[0], model(xr))
            finally:
                model.set_width(1.0)
            return kl_total.reshape(1)
        n = len(draws[0][0])
        widths = [draws[k][0][t] for t in range(n) for k in range(m)]
        picks = [draws[k][1][t] for t in range(n) for k in range(m)]
        size = step.x.shape[-1]
        canvas = self._canvases.get(network)
        if canvas is None or canvas.size != size:
            canvas = self._canvases[network] = Canvas(network, size, sizes)
        with canvas.slots(step.x, widths, picks) as inputs:
            student = step.model(inputs)
        return clients_kl(F.log_softmax(target, dim=2), student.view(n, m, *student.shape[1:])).sum(0)
