"""FedSMOO (Sun et al. ICML 2023, "Dynamic Regularized Sharpness Aware Minimization in Federated Learning"), as the
authors' simulator runs it (docs/update-rules.md §23).

FedDyn's (FedSpeed's) dynamic regularizer with a SAM step whose perturbation is itself corrected by a dual variable,
so that the clients' perturbations agree on one global perturbation s.

* **Server state:** s, the global perturbation (0 at first). **Client state:** h_i (the FedDyn drift) and mu_i (the
  perturbation's dual variable); both start at 0.
* **One local step**, lambda_i = lambda / w_i::

      g     = grad f(theta)                              f = CE + regularizer (+ loss terms)
      eps   = rho (g - mu_i - s) / ||g - mu_i - s||
      mu_i += eps - s
      g~    = grad f(theta + eps), then theta restored
      dir   = g~ + lambda_i (theta - theta^t + h_i) + wd theta     (lambda_i theta and wd theta as SGD decay, after
                                                                    clipping)

* **After training:** h_i += theta_i - theta^t. **Server:**
  ``s = rho mean_{P_t} mu_i / ||mean_{P_t} mu_i||`` and ``theta^{t+1} = mean_{P_t} theta_i + mean_{all} h_i``.

The SAM step is :class:`flatfl.train.optimizers.SAM`; the shift -(mu_i + s) of the ascent direction enters its
first pass as a loss term of value 0 (:func:`flatfl.train.sam_terms.linear_term`), so the first pass's gradient
is g - mu_i - s and the second pass's is plain g~; eps is read back as (theta + eps) - theta in the second pass. FedSMOO
is its own SAM-type optimizer: ``--local-opt asam`` is refused.

Defaults (the simulator's): lambda = 0.1, rho = 0.1. The server's s is the simulator's simplified rule (the paper's
hat-s_{i,K} term dropped); the docs section says what is not verified and where flatfl differs.
"""
from __future__ import annotations

import torch

from ..components import HParam
from .algorithm import register
from .feddyn import FedDyn
from ..sam_terms import linear_term, sam_pass


@register
class FedSMOO(FedDyn):
    name, display_name = "fedsmoo", "FedSMOO"
    summary = "FedSMOO: FedDyn's dynamic regularizer with a SAM step whose ascent is corrected by mu_i and s"
    all_model_weighting = "uniform"
    local_opt = "sam"
    hparams = (HParam("lam", 0.1, "FedSMOO dynamic-regularizer lambda; client i uses lambda / w_i (FL-Simulator "
                      "--lamb 0.1)", flag="fedsmoo-lambda", check="nonnegative"),
               HParam("rho", 0.1, "SAM radius for FedSMOO, also the norm of the global perturbation s "
                      "(FL-Simulator --rho 0.1)", check="nonnegative"))

    def init_state(self) -> None:
        super().init_state()  # h_i
        self.clients["mu"] = self.zeros(self.num_clients)
        self.server["s"] = self.zeros()

    def client_alpha(self, cctx) -> float:
        """lambda_i = lambda / w_i, in FedDyn's place of alpha_i."""
        return self.lam / cctx.weight

    def _ids(self, cohort) -> torch.Tensor:
        return torch.tensor([c.client_id for c in cohort.clients], device=self.clients["mu"].device)

    def start_cohort(self, cohort) -> None:
        cohort.extras["smoo_mu"] = self.clients["mu"].index_select(0, self._ids(cohort))  # the cohort's rows, a copy

    def loss_terms(self, step):
        mu, s = step.cohort.extras["smoo_mu"], self.server["s"]
        which = sam_pass(step, "smoo_pass")
        if which == 0:  # at theta: the ascent direction becomes g - mu_i - s
            step.scratch["smoo_theta"] = step.cohort.layout.get()
            return linear_term(step, -(mu + s))
        if which == 1:  # at theta + eps: mu_i += eps - s for the clients of this step
            with torch.no_grad():
                change = step.cohort.layout.get() - step.scratch.pop("smoo_theta") - s
                if step.rows is None:
                    mu.add_(change)
                else:
                    mu.index_add_(0, step.rows, change.index_select(0, step.rows))
        return None

    def end_cohort(self, cohort) -> None:
        self.clients["mu"].index_copy_(0, self._ids(cohort), cohort.extras["smoo_mu"])

    def aggregate(self, rctx, results):
        ids = torch.tensor([r.client_id for r in results], device=self.clients["mu"].device)
        mean_mu = self.clients["mu"].index_select(0, ids).mean(0)
        self.server["s"] = self.rho * mean_mu / (torch.linalg.vector_norm(mean_mu) + 1e-7)
        return super().aggregate(rctx, results)
