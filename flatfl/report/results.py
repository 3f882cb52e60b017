"""One layout's results, what every renderer reads: its runs, rows, direction checks and their counts, how our
setting differs from the paper's, and the findings."""
from __future__ import annotations

from dataclasses import dataclass

from ..paper_tables import TableSpec
from .layouts import model_for, paper_differences, records_of
from .tables import TableRow, build_table
from .text import findings
from .verdicts import direction_checks, summary_counts

__all__ = ["TableResult", "table_result"]


@dataclass
class TableResult:
    spec: TableSpec
    model: str  # the model every row measures
    records: list  # the runs the layout takes
    rows: list[TableRow]
    checks: list[dict]  # direction checks (.verdicts)
    counts: dict  # metric -> verdict counts (.verdicts.summary_counts)
    difference: str | None  # how our setting differs from the paper's (.layouts.paper_differences)
    findings: list[str]


def table_result(spec: TableSpec, records, model: str | None, values: list[dict], only=None) -> TableResult:
    """Fill ``spec``'s layout from ``records`` (which already hold the analyses of the layout's model) and judge
    its comparisons; ``model``: the model asked for (None: the layout's default); ``values``: the papers';
    ``only``: the row labels to keep (a restricted reproduction; None: every row of the layout)."""
    mine = records_of(spec, records)
    rows = build_table(spec, mine, values)
    if only is not None:
        rows = [r for r in rows if r.method in only]
    checks = direction_checks(spec, rows)
    return TableResult(spec=spec, model=model_for(spec, model), records=mine, rows=rows, checks=checks,
                       counts=summary_counts(checks), difference=paper_differences(spec, mine),
                       findings=findings(spec, rows, checks, mine))
