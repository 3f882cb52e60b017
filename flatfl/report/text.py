"""The words the Markdown and PDF renderers share: a cell's 'mean ±sd (n=3)', the verdict counts line, the
paired interval, the seeds a change would need, the settings behind each column, and the findings under a table
(every sentence built from the numbers, curated notes marked as such)."""
from __future__ import annotations

from collections import defaultdict

from ..utils.plots import format_number
from .metrics import metric_title, report_metric
from .paired import MAX_SEEDS
from .verdicts import NO_PAPER_VALUE, TOO_FEW_SEEDS

__all__ = ["cell_text", "counts_line", "effects_text", "needed_text", "seeds_cell", "ci_text", "setting_parts",
           "findings"]


def cell_text(cell, newline: bool = False) -> str:
    """'mean ±sd (n=3)' over seeds; one run: 'value ±se (est.)' with the estimator's own error, if any; a dagger
    when the value was computed with other settings than its column's. ``cell``: a :class:`.tables.MetricCell`."""
    if cell.mean is None:
        return "-"
    txt = format_number(cell.mean) + cell.mark
    sep = "\n" if newline else " "
    if cell.n >= 2 and cell.sd is not None:
        txt += f"{sep}±{format_number(cell.sd, 2)} (n={cell.n})"
    elif cell.se is not None:
        txt += f"{sep}±{format_number(cell.se, 2)} (est.)"
    return txt


def effects_text(effects: dict) -> str:
    """'2 lower, 1 higher, 3 unresolved' (:func:`.verdicts.summary_counts`' ``effects``)."""
    return ", ".join(f"{effects.get(e, 0)} {e}" for e in ("lower", "higher", "unresolved"))


def counts_line(metric: str, c: dict) -> str:
    """One metric's effect and verdict counts (:func:`.verdicts.summary_counts`) as a sentence."""
    n_paired = c.get("paired", 0)
    how = ("paired by seed: 95% t interval of the per-seed differences" if n_paired == c["compared"] else
           f"{n_paired} paired by seed (95% t interval of the per-seed differences), the others unpaired"
           if n_paired else "unpaired: change within twice its standard error")
    judged = c["compared"] - c.get(TOO_FEW_SEEDS, 0) - c.get("incomparable", 0)
    line = (f"{metric_title(metric)}: of {c['compared']} comparisons, our change "
            f"{effects_text(c['effects'])}" + (f" ({how})" if judged else "")
            + f"; {c['agree']} agree with the paper's direction, {c['disagree']} disagree, "
            f"{c['inconclusive']} inconclusive")
    if c.get(NO_PAPER_VALUE):
        line += f", {c[NO_PAPER_VALUE]} without a paper value to agree with"
    if c.get("incomparable"):
        line += f", {c['incomparable']} incomparable (trained or measured with other settings)"
    if c.get(TOO_FEW_SEEDS):
        line += (f", {c[TOO_FEW_SEEDS]} without a verdict (fewer than 2 seeds a side: the only error bar would be "
                 "the estimator's own, not the spread between seeds)")
    u = c.get("unpaired")
    if n_paired and u:
        line += (f"; unpaired (means +- 2 SE): {u['agree']} agree, {u['disagree']} disagree, "
                 f"{u['inconclusive']} inconclusive")
        if u.get(NO_PAPER_VALUE):
            line += f", {u[NO_PAPER_VALUE]} without a paper value"
    return line


def needed_text(c: dict) -> str:
    """', ~N seeds would resolve the paper's relative change' for an inconclusive paired check, else ''."""
    if c["verdict"] == TOO_FEW_SEEDS:
        if c.get("seeds_needed"):
            return (f", about {c['seeds_needed']} seeds a side would resolve a change of the paper's size (guessed "
                    "from the spread of the side with seeds)")
        return ", at least 2 seeds a side are needed to judge it"
    if c.get("seeds_needed") is not None:
        return f", {c['seeds_needed']} seeds would resolve a change of the paper's size"
    if c.get("paper_size_change") is not None and c.get("paired_sd") is not None:
        return f", more than {MAX_SEEDS:,} seeds needed for a change of the paper's size"
    return ""


def seeds_cell(c: dict) -> str:
    """The 'seeds for the paper's change' cell: the count for an inconclusive check; for one without a verdict
    (fewer than 2 seeds a side) the count guessed from the other side's spread ('~N'), else '>= 2'."""
    if c["verdict"] == TOO_FEW_SEEDS:
        return f"~{c['seeds_needed']}" if c.get("seeds_needed") else ">= 2"
    if c["verdict"] != "inconclusive":
        return ""
    return str(c["seeds_needed"]) if c.get("seeds_needed") else "-"


def ci_text(c: dict) -> str:
    """'-0.43 [-0.9, 0.04] k=3' (paired mean difference and its 95% t interval), '-' without one."""
    if c.get("paired_ci_low") is None:
        return "-"
    f = format_number
    return f"{f(c['paired_change'], 3)} [{f(c['paired_ci_low'], 2)}, {f(c['paired_ci_high'], 2)}] k={c['paired_seeds']}"


def setting_parts(metrics, setting_of) -> list[tuple[str, str]]:
    """(label, settings) for every metric with settings (its registry entry's ``settings_line``), metrics made with
    the same settings as one ('H_N, H_D')."""
    parts: dict[str, list[str]] = {}  # settings -> the labels of the metrics made with them
    for m in metrics:
        text = setting_of(m) if report_metric(m).settings_line else None
        if text:
            parts.setdefault(text, []).append(report_metric(m).short)
    return [(", ".join(labels), text) for text, labels in parts.items()]


def _final_train_loss(records, method, part) -> float | None:
    vals = [r.curve[-1].get("train_loss") for r in records if r.method == method and r.partition == part and r.curve]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


_FINDING_WORDS = (("agree", "agree with the paper"), ("disagree", "DISAGREE with the paper"),
                  ("inconclusive", "inconclusive"), (NO_PAPER_VALUE, "without a paper value"),
                  ("incomparable", "incomparable (trained or measured with other settings)"),
                  (TOO_FEW_SEEDS, "without a verdict (fewer than 2 seeds a side)"))


def _finding(c: dict, verdict: str) -> str:
    """'FedAvg+MAN vs FedAvg dirichlet-0.3 (-28%, paper -15%, ...)'; without a paper value, the effect first
    ('lower, -28%')."""
    pct = '-' if c['ours_change_pct'] is None else format(c['ours_change_pct'], '+.0f')
    paper = '' if c['paper_change_pct'] is None else ', paper ' + format(c['paper_change_pct'], '+.0f') + '%'
    need = needed_text(c) if verdict in ('inconclusive', TOO_FEW_SEEDS) else ''
    because = '; ' + c['incomparable_because'] if c.get('incomparable_because') else ''
    effect = f"{c['effect']}, " if verdict == NO_PAPER_VALUE and c.get('effect') else ''
    return f"{c['compared']} vs {c['reference']} {c['partition']} ({effect}{pct}%{paper}{need}{because})"


def findings(spec, rows, checks, records) -> list[str]:
    """What agrees with the paper, what does not, from the numbers: per metric the counts and which rows, the final
    training losses of disagreeing pairs (a measured hint), then the layout's curated notes
    (``TableSpec.curated_notes``) on rows that have runs, marked as such."""
    out = []
    by_metric = defaultdict(list)
    for c in checks:
        by_metric[c["metric"]].append(c)
    for metric, cs in by_metric.items():
        for verdict, word in _FINDING_WORDS:
            sel = [c for c in cs if c["verdict"] == verdict]
            if sel:
                out.append(f"{metric_title(metric)}: {len(sel)} of {len(cs)} {word}: "
                           + "; ".join(_finding(c, verdict) for c in sel))
    loss_pairs = sorted({(c["reference"], c["compared"], c["partition"]) for c in checks if c["verdict"] == "disagree"})
    for ref, cmp_, part in loss_pairs:
        la, lb = _final_train_loss(records, ref, part), _final_train_loss(records, cmp_, part)
        if la is not None and lb is not None:
            out.append(f"measured: final training loss {ref} {format_number(la, 3)}, {cmp_} {format_number(lb, 3)} "
                       f"({part})")
    methods = {r.method for r in rows if r.n_runs}
    out += [f"curated note (measured outside this report): {note}" for method, note in spec.curated_notes
            if method in methods]
    return out or ["no comparison has our values on both sides"]
