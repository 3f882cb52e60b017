"""How the runs of two or more reports were trained differently, for ``flatfl contrast`` (:mod:`.contrast`): the
settings that decide a row's numbers, compared row by row where every report records them (summary.json's
``training``), else each report's difference from the paper's setting (``differences_from_paper``), which covers
only the settings the paper fixes; a setting a report does not record is named as not compared."""
from __future__ import annotations

from ..paper_tables import REPRODUCED
from .layouts import NOT_COMPARED

__all__ = ["settings_that_differ", "settings_differ_line"]


def _setting_name(key: str) -> str:
    return key.removeprefix("params.").replace("_", "-")


def _training_differences(reports: list[dict], labels: list[str], common: list[tuple]) -> list[str]:
    """The settings in which the rows ``common`` to every report were trained differently: 'lr 0.1 (A) vs 0.05 (B)',
    each report's values over the rows that differ ('/'-joined), and those rows when not all of them differ."""
    found: dict[str, list[tuple]] = {}
    for key in common:
        settings = [r["training"][key] for r in reports]
        for name in dict.fromkeys(n for s in settings for n in s):
            if len({s.get(name, "not set") for s in settings}) > 1:
                found.setdefault(name, []).append(key)
    out = []
    for name, keys in found.items():
        values = ["/".join(dict.fromkeys(r["training"][k].get(name, "not set") for k in keys)) for r in reports]
        where = ""
        if len(keys) < len(common):
            rows = list(dict.fromkeys(f"{k[1]} {k[2]}" for k in keys))
            where = " in " + ", ".join(rows[:4]) + (f" and {len(rows) - 4} more rows" if len(rows) > 4 else "")
        out.append(f"{_setting_name(name)} " + " vs ".join(f"{v} ({label})" for v, label in zip(values, labels))
                   + where)
    return out


def _paper_entries(text: str, table: str) -> dict[str, tuple[str, str]]:
    """A table's 'differs from the paper: lr 0.05 (paper 0.1); ...' as {setting: (ours, paper's)}, for the settings
    of the table's paper preset (whose names :func:`.layouts.paper_differences` writes)."""
    preset = (REPRODUCED[table].presets.get("paper") or {}) if table in REPRODUCED else {}
    names = sorted([k.replace("_", " ") for k in preset.get("run", {})]
                   + [f"Hessian {k.replace('_', ' ')}" for k in preset.get("hessian", {})], key=len, reverse=True)
    out = {}
    for entry in text.removeprefix("differs from the paper: ").split("; "):
        name = next((n for n in names if entry.startswith(n + " ")), None)
        cut = entry.rfind(" (paper ")
        if name and cut > len(name) and entry.endswith(")"):
            out[name] = (entry[len(name) + 1:cut], entry[cut + len(" (paper "):-1])
    return out


def _not_recorded(text: str) -> list[str]:
    """The settings a report's differences from the paper name as not recorded ('Hessian settings': all of them)."""
    return text[text.index(NOT_COMPARED) + len(NOT_COMPARED):].split(", ") if NOT_COMPARED in text else []


def _paper_differences(reports: list[dict], labels: list[str]) -> list[str]:
    """The paper preset's settings in which the reports differ, from their differences from the paper (a setting a
    report does not name is the paper's, unless it says it does not record it: then it is named as not compared)."""
    out, unknown = [], {}  # label -> the settings it does not record
    for table in [t for t in reports[0]["tables"] if all(t in r["tables"] for r in reports[1:])]:
        texts = [r["differences"].get(table) or "" for r in reports]
        entries = [_paper_entries(text, table) for text in texts]
        missing = [_not_recorded(text) for text in texts]
        unknown.update({label: m for label, m in zip(labels, missing) if label not in unknown})
        for name in dict.fromkeys(n for e in entries for n in e):
            paper = next(e[name][1] for e in entries if name in e)
            if any(name in m or (name.startswith("Hessian ") and "Hessian settings" in m) for m in missing):
                continue
            values = [e[name][0] if name in e else paper for e in entries]
            line = f"{name} " + " vs ".join(f"{v} ({label})" for v, label in zip(values, labels))
            if len(set(values)) > 1 and line not in out:
                out.append(line)
    out += [f"not compared, since {label} does not record them: " + ", ".join(names)
            for label, names in unknown.items() if names]
    return out


def settings_that_differ(reports: list[dict], labels: list[str]) -> tuple[list[str] | None, str]:
    """The training settings in which the reports differ, and where they were read: each row's settings where every
    report records them (summary.json's ``training``) for a row they share, else each report's differences from the
    paper's setting (``differences_from_paper``); (None, '') when neither says."""
    if all(r.get("training") is not None for r in reports):
        common = [k for k in reports[0]["training"] if all(k in r["training"] for r in reports[1:])]
        if common:
            return _training_differences(reports, labels, common), "training"
    if all(r.get("differences") for r in reports):
        return _paper_differences(reports, labels), "differences_from_paper"
    return None, ""


def settings_differ_line(differ: list[str] | None, source: str) -> str:
    """The sentence contrast.md and the command show of :func:`settings_that_differ`."""
    if differ is None:
        return "settings that differ: not known (the reports do not record how their runs were trained)"
    if source == "differences_from_paper":
        where = " (among the settings the paper fixes; these reports record no others)"
        return f"settings that differ{where}: " + ("; ".join(differ) if differ else "none")
    return "settings that differ: " + ("; ".join(differ) if differ else
                                       "none (every row the reports share was trained alike)")
