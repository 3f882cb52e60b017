"""FedScar ("FedScar: Correcting Geometric Bias for Flatness-Consistent Federated Learning", an ICML 2026
submission), as the authors' code runs it (``Ultraman6/FedScar``: ``system/flcore/clients/clientscar.py``,
``system/flcore/servers/serverscar.py``, ``system/utils/optim_utils.py``; docs/update-rules.md §31).

Each client carries a geometric bias: a decaying sum of unit steps from its last local model towards the server
model, which shifts where it starts; local SAM steps are corrected towards the clients' mean bias, and a FedDyn-like
dual (split between the bias and the client's accumulated updates) pulls the server model.

* **Client state:** the dual d_i (the sum of the client's updates), the bias b_i, the client's last local model
  l_i and whether it has trained before; all 0 / never at first.
* **Round t**, theta^t the server model, for every client j and then every participant i that trained before::

      b_j  = gamma b_j
      b_i += alpha v / ||v||,     v = theta^t - l_i        (the code's ``send_models``; nothing when v = 0)
      b~   = mean_{all j} b_j                              (after every participant's injection)
      w~_i = theta^t + b_i                                 (what participant i starts from)

* **One local step** (the SAM step at radius rho; l_i is w~_i on a first participation)::

      dir = g~ + (beta / 2) (w - l_i) / ||w - l_i|| + beta (d_i + b_i) + (b~ - b_i) + wd w

  the gradient of (beta / 2) ||w - l_i|| (a norm, not its square, as the code's loss; 0 where w = l_i) plus the
  code's linear terms, at w, before clipping; then the SGD step.
* **After training:** d_i += theta_i - w~_i; l_i = theta_i.
* **Server**, over the participants P_t (sample-weighted, as the code's ``aggregate_parameters``), N clients::

      theta^{t+1} = sum_{P_t} n_i theta_i / sum_{P_t} n_i + beta mean_{all j} (d_j - b_j)

Pieces that read the round's server model (ASD's teacher, MOON's global model) see theta^t, not w~_i. The local
optimizer is :class:`flatfl.train.optimizers.SAM` (the code's ``ESAM``; ``--rho 0`` gives its ``ERM`` numbers);
``--local-opt asam`` is refused.

Defaults (the README's FedScar configuration, ``{'alpha': 0.1, 'gama': 0.9, 'beta': 0.06, 'rho': [0.1]}``):
alpha = 0.1, gamma = 0.9, beta = 0.06, rho = 0.1.
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, register


@register
class FedScar(Algorithm):
    name, display_name = "fedscar", "FedScar"
    summary = ("FedScar: local SAM from theta + b_i, b_i a decaying sum of unit steps from the client's last model "
               "to the server's; the mean bias corrects the steps; a dual split between bias and updates")
    local_opt = "sam"
    hparams = (HParam("rho", 0.1, "SAM radius for FedScar (FedScar README configuration 'rho': [0.1]; 0 gives "
                      "the code's ERM steps)", check="nonnegative"),
               HParam("alpha", 0.1, "FedScar's bias injection: a returning client's bias gains alpha times the unit "
                      "step from its last model to the server's (FedScar README 'alpha': 0.1)", flag="scar-alpha",
                      check="nonnegative"),
               HParam("gamma", 0.9, "FedScar's bias decay: every client's bias is multiplied by gamma each round "
                      "(FedScar README 'gama': 0.9)", flag="scar-gamma", check="prob"),
               HParam("beta", 0.06, "FedScar's penalty beta of the local norm and linear terms and the server's "
                      "dual step (FedScar README 'beta': 0.06)", flag="scar-beta", check="nonnegative"))

    def init_state(self) -> None:
        self.clients["dual"] = self.zeros(self.num_clients)
        self.clients["bias"] = self.zeros(self.num_clients)
        self.clients["last"] = self.zeros(self.num_clients)
        self.clients["trained"] = torch.zeros(self.num_clients, device=self.device)  # 1 once a client has trained

    def round_start(self, rctx) -> None:
        bias = self.clients["bias"]
        bias.mul_(self.gamma)
        for i in rctx.participants:
            if self.clients["trained"][i] > 0:
                v = rctx.global_params - self.clients["last"][i]
                size = torch.linalg.vector_norm(v)
                if size > 0:  # the code divides by 0 here (NaN); a client back at the server model gains nothing
                    bias[i] += v * (self.alpha / size)
        self._bias_mean = bias.mean(0)

    def client_start(self, cctx):
        i = cctx.client_id
        bias = self.clients["bias"][i]
        start = cctx.global_params + bias
        cctx.extras["scar_start"] = start
        cctx.extras["scar_last"] = self.clients["last"][i].clone() if self.clients["trained"][i] > 0 else start
        cctx.extras["scar_linear"] = self.beta * (self.clients["dual"][i] + bias) + (self._bias_mean - bias)
        return start.clone()

    def correct_gradient(self, step) -> None:
        cohort = step.cohort
        away = cohort.layout.get() - cohort.stack("scar_last")
        size = torch.linalg.vector_norm(away, dim=1, keepdim=True)
        scale = torch.where(size > 0, (self.beta / 2) / size, torch.zeros_like(size))  # the norm's gradient: 0 at 0
        cohort.layout.add_to_grads(away * scale + cohort.stack("scar_linear"))

    def client_end(self, cctx, params, loss):
        i = cctx.client_id
        self.clients["dual"][i] += params - cctx.extras["scar_start"]
        self.clients["last"][i] = params
        self.clients["trained"][i] = 1.0
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss)

    def aggregate(self, rctx, results):
        theta = super().aggregate(rctx, results)
        return theta + self.beta * (self.clients["dual"] - self.clients["bias"]).mean(0)
