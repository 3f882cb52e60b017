"""FedDC (Gao et al. CVPR 2022), as in the FedDC/fedMAN code (docs/update-rules.md section 6).

State: per client the parameter drift h_i and the local gradient-correction state g_i; on the server the global
correction G. All start at 0.

Local objective of client i, alpha_i = alpha / w_i::

    CE + (alpha_i / 2) ||theta - (theta^t - h_i)||^2 + <theta, G / w_i - g_i>

All three terms are part of the loss, so their gradient ``alpha_i (theta - theta^t + h_i) + G / w_i - g_i`` is
clipped with the CE gradient; the SGD step adds the weight decay wd.

After K local steps at rate eta (K = E * ceil(n_i / B); see ``--steps-rule``), with Delta_i = theta_i - theta^t::

    h_i  += Delta_i
    g_i+  = g_i - G / w_i - Delta_i / (K * eta)
    G    += (1/N) sum_{i in P_t} w_i (g_i+ - g_i)

Server (the drift term averages over *all* clients)::

    theta^{t+1} = mean_{i in P_t} theta_i + (1/N) sum_{all i} h_i

Clients start from theta^{t+1}. The "all clients" model is the plain mean (section 0).

``--cv-lr`` as for SCAFFOLD: ``current`` (default) divides by the rate the K steps used; the FedDC and fedMAN code
divide by the undecayed eta0 (``initial``), which published FedDC numbers were produced with.
Default alpha = 0.01 (hard-coded in fedMAN; FedDC's scripts).

``--steps-rule``: every client trains its own E epochs either way. ``own`` (the default) divides its drift by the
steps it took, K_i = E * ceil(n_i / B) (the paper's intent; docs/update-rules.md section 6). ``mean`` divides by the
official FedDC/fedMAN scripts' ``n_minibatch = E * ceil(mean(n) / B)``, computed from the mean client size, as those
scripts do. Equal client sizes (the FedDyn/MAN Dirichlet split): the same; unequal ones: ``mean`` reproduces the
official code (from round 2 on, when the changed g_i first steers training).
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, plain_mean, register
from .scaffold import CV_LR, STEPS_RULE, control_variate_lr, mean_size_steps


@register
class FedDC(Algorithm):
    name, display_name = "feddc", "FedDC"
    summary = "FedDC: FedDyn-style drift h_i with SCAFFOLD-style gradient correction G/w_i - g_i"
    all_model_weighting = "uniform"
    hparams = (HParam("alpha", 0.01, "FedDC penalty alpha; client i uses alpha / w_i (fedMAN, FedDC scripts)",
                      flag="feddc-alpha", check="nonnegative"),
               CV_LR, STEPS_RULE)

    def local_step_counts(self, num_samples, batch_size, epochs):
        taken, k = super().local_step_counts(num_samples, batch_size, epochs)
        if self.steps_rule == "mean":
            k = mean_size_steps(self.client_sizes, batch_size, epochs)
        return taken, k

    def init_state(self) -> None:
        self.clients["h"] = self.zeros(self.num_clients)
        self.clients["g"] = self.zeros(self.num_clients)
        self.server["G"] = self.zeros()

    def client_start(self, cctx):
        i, w = cctx.client_id, cctx.weight
        alpha_i = self.alpha / w
        cctx.extras["dc_alpha"] = alpha_i
        # gradient of the penalty and correction terms, less the alpha_i * theta part added at each step
        cctx.extras["dc_linear"] = (alpha_i * (self.clients["h"][i] - cctx.global_params)
                                    + self.server["G"] / w - self.clients["g"][i])
        return super().client_start(cctx)

    def correct_gradient(self, step) -> None:
        layout = step.cohort.layout
        layout.add_params_to_grads(step.cohort.stack("dc_alpha"))
        layout.add_to_grads(step.cohort.stack("dc_linear"))

    def client_end(self, cctx, params, loss):
        i, w = cctx.client_id, cctx.weight
        drift = params - cctx.global_params
        self.clients["h"][i] += drift
        eta = control_variate_lr(self.cv_lr, cctx, self.config)
        g_i = self.clients["g"][i]
        new_g_i = g_i - self.server["G"] / w - drift / (cctx.steps * eta)
        result = ClientResult(i, cctx.num_samples, params, loss, extras={"weighted_dg": w * (new_g_i - g_i)})
        self.clients["g"][i] = new_g_i
        return result

    def aggregate(self, rctx, results):
        self.server["G"] += torch.stack([r.extras["weighted_dg"] for r in results]).sum(0) / self.num_clients
        return plain_mean(results) + self.clients["h"].mean(0)
