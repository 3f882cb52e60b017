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

import io
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, FlatflError
from ..utils.device import resolve_device
from ..utils.hessian_settings import HessianSettings
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, csv_text
from ..utils.lock import locks_output
from . import figures
from .curvature import curvature_page, has_curvature
from .paired import MAX_SEEDS
from .tables import (
    METRIC_NAMES,
    MODEL_ACCURACY,
    MODEL_NAMES,
    TABLES,
    TOO_FEW_SEEDS,
    RunRecord,
    build_table,
    choose_clients_protocol,
    direction_checks,
    find_run_dirs,
    incomparable_notes,
    load_run,
    check_runs_belong_together,
    version_notices,
    matching_tables,
    model_for,
    paper_differences,
    paper_values,
    scale_label,
    tables_for,
)

__all__ = ["build_report", "write_pdf", "pdf_page_count", "DEFAULT_HESSIAN", "DEFAULT_CLIENTS"]

# a density asked of --compute-missing averages 4 SLQ starts of 100 Lanczos steps (one start is spiky)
DEFAULT_HESSIAN = dict({k: v for k, v in HessianSettings().to_dict().items()
                        if k in ("top", "trace", "density", "samples", "method", "seed")}, density_starts=4)
DEFAULT_CLIENTS = {"protocol": "default", "probes": 100, "seed": 0}


def write_pdf(pages, path) -> int:
    """Render ``pages`` (matplotlib Figures) into one PDF in memory, then write it atomically. Returns the count."""
    from matplotlib.backends.backend_pdf import FigureCanvasPdf, PdfPages

    buf = io.BytesIO()
    count = 0
    # no creation date: the same runs give the same bytes (README, "same numbers")
    with PdfPages(buf, metadata={"Creator": "flatfl report", "CreationDate": None}) as pdf:
        for fig in pages:
            FigureCanvasPdf(fig)
            pdf.savefig(fig)
            count += 1
    atomic_write_bytes(path, buf.getvalue())
    return count


def made_at() -> str:
    """When the report is made, for its title page: ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention, in UTC)
    when set, so that the same runs give the same PDF bytes; else the local time now. A ConfigError line when the
    variable is not a non-negative integer."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return time.strftime("%Y-%m-%d %H:%M")
    if not raw.isdigit() or len(raw) > 12:
        raise ConfigError(f"SOURCE_DATE_EPOCH must be a non-negative integer (seconds since 1970), got {raw!r}")
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(int(raw)))


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
    if wants_clients and (rec.clients or {}).get("H_N") is None:
        need.append("clients")
    return need


def _folder_tag(asked: dict) -> str:
    parts = []
    for k, v in sorted(asked.items()):
        if k in ("device", "quiet", "data_dir"):
            continue
        parts.append(k if v is True else f"no{k}" if v is False else f"{k}{v if v is not None else 'all'}")
    return "-".join(parts).replace("_", "").replace(".", "p") or "default"


def _settings_ok(asked: dict):
    from ..runs import settings_match

    if not asked:
        return None
    return lambda h: settings_match(h.get("settings"), asked)


def _compute_missing(records, specs, hessian: dict, asked: dict, clients: dict, echo) -> tuple[list, list]:
    """Compute, for every run, what the report lacks: a Hessian of the run's model with the settings asked for
    (``asked``: the options the user gave; an analysis made with other settings is kept where it is and the asked
    one is computed into a folder of its own), and H_N / H_D. Returns (problems, what was done)."""
    from ..runs import analyse_run, analysis_dir

    problems, done = [], []
    for rec in records:
        need = _needs(rec, specs)
        if not need:
            continue
        if not rec.finished:  # listed by build_report as not finished
            continue
        if "clients" in need and not (rec.run_dir / "clients.pt").is_file():
            problems.append(f"{rec.name}: H_N / H_D need the clients' models; train with --save-clients")
            need.remove("clients")
        if not need:
            continue
        folder = analysis_dir("hessian", rec.model)
        if folder in rec.stale:  # it measured an earlier round: kept where it is, the final model's goes beside it
            folder = f"{folder}-round{rec.config.get('rounds')}"
        other = [n for n in rec.analyses if n == folder]
        if "hessian" in need and other:
            folder = f"{folder}-{_folder_tag(asked)}"  # never overwrite (nor silently keep) other settings
        t0 = time.perf_counter()
        try:
            analyse_run(rec.run_dir, hessian=hessian if "hessian" in need else None,
                        clients=clients if "clients" in need else None, model=rec.model, hessian_dir=folder)
        except FlatflError as e:
            problems.append(f"{rec.name}: {e}")
            continue
        what = []
        if "hessian" in need:
            what.append(f"the Hessian of the {MODEL_NAMES[rec.model]} model into {folder}/"
                        + (f" (the analysis in {other[0]}/ has other settings and is kept)" if other else ""))
        if "clients" in need:
            what.append("H_N / H_D")
        line = f"computed for {rec.name}: {', '.join(what)} ({time.perf_counter() - t0:.1f} s)"
        done.append(line)
        if echo:
            echo(line)
    return problems, done


def _pick_clients(records, specs) -> list[str]:
    """Make every layout's H_N / H_D column one protocol where its runs allow it (:func:`choose_clients_protocol`);
    returns a notice for each layout whose runs hold results of more than one protocol (which one is shown)."""
    out = []
    for spec in specs:
        if "hessian_norm_gap" not in spec.metrics:
            continue
        recs = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
        proto = choose_clients_protocol(recs)
        for r in recs:
            r.select_clients(proto)
        held = sorted({p for r in recs for p in r.clients_all})
        if len(held) > 1:
            used = sorted({(r.clients or {}).get("protocol", "?") for r in recs if r.clients})
            out.append(f"{spec.key}: the runs hold H_N / H_D of the {' and '.join(held)} protocols; the table shows "
                       f"the {' / '.join(used)} protocol's (each protocol's results: clients-<protocol>.json)")
    return out


def _sample_notices(records) -> list[str]:
    """A notice for every Hessian whose asked sample count exceeded the split (it used the whole split)."""
    out = []
    for rec in records:
        h = rec.hessian or {}
        asked = (h.get("settings") or {}).get("samples")
        used = h.get("num_samples")
        if asked is not None and used is not None and int(asked) > int(used):
            out.append(f"{rec.name}: {int(asked):,} samples asked for the Hessian, the split has {int(used):,}: "
                       f"all {int(used):,} used (the tables show the samples actually used)")
    return out


# ---------------------------------------------------------------------------------------------- CSV / Markdown
def _shown_path(path) -> str:
    """A run folder as the tables show it: relative to the current folder when inside it (so that a report made by
    the same command in another clone is the same file), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _run_rows(records: list[RunRecord]) -> list[dict]:
    rows = []
    for r in records:
        h = r.hessian or {}
        s = h.get("settings") or {}
        cl = r.clients or {}
        rows.append({
            "run": r.name, "method": r.method, "partition": r.partition, "dataset": r.dataset, "seed": r.seed,
            "hessian_model": MODEL_NAMES[r.model], "hessian_dir": r.hessian_dir,
            "model": r.config.get("model") or "default", "clients": r.config.get("clients"),
            "rounds": r.config.get("rounds"), "rounds_done": r.rounds_done, "finished": r.finished,
            "test_acc": r.accuracy("test_acc"), "all_test_acc": r.accuracy("all_test_acc"),
            "top_eigenvalue": r.value("top_eigenvalue"), "trace": r.value("trace"), "trace_stderr": r.stderr("trace"),
            "hessian_norm_gap": r.value("hessian_norm_gap"), "hessian_norm_gap_stderr": r.stderr("hessian_norm_gap"),
            "hessian_direction": r.value("hessian_direction"),
            "hessian_direction_stderr": r.stderr("hessian_direction"),
            "num_eigenvalues": len(h.get("top_eigenvalues") or []), "density": bool(h.get("density")),
            "hessian_method": s.get("method"), "trace_method": s.get("trace_method"),
            "hessian_samples": h.get("num_samples"), "hessian_samples_asked": s.get("samples"),
            "clients_protocol": cl.get("protocol"),
            "run_dir": _shown_path(r.run_dir),
        })
    return rows


def _cell(row: dict, metric: str, newline: bool = False) -> str:
    """'mean ±sd (n=3)' over seeds; one run: 'value ±se (est.)' with the estimator's own error, if any; a dagger
    when the value was computed with other settings than its column's."""
    v = row[f"ours_{metric}"]
    if v is None:
        return "-"
    n, sd, se = row[f"ours_{metric}_n"], row[f"ours_{metric}_sd"], row[f"ours_{metric}_se"]
    txt = figures.format_number(v) + row.get(f"ours_{metric}_mark", "")
    sep = "\n" if newline else " "
    if n >= 2 and sd is not None:
        txt += f"{sep}±{figures.format_number(sd, 2)} (n={n})"
    elif se is not None:
        txt += f"{sep}±{figures.format_number(se, 2)} (est.)"
    return txt


_VERDICT_NAMES = ("agree", "disagree", "inconclusive", "incomparable", TOO_FEW_SEEDS)


def _summary_counts(checks: list[dict]) -> dict:
    """Per metric: how many checks, the verdicts (paired by seed where possible), and the unpaired verdicts."""
    out = {}
    for metric in sorted({c["metric"] for c in checks}):
        cs = [c for c in checks if c["metric"] == metric]
        out[metric] = {"compared": len(cs), **{v: sum(c["verdict"] == v for c in cs) for v in _VERDICT_NAMES},
                       "paired": sum(c.get("verdict_from", "").startswith("paired") for c in cs),
                       "unpaired": {v: sum(c.get("unpaired_verdict", c["verdict"]) == v for c in cs)
                                    for v in _VERDICT_NAMES}}
    return out


def counts_line(metric: str, c: dict) -> str:
    n_paired = c.get("paired", 0)
    how = ("paired by seed: 95% t interval of the per-seed differences" if n_paired == c["compared"] else
           f"{n_paired} paired by seed (95% t interval of the per-seed differences), the others unpaired"
           if n_paired else "unpaired: change within twice its standard error")
    judged = c["compared"] - c.get(TOO_FEW_SEEDS, 0) - c.get("incomparable", 0)
    line = (f"{METRIC_NAMES.get(metric, metric)}: of {c['compared']} comparisons, {c['agree']} agree with the "
            f"paper's direction, {c['disagree']} disagree, {c['inconclusive']} inconclusive"
            + (f" ({how})" if judged else ""))
    if c.get("incomparable"):
        line += f", {c['incomparable']} incomparable (trained or measured with other settings)"
    if c.get(TOO_FEW_SEEDS):
        line += (f", {c[TOO_FEW_SEEDS]} without a verdict (fewer than 2 seeds a side: the only error bar would be "
                 "the estimator's own, not the spread between seeds)")
    u = c.get("unpaired")
    if n_paired and u:
        line += (f"; unpaired (means +- 2 SE): {u['agree']} agree, {u['disagree']} disagree, "
                 f"{u['inconclusive']} inconclusive")
    return line


def _final_train_loss(records, method, part) -> float | None:
    vals = [r.curve[-1].get("train_loss") for r in records if r.method == method and r.partition == part and r.curve]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


# Notes from measurements made outside the report (an independent FedDyn+MAN loop, issue 17); shown, marked as
# curated, only beside a table holding the rows they concern.
CURATED_NOTES = {
    ("man-table2", "FedDyn"): ("on digits an independent FedDyn+MAN loop found that MAN raises FedDyn's trace while "
                               "the top eigenvalue mostly falls: FedDyn alone drives the training loss to ~1e-3, "
                               "and MAN moves curvature into the shrunken early layers."),
}


def _needed_text(c: dict) -> str:
    """', ~N seeds would resolve the paper's relative change' for an inconclusive paired check, else ''."""
    if c["verdict"] == TOO_FEW_SEEDS:
        if c.get("seeds_needed"):
            return (f", about {c['seeds_needed']} seeds a side would resolve a change of the paper's size (guessed "
                    "from the spread of the side with seeds)")
        return ", at least 2 seeds a side are needed to judge it"
    if c.get("seeds_needed") is not None:
        return f", {c['seeds_needed']} seeds would resolve a change of the paper's size"
    if c.get("paper_size_change") is not None and c.get("paired_sd") is not None:
        return f", more than {MAX_SEEDS:,} seeds needed for a change of the paper's size"
    return ""


def _seeds_cell(c: dict) -> str:
    """The 'seeds for the paper's change' cell: the count for an inconclusive check; for one without a verdict
    (fewer than 2 seeds a side) the count guessed from the other side's spread ('~N'), else '>= 2'."""
    if c["verdict"] == TOO_FEW_SEEDS:
        return f"~{c['seeds_needed']}" if c.get("seeds_needed") else ">= 2"
    if c["verdict"] != "inconclusive":
        return ""
    return str(c["seeds_needed"]) if c.get("seeds_needed") else "-"


def _ci_text(c: dict) -> str:
    """'-0.43 [-0.9, 0.04] k=3' (paired mean difference and its 95% t interval), '-' without one."""
    if c.get("paired_ci_low") is None:
        return "-"
    f = figures.format_number
    return f"{f(c['paired_change'], 3)} [{f(c['paired_ci_low'], 2)}, {f(c['paired_ci_high'], 2)}] k={c['paired_seeds']}"


def _directions_markdown(checks: list[dict]) -> list[str]:
    """A Markdown table of the direction checks: our change, paired by seed and unpaired, beside the paper's."""
    if not checks:
        return []
    head = ["comparison", "partition", "metric", "ours: reference → compared", "change", "paired: mean difference "
            "[95% t interval] seeds", "unpaired ± 2 SE", "paper change", "verdict (paired)", "unpaired verdict",
            "seeds for the paper's change"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = figures.format_number
    for c in checks:
        pct = "-" if c["ours_change_pct"] is None else f"{c['ours_change_pct']:+.1f}%"
        ppct = "-" if c["paper_change_pct"] is None else f"{c['paper_change_pct']:+.1f}%"
        two_se = "-" if c["ours_uncertainty"] is None else f"±{f(2 * c['ours_uncertainty'], 2)}"
        need = _seeds_cell(c)
        lines.append("| " + " | ".join([
            f"{c['compared']} vs {c['reference']}", c["partition"], METRIC_NAMES.get(c["metric"], c["metric"]),
            f"{f(c['ours_reference'])} → {f(c['ours_compared'])}", pct, _ci_text(c), two_se, ppct, c["verdict"],
            c.get("unpaired_verdict", c["verdict"]), need]) + " |")
    return lines


def findings(spec, rows, checks, records) -> list[str]:
    """What agrees with the paper, what does not, from the numbers: per metric the counts and which rows, the final
    training losses of disagreeing pairs (a measured hint), then curated notes, marked as such."""
    out = []
    by_metric = defaultdict(list)
    for c in checks:
        by_metric[c["metric"]].append(c)
    for metric, cs in by_metric.items():
        name = METRIC_NAMES.get(metric, metric)
        for verdict, word in (("agree", "agree with the paper"), ("disagree", "DISAGREE with the paper"),
                              ("inconclusive", "inconclusive"),
                              ("incomparable", "incomparable (trained or measured with other settings)"),
                              (TOO_FEW_SEEDS, "without a verdict (fewer than 2 seeds a side)")):
            sel = [c for c in cs if c["verdict"] == verdict]
            if not sel:
                continue
            which = "; ".join(f"{c['compared']} vs {c['reference']} {c['partition']} "
                              f"({'-' if c['ours_change_pct'] is None else format(c['ours_change_pct'], '+.0f')}%"
                              f"{'' if c['paper_change_pct'] is None else ', paper ' + format(c['paper_change_pct'], '+.0f') + '%'}"
                              f"{_needed_text(c) if verdict in ('inconclusive', TOO_FEW_SEEDS) else ''}"
                              f"{'; ' + c['incomparable_because'] if c.get('incomparable_because') else ''})"
                              for c in sel)
            out.append(f"{name}: {len(sel)} of {len(cs)} {word}: {which}")
    loss_pairs = sorted({(c["reference"], c["compared"], c["partition"]) for c in checks if c["verdict"] == "disagree"})
    for ref, cmp_, part in loss_pairs:
        la, lb = _final_train_loss(records, ref, part), _final_train_loss(records, cmp_, part)
        if la is not None and lb is not None:
            out.append(f"measured: final training loss {ref} {figures.format_number(la, 3)}, {cmp_} {figures.format_number(lb, 3)} "
                       f"({part})")
    methods = {r["method"] for r in rows if r["n_runs"]}
    for (key, method), note in CURATED_NOTES.items():
        if key == spec.key and method in methods:
            out.append(f"curated note (measured outside this report): {note}")
    return out or ["no comparison has our values on both sides"]


def _contents(page_titles: list[str], width: int = 145) -> list[str]:
    """The PDF's pages by title, runs of pages with one title as a range ("pp. 12-13 runs"), packed into lines of
    at most ``width`` characters."""
    lines, k = [], 0
    while k < len(page_titles):
        j = k
        while j + 1 < len(page_titles) and page_titles[j + 1] == page_titles[k]:
            j += 1
        where = f"p. {k + 1}" if j == k else f"pp. {k + 1}-{j + 1}"
        entry = f"{where} {page_titles[k]}"
        if lines and len(lines[-1]) + 4 + len(entry) <= width:
            lines[-1] += "  |  " + entry
        else:
            lines.append(entry)
        k = j + 1
    return lines


def _markdown(specs_rows, ours_scale: str, counts: dict, missing: list[str], notices: list[str],
              differences: dict | None = None) -> str:
    lines = ["# flatfl report", "", ours_scale, ""]
    if notices:
        lines += ["## Notices", ""] + [f"- {n}" for n in notices] + [""]
    for spec, rows, checks, found, model in specs_rows:
        diff = (differences or {}).get(spec.key)
        lines += [f"## {spec.title}", "", spec.paper_scale, ""] + ([ours_scale + "; " + diff, ""] if diff else []) + [
                  f"Every row measures one model: the {MODEL_NAMES[model]} (accuracy and Hessian alike). Ours: mean "
                  "±sd over seeds (n), or for one run ±the estimator's own error (est.); no direction verdict with "
                  "fewer than 2 seeds a side.", ""]
        metrics = list(spec.metrics)
        head = ["method", "partition", "model"] + [f"{METRIC_NAMES[m]} {who}" for m in metrics
                                                   for who in ("ours", "paper")] + ["settings", "runs"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in rows:
            cells = [r["method"], r["partition"], r["model"] or "-"]
            for m in metrics:
                p = r[f"paper_{m}"]
                cells.append(f"{_cell(r, m)} | {figures.format_number(p) if p is not None else '-'}")
            cells.append("; ".join(f"{label}: {text}" for label, text in _setting_parts(
                metrics, lambda m: r.get(f"ours_{m}_setting"))) or "-")
            cells.append(str(r["n_runs"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for metric, c in counts.get(spec.key, {}).items():
            lines.append(f"- {counts_line(metric, c)}")
        lines += ["", "Direction of each change (paired: compared - reference per seed, mean and 95% t interval with "
                  "k - 1 degrees of freedom; seeds for the paper's change: the smallest n with "
                  "t(0.975, n-1) * sd / sqrt(n) < |paper's relative change x our reference|):", ""]
        lines += _directions_markdown(checks)
        lines += ["", "Findings:", ""] + [f"- {f}" for f in found]
        for n in list(spec.notes) + incomparable_notes(spec, rows):
            lines.append(f"- note: {n}")
        lines.append("")
    if missing:
        lines += ["## Missing", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- PDF pages
SHORT = {"top_eigenvalue": "λmax", "trace": "trace", "accuracy": "acc %", "hessian_norm_gap": "H_N",
         "hessian_direction": "H_D"}


def _used_settings(rows, metric) -> str:
    """The settings that made a column's numbers, without the model (said once): 'lanczos, 1437 samples'; several
    joined by ' | ' (then the odd ones carry a dagger)."""
    names = tuple(f"{n}, " for n in MODEL_NAMES.values())
    vals = set()
    for r in rows:
        st = r.get(f"ours_{metric}_setting")
        if st:
            for one in st.removeprefix("mixed: ").split(" | "):
                vals.add(one[len(next(n for n in names if one.startswith(n))):] if one.startswith(names) else one)
    return " | ".join(sorted(vals)) if vals else "not computed"


SETTING_LABEL = {"top_eigenvalue": "λmax", "trace": "trace", "hessian_norm_gap": "H_N", "hessian_direction": "H_D"}


def _setting_parts(metrics, setting_of) -> list[tuple[str, str]]:
    """(label, settings) for every metric with settings; H_N and H_D as one 'H_N, H_D' where they agree."""
    parts = []
    for m in metrics:
        if m not in SETTING_LABEL or not setting_of(m):
            continue
        if m == "hessian_direction" and setting_of("hessian_norm_gap") == setting_of(m):
            parts = [("H_N, H_D", t) if lab == "H_N" else (lab, t) for lab, t in parts]
            continue
        parts.append((SETTING_LABEL[m], setting_of(m)))
    return parts


def _table_figure(spec, rows, ours_scale, model, found, difference=None):
    multi = len(spec.partitions) > 1
    header = ["method"]
    for part in spec.partitions:
        for m in spec.metrics:
            pre = f"{part}\n" if multi else ""
            header += [f"{pre}{SHORT[m]} ours", f"{pre}{SHORT[m]} paper"]
    by = {(r["method"], r["partition"]): r for r in rows}
    cells = []
    for method in spec.rows:
        line = [method if spec.paper_name(method) == method else f"{method}\n(paper: {spec.paper_name(method)})"]
        for part in spec.partitions:
            r = by[(method, part)]
            for m in spec.metrics:
                line += [_cell(r, m, newline=True), r[f"paper_{m}"]]
        cells.append(line)
    subtitle = [spec.paper_scale, ours_scale + (f"; {difference}" if difference else ""),
                f"model: every row measures the {MODEL_NAMES[model]} (accuracy and Hessian); "
                + "; ".join(f"{label}: {text}" for label, text in _setting_parts(
                    spec.metrics, lambda m: _used_settings(rows, m) if m in spec.metrics else None)),
                "ours: mean ±sd over seeds (n), or for one run ±the estimator's own error (est.; no direction "
                "verdict with fewer than 2 seeds a side); † other settings "
                "than the rest of the column (see the notes)"]
    notes = list(spec.notes) + incomparable_notes(spec, rows)
    return figures.table_page(spec.title, header, cells, subtitle=subtitle, notes=notes, findings=found)


def _directions_figure(spec, checks, counts):
    header = ["partition", "comparison", "metric", "ours:\nreference → compared", "ours\nchange",
              "paired: mean diff.\n[95% t interval] k", "unpaired\n± 2 SE (from)", "paper:\nreference → compared",
              "paper\nchange", "verdict (paired)\n(unpaired)", "seeds for\npaper's change"]
    cells, colors = [], []
    for c in checks:
        def pct(v):
            return "-" if v is None else f"{v:+.1f}%"

        two_se = "-" if c["ours_uncertainty"] is None else \
            f"{figures.format_number(2 * c['ours_uncertainty'], 2)} ({c['uncertainty_from']})"
        cells.append([c["partition"], f"{c['reference']}\nvs {c['compared']}", METRIC_NAMES[c["metric"]],
                      f"{figures.format_number(c['ours_reference'])} → {figures.format_number(c['ours_compared'])}",
                      pct(c["ours_change_pct"]), two_se,
                      f"{figures.format_number(c['paper_reference'])} → {figures.format_number(c['paper_compared'])}",
                      pct(c["paper_change_pct"]), f"{c['verdict']}\n({c.get('unpaired_verdict', c['verdict'])})",
                      _seeds_cell(c)])
        cells[-1].insert(5, _ci_text(c).replace(" k=", "\nk="))
        col = {"agree": "#d9f2d9", "disagree": "#f8d7d7", "inconclusive": "#f2f2f2",
               "incomparable": "#fff2cc", TOO_FEW_SEEDS: "#f2f2f2"}[c["verdict"]]
        colors.append([None] * 9 + [col, None])
    subtitle = [counts_line(m, c) for m, c in counts.items()] or ["no comparison has values on both sides"]
    pages = []
    n_pages = max(1, -(-len(cells) // 16))  # at most 16 checks a page, spread evenly (no near-empty last page)
    per_page = max(1, -(-len(cells) // n_pages))
    for k in range(0, max(1, len(cells)), per_page):
        part = "" if len(cells) <= per_page else f" ({k // per_page + 1}/{(len(cells) + per_page - 1) // per_page})"
        pages.append(figures.table_page(f"{spec.title.split(':')[0]}: direction of each change{part}", header,
                                        cells[k:k + per_page], subtitle=subtitle + [
                                            "paired: per seed, compared - reference (same partition, initial "
                                            "weights, clients and batches); verdict from its 95% t interval (k-1 "
                                            "dof): inconclusive when it holds 0. Unpaired: twice the standard error "
                                            "of the change of the means (n=k: sd / sqrt(k) per side; est.: the "
                                            "estimator's own error). Seeds for the paper's change: smallest n with "
                                            "t(0.975, n-1) sd / sqrt(n) < |paper's relative change x our reference|",
                                            "too few seeds: fewer than 2 seeds a side, so no verdict (one run's error "
                                            "bar is the estimator's own, not the spread between seeds); its seeds "
                                            "column: '>= 2', or '~n' guessed from the spread of the side with seeds"],
                                        highlight=colors[k:k + per_page]))
    return pages


def _curvature_subtitle(records, ours_scale: str) -> str:
    """What the curvature series measure: the server model, on the runs' tracking settings (config.json)."""
    settings = {_tracking_text(r.tracking) for r in records if r.tracking}
    shown = "; ".join(sorted(settings)) or "settings not recorded"
    return f"server model, every K rounds and the last (flatfl train --track-hessian): {shown}; {ours_scale}"


def _tracking_text(tracking: dict) -> str:
    keys = ("every", "samples", "split", "method", "tol", "trace_method", "trace_hvps")
    return ", ".join(f"{k} {tracking.get(k)}" for k in keys if k in tracking)


def _run_pages(rows: list[dict]):
    """'Every run' pages: each number with the settings that made it (the model and samples of the Hessian, its
    eigenvalue and trace methods, the cross-client protocol of H_N / H_D)."""
    header = ["run", "method", "partition", "seed", "rounds", "test\nacc %", "all-clients\nacc %",
              "Hessian of\n(samples)", "λmax / trace\nmethods", "λmax", "trace", "trace SE", "H_N", "H_D",
              "H_N, H_D\nprotocol"]
    per_page = max(1, -(-len(rows) // max(1, -(-len(rows) // 24))))  # at most 24 a page, spread evenly
    for start in range(0, max(1, len(rows)), per_page):
        chunk = rows[start:start + per_page]
        cells = [[r["run"], r["method"], r["partition"], r["seed"],
                  f"{r['rounds_done']}/{r['rounds']}", r["test_acc"], r["all_test_acc"],
                  f"{r['hessian_model']}\n({r['hessian_samples'] if r['hessian_samples'] is not None else '-'})",
                  f"{r['hessian_method'] or '-'} /\n{r['trace_method'] or '-'}" if r["hessian_method"] else "-",
                  r["top_eigenvalue"], r["trace"], r["trace_stderr"], r["hessian_norm_gap"], r["hessian_direction"],
                  r["clients_protocol"] or "-"]
                 for r in chunk]
        yield figures.table_page(f"Every run ({start + 1}-{start + len(chunk)} of {len(rows)})", header, cells)


@locks_output  # one writer per report folder
def build_report(paths, out, *, tables=None, compute_missing: bool = False, hessian: dict | None = None,
                 clients: dict | None = None, device: str = "cpu", title: str = "flatfl report",
                 echo: Callable[[str], None] | None = None, model: str | None = None) -> dict:
    """Write the report of the runs under ``paths`` into ``out``; returns the summary (also summary.json).

    ``tables``: layout keys ('man-table2', 'man-table6', 'man-tables', 'fedalign-table1'); None picks every layout
    that at least one run fills. ``model``: 'server' or 'clients-average', the model every row measures (accuracy
    and Hessian); None: each layout's default (:func:`~flatfl.report.tables.model_for`). ``hessian``: the Hessian
    settings asked for; with ``compute_missing`` a run lacking a Hessian of its model with those settings gets one
    (into a folder of its own when an analysis with other settings exists), without it such a run is listed as
    missing; the table then uses only analyses with the asked settings. ``clients``: H_N / H_D settings
    (defaults :data:`DEFAULT_HESSIAN`, :data:`DEFAULT_CLIENTS`).
    """
    stamp = made_at()  # checked before any work
    asked = {k: v for k, v in (hessian or {}).items() if v is not None or k == "samples"}
    if compute_missing:  # one error line before any work, not one per run
        resolve_device(device)
        HessianSettings.from_mapping(dict(DEFAULT_HESSIAN, **asked, device=device), "the Hessian settings asked for")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    run_dirs = find_run_dirs(paths)
    records = [load_run(d) for d in run_dirs]
    check_runs_belong_together(records)
    specs = tables_for(tables) if tables else [TABLES[k] for k in matching_tables(records)]
    settings_ok = _settings_ok(asked)

    def model_of(rec):
        for spec in specs:
            if rec.method in spec.rows and rec.partition in spec.partitions:
                return model_for(spec, model)
        return model_for(specs[0], model) if specs else (model or "server")

    for rec in records:
        rec.select(model_of(rec), settings_ok)
    notices: list[str] = []
    problems: list[str] = []
    if compute_missing:
        h = dict(DEFAULT_HESSIAN, **asked, device=device)
        c = dict(DEFAULT_CLIENTS, **(clients or {}), device=device)
        problems, done = _compute_missing(records, specs, h, asked, c, echo)
        notices += done
        records = [load_run(d) for d in run_dirs]
        for rec in records:
            rec.select(model_of(rec), settings_ok)
    notices += _pick_clients(records, specs)
    if asked:
        notices.append("Hessian settings asked for: " + ", ".join(f"{k} {v}" for k, v in sorted(asked.items()))
                       + "; only analyses made with them are used")
    sample_notes = _sample_notices(records)
    notices += sample_notes
    notices += version_notices(records)
    missing = []
    for rec in records:
        if not rec.finished:
            missing.append(f"{rec.name}: not finished ({rec.rounds_done}/{rec.config.get('rounds')} rounds): left "
                           f"out of every table column; resume it with flatfl train --resume {rec.run_dir}")
            continue
        need = _needs(rec, specs)
        if need:
            what = " and ".join({"hessian": f"Hessian results of the {MODEL_NAMES[rec.model]} model"
                                            + (" with the asked settings" if asked else ""),
                                 "clients": "H_N / H_D"}[n] for n in need)
            stale = "".join(f"; {n}/ measured round {r}, the run's last round is {rec.config.get('rounds')}"
                            for n, r in sorted(rec.stale.items()))
            missing.append(f"{rec.name}: no {what}{stale}")
    missing += [p for p in problems if p not in missing]
    if missing and not compute_missing:
        missing.append("run 'flatfl report ... --compute-missing' to compute the missing analyses")

    values = paper_values()
    ours_scale = scale_label(records)
    specs_rows, counts, all_checks, differences = [], {}, [], {}
    for spec in specs:
        m = model_for(spec, model)
        spec_records = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
        rows = build_table(spec, spec_records, values)
        checks = direction_checks(spec, rows)
        counts[spec.key] = _summary_counts(checks)
        differences[spec.key] = paper_differences(spec, spec_records)
        specs_rows.append((spec, rows, checks, findings(spec, rows, checks, spec_records), m))
        all_checks += checks

    # ---- files
    out.mkdir(parents=True, exist_ok=True)
    run_rows = _run_rows(records)
    written = []
    atomic_write_text(out / "runs.csv", csv_text(run_rows))
    written.append("runs.csv")
    for spec, rows, *_ in specs_rows:
        columns = [k for k in rows[0] if not isinstance(rows[0][k], dict) and not k.endswith("_by_seed")
                   and k != "training"] if rows else None
        atomic_write_text(out / f"{spec.key}.csv", csv_text(rows, columns))
        written.append(f"{spec.key}.csv")
    if specs_rows:
        columns = list(all_checks[0]) if all_checks else ["table", "partition", "reference", "compared", "metric"]
        atomic_write_text(out / "directions.csv", csv_text(all_checks, columns))
        written.append("directions.csv")
    atomic_write_text(out / "report.md", _markdown(specs_rows, ours_scale, counts, missing, notices, differences))
    written.append("report.md")

    pages, page_titles = [], []

    def add(fig, name):
        pages.append(fig)
        page_titles.append(name)

    sections = [("Scale", list(dict.fromkeys(s.paper_scale for s, *_ in specs_rows)) + [ours_scale]
                 + [f"{k}: {d}" for k, d in differences.items() if d]),
                ("Model", [f"{s.key}: every row measures the {MODEL_NAMES[m]} model (accuracy and Hessian)"
                           for s, _, _, _, m in specs_rows] or ["-"]),
                ("Directions: does each change point the same way as the paper's?",
                 [f"{s.key}: {counts_line(m, c)}" for s, *_ in specs_rows for m, c in counts[s.key].items()]
                 or ["no paper layout matched these runs"]),
                ("Runs", [f"{len(records)} run(s); {sum(r.finished for r in records)} finished; "
                          f"{sum(1 for r in records if r.hessian)} with Hessian results"]),
                ("Notices", notices or ["none"]),
                ("Missing", missing or ["nothing"])]
    add(None, "summary")  # drawn last, when the contents are known
    for spec, rows, checks, found, m in specs_rows:
        add(_table_figure(spec, rows, ours_scale, m, found, differences[spec.key]), f"{spec.key}: table")
        for k, fig in enumerate(_directions_figure(spec, checks, counts[spec.key])):
            add(fig, f"{spec.key}: directions" + (f" {k + 1}" if k else ""))
        spec_records = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
        for ref, cmp_ in spec.comparisons:
            for part in spec.partitions:
                a = [r for r in spec_records if r.method == ref and r.partition == part]
                b = [r for r in spec_records if r.method == cmp_ and r.partition == part]
                if not a or not b:
                    continue
                ha = [figures.spectrum_source(x) for x in a]
                hb = [figures.spectrum_source(y) for y in b]
                if (any(len(h.get("top_eigenvalues") or []) >= 2 for h in ha)
                        and any(len(h.get("top_eigenvalues") or []) >= 2 for h in hb)) \
                        or (any(h.get("density") for h in ha) and any(h.get("density") for h in hb)):
                    add(figures.spectrum_pair_page(a, b, f"{ref} vs {cmp_}, {part}: Hessian spectrum of the "
                                                         f"{MODEL_NAMES[m]} model (as MAN Fig. 4)"),
                        f"{spec.key}: spectrum {ref} {part}")
        groups = defaultdict(list)
        for r in spec_records:
            groups[r.partition].append(r)
        if groups:
            add(figures.accuracy_page(f"{spec.title.split(':')[0]}: accuracy against rounds", groups,
                                      MODEL_ACCURACY[m],
                                      subtitle=f"test accuracy of the {MODEL_NAMES[m]} model; {ours_scale}",
                                      ylabel=f"test accuracy, {MODEL_NAMES[m]} (%)", order=spec.rows),
                f"{spec.key}: accuracy")
        for ref, cmp_ in spec.comparisons:  # flatfl train --track-hessian: X vs X+MAN on one axis
            pair = [r for r in spec_records if r.method in (ref, cmp_)]
            if has_curvature(pair) and {r.method for r in pair} == {ref, cmp_}:
                add(curvature_page(f"{ref} vs {cmp_}: curvature against rounds", pair, [ref, cmp_],
                                   subtitle=_curvature_subtitle(pair, ours_scale)), f"{spec.key}: curvature {ref}")
        with_surface = sorted((r for r in spec_records if r.surface_path),
                              key=lambda r: (spec.partitions.index(r.partition), spec.rows.index(r.method), r.seed))
        if with_surface:
            per = -(-len(with_surface) // -(-len(with_surface) // 8))  # at most 8 a page, spread evenly
            parts = sorted({r.partition for r in with_surface})
            for k in range(0, len(with_surface), per):
                add(figures.surface_page(f"{spec.title.split(':')[0]}: loss surfaces of the {MODEL_NAMES[m]} "
                                         f"model, {', '.join(parts)}", with_surface[k:k + per]),
                    f"{spec.key}: surfaces")
    other = [r for r in records if not any(r.method in s.rows and r.partition in s.partitions for s in specs)]
    if other:
        groups = defaultdict(list)
        for r in other:
            groups[r.partition].append(r)
        add(figures.accuracy_page("Other runs: accuracy against rounds", groups, "test_acc",
                                  ylabel="test accuracy, server (%)"), "other: accuracy")
        if has_curvature(other):
            add(curvature_page("Other runs: curvature against rounds", other,
                               list(dict.fromkeys(r.method for r in other)),
                               subtitle=_curvature_subtitle(other, ours_scale)), "other: curvature")
    for fig in _run_pages(run_rows):
        add(fig, "runs")
    sections.append(("Contents", _contents(page_titles)))
    pages[0] = figures.text_page(title, sections, footer=f"flatfl report, {stamp}")
    n_pages = write_pdf(pages, out / "report.pdf")
    written.append("report.pdf")

    summary = {"runs": len(records), "tables": [s.key for s in specs], "directions": counts,
               "models": {s.key: m for s, _, _, _, m in specs_rows}, "notices": notices,
               "missing": missing, "pages": page_titles, "files": written + ["summary.json"],
               "ours_scale": ours_scale, "differences_from_paper": differences}
    atomic_write_json(out / "summary.json", summary)
    assert n_pages == len(page_titles)
    return summary
