"""The squared Frobenius norm of the curvature, ``||H||_F^2 = tr(H^2) = sum_i lambda_i^2`` (``flatfl hessian
--measure frobenius``): a flatness measure that weighs every eigenvalue, negative ones too, by its square, where the
trace lets positive and negative curvature cancel and the top eigenvalue sees one direction only.

Estimated as Hutchinson estimates a trace, on ``H^2``: the mean of ``||H z||^2`` over Rademacher vectors ``z``
(``E[z^T H^T H z] = tr(H^2)``, one product each), with the standard error of that mean; it stops once the standard
error is at most ``--trace-rtol`` of the estimate (after 10 probes) or at ``--trace-hvps`` products, the trace's own
budget. Its square root, ``||H||_F``, carries the relative error halved (to first order)."""
from __future__ import annotations

import math

from . import Quantity

#: probes before the stopping rule is looked at (a standard error of fewer is itself too noisy to stop on)
MIN_PROBES = 10


def _squared_norms(Z, HZ):
    """``||H z||^2`` of each probe (rows)."""
    return (HZ * HZ).sum(dim=1)


def squared_frobenius_norm(op, settings, seed: int) -> dict:
    """``{"estimate", "stderr", "hvps", "method", "probes", "target_rtol", "relative_stderr", "target_reached"}``
    of ``tr(H^2)`` on ``op`` (see the module's docstring), Rademacher probes from ``seed``."""
    import numpy as np

    from ...operators.linear_operator import as_operator, block_size_for
    from ...operators.vectors import seeded_generator
    from ..trace import probe_samples, standard_error, target_info

    op = as_operator(op, "the Frobenius norm")
    used, samples = probe_samples(op, lambda Z: Z, seeded_generator(seed, op.device), settings.trace_rtol,
                                  settings.trace_hvps, MIN_PROBES, block_size_for(op), term=_squared_norms)
    estimate, stderr = float(np.mean(samples)), standard_error(samples)
    return {"estimate": estimate, "stderr": stderr if math.isfinite(stderr) else None, "hvps": used,
            "method": "hutchinson on H^2", "probes": len(samples), **target_info(estimate, stderr, settings.trace_rtol)}


def most_products(settings, dim: int) -> int:
    """At most the trace's budget (``--trace-hvps``)."""
    return int(settings.trace_hvps)


QUANTITY = Quantity("frobenius", "squared Frobenius norm",
                    "||H||_F^2 = tr(H^2) = the sum of the squared eigenvalues, by Hutchinson's estimator on H^2 "
                    "within the trace's budget (--trace-hvps, --trace-rtol)",
                    squared_frobenius_norm, most_products, short="‖H‖F²", reading="lower: flatter")
