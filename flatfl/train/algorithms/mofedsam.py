"""MoFedSAM (Qu et al. ICML 2022, Algorithm 2; the FedSpeed simulator's ``client/mofedsam.py``; docs/update-rules.md
section 10).

FedCM's client momentum with SAM local steps. Per local step::

    w~ = w + rho g / ||g||                  g the local gradient at w
    v  = beta grad f(w~) + (1 - beta) Delta^r
    w <- w - eta v

and Delta^{r+1} = -(1 / (eta K S)) sum_i Delta_i^r, w^{r+1} = w^r + eta_g * mean update: FedCM's rules
(:class:`.fedcm.FedCM`, whose ``--fedcm-alpha`` is the slides' beta) with the SAM step
(:class:`flatfl.train.optimizers.SAM`). As in the simulator, the perturbed loss is scaled by beta and (1 - beta)
Delta added afterwards; the ascent direction does not depend on that scale.

Defaults (simulator README): rho = 0.1, beta = 0.1 (0.05 also listed), eta_g = 1.
"""
from ..components import HParam
from .algorithm import register
from .fedcm import FEDCM_ALPHA_HELP, SERVER_LR, FedCM


@register
class MoFedSAM(FedCM):
    name, display_name = "mofedsam", "MoFedSAM"
    summary = "MoFedSAM: FedCM's client momentum with local SAM steps"
    local_opt = "sam"
    hparams = (HParam("alpha", 0.1, FEDCM_ALPHA_HELP, flag="fedcm-alpha", check="unit"), SERVER_LR,
               HParam("rho", 0.1, "SAM radius for MoFedSAM (FedSpeed simulator README)", check="nonnegative"))
