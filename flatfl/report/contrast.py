"""Two or more reports of one paper table side by side: the same rows and comparisons (X vs X+MAN, per partition
and metric) measured under other conditions, e.g. an MLP and a CNN on one dataset (``flatfl contrast``).

Reads what :func:`flatfl.report.build_report` wrote into each report folder (``summary.json`` for its scale line
and tables, each table's CSV for the rows' values, ``directions.csv`` for the checks) and writes ``contrast.csv``
(one row per comparison and report), ``contrast.md`` (each report's headline, :mod:`.headline`, then the values
side by side, a table per metric of the changes, and per metric the verdict counts and where the reports resolve a
change the same or opposite ways, every sentence built from the numbers), ``contrast.json`` and ``effects.png``.
Nothing is recomputed: each report's own numbers.

* A change and its interval are of the same seeds: where a report has a paired interval (two or more seeds shared
  by both rows), the change shown is the mean per-seed difference over those seeds (``paired_change``), in % of the
  reference's mean, beside the interval; the change of the means over all seeds is kept as
  ``all_seeds_change_pct`` (and shown where it differs). Without an interval the change is that of the means.
* Each report's model and analysis settings are shown (summary.json's ``models``, the tables' ``ours_<metric>_setting``
  columns, runs.csv's data set and network), since reports of other settings are what a contrast sets side by side.
* How the reports' runs were trained differently (:mod:`.contrast_settings`): for each row the reports share, the settings that decide its
  runs' numbers (summary.json's ``training``) are compared, and every setting in which the reports differ is named
  with each report's value (``settings_that_differ``: 'lr 0.1 (A) vs 0.05 (B)'); for reports without that record,
  from how each differs from the paper's setting (summary.json's ``differences_from_paper``). Each report's seeds are
  listed (runs.csv).
* An 'incomparable' verdict is counted as such, with the report's reason (directions.csv's ``incomparable_because``).
* A comparison that some reports do not hold is listed as dropped (``dropped``), with the reports that hold it.
* One report given twice (the same folder under two paths, or two copies with the same summary.json and
  directions.csv) is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..utils.io import atomic_write_many, csv_text
from ..utils.lock import folder_lock
from ..utils.plots import format_number, saved
from . import folder_kinds
from .contrast_figure import contrast_figure
from .contrast_settings import settings_differ_line, settings_that_differ
from .headline import HEADLINE_TITLE, contrast_headline
from .metrics import metric_title
from .report_folder import KEY as _KEY, MAX_FILE_BYTES, read_report
from .verdicts import NO_PAPER_VALUE, TOO_FEW_SEEDS, VERDICTS

__all__ = ["read_report", "contrast_rows", "write_contrast", "settings_that_differ", "MAX_FILE_BYTES"]

_JUDGED = ("agree", "disagree", "inconclusive", NO_PAPER_VALUE)  # the checks whose interval is read


def _relative(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else 100.0 * value / abs(reference)


def _paired_change(c: dict) -> float | None:
    """The mean per-seed difference over the seeds of the paired interval: directions.csv's ``paired_change``, else
    (a report without the column) the interval's midpoint, which a t interval is centred on; None without one."""
    if c["paired_ci_low"] is None or c["paired_ci_high"] is None:
        return None
    if c.get("paired_change") is not None:
        return c["paired_change"]
    return (c["paired_ci_low"] + c["paired_ci_high"]) / 2


def contrast_rows(reports: list[dict], labels: list[str]) -> list[dict]:
    """One row per comparison every report holds and per report, in the first report's order: the label, both
    values, the change in % of the reference over the seeds of its interval (``change_over``), its paired 95%
    interval in % (None without one), the change of the means over all seeds, the verdict and the paper's
    change."""
    keyed = [{tuple(c[k] for k in _KEY): c for c in r["checks"]} for r in reports]
    common = [k for k in keyed[0] if all(k in other for other in keyed[1:])]
    rows = []
    for key in common:
        for label, checks in zip(labels, keyed):
            c = checks[key]
            paired = _paired_change(c)
            rows.append(dict(zip(_KEY, key), report=label, ours_reference=c["ours_reference"],
                             ours_compared=c["ours_compared"],
                             ours_change_pct=(c["ours_change_pct"] if paired is None
                                              else _relative(paired, c["ours_reference"])),
                             change_over=("all seeds (no paired interval)" if paired is None
                                          else f"{c['paired_seeds']} shared seeds"),
                             ci_low_pct=_relative(c["paired_ci_low"], c["ours_reference"]),
                             ci_high_pct=_relative(c["paired_ci_high"], c["ours_reference"]),
                             all_seeds_change_pct=c["ours_change_pct"],
                             paired_seeds=c["paired_seeds"], verdict=c["verdict"],
                             paper_change_pct=c["paper_change_pct"],
                             incomparable_because=c.get("incomparable_because") or ""))
    return rows


def dropped_comparisons(reports: list[dict], labels: list[str]) -> list[dict]:
    """The comparisons some reports hold and others not (left out), in order, each with the labels holding it."""
    keyed = [{tuple(c[k] for k in _KEY) for c in r["checks"]} for r in reports]
    every = list(dict.fromkeys(k for r in reports for k in (tuple(c[k] for k in _KEY) for c in r["checks"])))
    return [dict(zip(_KEY, key), held_by=[label for label, keys in zip(labels, keyed) if key in keys])
            for key in every if not all(key in keys for keys in keyed)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _end(x: float) -> str:
    """An interval's end in %: one decimal, or two significant digits where one decimal would show 0.0."""
    return f"{x:+.1f}" if abs(x) >= 0.05 or x == 0 else f"{x:+.2g}"


def _cell(row: dict) -> str:
    interval = ("" if row["ci_low_pct"] is None else
                f" [{_end(row['ci_low_pct'])}, {_end(row['ci_high_pct'])}]")
    every = _pct(row.get("all_seeds_change_pct", row["ours_change_pct"]))
    also = f" (all seeds {every})" if every != _pct(row["ours_change_pct"]) else ""
    return f"{_pct(row['ours_change_pct'])}{interval} {row['verdict']}{also}"


def _counts(rows: list[dict], label: str, metric: str) -> dict:
    mine = [r for r in rows if r["report"] == label and r["metric"] == metric]
    out = {v: sum(r["verdict"] == v for r in mine) for v in VERDICTS}
    out["compared"] = len(mine)
    out["incomparable_because"] = list(dict.fromkeys(r.get("incomparable_because") or "not given" for r in mine
                                                     if r["verdict"] == "incomparable"))
    return out


def _direction(row: dict) -> int | None:
    """+1 / -1 for a change resolved by its paired interval, else None."""
    if row["ci_low_pct"] is None or row["verdict"] not in _JUDGED:
        return None
    if row["ci_low_pct"] > 0:
        return 1
    if row["ci_high_pct"] < 0:
        return -1
    return None


def _by_comparison(rows: list[dict], metric: str) -> dict[tuple, dict]:
    """The rows of ``metric`` by comparison (table, partition, pair, metric), each as {report label: row}."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["metric"] == metric:
            out.setdefault(tuple(r[k] for k in _KEY), {})[r["report"]] = r
    return out


def _paragraph(rows: list[dict], labels: list[str], metrics: list[str]) -> list[str]:
    """What the reports show together, per metric: each report's verdicts, and where two reports resolve the same
    comparison in opposite directions (or the same one)."""
    out = []
    for metric in metrics:
        name = metric_title(metric)
        parts = []
        for label in labels:
            c = _counts(rows, label, metric)
            part = f"{label} {c['agree']} agree, {c['disagree']} disagree, {c['inconclusive']} inconclusive"
            if c[NO_PAPER_VALUE]:
                part += f", {c[NO_PAPER_VALUE]} without a paper value"
            if c[TOO_FEW_SEEDS]:
                part += f", {c[TOO_FEW_SEEDS]} without a verdict (too few seeds)"
            if c["incomparable"]:
                because = c["incomparable_because"]
                part += (f", {c['incomparable']} incomparable ({'; '.join(because[:3])}"
                         + (f"; {len(because) - 3} other reasons" if len(because) > 3 else "") + ")")
            parts.append(part)
        n = _counts(rows, labels[0], metric)["compared"]
        sentence = f"{name}, verdicts on the paper's direction in {n} comparisons: " + "; ".join(parts) + "."
        by_key = _by_comparison(rows, metric)
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                both = [(_direction(g[a]), _direction(g[b])) for g in by_key.values()]
                resolved = [(x, y) for x, y in both if x is not None and y is not None]
                opposite = sum(x != y for x, y in resolved)
                sentence += (f" {a} and {b} both resolve (95% paired interval excluding 0) {len(resolved)} of "
                             f"{len(both)} changes: "
                             f"{len(resolved) - opposite} the same way, {opposite} opposite ways.")
        out.append(sentence)
    return out


def settings_lines(report: dict) -> list[str]:
    """What a report's numbers were made with, as lines: the data set, network and seeds of its runs, the model each
    table measures, and per metric the settings its values were computed with."""
    out = []
    if report.get("runs"):
        out.append("runs: " + "; ".join(f"{k} {', '.join(v)}" for k, v in report["runs"].items() if v))
    if report.get("models"):
        out.append("model: " + "; ".join(f"{t} {m}" for t, m in report["models"].items()))
    for metric, settings in (report.get("settings") or {}).items():
        if settings:
            out.append(f"{metric_title(metric)}: {' | '.join(settings)}")
    return out


def _markdown(reports: list[dict], labels: list[str], rows: list[dict], metrics: list[str], together: list[str],
              dropped: list[dict] = (), differ: str = "") -> str:
    lines = ["# flatfl contrast", "", f"**{HEADLINE_TITLE}.** " + " ".join(contrast_headline(rows, labels)), ""]
    for label, r in zip(labels, reports):
        lines.append(f"- **{label}** ({r['folder']}): {r['scale']}")
        lines += [f"  - {line}" for line in settings_lines(r)]
    if differ:
        lines.append(f"- {differ}")
    lines += ["", "Each cell: the change compared - reference in % of the reference, over the seeds of its paired 95% "
              "t interval where the report has one (then the interval; the change of the means over all seeds in "
              "parentheses where it differs), else the change of the means, and that report's verdict on the "
              "paper's direction. Nothing is recomputed here: each report's numbers are its own.", ""]
    lines += ["## What the reports show together", ""]
    lines += [f"- {s}" for s in together]
    if dropped:
        lines += ["", "## Comparisons not in every report (dropped)", "",
                  "| table | comparison | partition | metric | held by |", "|---|---|---|---|---|"]
        lines += [f"| {d['table']} | {d['compared']} vs {d['reference']} | {d['partition']} | {d['metric']} | "
                  f"{', '.join(d['held_by'])} |" for d in dropped]
    lines += _values_markdown(reports, labels)
    for metric in metrics:
        lines += ["", f"## {metric_title(metric)}", "",
                  "| table | comparison | partition | paper | " + " | ".join(labels) + " |",
                  "|---|---|---|---|" + "---|" * len(labels)]
        for key, g in _by_comparison(rows, metric).items():
            first = g[labels[0]]
            lines.append(f"| {key[0]} | {key[3]} vs {key[2]} | {key[1]} | {_pct(first['paper_change_pct'])} | "
                         + " | ".join(_cell(g[label]) for label in labels) + " |")
    return "\n".join(lines) + "\n"


def _value_cell(value: tuple | None) -> str:
    if value is None or value[0] is None:
        return "-"
    mean, sd, n, _ = value
    return format_number(mean) + ("" if sd is None or not n or n < 2 else f" ±{format_number(sd, 2)} (n={n})")


def _values_markdown(reports: list[dict], labels: list[str]) -> list[str]:
    """Each table's rows that every report holds: per metric each report's mean ±sd over seeds, and the paper's."""
    keys = [k for k in reports[0]["values"] if all(k in r["values"] for r in reports[1:])]
    lines = []
    for table in dict.fromkeys(k[0] for k in keys):
        rows = [k for k in keys if k[0] == table]
        metrics = [m for m in reports[0]["values"][rows[0]] if all(m in r["values"][k] for r in reports for k in rows)]
        if not metrics:
            continue
        head = ["method", "partition"] + [f"{metric_title(m)} {x}" for m in metrics for x in labels + ["paper"]]
        lines += ["", f"## Values: {table}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for k in rows:
            cells = [k[1], k[2]]
            for m in metrics:
                cells += [_value_cell(r["values"][k][m]) for r in reports]
                paper = reports[0]["values"][k][m][3]
                cells.append("-" if paper is None else format_number(paper))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


_CSV_COLUMNS = list(_KEY) + ["report", "ours_reference", "ours_compared", "ours_change_pct", "change_over",
                             "ci_low_pct", "ci_high_pct", "all_seeds_change_pct", "paired_seeds", "verdict",
                             "paper_change_pct", "incomparable_because"]


def write_contrast(folders, out, labels=None) -> dict:
    """Read the report ``folders`` (two or more), write contrast.csv, .md, .json and effects.png / .pdf (the forest
    plot, :mod:`.contrast_figure`) into ``out``; return the summary (``labels``: one per report, default folders)."""
    given = [str(f) for f in folders]
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise ConfigError("flatfl contrast needs two or more report folders")
    seen: dict[Path, str] = {}
    for text, folder in zip(given, folders):
        where = folder.resolve()
        if where in seen:
            raise ConfigError(f"{seen[where]} and {text} are the same report: give each report once")
        seen[where] = text
    folder_kinds.refuse_other(out, folder_kinds.CONTRAST)  # a report's forest plot is never replaced
    labels = [f.name for f in folders] if not labels else [str(x) for x in labels]
    if len(labels) != len(folders):
        raise ConfigError(f"{len(labels)} --label for {len(folders)} reports: give one per report, in order")
    bad = [x for x in labels if not x.strip() or "|" in x or "\n" in x or len(x) > 60]
    if bad or len(set(labels)) != len(labels):
        raise ConfigError(f"labels must be distinct, non-empty, at most 60 characters and without '|': {labels!r}")
    reports = [read_report(f) for f in folders]
    for i, r in enumerate(reports):
        twin = next((given[j] for j in range(i) if reports[j]["digest"] == r["digest"]), None)
        if twin is not None:
            raise ConfigError(f"{twin} and {given[i]} are the same report (identical summary.json and "
                              "directions.csv): give each report once")
    rows = contrast_rows(reports, labels)
    if not rows:
        raise ConfigError("these reports share no comparison (same table, partition, pair and metric)")
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    together = _paragraph(rows, labels, metrics)
    dropped = dropped_comparisons(reports, labels)
    differ, source = settings_that_differ(reports, labels)
    differ_line = settings_differ_line(differ, source)
    summary = {"reports": [{"label": label, "folder": r["folder"], "scale": r["scale"], "models": r["models"],
                            "settings": r["settings"], "runs": r["runs"]}
                           for label, r in zip(labels, reports)],
               "settings_that_differ": differ, "settings_read_from": source or None,
               "settings_line": differ_line,
               "comparisons": len(rows) // len(labels),
               "dropped": dropped,
               "counts": {label: {m: _counts(rows, label, m) for m in metrics} for label in labels},
               "together": together, "headline": contrast_headline(rows, labels),
               "files": ["contrast.csv", "contrast.md", "contrast.json", "effects.png", "effects.pdf"]}
    out = Path(out)
    with folder_lock(out):
        folder_kinds.refuse_other(out, folder_kinds.CONTRAST)  # again, under the folder's lock
        fig = contrast_figure(rows, labels)
        atomic_write_many({out / "effects.png": saved(fig, "png"), out / "effects.pdf": saved(fig, "pdf"),
                           out / "contrast.csv": csv_text(rows, _CSV_COLUMNS),
                           out / "contrast.md": _markdown(reports, labels, rows, metrics, together, dropped,
                                                              differ_line),
                           out / "contrast.json": json.dumps(summary, indent=2) + "\n"})
        folder_kinds.record(out, folder_kinds.CONTRAST)
    return summary
