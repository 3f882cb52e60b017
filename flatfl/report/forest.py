"""The report's headline figure: a forest plot of every comparison (the PDF's first page, and ``effects.png`` /
``effects.pdf`` in the report folder).

One panel per table and metric; in each, one line per comparison (compared vs reference, per partition): our change
in % of the reference's mean with its 95% interval, the paper's change marked where the paper gives one. The change
and interval are those the verdict is judged from (:mod:`.verdicts`):

* paired by seed: the mean per-seed difference and its 95% t interval, each in % of the reference's mean;
* unpaired (fewer than two shared seeds): the change of the means +- twice its standard error (dashed);
* no interval (fewer than two seeds a side): the change alone, a hollow marker.

Resolved changes (``effect`` lower / higher) come first, coloured by their direction; the unresolved ones (the
interval holds 0, there is none, or the comparison is incomparable) follow on a grey band below a dashed line, in
grey, so that what the runs resolve reads apart from what they do not.

The page is as wide as A4 landscape and as tall as its lines need (:func:`page_height`): a fixed height a comparison
line and a row of panels, at least :data:`MIN_HEIGHT`, so that one or two comparisons do not sit on a mostly blank
page and eighty are not pressed together. Under its title, the report's headline (:mod:`.headline`): what the
comparisons found, in words.
"""
from __future__ import annotations

from .display import shown
from .headline import report_headline
from .metrics import metric_names, report_metric

__all__ = ["forest_items", "forest_figure", "forest_page", "page_height", "EFFECT_COLOURS", "LINE_IN", "ROW_IN",
           "MIN_HEIGHT", "MAX_HEIGHT", "HEADLINE_SIZE"]

#: the colour of a change by its effect (the directions pages colour their effect cells alike, lighter)
EFFECT_COLOURS = {"lower": "#1f77b4", "higher": "#d95f02", "unresolved": "#8c8c8c"}
_PAPER = dict(marker="D", s=22, facecolors="none", edgecolors="black", linewidths=0.9, zorder=4)
_COLUMNS = 3  # panels a row at most
#: inches: one comparison line; a row of panels besides its lines (its title, the panels' titles, the x axis); the
#: shortest page; the tallest (a PDF page is at most 200 inches); the page's title; the legend's entries
LINE_IN, ROW_IN, MIN_HEIGHT, MAX_HEIGHT = 0.25, 1.3, 4.5, 190.0
_TOP_IN, _LEGEND_IN = 0.45, 0.45
HEADLINE_SIZE = 9.5  # points: the headline under the page's title
_TITLE = "Effects at a glance: each comparison's change, in % of the reference, with its 95% interval"


def _relative(value, reference) -> float | None:
    return None if value is None or not reference else 100.0 * value / abs(reference)


def _label(c: dict, partitions: int) -> str:
    where = f" ({c['partition'].replace('dirichlet-', 'Dir ')})" if partitions > 1 else ""
    why = ""
    if c["verdict"] == "incomparable":
        why = "  [incomparable]"
    elif str(c.get("verdict_from", "")).startswith("none"):
        a, b = c["seeds_reference"], c["seeds_compared"]
        why = f"  [{a} seed{'s' if a != 1 else ''} a side]" if a == b else f"  [{a} / {b} seeds]"
    return shown(f"{c['compared']} vs {c['reference']}{where}{why}", 120)  # a label beside a panel


def forest_items(checks: list[dict], partitions: int = 1) -> list[dict]:
    """One panel's lines from its direction checks, resolved first then unresolved (each in the checks' order):
    ``label``, ``effect``, ``change`` (%), ``low`` / ``high`` (the interval in %, None without one), ``how``
    ('paired', 'unpaired' or 'none') and ``paper`` (the paper's change in %, None without one)."""
    items = []
    for c in checks:
        ref = c["ours_reference"]
        paired = str(c.get("verdict_from", "")).startswith("paired") and c.get("paired_ci_low") is not None
        if paired:
            change, low, high, how = (_relative(c["paired_change"], ref), _relative(c["paired_ci_low"], ref),
                                      _relative(c["paired_ci_high"], ref), "paired")
        elif c.get("ours_uncertainty") is not None and not str(c.get("verdict_from", "")).startswith("none"):
            change, half = c["ours_change_pct"], _relative(2 * c["ours_uncertainty"], ref)
            low, high, how = (None, None, "none") if change is None or half is None else \
                (change - half, change + half, "unpaired")
        else:
            change, low, high, how = c["ours_change_pct"], None, None, "none"
        items.append({"label": _label(c, partitions), "effect": c["effect"], "change": change, "low": low,
                      "high": high, "how": how, "paper": c.get("paper_change_pct")})
    return [i for i in items if i["effect"] != "unresolved"] + [i for i in items if i["effect"] == "unresolved"]


def _metric_title(metric: str) -> str:
    """The panel's title: the metric's label and how its direction reads ('top eigenvalue\n(lower: flatter)')."""
    if metric not in metric_names():
        return metric
    entry = report_metric(metric)
    return f"{entry.label}\n({entry.reading})" if entry.reading else entry.label


def _panels(results) -> list[tuple[str, list[tuple[str, list[dict]]]]]:
    """Rows of panels: (the table's title, its metrics' (title, items) in the table's order), at most
    :data:`_COLUMNS` panels a row."""
    rows = []
    for t in results:
        panels = []
        for metric in t.spec.metrics:
            checks = [c for c in t.checks if c["metric"] == metric]
            if checks:
                panels.append((_metric_title(metric), forest_items(checks, len(t.spec.partitions))))
        name = t.spec.title.split(":")[0]
        rows += [(name if not k else f"{name} (continued)", panels[k:k + _COLUMNS])
                 for k in range(0, len(panels), _COLUMNS)]
    return rows


def _limits(items: list[dict]) -> tuple[float, float]:
    """The panel's x range: 0, every change, the paper's, and the intervals of the resolved changes (an unresolved
    interval reaching further is cut at the edge, with an arrow)."""
    xs = [0.0] + [v for i in items for v in (i["change"], i["paper"]) if v is not None]
    xs += [v for i in items if i["effect"] != "unresolved" for v in (i["low"], i["high"]) if v is not None]
    lo, hi = min(xs), max(xs)
    pad = 0.08 * (hi - lo) or 1.0
    return lo - pad, hi + pad


def _interval(ax, it: dict, y: float, colour: str, lo: float, hi: float) -> None:
    """The interval of one line, cut to [lo, hi] with an arrow head where it reaches further."""
    a, b = max(it["low"], lo), min(it["high"], hi)
    ax.plot([a, b], [y, y], color=colour, lw=1.8 if it["how"] == "paired" else 1.3,
            ls="-" if it["how"] == "paired" else (0, (3, 1.5)), solid_capstyle="butt", zorder=2)
    for cut, end, marker in ((it["low"] < lo, lo, "<"), (it["high"] > hi, hi, ">")):
        if cut:
            ax.plot([end], [y], marker=marker, color=colour, markersize=4.5, zorder=2, clip_on=False)


def _draw_panel(ax, title: str, items: list[dict], apart: bool = True, tick: float = 8.0) -> None:
    """One panel: its lines from the top, ``tick`` points the size of their labels."""
    from ..utils.plots import LABEL_SIZE, PANEL_SIZE, TICK_SIZE

    n = len(items)
    n_resolved = sum(i["effect"] != "unresolved" for i in items)
    apart = apart and all(i["effect"] != "unresolved" for i in items[:n_resolved])  # the unresolved set apart
    ys = list(range(n - 1, -1, -1))  # the first item on top
    if apart and n_resolved < n:  # the unresolved ones on a grey band under a dashed line
        ax.axhspan(-0.5, n - n_resolved - 0.5, color="#f0f0f0", zorder=0)
        if n_resolved:
            ax.axhline(n - n_resolved - 0.5, color="0.45", lw=0.8, ls="--", zorder=1)
    ax.axvline(0.0, color="0.25", lw=0.8, zorder=1)
    lo, hi = _limits(items)
    for y, it in zip(ys, items):
        colour = EFFECT_COLOURS[it["effect"]]
        if it["low"] is not None:
            _interval(ax, it, y, colour, lo, hi)
        if it["change"] is not None:
            hollow = it["how"] == "none" or it["effect"] == "unresolved"
            ax.scatter([it["change"]], [y], s=26, marker="o", zorder=3, linewidths=1.1, edgecolors=colour,
                       facecolors="white" if hollow else colour)
        if it["paper"] is not None:
            ax.scatter([it["paper"]], [y], **_PAPER)
    ax.set_yticks(ys, [it["label"] for it in items], fontsize=tick)
    for tick, it in zip(ax.get_yticklabels(), items):
        tick.set_color("0.35" if it["effect"] == "unresolved" else "black")
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(lo, hi)
    ax.tick_params(axis="x", labelsize=TICK_SIZE)
    ax.set_title(title, fontsize=PANEL_SIZE)
    ax.set_xlabel("change (%)", fontsize=LABEL_SIZE - 1)
    ax.grid(axis="x", color="0.9", lw=0.6)
    ax.set_axisbelow(True)
    if apart and n_resolved < n:
        ax.text(0.99, n - n_resolved - 0.55, "unresolved", transform=ax.get_yaxis_transform(), ha="right",
                va="top", fontsize=6.5, color="0.35", style="italic")


def _legend_handles(items: list[dict]):
    """The legend's entries: the three effects, and the unpaired interval and the paper's change where drawn."""
    from matplotlib.lines import Line2D

    def dot(colour, face, label, ls="-"):
        return Line2D([], [], color=colour, marker="o", markerfacecolor=face, markersize=5, lw=1.6, ls=ls,
                      label=label)

    out = [dot(EFFECT_COLOURS["lower"], EFFECT_COLOURS["lower"], "lower: interval below 0"),
           dot(EFFECT_COLOURS["higher"], EFFECT_COLOURS["higher"], "higher: interval above 0"),
           dot(EFFECT_COLOURS["unresolved"], "white", "unresolved: interval holds 0, or none")]
    if any(it["how"] == "unpaired" for it in items):
        out.append(dot("0.3", "0.3", "unpaired: change of the means ± 2 SE", ls=(0, (3, 1.5))))
    if any(it["paper"] is not None for it in items):
        out.append(Line2D([], [], ls="none", marker="D", markerfacecolor="none", markeredgecolor="black",
                          markersize=5, label="the paper's change"))
    return out


def forest_figure(results, subtitle: str = ""):
    """The forest plot of every layout's comparisons (``results``: :class:`.results.TableResult` s), one page as
    wide as A4 landscape and as tall as its lines need (:func:`forest_page`), headed by the report's headline
    (:func:`.headline.report_headline`)."""
    return forest_page(_panels(results), subtitle, "resolved changes first, unresolved ones apart on grey",
                       headline=report_headline(results))


def page_height(lines: list[int], fixed: float) -> tuple[float, float]:
    """(the page's height, one comparison line's height), in inches, for rows of panels of ``lines`` lines each
    and ``fixed`` inches of title, headline and legend: :data:`LINE_IN` a line and :data:`ROW_IN` a row of panels,
    at least :data:`MIN_HEIGHT` (the rows then take the spare height) and at most :data:`MAX_HEIGHT` (the lines then
    closer together)."""
    need = fixed + ROW_IN * len(lines) + LINE_IN * sum(lines)
    height = min(max(need, MIN_HEIGHT), MAX_HEIGHT)
    line = min(LINE_IN, (height - fixed - ROW_IN * len(lines)) / max(sum(lines), 1))
    return height, max(line, 0.01)


def _text_height(text: str, size: float) -> float:
    """The inches ``text`` (lines already broken) takes at ``size`` points, with matplotlib's line spacing."""
    return (text.count("\n") + 1) * size * 1.2 / 72 if text else 0.0


def forest_page(rows, subtitle: str = "", order: str = "", columns: int = _COLUMNS, apart: bool = True,
                headline=()):
    """One page of forest panels, as wide as A4 landscape and as tall as its lines need (:func:`page_height`):
    ``rows`` of (title, [(panel title, :func:`forest_items`-like lines)]), at most ``columns`` panels a row;
    ``order`` says how each panel's lines are ordered; ``apart``: the unresolved lines (after the resolved ones) on
    a grey band; ``headline``: sentences printed under the page's title (what the comparisons found)."""
    from .figure_pages import PAGE_SIZE
    from ..utils.plots import LEGEND_SIZE, NOTE_SIZE, TICK_SIZE, TITLE_SIZE, new_figure, wrap_to

    fig = new_figure((PAGE_SIZE[0], MIN_HEIGHT))
    fig.suptitle(_TITLE, fontsize=TITLE_SIZE + 2, weight="bold")
    explain = "; ".join(s for s in ("paired by seed: the mean per-seed difference (compared - reference) and its "
                                    "95% t interval", order) if s)
    if not rows:
        fig.text(0.5, 0.5, "no comparison has our values on both sides", ha="center", va="center", fontsize=12)
        return fig
    said = wrap_to(fig, shown("\n".join(headline), 40 * 150), HEADLINE_SIZE, 0.97) if headline else ""
    note = wrap_to(fig, "\n".join(s for s in (explain, subtitle) if s), NOTE_SIZE, 0.9)
    said_in = _text_height(said, HEADLINE_SIZE)
    lines = [max(len(items) for _, items in panels) for _, panels in rows]
    fixed = _TOP_IN + said_in + _LEGEND_IN + _text_height(note, NOTE_SIZE)
    height, line_in = page_height(lines, fixed)
    fig.set_size_inches(PAGE_SIZE[0], height)
    tick = max(4.0, min(TICK_SIZE, 0.6 * 72 * line_in))
    panels_in = [ROW_IN + n * line_in for n in lines]
    spare = (height - fixed) / sum(panels_in)  # > 1 on a page of few lines: the rows, not the headline, take it
    heights = [said_in] * bool(said) + [h * spare for h in panels_in]
    columns = columns if any(len(panels) > 1 for _, panels in rows) else 1
    subs = list(fig.subfigures(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0])
    if said:
        head = subs.pop(0)
        head.text(0.01, 1.0, said, ha="left", va="top", fontsize=HEADLINE_SIZE, transform=head.transSubfigure)
    for sub, (name, panels) in zip(subs, rows):
        sub.suptitle(name, fontsize=TITLE_SIZE, weight="bold", x=0.01, ha="left")
        axes = sub.subplots(1, columns, squeeze=False)[0]
        drawn = None
        for ax, (title, items) in zip(axes, panels):
            _draw_panel(ax, title, items, apart, tick)
            labels = [it["label"] for it in items]
            if labels == drawn:  # the same lines in the same order as the panel to its left: named once
                ax.tick_params(axis="y", labelleft=False)
            drawn = labels
        for ax in axes[len(panels):]:
            ax.set_axis_off()
    every = [it for _, panels in rows for _, items in panels for it in items]
    fig.legend(handles=_legend_handles(every), loc="outside lower center", ncols=5, fontsize=LEGEND_SIZE, frameon=False,
               title=note, title_fontsize=NOTE_SIZE)
    return fig
