"""The contrast's headline figure: its comparisons as a forest plot, one panel per table, metric and report, the
reports of a metric side by side (``effects.png`` / ``effects.pdf`` in the contrast's folder).

Each line is one comparison of one report (:func:`.contrast.contrast_rows`): the change in % of the reference over
the seeds of its paired 95% interval, with that interval, and the paper's change where it has one. The lines keep
the comparisons' order in every panel, so that a comparison sits at the same height in each report's panel; its
effect (lower / higher where the interval excludes 0, else unresolved) colours it as in a report's own forest plot.
Under the title, each report's headline (:func:`.headline.contrast_headline`).
"""
from __future__ import annotations

from ..paper_tables import TABLES
from .forest import forest_page
from .headline import contrast_headline
from .metrics import metric_names, report_metric

__all__ = ["contrast_items", "contrast_figure"]


def _effect(row: dict) -> str:
    low, high = row.get("ci_low_pct"), row.get("ci_high_pct")
    if low is None or high is None:
        return "unresolved"
    return "lower" if high < 0 else "higher" if low > 0 else "unresolved"


def contrast_items(rows: list[dict], partitions: int) -> list[dict]:
    """One panel's lines (:func:`.forest.forest_items`' keys) from one report's contrast rows, in their order."""
    items = []
    for r in rows:
        where = f" ({r['partition'].replace('dirichlet-', 'Dir ')})" if partitions > 1 else ""
        paired = r.get("ci_low_pct") is not None and r.get("ci_high_pct") is not None
        items.append({"label": f"{r['compared']} vs {r['reference']}{where}", "effect": _effect(r),
                      "change": r.get("ours_change_pct"), "low": r.get("ci_low_pct") if paired else None,
                      "high": r.get("ci_high_pct") if paired else None, "how": "paired" if paired else "none",
                      "paper": r.get("paper_change_pct")})
    return items


def _title(table: str, metric: str, label: str) -> str:
    name = TABLES[table].title.split(":")[0] if table in TABLES else table
    what = report_metric(metric).label if metric in metric_names() else metric
    return f"{name}, {what}: {label}"


def contrast_figure(rows: list[dict], labels: list[str], subtitle: str = ""):
    """The forest plot of the contrast ``rows`` (every report's line of each comparison), one A4 landscape page:
    a row of panels per table and metric, one panel per report (in ``labels``' order)."""
    page = []
    for table in dict.fromkeys(r["table"] for r in rows):
        of_table = [r for r in rows if r["table"] == table]
        partitions = len({r["partition"] for r in of_table})
        for metric in dict.fromkeys(r["metric"] for r in of_table):
            panels = [(_title(table, metric, label),
                       contrast_items([r for r in of_table if r["metric"] == metric and r["report"] == label],
                                      partitions)) for label in labels]
            page.append(("", panels))
    return forest_page(page, subtitle, "each comparison at the same height in every report's panel",
                       columns=len(labels), apart=False, headline=contrast_headline(rows, labels))
