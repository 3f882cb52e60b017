"""Named, pluggable pieces of a run: algorithms, local optimizers and regularizers.

Each piece is a class with a ``name`` and the hyper-parameters it reads, declared as :class:`HParam`. Each
hyper-parameter has a command-line flag (``--rho``, ``--zeta``...). Pieces that mean the same thing may share a flag
(SAM's and FedSpeed's ``--rho``); each keeps its own default, used when the user does not set the flag.

The user's explicit settings live in one flat dict keyed by flag name (``rho``, ``asd_lambda``); ``resolve`` turns
them into the values a piece uses and records them in the run's config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError


@dataclass(frozen=True)
class HParam:
    name: str  # attribute name inside the piece
    default: Any
    help: str
    flag: str | None = None  # command-line flag without dashes, '-' separated; defaults to ``name``
    type: type | None = None  # float, int, bool, str; inferred from the default when None
    choices: tuple | None = None
    check: str | None = None  # "positive", "nonnegative", "unit" (in (0, 1]), "prob" (in [0, 1])

    @property
    def key(self) -> str:
        """The key in the flat settings dict (and in config files): the flag with '_' for '-'."""
        return (self.flag or self.name).replace("-", "_")

    @property
    def cli_flag(self) -> str:
        return "--" + (self.flag or self.name).replace("_", "-")

    @property
    def py_type(self) -> type:
        return self.type or type(self.default)

    def validate(self, value: Any, owner: str) -> Any:
        from ..utils.values import coerce

        t = self.py_type
        value = coerce(value, t, f"--{self.key.replace('_', '-')} for {owner}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"--{self.key.replace('_', '-')} for {owner} must be one of {self.choices}, got {value!r}")
        bad = {
            "positive": lambda v: not v > 0,
            "nonnegative": lambda v: not v >= 0,
            "unit": lambda v: not 0 < v <= 1,
            "prob": lambda v: not 0 <= v <= 1,
        }
        if self.check and bad[self.check](value):
            what = {"positive": "> 0", "nonnegative": ">= 0", "unit": "in (0, 1]", "prob": "in [0, 1]"}[self.check]
            raise ConfigError(f"--{self.key.replace('_', '-')} for {owner} must be {what}, got {value}")
        return value


class Component:
    """Base of every named piece. Subclasses set ``name``, ``summary`` and ``hparams``."""

    kind: ClassVar[str] = "component"
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    hparams: ClassVar[tuple[HParam, ...]] = ()

    @classmethod
    def resolve(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """The hyper-parameter values this piece uses: the user's setting for its flag, else its own default."""
        out = {}
        for hp in cls.hparams:
            v = settings.get(hp.key)
            out[hp.name] = hp.default if v is None else hp.validate(v, cls.name)
        return out


class Registry(dict):
    """name -> Component subclass, for one kind of piece."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, cls):
        key = cls.name.lower()
        if key in self:
            raise RuntimeError(f"{self.kind} {key!r} registered twice")
        self[key] = cls
        return cls

    def get_class(self, name: str):
        key = (name or "").lower()
        if key not in self:
            raise ConfigError(f"unknown {self.kind} {name!r}: choose one of {', '.join(sorted(self))}")
        return self[key]


ALGORITHMS = Registry("algorithm")
LOCAL_OPTIMIZERS = Registry("local optimizer")
REGULARIZERS = Registry("regularizer")


def load_all() -> None:
    """Import every built-in piece so the registries are complete."""
    from . import algorithms, optimizers, regularizers  # noqa: F401


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
