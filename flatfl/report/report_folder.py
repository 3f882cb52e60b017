"""A report folder read for ``flatfl contrast`` (:mod:`.contrast`): what :func:`flatfl.report.build_report` wrote
there (``summary.json``, ``directions.csv``, each table's CSV, ``runs.csv``), every file checked to be what flatfl
writes (sizes, columns, numbers, verdicts; CSV fields and JSON nesting bounded, :mod:`.bounded`), anything else one
ConfigError line naming the file.

Besides the numbers, what the contrast shows of how each report's runs were trained: summary.json's ``training``
(per table row, the settings that decide its runs' numbers, as :func:`flatfl.report.files.summary` writes them; absent
from reports that do not record it), its ``differences_from_paper`` and runs.csv's data sets, networks and seeds.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..errors import ConfigError
from ..paper_tables import TABLES
from .bounded import csv_rows, finite_number, loads, read_text
from .metrics import metric_names
from .verdicts import VERDICTS

__all__ = ["read_report", "MAX_FILE_BYTES", "KEY"]

#: directions.csv and summary.json of a report are kilobytes; anything far larger is not one
MAX_FILE_BYTES = 20_000_000
KEY = ("table", "partition", "reference", "compared", "metric")
_NUMBERS = ("ours_reference", "ours_compared", "ours_change_pct", "paper_change_pct", "paired_ci_low",
            "paired_ci_high")
_NEEDED = KEY + _NUMBERS + ("verdict", "paired_seeds")
_TABLE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,60}")
#: a report's rows and settings per row are tens; anything far larger is not what flatfl writes
_MAX_TRAINING_ROWS, _MAX_SETTINGS = 10_000, 500


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"{path.parent} is not a flatfl report folder: it has no {path.name} "
                          "(make one with flatfl report or flatfl reproduce)")
    return read_text(path, MAX_FILE_BYTES, f"a flatfl report's {path.name}")


def _csv_rows(path: Path, needed, what: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """A report CSV's header and its rows with their line numbers; a missing column or a short or long row is one
    ConfigError line."""
    fields, rows = csv_rows(_read_text(path), path)  # fields and nesting bounded (.bounded)
    missing = [c for c in needed if c not in fields]
    if missing:
        raise ConfigError(f"{path}: not a flatfl {what} (no column {', '.join(missing)})")
    for line, row in rows:
        if None in row or any(v is None for v in row.values()):
            raise ConfigError(f"{path} line {line}: not as many fields as the header")
    return fields, rows


def _number(path: Path, line: int, column: str, text: str) -> float | None:
    return finite_number(text, f"{path} line {line}: {column}")


def read_report(folder: str | Path) -> dict:
    """One report folder: ``{"folder", "scale", "tables", "checks", "values"}``, the checks being directions.csv's rows
    with their numbers parsed, the values its tables' rows (:func:`_read_values`); a folder that is not a report, or
    a file that is not what flatfl writes there, is one ConfigError line naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder (give report folders, e.g. reports/man-tables-quick)")
    summary_path = folder / "summary.json"
    summary_text = _read_text(summary_path)
    summary = loads(summary_text, summary_path)
    if not isinstance(summary, dict) or not isinstance(summary.get("ours_scale"), str) \
            or not isinstance(summary.get("tables"), list) \
            or not all(isinstance(t, str) for t in summary["tables"]):
        raise ConfigError(f"{summary_path}: not a flatfl report summary (no 'ours_scale' text or 'tables' list)")
    path = folder / "directions.csv"
    checks, seen = [], set()
    for line, row in _csv_rows(path, _NEEDED, "directions table")[1]:
        if row["table"] not in TABLES:
            raise ConfigError(f"{path} line {line}: {row['table'][:40]!r} is not a table flatfl knows "
                              "(damaged or not flatfl's)")
        key = tuple(row[k] for k in KEY)
        if key in seen:
            raise ConfigError(f"{path} line {line}: {' / '.join(key)} appears twice")
        seen.add(key)
        if row["verdict"] not in VERDICTS:
            raise ConfigError(f"{path} line {line}: unknown verdict {row['verdict'][:40]!r}; "
                              f"one of {', '.join(VERDICTS)}")
        check = {k: row[k] for k in KEY + ("verdict",)}
        check.update({k: _number(path, line, k, row[k]) for k in _NUMBERS})
        seeds = _number(path, line, "paired_seeds", row["paired_seeds"])
        if seeds is not None and (seeds < 0 or seeds != int(seeds)):
            raise ConfigError(f"{path} line {line}: paired_seeds must be a count, got {row['paired_seeds'][:40]!r}")
        check["paired_seeds"] = None if seeds is None else int(seeds)
        check["paired_change"] = _number(path, line, "paired_change", row.get("paired_change") or "")
        check["incomparable_because"] = _shown(row.get("incomparable_because") or "")
        checks.append(check)
    settings: dict[str, list[str]] = {}
    values = _read_values(folder, summary["tables"], settings)
    digest = hashlib.sha256(summary_text.encode() + b"\0" + _read_text(path).encode()).hexdigest()
    return {"folder": str(folder), "scale": summary["ours_scale"], "tables": list(summary["tables"]),
            "checks": checks, "values": values, "models": _models(summary, summary_path), "settings": settings,
            "runs": _runs_settings(folder), "training": _training(summary, summary_path),
            "differences": _differences(summary, summary_path), "digest": digest}


def _shown(text: str) -> str:
    """A setting read from a report, as one Markdown-safe line of at most 200 characters."""
    return " ".join(str(text).replace("|", "/").split())[:200]


def _models(summary: dict, path: Path) -> dict:
    """summary.json's ``models`` (table -> the model its rows measure); {} for a report without it."""
    models = summary.get("models")
    if models is None:
        return {}
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        raise ConfigError(f"{path}: not a flatfl report summary ('models' is not a table of names)")
    return {_shown(k): _shown(v) for k, v in models.items()}


def _training(summary: dict, path: Path) -> dict | None:
    """summary.json's ``training``: (table, method, partition) -> {setting: value as text} for each row with runs;
    None for a report without it."""
    training = summary.get("training")
    if training is None:
        return None
    bad = ConfigError(f"{path}: not a flatfl report summary ('training' is not each table's rows and their "
                      "settings)")
    if not isinstance(training, dict):
        raise bad
    out = {}
    for table, rows in training.items():
        if not isinstance(rows, list) or len(rows) > _MAX_TRAINING_ROWS:
            raise bad
        for row in rows:
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("method", "partition")) \
                    or not isinstance(row.get("settings"), dict) or len(row["settings"]) > _MAX_SETTINGS \
                    or not all(isinstance(v, str) for v in row["settings"].values()):
                raise bad
            out[(table, row["method"], row["partition"])] = {_shown(k): _shown(v) for k, v in row["settings"].items()}
    return out


def _differences(summary: dict, path: Path) -> dict:
    """summary.json's ``differences_from_paper``: table -> the text (tables without one left out); {} without it."""
    diffs = summary.get("differences_from_paper") or {}
    if not isinstance(diffs, dict) or not all(v is None or isinstance(v, str) for v in diffs.values()):
        raise ConfigError(f"{path}: not a flatfl report summary ('differences_from_paper' is not a text per table)")
    return {k: v[:2000] for k, v in diffs.items() if v}


def _seed_order(text: str):
    return (0, int(text), "") if re.fullmatch(r"-?[0-9]{1,30}", text) else (1, 0, text)


def _runs_settings(folder: Path) -> dict:
    """The data sets, networks and seeds of the report's runs (runs.csv's ``dataset``, ``model`` and ``seed``
    columns, each value once, the seeds in order); {} for a report without runs.csv."""
    path = folder / "runs.csv"
    if not path.is_file():
        return {}
    _, rows = _csv_rows(path, (), "runs table")
    out = {name: list(dict.fromkeys(_shown(row.get(col) or "?") for _, row in rows))[:20]
           for name, col in (("data", "dataset"), ("network", "model"))}
    seeds = sorted({_shown(row["seed"]) for _, row in rows if row.get("seed")}, key=_seed_order)
    out["seeds"] = seeds[:50] + ([f"... ({len(seeds)} in all)"] if len(seeds) > 50 else [])
    return out


def _read_values(folder: Path, tables: list[str], settings: dict | None = None) -> dict:
    """(table, method, partition) -> {metric: (mean, sd, n, paper)} from each table's CSV (``<table>.csv``), for the
    metrics it has; ``settings`` gets, per metric, the settings its values were computed with (each once)."""
    out = {}
    for table in tables:
        if not _TABLE_NAME.fullmatch(table):
            raise ConfigError(f"{folder / 'summary.json'}: {table[:40]!r} is not a table name")
        if table not in TABLES:
            raise ConfigError(f"{folder / 'summary.json'}: {table!r} is not a table flatfl knows "
                              "(damaged or not flatfl's)")
        path = folder / f"{table}.csv"
        fields, rows = _csv_rows(path, ("method", "partition"), "table")
        metrics = [m for m in dict.fromkeys(f[len("ours_"):] for f in fields) if m in metric_names()]  # CSV order
        for line, row in rows:
            values = {}
            for m in metrics:
                n = _number(path, line, f"ours_{m}_n", row.get(f"ours_{m}_n", ""))
                values[m] = (_number(path, line, f"ours_{m}", row[f"ours_{m}"]),
                             _number(path, line, f"ours_{m}_sd", row.get(f"ours_{m}_sd", "")),
                             None if n is None else int(n),
                             _number(path, line, f"paper_{m}", row.get(f"paper_{m}", "")))
                setting = row.get(f"ours_{m}_setting")
                if settings is not None and setting and values[m][0] is not None:
                    known = settings.setdefault(m, [])
                    if _shown(setting) not in known:
                        known.append(_shown(setting))
            out[(table, row["method"], row["partition"])] = values
    return out
