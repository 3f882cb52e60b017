"""SCAFFOLD (Karimireddy et al. ICML 2020), option-II control variates as in the FedDyn code (docs/update-rules.md section 4).

State: a server control variate c and one per client, c_i; all start at 0.

Local objective of client i (w_i = n_i / mean(n)): CE + <theta, c / w_i - c_i>, so every local step follows
``g + c / w_i - c_i`` (g + c - c_i on balanced data). The linear term is part of the clipped gradient.

After K local steps at rate eta (K = E * ceil(n_i / B); see ``--steps-rule``)::

    c_i+ = c_i - c + (theta^t - theta_i) / (K * eta)

Server::

    theta^{t+1} = mean_{i in P_t} theta_i               (plain mean, global rate 1)
    c          += (1/N) sum_{i in P_t} w_i (c_i+ - c_i)

The c_i+ rule uses c (not c / w_i) as the DYN code does. The "all clients" model is the plain mean (section 0).

``--cv-lr`` picks eta in the control-variate update. SCAFFOLD's option II divides the model change by the rate the
K steps were taken with: the round's rate eta_t = eta0 * decay^t (``current``, the default; also what the FedSpeed
authors' simulator does). The FedDyn/fedMAN code divides by the undecayed eta0 (``initial``): after t rounds its
c_i are too small by the factor decay^t (0.37 at round 500 with decay 0.998). Use ``initial`` to reproduce numbers
published with that code.

``--steps-rule`` picks K. ``own`` (the default): every client takes K_i = E * ceil(n_i / B) steps, its own E epochs,
and divides by K_i, as docs/update-rules.md section 4 and the SCAFFOLD paper mean it (K is the number of steps the
client actually took). ``mean``: the official FedDyn/fedMAN scripts compute one ``n_minibatch = E * ceil(mean(n) /
B)`` from the *mean* client size and every client takes exactly that many steps (freshly shuffled epochs, the last
one cut short) and divides by it. With equal client sizes (the FedDyn/MAN Dirichlet split) the two are the same;
with unequal ones (``fedml-dirichlet``) ``mean`` reproduces the official code's numbers.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..components import HParam
from ..context import ClientContext
from .algorithm import Algorithm, ClientResult, plain_mean, register

CV_LR = HParam("cv_lr", "current", "learning rate in the control-variate update: 'current' = the round's decayed "
               "rate (the paper's intent), 'initial' = the undecayed --lr (FedDyn/FedDC/fedMAN code)",
               flag="cv-lr", choices=("current", "initial"))


STEPS_RULE = HParam("steps_rule", "own", "local steps K: 'own' = E * ceil(n_i / B) for client i (docs/update-rules.md §4, "
                    "the default); 'mean' = E * ceil(mean(n) / B) for every client, as the official FedDyn/FedDC/"
                    "fedMAN scripts (SCAFFOLD takes that many steps; FedDC trains E epochs and divides by it)",
                    flag="steps-rule", choices=("own", "mean"))


def mean_size_steps(client_sizes, batch_size: int, epochs: int) -> int:
    """The official scripts' ``n_minibatch = E * ceil(mean(n) / B)``, one count for every client."""
    return int(epochs * math.ceil(float(np.mean(client_sizes)) / batch_size))


def control_variate_lr(choice: str, cctx: ClientContext, config) -> float:
    """eta in (theta^t - theta_i) / (K eta): the round's rate, or the run's initial rate for ``initial``."""
    return cctx.lr if choice == "current" else float(config.lr)


@register
class Scaffold(Algorithm):
    name, display_name = "scaffold", "SCAFFOLD"
    summary = "SCAFFOLD: local steps corrected by c/w_i - c_i, option-II control variates"
    all_model_weighting = "uniform"
    hparams = (CV_LR, STEPS_RULE)

    def local_step_counts(self, num_samples, batch_size, epochs):
        if self.steps_rule == "mean":
            k = mean_size_steps(self.client_sizes, batch_size, epochs)
            return k, k
        return super().local_step_counts(num_samples, batch_size, epochs)

    def init_state(self) -> None:
        self.server["c"] = self.zeros()
        self.clients["c"] = self.zeros(self.num_clients)

    def client_start(self, cctx):
        c, c_i = self.server["c"], self.clients["c"][cctx.client_id]
        cctx.extras["scaffold_correction"] = c / cctx.weight - c_i
        return super().client_start(cctx)

    def correct_gradient(self, step) -> None:
        step.cohort.layout.add_to_grads(step.cohort.stack("scaffold_correction"))

    def client_end(self, cctx, params, loss):
        i = cctx.client_id
        eta = control_variate_lr(self.cv_lr, cctx, self.config)
        c_i = self.clients["c"][i]
        new_c_i = c_i - self.server["c"] + (cctx.global_params - params) / (cctx.steps * eta)
        result = ClientResult(i, cctx.num_samples, params, loss,
                              extras={"weighted_dc": cctx.weight * (new_c_i - c_i)})
        self.clients["c"][i] = new_c_i
        return result

    def aggregate(self, rctx, results):
        self.server["c"] += torch.stack([r.extras["weighted_dc"] for r in results]).sum(0) / self.num_clients
        return plain_mean(results)
