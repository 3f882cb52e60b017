"""An algorithm defined outside the package, as a user would write one: a subclass of
:class:`flatfl.train.algorithms.algorithm.Algorithm` registered with the public ``register``
(``flatfl/train/algorithms/algorithm.py``; docs/training-and-algorithms.md, "Adding an algorithm").

:class:`ProxServerStep`: FedAvg with a proximal term and a server learning rate. Client i minimises
CE + (mu/2)||theta - theta^t||^2 (the gradient mu (theta - theta^t) added to each client's row after backward, so it
is written once for a cohort of any size); the server moves theta^t by eta_g times the sample-weighted mean update::

    theta^{t+1} = theta^t + eta_g * (sum_i n_i theta_i / sum_i n_i - theta^t)

:func:`registered` registers it for the time of a ``with`` block and takes it out after, so the registries of the
other test modules stay the package's own.
"""
from __future__ import annotations

import contextlib

from flatfl.train.algorithms.algorithm import Algorithm, register, weighted_mean
from flatfl.train.algorithms.fedcm import SERVER_LR
from flatfl.train.catalog import load_all
from flatfl.train.components import ALGORITHMS, HParam


class ProxServerStep(Algorithm):
    name = "proxstep"
    display_name = "ProxStep"
    summary = "an algorithm defined outside the package: FedAvg with a proximal term and a server learning rate"
    hparams = (SERVER_LR,
               HParam("mu", 0.5, "proximal coefficient of the outside algorithm", flag="proxstep-mu",
                      check="nonnegative"))

    def correct_gradient(self, step) -> None:
        layout = step.cohort.layout  # (N, dim) rows: grad_i += mu * (theta_i - theta^t)
        layout.add_params_to_grads(self.mu)
        layout.add_to_grads(step.cohort.global_params, -self.mu)

    def aggregate(self, rctx, results):
        mean = weighted_mean([r.params for r in results], [r.num_samples for r in results])
        return rctx.global_params + self.server_lr * (mean - rctx.global_params)


@contextlib.contextmanager
def registered(cls: type[Algorithm] = ProxServerStep):
    """``cls`` registered (``register``, the package's pieces loaded first) inside the block, taken out after."""
    load_all()
    register(cls)
    try:
        yield cls
    finally:
        ALGORITHMS.pop(cls.name, None)
