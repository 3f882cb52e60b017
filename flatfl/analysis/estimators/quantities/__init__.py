"""The registry of measured quantities, torch-free: a quantity is one more number an analysis measures of the
curvature operator beside its eigenvalues, trace and density (``flatfl hessian --measure NAME``), such as the
squared Frobenius norm. One :class:`Quantity` per name carries its function, how result lines, figures and the
report name it, and a bound on the products it spends (the progress bar's). Everything generic is done once, for
every quantity: the option and its check (:class:`~flatfl.analysis.commands.hessian_settings.HessianSettings`'
``measure``), its own seed stream, its phase of the progress bar, hessian.json's ``quantities`` section and its
checks where read, the result line, a report column where runs measured it (:mod:`flatfl.report.metrics`) and
two metrics.csv columns when training tracks it (``flatfl train --track-measure``).

A new quantity is one file:

* inside flatfl, a module of this package that defines ``QUANTITY = Quantity(...)`` at its top level and imports
  torch only inside its functions (the command line lists the quantities without importing torch). The modules are
  found when the registry is first asked (:func:`quantity_names`), in alphabetical order;
* in another package, an object named in the entry-point group ``flatfl.quantities`` (a :class:`Quantity`, a list
  of them, or a function of no argument that registers them), or a call of :func:`register_quantity`.

A quantity's ``function(op, settings, seed)`` gets the operator (:class:`~flatfl.analysis.operators.linear_operator.
CurvatureOperator`), the analysis' settings (it reads what it needs, e.g. the trace's budget ``trace_hvps`` and
``trace_rtol``) and its seed (the analysis' ``seed + 5``: the same vectors whichever other quantities run), and
returns a JSON-ready dict holding at least ``estimate`` (a finite number), ``stderr`` (its standard error or a bound
on its error; None when it has none) and ``hvps`` (the products it spent). A name already taken is refused in one
line; a plug-in that fails to load is skipped with one warning line, never fatal.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Any, Callable

from ....errors import ConfigError, unknown_name
from ....utils.plugins import loading

__all__ = ["Quantity", "register_quantity", "unregister_quantity", "quantity", "quantity_names", "parse_measure",
           "measure_record", "recorded_names", "QUANTITY_NAME", "QUANTITY_SEED_OFFSET", "PLUGIN_PROBLEMS"]

#: the offset of every quantity's seed from the analysis' seed (the eigenvalues take seed, the trace seed + 1, the
#: density seed + 2, the per-layer blocks seed + 3, the smallest eigenvalues seed + 4)
QUANTITY_SEED_OFFSET = 5
ENTRY_POINT_GROUP = "flatfl.quantities"
#: a quantity's name: a word of lower-case letters, digits and '_' (it names a hessian.json key and a CSV column)
QUANTITY_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Quantity:
    """One measured quantity: its ``name`` (``--measure NAME``, its key in hessian.json's ``quantities`` and its
    report column), ``title`` (how result lines and tables name it: "squared Frobenius norm"), a one-line
    ``description`` (the option's help), ``function(op, settings, seed) -> dict`` (see the module's docstring),
    ``max_products(settings, dim) -> int``, the most products it spends (the progress bar's bound), and for the
    report its ``short`` column title and ``reading`` ("lower: flatter")."""

    name: str
    title: str
    description: str
    function: Callable[..., dict]
    max_products: Callable[[Any, int], int]
    short: str = ""
    reading: str = ""

    def measure(self, op, settings, seed: int) -> dict:
        """Run the quantity on ``op``; its record checked (``estimate`` a finite number, ``stderr`` a non-negative
        number or None, ``hvps`` the products ``op`` counted), a ConfigError line naming the quantity otherwise."""
        import json
        import math

        from ...operators.linear_operator import as_operator

        op = as_operator(op, f"the quantity {self.name!r}")
        before = op.hvps
        record = self._call(self.function, op, settings, seed)
        if not isinstance(record, dict):
            raise ConfigError(f"the quantity {self.name!r} gave a {type(record).__name__}, not a dict holding "
                              "estimate, stderr and hvps")
        estimate, stderr, hvps = record.get("estimate"), record.get("stderr"), record.get("hvps")
        if not _real(estimate) or not math.isfinite(estimate):
            raise ConfigError(f"the quantity {self.name!r} gave the estimate {estimate!r}, not a finite number")
        if stderr is not None and not (_real(stderr) and 0 <= stderr < math.inf):
            raise ConfigError(f"the quantity {self.name!r} gave the standard error {stderr!r}, not a finite number "
                              ">= 0 or None")
        if isinstance(hvps, bool) or not isinstance(hvps, int) or hvps < 0:
            raise ConfigError(f"the quantity {self.name!r} gave hvps {hvps!r}, not a count of products")
        if hvps != op.hvps - before:
            raise ConfigError(f"the quantity {self.name!r} says it spent {hvps} products; the operator counted "
                              f"{op.hvps - before}")
        try:
            json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as e:  # what hessian.json could not hold
            raise ConfigError(f"the quantity {self.name!r} gave a record that is not JSON of finite numbers "
                              f"({' '.join(str(e).split())[:120]})") from None
        return record

    def _call(self, fn, *args):
        """``fn(*args)``, a function of this quantity's, run as code of its author's
        (:func:`flatfl.utils.user_code.user_code`: what it changes of the process is put back); what it raises, but
        a ConfigError line of its own, is one ConfigError line naming the quantity, the function and where."""
        from ....utils.user_code import user_code

        try:
            with user_code(f"the quantity {self.name}"):
                return fn(*args)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the quantity's own failure, named as its
            code = e.__traceback__  # its innermost frame: where it was raised
            while code is not None and code.tb_next is not None:
                code = code.tb_next
            where = f" at {code.tb_frame.f_code.co_filename}:{code.tb_lineno}" if code is not None else ""
            text = " ".join(str(e).split())[:200]
            raise ConfigError(f"the quantity {self.name!r} failed in {getattr(fn, '__qualname__', fn)!s}{where}: "
                              f"{type(e).__name__}: {text}") from None

    def bound(self, settings, dim: int) -> int:
        """``max_products(settings, dim)``, checked: a ConfigError line naming the quantity when it is not a count."""
        most = self._call(self.max_products, settings, dim)
        if isinstance(most, bool) or not isinstance(most, int) or most < 0:
            raise ConfigError(f"the quantity {self.name!r} bounds its products by {most!r}, not a count")
        return most


def _real(value) -> bool:
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_REGISTRY: dict[str, Quantity] = {}
_found = False  # whether the built-in modules and the entry points were read
#: one line per plug-in entry point that was skipped (what its warning said)
PLUGIN_PROBLEMS: list[str] = []


def register_quantity(entry: Quantity, *, replace: bool = False) -> Quantity:
    """Register ``entry`` (checked) and return it. A name already taken is a ConfigError unless ``replace`` (which a
    plug-in loading through the entry points cannot pass)."""
    if not isinstance(entry, Quantity):
        raise ConfigError(f"register_quantity takes a Quantity, got a {type(entry).__name__}")
    _find()  # the built-in ones first: a name of theirs is taken before any call registers it
    name = entry.name
    if not isinstance(name, str) or not QUANTITY_NAME.fullmatch(name):
        raise ConfigError(f"a quantity's name must be lower-case letters, digits and '_', starting with a letter; "
                          f"got {name!r}")
    for field in ("title", "description"):
        value = getattr(entry, field)
        if not isinstance(value, str) or not value.strip() or "\n" in value:
            raise ConfigError(f"quantity {name!r}: {field} must be one non-empty line, got {value!r}")
    for field in ("short", "reading"):
        if not isinstance(getattr(entry, field), str):
            raise ConfigError(f"quantity {name!r}: {field} must be a string, got {getattr(entry, field)!r}")
    for field in ("function", "max_products"):
        if not callable(getattr(entry, field)):
            raise ConfigError(f"quantity {name!r}: {field} must be a function, got {getattr(entry, field)!r}")
    plugin = loading(ENTRY_POINT_GROUP)  # an entry point being loaded: it cannot replace
    if name in _REGISTRY and (not replace or plugin is not None):
        how = "a plug-in cannot replace it" if plugin is not None else "pass replace=True to replace it"
        raise ConfigError(f"a quantity called {name!r} is already registered ({how})")
    _REGISTRY[name] = entry
    return entry


def unregister_quantity(name: str) -> None:
    """Remove a registered quantity (a no-op when there is none of that name)."""
    _REGISTRY.pop(name, None)


def quantity_names() -> tuple[str, ...]:
    """The registered quantities' names: the built-in ones (this package's modules, alphabetically), then the
    plug-ins' and those registered from Python, in the order they came."""
    _find()
    return tuple(_REGISTRY)


def quantity(name: str) -> Quantity:
    """The registered quantity ``name``; a ConfigError line naming the registered ones otherwise."""
    _find()
    if name not in _REGISTRY:
        raise unknown_name("quantity", name, tuple(_REGISTRY))
    return _REGISTRY[name]


def parse_measure(text: str | None) -> tuple[str, ...]:
    """``--measure``'s value, names separated by commas ('frobenius,other'), as the registered quantities it names,
    in the registry's order (so that the same quantities asked in another order are the same analysis); '' or None:
    none. An unknown name or one given twice is a ConfigError line."""
    if text is None or not str(text).strip():
        return ()
    names = [part.strip() for part in str(text).split(",")]
    if any(not n for n in names):
        raise ConfigError(f"--measure takes quantity names separated by commas, got {text!r}")
    for n in names:
        quantity(n)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--measure names the quantity {twice[0]!r} twice")
    order = quantity_names()
    return tuple(sorted(names, key=order.index))


def measure_record(text: str | None) -> str | None:
    """``--measure``'s value as results record it (hessian.json's and a tracking's ``measure``, a report's asked
    settings): the names :func:`parse_measure` gives, comma-separated, or None for none."""
    return ",".join(parse_measure(text)) or None


def recorded_names(record) -> list[str]:
    """The parts of a recorded ``measure`` (:func:`measure_record`'s form, read back from a result file or a run's
    config), as recorded: not checked against the registry (a plug-in of the run's may be missing here); none for
    None or ''."""
    return str(record).split(",") if record else []


def _find() -> None:
    """Register the built-in quantities (each module of this package defining ``QUANTITY``) and the plug-ins' (the
    entry-point group ``flatfl.quantities``), once."""
    global _found
    if _found:
        return
    _found = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        entry = getattr(module, "QUANTITY", None)
        if isinstance(entry, Quantity):
            register_quantity(entry)
    _load_entry_points()


def _load_entry_points() -> None:
    """The plug-ins' quantities, each in isolation (:func:`flatfl.utils.plugins.load_entry_points`): one that
    cannot be imported, raises, gives something else than quantities or takes a registered name is skipped whole
    with one warning line on stderr naming it."""
    from ....utils.plugins import load_entry_points, register_each

    load_entry_points(ENTRY_POINT_GROUP, "quantity", lambda found: register_each(found, Quantity, register_quantity,
                                                                                 "a Quantity"),
                      _REGISTRY, PLUGIN_PROBLEMS)
