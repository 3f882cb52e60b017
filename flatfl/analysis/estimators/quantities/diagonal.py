"""The squared norm of the curvature's diagonal, ``||diag(H)||^2 = sum_i H_ii^2`` (``flatfl hessian --measure
diagonal``): how strongly the loss curves along each parameter's own axis, the measure of per-parameter sensitivity
that pruning and quantization methods read, where the Frobenius norm also counts the couplings between parameters.

Estimated from pairs of independent Rademacher probes ``z``, ``w``: ``z * (H z)`` (element-wise) has expectation
``diag(H)`` (Bekas, Kokiopoulou and Saad's diagonal estimator), so ``(z * H z) . (w * H w)`` has expectation
``sum_i H_ii^2`` (the two factors are independent); the estimate is the mean of that over the pairs (two products
each), with the standard error of the mean. It stops once the standard error is at most ``--trace-rtol`` of the
estimate (after 10 pairs) or when another pair would pass ``--trace-hvps`` products, the trace's own budget. Its
variance grows with the off-diagonal entries: ``(z * H z)_i`` is ``H_ii`` plus ``sum_{j != i} H_ij z_i z_j``. For a
diagonal matrix every pair gives the value exactly (standard error 0)."""
from __future__ import annotations

import math

from ....errors import ConfigError
from . import Quantity

#: pairs before the stopping rule is looked at (a standard error of fewer is itself too noisy to stop on)
MIN_PAIRS = 10


def _paired_products(Z, HZ):
    """``(z * H z) . (w * H w)`` of each pair of consecutive probes (rows 0 and 1, 2 and 3, ...), in float64."""
    D = (Z * HZ).double()  # each row: z * H z, an unbiased estimate of diag(H)
    return (D[0::2] * D[1::2]).sum(dim=1)


def squared_diagonal_norm(op, settings, seed: int) -> dict:
    """``{"estimate", "stderr", "hvps", "method", "pairs", "target_rtol", "relative_stderr", "target_reached"}``
    of ``sum_i H_ii^2`` on ``op`` (see the module's docstring), Rademacher probes from ``seed``."""
    import numpy as np

    from ...operators.linear_operator import as_operator, block_size_for
    from ...operators.vectors import seeded_generator
    from ..trace import probe_samples, standard_error, target_info

    op = as_operator(op, "the diagonal's norm")
    budget = most_products(settings, op.dim)
    if budget < 2:
        raise ConfigError(f"--measure diagonal takes two products a sample: --trace-hvps {settings.trace_hvps} "
                          "leaves none (give at least 2)")
    block = 2 * math.ceil(block_size_for(op) / 2)  # whole pairs in every block (the budget is whole pairs too)
    used, samples = probe_samples(op, lambda Z: Z, seeded_generator(seed, op.device), settings.trace_rtol, budget,
                                  MIN_PAIRS, block, term=_paired_products)
    estimate, stderr = float(np.mean(samples)), standard_error(samples)
    return {"estimate": estimate, "stderr": stderr if math.isfinite(stderr) else None, "hvps": used,
            "method": "paired diagonal probes", "pairs": len(samples),
            **target_info(estimate, stderr, settings.trace_rtol)}


def most_products(settings, dim: int) -> int:
    """At most the trace's budget (``--trace-hvps``), rounded down to whole pairs."""
    return 2 * (int(settings.trace_hvps) // 2)


QUANTITY = Quantity("diagonal", "squared norm of the diagonal",
                    "||diag(H)||^2 = the sum of the squared diagonal entries, from pairs of Rademacher probes "
                    "(z * Hz) . (w * Hw) within the trace's budget (--trace-hvps, --trace-rtol)",
                    squared_diagonal_norm, most_products, short="‖diag H‖²", reading="lower: flatter")
