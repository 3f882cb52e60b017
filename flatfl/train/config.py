"""The run configuration: every setting of ``flatfl train`` in one typed record.

Sources, later ones winning: the defaults below, a TOML or YAML file (``--config``), the command line. Keys of the
config file are the long option names with '_' or '-' (``local_epochs`` or ``local-epochs``); hyper-parameters of
algorithms, optimizers and regularizers use their flag names (``rho``, ``zeta``, ``asd_lambda``...) either at the top
level or inside a ``[params]`` table.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, unknown_name

MAX_SEED = 2**32 - 1
MAX_COUNT = 10**7  # rounds and clients
MIN_ROUND_PROBABILITY = 0.01  # Bernoulli sampling: a draw must seat at least one client with this probability

DEFAULT_MODELS = {
    "digits": "digits-cnn",
    "cifar10": "cifar-cnn",
    "cifar100": "cifar-cnn",
    "tinyimagenet": "tiny-cnn",
    "emnist": "emnist-cnn",
    "fashionmnist": "emnist-cnn",
}


def parallel_clients_value(value):
    """``--parallel-clients``: None, "all" or an integer >= 1 (given as a number or a string of digits)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return "all"
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > MAX_COUNT:
        raise ConfigError(f"--parallel-clients must be 'all' or an integer from 1 to {MAX_COUNT}, got {value!r}")
    return value


@dataclass
class RunConfig:
    # data
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool | None = None  # fetch missing files; None: the dataset's default (all but Fashion-MNIST)
    model: str | None = None  # None: the dataset's default model (DEFAULT_MODELS)
    model_args: dict = field(default_factory=dict)
    augment: bool | None = None  # None: the dataset's default (flip + padded crop for CIFAR and Tiny-ImageNet)
    partition: str = "dirichlet"
    alpha: float = 0.3
    clients: int = 20
    # rounds and client sampling
    rounds: int = 50
    participation: float = 0.5
    sampling: str = "bernoulli"  # "bernoulli" (FedDyn code: each client joins with prob p) or "fraction" (fixed m)
    # local training (docs/update-rules.md section 0)
    local_epochs: int = 2
    batch_size: int = 50
    lr: float = 0.1
    lr_decay: float = 0.998  # per-round factor
    weight_decay: float = 1e-3
    momentum: float = 0.0
    nesterov: bool = False
    clip: float = 10.0  # global gradient-norm clip; 0 disables
    # pieces
    algo: str = "fedavg"
    local_opt: str = "sgd"
    reg: str = "none"
    params: dict = field(default_factory=dict)  # explicit hyper-parameter settings keyed by flag name
    # bookkeeping
    seed: int = 0
    device: str = "cpu"
    eval_every: int = 1
    eval_batch_size: int = 500
    checkpoint_every: int = 10
    save_clients: bool = False
    out: str | None = None
    threads: int | None = None  # torch threads; None: flatfl.utils.threads.default_threads() at run time
    # clients trained at once: an int >= 1 or "all"; None: "all" on CUDA, 1 elsewhere (see Trainer)
    parallel_clients: object = None
    # float32 products and convolutions on CUDA: "full" (IEEE float32) or "tf32" (flatfl.utils.precision)
    float32_matmul: str = "full"
    # CUDA: a cohort's full local steps captured once a round as a CUDA graph and replayed (flatfl.train.step_graph)
    cuda_graphs: bool = False
    # curvature during training: every K rounds and at the end (0: off), settings as in flatfl.utils.hessian_settings
    # (TRACKING_FIELDS; unset ones take TRACKING_DEFAULTS). The engine only calls the observer that computes them.
    track_hessian: int = 0
    track_hessian_settings: dict = field(default_factory=dict)

    def check_types(self) -> "RunConfig":
        """Every field holds a value of its declared type (see :mod:`flatfl.utils.values` for the rules)."""
        from ..utils.values import coerce

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            hint = str(f.type).replace(" ", "")
            optional = hint.endswith("|None")
            kind = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict}.get(hint.split("|")[0])
            if kind is None or (optional and value is None):
                continue
            setattr(self, f.name, coerce(value, kind, f"--{f.name.replace('_', '-')}"))
        for name, table in (("model_args", self.model_args), ("params", self.params),
                            ("track_hessian_settings", self.track_hessian_settings)):
            if any(not isinstance(k, str) for k in table):
                raise ConfigError(f"{name} keys must be strings, got {sorted(map(repr, table))[:3]}")
        return self

    def resolved_model(self) -> str:
        return self.model or DEFAULT_MODELS.get(self.dataset.lower().replace("-", "").replace("_", ""), "digits-cnn")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> "RunConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        self.check_types()
        need(0 <= self.seed <= MAX_SEED, f"--seed must be in 0..{MAX_SEED}, got {self.seed}")
        need(self.rounds <= MAX_COUNT, f"--rounds must be at most {MAX_COUNT}, got {self.rounds}")
        need(self.clients <= MAX_COUNT, f"--clients must be at most {MAX_COUNT}, got {self.clients}")

        need(self.rounds >= 1, f"--rounds must be a positive integer, got {self.rounds}")
        need(0 < self.participation <= 1, f"--participation must be in (0, 1], got {self.participation}")
        if self.sampling == "bernoulli" and self.clients >= 1:
            # each draw of the Bernoulli sample is repeated until a client joins: keep the expected redraws bounded
            p_any = -math.expm1(self.clients * math.log1p(-min(self.participation, 1 - 1e-16)))
            need(self.participation == 1 or p_any >= MIN_ROUND_PROBABILITY,
                 f"--participation {self.participation:g} with {self.clients} clients leaves a round empty with "
                 f"probability {1 - p_any:.6g}: choose participation * clients of at least about 0.01")
        need(self.lr > 0 and math.isfinite(self.lr), f"--lr must be > 0, got {self.lr}")
        need(0 < self.lr_decay <= 1.5, f"--lr-decay must be in (0, 1.5], got {self.lr_decay}")
        need(self.batch_size >= 1, f"--batch-size must be a positive integer, got {self.batch_size}")
        need(self.local_epochs >= 1, f"--local-epochs must be a positive integer, got {self.local_epochs}")
        need(self.clients >= 1, f"--clients must be a positive integer, got {self.clients}")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        need(self.clip >= 0, f"--clip must be >= 0 (0 disables clipping), got {self.clip}")
        need(self.sampling in ("bernoulli", "fraction"), f"--sampling must be 'bernoulli' or 'fraction', got {self.sampling!r}")
        need(self.eval_every >= 1, f"--eval-every must be a positive integer, got {self.eval_every}")
        need(self.checkpoint_every >= 1, f"--checkpoint-every must be a positive integer, got {self.checkpoint_every}")
        need(0 <= self.track_hessian <= MAX_COUNT, f"--track-hessian must be an integer >= 0 (0: off), got "
             f"{self.track_hessian}")
        if self.track_hessian:
            from ..utils.hessian_settings import tracking_settings

            tracking_settings(self.track_hessian_settings)  # raises ConfigError on a bad key or value
        elif self.track_hessian_settings:
            raise ConfigError("curvature-tracking settings given without --track-hessian K")
        need(self.eval_batch_size >= 1, f"--eval-batch-size must be a positive integer, got {self.eval_batch_size}")
        from ..utils.threads import check_threads

        check_threads(self.threads, "--threads")
        self.parallel_clients = parallel_clients_value(self.parallel_clients)
        from ..utils.precision import check_float32_matmul

        check_float32_matmul(self.float32_matmul)
        if self.partition != "iid":
            need(self.alpha > 0, f"the Dirichlet concentration --alpha must be > 0, got {self.alpha}")
        from .catalog import all_hparams
        from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

        known = all_hparams()
        for k in self.params:
            if k not in known:
                raise unknown_name("hyper-parameter", k, sorted(known),
                                   fallback=f"unknown hyper-parameter {k!r}: see 'flatfl algos' for the valid names")
        for reg, name in ((ALGORITHMS, self.algo), (LOCAL_OPTIMIZERS, self.local_opt), (REGULARIZERS, self.reg)):
            reg.get_class(name).resolve(self.params)  # raises ConfigError on bad names or values
        from .catalog import check_used_hparams

        check_used_hparams(self.params, self.algo, self.local_opt, self.reg)  # e.g. --zeta without --reg man
        from ..data.datasets import DATASET_NAMES, DATASETS
        from ..data.partition import PARTITIONS

        if self.dataset.lower().replace("-", "").replace("_", "") not in DATASETS:
            raise unknown_name("dataset", self.dataset, DATASET_NAMES)
        if self.partition not in PARTITIONS:
            raise unknown_name("partition", self.partition, PARTITIONS)
        return self


def with_defaults(stored: dict) -> dict:
    """A run's recorded settings (config.json's ``config``) with every RunConfig field it lacks at its default: a
    run made before a setting existed ran with that setting at its default (curvature tracking off, say)."""
    import json

    out = dict(stored)
    for f in dataclasses.fields(RunConfig):
        if f.name not in out:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not dataclasses.MISSING:
                out[f.name] = json.loads(json.dumps(default))
    return out


#: bounds on a config or grid file: its size, and the values it holds once YAML's aliases are expanded (each alias
#: stands for a copy of what it names, so a few hundred bytes can stand for billions of values) and their nesting
MAX_SETTINGS_BYTES = 1 << 20
MAX_SETTINGS_VALUES = 100_000
MAX_SETTINGS_DEPTH = 64


def read_settings_file(path: str | Path, what: str = "config file") -> dict:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) file holding a table; errors name ``what`` and the file. The file,
    its values (aliases expanded) and their nesting are bounded (:data:`MAX_SETTINGS_BYTES`,
    :data:`MAX_SETTINGS_VALUES`, :data:`MAX_SETTINGS_DEPTH`): a larger one is refused in one line before any of
    its values is used."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if size > MAX_SETTINGS_BYTES:
        raise ConfigError(f"{what} {path} is {size:,} bytes; a settings file may hold at most "
                          f"{MAX_SETTINGS_BYTES:,}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        elif path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{what} {path} must end in .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as e:  # parser errors carry line numbers
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot parse {what} {path}: {first[:300]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must hold a table of settings")
    check_settings_size(raw, f"{what} {path}", aliases=path.suffix.lower() != ".toml")
    return raw


def check_settings_size(value, where: str, aliases: bool = True) -> None:
    """``value`` (parsed settings) holds at most :data:`MAX_SETTINGS_VALUES` values counted as its aliases expand,
    nests at most :data:`MAX_SETTINGS_DEPTH` levels and contains no value that contains itself (a recursive YAML
    alias). Counted without expanding anything: a table or list reached again through an alias adds its count."""
    counts: dict[int, int] = {}
    open_: set[int] = set()

    def count(v, depth: int) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        key = id(v)
        if key in counts:
            return counts[key]
        if key in open_:
            raise ConfigError(f"{where} holds a value that contains itself (a recursive YAML alias)")
        if depth >= MAX_SETTINGS_DEPTH:
            raise ConfigError(f"{where} nests values deeper than {MAX_SETTINGS_DEPTH} levels")
        open_.add(key)
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        n = 1 + sum(count(x, depth + 1) for x in items)
        open_.discard(key)
        counts[key] = n
        return n

    total = count(value, 0)
    if total > MAX_SETTINGS_VALUES:
        expanded = " once its YAML aliases are expanded" if aliases else ""
        raise ConfigError(f"{where} holds {total:,} values{expanded}; a settings file may hold at most "
                          f"{MAX_SETTINGS_VALUES:,}")


def read_config_file(path: str | Path) -> dict:
    """Read a TOML (.toml) or YAML (.yaml/.yml) file into a flat dict of RunConfig fields + ``params``."""
    raw = read_settings_file(path, "config file")
    return normalize_settings(raw, source=str(path))


def normalize_settings(raw: dict, source: str = "settings") -> dict:
    """Map user keys (dashes or underscores, hyper-parameters at top level or under 'params') to RunConfig fields."""
    from .catalog import all_hparams

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    known_hp = all_hparams()
    out: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for k, v in raw.items():
        key = str(k).replace("-", "_")
        if key == "params":
            if not isinstance(v, dict):
                raise ConfigError(f"'params' in {source} must be a table")
            for pk, pv in v.items():
                params[str(pk).replace("-", "_")] = pv
        elif key in fields:
            out[key] = v
        elif key in known_hp:
            params[key] = v
        else:
            raise unknown_name("setting", k, sorted(fields | set(known_hp)), where=f"in {source}",
                               fallback=f"unknown setting {k!r} in {source}")
    for pk in params:
        if pk not in known_hp:
            raise unknown_name("hyper-parameter", pk, sorted(known_hp), where=f"in {source}",
                               fallback=f"unknown hyper-parameter {pk!r} in {source}")
    if params:
        out["params"] = params
    return out


def build_config(file_settings: dict | None = None, cli_settings: dict | None = None) -> RunConfig:
    """Defaults < config file < command line. ``params`` dicts are merged key by key."""
    merged: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for src in (file_settings or {}, cli_settings or {}):
        for k, v in src.items():
            if k == "params":
                params.update({pk: pv for pk, pv in v.items() if pv is not None})
            elif v is not None:
                merged[k] = v
    merged["params"] = params
    try:
        cfg = RunConfig(**merged)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    return cfg.validate()
