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

Clients trained together (a channel-stacked network, ``--parallel-clients``): each client draws its widths and
resolutions from its own stream (:func:`client_rng`), in the order it draws them alone. A sub-network pass runs
every client at once at one resolution, each at its own width: the stacked BatchNorms normalise with batch
statistics (running statistics untouched, as a slimmed BatchNorm does) and zero each client's channels beyond its
leading ceil(w*C), so every convolution and the classifier see exactly the slimmed network's inputs (the extra
channels are zeros). The clients' sub-networks are grouped into passes by resolution (a client with two
sub-networks at one resolution takes two passes); a client without a sub-network in a pass runs with every channel
zeroed and its KL term weighted 0. So a step costs one full pass plus one pass per (resolution, repeat) drawn (about
6 for 10 clients, 2 sub-networks and 4 resolutions, against 2 for one client). GroupNorm networks of one group
(its statistics would span the masked channels) and ``--width 1`` (every sub-network is the full network, whose
BatchNorm statistics move) train one client at a time. GroupNorm of more groups is refused at ``attach``: most
random widths leave channel counts it cannot split (one client at a time fails on them too).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.slimmable import check_width, slim_channels
from ...models.stacking import StackedBatchNorm2d, stacked_clients
from ..components import REGULARIZERS, HParam
from ..context import StepContext, client_rng
from .base import Regularizer, per_client_cross_entropy
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


def clients_kl(log_target: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """:func:`batch_kl` of each client: log-softmaxed targets and student logits (M, B, K) -> (M,)."""
    log_s = F.log_softmax(student_logits, dim=2)
    return (log_target.exp() * (log_target - log_s)).sum(2).mean(1)


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

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._norms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stacked network -> its BatchNorms

    def cohort_refusal(self, model: nn.Module) -> str | None:
        if self.mu and check_width(self.width) == 1.0:
            return "at --width 1 every sub-network is the full network, whose BatchNorm statistics move with each"
        if any(isinstance(m, nn.GroupNorm) for m in model.modules()):
            return "GroupNorm's groups span each client's active channels, which differ per client"
        return None

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
        if stacked_clients(model) > 1:
            self._norms[model] = [m for m in model.modules() if isinstance(m, StackedBatchNorm2d)]

    def sample_widths(self) -> list[float]:
        """[omega] + (n - 1) draws from U[omega, 1], sorted widest first."""
        extra = (self.width + (1.0 - self.width) * torch.rand(self.num_subnets - 1, dtype=torch.float64)).tolist()
        return sorted([self.width] + extra, reverse=True)

    def forward(self, step: StepContext) -> torch.Tensor:
        if step.cohort.n == 1:
            return self.client_loss(step).reshape(1)
        return self.clients_loss(step)

    def clients_loss(self, step: StepContext) -> torch.Tensor:
        """Each of the step's M clients' loss, (M,): one full pass, then the sub-network passes (module docstring)."""
        m = step.m
        logits = step.model(step.x)
        step.logits = logits
        loss = per_client_cross_entropy(logits, step.y)
        if not self.mu:
            return loss
        size = step.x.shape[-1]
        sizes = resolutions(size)
        passes: dict[tuple[int, int], dict[int, float]] = {}  # (resolution, repeat) -> {client: width}
        for k, c in enumerate(step.clients):
            with client_rng(c):  # the widths, then one resolution per sub-network: a client's own order
                widths = self.sample_widths()
                picks = torch.randint(len(sizes), (len(widths),)).tolist()
            repeats: dict[int, int] = {}  # resolution -> this client's sub-networks at it so far
            for w, i in zip(widths, picks):
                repeat = repeats[sizes[i]] = repeats.get(sizes[i], -1) + 1
                passes.setdefault((sizes[i], repeat), {})[k] = w
        norms = self._norms[step.cohort.network]
        counts = sorted({bn.per_client for bn in norms})
        # every pass's channel masks (per channel count, (M, C)) and client weights (M,): one copy to the device
        host: list[float] = []
        for chosen in passes.values():
            for c in counts:
                for k in range(m):
                    on = slim_channels(c, chosen[k]) if k in chosen else 0
                    host += [1.0] * on + [0.0] * (c - on)
            host += [1.0 if k in chosen else 0.0 for k in range(m)]
        flat = torch.tensor(host, dtype=logits.dtype).to(logits.device)
        log_target = F.log_softmax(logits.detach(), dim=2)
        resized: dict[int, torch.Tensor] = {}
        kl_total = None
        start = 0
        try:
            for (r, _), chosen in passes.items():
                masks = {}
                for c in counts:
                    masks[c] = flat[start:start + m * c]
                    start += m * c
                present = flat[start:start + m]
                start += m
                for bn in norms:
                    bn.channel_mask = masks[bn.per_client]
                if r not in resized:
                    x = step.x
                    resized[r] = x if r == size else F.interpolate(
                        x.reshape(-1, *x.shape[2:]), size=(r, r), mode="bilinear", align_corners=True
                    ).view(*x.shape[:3], r, r)
                term = clients_kl(log_target, step.model(resized[r])) * present
                kl_total = term if kl_total is None else kl_total + term
        finally:
            for bn in norms:
                bn.channel_mask = None
        step.scratch["gradaug_kl"] = kl_total.detach()
        return loss + self.mu * kl_total

    def client_loss(self, step: StepContext) -> torch.Tensor:
        """The loss of a cohort of one client: its sub-networks one after another at their widths."""
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
