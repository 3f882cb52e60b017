"""Named, pluggable pieces of a run: algorithms, local optimizers and regularizers.

Each piece is a class with a ``name`` and the hyper-parameters it reads, declared as :class:`HParam`. Each
hyper-parameter has a command-line flag (``--rho``, ``--zeta``...). Pieces that mean the same thing may share a flag
(SAM's and FedSpeed's ``--rho``); each keeps its own default, used when the user does not set the flag.

The user's explicit settings live in one flat dict keyed by flag name (``rho``, ``asd_lambda``); ``resolve`` turns
them into the values a piece uses and records them in the run's config.

This module never imports a piece: each piece's module imports it and registers its class here
(``@ALGORITHMS.register``...); :func:`flatfl.train.catalog.load_all` imports every module of the algorithm and
regularizer packages, so a new piece is one new file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError, unknown_name


@dataclass(frozen=True)
class HParam:
    name: str  # attribute name inside the piece
    default: Any
    help: str
    flag: str | None = None  # command-line flag without dashes, '-' separated; defaults to ``name``
    type: type | None = None  # float, int, bool, str; inferred from the default when None
    choices: tuple | None = None
    check: str | None = None  # "positive", "nonnegative", "unit" (in (0, 1]), "prob" (in [0, 1])
    most: int | float | None = None  # the largest value taken (a count or size that memory is allocated for)

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
            raise unknown_name(f"--{self.key.replace('_', '-')} value for {owner}", value, self.choices)
        bad = {
            "positive": lambda v: not v > 0,
            "nonnegative": lambda v: not v >= 0,
            "unit": lambda v: not 0 < v <= 1,
            "prob": lambda v: not 0 <= v <= 1,
        }
        if self.check and bad[self.check](value):
            what = {"positive": "> 0", "nonnegative": ">= 0", "unit": "in (0, 1]", "prob": "in [0, 1]"}[self.check]
            raise ConfigError(f"--{self.key.replace('_', '-')} for {owner} must be {what}, got {value}")
        if self.most is not None and value > self.most:
            raise ConfigError(f"--{self.key.replace('_', '-')} for {owner} must be at most {self.most:,}, got {value}")
        return value


class Component:
    """Base of every named piece. Subclasses set ``name``, ``display_name``, ``summary`` and ``hparams``."""

    kind: ClassVar[str] = "component"
    name: ClassVar[str] = ""
    #: the name tables and reports print (the paper's spelling: "FedAvg", "MoFedSAM", "MAN", "SAM"); ``name`` if empty
    display_name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    hparams: ClassVar[tuple[HParam, ...]] = ()

    @classmethod
    def label(cls) -> str:
        """The name to print: ``display_name``, else ``name``."""
        return cls.display_name or cls.name

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
            raise unknown_name(self.kind, name, sorted(self))
        return self[key]


ALGORITHMS = Registry("algorithm")
LOCAL_OPTIMIZERS = Registry("local optimizer")
REGULARIZERS = Registry("regularizer")
