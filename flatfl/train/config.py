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
#: the largest float32: a float setting that torch multiplies into the (float32) weights or gradients as a scalar
#: (--lr, --weight-decay, a hyper-parameter) cannot be larger (torch: "cannot be converted to type float without
#: overflow"); such a value is refused naming its option
FLOAT32_MAX = 3.4028234663852886e38
#: the smallest positive float32: a non-zero setting below half of it is 0 in float32 (--lr 1e-320 trains nothing)
FLOAT32_SMALLEST = 1.401298464324817e-45


def float32_zero(value) -> bool:
    """Whether a non-zero float within the float32 range is 0 once stored as float32."""
    import struct

    return isinstance(value, float) and value != 0 and abs(value) <= FLOAT32_MAX \
        and struct.unpack("f", struct.pack("f", value))[0] == 0.0


def float32_zero_message(name: str, value: float) -> str:
    return (f"{name} must be at least {FLOAT32_SMALLEST:.4g} in magnitude (the smallest positive float32; a "
            f"smaller value is 0 in float32), got {value!r}")

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
    # the floating type of the model, data, algorithm state and every product: "float32" or "float64"
    # (flatfl.utils.precision; a run recorded without it ran in float32)
    precision: str = "float32"
    # float32 products and convolutions on CUDA: "full" (IEEE float32) or "tf32" (flatfl.utils.precision)
    float32_matmul: str = "full"
    # CUDA: a cohort's full local steps captured once a round as a CUDA graph and replayed (flatfl.train.step_graph)
    cuda_graphs: bool = False
    # curvature during training: every K rounds and at the end (0: off); its settings, keys of flatfl hessian's,
    # are recorded here and checked by the analysis (flatfl.analysis.commands.hessian_settings.tracking_settings)
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
        names = canonical_method_names({k: getattr(self, k) for k in METHOD_SETTINGS})
        self.algo, self.local_opt, self.reg = (names[k] for k in METHOD_SETTINGS)
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
        for name, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay)):
            need(abs(value) <= FLOAT32_MAX, f"{name} must be at most {FLOAT32_MAX:.4g} (the largest float32; a "
                 f"step of the float32 weights overflows beyond it), got {value:g}")
            need(not float32_zero(value), float32_zero_message(name, value))
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
        if self.track_hessian_settings and not self.track_hessian:
            raise ConfigError("curvature-tracking settings given without --track-hessian K")
        # their keys and values are the analysis' to check (training records them, and never imports analysis):
        # the observer that computes the curvature, flatfl.analysis.commands.tracking.curvature_observer(cfg), refuses a bad
        # one, and every caller builds it before a run folder is made (train_from_options, the sweep's plan)
        need(self.eval_batch_size >= 1, f"--eval-batch-size must be a positive integer, got {self.eval_batch_size}")
        from ..utils.threads import check_threads

        check_threads(self.threads, "--threads")
        self.parallel_clients = parallel_clients_value(self.parallel_clients)
        from ..utils.precision import check_float32_matmul, check_precision

        check_float32_matmul(self.float32_matmul)
        check_precision(self.precision)
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
        for k, v in self.params.items():
            if isinstance(v, float) and math.isfinite(v) and abs(v) > FLOAT32_MAX:
                raise ConfigError(f"--{k.replace('_', '-')} must be at most {FLOAT32_MAX:.4g} in magnitude (the "
                                  f"largest float32), got {v:g}")
            if float32_zero(v):
                raise ConfigError(float32_zero_message(f"--{k.replace('_', '-')}", v))
        from .catalog import check_used_hparams

        check_used_hparams(self.params, self.algo, self.local_opt, self.reg)  # e.g. --zeta without --reg man
        from ..data.datasets import DATASET_NAMES, DATASETS
        from ..data.partition import PARTITIONS

        if self.dataset.lower().replace("-", "").replace("_", "") not in DATASETS:
            raise unknown_name("dataset", self.dataset, DATASET_NAMES)
        if self.partition not in PARTITIONS:
            raise unknown_name("partition", self.partition, PARTITIONS)
        return self


#: the settings that name a registered piece, and their registries (flatfl.train.components)
METHOD_SETTINGS = ("algo", "local_opt", "reg")


def canonical_method_names(settings: dict) -> dict:
    """``settings`` with each algorithm, local optimizer and regularizer name (keys ``algo``, ``local_opt`` /
    ``local-opt``, ``reg``) written as its registry's name, whatever its case (``FedAvg`` -> ``fedavg``, ``MAN`` ->
    ``man``, ``SAM`` -> ``sam``), so that runs of one method group together in sweeps and reports. A name no
    registry knows is left as written, for the error that names it."""
    from .catalog import load_all
    from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

    registries = dict(zip(METHOD_SETTINGS, (ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS)))
    out = dict(settings)
    for key, value in settings.items():
        registry = registries.get(str(key).replace("-", "_"))
        if registry is not None and isinstance(value, str) and value.lower() != value:
            load_all()
            if value.lower() in registry:
                out[key] = value.lower()
    return out


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


class DuplicateKey(Exception):
    """A key set twice in one table of a settings file: the key and the lines (1-based) of both."""

    def __init__(self, key, first: int, second: int):
        super().__init__(f"duplicate key {key!r} (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


_YAML_LOADER = None


def yaml12_loader():
    """PyYAML's SafeLoader reading plain scalars by the YAML 1.2 core schema instead of YAML 1.1's, and refusing a
    key set twice in one mapping (:class:`DuplicateKey`; a ``<<`` merge may still be overridden):

    * integers: ``[-+]?[0-9]+`` in decimal (``010`` is 10, not octal 8), ``0o17``, ``0x1f``; no ``1_000``, no
      sexagesimal (``1:1`` is the string '1:1', not 61), no ``0b``;
    * floats: ``1e-2``, ``.5``, ``-2.5E3``, ``.inf``, ``.nan`` (1.1 wanted a dot: ``1e-2`` was a string);
    * booleans only ``true`` / ``false`` (any case as 1.2 writes them): ``yes``, ``no``, ``on``, ``off`` are strings,
      which every boolean setting then refuses; ``null`` / ``~`` / nothing is None; no timestamps (``2024-01-01``
      is a string).
    """
    global _YAML_LOADER
    if _YAML_LOADER is not None:
        return _YAML_LOADER
    import math
    import re

    import yaml
    from yaml.constructor import ConstructorError
    from yaml.nodes import MappingNode

    int_re = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
    float_re = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                          r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
    bool_re = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
    null_re = re.compile(r"^(?:~|null|Null|NULL|)$")

    class Yaml12Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        if key in seen:
                            raise DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
                        seen[key] = key_node.start_mark.line
                    except TypeError:  # an unhashable key: refused by PyYAML itself below
                        pass
            return super().construct_mapping(node, deep=deep)

        def construct_yaml12_int(self, node):
            text = str(self.construct_scalar(node)).strip()
            if not int_re.match(text):
                raise ConstructorError(None, None, f"{text!r} is not a YAML 1.2 integer", node.start_mark)
            if text.startswith("0o"):
                return int(text[2:], 8)
            if text.startswith("0x"):
                return int(text[2:], 16)
            return int(text, 10)

        def construct_yaml12_float(self, node):
            text = str(self.construct_scalar(node)).strip()
            if not float_re.match(text):
                raise ConstructorError(None, None, f"{text!r} is not a YAML 1.2 float", node.start_mark)
            low = text.lower()
            if low.endswith(".inf"):
                return -math.inf if low.startswith("-") else math.inf
            if low == ".nan":
                return math.nan
            return float(text)

    # the 1.1 resolvers of bool, int, float, null and timestamp are replaced by 1.2's; the others (merge, value,
    # yaml) are kept
    dropped = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
               "tag:yaml.org,2002:null", "tag:yaml.org,2002:timestamp"}
    Yaml12Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in dropped]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, regexp, first in (("tag:yaml.org,2002:bool", bool_re, list("tTfF")),
                               ("tag:yaml.org,2002:int", int_re, list("-+0123456789")),
                               ("tag:yaml.org,2002:float", float_re, list("-+.0123456789")),
                               ("tag:yaml.org,2002:null", null_re, ["~", "n", "N", ""])):
        Yaml12Loader.add_implicit_resolver(tag, regexp, first)
    Yaml12Loader.add_constructor("tag:yaml.org,2002:int", Yaml12Loader.construct_yaml12_int)
    Yaml12Loader.add_constructor("tag:yaml.org,2002:float", Yaml12Loader.construct_yaml12_float)
    _YAML_LOADER = Yaml12Loader
    return Yaml12Loader


def _toml_duplicate(text: str, message: str) -> str | None:
    """The key a TOML 'Cannot overwrite a value' / 'Cannot declare' error is about, read from the line it names."""
    import re

    m = re.search(r"\(at line (\d+)", message)
    if not m or not ("overwrite" in message or "declare" in message):
        return None
    lines = text.splitlines()
    k = int(m.group(1)) - 1
    if not 0 <= k < len(lines):
        return None
    key = re.match(r"\s*\[*\s*([^=\]]+?)\s*(?:=|\]|$)", lines[k])
    return key.group(1).strip() if key else None


def read_settings_file(path: str | Path, what: str = "config file") -> dict:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) file holding a table; errors name ``what`` and the file. The file,
    its values (aliases expanded) and their nesting are bounded (:data:`MAX_SETTINGS_BYTES`,
    :data:`MAX_SETTINGS_VALUES`, :data:`MAX_SETTINGS_DEPTH`): a larger one is refused in one line before any of
    its values is used. YAML is read by the YAML 1.2 core schema (:func:`yaml12_loader`: ``seed: 010`` is 10,
    ``rounds: 1:1`` a string); a key set twice in one table is refused in one line naming it, in YAML and TOML."""
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

            raw = yaml.load(text, Loader=yaml12_loader())  # noqa: S506 - a SafeLoader subclass
            raw = {} if raw is None else raw
        else:
            raise ConfigError(f"{what} {path} must end in .toml, .yaml or .yml")
    except ConfigError:
        raise
    except DuplicateKey as e:
        raise ConfigError(f"{what} {path} sets {e.key!r} twice (lines {e.first} and {e.second}); keep one") from None
    except Exception as e:  # parser errors carry line numbers
        first = (str(e).splitlines() or [type(e).__name__])[0]
        key = _toml_duplicate(text, first) if path.suffix.lower() == ".toml" else None
        if key:
            raise ConfigError(f"{what} {path} sets {key!r} twice ({first}); keep one") from None
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
    return canonical_method_names(out)


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
