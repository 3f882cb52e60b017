"""Reports: our results beside the papers' (MAN Table 2 / Table 6, FedAlign Table 1) as CSV, Markdown and one PDF.

    from flatfl.report import AnalysesAsked, build_report
    summary = build_report(["runs/sweep"], "reports/x", analyses=AnalysesAsked(compute_missing=True))

A report is a pipeline (:mod:`.pipeline`): run folders (or one report's runs.csv, :mod:`.runs_csv`) read into
records (:mod:`.run_files`, :mod:`.provenance`, :mod:`.records`; what is missing: :mod:`.missing`) -> one table per paper layout (:mod:`.layouts`,
:mod:`.experiments`, :mod:`.tables`; each column a metric of the registry in :mod:`.metrics`) -> direction verdicts
(:mod:`.verdicts`, :mod:`.paired`), held together in :mod:`.results` -> the renderers: CSV and summary.json
(:mod:`.files`), the headline of what the tables found (:mod:`.headline`), report.md (:mod:`.markdown`), the
PDF's pages (:mod:`.pages`, :mod:`.figures`, :mod:`.curvature`; shared wording :mod:`.text`) and file
(:mod:`.pdf`). :mod:`.contrast` sets finished reports side by side.
``paper_values.csv`` holds the papers' published numbers.
"""
from .pipeline import AnalysesAsked, build_report
from .layouts import TABLES, paper_values
from .pdf import pdf_page_count, write_pdf
from .records import collect_runs, load_run, method_label
from .tables import build_table
from .verdicts import direction_checks

__all__ = ["build_report", "AnalysesAsked", "write_pdf", "pdf_page_count", "TABLES", "build_table", "collect_runs",
           "direction_checks", "load_run", "method_label", "paper_values"]
