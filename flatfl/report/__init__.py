"""Reports: our results beside the papers' (MAN Table 2 / Table 6, FedAlign Table 1) as CSV, Markdown and one PDF.

    from flatfl.report import build_report
    summary = build_report(["runs/sweep"], "reports/x", compute_missing=True)

:mod:`.tables` collects runs and builds the layouts and direction checks, :mod:`.figures` draws the pages,
:mod:`.pdf` writes everything (``flatfl report``). ``paper_values.csv`` holds the papers' published numbers.
"""
from .pdf import build_report, pdf_page_count, write_pdf
from .tables import TABLES, build_table, collect_runs, direction_checks, load_run, method_label, paper_values

__all__ = ["build_report", "write_pdf", "pdf_page_count", "TABLES", "build_table", "collect_runs",
           "direction_checks", "load_run", "method_label", "paper_values"]
