"""FedProx (Li et al. 2020; docs/update-rules.md section 3).

Local objective: CE + (mu/2)||theta - theta^t||^2, i.e. CE + (mu/2)||theta||^2 - mu<theta, theta^t> + const, as
the FedDyn-family code writes it (the terms are part of the loss, so they are clipped with it). Its gradient
mu (theta - theta^t) is added after backward. Server: as FedAvg. Default mu = 1e-4 (DYN/FDC scripts, MAN argparse).
"""
from ..components import HParam
from .algorithm import Algorithm, register


@register
class FedProx(Algorithm):
    name, display_name = "fedprox", "FedProx"
    summary = "FedProx: FedAvg with a proximal term (mu/2)||theta - theta^t||^2"
    hparams = (HParam("mu", 1e-4, "proximal coefficient mu", check="nonnegative"),)

    def correct_gradient(self, step) -> None:
        if self.mu:
            layout = step.cohort.layout
            layout.add_params_to_grads(self.mu)
            layout.add_to_grads(step.cohort.global_params, -self.mu)
