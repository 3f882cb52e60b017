"""FedCM: client-level momentum (Xu et al. 2021), as in the FedSpeed authors' simulator (docs/update-rules.md section 9).

Server state: Delta^t, the previous round's average update turned into a gradient estimate; 0 in round 1::

    Delta^{t+1} = mean_{i in P_t} (theta^t - theta_i) / (K_i * eta_t)

Local steps of client i follow a momentum mix of the local gradient g and the server's estimate::

    v = alpha g + (1 - alpha) Delta^t        (the loss alpha CE + (1 - alpha) <theta, Delta^t>)

then clipping and the SGD step (weight decay included). Server::

    theta^{t+1} = theta^t + eta_g mean_{i in P_t} (theta_i - theta^t)

The simulator divides the mean update by one K, computed from client 0's size; each client's own K_i is used here,
which is the same when the clients' sizes are equal. ``mean`` is the plain mean over participants, as in the code.

Defaults: alpha = 0.1 (simulator README), eta_g = 1. With ``--local-opt sam`` the g above is the SAM gradient: that
is MoFedSAM (:mod:`.mofedsam`).
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, plain_mean, register

FEDCM_ALPHA_HELP = "weight alpha of the local gradient in alpha g + (1 - alpha) Delta (FedSpeed simulator README: 0.1)"
SERVER_LR = HParam("server_lr", 1.0, "server learning rate eta_g: theta += eta_g * mean update (FedCM, MoFedSAM: 1 "
                   "in the FedSpeed simulator; MimeLite: unverified)", flag="server-lr", check="positive")


@register
class FedCM(Algorithm):
    name, display_name = "fedcm", "FedCM"
    summary = "FedCM: local steps along alpha g + (1 - alpha) Delta, Delta the last round's mean update per step"
    hparams = (HParam("alpha", 0.1, FEDCM_ALPHA_HELP, flag="fedcm-alpha", check="unit"), SERVER_LR)

    def init_state(self) -> None:
        self.server["delta"] = self.zeros()

    def correct_gradient(self, step) -> None:
        layout = step.cohort.layout
        torch._foreach_mul_(layout.grads(), self.alpha)
        layout.add_to_grads(self.server["delta"], 1.0 - self.alpha)

    def client_end(self, cctx, params, loss):
        estimate = (cctx.global_params - params) / (cctx.steps * cctx.lr)
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss, extras={"gradient_estimate": estimate})

    def aggregate(self, rctx, results):
        self.server["delta"] = torch.stack([r.extras["gradient_estimate"] for r in results]).mean(0)
        update = plain_mean(results) - rctx.global_params
        return rctx.global_params + self.server_lr * update
