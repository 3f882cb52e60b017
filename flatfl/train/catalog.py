"""Every built-in piece of a run, loaded: the algorithms, local optimizers and regularizers, and the questions
asked of all of them (every flag, who declares it, which ones a run reads, the listing of ``flatfl algos``).

:func:`load_all` imports every module of :mod:`flatfl.train.algorithms` and :mod:`flatfl.train.regularizers`
(walking the packages, so a module dropped into one is registered without editing any other file) and
:mod:`flatfl.train.optimizers`; each registers its classes with the registries of
:mod:`flatfl.train.components`, which imports none of them.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from ..errors import ConfigError
from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS, HParam, Registry


def load_package(package: ModuleType) -> list[str]:
    """Import every module of ``package`` (every folder on its ``__path__``; names starting with ``_`` are left
    out), in name order; the modules imported, by dotted name."""
    names = [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
             if not info.name.startswith("_")]
    for name in names:
        importlib.import_module(name)
    return names


def load_all() -> None:
    """Import every built-in piece so the registries are complete."""
    from . import algorithms, optimizers, regularizers  # noqa: F401

    for package in (algorithms, regularizers):
        load_package(package)


def all_hparams() -> dict[str, HParam]:
    """Every flag declared by any registered piece, keyed by settings key (shared flags appear once)."""
    load_all()
    flags: dict[str, HParam] = {}
    for reg in (ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS):
        for cls in reg.values():
            for hp in cls.hparams:
                prev = flags.get(hp.key)
                if prev is not None and prev.py_type is not hp.py_type:
                    raise RuntimeError(f"flag --{hp.key} declared with two types ({prev.py_type}, {hp.py_type})")
                flags.setdefault(hp.key, hp)
    return flags


KIND_FLAGS = {"algorithm": "--algo", "local optimizer": "--local-opt", "regularizer": "--reg"}


def hparam_declarations() -> dict[str, list[tuple[str, str, HParam]]]:
    """settings key -> every (kind, component name, HParam) declaring it: local optimizers, then algorithms, then
    regularizers, each in name order."""
    load_all()
    out: dict[str, list[tuple[str, str, HParam]]] = {}
    for reg in (LOCAL_OPTIMIZERS, ALGORITHMS, REGULARIZERS):
        for name in sorted(reg):
            for hp in reg[name].hparams:
                out.setdefault(hp.key, []).append((reg.kind, name, hp))
    return out


def used_hparams(algo: str, local_opt: str, reg: str) -> set[str]:
    """The settings keys read by the selected algorithm, the local optimizer it runs and the regularizer."""
    algo_cls = ALGORITHMS.get_class(algo)
    pieces = (algo_cls, LOCAL_OPTIMIZERS.get_class(algo_cls.local_optimizer(local_opt)), REGULARIZERS.get_class(reg))
    return {hp.key for cls in pieces for hp in cls.hparams}


def check_used_hparams(settings: dict[str, Any], algo: str, local_opt: str, reg: str) -> None:
    """A :class:`ConfigError` naming the first explicitly set hyper-parameter that none of the selected pieces
    reads (the algorithm, the local optimizer it runs, i.e. its own one for fedsam / fedspeed..., the regularizer):
    setting it would be saved in the config and silently ignored."""
    algo_cls = ALGORITHMS.get_class(algo)
    opt_name = algo_cls.local_optimizer(local_opt)
    used = used_hparams(algo, local_opt, reg)
    declared = hparam_declarations()
    for key in settings:
        if key in used or key not in declared:
            continue
        owners = [f"{KIND_FLAGS[kind]} {name}" for kind, name, _ in declared[key]]
        reading_opts = {name for kind, name, _ in declared[key] if kind == "local optimizer"}
        owners += [f"--algo {name}" for name in sorted(ALGORITHMS)  # fedsam / fedasam: read via their optimizer
                   if ALGORITHMS.get_class(name).local_opt in reading_opts and f"--algo {name}" not in owners]
        flag = declared[key][0][2].cli_flag
        run = f"--algo {algo_cls.name}, --local-opt {opt_name}, --reg {REGULARIZERS.get_class(reg).name}"
        if len(owners) == 1:
            raise ConfigError(f"{flag} is a setting of {owners[0]}, which this run ({run}) does not use: remove it "
                              f"or add {owners[0]}")
        raise ConfigError(f"{flag} is a setting of {' / '.join(owners)}, none of which this run ({run}) uses: "
                          "remove it or select one of them")


def describe(kind_registry: Registry) -> str:
    """Human-readable listing of the pieces of one kind and their hyper-parameters with defaults."""
    lines = []
    for key in sorted(kind_registry):
        cls = kind_registry[key]
        lines.append(f"{key}: {cls.summary}")
        for hp in cls.hparams:
            lines.append(f"    {hp.cli_flag:<22} default {hp.default!r:<10} {hp.help}")
    return "\n".join(lines)


def display_name(registry: Registry, name: str) -> str:
    """The name tables print for a piece (its class's ``display_name``); ``name`` itself when no piece of that name
    is registered (a run made by another version)."""
    load_all()
    cls = registry.get(str(name).lower())
    return name if cls is None else cls.label()
