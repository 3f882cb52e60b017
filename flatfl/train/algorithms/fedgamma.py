"""FedGAMMA (Dai et al., IEEE TNNLS 2023, "FedGAMMA: Federated Learning With Global Sharpness-Aware Minimization"),
as the FedSpeed authors' simulator runs it (docs/update-rules.md §24).

SCAFFOLD's control variates with SAM local steps, so that every client steps towards the global flat region.

* **Server state:** c. **Client state:** c_i. Both start at 0.
* **One local step**, with the SCAFFOLD correction v_i = c / w_i - c_i (c - c_i on equal client sizes)::

      g    = grad f(theta)                              f = CE + regularizer (+ loss terms)
      eps  = rho g / ||g||                  ('plain', the code; 'corrected': rho (g + v_i) / ||g + v_i||)
      g~   = grad f(theta + eps), then theta restored
      dir  = g~ + v_i + wd theta            (clipped, then the SGD step)

* **After K local steps:** ``c_i+ = c_i - c + (theta^t - theta_i) / (K eta)``.
* **Server:** ``c += (1/N) sum_{P_t} w_i (c_i+ - c_i)`` and ``theta^{t+1} = theta^t + eta_g mean_{P_t}(theta_i -
  theta^t)``.

The control variates are SCAFFOLD's (:class:`.scaffold.Scaffold`, with its ``--cv-lr`` and ``--steps-rule``); the
SAM step is :class:`flatfl.train.optimizers.SAM`. ``--gamma-ascent corrected`` puts v_i into the ascent as well, as
a loss term of value 0 in both passes (:func:`flatfl.train.sam_terms.linear_term`; its gradient does not depend on
theta, so the descent direction is the same). FedGAMMA is its own SAM-type optimizer: ``--local-opt asam`` is refused.

Defaults (the simulator's): rho = 0.1, eta_g = 1, ascent 'plain' (the simulator and the FedLESAM authors'
re-implementation both perturb along the plain local gradient; 'corrected' is a reading of the paper, not verified:
see the docs section).
"""
from __future__ import annotations

from ..components import HParam
from .algorithm import register
from .fedcm import SERVER_LR
from ..sam_terms import linear_term
from .scaffold import CV_LR, STEPS_RULE, Scaffold


@register
class FedGAMMA(Scaffold):
    name, display_name = "fedgamma", "FedGAMMA"
    summary = "FedGAMMA: SCAFFOLD's control variates c/w_i - c_i with SAM local steps"
    local_opt = "sam"
    hparams = (CV_LR, STEPS_RULE, SERVER_LR,
               HParam("rho", 0.1, "SAM radius for FedGAMMA (FL-Simulator --rho 0.1)", check="nonnegative"),
               HParam("ascent", "plain", "FedGAMMA's ascent direction: 'plain' = the local gradient g (FL-Simulator "
                      "and FedLESAM code, the default); 'corrected' = g + c/w_i - c_i", flag="gamma-ascent",
                      choices=("plain", "corrected")))

    def loss_terms(self, step):
        if self.ascent == "corrected":  # in both passes: the ascent and the descent follow g + v_i
            return linear_term(step, step.cohort.stack("scaffold_correction"))
        return None

    def correct_gradient(self, step) -> None:
        if self.ascent == "plain":  # added once, at theta (the linear term's gradient is the same everywhere)
            super().correct_gradient(step)

    def aggregate(self, rctx, results):
        mean = super().aggregate(rctx, results)  # updates c; the plain mean of the participants' models
        return rctx.global_params + self.server_lr * (mean - rctx.global_params)

