"""FedSAM and FedASAM: FedAvg with a sharpness-aware local optimizer (docs/update-rules.md section 8).

FedSAM (Qu et al. ICML 2022, Algorithm 1; Caldarola et al. ECCV 2022) runs K local SAM steps
w~ = w + rho g / ||g||, w <- w - eta grad f(w~) and averages the models as FedAvg does; FedASAM (Caldarola et al.)
uses ASAM's adaptive perturbation. They are FedAvg with ``--local-opt sam`` / ``asam``
(:class:`flatfl.train.optimizers.SAM`, :class:`~flatfl.train.optimizers.ASAM`), registered under their own names
so a run reads as the papers name it. ``--rho`` / ``--eta`` keep the optimizers' defaults (MAN: SAM rho 0.05,
ASAM rho 0.5, eta 0.2).
"""
from .algorithm import register
from .fedavg import FedAvg


@register
class FedSAM(FedAvg):
    name, display_name = "fedsam", "FedSAM"
    summary = "FedSAM: FedAvg with local SAM steps (= fedavg --local-opt sam)"
    local_opt = "sam"


@register
class FedASAM(FedAvg):
    name, display_name = "fedasam", "FedASAM"
    summary = "FedASAM: FedAvg with local ASAM steps (= fedavg --local-opt asam)"
    local_opt = "asam"
