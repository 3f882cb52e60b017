"""The report's headline: what its tables found, in a few sentences computed from its own direction checks (the
top of ``report.md``, the PDF's first page and title page, ``effects.png``, ``summary.json``'s ``headline``), and
the same for a contrast, per report.

Each comparison (compared vs reference, per partition and metric) counts once, by the change its forest line draws:
the mean per-seed difference where the verdict is paired by seed, else the change of the means; a change within
:data:`TIE` of the reference's size is no change (float noise). The sentences say, per metric:

* how many changes fell, rose or stayed, and how many of each the report's interval resolves (``effect`` lower /
  higher: the 95% interval the verdict is judged from excludes 0), and how those intervals were made (paired by
  seed over k seeds, unpaired, none with fewer than 2 seeds a side);
* the verdicts on the paper's direction (agree / disagree / inconclusive, paired by seed where possible), or that
  the paper gives no value;
* how our setting differs from the paper's (:func:`.layouts.paper_differences`), where it does.

The comparisons are grouped by what they compare: the methods measured against one shared reference ("each method
against FedAvg"), else the pairs that add one regularizer ("with MAN": X+MAN against X), else "each compared
method against its reference". Nothing is written per table: any report, or contrast, gets its own sentences.
"""
from __future__ import annotations

from collections import Counter

from .display import shown
from .layouts import NOT_COMPARED
from .metrics import metric_names, report_metric
from .paired import LEVEL
from .verdicts import NO_PAPER_VALUE, TOO_FEW_SEEDS

__all__ = ["TIE", "HEADLINE_TITLE", "check_items", "row_items", "headline", "report_headline", "contrast_headline"]

#: a change within this fraction of its reference's magnitude is counted as none (the rounding of float sums)
TIE = 1e-9
HEADLINE_TITLE = "What the tables found"
_LEVEL = f"{100 * LEVEL:g}%"
_NAME = 60  # the characters of a method's or report's name a headline shows


def _sign(change, reference) -> int | None:
    if change is None:
        return None
    scale = abs(reference) if reference else 1.0
    return 0 if abs(change) <= TIE * scale else (1 if change > 0 else -1)


def _item(c: dict, sign: int | None, resolved: str | None, how: str, k) -> dict:
    return {"metric": c["metric"], "reference": str(c["reference"]), "compared": str(c["compared"]),
            "sign": None if c["verdict"] == "incomparable" else sign, "resolved": resolved,
            "verdict": c["verdict"], "paper": c.get("paper_change_pct") is not None, "how": how, "k": k}


def check_items(checks: list[dict]) -> list[dict]:
    """The headline's view of a report's direction checks (:mod:`.verdicts`): per check its metric, pair, the sign
    of the change drawn (-1, 0, +1; None when incomparable), what its interval resolves ('lower' / 'higher' /
    None), its verdict, whether the paper gives a change, and how its interval was made ('paired' over ``k`` seeds,
    'unpaired', 'none')."""
    items = []
    for c in checks:
        source = str(c.get("verdict_from") or "")
        how = "paired" if source.startswith("paired") else "none" if source.startswith("none") else "unpaired"
        change = c.get("paired_change") if how == "paired" and c.get("paired_change") is not None \
            else c.get("ours_change")
        resolved = c.get("effect") if c.get("effect") in ("lower", "higher") else None
        items.append(_item(c, _sign(change, c.get("ours_reference")), resolved, how,
                           c.get("paired_seeds") if how == "paired" else None))
    return items


def row_items(rows: list[dict]) -> list[dict]:
    """The headline's view of one report's contrast rows (:func:`.contrast.contrast_rows`): the change in % over the
    seeds of its paired interval, resolved where that interval excludes 0; a row without a paired interval is
    'none' (fewer than 2 seeds a side) or 'not paired' (fewer than 2 shared seeds), unresolved."""
    items = []
    for r in rows:
        low, high = r.get("ci_low_pct"), r.get("ci_high_pct")
        paired = low is not None and high is not None
        resolved = None if not paired else "lower" if high < 0 else "higher" if low > 0 else None
        how = "paired" if paired else "none" if r["verdict"] == TOO_FEW_SEEDS else "not paired"
        items.append(_item(r, _sign(r.get("ours_change_pct"), 100.0), resolved, how,
                           r.get("paired_seeds") if paired else None))
    return items


def _metric_word(metric: str) -> str:
    return report_metric(metric).label if metric in metric_names() else shown(metric, _NAME)


def _groups(items: list[dict]) -> list[tuple[str, list[dict]]]:
    """(subject, items): the pairs of a reference shared by two or more compared methods, per reference; the rest
    as one group, 'with R' when every one of them adds the same regularizer R to its reference."""
    pairs = list(dict.fromkeys((i["reference"], i["compared"]) for i in items))
    shared = [ref for ref, n in Counter(ref for ref, _ in pairs).items() if n >= 2]
    out = [(f"Each method against {shown(ref, _NAME)}", [i for i in items if i["reference"] == ref]) for ref in shared]
    rest = [i for i in items if i["reference"] not in shared]
    if rest:
        added = {i["compared"][len(i["reference"]) + 1:] if i["compared"].startswith(i["reference"] + "+") else None
                 for i in rest}
        reg = next(iter(added)) if len(added) == 1 else None
        out.append((f"With {shown(reg, _NAME)} (X+{shown(reg, _NAME)} against X)" if reg
                    else "Each compared method against its reference", rest))
    return out


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _metric_effects(metric: str, items: list[dict]) -> str:
    """'the trace fell in 8 of 12 comparisons (6 resolved) and rose in 4 (2 resolved)'."""
    n = len(items)
    parts = []
    for sign, verb, side in ((-1, "fell", "lower"), (1, "rose", "higher"), (0, "was unchanged", None)):
        mine = [i for i in items if i["sign"] == sign]
        if mine:
            done = sum(i["resolved"] == side for i in mine) if side else 0
            of = f" of {n} comparison{'s' if n != 1 else ''}" if not parts else ""
            parts.append(f"{verb} in {len(mine)}{of}" + (f" ({done or 'none'} resolved)" if side else ""))
    apart = sum(i["sign"] is None for i in items)
    if not parts:
        return (f"the {_metric_word(metric)} incomparable in {apart} of {n} comparison{'s' if n != 1 else ''} "
                "(trained or measured otherwise)")
    return f"the {_metric_word(metric)} " + _join(parts) + (
        f", {apart} incomparable (trained or measured otherwise)" if apart else "")


def _effects_sentences(items: list[dict], metrics: list[str]) -> list[str]:
    out = []
    for subject, group in _groups(items):
        parts = [_metric_effects(m, [i for i in group if i["metric"] == m]) for m in metrics
                 if any(i["metric"] == m for i in group)]
        out.append(f"{subject}: " + "; ".join(parts) + ".")
    return out


def _seeds(ks) -> str:
    ks = sorted(set(ks))
    return f"{ks[0]} seeds" if len(ks) == 1 else f"{ks[0]}-{ks[-1]} seeds"


def _intervals_sentence(items: list[dict]) -> str:
    """How 'resolved' was judged: paired by seed over how many seeds, or otherwise."""
    judged = [i for i in items if i["sign"] is not None]
    by = Counter(i["how"] for i in judged)
    paired = [i["k"] for i in judged if i["how"] == "paired"]
    if not judged:
        return ""
    if by["paired"] == len(judged):
        return (f"Resolved: the {_LEVEL} t interval of the per-seed differences ({_seeds(paired)}) excludes 0; "
                "an unresolved change is within the spread between seeds.")
    if not by["paired"] and not by["unpaired"]:
        return ("No change is resolved: " + ("no comparison has 2 seeds a side, so there is no interval between "
                                             "seeds" if by["none"] == len(judged) else
                                             "no comparison has a paired interval") + ".")
    n = by["paired"]
    where = [f"where the {_LEVEL} t interval of the per-seed differences over {_seeds(paired)} excludes 0 "
             f"({n} comparison{'s' if n != 1 else ''})"] if n else []
    if by["unpaired"]:
        where.append(f"unpaired, where the change of the means exceeds twice its standard error ({by['unpaired']})")
    rest = [f"no interval with fewer than 2 seeds a side ({by['none']})" if by["none"] else "",
            f"no paired interval ({by['not paired']})" if by["not paired"] else ""]
    rest = [r for r in rest if r]
    return "Resolved " + ", or ".join(where) + (f"; {_join(rest)}, counted unresolved" if rest else "") + "."


def _paper_sentence(items: list[dict], metrics: list[str]) -> str:
    if not any(i["paper"] for i in items):
        return "The paper gives no value for these comparisons: there is no direction of its to agree with."
    parts = []
    for m in metrics:
        mine = [i for i in items if i["metric"] == m]
        if not any(i["paper"] for i in mine):
            parts.append(f"{_metric_word(m)} no paper value")
            continue
        v = Counter(i["verdict"] for i in mine)
        text = f"{_metric_word(m)} {v['agree']} agree, {v['disagree']} disagree, {v['inconclusive']} inconclusive"
        extra = [f"{v[TOO_FEW_SEEDS]} without a verdict (fewer than 2 seeds a side)" if v[TOO_FEW_SEEDS] else "",
                 f"{v['incomparable']} incomparable" if v["incomparable"] else "",
                 f"{v[NO_PAPER_VALUE]} without a paper value" if v[NO_PAPER_VALUE] else ""]
        parts.append(text + "".join(f", {e}" for e in extra if e))
    return "Against the paper's direction: " + "; ".join(parts) + "."


def _setting_sentence(differences) -> str:
    """How our setting differs from the paper's (:func:`.layouts.paper_differences` of each table), shortly."""
    texts = [d for d in dict.fromkeys(differences) if d]
    if not texts:
        return ""
    prefix = "differs from the paper: "
    items = list(dict.fromkeys(p for t in texts for p in t.removeprefix(prefix).split("; ")))
    differ = [p for p in items if not p.startswith(NOT_COMPARED)]
    unknown = any(NOT_COMPARED in t for t in texts)
    if not differ:
        if unknown:
            return "Some settings are not recorded, so not compared with the paper's (the scale line names them)."
        return "The runs have the paper's setting."
    more = len(differ) - 2
    listed = "; ".join(shown(p, 120) for p in differ[:2]) + (f"; {more} more on the scale line" if more > 0 else "")
    return (f"Not the paper's setting ({listed}" + ("; some settings not recorded" if unknown else "")
            + "): compare directions with the paper's, not sizes.")


def headline(items: list[dict], differences=()) -> list[str]:
    """The headline's sentences from :func:`check_items` (or :func:`row_items`) and the tables' differences from
    the paper's setting: the changes per metric, how they were resolved, the verdicts on the paper's direction, the
    setting. One sentence when there is no comparison."""
    if not items:
        return ["No comparison has our values on both sides, so there is no change to count."]
    metrics = list(dict.fromkeys(i["metric"] for i in items))
    out = _effects_sentences(items, metrics) + [_intervals_sentence(items), _paper_sentence(items, metrics),
                                                _setting_sentence(differences)]
    return [s for s in out if s]


def report_headline(results) -> list[str]:
    """A report's headline from its :class:`.results.TableResult` s (every table's checks together)."""
    if not results:
        return ["No table layout matched these runs, so there is no comparison to count."]
    return headline(check_items([c for t in results for c in t.checks]),
                    [getattr(t, "difference", None) for t in results])


def _lower(sentence: str) -> str:
    return sentence[:1].lower() + sentence[1:]


def contrast_headline(rows: list[dict], labels: list[str]) -> list[str]:
    """A contrast's headline: each report's changes and verdicts on the paper's direction (:func:`headline`'s
    sentences of its rows), headed by its label; how 'resolved' was judged once where every report judged alike."""
    out, judged = [], {}
    for label in labels:
        items, name = row_items([r for r in rows if r["report"] == label]), shown(label, _NAME)
        if not items:
            out.append(f"{name}: no comparison has its values on both sides.")
            continue
        metrics = list(dict.fromkeys(i["metric"] for i in items))
        out += [f"{name}, {_lower(s)}" for s in _effects_sentences(items, metrics) + [_paper_sentence(items, metrics)]]
        judged[name] = _intervals_sentence(items)
    if len(set(judged.values())) == 1:
        return out + [s for s in judged.values()][:1]
    return out + [f"{name}: {s}" for name, s in judged.items() if s]
