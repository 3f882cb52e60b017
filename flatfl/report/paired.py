"""Verdicts paired by seed: a change "X -> X+MAN" judged from the per-seed differences.

Two runs of one seed share everything the seed decides: the partition (``make_partition(labels, clients, method,
alpha, seed)``), the initial weights (``torch.manual_seed(seed)`` just before the model is built, before any
algorithm or regularizer exists), the clients drawn each round (``default_rng([seed, round, 0])``) and each
client's batch order. So the difference d_s = value(X+MAN, seed s) - value(X, seed s) removes the seed-to-seed
spread the two methods share, and the change is judged from the k differences:

* mean difference  d = (1/k) sum_s d_s;
* its standard error  se = s_d / sqrt(k), with s_d the sample standard deviation of the d_s (k - 1 in the
  denominator);
* the 95% t interval  d +- t_{0.975, k-1} se (Student's t with k - 1 degrees of freedom, ``scipy.stats.t``).

The change is resolved when that interval excludes 0; it then agrees with the paper when d has the paper's sign.

Seeds needed: for a change the interval does not resolve, the smallest number of seeds n >= 2 at which a change
of the paper's relative size, D = (paper change / |paper reference|) * |our reference|, would be resolved at the
observed spread s_d, i.e. the smallest n with ``t_{0.975, n-1} * s_d / sqrt(n) < |D|``.
"""
from __future__ import annotations

import math

__all__ = ["LEVEL", "paired_differences", "paired_stats", "seeds_needed", "MAX_SEEDS"]

LEVEL = 0.95  # two-sided level of the t interval
MAX_SEEDS = 100_000  # seeds_needed gives up (None) beyond this


def _t_quantile(level: float, dof: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, dof))


def paired_differences(reference: dict, compared: dict) -> dict:
    """seed -> compared[seed] - reference[seed], for the seeds both hold (in seed order)."""
    return {s: float(compared[s]) - float(reference[s]) for s in sorted(set(reference) & set(compared))}


def paired_stats(diffs, level: float = LEVEL) -> dict:
    """k, mean, sd (k - 1 denominator), se = sd / sqrt(k), the t quantile with k - 1 degrees of freedom, the
    interval mean +- t se and whether it excludes 0 (``resolved``). With fewer than two differences only k and
    the mean are given (the rest None)."""
    d = [float(x) for x in diffs]
    k = len(d)
    out = {"k": k, "mean": None, "sd": None, "se": None, "t": None, "low": None, "high": None, "resolved": None}
    if not k:
        return out
    mean = sum(d) / k
    out["mean"] = mean
    if k < 2:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (k - 1))
    se = sd / math.sqrt(k)
    t = _t_quantile(level, k - 1)
    out.update(sd=sd, se=se, t=t, low=mean - t * se, high=mean + t * se)
    out["resolved"] = out["low"] > 0 or out["high"] < 0
    return out


def seeds_needed(sd: float | None, change: float | None, level: float = LEVEL) -> int | None:
    """The smallest n >= 2 with ``t_{level, n-1} * sd / sqrt(n) < |change|`` (None: no spread known, no change to
    resolve, or more than :data:`MAX_SEEDS`). The left side falls as n grows, so a doubling then bisection
    search finds it."""
    if sd is None or change is None or not math.isfinite(sd) or not math.isfinite(change) or change == 0:
        return None

    def enough(n: int) -> bool:
        return _t_quantile(level, n - 1) * sd / math.sqrt(n) < abs(change)

    if enough(2):
        return 2
    lo, hi = 2, 4
    while not enough(hi):
        if hi >= MAX_SEEDS:
            return None
        lo, hi = hi, min(2 * hi, MAX_SEEDS)
    while hi - lo > 1:  # enough(hi), not enough(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi
