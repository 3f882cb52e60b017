"""``flatfl report``: run directories in; CSV tables, a Markdown summary and one multi-page PDF out.

:func:`build_report` collects every run (config, accuracy curve, Hessian results), computes the missing analyses
when asked (``compute_missing``) or lists them, then writes into ``out``:

* ``runs.csv``: one line per run (method, partition, seed, accuracy, top eigenvalue, trace and its standard error,
  H_N, H_D, the analysis settings);
* ``<table>.csv`` for each paper layout filled (``man-table2.csv``, ``man-table6.csv``, ``fedalign-table1.csv``):
  one line per (method, partition), ours beside the paper's;
* ``directions.csv``: every "X vs X+regularizer" comparison, our change and the paper's, and whether they agree;
* ``report.md``: the tables and the agreement counts as Markdown; ``summary.json``: the same counts, what is missing;
* ``report.pdf``: a title page (the two scales, the agreement counts), per layout its table, its direction checks,
  MAN Fig. 4 pages (top-k eigenvalues and spectral densities of each pair overlaid), accuracy against rounds, loss
  surfaces where computed, then every run, then what is missing.

Every file is written atomically (:mod:`flatfl.utils.io`); the PDF is rendered in memory first.
"""
from __future__ import annotations

import csv
import io
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, FlatflError
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from . import figures
from .tables import (
    METRIC_NAMES,
    TABLES,
    RunRecord,
    build_table,
    direction_checks,
    find_run_dirs,
    load_run,
    matching_tables,
    paper_values,
    scale_label,
    tables_for,
)

__all__ = ["build_report", "write_pdf", "pdf_page_count", "DEFAULT_HESSIAN", "DEFAULT_CLIENTS"]

DEFAULT_HESSIAN = {"top": 1, "trace": True, "density": False, "samples": None, "method": "lanczos", "seed": 0}
DEFAULT_CLIENTS = {"protocol": "default", "probes": 100, "seed": 0}


def write_pdf(pages, path) -> int:
    """Render ``pages`` (matplotlib Figures) into one PDF in memory, then write it atomically. Returns the count."""
    from matplotlib.backends.backend_pdf import FigureCanvasPdf, PdfPages

    buf = io.BytesIO()
    count = 0
    with PdfPages(buf, metadata={"Creator": "flatfl report"}) as pdf:
        for fig in pages:
            FigureCanvasPdf(fig)
            pdf.savefig(fig)
            count += 1
    atomic_write_bytes(path, buf.getvalue())
    return count


def pdf_page_count(data: bytes) -> int:
    """Pages of a PDF from its page-tree root(s): the /Count of every /Type /Pages node that has no /Parent.

    Enough for matplotlib's uncompressed object layout (and most writers'); not a general PDF parser."""
    import re

    total = 0
    for m in re.finditer(rb"<<(?:(?!>>).)*?/Type\s*/Pages\b(?:(?!endobj).)*?>>", data, flags=re.S):
        node = m.group(0)
        if b"/Parent" in node:
            continue
        c = re.search(rb"/Count\s+(\d+)", node)
        if c:
            total += int(c.group(1))
    return total


# ---------------------------------------------------------------------------------------------- what is missing
def _needs(rec: RunRecord, specs) -> list[str]:
    """What the report needs from this run and does not have: 'hessian', 'clients'."""
    need = []
    h = rec.hessian or {}
    has_trace = (h.get("trace") or {}).get("estimate") is not None
    if not h.get("top_eigenvalues") or not has_trace:
        need.append("hessian")
    wants_clients = any(s.key == "fedalign-table1" and rec.method in s.rows and rec.partition in s.partitions
                        for s in specs)
    if wants_clients and (h.get("clients") or {}).get("H_N") is None:
        need.append("clients")
    return need


def _compute_missing(records, specs, hessian: dict, clients: dict, echo) -> list[str]:
    from ..sweep import analyse_run

    problems = []
    for rec in records:
        need = _needs(rec, specs)
        if not need:
            continue
        if not rec.finished:
            problems.append(f"{rec.name}: not finished ({rec.rounds_done}/{rec.config.get('rounds')} rounds); "
                            "resume it with flatfl train --resume")
            continue
        if "clients" in need and not (rec.run_dir / "clients.pt").is_file():
            problems.append(f"{rec.name}: H_N / H_D need the clients' models; train with --save-clients")
            need.remove("clients")
        if not need:
            continue
        t0 = time.perf_counter()
        try:
            # only what is missing: an existing hessian.json (other settings, say top 200) is left as it is
            analyse_run(rec.run_dir, hessian=hessian if "hessian" in need else None,
                        clients=clients if "clients" in need else None)
        except FlatflError as e:
            problems.append(f"{rec.name}: {e}")
            continue
        if echo:
            echo(f"computed {', '.join(need)} for {rec.name} ({time.perf_counter() - t0:.1f} s)")
    return problems


# ---------------------------------------------------------------------------------------------- CSV / Markdown
def _csv(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()


def _run_rows(records: list[RunRecord]) -> list[dict]:
    rows = []
    for r in records:
        h = r.hessian or {}
        s = h.get("settings") or {}
        cl = h.get("clients") or {}
        rows.append({
            "run": r.name, "method": r.method, "partition": r.partition, "dataset": r.dataset, "seed": r.seed,
            "model": r.config.get("model") or "default", "clients": r.config.get("clients"),
            "rounds": r.config.get("rounds"), "rounds_done": r.rounds_done, "finished": r.finished,
            "test_acc": r.accuracy("test_acc"), "all_test_acc": r.accuracy("all_test_acc"),
            "top_eigenvalue": r.value("top_eigenvalue"), "trace": r.value("trace"), "trace_stderr": r.stderr("trace"),
            "hessian_norm_gap": r.value("hessian_norm_gap"), "hessian_norm_gap_stderr": r.stderr("hessian_norm_gap"),
            "hessian_direction": r.value("hessian_direction"),
            "hessian_direction_stderr": r.stderr("hessian_direction"),
            "num_eigenvalues": len(h.get("top_eigenvalues") or []), "density": bool(h.get("density")),
            "hessian_method": s.get("method"), "trace_method": s.get("trace_method"),
            "hessian_samples": h.get("num_samples"), "clients_protocol": cl.get("protocol"),
            "run_dir": str(r.run_dir),
        })
    return rows


def _cell(row: dict, metric: str) -> str:
    v = row[f"ours_{metric}"]
    if v is None:
        return "-"
    err = row[f"ours_{metric}_sd"] if row[f"ours_{metric}_sd"] is not None else row[f"ours_{metric}_se"]
    txt = figures._fmt(v)
    return txt + (f" ±{figures._fmt(err, 2)}" if err is not None else "")


def _summary_counts(checks: list[dict]) -> dict:
    out = {}
    for metric in sorted({c["metric"] for c in checks}):
        cs = [c for c in checks if c["metric"] == metric and c["agrees"] is not None]
        out[metric] = {"compared": len(cs), "agree": sum(c["agrees"] for c in cs),
                       "agree_resolved": sum(bool(c["agrees"] and c["resolved"]) for c in cs),
                       "disagree_resolved": sum(bool(c["agrees"] is False and c["resolved"]) for c in cs)}
    return out


def _counts_line(metric: str, c: dict) -> str:
    line = (f"{METRIC_NAMES.get(metric, metric)}: {c['agree']} of {c['compared']} comparisons point the same way "
            f"as the paper's")
    if c["agree_resolved"] or c["disagree_resolved"]:
        line += (f" ({c['agree_resolved']} agreeing and {c['disagree_resolved']} disagreeing by more than twice "
                 "our uncertainty)")
    return line


def _markdown(specs_rows, ours_scale: str, counts: dict, missing: list[str]) -> str:
    lines = ["# flatfl report", "", ours_scale, ""]
    for spec, rows, checks in specs_rows:
        lines += [f"## {spec.title}", "", spec.paper_scale, ""]
        metrics = list(spec.metrics)
        head = ["method", "partition"] + [f"{METRIC_NAMES[m]} {who}" for m in metrics for who in ("ours", "paper")] \
            + ["runs"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in rows:
            cells = [r["method"], r["partition"]]
            for m in metrics:
                p = r[f"paper_{m}"]
                cells.append(f"{_cell(r, m)} | {figures._fmt(p) if p is not None else '-'}")
            cells.append(str(r["n_runs"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for metric, c in counts.get(spec.key, {}).items():
            lines.append(f"- {_counts_line(metric, c)}")
        for n in spec.notes:
            lines.append(f"- note: {n}")
        lines.append("")
    if missing:
        lines += ["## Missing", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- PDF pages
def _table_figure(spec, rows, records, ours_scale):
    header = ["method"]
    for part in spec.partitions:
        for m in spec.metrics:
            short = {"top_eigenvalue": "λmax", "trace": "trace", "accuracy": "acc %", "hessian_norm_gap": "H_N",
                     "hessian_direction": "H_D"}[m]
            pre = f"{part}\n" if len(spec.partitions) > 1 else ""
            header += [f"{pre}{short} ours", f"{pre}{short} paper"]
    by = {(r["method"], r["partition"]): r for r in rows}
    cells = []
    for method in spec.rows:
        line = [method if spec.paper_name(method) == method else f"{method} ({spec.paper_name(method)})"]
        for part in spec.partitions:
            r = by[(method, part)]
            for m in spec.metrics:
                line += [_cell(r, m), r[f"paper_{m}"]]
        cells.append(line)
    n_runs = sorted({r["n_runs"] for r in rows})
    subtitle = [spec.paper_scale, ours_scale,
                "ours: mean over runs; ± is the spread over seeds, or for one run the estimator's standard error "
                f"(trace, H_N, H_D); runs per cell: {', '.join(map(str, n_runs))}"]
    return figures.table_page(spec.title, header, cells, subtitle=subtitle, notes=list(spec.notes))


def _directions_figure(spec, checks, counts):
    header = ["partition", "comparison", "metric", "ours:\nreference -> compared", "ours\nchange",
              "paper:\nreference -> compared", "paper\nchange", "same\ndirection", "change beyond\n2 x uncertainty"]
    cells, colors = [], []
    for c in checks:
        def pct(v):
            return "-" if v is None else f"{v:+.1f}%"

        agree = {True: "yes", False: "NO", None: "-"}[c["agrees"]]
        cells.append([c["partition"], f"{c['reference']} vs {c['compared']}", METRIC_NAMES[c["metric"]],
                      f"{figures._fmt(c['ours_reference'])} -> {figures._fmt(c['ours_compared'])}",
                      pct(c["ours_change_pct"]),
                      f"{figures._fmt(c['paper_reference'])} -> {figures._fmt(c['paper_compared'])}",
                      pct(c["paper_change_pct"]), agree,
                      {True: "yes", False: "no", None: "-"}[c["resolved"]]])
        col = {True: "#d9f2d9", False: "#f8d7d7", None: None}[c["agrees"]]
        colors.append([None] * 7 + [col, None])
    subtitle = [_counts_line(m, c) for m, c in counts.items()] or ["no comparison has values on both sides"]
    return figures.table_page(f"{spec.title}: direction of each change", header, cells, subtitle=subtitle,
                              highlight=colors, col_widths=[0.09, 0.19, 0.09, 0.15, 0.07, 0.15, 0.07, 0.07, 0.1])


def _run_pages(rows: list[dict]):
    header = ["run", "method", "partition", "seed", "rounds", "test\nacc %", "all-clients\nacc %", "λmax",
              "trace", "trace SE", "H_N", "H_D"]
    per_page = 24
    for start in range(0, max(1, len(rows)), per_page):
        chunk = rows[start:start + per_page]
        cells = [[r["run"][-38:], r["method"], r["partition"], r["seed"],
                  f"{r['rounds_done']}/{r['rounds']}", r["test_acc"], r["all_test_acc"], r["top_eigenvalue"],
                  r["trace"], r["trace_stderr"], r["hessian_norm_gap"], r["hessian_direction"]] for r in chunk]
        yield figures.table_page(f"Every run ({start + 1}-{start + len(chunk)} of {len(rows)})", header, cells,
                                 col_widths=[0.22, 0.11, 0.1, 0.04, 0.05, 0.06, 0.07, 0.07, 0.07, 0.06, 0.07, 0.05])


def build_report(paths, out, *, tables=None, compute_missing: bool = False, hessian: dict | None = None,
                 clients: dict | None = None, device: str = "cpu", title: str = "flatfl report",
                 echo: Callable[[str], None] | None = None) -> dict:
    """Write the report of the runs under ``paths`` into ``out``; returns the summary (also summary.json).

    ``tables``: layout keys ('man-table2', 'man-table6', 'man-tables', 'fedalign-table1'); None picks every layout
    that at least one run fills. ``hessian`` / ``clients``: the settings used for missing analyses when
    ``compute_missing`` (defaults :data:`DEFAULT_HESSIAN`, :data:`DEFAULT_CLIENTS`).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    run_dirs = find_run_dirs(paths)
    records = [load_run(d) for d in run_dirs]
    specs = tables_for(tables) if tables else [TABLES[k] for k in matching_tables(records)]
    problems: list[str] = []
    if compute_missing:
        h = dict(DEFAULT_HESSIAN, **(hessian or {}), device=device)
        c = dict(DEFAULT_CLIENTS, **(clients or {}), device=device)
        problems = _compute_missing(records, specs, h, c, echo)
        records = [load_run(d) for d in run_dirs]
    missing = []
    for rec in records:
        need = _needs(rec, specs)
        if need:
            what = " and ".join({"hessian": "Hessian results (hessian/hessian.json)",
                                 "clients": "H_N / H_D (the 'clients' section of hessian.json)"}[n] for n in need)
            missing.append(f"{rec.name}: no {what}")
    missing += [p for p in problems if p not in missing]
    if missing and not compute_missing:
        missing.append("run 'flatfl report ... --compute-missing' to compute the missing analyses")

    values = paper_values()
    ours_scale = scale_label(records)
    specs_rows, counts, all_checks = [], {}, []
    for spec in specs:
        rows = build_table(spec, records, values)
        checks = direction_checks(spec, rows)
        counts[spec.key] = _summary_counts(checks)
        specs_rows.append((spec, rows, checks))
        all_checks += checks

    # ---- files
    out.mkdir(parents=True, exist_ok=True)
    run_rows = _run_rows(records)
    written = []
    atomic_write_text(out / "runs.csv", _csv(run_rows))
    written.append("runs.csv")
    for spec, rows, _ in specs_rows:
        atomic_write_text(out / f"{spec.key}.csv", _csv(rows))
        written.append(f"{spec.key}.csv")
    if specs_rows:
        atomic_write_text(out / "directions.csv", _csv(all_checks, list(all_checks[0]) if all_checks else
                                                           ["table", "partition", "reference", "compared", "metric"]))
        written.append("directions.csv")
    atomic_write_text(out / "report.md", _markdown(specs_rows, ours_scale, counts, missing))
    written.append("report.md")

    pages, page_titles = [], []

    def add(fig, name):
        pages.append(fig)
        page_titles.append(name)

    sections = [("Scale", list(dict.fromkeys(s.paper_scale for s, _, _ in specs_rows)) + [ours_scale]),
                ("Directions: does each change point the same way as the paper's?",
                 [f"{s.key}: {_counts_line(m, c)}" for s, _, _ in specs_rows for m, c in counts[s.key].items()]
                 or ["no paper layout matched these runs"]),
                ("Runs", [f"{len(records)} run(s); {sum(r.finished for r in records)} finished; "
                          f"{sum(1 for r in records if r.hessian)} with Hessian results"]),
                ("Missing", missing or ["nothing"])]
    add(figures.text_page(title, sections, footer=f"flatfl report, {time.strftime('%Y-%m-%d %H:%M')}"), "summary")
    for spec, rows, checks in specs_rows:
        add(_table_figure(spec, rows, records, ours_scale), f"{spec.key}: table")
        add(_directions_figure(spec, checks, counts[spec.key]), f"{spec.key}: directions")
        spec_records = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
        for ref, cmp_ in spec.comparisons:
            for part in spec.partitions:
                a = [r for r in spec_records if r.method == ref and r.partition == part]
                b = [r for r in spec_records if r.method == cmp_ and r.partition == part]
                pairs = [(x, y) for x in a for y in b if x.seed == y.seed]
                for x, y in pairs[:1]:
                    hx, hy = figures._spectrum_source(x), figures._spectrum_source(y)
                    if (len(hx.get("top_eigenvalues") or []) >= 2 and len(hy.get("top_eigenvalues") or []) >= 2) \
                            or (hx.get("density") and hy.get("density")):
                        add(figures.spectrum_pair_page(x, y, f"{ref} vs {cmp_}, {part}: Hessian spectrum "
                                                             "(as MAN Fig. 4)"), f"{spec.key}: spectrum {ref} {part}")
        groups = defaultdict(list)
        for r in spec_records:
            groups[r.partition].append(r)
        if groups:
            add(figures.accuracy_page(f"{spec.title.split(':')[0]}: accuracy against rounds", groups,
                                      spec.accuracy_column,
                                      subtitle=f"{spec.accuracy_column} of metrics.csv; {ours_scale}"),
                f"{spec.key}: accuracy")
        with_surface = [r for r in spec_records if r.surface_path]
        if with_surface:
            for k in range(0, len(with_surface), 6):
                add(figures.surface_page(f"{spec.title.split(':')[0]}: loss surfaces", with_surface[k:k + 6]),
                    f"{spec.key}: surfaces")
    other = [r for r in records if not any(r.method in s.rows and r.partition in s.partitions for s in specs)]
    if other:
        groups = defaultdict(list)
        for r in other:
            groups[r.partition].append(r)
        add(figures.accuracy_page("Other runs: accuracy against rounds", groups, "test_acc"), "other: accuracy")
    for fig in _run_pages(run_rows):
        add(fig, "runs")
    n_pages = write_pdf(pages, out / "report.pdf")
    written.append("report.pdf")

    summary = {"runs": len(records), "tables": [s.key for s in specs], "directions": counts,
               "missing": missing, "pages": page_titles, "files": written + ["summary.json"],
               "ours_scale": ours_scale}
    atomic_write_json(out / "summary.json", summary)
    assert n_pages == len(page_titles)
    return summary

