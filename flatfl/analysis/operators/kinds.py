"""The registry of curvature kinds, torch-free: one :class:`CurvatureKind` per name (``--curvature``, the
``curvature=`` of the Python API), carrying its operator class (or its ``"module:Class"`` path, imported when the
kind is first built), its short title, its name in full and a one-line description. Everything that names a
curvature asks here: :data:`CURVATURES`, :data:`CURVATURE_TITLES` and :data:`CURVATURE_NAMES` (live views of the
registry, re-exported by :mod:`.names` and the settings), :func:`kind_of` (the check where a setting enters) and
:func:`~flatfl.analysis.operators.loss_curvature.curvature_operator` (the dispatch).

A kind registers itself: its class, a subclass of
:class:`~flatfl.analysis.operators.loss_curvature.LossCurvature`, is decorated with :func:`curvature_kind` (string
literals, and ``takes_products`` a literal bool)::

    @curvature_kind("ggn", title="GGN", full_name="Gauss-Newton matrix",
                    description="J^T H_out J: positive semi-definite, the Fisher for cross-entropy")
    class GGNOperator(LossCurvature): ...

Inside flatfl that is the whole of a new kind: one module of :mod:`flatfl.analysis.operators`. The command line
lists the kinds without importing torch, so the built-in ones are read from those modules' sources
(:func:`builtin_kinds`: each top-level decorator and its class line parsed, once, on the first question asked of the
registry); a module is imported when one of its kinds is built, and its decorators then register the same entries
with their classes. Another package registers its kinds by importing its module (the decorator) or by calling
:func:`register_curvature`. The Hessian comes first (the default), then the built-in kinds in their modules' order,
then the others as they were registered. A name already taken by another class is refused in one line.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ...errors import ConfigError, unknown_name

__all__ = ["CurvatureKind", "curvature_kind", "register_curvature", "unregister_curvature", "kind_of",
           "builtin_kinds", "declared_in", "CURVATURES", "CURVATURE_TITLES", "CURVATURE_NAMES", "DEFAULT_CURVATURE"]

#: the curvature measured when none is named
DEFAULT_CURVATURE = "hessian"
_PACKAGE = __name__.rpartition(".")[0]  # flatfl.analysis.operators: where the built-in kinds live
_DECORATOR = "curvature_kind"
#: a top-level ``@curvature_kind(...)`` through the line of the class it decorates
_DECLARATION = re.compile(rf"^@{_DECORATOR}\(.*?^class \w+", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class CurvatureKind:
    """One registered curvature: its ``name``, its ``operator`` (the class, or its ``"module:Class"`` path), its
    ``title`` (how figures and result lines name it: "GGN eigenvalue λ"), its ``full_name`` (how the command line's
    first lines say it: "top eigenvalues of the Gauss-Newton matrix"), a one-line ``description``, and
    ``takes_products``: whether ``products`` (``--products``) chooses how its products are computed (the Hessian's);
    a kind without computes its own and takes only ``"auto"``."""

    name: str
    operator: str | type
    title: str
    full_name: str
    description: str
    takes_products: bool = False

    @property
    def path(self) -> str:
        """``"module:Class"`` of the operator class."""
        if isinstance(self.operator, str):
            return self.operator
        return f"{self.operator.__module__}:{self.operator.__qualname__}"

    def check_products(self, products: str) -> None:
        """A ConfigError line when ``products`` asks this kind for a product method it does not take (only a kind
        with ``takes_products`` takes another than ``"auto"``)."""
        if products != "auto" and not self.takes_products:
            raise ConfigError(f"--products {products} chooses how Hessian products are computed; the {self.name} "
                              "curvature has products of its own: leave --products at auto")

    def load(self) -> type:
        """The operator class (its module imported now, when it is given as a path)."""
        if not isinstance(self.operator, str):
            return self.operator
        module, _, name = self.operator.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"the curvature {self.name!r} names {self.operator!r}, which cannot be imported: "
                              f"{e}") from None


_REGISTRY: dict[str, CurvatureKind] = {}
_FIELDS = ("title", "full_name", "description", "takes_products")
_found = False  # whether the built-in kinds were read from their modules' sources


def register_curvature(name: str, operator: str | type, *, title: str, full_name: str, description: str,
                       takes_products: bool = False) -> CurvatureKind:
    """Register a curvature kind (:class:`CurvatureKind` for the fields) and return its entry. A name already
    registered for another class is a ConfigError; registering the same class again (its module imported after
    its entry was read from the source) keeps its place."""
    _ensure_builtins()
    entry = _checked(name, operator, title, full_name, description, takes_products)
    taken = _REGISTRY.get(name)
    if taken is not None and taken.path != entry.path:
        raise ConfigError(f"a curvature called {name!r} is already registered ({taken.path}); {entry.path} cannot "
                          "take its name")
    _REGISTRY[name] = entry
    return entry


def curvature_kind(name: str, *, title: str, full_name: str, description: str,
                   takes_products: bool = False) -> Callable[[type], type]:
    """The class decorator that registers a curvature kind (:func:`register_curvature`) and sets its class's
    ``curvature`` to ``name``. Inside flatfl its arguments must be literals: the command line reads them from the
    source without importing the module."""

    def register(cls: type) -> type:
        register_curvature(name, cls, title=title, full_name=full_name, description=description,
                           takes_products=takes_products)
        cls.curvature = name
        return cls

    return register


def unregister_curvature(name: str) -> None:
    """Remove a registered kind (a no-op when there is none of that name)."""
    _ensure_builtins()
    _REGISTRY.pop(name, None)


def kind_of(name: str) -> CurvatureKind:
    """The registered kind ``name``; a ConfigError listing the registered ones otherwise (the check where a
    ``curvature`` setting enters, before any work)."""
    _ensure_builtins()
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise unknown_name("curvature", name, list(_REGISTRY))
    return entry


def _checked(name, operator, title, full_name, description, takes_products) -> CurvatureKind:
    if not isinstance(name, str) or not name or name != name.strip() or name.startswith("-"):
        raise ConfigError(f"a curvature's name must be a non-empty word, got {name!r}")
    if not isinstance(operator, type) and (not isinstance(operator, str) or ":" not in operator):
        raise ConfigError(f"curvature {name!r}: give its operator class, or its path as 'module:Class', got "
                          f"{operator!r}")
    for field, value in (("title", title), ("full_name", full_name), ("description", description)):
        if not isinstance(value, str) or not value.strip() or "\n" in value:
            raise ConfigError(f"curvature {name!r}: {field} must be one non-empty line, got {value!r}")
    if not isinstance(takes_products, bool):
        raise ConfigError(f"curvature {name!r}: takes_products must be True or False, got {takes_products!r}")
    return CurvatureKind(name, operator, title, full_name, description, takes_products)


def declared_in(module: str, source: str) -> Iterator[tuple[str, dict]]:
    """``(operator path, fields)`` of every top-level class of ``source`` decorated with ``@curvature_kind(...)``:
    the decorator and the class line alone are parsed (literals only: one ConfigError line naming the class
    otherwise)."""
    for match in _DECLARATION.finditer(source):
        node = ast.parse(f"{match.group(0)}:\n    pass").body[0]
        decorator = node.decorator_list[0]  # the match starts at this one
        try:
            fields = {"name": ast.literal_eval(decorator.args[0]),
                      **{k.arg: ast.literal_eval(k.value) for k in decorator.keywords}}
        except (ValueError, IndexError, TypeError, SyntaxError):
            raise ConfigError(f"{module}:{node.name}: @{_DECORATOR} takes its name and fields as literals (the "
                              "command line reads them without importing the module)") from None
        yield f"{module}:{node.name}", fields


def builtin_kinds() -> list[CurvatureKind]:
    """The kinds the modules of :mod:`flatfl.analysis.operators` declare, read from their sources: the Hessian
    first, then in the order of the modules' names and of the classes in each."""
    package = importlib.import_module(_PACKAGE)  # torch-free: the package imports nothing
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module, file = f"{_PACKAGE}.{info.name}", Path(getattr(info.module_finder, "path", "")) / f"{info.name}.py"
        if not file.is_file():  # an installation without sources: the module registers its kinds when imported
            importlib.import_module(module)
            continue
        for path, fields in declared_in(module, file.read_text(encoding="utf-8")):
            unknown = sorted(set(fields) - {"name", *_FIELDS})
            if unknown:
                raise ConfigError(f"{path}: @{_DECORATOR} has no field {unknown[0]!r} (its fields: name, "
                                  f"{', '.join(_FIELDS)})")
            found.append(_checked(fields.get("name"), path, *(fields.get(f) for f in _FIELDS[:3]),
                                  fields.get("takes_products", False)))
    return sorted(found, key=lambda kind: kind.name != DEFAULT_CURVATURE)


def _ensure_builtins() -> None:
    """The built-in kinds in the registry, read from the sources once, before any other registration (each
    registration asks here first; importing a module then replaces its entries' paths by the classes, in place)."""
    global _found
    if not _found:
        _found = True
        for kind in builtin_kinds():
            _REGISTRY.setdefault(kind.name, kind)


class _View(Mapping):
    """A read-only, live view of the registry: name -> ``field`` of each kind (the kind itself when None)."""

    def __init__(self, field: str | None) -> None:
        self.field = field

    def __getitem__(self, name: str):
        _ensure_builtins()
        entry = _REGISTRY[name]
        return entry if self.field is None else getattr(entry, self.field)

    def __iter__(self):
        _ensure_builtins()
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        _ensure_builtins()
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


#: the registered curvatures, name -> :class:`CurvatureKind`, in order (``"hessian" in CURVATURES``,
#: ``" | ".join(CURVATURES)``)
CURVATURES: Mapping[str, CurvatureKind] = _View(None)
#: each curvature's short name, as figures label their axes ("GGN eigenvalue λ") and result lines name it
CURVATURE_TITLES: Mapping[str, str] = _View("title")
#: each curvature's name in full, as the command line's first lines say it ("top eigenvalues of the ...")
CURVATURE_NAMES: Mapping[str, str] = _View("full_name")
