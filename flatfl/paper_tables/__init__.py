"""The paper tables ``flatfl reproduce`` makes and ``flatfl report`` fills: one module each, found by walking this
package.

A module defining ``TABLE`` (a :class:`~flatfl.paper_tables.table_spec.PaperTable`: the layout, a
:class:`~flatfl.paper_tables.table_spec.TableSpec`, and the runs behind it) is a table; its published values are rows of
``flatfl/report/paper_values.csv``. Nothing else is edited to add one: the report's table matching, ``reproduce``'s
planning and the command line's choice of targets read :data:`REPRODUCED`, :data:`GROUPS` and :data:`TARGETS`.
Modules without ``TABLE`` (``spec``, ``man_common``) hold what tables share.
"""
from __future__ import annotations

import importlib
import pkgutil

from .table_spec import Method, PaperTable, TableSpec

__all__ = ["REPRODUCED", "TABLES", "GROUPS", "TARGETS", "PRESETS", "DEFAULT_SEEDS", "Method", "PaperTable",
           "TableSpec", "discover"]


def discover() -> dict[str, PaperTable]:
    """Every table of the package (each module's ``TABLE``), by key, in ``position`` order."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            table = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TABLE", None)
            if isinstance(table, PaperTable):
                found.append(table)
    keys = [t.key for t in found]
    if len(set(keys)) != len(keys):
        raise RuntimeError(f"two paper tables share a key: {sorted(keys)}")
    return {t.key: t for t in sorted(found, key=lambda t: (t.position, t.key))}


#: key -> PaperTable, in position order
REPRODUCED: dict[str, PaperTable] = discover()
#: key -> its layout
TABLES: dict[str, TableSpec] = {k: t.spec for k, t in REPRODUCED.items()}
#: a group's name (e.g. 'man-tables') -> the keys of its tables
GROUPS: dict[str, tuple[str, ...]] = {
    g: tuple(k for k, t in REPRODUCED.items() if t.group == g)
    for g in dict.fromkeys(t.group for t in REPRODUCED.values() if t.group)}
#: what ``flatfl reproduce`` and ``flatfl report --table`` accept: each table, and each group after its last table
TARGETS: tuple[str, ...] = tuple(
    name for k, t in REPRODUCED.items()
    for name in ((k, t.group) if t.group and GROUPS[t.group][-1] == k else (k,)))
#: the presets ``flatfl reproduce`` offers (each table has some of them: its ``presets``)
PRESETS: tuple[str, ...] = ("quick", "fmnist", "fmnist-cnn", "paper", "tiny")
#: seeds when ``--seeds`` is not given: the quick and Fashion-MNIST tables show mean +- sd over three seeds; one
#: paper run takes GPU-days; tiny is for tests
DEFAULT_SEEDS: dict[str, tuple[int, ...]] = {"quick": (0, 1, 2), "fmnist": (0, 1, 2), "fmnist-cnn": (0, 1, 2),
                                             "paper": (0,), "tiny": (0,)}
