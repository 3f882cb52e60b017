"""Direction checks: for each (reference, compared) pair of a layout, partition and metric, our change beside the
paper's and a verdict on whether it points the paper's way, paired by seed where both sides share two or more seeds
(:mod:`.paired`; docs/reproductions.md, "Seeds and verdicts").

Each check is one record of :data:`DIRECTION_COLUMNS` (``directions.csv``'s columns, in order):

* ``incomparable``: the two rows' runs were trained differently in anything but the method (dataset, rounds, a
  shared hyper-parameter...: ``incomparable_because``), or the two values were computed with different settings
  (model, method, samples, protocol);
* ``too few seeds``: a side has fewer than two seeds (and the paper gives a direction): the only error bar would be
  the estimator's own, not the spread between seeds, so no direction is claimed (``seeds_needed``: the seeds per
  side that would resolve a change of the paper's relative size, from the other side's spread where it has seeds,
  else None);
* ``no paper value``: the paper gives no value for one of the two rows (and the rows are comparable), so there is
  no direction to agree with, whatever the seeds; the change itself is still said, by ``effect``;
* paired (``verdict_from`` 'paired, k=K'): ``agree`` / ``disagree`` when the 95% t interval (K - 1 degrees of
  freedom) of the mean per-seed difference compared - reference excludes 0 and the mean points the paper's way or
  not; else ``inconclusive``;
* unpaired (fewer than two shared seeds): the change of the means against twice its standard error,
  sqrt(se_a^2 + se_b^2), each side's se being sd / sqrt(n) over seeds (n >= 2) or, for one seed, the estimator's
  own error; inconclusive within it or when no error is known.

Apart from the paper, ``effect`` says what the interval the verdict is judged from shows of our change: ``lower`` or
``higher`` when it excludes 0 (the paired 95% t interval; unpaired, the change beyond twice its standard error),
``unresolved`` when it holds 0, when there is none (too few seeds) or when the comparison is incomparable.

The unpaired verdict is kept beside the paired one (``unpaired_verdict``); ``seeds_needed``: for an inconclusive
paired check, the seeds that would resolve a change of the paper's relative size at the observed spread
(:func:`.paired.seeds_needed`). ``agrees`` keeps the bare sign comparison (None without a paper value).
"""
from __future__ import annotations

import math

from ..paper_tables import TableSpec
from .experiments import settings_differences
from .paired import paired_differences, paired_stats, seeds_needed

__all__ = ["TOO_FEW_SEEDS", "NO_PAPER_VALUE", "VERDICTS", "EFFECTS", "DIRECTION_COLUMNS", "direction_checks",
           "direction_check", "effect_of", "summary_counts"]

TOO_FEW_SEEDS = "too few seeds"
NO_PAPER_VALUE = "no paper value"
VERDICTS = ("agree", "disagree", "inconclusive", NO_PAPER_VALUE, "incomparable", TOO_FEW_SEEDS)
#: what the interval of a check shows of our change, whatever the paper says
EFFECTS = ("lower", "higher", "unresolved")
#: the fields of a direction check, in order (directions.csv's columns)
DIRECTION_COLUMNS = (
    "table", "partition", "reference", "compared", "metric", "model", "ours_reference", "ours_compared",
    "ours_change", "ours_change_pct", "ours_uncertainty", "uncertainty_from", "resolved", "paper_reference",
    "paper_compared", "paper_change", "paper_change_pct", "ours_direction", "paper_direction", "agrees", "effect",
    "verdict", "verdict_from", "incomparable_because", "seeds_reference", "seeds_compared", "paired_seeds",
    "paired_change", "paired_sd", "paired_se", "paired_t", "paired_ci_low", "paired_ci_high", "paired_resolved",
    "unpaired_verdict", "paper_size_change", "seeds_needed")
_DIRECTION = {1: "higher", -1: "lower", 0: "equal", None: None}


def _sign(delta: float | None, tol: float = 0.0) -> int | None:
    if delta is None:
        return None
    return 0 if abs(delta) <= tol else (1 if delta > 0 else -1)


def _mean_error(cell) -> tuple[float | None, str]:
    """Standard error of a row's mean and where it comes from: sd / sqrt(n) over seeds ('n=3', n >= 2), else the
    estimator's own error ('est.'), else none."""
    if cell.n >= 2 and cell.sd is not None:
        return cell.sd / math.sqrt(cell.n), f"n={cell.n}"
    if cell.se is not None:
        return cell.se, "est."
    return None, "none"


def _spread_guess(a, b) -> float | None:
    """With fewer than two seeds on one side: the spread of a per-seed difference guessed from the side that has
    seeds (sqrt(2) x its sd: two independent runs; pairing by seed usually does better), None when neither has."""
    sds = [c.sd for c in (a, b) if c.n >= 2 and c.sd is not None]
    return math.sqrt(2) * max(sds) if sds else None


def _incomparable_because(a, b, trained: list[str]) -> str:
    """Why two cells are not compared ('' when they are): the rows trained differently, or the values made with
    other settings (or mixed ones)."""
    if trained:
        return "trained differently: " + ", ".join(trained)
    if a.setting == b.setting and not str(a.setting).startswith("mixed"):
        return ""
    return f"computed with other settings: {a.setting} vs {b.setting}"


def _unpaired_verdict(comparable: bool, few: bool, agrees: bool | None, resolved: bool | None) -> str:
    if not comparable:
        return "incomparable"
    if agrees is None:
        return NO_PAPER_VALUE
    if few:
        return TOO_FEW_SEEDS
    if not resolved:
        return "inconclusive"
    return "agree" if agrees else "disagree"


def effect_of(verdict_from: str, verdict: str, ps: dict, ours: float, resolved: bool | None) -> str:
    """What the interval the verdict is judged from shows of our change (:data:`EFFECTS`): the paired interval
    (``verdict_from`` 'paired, ...'), else the change of the means against twice its standard error (``resolved``);
    'unresolved' for an incomparable check or one with fewer than 2 seeds a side (no interval between seeds)."""
    if verdict == "incomparable" or verdict_from.startswith("none"):
        return "unresolved"
    if verdict_from.startswith("paired"):
        if not ps["resolved"]:
            return "unresolved"
        return "higher" if ps["low"] > 0 else "lower"
    if not resolved or ours == 0:
        return "unresolved"
    return "higher" if ours > 0 else "lower"


def _verdict(ps: dict, s_paper: int | None, comparable: bool, a, b, unpaired: str) -> tuple[str, str]:
    """(where the verdict comes from, the verdict): paired by seed with two or more shared seeds, none with fewer
    than two seeds a side, else the unpaired verdict."""
    if ps["k"] >= 2:
        p_agrees = None if s_paper is None else _sign(ps["mean"]) == s_paper
        if not comparable:
            verdict = "incomparable"
        elif p_agrees is None:
            verdict = NO_PAPER_VALUE
        elif not ps["resolved"]:
            verdict = "inconclusive"
        else:
            verdict = "agree" if p_agrees else "disagree"
        return f"paired, k={ps['k']}", verdict
    if min(a.n, b.n) < 2 and comparable:
        return f"none: {a.n} / {b.n} seeds, 2 a side needed", NO_PAPER_VALUE if s_paper is None else TOO_FEW_SEEDS
    return "unpaired (fewer than 2 shared seeds)", unpaired


def direction_check(spec: TableSpec, part: str, ref_row, cmp_row, metric: str, trained: list[str]) -> dict:
    """The check of one metric of two rows (both with a value): the record described in the module's docstring.
    ``trained``: how the rows were trained differently, the method aside (:func:`.experiments.settings_differences`)."""
    a, b = ref_row.cells[metric], cmp_row.cells[metric]
    ours = b.mean - a.mean
    paper = None if a.paper is None or b.paper is None else b.paper - a.paper
    (ua, ka), (ub, kb) = _mean_error(a), _mean_error(b)
    unc = math.sqrt(ua * ua + ub * ub) if ua is not None and ub is not None else None
    s_ours, s_paper = _sign(ours), _sign(paper)
    agrees = None if s_paper is None else (s_ours == s_paper)
    because = _incomparable_because(a, b, trained)
    resolved = None if unc is None else abs(ours) > 2 * unc
    unpaired = _unpaired_verdict(not because, min(a.n, b.n) < 2, agrees, resolved)
    ps = paired_stats(paired_differences(a.by_seed or {}, b.by_seed or {}).values())
    verdict_from, verdict = _verdict(ps, s_paper, not because, a, b, unpaired)
    effect = effect_of(verdict_from, verdict, ps, ours, resolved)
    target = None if paper is None or not a.paper else paper / abs(a.paper) * abs(a.mean)
    needed = seeds_needed(ps["sd"], target) if verdict == "inconclusive" else \
        seeds_needed(_spread_guess(a, b), target) if verdict == TOO_FEW_SEEDS else None
    values = (
        spec.key, part, ref_row.method, cmp_row.method, metric,
        ref_row.model if ref_row.model == cmp_row.model else f"{ref_row.model} / {cmp_row.model}",
        a.mean, b.mean, ours, None if not a.mean else 100.0 * ours / abs(a.mean), unc, f"{ka} / {kb}", resolved,
        a.paper, b.paper, paper, None if paper is None or not a.paper else 100.0 * paper / abs(a.paper),
        _DIRECTION[s_ours], _DIRECTION[s_paper], agrees, effect, verdict, verdict_from,
        because if verdict == "incomparable" else "", a.n, b.n,
        ps["k"], ps["mean"], ps["sd"], ps["se"], ps["t"], ps["low"], ps["high"], ps["resolved"], unpaired,
        target, needed)
    return dict(zip(DIRECTION_COLUMNS, values, strict=True))


def _row_pairs(spec: TableSpec, rows):
    """(partition, reference row, compared row) for each comparison of ``spec`` whose two rows are in ``rows``."""
    by = {(r.method, r.partition): r for r in rows}
    for ref, cmp_ in spec.comparisons:
        for part in spec.partitions:
            a, b = by.get((ref, part)), by.get((cmp_, part))
            if a is not None and b is not None:
                yield part, a, b


def direction_checks(spec: TableSpec, table_rows) -> list[dict]:
    """For each (reference, compared) pair, partition and metric where we have both values (rows of
    :func:`.tables.build_table`): our change and the paper's, and a verdict (:func:`direction_check`)."""
    checks = []
    for part, a, b in _row_pairs(spec, table_rows):
        trained = settings_differences(spec, a.method, a.training, b.method, b.training)
        checks += [direction_check(spec, part, a, b, metric, trained) for metric in spec.metrics
                   if a.cells[metric].mean is not None and b.cells[metric].mean is not None]
    return checks


def summary_counts(checks: list[dict]) -> dict:
    """Per metric: how many checks, the verdicts (paired by seed where possible), the effects (``effects``: lower /
    higher / unresolved) and the unpaired verdicts."""
    out = {}
    for metric in sorted({c["metric"] for c in checks}):
        cs = [c for c in checks if c["metric"] == metric]
        out[metric] = {"compared": len(cs), **{v: sum(c["verdict"] == v for c in cs) for v in VERDICTS},
                       "effects": {e: sum(c["effect"] == e for c in cs) for e in EFFECTS},
                       "paired": sum(c.get("verdict_from", "").startswith("paired") for c in cs),
                       "unpaired": {v: sum(c.get("unpaired_verdict", c["verdict"]) == v for c in cs)
                                    for v in VERDICTS}}
    return out
