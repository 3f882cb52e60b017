"""FedSpeed (Sun et al. ICLR 2023), as the FedSpeed authors' simulator and fedMAN run it (docs/update-rules.md section 7).

FedDyn's prox-correction with a SAM-type local step. Client state h_i (starts at 0). Per local step::

    g    = grad f(theta)                    (the data loss: CE + regularizer)
    eps  = rho g / ||g||
    g~   = grad f(theta + eps), then theta restored
    step = g~ + lambda_i (theta - theta^t + h_i) + wd theta      (lambda_i theta as weight decay, after clipping)

After training h_i += theta_i - theta^t; server theta^{t+1} = mean_{P_t} theta_i + mean_{all} h_i. These are the
FedDyn rules with FedDyn's alpha renamed lambda (``lam``; runs written before the rename recorded it as ``alpha``,
read as ``lam``: :data:`flatfl.checkpoint.RENAMED_SETTINGS`), so the class is FedDyn's with the SAM step
(:class:`flatfl.train.optimizers.SAM`) and its own defaults.

The paper's intent, not the code's quirks: fedMAN's speedOpt never zeroes the gradient before the ascent (the
previous step's gradient leaks into the ascent direction) and ASD's never removes the perturbation; here each
ascent uses only the current gradient at theta and the step always starts from theta. The paper's merge
(1 - a) g + a g~ is not used: both codes take a = 1 (only the perturbed gradient), as here.

Defaults: lambda = 0.01 with lambda_i = lambda / w_i (fedMAN's ``alpha_coef``; the simulator's README uses 0.1),
rho = 0.1 (the MAN appendix for non-IID runs and the simulator; MAN uses 0.01 for IID). ``--rho`` is the SAM
radius shared with ``--local-opt sam``.
"""
from __future__ import annotations

from ..components import HParam
from .algorithm import register
from .feddyn import FedDyn


@register
class FedSpeed(FedDyn):
    name, display_name = "fedspeed", "FedSpeed"
    summary = "FedSpeed: FedDyn's prox-correction lambda_i(theta - theta^t + h_i) with a SAM local step"
    local_opt = "sam"
    hparams = (HParam("lam", 0.01, "FedSpeed prox-correction lambda; client i uses lambda / w_i (fedMAN "
                      "alpha_coef 0.01; FedSpeed simulator 0.1)", flag="fedspeed-lambda", check="nonnegative"),
               HParam("rho", 0.1, "SAM radius for FedSpeed (MAN appendix non-IID, FedSpeed simulator; MAN IID 0.01)",
                      check="nonnegative"))

    def client_alpha(self, cctx) -> float:
        """lambda_i = lambda / w_i, in FedDyn's place of alpha_i."""
        return self.lam / cctx.weight
