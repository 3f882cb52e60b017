"""FedNSAM (Liu et al. 2026, "FedNSAM: Consistency of Local and Global Flatness for Federated Learning",
arXiv:2602.23827), as the authors' code runs it (``junkangLiu0/FedNSAM``, ``main_FedNSAM.py``: ``update_NSAM``
and the ``apply_weights_avgACG`` its round loop calls; docs/update-rules.md §28).

Local SAM started from the Nesterov look-ahead of the global model along the server's momentum, so that the clients'
flat regions are searched where the global model is heading.

* **Server state:** the global momentum m (0 at first).
* **Round t**, theta^t the server model::

      w~ = theta^t + gamma m          (what every participant starts from)

* **One local step:** flatfl's SAM step at radius rho (clipped, then the SGD step with weight decay).
* **After training:** Delta_i = theta_i - w~, and D = mean_{P_t} Delta_i (plain mean, as the code's).
* **Server**, ``--nsam-momentum``::

      released (default):  m = D in the first round, then m = gamma D + D      (apply_weights_avgACG, which the
                           code's round loop calls: its loop reads the round's mean where the momentum was meant)
      accumulated:         m = gamma m + D                                      (apply_weights_avgACG2, which the
                           loop never calls)
      theta^{t+1} = theta^t + m

Both agree in the first round. Pieces that read the round's server model (ASD's teacher, MOON's global model) see
theta^t, not w~. The SAM step is :class:`flatfl.train.optimizers.SAM`: ``--local-opt asam`` is refused.

Defaults (the authors' code): gamma = 0.85 and rho = 0.05, the values ``update_NSAM`` sets for the clients whatever
the command line says; the server's gamma is the command line's ``--gamma``, whose default is 0.85.
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, register

#: the server momentum rules of ``--nsam-momentum``: the one the authors' loop runs, and the one it never calls
MOMENTUM_RULES = ("released", "accumulated")


@register
class FedNSAM(Algorithm):
    name, display_name = "fednsam", "FedNSAM"
    summary = ("FedNSAM: local SAM from the Nesterov point theta + gamma m; server momentum m = gamma D + D (as "
               "released) or gamma m + D, D the mean update")
    all_model_weighting = "uniform"
    local_opt = "sam"
    hparams = (HParam("rho", 0.05, "SAM radius for FedNSAM (FedNSAM code: update_NSAM sets rho = 0.05)",
                      check="nonnegative"),
               HParam("gamma", 0.85, "FedNSAM's momentum gamma: clients start from theta + gamma m, and the server "
                      "momentum is built with it (FedNSAM code: gamma = 0.85)", flag="nsam-gamma", check="prob"),
               HParam("momentum_rule", "released", "FedNSAM's server momentum, D the round's mean update: "
                      "'released' = D in the first round, then gamma D + D, as the authors' loop runs it "
                      "(apply_weights_avgACG, the default); 'accumulated' = gamma m + D (apply_weights_avgACG2, "
                      "which the loop never calls)", flag="nsam-momentum", choices=MOMENTUM_RULES))

    def init_state(self) -> None:
        self.server["momentum"] = self.zeros()

    def round_start(self, rctx) -> None:
        self._start = rctx.global_params + self.gamma * self.server["momentum"]  # the Nesterov point w~

    def client_start(self, cctx):
        cctx.extras["nsam_start"] = self._start
        return self._start.clone()

    def client_end(self, cctx, params, loss):
        delta = params - cctx.extras["nsam_start"]
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss, extras={"delta": delta})

    def aggregate(self, rctx, results):
        mean = torch.stack([r.extras["delta"] for r in results]).mean(0)
        if self.momentum_rule == "accumulated":
            self.server["momentum"] = self.gamma * self.server["momentum"] + mean
        elif rctx.index == 0:  # the code's momentum is still empty: it takes the mean
            self.server["momentum"] = mean
        else:
            self.server["momentum"] = self.gamma * mean + mean
        return rctx.global_params + self.server["momentum"]
