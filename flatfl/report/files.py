"""The report's CSV files and summary.json: their records and columns.

* ``runs.csv``: one line per run (:func:`run_rows`; of the metrics, those whose registry entry asks for it);
* ``<table>.csv``: one line per (method, partition): the row's columns (:class:`.tables.TableRow`'s fields up to
  ``training``), then per metric ``ours_<metric>_left_out``, ``ours_<metric>``, ``_n``, ``_sd``, ``_se``,
  ``_setting``, ``_mark`` and ``paper_<metric>`` (:func:`table_csv`);
* ``directions.csv``: the direction checks (:data:`.verdicts.DIRECTION_COLUMNS`; :func:`directions_csv`);
* ``summary.json``: the counts, notices, what is missing, the pages, how the runs differ from the paper's setting and
  how each table row's runs were trained (``training``: per table, each row's method, partition and the settings that
  decide its runs' numbers, as text; what ``flatfl contrast`` compares) (:func:`summary`).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ..utils.io import csv_text
from .experiments import shown_value
from .metrics import measured_metrics, metric_names, report_metric
from .run_reader import MODEL_NAMES
from .tables import MetricCell, TableRow

__all__ = ["ROW_COLUMNS", "FOLDER_COLUMNS", "metric_columns", "table_csv", "directions_csv", "run_rows", "shown_path",
           "summary"]

#: a table row's own columns, in order
ROW_COLUMNS = tuple(f.name for f in fields(TableRow))[:[f.name for f in fields(TableRow)].index("training")]
_DIRECTIONS_WITHOUT_CHECKS = ["table", "partition", "reference", "compared", "metric"]


def metric_columns(metric: str, cell: MetricCell) -> dict:
    """One metric's columns of a table row, in order."""
    return {f"ours_{metric}_left_out": cell.left_out, f"ours_{metric}": cell.mean, f"ours_{metric}_n": cell.n,
            f"ours_{metric}_sd": cell.sd, f"ours_{metric}_se": cell.se, f"ours_{metric}_setting": cell.setting,
            f"ours_{metric}_mark": cell.mark, f"paper_{metric}": cell.paper}


def _table_record(row: TableRow) -> dict:
    out = {k: getattr(row, k) for k in ROW_COLUMNS}
    for metric, cell in row.cells.items():
        out.update(metric_columns(metric, cell))
    return out


def table_csv(rows: list[TableRow]) -> str:
    """A layout's CSV text."""
    records = [_table_record(r) for r in rows]
    return csv_text(records, list(records[0]) if records else None)


def directions_csv(checks: list[dict]) -> str:
    """directions.csv's text: every check of every layout (a header only when there is none)."""
    return csv_text(checks, list(checks[0]) if checks else _DIRECTIONS_WITHOUT_CHECKS)


def shown_path(path) -> str:
    """A run folder as the tables show it: relative to the current folder when inside it (so that a report made by
    the same command in another clone is the same file), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _metric_values(record, names) -> dict:
    """A run's columns of the metrics ``names`` that runs.csv carries (each registry entry's ``runs_csv``):
    ``<name>`` its value, ``<name>_stderr`` its estimator's own error, ``<name>_setting``, in the registry's order."""
    out = {}
    for name in names:
        parts = report_metric(name).runs_csv
        if "value" in parts:
            out[name] = record.value(name)
        if "error" in parts:
            out[f"{name}_stderr"] = record.stderr(name)
        if "setting" in parts:
            out[f"{name}_setting"] = record.setting(name)
    return out


#: runs.csv's columns that only a run folder gives (its config and analyses' files); a record read from a runs.csv
#: (:mod:`.runs_csv`) holds them as that file recorded them (``recorded``)
FOLDER_COLUMNS = ("hessian_dir", "model", "clients", "rounds", "rounds_done", "num_eigenvalues", "density",
                  "hessian_method", "trace_method", "hessian_samples", "hessian_samples_asked", "clients_protocol",
                  "run_dir")


#: runs.csv's columns of every run that a runs.csv must have to be read (:mod:`.runs_csv`)
RUN_COLUMNS = ("run", "method", "partition", "dataset", "seed", "hessian_model", "finished", "test_acc",
               "all_test_acc")
#: runs.csv's columns of every run, beside the metrics' (:func:`run_rows`)
FIXED_COLUMNS = RUN_COLUMNS + FOLDER_COLUMNS


def _folder_columns(r) -> dict:
    h = r.hessian or {}
    s = h.get("settings") or {}
    return {"hessian_dir": r.hessian_dir,
            "model": getattr(r, "network_label", None) or r.config.get("model") or "default",
            "clients": r.config.get("clients"), "rounds": r.config.get("rounds"), "rounds_done": r.rounds_done,
            "num_eigenvalues": len(h.get("top_eigenvalues") or []), "density": bool(h.get("density")),
            "hessian_method": s.get("method"), "trace_method": s.get("trace_method"),
            "hessian_samples": h.get("num_samples"), "hessian_samples_asked": s.get("samples"),
            "clients_protocol": (r.clients or {}).get("protocol"), "run_dir": shown_path(r.run_dir)}


def run_rows(records) -> list[dict]:
    """runs.csv's lines: each run's values with the settings that made them."""
    # a metric computed only when asked (the smallest eigenvalue) has columns where a run measured it
    measured = measured_metrics(records)
    names = [n for n in metric_names() if not report_metric(n).when_measured or n in measured]
    rows = []
    for r in records:
        recorded = getattr(r, "recorded", None)
        f = recorded if isinstance(recorded, dict) else _folder_columns(r)
        rows.append({
            "run": r.name, "method": r.method, "partition": r.partition, "dataset": r.dataset, "seed": r.seed,
            "hessian_model": MODEL_NAMES[r.model], "hessian_dir": f["hessian_dir"], "model": f["model"],
            "clients": f["clients"], "rounds": f["rounds"], "rounds_done": f["rounds_done"], "finished": r.finished,
            "test_acc": r.accuracy("test_acc"), "all_test_acc": r.accuracy("all_test_acc"),
            **_metric_values(r, names),
            **{k: f[k] for k in FOLDER_COLUMNS[FOLDER_COLUMNS.index("num_eigenvalues"):]},
        })
    return rows


def summary(records, specs, results, *, notices, missing, pages, files, ours_scale) -> dict:
    """summary.json's content (also what :func:`.build.build_report` returns)."""
    return {"runs": len(records), "tables": [s.key for s in specs],
            "directions": {t.spec.key: t.counts for t in results},
            "models": {t.spec.key: t.model for t in results}, "notices": notices,
            "missing": missing, "pages": pages, "files": files + ["summary.json"],
            "ours_scale": ours_scale, "differences_from_paper": {t.spec.key: t.difference for t in results},
            "training": {t.spec.key: [_training(r) for r in t.rows if isinstance(r.training, dict)] for t in results}}


def _training(row: TableRow) -> dict:
    """A row's training settings as summary.json keeps them: each value as messages show it (text)."""
    return {"method": row.method, "partition": row.partition,
            "settings": {k: shown_value(v) for k, v in sorted(row.training.items())}}
