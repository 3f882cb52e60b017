"""``flatfl report``: run directories in; CSV tables, a Markdown summary and one multi-page PDF out.

:func:`build_report` is a pipeline: the run records (:mod:`.records`; the missing analyses computed when asked,
:mod:`.missing`) -> one table per layout (:mod:`.tables`) -> its direction verdicts (:mod:`.verdicts`), both held
in a :class:`~.results.TableResult` -> the files, written into ``out``:

* ``runs.csv``: one line per run (method, partition, seed, accuracy, top eigenvalue, trace and its standard error,
  H_N, H_D, lambda_1/lambda_5, each with the settings that made it, the analysis settings);
* ``<table>.csv`` for each paper layout filled (``man-table2.csv``, ``man-table6.csv``, ``fedalign-table1.csv``):
  one line per (method, partition), ours beside the paper's;
* ``directions.csv``: every "X vs X+regularizer" comparison, our change and the paper's, and whether they agree;
* ``report.md``: what the tables found (:mod:`.headline`), the tables and the agreement counts as Markdown;
  ``summary.json``: the same counts and headline, what is missing;
* ``effects.png`` / ``effects.pdf``: the forest plot of every comparison under the headline (:mod:`.forest`), as
  tall as its lines need, also the PDF's first page;
* ``report.pdf``: the forest plot, then the pages of :mod:`.pages`.

The runs come from run folders (:mod:`.records`) or from one runs.csv, re-rendered (:mod:`.runs_csv`: its lines
read as records the tables use alike; what only a run folder holds is absent and said in a notice).

Every file is written atomically (:mod:`flatfl.utils.io`); the PDF is rendered in memory first. A file of one of
these names in ``out`` that flatfl did not write (its folder's manifest, :mod:`flatfl.utils.manifest`, does not list
it) is never replaced: the report is refused before any work (:func:`report_files`); so is a folder holding a
contrast (:mod:`.folder_kinds`), whose forest plot shares the report's file names.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError
from ..utils.device import resolve_device
from ..analysis.commands.hessian_settings import HessianSettings
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, csv_text
from ..utils.lock import locks_output
from ..utils.manifest import refuse_foreign, remove_owned
from ..utils.plots import saved
from . import figure_pages, folder_kinds, pdf, runs_csv
from .forest import forest_figure
from .headline import report_headline
from .files import FIXED_COLUMNS, directions_csv, run_rows, summary, table_csv
from .layouts import (TABLES, fills, matching_tables, model_for, paper_values, scale_label, tables_for,
                      with_measured_metrics)
from .markdown import report_markdown
from .metrics import register_quantity_metrics
from .missing import (DEFAULT_CLIENTS, DEFAULT_HESSIAN, compute_missing as compute_analyses, missing_lines,
                      pick_clients, sample_notices, settings_ok)
from .pages import contents, other_pages, run_pages, table_pages, title_sections
from .run_checks import check_runs_belong_together, version_notices
from .records import find_run_dirs, load_run
from .results import table_result

__all__ = ["build_report", "report_files", "AnalysesAsked"]

#: the files every report writes, whatever its layouts
_ALWAYS = ("runs.csv", "report.md", "effects.png", "effects.pdf", "report.pdf", "summary.json")


def report_files(specs) -> list[str]:
    """The names of the files a report of the layouts ``specs`` writes into its folder."""
    tables = [f"{s.key}.csv" for s in specs]
    return ["runs.csv", *tables, *(["directions.csv"] if tables else []), "report.md", "effects.png", "effects.pdf",
            "report.pdf", "summary.json"]


def _model_of(specs, model: str | None):
    """The model whose analyses each run's numbers come from: that of the first layout taking it."""
    def of(rec) -> str:
        for spec in specs:
            if fills(spec, rec):
                return model_for(spec, model)
        return model_for(specs[0], model) if specs else (model or "server")
    return of


def _read(run_dirs, model_of, accept) -> list:
    records = [load_run(d) for d in run_dirs]
    for rec in records:
        rec.select(model_of(rec), accept)
    return records


def _write_tables(out: Path, records, results, ours_scale: str, missing, notices) -> list[str]:
    """runs.csv, each layout's CSV, directions.csv and report.md; returns their names, in order."""
    written = ["runs.csv"]
    atomic_write_text(out / "runs.csv", csv_text(run_rows(records)))
    for t in results:
        atomic_write_text(out / f"{t.spec.key}.csv", table_csv(t.rows))
        written.append(f"{t.spec.key}.csv")
    if results:
        atomic_write_text(out / "directions.csv", directions_csv([c for t in results for c in t.checks]))
        written.append("directions.csv")
    atomic_write_text(out / "report.md", report_markdown(results, ours_scale, missing, notices))
    # an earlier report's table of another layout would sit beside this one as if it were part of it
    for stale in [f"{key}.csv" for key in TABLES] + ["directions.csv"]:
        if stale not in written:
            remove_owned(out / stale)
    return written + ["report.md"]


def _write_effects(out: Path, results, ours_scale: str):
    """effects.png and effects.pdf, the forest plot of every comparison; returns its figure (the PDF's first
    page)."""
    fig = forest_figure(results, ours_scale)
    atomic_write_bytes(out / "effects.png", saved(fig, "png"))
    atomic_write_bytes(out / "effects.pdf", saved(fig, "pdf"))
    return fig


@dataclass(frozen=True)
class AnalysesAsked:
    """The analyses a report asks of its runs: the Hessian settings its numbers must be made with (``hessian``:
    ``top``, ``density``, ``samples``, ``method``; none asked: any), and whether the missing ones are computed
    (``compute_missing``), on which ``device`` and with which H_N / H_D settings (``clients``; defaults
    :data:`~.missing.DEFAULT_HESSIAN`, :data:`~.missing.DEFAULT_CLIENTS`)."""
    hessian: dict = field(default_factory=dict)
    compute_missing: bool = False
    device: str = "cpu"
    clients: dict | None = None


@dataclass(frozen=True)
class _TitlePage:
    """The PDF's title page: the report's ``title``, when it was made (``stamp``, its footer) and the ``sections``
    it lists, the contents last."""
    title: str
    stamp: str
    sections: list

    def figure(self, titles: list[str]):
        return figure_pages.text_page(self.title, [*self.sections, ("Contents", contents(titles))],
                                      footer=f"flatfl report, {self.stamp}")


def _write_pdf(out: Path, records, results, ours_scale: str, specs, effects, title_page: _TitlePage) -> list[str]:
    """report.pdf: the forest plot of every comparison (``effects``), the title page (drawn last, with the
    contents), each layout's pages, the other runs', every run. Returns the pages' titles."""
    pages = [(effects, "effects"), (None, "summary")]
    for t in results:
        pages += table_pages(t, ours_scale)
    pages += other_pages([r for r in records if not any(fills(s, r) for s in specs)], ours_scale)
    pages += run_pages(run_rows(records))
    titles = [name for _, name in pages]
    pages[1] = (title_page.figure(titles), "summary")
    n_pages = pdf.write_pdf([fig for fig, _ in pages], out / "report.pdf")
    assert n_pages == len(titles)
    return titles


def _from_run_folders(paths, out: Path, tables, model, analyses: AnalysesAsked, echo):
    """The records of the run folders under ``paths`` (the missing analyses computed when ``analyses`` asks), the
    layouts, the notices and what is missing."""
    asked, compute_missing, device = analyses.hessian, analyses.compute_missing, analyses.device
    run_dirs = find_run_dirs(paths)
    records = [load_run(d) for d in run_dirs]
    check_runs_belong_together(records)
    specs = tables_for(tables) if tables else [TABLES[k] for k in matching_tables(records)]
    refuse_foreign(out, report_files(specs))  # and each table's CSV, before any analysis is computed
    model_of, accept = _model_of(specs, model), settings_ok(asked)
    for rec in records:
        rec.select(model_of(rec), accept)
    notices: list[str] = []
    problems: list[str] = []
    if compute_missing:
        problems, done = compute_analyses(records, specs, dict(DEFAULT_HESSIAN, **asked, device=device), asked,
                                          dict(DEFAULT_CLIENTS, **(analyses.clients or {}), device=device), echo)
        notices += done
        records = _read(run_dirs, model_of, accept)
    notices += pick_clients(records, specs)
    if asked:
        notices.append("Hessian settings asked for: " + ", ".join(f"{k} {v}" for k, v in sorted(asked.items()))
                       + "; only analyses made with them are used")
    notices += sample_notices(records) + version_notices(records)
    return records, specs, notices, missing_lines(records, specs, asked, problems, compute_missing)


def _from_runs_csv(source: Path, out: Path, tables, model):
    """The records of the lines of the runs.csv ``source`` (:mod:`.runs_csv`), the layouts, the notices (where the
    numbers come from, what is not available) and what is missing."""
    records = runs_csv.read_runs_csv(source)
    if model is not None:
        for rec in records:
            rec.select(model)
    specs = tables_for(tables) if tables else [TABLES[k] for k in matching_tables(records)]
    refuse_foreign(out, report_files(specs))
    return records, specs, runs_csv.notices(source, records), runs_csv.missing_lines(records, specs)


@contextlib.contextmanager
def _said_if_interrupted(out: Path) -> Iterator[None]:
    """Ctrl-C while the report's files are written: the line says what is there (each file is written whole, the
    set may be short of the last ones; summary.json, written last, marks a whole report)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if not getattr(e, "hint", None):
            e.hint = (f"{out} holds the report's files written so far, each whole, but perhaps not all of them "
                      "(summary.json, written last, marks a whole report): run the same command again")
        raise


@locks_output  # one writer per report folder
def build_report(paths, out, *, tables=None, analyses: AnalysesAsked | None = None, title: str = "flatfl report",
                 echo: Callable[[str], None] | None = None, model: str | None = None, rows=None) -> dict:
    """Write the report of the runs under ``paths`` into ``out``; returns the summary (also summary.json).
    ``paths`` is run folders, or one runs.csv to re-render (:mod:`.runs_csv`; then without analyses asked for).

    ``tables``: layout keys ('man-table2', 'man-table6', 'man-tables', 'fedalign-table1'); None picks every layout
    that at least one run fills. ``model``: 'server' or 'clients-average', the model every row measures (accuracy
    and Hessian); None: each layout's default (:func:`~flatfl.report.layouts.model_for`). ``analyses``
    (:class:`AnalysesAsked`; None: none asked): the Hessian settings asked for; with ``compute_missing`` a run
    lacking a Hessian of its model with those settings gets one (into a folder of its own when an analysis with
    other settings exists), without it such a run is listed as missing; the table then uses only analyses with the
    asked settings. ``rows``: the row labels to show (a reproduction restricted by ``--methods``; None: every row
    of each layout).
    """
    stamp = pdf.made_at()  # checked before any work
    register_quantity_metrics(FIXED_COLUMNS)  # a column for each quantity registered by now (a plug-in's too)
    analyses = analyses or AnalysesAsked()
    compute_missing, device = analyses.compute_missing, analyses.device
    asked = {k: v for k, v in (analyses.hessian or {}).items() if v is not None or k == "samples"}
    if isinstance(asked.get("method"), str):  # names are case-folded where they enter
        asked["method"] = asked["method"].strip().lower()
    analyses = replace(analyses, hessian=asked)
    if compute_missing:  # one error line before any work, not one per run
        resolve_device(device)
    if asked or compute_missing:  # settings no analysis could have: refused, not a report of empty cells
        HessianSettings.from_mapping(dict(DEFAULT_HESSIAN, **asked, device=device if compute_missing else "cpu"),
                                     "the Hessian settings asked for")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    refuse_foreign(out, _ALWAYS)  # a user's report.md is never replaced: refused before the runs are read
    folder_kinds.refuse_other(out, folder_kinds.REPORT)  # nor a contrast's forest plot (effects.png / .pdf)

    # ---- records
    source = runs_csv.runs_csv_source(paths)
    if source is None:
        records, specs, notices, missing = _from_run_folders(paths, out, tables, model, analyses, echo)
    else:
        if compute_missing or asked:
            raise ConfigError(f"{source}: a runs.csv holds the analyses as they were made; --compute-missing and "
                              "the Hessian options need the run folders")
        records, specs, notices, missing = _from_runs_csv(source, out, tables, model)
    specs = [with_measured_metrics(spec, records) for spec in specs]  # the smallest eigenvalue, where measured
    names = [r.name for r in records if not any(fills(s, r) for s in specs)]
    if specs and names:  # a run of no table's method and partition: said, not dropped unseen
        notices.append(f"{len(names)} run(s) fill no row of the tables (no row of their method and partition): "
                       f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}; runs.csv lists them")

    # ---- tables and verdicts
    values = paper_values()
    ours_scale = scale_label(records)

    def table_model(spec):  # a runs.csv's lines measured the model they name: by default, that one
        return model if source is None or model else runs_csv.recorded_model(spec, records)

    results = [table_result(spec, records, table_model(spec), values, only=rows) for spec in specs]

    # ---- files
    with _said_if_interrupted(out):
        out.mkdir(parents=True, exist_ok=True)
        # summary.json, written last, marks a whole report: an earlier report's goes first, so that a report that
        # stops midway (an error, Ctrl-C) is never taken for whole beside the earlier one's other files
        remove_owned(out / "summary.json")
        written = _write_tables(out, records, results, ours_scale, missing, notices)
        effects = _write_effects(out, results, ours_scale)
        # where the numbers come from heads the title page when they are a runs.csv's (its first notice)
        if source is None:
            sections = title_sections(results, records, ours_scale, notices, missing)
        else:
            sections = [("Source", notices[:1])] + title_sections(results, records, ours_scale, notices[1:], missing)
        page_titles = _write_pdf(out, records, results, ours_scale, specs, effects, _TitlePage(title, stamp, sections))
        report = summary(records, specs, results, notices=notices, missing=missing, pages=page_titles,
                         files=written + ["effects.png", "effects.pdf", "report.pdf"], ours_scale=ours_scale)
        report["headline"] = report_headline(results)
        if source is not None:  # runs.csv records no training settings beyond data set, network, clients and rounds
            report.update(training=None, source={"runs_csv": str(source)})
        atomic_write_json(out / "summary.json", report)
        folder_kinds.record(out, folder_kinds.REPORT)
    return report
