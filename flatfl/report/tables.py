"""A paper layout filled with our runs: one :class:`TableRow` per (method, partition), each metric a
:class:`MetricCell` (our mean over the row's seeds, its spread and errors, the settings that made it, the paper's
value), and the notes on what keeps every row one experiment.

:func:`build_table` makes the rows; :func:`.verdicts.direction_checks` compares them; :mod:`.files`,
:mod:`.markdown` and :mod:`.pages` write them. Each metric's label comes from its registry entry (:mod:`.metrics`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..paper_tables import TableSpec
from .experiments import (check_same_settings, neutral_differences, one_run_per_seed, run_identity,
                          settings_differences)
from .layouts import NOT_RECORDED, fills, paper_lookup, paper_values, run_setting
from .metrics import metric_title
from .run_reader import MODEL_NAMES

__all__ = ["MetricCell", "TableRow", "build_table", "incomparable_notes", "experiment_notes",
           "trained_differently"]


@dataclass
class MetricCell:
    """One metric of one row: our mean over the row's runs and what stands behind it, beside the paper's value."""

    mean: float | None = None  # over the runs made with one setting (None: no value)
    n: int = 0  # runs averaged
    sd: float | None = None  # standard deviation over seeds (two or more runs)
    se: float | None = None  # the estimator's own error of the mean, sqrt(sum se_i^2) / n (where every run has one)
    setting: str | None = None  # the settings that made the number ('mixed: a | b' when the runs differ)
    mark: str = ""  # '†' when made with other settings than the rest of its column
    left_out: str = ""  # runs made with other settings than the rest of the row, left out of its mean
    by_seed: dict[int, float] = field(default_factory=dict)  # seed -> value (two runs of a seed: their mean)
    paper: float | None = None  # the paper's value


@dataclass
class TableRow:
    """One (method, partition) row of a layout: which runs make it and one :class:`MetricCell` per metric.

    The fields before ``training`` are the row's columns in the table CSV, in order (:mod:`.files`)."""

    table: str
    method: str
    paper_method: str
    partition: str
    model: str  # the model its runs measured ('all-clients average'; several joined by '/')
    n_runs: int
    runs: str  # the runs' names, ';'-joined
    dataset: str
    unfinished: str  # runs not finished (in no column), with their rounds
    same_seed_left_out: str  # second runs of a seed (counted once)
    settings_not_changing_numbers: str  # settings that change no number in which the runs differ
    training: dict | None = None  # what decides the row's runs' numbers besides the seed (run_identity)
    cells: dict[str, MetricCell] = field(default_factory=dict)

    def cell(self, metric: str) -> MetricCell:
        return self.cells[metric]


def _setting(record, metric: str) -> str | None:
    return getattr(record, "setting", lambda m: None)(metric)


def _rounds(record):
    """The rounds a run was to train, '?' where its record does not say."""
    rounds = run_setting(record, "rounds")
    return "?" if rounds is None or rounds is NOT_RECORDED else rounds


def _mean_and_spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var)


def _common_settings(spec: TableSpec, chosen) -> dict[str, str | None]:
    """Per metric, the settings most runs of the layout used: a row whose runs differ averages only those."""
    common = {}
    for metric in spec.metrics:
        used = [st for st in (_setting(r, metric) for r in chosen if r.value(metric) is not None) if st is not None]
        common[metric] = max(sorted(set(used)), key=used.count) if used else None
    return common


def _one_setting(have: list, metric: str, common: str | None) -> tuple[list, str]:
    """Never average numbers made with different settings: of (run, value) pairs keep those of the layout's common
    setting (else the row's most frequent one); returns (kept, the runs left out as text)."""
    setting_of = {id(r): _setting(r, metric) for r, _ in have}
    kinds = [setting_of[id(r)] for r, _ in have]
    if len(set(kinds)) <= 1:
        return have, ""
    keep = common if common in kinds else max(sorted(set(kinds), key=str), key=kinds.count)
    left = "; ".join(f"{r.name} ({setting_of[id(r)]})" for r, _ in have if setting_of[id(r)] != keep)
    return [(r, v) for r, v in have if setting_of[id(r)] == keep], left


def _metric_cell(runs, metric: str, common: str | None, paper: float | None) -> MetricCell:
    have = [(r, v) for r, v in ((r, r.value(metric)) for r in runs) if v is not None]
    have, left_out = _one_setting(have, metric, common)
    got = [v for _, v in have]
    by_seed: dict[int, list[float]] = {}
    for r, v in have:
        by_seed.setdefault(int(r.seed), []).append(v)
    mean, sd = _mean_and_spread(got)
    ses = [r.stderr(metric) for r, _ in have]
    settings = sorted({st for st in (_setting(r, metric) for r, _ in have) if st is not None})
    return MetricCell(
        mean=mean, n=len(got), sd=sd,
        se=math.sqrt(sum(x * x for x in ses)) / len(ses) if ses and all(x is not None for x in ses) else None,
        setting=settings[0] if len(settings) == 1 else "mixed: " + " | ".join(settings) if settings else None,
        left_out=left_out, by_seed={s: sum(vs) / len(vs) for s, vs in sorted(by_seed.items())}, paper=paper)


def _row(spec: TableSpec, method: str, part: str, records, common: dict, paper: dict) -> TableRow:
    every = [r for r in records if r.method == method and r.partition == part]
    # a run killed before its last round is no seed of the experiment: listed, used in no column
    unfinished = [r for r in every if not getattr(r, "finished", True)]
    runs = [r for r in every if getattr(r, "finished", True)]
    check_same_settings(spec, method, part, runs)
    runs, same_seed = one_run_per_seed(runs, spec.metrics)
    models = sorted({getattr(r, "model", "server") for r in runs})
    return TableRow(
        table=spec.key, method=method, paper_method=spec.paper_name(method), partition=part,
        model="/".join(MODEL_NAMES.get(m, m) for m in models), n_runs=len(runs),
        runs=";".join(r.name for r in runs), dataset=";".join(sorted({r.dataset for r in runs})),
        unfinished="; ".join(f"{r.name} ({getattr(r, 'rounds_done', '?')}/{_rounds(r)} rounds)" for r in unfinished),
        same_seed_left_out="; ".join(f"{r.name} (seed {r.seed}, as {k.name})" for r, k in same_seed),
        settings_not_changing_numbers=neutral_differences(runs),
        training=run_identity(runs[0]) if runs else None,
        cells={m: _metric_cell(runs, m, common[m], paper.get((spec.paper_name(method), part, m)))
               for m in spec.metrics})


def build_table(spec: TableSpec, records, values: list[dict] | None = None) -> list[TableRow]:
    """One row per (method, partition) of ``spec``: per metric our mean over the matching runs' values (``n`` of
    them), the standard deviation over seeds (``sd``, two or more runs), the estimator's own error of that mean
    (``se``), the settings that made the number (``setting``) and the paper's value. The records must already hold
    the model to report (:meth:`RunRecord.select`); the row names it (``model``).

    A row is one experiment: its finished runs of distinct seeds, trained alike
    (:func:`.experiments.training_settings`; other settings refused). A run not finished is in no column
    (``unfinished``); a second run of a seed counts once (``same_seed_left_out``); settings that change no number
    (:data:`.experiments.NEUTRAL_SETTINGS`) do not split the row and are named where its runs differ in them
    (``settings_not_changing_numbers``); ``training`` keeps the row's settings for
    :func:`.verdicts.direction_checks`."""
    paper = paper_lookup(spec, values if values is not None else paper_values())
    common = _common_settings(spec, [r for r in records if fills(spec, r)])
    rows = [_row(spec, method, part, records, common, paper) for method in spec.rows for part in spec.partitions]
    _mark_incomparable(spec, rows)
    return rows


def _column_setting(rows: list[TableRow], metric: str) -> str | None:
    """The settings most values of a column were made with (None when the column has no value)."""
    settings = [r.cells[metric].setting for r in rows if r.cells[metric].mean is not None]
    return max(sorted(set(settings)), key=settings.count) if settings else None


def _mark_incomparable(spec: TableSpec, rows: list[TableRow]) -> None:
    """A dagger on every value computed with settings other than the column's most common ones (or mixed)."""
    for metric in spec.metrics:
        if not any(r.cells[metric].mean is not None for r in rows):
            continue
        common = _column_setting(rows, metric)
        for r in rows:
            c = r.cells[metric]
            if c.mean is not None and (c.setting != common or common.startswith("mixed")):
                c.mark = "†"


def incomparable_notes(spec: TableSpec, rows: list[TableRow]) -> list[str]:
    """The footnotes of the daggers (empty when every column is one protocol), the runs left out of a row's mean,
    then :func:`experiment_notes`."""
    out = []
    for metric in spec.metrics:
        marked = [r for r in rows if r.cells[metric].mark]
        if not marked:
            continue
        what = "; ".join(f"{r.method} {r.partition}: {r.cells[metric].setting}" for r in marked)
        out.append(f"† {metric_title(metric)} computed with other settings than the rest of its column "
                   f"({_column_setting(rows, metric)}): {what}. Not comparable without caution; direction checks "
                   "between them are marked 'incomparable'.")
    for metric in spec.metrics:
        left = [r for r in rows if r.cells[metric].left_out]
        if left:
            out.append(f"{metric_title(metric)}: runs made with other settings than the rest of their row "
                       "are left out of its mean: " + "; ".join(
                           f"{r.method} {r.partition}: {r.cells[metric].left_out}" for r in left))
    return out + experiment_notes(spec, rows)


def trained_differently(spec: TableSpec, a: TableRow, b: TableRow) -> list[str]:
    """How the runs of two table rows were trained differently, the method aside: ['rounds 2 vs 3', ...] (empty when
    they are the same experiment but for the method, or when a row does not say how its runs were trained)."""
    return settings_differences(spec, a.method, a.training, b.method, b.training)


def experiment_notes(spec: TableSpec, rows: list[TableRow]) -> list[str]:
    """What keeps each row one experiment: runs not finished (in no column), second runs of a seed (counted once),
    the settings that change no number in which a row's runs differ (shown, not splitting the row), and pairs of
    rows trained differently in anything but the method (their checks 'incomparable')."""
    out = []
    for text, attr in (("runs not finished, left out of every column (resume them with flatfl train --resume): ",
                        "unfinished"),
                       ("a seed trained more than once counts once (its runs differ only in settings that change no "
                        "number beyond rounding); left out: ", "same_seed_left_out"),
                       ("seeds of one row ran with different settings that change no number beyond rounding: ",
                        "settings_not_changing_numbers")):
        found = [f"{r.method} {r.partition}: {getattr(r, attr)}" for r in rows if getattr(r, attr)]
        if found:
            out.append(text + "; ".join(found))
    by = {(r.method, r.partition): r for r in rows}
    for ref, cmp_ in spec.comparisons:
        for part in spec.partitions:
            a, b = by.get((ref, part)), by.get((cmp_, part))
            diff = trained_differently(spec, a, b) if a and b and a.n_runs and b.n_runs else []
            if diff:
                out.append(f"{cmp_} vs {ref} {part}: trained differently ({', '.join(diff)}): not the same "
                           "experiment, its direction checks are 'incomparable'")
    return out
