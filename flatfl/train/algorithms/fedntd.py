"""FedNTD: federated not-true distillation (Lee et al. NeurIPS 2022), as in the official criterion
(``algorithms/fedntd/criterion.py``; docs/update-rules.md section 14).

Both the local logits l and the logits g of the frozen model the server sent drop the ground-truth class; the
local model is distilled towards the global model's distribution over the remaining C - 1 classes::

    CE(l, y) + beta * tau^2 * KL( softmax(g_nt / tau) || softmax(l_nt / tau) )      (KL averaged over the batch)

The local logits are those of the closure's own forward pass (``step.logits``); the global logits are computed
once per batch (SAM's second pass reuses them). Server: FedAvg.

Defaults: tau = 1, beta = 1 (``config/fedntd.json``). ASD's port has no tau^2 factor and a different temperature;
not reproduced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..components import HParam
from ..regularizers.regularizer import kl_divergence
from .algorithm import Algorithm, register


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B, C - 1): each row without its ground-truth entry, the other classes in order (one gather: class
    j of the C - 1 others is j, or j + 1 from the true class on)."""
    others = torch.arange(logits.shape[1] - 1, device=y.device).expand(len(y), -1)
    return logits.gather(1, others + (others >= y.unsqueeze(1)))


def clients_not_true_distillation(local: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor,
                                  tau: float) -> torch.Tensor:
    """tau^2 * mean_b KL( softmax(teacher_nt / tau) || softmax(local_nt / tau) ) of each client: logits (M, B, K),
    labels (M, B) -> (M,)."""
    m, b, k = local.shape
    log_t = F.log_softmax(not_true_logits(teacher.reshape(m * b, k), y.reshape(-1)) / tau, dim=1)
    log_s = F.log_softmax(not_true_logits(local.reshape(m * b, k), y.reshape(-1)) / tau, dim=1)
    return tau ** 2 * kl_divergence(log_t, log_s).view(m, b).mean(1)


@register
class FedNTD(Algorithm):
    name, display_name = "fedntd", "FedNTD"
    summary = "FedNTD: CE + beta * tau^2 * KL of the not-true-class distributions (global -> local)"
    hparams = (HParam("tau", 1.0, "FedNTD temperature tau (config/fedntd.json)", flag="ntd-tau", check="positive"),
               HParam("beta", 1.0, "FedNTD distillation weight beta (config/fedntd.json)", flag="ntd-beta",
                      check="nonnegative"))

    def loss_terms(self, step):
        local = step.logits if step.logits is not None else step.model(step.x)
        cached = step.scratch.get("ntd_teacher")
        if cached is None or cached[0] is not step.x:
            m, b = step.y.shape
            with torch.no_grad():
                teacher = step.cohort.round.global_model(step.x.reshape(m * b, *step.x.shape[2:])).view(m, b, -1)
            cached = step.scratch["ntd_teacher"] = (step.x, teacher)
        return self.beta * clients_not_true_distillation(local, cached[1], step.y, self.tau)
