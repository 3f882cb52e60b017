"""The PDF's pages, each a matplotlib Figure with its title in the contents: the title page (what the tables found,
scales, models, verdict counts, notices, what is missing, contents), per layout its table, its direction checks,
MAN Fig. 4 spectrum pages (top-k eigenvalues and spectral densities of each pair overlaid), accuracy and curvature
against rounds and loss surfaces where computed, the other runs' curves, then every run."""
from __future__ import annotations

from collections import defaultdict

from . import figure_pages
from .curvature import curvature_page, has_curvature
from .headline import HEADLINE_TITLE, report_headline
from .metrics import metric_title, report_metric
from .run_reader import MODEL_ACCURACY, MODEL_NAMES
from .tables import incomparable_notes
from .text import cell_text, ci_text, counts_line, seeds_cell, setting_parts
from .verdicts import NO_PAPER_VALUE, TOO_FEW_SEEDS

__all__ = ["title_sections", "contents", "table_pages", "other_pages", "run_pages"]

_VERDICT_COLOURS = {"agree": "#d9f2d9", "disagree": "#f8d7d7", "inconclusive": "#f2f2f2", "incomparable": "#fff2cc",
                    TOO_FEW_SEEDS: "#f2f2f2", NO_PAPER_VALUE: "#ffffff"}
#: the effect cell's colour: the forest plot's (:mod:`.forest`), lighter
_EFFECT_COLOURS = {"lower": "#dbe8f5", "higher": "#fbe3d0", "unresolved": "#f2f2f2"}
_DIRECTIONS_LEGEND = [
    "paired: per seed, compared - reference (same partition, initial weights, clients and batches); verdict from its "
    "95% t interval (k-1 dof): inconclusive when it holds 0; effect: lower / higher when that interval excludes "
    "0, else unresolved; 'no paper value': no paper direction to agree with. Unpaired: twice the standard error "
    "of the change of the means (n=k: sd / sqrt(k) per side; est.: the estimator's own error). Seeds for the "
    "paper's change: smallest n with t(0.975, n-1) sd / sqrt(n) < |paper's relative change x our reference|",
    "too few seeds: fewer than 2 seeds a side, so no verdict (one run's error bar is the estimator's own, not the "
    "spread between seeds); its seeds column: '>= 2', or '~n' guessed from the spread of the side with seeds"]


def title_sections(results, records, ours_scale: str, notices: list[str], missing: list[str]) -> list:
    """The title page's sections (the contents are added once every page is known)."""
    return [(HEADLINE_TITLE, report_headline(results)),
            ("Scale", list(dict.fromkeys(t.spec.paper_scale for t in results)) + [ours_scale]
             + [f"{t.spec.key}: {t.difference}" for t in results if t.difference]),
            ("Model", [f"{t.spec.key}: every row measures the {MODEL_NAMES[t.model]} model (accuracy and Hessian)"
                       for t in results] or ["-"]),
            ("Effects and directions: what each interval resolves, and whether it points the paper's way",
             [f"{t.spec.key}: {counts_line(m, c)}" for t in results for m, c in t.counts.items()]
             or ["no paper layout matched these runs"]),
            ("Runs", [f"{len(records)} run(s); {sum(r.finished for r in records)} finished; "
                      f"{sum(1 for r in records if r.has_hessian)} with Hessian results"]),
            ("Notices", notices or ["none"]),
            ("Missing", missing or ["nothing"])]


def contents(page_titles: list[str], width: int = 145) -> list[str]:
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


def _used_settings(rows, metric) -> str:
    """The settings that made a column's numbers, without the model (said once): 'lanczos, 1437 samples'; several
    joined by ' | ' (then the odd ones carry a dagger)."""
    names = tuple(f"{n}, " for n in MODEL_NAMES.values())
    vals = set()
    for r in rows:
        st = r.cells[metric].setting
        if st:
            for one in st.removeprefix("mixed: ").split(" | "):
                vals.add(one[len(next(n for n in names if one.startswith(n))):] if one.startswith(names) else one)
    return " | ".join(sorted(vals)) if vals else "not computed"


def _table_figure(result, ours_scale: str):
    spec, rows = result.spec, result.rows
    multi = len(spec.partitions) > 1
    header = ["method"]
    for part in spec.partitions:
        for m in spec.metrics:
            pre = f"{part}\n" if multi else ""
            header += [f"{pre}{report_metric(m).short} ours", f"{pre}{report_metric(m).short} paper"]
    by = {(r.method, r.partition): r for r in rows}
    cells = []
    for method in [m for m in spec.rows if any((m, part) in by for part in spec.partitions)]:  # rows shown only
        line = [method if spec.paper_name(method) == method else f"{method}\n(paper: {spec.paper_name(method)})"]
        for part in spec.partitions:
            r = by.get((method, part))
            for m in spec.metrics:
                line += [cell_text(r.cells[m], newline=True), r.cells[m].paper] if r is not None else ["", None]
        cells.append(line)
    subtitle = [spec.paper_scale, ours_scale + (f"; {result.difference}" if result.difference else ""),
                f"model: every row measures the {MODEL_NAMES[result.model]} (accuracy and Hessian); "
                + "; ".join(f"{label}: {text}" for label, text in setting_parts(
                    spec.metrics, lambda m: _used_settings(rows, m) if m in spec.metrics else None)),
                "ours: mean ±sd over seeds (n), or for one run ±the estimator's own error (est.; no direction "
                "verdict with fewer than 2 seeds a side); † other settings "
                "than the rest of the column (see the notes)"]
    notes = list(spec.notes) + incomparable_notes(spec, rows)
    return figure_pages.table_page(spec.title, header, cells, subtitle=subtitle, notes=notes, findings=result.findings)


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _direction_cells(c: dict) -> list:
    f = figure_pages.format_number
    two_se = "-" if c["ours_uncertainty"] is None else f"{f(2 * c['ours_uncertainty'], 2)} ({c['uncertainty_from']})"
    return [c["partition"], f"{c['reference']}\nvs {c['compared']}", metric_title(c["metric"]),
            f"{f(c['ours_reference'])} → {f(c['ours_compared'])}", _pct(c["ours_change_pct"]),
            ci_text(c).replace(" k=", "\nk="), two_se, f"{f(c['paper_reference'])} → {f(c['paper_compared'])}",
            _pct(c["paper_change_pct"]), c["effect"],
            f"{c['verdict']}\n({c.get('unpaired_verdict', c['verdict'])})".replace(NO_PAPER_VALUE, "no paper\nvalue"),
            seeds_cell(c)]


def _directions_figures(result) -> list:
    header = ["partition", "comparison", "metric", "ours:\nreference → compared", "ours\nchange",
              "paired: mean diff.\n[95% t interval] k", "unpaired\n± 2 SE (from)", "paper:\nreference → compared",
              "paper\nchange", "effect", "verdict (paired)\n(unpaired)", "seeds for\npaper's change"]
    cells = [_direction_cells(c) for c in result.checks]
    colors = [[None] * 9 + [_EFFECT_COLOURS[c["effect"]], _VERDICT_COLOURS[c["verdict"]], None]
              for c in result.checks]
    subtitle = [counts_line(m, c) for m, c in result.counts.items()] or ["no comparison has values on both sides"]
    title = result.spec.title.split(':')[0]
    pages = []
    n_pages = max(1, -(-len(cells) // 16))  # at most 16 checks a page, spread evenly (no near-empty last page)
    per_page = max(1, -(-len(cells) // n_pages))
    for k in range(0, max(1, len(cells)), per_page):
        part = "" if len(cells) <= per_page else f" ({k // per_page + 1}/{(len(cells) + per_page - 1) // per_page})"
        pages.append(figure_pages.table_page(f"{title}: direction of each change{part}", header, cells[k:k + per_page],
                                        subtitle=subtitle + _DIRECTIONS_LEGEND, highlight=colors[k:k + per_page]))
    return pages


def _tracking_text(tracking: dict) -> str:
    keys = ("every", "samples", "split", "method", "tol", "trace_method", "trace_hvps")
    return ", ".join(f"{k} {tracking.get(k)}" for k in keys if k in tracking)


def _curvature_subtitle(records, ours_scale: str) -> str:
    """What the curvature series measure: the server model, on the runs' tracking settings (config.json)."""
    settings = {_tracking_text(r.tracking) for r in records if r.tracking}
    shown = "; ".join(sorted(settings)) or "settings not recorded"
    return f"server model, every K rounds and the last (flatfl train --track-hessian): {shown}; {ours_scale}"


def _has_spectra(a, b) -> bool:
    """Whether both sides of a pair have a top-k (two or more eigenvalues) or both have a density to draw."""
    ha = [figure_pages.spectrum_source(x) for x in a]
    hb = [figure_pages.spectrum_source(y) for y in b]
    return (any(len(h.get("top_eigenvalues") or []) >= 2 for h in ha)
            and any(len(h.get("top_eigenvalues") or []) >= 2 for h in hb)) \
        or (any(h.get("density") for h in ha) and any(h.get("density") for h in hb))


def _spectrum_pages(result):
    spec, model = result.spec, MODEL_NAMES[result.model]
    for ref, cmp_ in spec.comparisons:
        for part in spec.partitions:
            a = [r for r in result.records if r.method == ref and r.partition == part]
            b = [r for r in result.records if r.method == cmp_ and r.partition == part]
            if a and b and _has_spectra(a, b):
                yield (figure_pages.spectrum_pair_page(a, b, f"{ref} vs {cmp_}, {part}: Hessian spectrum of the {model} "
                                                        "model (as MAN Fig. 4)"), f"{spec.key}: spectrum {ref} {part}")


def _by_partition(records) -> dict:
    groups = defaultdict(list)
    for r in records:
        groups[r.partition].append(r)
    return groups


def _accuracy_pages(result, ours_scale: str):
    spec, model = result.spec, result.model
    groups = _by_partition(result.records)
    if any(r.curve for r in result.records):  # runs read from a runs.csv have no curve
        yield (figure_pages.accuracy_page(f"{spec.title.split(':')[0]}: accuracy against rounds", groups,
                                     MODEL_ACCURACY[model],
                                     subtitle=f"test accuracy of the {MODEL_NAMES[model]} model; {ours_scale}",
                                     ylabel=f"test accuracy, {MODEL_NAMES[model]} (%)", order=spec.rows),
               f"{spec.key}: accuracy")


def _curvature_pages(result, ours_scale: str):
    """flatfl train --track-hessian: each pair X vs X+MAN on one axis."""
    for ref, cmp_ in result.spec.comparisons:
        pair = [r for r in result.records if r.method in (ref, cmp_)]
        if has_curvature(pair) and {r.method for r in pair} == {ref, cmp_}:
            yield (curvature_page(f"{ref} vs {cmp_}: curvature against rounds", pair, [ref, cmp_],
                                  subtitle=_curvature_subtitle(pair, ours_scale)), f"{result.spec.key}: curvature {ref}")


def _surface_pages(result):
    spec = result.spec
    with_surface = sorted((r for r in result.records if r.surface_path),
                          key=lambda r: (spec.partitions.index(r.partition), spec.rows.index(r.method), r.seed))
    if not with_surface:
        return
    per = -(-len(with_surface) // -(-len(with_surface) // 8))  # at most 8 a page, spread evenly
    parts = sorted({r.partition for r in with_surface})
    for k in range(0, len(with_surface), per):
        yield (figure_pages.surface_page(f"{spec.title.split(':')[0]}: loss surfaces of the {MODEL_NAMES[result.model]} "
                                    f"model, {', '.join(parts)}", with_surface[k:k + per]), f"{spec.key}: surfaces")


def table_pages(result, ours_scale: str):
    """(figure, contents title) for every page of one layout, in order."""
    yield _table_figure(result, ours_scale), f"{result.spec.key}: table"
    for k, fig in enumerate(_directions_figures(result)):
        yield fig, f"{result.spec.key}: directions" + (f" {k + 1}" if k else "")
    yield from _spectrum_pages(result)
    yield from _accuracy_pages(result, ours_scale)
    yield from _curvature_pages(result, ours_scale)
    yield from _surface_pages(result)


def other_pages(other, ours_scale: str):
    """(figure, contents title) for the runs no layout takes: accuracy and curvature against rounds."""
    if not any(r.curve for r in other):  # none, or runs read from a runs.csv (no curve)
        return
    yield (figure_pages.accuracy_page("Other runs: accuracy against rounds", _by_partition(other), "test_acc",
                                 ylabel="test accuracy, server (%)"), "other: accuracy")
    if has_curvature(other):
        yield (curvature_page("Other runs: curvature against rounds", other,
                              list(dict.fromkeys(r.method for r in other)),
                              subtitle=_curvature_subtitle(other, ours_scale)), "other: curvature")


def run_pages(rows: list[dict]):
    """'Every run' pages (runs.csv's lines): each number with the settings that made it (the model and samples of
    the Hessian, its eigenvalue and trace methods, the cross-client protocol of H_N / H_D); λmin where the runs'
    analyses computed it (runs.csv then has its column)."""
    low = ["smallest_eigenvalue"] if rows and "smallest_eigenvalue" in rows[0] else []
    header = ["run", "method", "partition", "seed", "rounds", "test\nacc %", "all-clients\nacc %",
              "Hessian of\n(samples)", "λmax / trace\nmethods", "λmax", *(["λmin"] if low else []), "trace",
              "trace SE", "H_N", "H_D", "H_N, H_D\nprotocol"]
    per_page = max(1, -(-len(rows) // max(1, -(-len(rows) // 24))))  # at most 24 a page, spread evenly
    for start in range(0, max(1, len(rows)), per_page):
        chunk = rows[start:start + per_page]
        cells = [[r["run"], r["method"], r["partition"], r["seed"],
                  f"{r['rounds_done']}/{r['rounds']}", r["test_acc"], r["all_test_acc"],
                  f"{r['hessian_model']}\n({r['hessian_samples'] if r['hessian_samples'] is not None else '-'})",
                  f"{r['hessian_method'] or '-'} /\n{r['trace_method'] or '-'}" if r["hessian_method"] else "-",
                  r["top_eigenvalue"], *(r[k] for k in low), r["trace"], r["trace_stderr"], r["hessian_norm_gap"],
                  r["hessian_direction"],
                  r["clients_protocol"] or "-"]
                 for r in chunk]
        yield figure_pages.table_page(f"Every run ({start + 1}-{start + len(chunk)} of {len(rows)})", header, cells), "runs"
