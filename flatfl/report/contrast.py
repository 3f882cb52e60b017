"""Two or more reports of one paper table side by side: the same rows and comparisons (X vs X+MAN, per partition
and metric) measured under other conditions, e.g. an MLP and a CNN on one dataset (``flatfl contrast``).

Reads what :func:`flatfl.report.build_report` wrote into each report folder (``summary.json`` for its scale line
and tables, each table's CSV for the rows' values, ``directions.csv`` for the checks) and writes ``contrast.csv``
(one row per comparison and report), ``contrast.md`` (the values side by side, a table per metric of the changes,
and per metric the verdict counts and where the reports resolve a change the same or opposite ways, every sentence
built from the numbers) and ``contrast.json``. Nothing is recomputed: each report's numbers and verdicts are its own.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

from ..errors import ConfigError
from ..utils.io import atomic_write_many, csv_text
from ..utils.lock import folder_lock
from ..utils.plots import format_number
from .layouts import METRIC_NAMES
from .verdicts import TOO_FEW_SEEDS, VERDICTS

__all__ = ["read_report", "contrast_rows", "write_contrast", "MAX_FILE_BYTES"]

#: directions.csv and summary.json of a report are kilobytes; anything far larger is not one
MAX_FILE_BYTES = 20_000_000
_KEY = ("table", "partition", "reference", "compared", "metric")
_NUMBERS = ("ours_reference", "ours_compared", "ours_change_pct", "paper_change_pct", "paired_ci_low",
            "paired_ci_high")
_NEEDED = _KEY + _NUMBERS + ("verdict", "paired_seeds")
_JUDGED = ("agree", "disagree", "inconclusive")
_TABLE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,60}")


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"{path.parent} is not a flatfl report folder: it has no {path.name} "
                          "(make one with flatfl report or flatfl reproduce)")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes, more than a report's {MAX_FILE_BYTES:,}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def _csv_rows(path: Path, needed, what: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """A report CSV's header and its rows with their line numbers; a missing column or a short or long row is one
    ConfigError line."""
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    fields = reader.fieldnames or []
    missing = [c for c in needed if c not in fields]
    if missing:
        raise ConfigError(f"{path}: not a flatfl {what} (no column {', '.join(missing)})")
    rows = []
    for line, row in enumerate(reader, start=2):
        if None in row or any(v is None for v in row.values()):
            raise ConfigError(f"{path} line {line}: not as many fields as the header")
        rows.append((line, row))
    return fields, rows


def _number(path: Path, line: int, column: str, text: str) -> float | None:
    if text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{path} line {line}: {column} is not a number: {text[:40]!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{path} line {line}: {column} is not finite: {text[:40]!r}")
    return value


def read_report(folder: str | Path) -> dict:
    """One report folder: ``{"folder", "scale", "tables", "checks", "values"}``, the checks being directions.csv's rows
    with their numbers parsed, the values its tables' rows (:func:`_read_values`); a folder that is not a report, or
    a file that is not what flatfl writes there, is one ConfigError line naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder (give report folders, e.g. reports/man-tables-quick)")
    summary_path = folder / "summary.json"
    try:
        summary = json.loads(_read_text(summary_path))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{summary_path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("ours_scale"), str) \
            or not isinstance(summary.get("tables"), list) \
            or not all(isinstance(t, str) for t in summary["tables"]):
        raise ConfigError(f"{summary_path}: not a flatfl report summary (no 'ours_scale' text or 'tables' list)")
    path = folder / "directions.csv"
    checks, seen = [], set()
    for line, row in _csv_rows(path, _NEEDED, "directions table")[1]:
        key = tuple(row[k] for k in _KEY)
        if key in seen:
            raise ConfigError(f"{path} line {line}: {' / '.join(key)} appears twice")
        seen.add(key)
        if row["verdict"] not in VERDICTS:
            raise ConfigError(f"{path} line {line}: unknown verdict {row['verdict'][:40]!r}; "
                              f"one of {', '.join(VERDICTS)}")
        check = {k: row[k] for k in _KEY + ("verdict",)}
        check.update({k: _number(path, line, k, row[k]) for k in _NUMBERS})
        seeds = _number(path, line, "paired_seeds", row["paired_seeds"])
        if seeds is not None and (seeds < 0 or seeds != int(seeds)):
            raise ConfigError(f"{path} line {line}: paired_seeds must be a count, got {row['paired_seeds'][:40]!r}")
        check["paired_seeds"] = None if seeds is None else int(seeds)
        checks.append(check)
    return {"folder": str(folder), "scale": summary["ours_scale"], "tables": list(summary["tables"]),
            "checks": checks, "values": _read_values(folder, summary["tables"])}


def _read_values(folder: Path, tables: list[str]) -> dict:
    """(table, method, partition) -> {metric: (mean, sd, n, paper)} from each table's CSV (``<table>.csv``), for the
    metrics it has."""
    out = {}
    for table in tables:
        if not _TABLE_NAME.fullmatch(table):
            raise ConfigError(f"{folder / 'summary.json'}: {table[:40]!r} is not a table name")
        path = folder / f"{table}.csv"
        fields, rows = _csv_rows(path, ("method", "partition"), "table")
        metrics = [m for m in dict.fromkeys(f[len("ours_"):] for f in fields) if m in METRIC_NAMES]  # CSV order
        for line, row in rows:
            values = {}
            for m in metrics:
                n = _number(path, line, f"ours_{m}_n", row.get(f"ours_{m}_n", ""))
                values[m] = (_number(path, line, f"ours_{m}", row[f"ours_{m}"]),
                             _number(path, line, f"ours_{m}_sd", row.get(f"ours_{m}_sd", "")),
                             None if n is None else int(n),
                             _number(path, line, f"paper_{m}", row.get(f"paper_{m}", "")))
            out[(table, row["method"], row["partition"])] = values
    return out


def _relative(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else 100.0 * value / abs(reference)


def contrast_rows(reports: list[dict], labels: list[str]) -> list[dict]:
    """One row per comparison every report holds and per report, in the first report's order: the label, both
    values, the change in % of the reference, its paired 95% interval in % (None without one), the verdict and the
    paper's change."""
    keyed = [{tuple(c[k] for k in _KEY): c for c in r["checks"]} for r in reports]
    common = [k for k in keyed[0] if all(k in other for other in keyed[1:])]
    rows = []
    for key in common:
        for label, checks in zip(labels, keyed):
            c = checks[key]
            rows.append(dict(zip(_KEY, key), report=label, ours_reference=c["ours_reference"],
                             ours_compared=c["ours_compared"], ours_change_pct=c["ours_change_pct"],
                             ci_low_pct=_relative(c["paired_ci_low"], c["ours_reference"]),
                             ci_high_pct=_relative(c["paired_ci_high"], c["ours_reference"]),
                             paired_seeds=c["paired_seeds"], verdict=c["verdict"],
                             paper_change_pct=c["paper_change_pct"]))
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _end(x: float) -> str:
    """An interval's end in %: one decimal, or two significant digits where one decimal would show 0.0."""
    return f"{x:+.1f}" if abs(x) >= 0.05 or x == 0 else f"{x:+.2g}"


def _cell(row: dict) -> str:
    interval = ("" if row["ci_low_pct"] is None else
                f" [{_end(row['ci_low_pct'])}, {_end(row['ci_high_pct'])}]")
    return f"{_pct(row['ours_change_pct'])}{interval} {row['verdict']}"


def _counts(rows: list[dict], label: str, metric: str) -> dict:
    mine = [r for r in rows if r["report"] == label and r["metric"] == metric]
    out = {v: sum(r["verdict"] == v for r in mine) for v in VERDICTS}
    out["compared"] = len(mine)
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
        name = METRIC_NAMES.get(metric, metric)
        parts = []
        for label in labels:
            c = _counts(rows, label, metric)
            part = f"{label} {c['agree']} agree, {c['disagree']} disagree, {c['inconclusive']} inconclusive"
            if c[TOO_FEW_SEEDS] or c["incomparable"]:
                part += f", {c[TOO_FEW_SEEDS] + c['incomparable']} without a verdict"
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


def _markdown(reports: list[dict], labels: list[str], rows: list[dict], metrics: list[str], together: list[str]) -> str:
    lines = ["# flatfl contrast", ""]
    lines += [f"- **{label}** ({r['folder']}): {r['scale']}" for label, r in zip(labels, reports)]
    lines += ["", "Each cell: the change compared - reference in % of the reference, its paired 95% t interval over "
              "seeds (where the report has one), and that report's verdict on the paper's direction. Nothing is "
              "recomputed here: each report's numbers are its own.", ""]
    lines += ["## What the reports show together", ""]
    lines += [f"- {s}" for s in together]
    lines += _values_markdown(reports, labels)
    for metric in metrics:
        lines += ["", f"## {METRIC_NAMES.get(metric, metric)}", "",
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
        head = ["method", "partition"] + [f"{METRIC_NAMES[m]} {x}" for m in metrics for x in labels + ["paper"]]
        lines += ["", f"## Values: {table}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for k in rows:
            cells = [k[1], k[2]]
            for m in metrics:
                cells += [_value_cell(r["values"][k][m]) for r in reports]
                paper = reports[0]["values"][k][m][3]
                cells.append("-" if paper is None else format_number(paper))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


_CSV_COLUMNS = list(_KEY) + ["report", "ours_reference", "ours_compared", "ours_change_pct", "ci_low_pct",
                             "ci_high_pct", "paired_seeds", "verdict", "paper_change_pct"]


def write_contrast(folders, out, labels=None) -> dict:
    """Read the report ``folders`` (two or more), write contrast.csv, contrast.md and contrast.json into ``out`` and
    return the summary (``labels``: one name per report, default the folder names)."""
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise ConfigError("flatfl contrast needs two or more report folders")
    labels = [f.name for f in folders] if not labels else [str(x) for x in labels]
    if len(labels) != len(folders):
        raise ConfigError(f"{len(labels)} --label for {len(folders)} reports: give one per report, in order")
    bad = [x for x in labels if not x.strip() or "|" in x or "\n" in x or len(x) > 60]
    if bad or len(set(labels)) != len(labels):
        raise ConfigError(f"labels must be distinct, non-empty, at most 60 characters and without '|': {labels!r}")
    reports = [read_report(f) for f in folders]
    rows = contrast_rows(reports, labels)
    if not rows:
        raise ConfigError("these reports share no comparison (same table, partition, pair and metric)")
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    together = _paragraph(rows, labels, metrics)
    summary = {"reports": [{"label": label, "folder": r["folder"], "scale": r["scale"]}
                           for label, r in zip(labels, reports)],
               "comparisons": len(rows) // len(labels),
               "counts": {label: {m: _counts(rows, label, m) for m in metrics} for label in labels},
               "together": together,
               "files": ["contrast.csv", "contrast.md", "contrast.json"]}
    out = Path(out)
    with folder_lock(out):
        atomic_write_many({out / "contrast.csv": csv_text(rows, _CSV_COLUMNS),
                           out / "contrast.md": _markdown(reports, labels, rows, metrics, together),
                           out / "contrast.json": json.dumps(summary, indent=2) + "\n"})
    return summary
