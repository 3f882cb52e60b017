"""FedLESAM (Fan et al. ICML 2024, "Locally Estimated Global Perturbations are Better than Local Perturbations for
Federated Sharpness-aware Minimization") and its variants FedLESAM-S and FedLESAM-D, as the authors' code runs them
(docs/update-rules.md §25).

SAM's perturbation is not computed from a second local gradient but estimated from the global model's change, so a
local step takes one gradient, at the perturbed point::

    d_i  = theta^{t-1} - theta^t        ('round', the code: the last round's global change, the same for every client)
         = theta_i^old - theta^t        ('client', the paper: theta_i^old the global model client i received in the
                                         round it last took part; 0 on its first participation)
    eps  = rho d_i / ||d_i||            (||.||: 'tensors', the sum of the parameter tensors' 2-norms, the code;
                                         'global', the 2-norm of the whole vector)
    g~   = grad f(theta + eps), then theta restored exactly
    dir  = g~ + correction + wd theta   (clipped, then the SGD step)

``--lesam-variant``:

* ``fedlesam``: no correction; server ``theta^{t+1} = theta^t + eta_g mean_{P_t}(theta_i - theta^t)``.
* ``s`` (FedLESAM-S, SCAFFOLD's control variates): correction ``lambda (c / w_i - c_i)``; after training
  ``c_i+ = c_i - c + (theta^t - theta_i) / (K eta)``; server ``c += (1/N) sum_{P_t} w_i (c_i+ - c_i)`` and theta as
  ``fedlesam``.
* ``d`` (FedLESAM-D, FedDyn's dynamic regularizer): correction ``lambda_i (theta - theta^t + h_i)``, lambda_i =
  lambda / w_i (lambda_i theta as SGD decay, after clipping); after training ``h_i += theta_i - theta^t``; server
  ``theta^{t+1} = mean_{P_t} theta_i + mean_{all} h_i``.

In every variant the server keeps theta^{t+1} - theta^t for the next round's 'round' estimate. The perturbation is
set in ``prepare_batch`` and theta restored in ``correct_gradient`` (:class:`flatfl.train.sam_terms.Perturbed`),
around the closure of plain SGD: FedLESAM is its own SAM-type step, so ``--local-opt sam`` / ``asam`` are refused;
momentum (``--momentum``) applies as usual.

Defaults (the FedLESAM code's): rho = 0.1, lambda = 0.1, eta_g = 1, estimate 'round', norm 'tensors'; the docs
section lists where code and paper differ and the code's indexing quirk that is not copied.
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, plain_mean, register
from .fedcm import SERVER_LR
from ..sam_terms import Perturbed, scaled_direction


@register
class FedLESAM(Algorithm):
    name, display_name = "fedlesam", "FedLESAM"
    summary = "FedLESAM: one gradient a step, at theta + rho d/||d||, d the global model's change (-S, -D variants)"
    all_model_weighting = "uniform"
    local_opt = "sgd"
    hparams = (HParam("rho", 0.1, "perturbation radius for FedLESAM (FedLESAM code --rho 0.1)",
                      check="nonnegative"),
               HParam("variant", "fedlesam", "FedLESAM variant: 'fedlesam' (FedAvg server), 's' (FedLESAM-S: SCAFFOLD "
                      "control variates), 'd' (FedLESAM-D: FedDyn dynamic regularizer)", flag="lesam-variant",
                      choices=("fedlesam", "s", "d")),
               HParam("lam", 0.1, "FedLESAM-S weight of the correction c/w_i - c_i; FedLESAM-D's lambda, client i "
                      "uses lambda / w_i (FedLESAM code --lamb 0.1)", flag="fedlesam-lambda", check="nonnegative"),
               HParam("estimate", "round", "FedLESAM's perturbation direction: 'round' = theta^{t-1} - theta^t, the "
                      "last round's global change (the code, the default); 'client' = the global model the client "
                      "received when it last took part minus theta^t (the paper)", flag="lesam-estimate",
                      choices=("round", "client")),
               HParam("norm", "tensors", "norm of FedLESAM's direction: 'tensors' = sum of the parameter tensors' "
                      "2-norms (the code, the default); 'global' = the 2-norm of the whole vector",
                      flag="lesam-norm", choices=("tensors", "global")),
               SERVER_LR)

    def init_state(self) -> None:
        self.server["update"] = self.zeros()  # theta^t - theta^{t-1}
        if self.estimate == "client":
            self.clients["old"] = self.zeros(self.num_clients)  # the global model client i last received
            self.clients["seen"] = torch.zeros(self.num_clients, device=self.device)
        if self.variant == "s":
            self.server["c"] = self.zeros()
            self.clients["c"] = self.zeros(self.num_clients)
        elif self.variant == "d":
            self.clients["h"] = self.zeros(self.num_clients)

    def client_lambda(self, cctx) -> float:
        """FedLESAM-D's lambda_i = lambda / w_i."""
        return self.lam / cctx.weight

    # ----- the client
    def client_start(self, cctx):
        i, theta = cctx.client_id, cctx.global_params
        if self.estimate == "round":
            direction = -self.server["update"]
        else:
            direction = (self.clients["old"][i] - theta) * self.clients["seen"][i].to(theta.dtype)
        cctx.extras["lesam_eps"] = scaled_direction(direction, self.rho, self.norm, self.layout.numels)
        if self.variant == "s":
            cctx.extras["lesam_correction"] = self.lam * (self.server["c"] / cctx.weight - self.clients["c"][i])
        elif self.variant == "d":
            cctx.extras["lesam_correction"] = self.client_lambda(cctx) * (self.clients["h"][i] - theta)
        return super().client_start(cctx)

    def prepare_batch(self, step) -> None:
        Perturbed.enter(step, step.cohort.stack("lesam_eps"))

    def correct_gradient(self, step) -> None:
        Perturbed.leave(step)  # the one gradient was taken at theta + eps; the step starts from theta
        if self.variant != "fedlesam":
            step.cohort.layout.add_to_grads(step.cohort.stack("lesam_correction"))

    def extra_weight_decay(self, cctx) -> float:
        return self.client_lambda(cctx) if self.variant == "d" else 0.0

    def client_end(self, cctx, params, loss):
        i, theta = cctx.client_id, cctx.global_params
        extras = {}
        if self.variant == "s":
            c_i = self.clients["c"][i]
            new_c_i = c_i - self.server["c"] + (theta - params) / (cctx.steps * cctx.lr)
            extras["weighted_dc"] = cctx.weight * (new_c_i - c_i)
            self.clients["c"][i] = new_c_i
        elif self.variant == "d":
            self.clients["h"][i] += params - theta
        if self.estimate == "client":
            self.clients["old"][i] = theta
            self.clients["seen"][i] = 1.0
        return ClientResult(i, cctx.num_samples, params, loss, extras=extras)

    # ----- the server
    def aggregate(self, rctx, results):
        theta = rctx.global_params
        if self.variant == "d":
            new = plain_mean(results) + self.clients["h"].mean(0)
        else:
            if self.variant == "s":
                dc = torch.stack([r.extras["weighted_dc"] for r in results]).sum(0)
                self.server["c"] += dc / self.num_clients
            new = theta + self.server_lr * (plain_mean(results) - theta)
        self.server["update"] = new - theta
        return new
