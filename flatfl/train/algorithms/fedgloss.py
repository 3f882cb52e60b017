"""FedGloSS (Caldarola et al. CVPR 2025, "Beyond Local Sharpness: Communication-Efficient Global Sharpness-aware
Minimization for Federated Learning"), as the authors' code runs it (docs/update-rules.md §26).

Sharpness-aware minimization on the server: the server sends the global model perturbed along its previous
pseudo-gradient, the clients train from that point (local SAM, with ADMM dual variables), and the server steps from
the unperturbed model with the pseudo-gradient they return.

* **Server state:** the previous pseudo-gradient G (0 at first) and the dual sigma (0). **Client state:** the dual
  sigma_i (0).
* **Round t**, theta^t the server model::

      eps~  = rho_s G / ||G||            (no perturbation in the first round, G = 0)
      w~    = theta^t + eps~             (what every client starts from)

* **One local step** (the local objective f_i(w) - <sigma_i, w> + ||w - w~||^2 / (2 beta))::

      g~  = the SAM gradient of f at w    (flatfl's SAM step, radius rho)
      dir = g~ - sigma_i + (w - w~) / beta + wd w       (clipped, then the SGD step)

* **After training:** Delta_i = theta_i - w~; ``sigma_i -= Delta_i / beta``.
* **Server**, over the participants P_t, N clients in all::

      sigma     -= sum_{P_t} Delta_i / (beta N |P_t|)
      Delta      = sum_{P_t} n_i Delta_i / sum_{P_t} n_i
      G          = -Delta
      theta^{t+1} = theta^t + eta_g Delta - beta sigma

Clients start from w~ (:meth:`client_start`); the dual and proximal terms are gradient terms at the unperturbed w
(:meth:`correct_gradient`). Pieces that read the server model of the round (ASD's teacher, MOON's global model) see
theta^t, not w~. The clients' SAM is :class:`flatfl.train.optimizers.SAM` (the code's ``FedGloSSOpt``):
``--local-opt asam`` is refused.

Defaults (the code's CIFAR scripts): rho_s = rho = 0.15, beta = 10, eta_g = 1. The code's
linear warm-up of both radii over the first ``T_s`` rounds is not reproduced (constant radii).
"""
from __future__ import annotations

import numpy as np
import torch

from ..components import HParam
from .algorithm import Algorithm, ClientResult, register
from .fedcm import SERVER_LR


@register
class FedGloSS(Algorithm):
    name, display_name = "fedgloss", "FedGloSS"
    summary = "FedGloSS: server-side SAM along the previous pseudo-gradient, ADMM duals, local SAM"
    local_opt = "sam"
    hparams = (HParam("rho", 0.15, "clients' SAM radius for FedGloSS (fedgloss scripts --rho-l 0.15)",
                      check="nonnegative"),
               HParam("server_rho", 0.15, "FedGloSS server-side SAM radius rho_s (fedgloss scripts --rho 0.15)",
                      flag="gloss-rho", check="nonnegative"),
               HParam("beta", 10.0, "FedGloSS ADMM penalty beta: local term ||w - w~||^2 / (2 beta) (fedgloss "
                      "scripts --beta 10)", flag="gloss-beta", check="positive"),
               SERVER_LR)

    def init_state(self) -> None:
        self.server["pseudo_grad"] = self.zeros()  # G = -(the last round's mean update)
        self.server["sigma"] = self.zeros()
        self.clients["sigma"] = self.zeros(self.num_clients)

    def perturbation(self) -> torch.Tensor:
        """eps~ = rho_s G / ||G||; zero while G is zero (the first round)."""
        g = self.server["pseudo_grad"]
        norm = float(torch.linalg.vector_norm(g))
        return g * (self.server_rho / norm) if norm > 0 else torch.zeros_like(g)

    def round_start(self, rctx) -> None:
        self._start = rctx.global_params + self.perturbation()  # w~, what the clients receive

    def client_start(self, cctx):
        sigma_i = self.clients["sigma"][cctx.client_id]
        cctx.extras["gloss_start"] = self._start
        cctx.extras["gloss_linear"] = -sigma_i - self._start / self.beta  # -sigma_i + (w - w~)/beta, less w/beta
        return self._start.clone()

    def correct_gradient(self, step) -> None:
        layout = step.cohort.layout
        layout.add_to_grads(step.cohort.stack("gloss_linear"))
        layout.add_params_to_grads(1.0 / self.beta)

    def client_end(self, cctx, params, loss):
        delta = params - cctx.extras["gloss_start"]
        self.clients["sigma"][cctx.client_id] -= delta / self.beta
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss, extras={"delta": delta})

    def aggregate(self, rctx, results):
        deltas = torch.stack([r.extras["delta"] for r in results])
        self.server["sigma"] -= deltas.sum(0) / (self.beta * self.num_clients * len(results))
        n = np.array([r.num_samples for r in results], dtype=np.float64)
        weights = torch.as_tensor(n / n.sum(), dtype=deltas.dtype, device=deltas.device)
        mean = torch.einsum("k,kd->d", weights, deltas)
        self.server["pseudo_grad"] = -mean
        return rctx.global_params + self.server_lr * mean - self.beta * self.server["sigma"]
