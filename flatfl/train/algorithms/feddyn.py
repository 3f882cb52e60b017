"""FedDyn (Acar et al. ICLR 2021), as in the FedDyn/fedMAN code (docs/update-rules.md section 5).

Client state: h_i, the accumulated drift (h_i = -grad L_i(theta_i) / alpha at a stationary point), starts at 0.

Local objective of client i, alpha_i = alpha / w_i (w_i = n_i / mean(n))::

    CE(theta) + alpha_i <theta, h_i - theta^t> + (alpha_i / 2) ||theta||^2 + (wd / 2) ||theta||^2

which is the paper's L_i(theta) - <grad L_i(theta_i^{t-1}), theta> + (alpha/2) ||theta - theta^t||^2 up to a
constant. The linear term's gradient alpha_i (h_i - theta^t) joins the clipped gradient; the quadratic term is
weight decay, so the SGD step's decay is wd + alpha_i, applied after clipping, as in the code. Gradient::

    grad CE + alpha_i (theta - theta^t + h_i) + wd theta

After training: h_i += theta_i - theta^t. Server::

    theta^{t+1} = mean_{i in P_t} theta_i + (1/N) sum_{all i} h_i

(the paper's theta = mean(theta_i) - h/alpha with h updated by the factor alpha/m, m = N). Clients start from
theta^{t+1}, the "cld" model. The "all clients" model is the plain mean (section 0).

Default alpha = 0.01 (DYN example script; fedMAN's ``--alpha_coef`` default). Any local optimizer works: with
``--local-opt sam`` the CE gradient is SAM's, the drift terms are taken at the unperturbed theta.
"""
from __future__ import annotations

from ..components import HParam
from .algorithm import Algorithm, plain_mean, register


#: FedDyn's alpha (client i uses alpha / w_i)
ALPHA = HParam("alpha", 0.01, "FedDyn alpha; client i uses alpha / w_i (DYN example, fedMAN --alpha_coef)",
               flag="feddyn-alpha", check="nonnegative")


@register
class FedDyn(Algorithm):
    name, display_name = "feddyn", "FedDyn"
    summary = "FedDyn: dynamic regularization alpha_i<theta, h_i - theta^t> + alpha_i/2 ||theta||^2"
    all_model_weighting = "uniform"
    hparams = (ALPHA,)

    def init_state(self) -> None:
        self.clients["h"] = self.zeros(self.num_clients)

    def client_alpha(self, cctx) -> float:
        """alpha_i = alpha / w_i."""
        return self.alpha / cctx.weight

    def client_start(self, cctx):
        h_i = self.clients["h"][cctx.client_id]
        cctx.extras["dyn_linear"] = self.client_alpha(cctx) * (h_i - cctx.global_params)
        return super().client_start(cctx)

    def correct_gradient(self, step) -> None:
        step.cohort.layout.add_to_grads(step.cohort.stack("dyn_linear"))

    def extra_weight_decay(self, cctx) -> float:
        return self.client_alpha(cctx)

    def client_end(self, cctx, params, loss):
        self.clients["h"][cctx.client_id] += params - cctx.global_params
        return super().client_end(cctx, params, loss)

    def aggregate(self, rctx, results):
        return plain_mean(results) + self.clients["h"].mean(0)
