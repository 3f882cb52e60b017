"""FedGMT (Li et al. ICML 2025, "One Arrow, Two Hawks: Sharpness-aware Minimization for Federated Learning via Global
Model Trajectory"), as the authors' code runs it (``harrylee999/FL-SAM``: ``system/flcore/clients/clientgmt.py``,
``system/flcore/servers/servergmt.py``; docs/update-rules.md §30).

The global model's sharpness is measured along its trajectory instead of by a SAM ascent: the server keeps an
exponential moving average e of its models, and each client's loss pulls its predictions towards e's, with one
backward pass a step; an ADMM dual keeps the clients' updates aligned with the global objective.

* **Server state:** the trajectory e (the initial model at first). **Client state:** the dual h_i, the sum of the
  client's past updates (0 at first).
* **Local objective** of client i, theta^t the server model, q^tau = softmax(z / tau)::

      CE(w) + gamma tau^2 mean_b KL( q^tau(f(e; x_b)) || q^tau(f(w; x_b)) ) + (1 / beta) <w, h_i>

  The KL is a loss term (inside the closure: SAM-type optimizers see it in both passes); the dual's gradient
  h_i / beta is a gradient term at w (before clipping).
* **After training:** h_i += theta_i - theta^t.
* **Server**, over the participants P_t (sample-weighted, as the code's ``aggregate_parameters``), N clients in all::

      theta^{t+1} = sum_{P_t} n_i theta_i / sum_{P_t} n_i + (1/N) sum_{all i} h_i
      e          = alpha e + (1 - alpha) theta^{t+1}

e is evaluated as a frozen network holding the trajectory's parameters and the round's server buffers, in eval mode
(ASD's and FedNTD's teachers are the same kind of network). Any local optimizer works.

Defaults (the code's ``main.py`` and README command): gamma = 1 (``--gama``), alpha = 0.95, tau = 3, beta = 10.
"""
from __future__ import annotations

import copy

import torch

from ..components import HParam
from ..regularizers.asd import kl_global_local
from .algorithm import Algorithm, register


def trajectory_network(global_model: torch.nn.Module, names: list[str], views: list[torch.Tensor]) -> torch.nn.Module:
    """A frozen copy of the round's server network (``global_model``: eval mode, no gradients, the server's buffers)
    holding the parameters ``views`` under their ``names`` instead."""
    network = copy.deepcopy(global_model)
    with torch.no_grad():
        for name, value in zip(names, views):
            network.get_parameter(name).copy_(value)
    return network


def trajectory_distillation(teacher: torch.Tensor, local: torch.Tensor, tau: float) -> torch.Tensor:
    """tau^2 mean_b KL( softmax(teacher / tau) || softmax(local / tau) ) of each client: logits (M, B, K) -> (M,)
    (the code's ``tau^2 * KLDivLoss(reduction="batchmean")``)."""
    return tau ** 2 * kl_global_local(teacher, local, tau).mean(-1)


@register
class FedGMT(Algorithm):
    name, display_name = "fedgmt", "FedGMT"
    summary = ("FedGMT: CE + gamma tau^2 KL(trajectory || local), the trajectory an EMA of the global models; ADMM "
               "dual h_i / beta")
    hparams = (HParam("gamma", 1.0, "FedGMT's sharpness strength gamma, the weight of the trajectory's KL "
                      "(FL-SAM main.py --gama 1.0)", flag="gmt-gamma", check="nonnegative"),
               HParam("alpha", 0.95, "FedGMT's EMA coefficient alpha: e = alpha e + (1 - alpha) theta^{t+1} "
                      "(FL-SAM main.py --alpha 0.95)", flag="gmt-alpha", check="prob"),
               HParam("tau", 3.0, "FedGMT's temperature tau of the trajectory's KL, weighted by tau^2 (FL-SAM "
                      "main.py --tau 3)", flag="gmt-tau", check="positive"),
               HParam("beta", 10.0, "FedGMT's ADMM penalty beta: the dual's gradient is h_i / beta (FL-SAM main.py "
                      "--beta 10)", flag="gmt-beta", check="positive"))

    def init_state(self) -> None:
        self.server["trajectory"] = self.layout.get().to(self.device)  # e: the initial model
        self.clients["dual"] = self.zeros(self.num_clients)

    def round_start(self, rctx) -> None:
        self._teacher = None
        self._round = rctx

    def teacher(self) -> torch.nn.Module:
        """The round's trajectory network, built on first use."""
        if self._teacher is None:
            self._teacher = trajectory_network(self._round.global_model, self.layout.names,
                                               self.layout.views(self.server["trajectory"]))
        return self._teacher

    def client_start(self, cctx):
        cctx.extras["gmt_dual"] = self.clients["dual"][cctx.client_id]
        return super().client_start(cctx)

    def loss_terms(self, step):
        if not self.gamma:
            return None
        local = step.logits if step.logits is not None else step.model(step.x)
        cached = step.scratch.get("gmt_teacher")
        if cached is None or cached[0] is not step.x:
            m, b = step.y.shape
            with torch.no_grad():
                teacher = self.teacher()(step.x.reshape(m * b, *step.x.shape[2:])).view(m, b, -1)
            cached = step.scratch["gmt_teacher"] = (step.x, teacher)
        return self.gamma * trajectory_distillation(cached[1], local, self.tau)

    def correct_gradient(self, step) -> None:
        step.cohort.layout.add_to_grads(step.cohort.stack("gmt_dual"), 1.0 / self.beta)

    def client_end(self, cctx, params, loss):
        self.clients["dual"][cctx.client_id] += params - cctx.global_params
        return super().client_end(cctx, params, loss)

    def aggregate(self, rctx, results):
        theta = super().aggregate(rctx, results) + self.clients["dual"].mean(0)
        self.server["trajectory"] = self.alpha * self.server["trajectory"] + (1 - self.alpha) * theta
        self._teacher = None
        return theta
