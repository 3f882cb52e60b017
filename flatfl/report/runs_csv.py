"""A report's ``runs.csv`` read back into run records, so that ``flatfl report path/to/runs.csv`` re-renders a report
whose run folders are gone (or were never shared): the same numbers, the current tables, verdicts and forest plot.

Each line becomes a :class:`CsvRunRecord`, which the table code reads exactly as it reads a
:class:`~flatfl.report.records.RunRecord`: ``name``, ``method``, ``partition``, ``dataset``, ``seed``, ``model``,
``finished``, ``accuracy(column)``, ``value(metric)``, ``stderr(metric)``, ``setting(metric)`` and ``identity`` (what
decides its numbers besides the seed, as far as runs.csv records it: data set, network, clients and rounds). A
metric's value, error and settings are the file's columns ``<name>``, ``<name>_stderr`` and ``<name>_setting`` where
it has them (the metric registry's ``runs_csv``, :mod:`.metrics`); anything else is what the registry's own
functions read of a record that holds no analysis file (nothing, but for the accuracy, which runs.csv carries). A
runs.csv of an older flatfl has no settings columns: each value's settings are then the analysis columns the file
has (model, methods, samples, protocol), so that values of other recorded settings are still never averaged.

What only a run folder holds (metrics.csv's curves, spectra, loss surfaces, curvature tracking, the provenance and
version checks, the training settings) is not invented: the report says so (:func:`notices`).

The file is another person's, untrusted: read with the bounded CSV reader (:func:`.bounded.csv_rows`), its required
columns present, each value checked for type and range, every problem one ConfigError line naming the file, the
line and the column.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.commands.result_files import MAX_MAGNITUDE as RESULT_MAX_MAGNITUDE
from ..errors import ConfigError
from .bounded import csv_rows, finite_number, read_text
from .files import FOLDER_COLUMNS, RUN_COLUMNS
from .layouts import NOT_RECORDED, fills
from .metrics import metric_columns, metric_names, metric_title, report_metric
from .run_reader import MODEL_NAMES

__all__ = ["CsvRunRecord", "REQUIRED_COLUMNS", "MAX_BYTES", "runs_csv_source", "read_runs_csv", "notices",
           "missing_lines", "recorded_model"]

#: the columns every flatfl runs.csv has had: a file without one of them is not a runs.csv
REQUIRED_COLUMNS = RUN_COLUMNS
#: the largest runs.csv read (a line is a few hundred characters: millions of runs fit)
MAX_BYTES = 256 * 1024 * 1024
#: the training settings a runs.csv line records (each the column of its name), each checked where it is read
RECORDED_SETTINGS = ("dataset", "model", "clients", "rounds")
_INTEGER_COLUMNS = ("seed", "clients", "rounds", "rounds_done", "num_eigenvalues", "hessian_samples",
                    "hessian_samples_asked")
_TEXT_COLUMNS = ("hessian_dir", "model", "hessian_method", "trace_method", "clients_protocol", "run_dir")
#: the analysis columns that stand for a value's settings in a runs.csv without settings columns
_ANALYSIS_COLUMNS = ("hessian_method", "trace_method", "hessian_samples", "clients_protocol")
_MODEL_KEYS = {name: key for key, name in MODEL_NAMES.items()}
_BOOLEANS = {"true": True, "false": False}
#: the largest integer of a count column (runs.csv's counts: clients, rounds, samples, eigenvalues); a seed is
#: bounded by what training accepts (:data:`flatfl.train.config.MAX_SEED`)
MAX_COUNT = 2**63 - 1
#: the largest magnitude of a number read (the same bound as a result file's): far above any value flatfl records,
#: and small enough that a report's means, spreads and differences of such values stay finite
MAX_MAGNITUDE = RESULT_MAX_MAGNITUDE


@dataclass
class CsvRunRecord:
    """One line of a runs.csv, read as the report reads a run folder (:class:`~.records.RunRecord`'s interface).

    ``columns``: the line's values by column, parsed (numbers as floats or ints, None for empty);
    ``recorded``: the columns only a run folder gives (:data:`.files.FOLDER_COLUMNS`), as the file recorded them;
    ``recorded_settings``: the training settings the line records (data set, network, clients, rounds)."""

    name: str
    method: str
    partition: str
    dataset: str
    seed: int
    model: str  # 'server' or 'clients-average': the model its numbers measure
    finished: bool
    source: Path
    line: int
    columns: dict
    recorded: dict
    recorded_settings: dict
    has_settings: frozenset = frozenset()  # the metrics whose settings the file records (``<name>_setting``)
    # what only a run folder holds: none of it
    config = None
    hessian = None
    clients = None
    spectrum = None
    surface_path = None
    weights_sha256 = None
    network = None
    data = None
    curve: list = field(default_factory=list)
    tracking: dict = field(default_factory=dict)
    training_path: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)

    @property
    def identity(self) -> dict:
        """What decides this run's numbers besides its seed, as far as runs.csv records it."""
        return dict(self.recorded_settings)

    @property
    def network_label(self) -> str:
        """The network as the line records it; :data:`.layouts.NOT_RECORDED` in a runs.csv without the column (or
        with it empty): it is never looked up in a config the line does not have."""
        return self.recorded_settings.get("model") or NOT_RECORDED

    @property
    def rounds_done(self):
        return self.recorded.get("rounds_done")

    @property
    def run_dir(self) -> Path:
        """The run's folder as runs.csv recorded it (it need not exist here)."""
        return Path(self.recorded.get("run_dir") or self.name)

    @property
    def has_hessian(self) -> bool:
        return bool(self.recorded.get("hessian_method")) or any(
            self.columns.get(m) is not None for m in metric_names() if report_metric(m).runs_csv)

    def select(self, model: str, settings_ok=None) -> "CsvRunRecord":
        """A line's numbers are of the model runs.csv names: another one asked for is refused."""
        if model != self.model:
            raise ConfigError(f"{self.source} line {self.line}: run {self.name}'s numbers are of the "
                              f"{MODEL_NAMES[self.model]} model; runs.csv cannot give the {MODEL_NAMES[model]}'s "
                              "(leave --model out, or report the run folders)")
        return self

    def accuracy(self, column: str) -> float | None:
        """The recorded ``column`` (test_acc, all_test_acc), in percent."""
        return self.columns.get(column)

    def _registered(self, metric: str, part: str, column: str, read):
        if part in report_metric(metric).runs_csv and column in self.columns:
            return self.columns[column]
        return read(self)

    def value(self, metric: str) -> float | None:
        return self._registered(metric, "value", metric, report_metric(metric).value)

    def stderr(self, metric: str) -> float | None:
        v = self._registered(metric, "error", f"{metric}_stderr", report_metric(metric).error)
        return None if v is None or not math.isfinite(float(v)) else abs(float(v))

    def setting(self, metric: str) -> str | None:
        if metric in self.has_settings:
            return self.columns.get(f"{metric}_setting")
        found = report_metric(metric).setting(self)
        if found is not None or self.value(metric) is None:
            return found
        recorded = ", ".join(f"{c.replace('_', ' ')} {self.recorded[c]}" for c in _ANALYSIS_COLUMNS
                             if self.recorded.get(c) not in (None, ""))
        return f"{MODEL_NAMES[self.model]}; as runs.csv records it: {recorded or 'nothing'}"


def runs_csv_source(paths) -> Path | None:
    """The runs.csv among a report's sources (an argument that is a file named ``*.csv``), None for run folders.
    One source kind per report: a runs.csv beside anything else is refused."""
    paths = [Path(p) for p in paths]
    csvs = [p for p in paths if p.name.lower().endswith(".csv") and not p.is_dir()]
    if not csvs:
        return None
    if len(paths) > 1:
        raise ConfigError(f"a report is re-rendered from one runs.csv alone, got {len(paths)} sources "
                          f"({', '.join(map(str, paths[:3]))}{', ...' if len(paths) > 3 else ''}): report the run "
                          "folders together, or each runs.csv into its own folder")
    if not csvs[0].is_file():
        raise ConfigError(f"runs.csv not found: {csvs[0]}")
    return csvs[0]


def _quoted(v: str) -> str:
    """A field as messages quote it: its first 40 characters (the length said beyond that)."""
    return repr(v) if len(v) <= 40 else f"{v[:40]!r}... ({len(v):,} characters)"


def _integer(v: str, column: str, where: str) -> int:
    """A count or seed column's integer, in 0..its bound; the digits counted before any conversion (Python refuses
    to convert more than 4,300 digits, and a number that long is no flatfl count)."""
    from ..train.config import MAX_SEED

    bound = MAX_SEED if column == "seed" else MAX_COUNT
    digits = v.lstrip("0") or "0"  # leading zeros count towards Python's limit too
    if not v.isascii() or not v.isdigit() or len(digits) > len(str(bound)) or int(digits) > bound:
        raise ConfigError(f"{where}: {_quoted(v)} is not an integer in 0..{bound}")
    return int(digits)


def _parse(value: str, column: str, where: str):
    """One field by its column's type: integers >= 0, booleans, finite numbers (accuracy within 0..100, errors
    >= 0), text; empty is None (not recorded) but for the columns every run has."""
    v = value.strip()
    if column in ("run", "method", "partition", "dataset"):
        if not v:
            raise ConfigError(f"{where}: empty; every run has a {column}")
        return v
    if column == "hessian_model":
        if v not in _MODEL_KEYS:
            raise ConfigError(f"{where}: {_quoted(v)} is not a model ({' or '.join(map(repr, _MODEL_KEYS))})")
        return _MODEL_KEYS[v]
    if column in ("finished", "density"):
        if not v and column == "density":
            return None
        if v.lower() not in _BOOLEANS:
            raise ConfigError(f"{where}: {_quoted(v)} is not True or False")
        return _BOOLEANS[v.lower()]
    if column in _TEXT_COLUMNS or column.endswith("_setting"):
        return v or None
    if not v:
        if column == "seed":
            raise ConfigError(f"{where}: empty; every run has a seed")
        return None
    if column in _INTEGER_COLUMNS:
        return _integer(v, column, where)
    number = finite_number(v, where)
    if abs(number) > MAX_MAGNITUDE:
        raise ConfigError(f"{where}: {number:g} is beyond +-{MAX_MAGNITUDE:g}, more than any value flatfl records "
                          "(a report could not average it)")
    if column in ("test_acc", "all_test_acc") and not 0 <= number <= 100:
        raise ConfigError(f"{where}: {number:g} is not an accuracy in percent (0 to 100)")
    if column.endswith("_stderr") and number < 0:
        raise ConfigError(f"{where}: {number:g} is negative; a standard error is >= 0")
    return number


def _known_columns() -> set[str]:
    """The columns read: the required ones, the folder ones and each registered metric's runs.csv columns."""
    known = set(REQUIRED_COLUMNS) | set(FOLDER_COLUMNS)
    for name in metric_names():
        known |= set(metric_columns(name))
    return known


def _check_together(values: dict, where: str) -> None:
    """What a line's values must be: at least one client and one round, and its smallest eigenvalue not above its
    top one (both of one analysis) beyond their errors."""
    for column in ("clients", "rounds"):
        if values.get(column) == 0:
            raise ConfigError(f"{where}, column {column}: 0; every run has at least one")
    low, top = values.get("smallest_eigenvalue"), values.get("top_eigenvalue")
    if low is not None and top is not None:  # beyond both estimates' errors and the numbers' last digits
        slack = (values.get("smallest_eigenvalue_stderr") or 0.0) + (values.get("top_eigenvalue_stderr") or 0.0)
        if low - top > slack + 1e-9 * max(abs(low), abs(top)):
            raise ConfigError(f"{where}, column smallest_eigenvalue: {low:g} is above the top eigenvalue {top:g}")


def _record(path: Path, line: int, row: dict, header: list[str], known: set[str],
            has_settings: frozenset) -> CsvRunRecord:
    if None in row:
        raise ConfigError(f"{path} line {line}: {len(header) + len(row[None])} fields, the header has "
                          f"{len(header)}")
    short = [c for c in header if row.get(c) is None]
    if short:
        raise ConfigError(f"{path} line {line}: {len(header) - len(short)} fields, the header has {len(header)}")
    values = {c: _parse(row[c], c, f"{path} line {line}, column {c}") for c in header if c in known}
    _check_together(values, f"{path} line {line}")
    recorded = {c: values.get(c) for c in FOLDER_COLUMNS}
    settings = {k: values[k] for k in RECORDED_SETTINGS if values.get(k) is not None}
    return CsvRunRecord(name=values["run"], method=values["method"], partition=values["partition"],
                        dataset=values["dataset"], seed=values["seed"], model=values["hessian_model"],
                        finished=values["finished"], source=path, line=line, columns=values, recorded=recorded,
                        recorded_settings=settings, has_settings=has_settings)


def read_runs_csv(path) -> list[CsvRunRecord]:
    """Every line of the runs.csv at ``path`` as a :class:`CsvRunRecord`; anything that is not a flatfl runs.csv
    (not UTF-8, empty, no runs, a required column missing, a value of the wrong type or range, two lines of one
    run) is one ConfigError line naming the file, and the line and column where there is one."""
    path = Path(path)
    text = read_text(path, MAX_BYTES, "a flatfl runs.csv", encoding="utf-8-sig")
    if not text.strip():
        raise ConfigError(f"{path} is empty: not a flatfl runs.csv")
    if "\x00" in text:  # no flatfl field holds one; a cell with it would reach the tables and figures
        raise ConfigError(f"{path} line {text.count(chr(10), 0, text.index(chr(0))) + 1}: a NUL byte, which no "
                          "flatfl runs.csv holds")
    header, rows = csv_rows(text, path)
    lacking = [c for c in REQUIRED_COLUMNS if c not in header]
    if lacking:
        raise ConfigError(f"{path}: not a flatfl runs.csv (no column {', '.join(lacking[:4])}"
                          f"{', ...' if len(lacking) > 4 else ''})")
    if not rows:
        raise ConfigError(f"{path}: a header and no runs")
    records, seen, known = [], {}, _known_columns()
    has_settings = frozenset(m for m in metric_names() if f"{m}_setting" in header
                             and "setting" in report_metric(m).runs_csv)  # the metrics whose settings it records
    for line, row in rows:
        rec = _record(path, line, row, header, known, has_settings)
        if rec.name in seen:
            raise ConfigError(f"{path} line {line}, column run: {rec.name!r} is also line {seen[rec.name]}'s run; "
                              "each run is one line")
        seen[rec.name] = line
        records.append(rec)
    return records


def recorded_model(spec, records) -> str | None:
    """The model the runs of ``spec``'s layout measured, when they all measured one (None otherwise)."""
    models = {r.model for r in records if fills(spec, r)}
    return models.pop() if len(models) == 1 else None


def notices(path: Path, records) -> list[str]:
    """What a re-rendered report says of itself: where its numbers come from and what it does not have; the
    columns of the current runs.csv the file lacks (an older flatfl's), whose values are then not recorded."""
    out = [f"re-rendered from runs.csv ({path}): the numbers are the runs' as recorded; per-run pages (accuracy, "
           "spectrum, curvature and loss-surface figures), provenance and version checks and training settings are "
           "not available; a setting runs.csv does not record shows as 'not recorded'"]
    header = set(records[0].columns) if records else set()
    optional = {c for n in metric_names() if report_metric(n).when_measured  # columns only where runs measured it
                for c in metric_columns(n)}
    lacking = sorted(_known_columns() - header - optional)
    if lacking:
        out.append(f"{path} has no column {', '.join(lacking)} (a runs.csv of an older flatfl, or a partial one): "
                   "those values are not recorded; a value's settings without its column are the analysis columns "
                   "the file has")
    return out


def missing_lines(records, specs) -> list[str]:
    """The report's 'Missing' list for runs read from a runs.csv: runs not finished, and per run the values its
    layouts show that the file does not record (nothing can be computed without the run folders)."""
    out = []
    for rec in records:
        if not rec.finished:
            out.append(f"{rec.name}: not finished ({rec.rounds_done if rec.rounds_done is not None else '?'}/"
                       f"{rec.recorded.get('rounds') or '?'} rounds, as runs.csv records it): left out of every table "
                       "column")
            continue
        wanted = list(dict.fromkeys(m for s in specs if fills(s, rec) for m in s.metrics))
        lacking = [metric_title(m) for m in wanted if rec.value(m) is None]
        if lacking:
            out.append(f"{rec.name}: no {', '.join(lacking)} in runs.csv")
    return out
