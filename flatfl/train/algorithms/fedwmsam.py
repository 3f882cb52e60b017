"""FedWMSAM (Li, Huang et al. NeurIPS 2025, "FedWMSAM: Fast and Flat Federated Learning via Weighted Momentum and
Sharpness-Aware Minimization"), as the authors' code runs it (``Huang-Yongzhi/NeurlPS_FedWMSAM``:
``client/fedwmsam.py``, ``optimizer/WMSAM.py``, ``server/FedWMSAM.py``; docs/update-rules.md §29).

One gradient a step, at a point steered by a personalised momentum; the step mixes that gradient with the momentum,
and the mixing weight alpha adapts to how well the clients' updates agree with the momentum.

* **Server state:** the momentum m (a gradient estimate, 0 at first), SCAFFOLD's c, and alpha. **Client state:**
  c_i. With v_i = c / w_i - c_i (c - c_i on equal sizes), client i's personalised momentum is::

      m_i = m + v_i alpha / (1 - alpha)

* **Local step b** (b = 0, 1, ... the steps the client has taken), theta^t the server model::

      d    = w - (theta^t + b m_i)                        ('code'; 'paper': the opposite sign)
      eps  = rho d / (||d|| + 1e-7)                       (||.||: 'tensors', the sum of the parameter tensors'
                                                           2-norms; 'global', the vector's 2-norm)
      g~   = grad f(w + eps), then w restored exactly     (f = CE + regularizer + loss terms)
      dir  = alpha g~ + (1 - alpha) m_i + wd w            (clipped, then the SGD step)

* **After K local steps:** ``c_i+ = c_i - c + (theta^t - theta_i) / (K eta)`` (SCAFFOLD's, §4) and the agreement
  ``a_i = cos(theta_i - theta^t, m) + 1`` (0 when either vector is 0).
* **Server:** ``c += (1/N) sum_{P_t} w_i (c_i+ - c_i)``;
  ``alpha = 0.99 alpha + 0.01 clip(mean_{P_t} a_i, 0.1, 0.9)``; ``m = mean_{P_t} (theta^t - theta_i) / (K_i eta)``;
  ``theta^{t+1} = theta^t + eta_g mean_{P_t}(theta_i - theta^t)``.

The step's one gradient is taken as FedLESAM's (:class:`flatfl.train.sam_terms.Perturbed`, around plain SGD's
closure): FedWMSAM is its own SAM-type step, so ``--local-opt sam`` / ``asam`` are refused; the control variates are
SCAFFOLD's (:class:`.scaffold.Scaffold`, with its ``--cv-lr`` and ``--steps-rule``).

Defaults (the code's ``train.py``): rho = 0.1, alpha = 0.1 at the start, eta_g = 1, direction 'code', norm
'tensors'. The code indexes its flat direction by parameter tensor (``g_update[idx]``), which shifts each tensor by
one scalar; flatfl perturbs every entry by the matching entry of d (the docs section says why).
"""
from __future__ import annotations

import numpy as np
import torch

from ...errors import ConfigError
from ..components import HParam
from .algorithm import register
from .fedcm import SERVER_LR
from ..sam_terms import Perturbed, scaled_direction
from .scaffold import CV_LR, STEPS_RULE, Scaffold


def agreement(update: torch.Tensor, momentum: torch.Tensor) -> float:
    """cos(update, momentum) + 1, in [0, 2]; 0 when either vector is 0 (the code's ``cosine_similarity``)."""
    size = float(torch.linalg.vector_norm(update) * torch.linalg.vector_norm(momentum))
    return 0.0 if size == 0 else float(torch.dot(update, momentum)) / size + 1.0


@register
class FedWMSAM(Scaffold):
    name, display_name = "fedwmsam", "FedWMSAM"
    summary = ("FedWMSAM: one gradient a step at a point steered by the personalised momentum m + v_i a/(1-a); steps "
               "along a g + (1-a) m_i, a adapted each round")
    local_opt = "sgd"
    hparams = (CV_LR, STEPS_RULE, SERVER_LR,
               HParam("rho", 0.1, "perturbation radius for FedWMSAM (FedWMSAM train.py --rho 0.1)",
                      check="nonnegative"),
               HParam("alpha", 0.1, "FedWMSAM's initial weight alpha of the gradient in alpha g + (1 - alpha) m_i, "
                      "then adapted each round; below 1 (FedWMSAM train.py --alpha 0.1)", flag="wmsam-alpha",
                      check="unit"),
               HParam("direction", "code", "FedWMSAM's perturbation direction: 'code' = w - (theta^t + b m_i), as "
                      "the released code (the default); 'paper' = (theta^t + b m_i) - w, as the README's equation",
                      flag="wmsam-direction", choices=("code", "paper")),
               HParam("norm", "tensors", "norm of FedWMSAM's direction: 'tensors' = sum of the parameter tensors' "
                      "2-norms (the code's WMSAM.first_step, the default); 'global' = the 2-norm of the whole vector",
                      flag="wmsam-norm", choices=("tensors", "global")))

    def init_state(self) -> None:
        if self.alpha >= 1:
            raise ConfigError(f"--wmsam-alpha for fedwmsam must be below 1 (it divides by 1 - alpha), got {self.alpha}")
        super().init_state()  # c, c_i
        self.server["momentum"] = self.zeros()
        self.server["alpha"] = torch.full((), float(self.alpha), device=self.device)  # the run's floating type

    # ----- the client
    def round_start(self, rctx) -> None:
        self._alpha = float(self.server["alpha"])  # this round's alpha

    def client_start(self, cctx):
        start = super().client_start(cctx)  # v_i = c / w_i - c_i
        a = self._alpha
        cctx.extras["wmsam_momentum"] = self.server["momentum"] + cctx.extras["scaffold_correction"] * (a / (1 - a))
        return start

    def start_cohort(self, cohort) -> None:
        cohort.extras["wmsam_steps"] = torch.zeros(cohort.n, 1, dtype=cohort.global_params.dtype,
                                                   device=cohort.device)  # b, the steps each client has taken

    def prepare_batch(self, step) -> None:
        cohort = step.cohort
        steps, momenta = cohort.extras["wmsam_steps"], cohort.stack("wmsam_momentum")
        direction = cohort.layout.get() - (cohort.global_params + steps * momenta)  # w - (theta^t + b m_i)
        if self.direction == "paper":
            direction = -direction
        Perturbed.enter(step, scaled_direction(direction, self.rho, self.norm, self.layout.numels))
        if step.rows is None:
            steps.add_(1.0)
        else:
            steps[step.rows] += 1.0

    def correct_gradient(self, step) -> None:
        Perturbed.leave(step)  # the one gradient was taken at w + eps; the step starts from w
        layout = step.cohort.layout
        torch._foreach_mul_(layout.grads(), self._alpha)
        layout.add_to_grads(step.cohort.stack("wmsam_momentum"), 1.0 - self._alpha)

    def client_end(self, cctx, params, loss):
        result = super().client_end(cctx, params, loss)  # c_i+
        update = params - cctx.global_params
        result.extras["agreement"] = agreement(update, self.server["momentum"])
        result.extras["gradient_estimate"] = -update / (cctx.steps * cctx.lr)
        return result

    # ----- the server
    def aggregate(self, rctx, results):
        mean = super().aggregate(rctx, results)  # updates c; the plain mean of the participants' models
        value = float(np.mean([r.extras["agreement"] for r in results]))
        self.server["alpha"].mul_(0.99).add_(0.01 * min(max(value, 0.1), 0.9))
        self.server["momentum"] = torch.stack([r.extras["gradient_estimate"] for r in results]).mean(0)
        return rctx.global_params + self.server_lr * (mean - rctx.global_params)
