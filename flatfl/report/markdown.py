"""``report.md``: what the tables found (:mod:`.headline`), the scale, the notices, per layout its table (ours beside the paper's), the verdict counts, the
direction of each change and the findings, then what is missing."""
from __future__ import annotations

from ..utils.plots import format_number
from .headline import HEADLINE_TITLE, report_headline
from .metrics import metric_title
from .run_reader import MODEL_NAMES
from .tables import incomparable_notes
from .text import cell_text, ci_text, counts_line, seeds_cell, setting_parts

__all__ = ["report_markdown", "directions_markdown"]

_DIRECTIONS_HEAD = ["comparison", "partition", "metric", "ours: reference → compared", "change",
                    "paired: mean difference [95% t interval] seeds", "unpaired ± 2 SE", "paper change",
                    "effect", "verdict (paired)", "unpaired verdict", "seeds for the paper's change"]


def _table_line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def directions_markdown(checks: list[dict]) -> list[str]:
    """A Markdown table of the direction checks: our change, paired by seed and unpaired, beside the paper's."""
    if not checks:
        return []
    lines = [_table_line(_DIRECTIONS_HEAD), "|" + "---|" * len(_DIRECTIONS_HEAD)]
    f = format_number
    for c in checks:
        pct = "-" if c["ours_change_pct"] is None else f"{c['ours_change_pct']:+.1f}%"
        ppct = "-" if c["paper_change_pct"] is None else f"{c['paper_change_pct']:+.1f}%"
        two_se = "-" if c["ours_uncertainty"] is None else f"±{f(2 * c['ours_uncertainty'], 2)}"
        lines.append(_table_line([
            f"{c['compared']} vs {c['reference']}", c["partition"], metric_title(c["metric"]),
            f"{f(c['ours_reference'])} → {f(c['ours_compared'])}", pct, ci_text(c), two_se, ppct, c["effect"],
            c["verdict"],
            c.get("unpaired_verdict", c["verdict"]), seeds_cell(c)]))
    return lines


def _values_table(spec, rows) -> list[str]:
    metrics = list(spec.metrics)
    head = ["method", "partition", "model"] + [f"{metric_title(m)} {who}" for m in metrics
                                               for who in ("ours", "paper")] + ["settings", "runs"]
    lines = [_table_line(head), "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.method, r.partition, r.model or "-"]
        for m in metrics:
            p = r.cells[m].paper
            cells.append(f"{cell_text(r.cells[m])} | {format_number(p) if p is not None else '-'}")
        cells.append("; ".join(f"{label}: {text}" for label, text in setting_parts(
            metrics, lambda m: r.cells[m].setting if m in r.cells else None)) or "-")
        cells.append(str(r.n_runs))
        lines.append(_table_line(cells))
    return lines


def _table_section(result, ours_scale: str) -> list[str]:
    spec, diff = result.spec, result.difference
    lines = [f"## {spec.title}", "", spec.paper_scale, ""] + ([ours_scale + "; " + diff, ""] if diff else []) + [
        f"Every row measures one model: the {MODEL_NAMES[result.model]} (accuracy and Hessian alike). Ours: mean "
        "±sd over seeds (n), or for one run ±the estimator's own error (est.); no direction verdict with "
        "fewer than 2 seeds a side.", ""]
    lines += _values_table(spec, result.rows)
    lines.append("")
    lines += [f"- {counts_line(metric, c)}" for metric, c in result.counts.items()]
    lines += ["", "Direction of each change (paired: compared - reference per seed, mean and 95% t interval with "
              "k - 1 degrees of freedom; effect: lower or higher where the interval the verdict is judged from "
              "excludes 0, else unresolved; verdict: whether a resolved change points the paper's way, 'no paper "
              "value' where the paper gives none; seeds for the paper's change: the smallest n with "
              "t(0.975, n-1) * sd / sqrt(n) < |paper's relative change x our reference|):", ""]
    lines += directions_markdown(result.checks)
    lines += ["", "Findings:", ""] + [f"- {f}" for f in result.findings]
    lines += [f"- note: {n}" for n in list(spec.notes) + incomparable_notes(spec, result.rows)]
    return lines + [""]


def report_markdown(results, ours_scale: str, missing: list[str], notices: list[str]) -> str:
    """The whole of report.md; ``results``: one :class:`.results.TableResult` per layout."""
    lines = ["# flatfl report", "", f"**{HEADLINE_TITLE}.** " + " ".join(report_headline(results)), "", ours_scale, ""]
    if notices:
        lines += ["## Notices", ""] + [f"- {n}" for n in notices] + [""]
    for result in results:
        lines += _table_section(result, ours_scale)
    if missing:
        lines += ["## Missing", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)
