"""Loading the plug-ins of a registry from an entry-point group, each in isolation: what every registry of flatfl
that other packages extend (estimators, measured quantities) does alike. A plug-in that cannot be imported, raises
(SystemExit included) or gives something its registry refuses is skipped whole (what it registered before failing
is taken back) with one warning line on stderr naming its distribution and entry point; the others and every
command go on. Ctrl-C while one loads is an interruption naming it."""
from __future__ import annotations

import sys
from typing import Any, Callable

from ..errors import ConfigError

__all__ = ["plugin_name", "load_entry_points", "register_each", "loading"]


def plugin_name(point, noun: str, group: str) -> str:
    """'the estimator plug-in NAME = VALUE of the distribution DIST VERSION (entry-point group GROUP)': an entry
    point as its warning names it (``noun``: what the registry holds)."""
    dist = getattr(point, "dist", None)
    meta = getattr(dist, "metadata", None)
    owner = f" of the distribution {meta['Name']} {getattr(dist, 'version', '')}".rstrip() if meta else ""
    return f"the {noun} plug-in {point.name} = {point.value}{owner} (entry-point group {group})"


#: the entry point being loaded in each group (its name), while one is: a registry refuses ``replace=True`` then
_loading: dict[str, str] = {}


def loading(group: str) -> str | None:
    """The name of the entry point of ``group`` being loaded now, None when none is."""
    return _loading.get(group)


def _snapshot(registry: dict) -> dict:
    """The registry's entries, its inner dicts (a registry of kinds) copied one level down."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in registry.items()}


def _restore(registry: dict, before: dict) -> None:
    """Put the registry back as :func:`_snapshot` saw it, its inner dicts changed in place (views of them stay)."""
    for key in [k for k in registry if k not in before]:
        del registry[key]
    for key, value in before.items():
        if isinstance(value, dict) and isinstance(registry.get(key), dict):
            registry[key].clear()
            registry[key].update(value)
        else:
            registry[key] = value


def register_each(found, entry_type: type, register: Callable[[Any], None], noun: str) -> None:
    """Register what an entry point gave: an ``entry_type`` (``register(entry)``), a list of them, or a function of
    no argument that registers them; anything else is a ConfigError ('it gave a str, not NOUN, ...')."""
    for item in (found if isinstance(found, (list, tuple)) else [found]):
        if isinstance(item, entry_type):
            register(item)
        elif callable(item):
            item()
        else:
            raise ConfigError(f"it gave a {type(item).__name__}, not {noun}, a list of them or a function that "
                              "registers them")


def load_entry_points(group: str, noun: str, take: Callable[[Any], None], registry: dict,
                      problems: list[str]) -> None:
    """Load every entry point of ``group``: ``take(loaded object)`` registers what it gives into ``registry`` (a
    dict, or a dict of dicts by kind), which is put back as it was when one fails; :func:`loading` names the one
    being loaded; each skipped one appends its warning line to ``problems``."""
    from importlib.metadata import entry_points

    try:
        points = list(entry_points(group=group))
    except Exception as e:  # noqa: BLE001 - unreadable installed metadata: no plug-ins, one warning
        problems.append(f"the installed packages' entry points cannot be read ({type(e).__name__}: {e})")
        sys.stderr.write(f"flatfl: warning: {problems[-1]}\n")
        return
    for point in points:
        before = _snapshot(registry)
        try:
            _loading[group] = point.name
            take(point.load())
        except KeyboardInterrupt as e:
            e.hint = f"while loading {plugin_name(point, noun, group)}; nothing was written"
            raise
        except BaseException as e:  # noqa: BLE001 - a broken plug-in is skipped with one line, never fatal
            _restore(registry, before)
            if isinstance(e, SystemExit):
                why = f"it called sys.exit({e.code!r}) while loading"
            elif isinstance(e, ConfigError):
                why = str(e)
            else:
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            problems.append(f"{plugin_name(point, noun, group)} is skipped: {why}")
            sys.stderr.write(f"flatfl: warning: {problems[-1]}\n")
        finally:
            _loading.pop(group, None)
