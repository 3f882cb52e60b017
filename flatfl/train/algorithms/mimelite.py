"""MimeLite (Karimireddy et al. 2020, "Mime"), with SGD-momentum as the base optimizer, as fedjax's
``mime_lite.py`` structures it (docs/update-rules.md section 11).

Server state: theta and the base optimizer's state, a momentum buffer m (starts at 0).

Clients start from theta^t and take their local steps with the server's momentum *frozen* (never updated
locally)::

    theta <- theta - eta ((1 - beta) g + beta m)         g the local gradient (then clipping, weight decay)

Each client also computes the full-batch gradient of its cross-entropy at the start point theta^t (one extra pass
over its data, without augmentation). Server::

    Delta = sum_i n_i (theta^t - theta_i) / sum_i n_i            (each delta clipped to norm --mime-clip if > 0)
    theta^{t+1} = theta^t - eta_g Delta
    grad = sum_i (sum of client i's per-sample gradients at theta^t) / sum_i n_i
    m   <- (1 - beta) grad + beta m

The full-batch gradient is of the cross-entropy alone (not of a regularizer's penalty), with the model in training
mode, in batches of --batch-size.

Defaults, all unverified (docs/update-rules.md section 22: no values found): beta = 0.9, eta_g = 1, no delta clipping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..components import HParam
from .algorithm import Algorithm, ClientResult, register, weighted_mean
from .fedcm import SERVER_LR


@register
class MimeLite(Algorithm):
    name, display_name = "mimelite", "MimeLite"
    summary = "MimeLite: local steps with the server's frozen momentum; momentum advanced by full-batch gradients"
    hparams = (HParam("beta", 0.9, "MimeLite momentum beta: local steps along (1 - beta) g + beta m "
                      "(unverified: no published default found)", flag="mime-beta", check="prob"),
               SERVER_LR,
               HParam("delta_clip", 0.0, "clip each client's model delta to this norm before averaging; 0 = off "
                      "(unverified)", flag="mime-clip", check="nonnegative"))

    def init_state(self) -> None:
        self.server["momentum"] = self.zeros()

    def full_gradient_sum(self, cctx) -> torch.Tensor:
        """sum over client i's samples of grad CE at theta^t, flat (a trainable copy of the model the server sent)."""
        model = cctx.round.trainable_global_model  # theta^t, in training mode
        params = [p for p in model.parameters() if p.requires_grad]
        batch = int(getattr(self.config, "batch_size", 0) or cctx.num_samples)
        total = torch.zeros(self.dim, device=cctx.x.device)
        for s in range(0, cctx.num_samples, batch):
            loss = F.cross_entropy(model(cctx.x[s:s + batch]), cctx.y[s:s + batch], reduction="sum")
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            total += torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                for g, p in zip(grads, params)])
        return total

    def client_start(self, cctx):
        cctx.extras["mime_grad_sum"] = self.full_gradient_sum(cctx)
        return super().client_start(cctx)

    def correct_gradient(self, step) -> None:
        layout = step.cohort.layout
        torch._foreach_mul_(layout.grads(), 1.0 - self.beta)
        layout.add_to_grads(self.server["momentum"], self.beta)

    def client_end(self, cctx, params, loss):
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss,
                            extras={"grad_sum": cctx.extras["mime_grad_sum"]})

    def aggregate(self, rctx, results):
        theta = rctx.global_params
        deltas = [theta - r.params for r in results]
        if self.delta_clip > 0:
            deltas = [d * min(1.0, self.delta_clip / (float(d.norm()) + 1e-12)) for d in deltas]
        sizes = [r.num_samples for r in results]
        full_grad = torch.stack([r.extras["grad_sum"] for r in results]).sum(0) / sum(sizes)
        self.server["momentum"] = (1.0 - self.beta) * full_grad + self.beta * self.server["momentum"]
        return theta - self.server_lr * weighted_mean(deltas, sizes)
