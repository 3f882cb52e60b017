"""Which runs are one experiment: the runs averaged in a table row are seeds trained alike, and two rows compared
differ in the method only.

The rule is the project's one (:mod:`flatfl.utils.run_identity`, :func:`flatfl.train.identity.experiment_settings`):
settings that change no number (:data:`NEUTRAL_SETTINGS`) do not split an experiment and are shown where seeds
differ in them; any other setting does, and so do the network and data of the user's that a run records beside
its settings (:func:`run_identity`: their class, factory, structure and data digest). What a run's analyses were
measured with (model, estimator, samples, split, loss) is each value's own setting
(:meth:`flatfl.report.records.RunRecord.setting`): values of other settings are never averaged in a row, and a pair
of them is marked 'incomparable' (:mod:`.verdicts`).
"""
from __future__ import annotations

import re

from ..errors import ConfigError
from ..paper_tables import TableSpec
from ..train.identity import experiment_settings
from ..utils.run_identity import NO_NUMBER_SETTINGS

__all__ = ["NEUTRAL_SETTINGS", "training_settings", "run_identity", "shown_value", "shown_repr", "neutral_differences",
           "one_run_per_seed", "check_same_settings", "method_keys", "settings_differences"]

#: run settings that change no number beyond rounding (:mod:`flatfl.utils.run_identity`): runs differing only in
#: these are seeds of one experiment; the differences are shown.
NEUTRAL_SETTINGS = NO_NUMBER_SETTINGS
_NEUTRAL_SHOWN = tuple(k for k in NEUTRAL_SETTINGS if k not in ("out", "quiet"))  # out differs for every run
_METHOD_KEYS = ("algo", "local_opt", "reg")
#: what decides a run's numbers besides its seed (:func:`flatfl.train.identity.experiment_settings`)
training_settings = experiment_settings
_DIGEST = re.compile(r"[0-9a-f]{64}")


def run_identity(run) -> dict | None:
    """What decides a run's numbers besides its seed: :func:`training_settings` of its config with the network and
    data it records (a :class:`~.records.RunRecord`'s ``identity``; a line of a runs.csv: the settings it records,
    :class:`~.runs_csv.CsvRunRecord`); None for a run without a config."""
    identity = getattr(run, "identity", None)
    if isinstance(identity, dict):
        return identity
    if not isinstance(getattr(run, "config", None), dict):
        return None
    return training_settings(run.config, network=getattr(run, "network", None), data=getattr(run, "data", None),
                             data_digest=getattr(run, "data_digest", None))


def shown_value(v) -> str:
    """A setting as messages show it: 'default' for None, floats as %g, a sha256 by its first 12 digits."""
    if isinstance(v, str) and _DIGEST.fullmatch(v):
        return v[:12]
    return "default" if v is None else format(v, "g") if isinstance(v, float) else str(v)


def shown_repr(v) -> str:
    """A setting as refusals show it: a sha256 by its first 12 digits, anything else as Python writes it."""
    return v[:12] if isinstance(v, str) and _DIGEST.fullmatch(v) else repr(v)


def neutral_differences(runs) -> str:
    """'threads 1 / 2; parallel-clients 1 / 4': the settings of :data:`NEUTRAL_SETTINGS` in which the runs differ."""
    from ..train.config import with_defaults

    configs = [with_defaults(r.config) for r in runs if isinstance(getattr(r, "config", None), dict)]
    parts = []
    for key in _NEUTRAL_SHOWN:
        vals = list(dict.fromkeys(shown_value(c.get(key)) for c in configs))
        if len(vals) > 1:
            parts.append(f"{key.replace('_', '-')} {' / '.join(vals)}")
    return "; ".join(parts)


def one_run_per_seed(runs, metrics) -> tuple[list, list]:
    """Two runs of one seed (trained with other thread or client-cohort counts, say) are one experiment, not two
    seeds: keep one per seed (the one with the most values, then the first by name) and return (kept, [(left out,
    kept instead)])."""
    by_seed: dict[int, list] = {}
    for r in runs:
        by_seed.setdefault(int(r.seed), []).append(r)
    keep, dropped = set(), []
    for seed, rs in by_seed.items():
        rs = sorted(rs, key=lambda r: (-sum(r.value(m) is not None for m in metrics), str(r.name)))
        keep.add(id(rs[0]))
        dropped += [(r, rs[0]) for r in rs[1:]]
    return [r for r in runs if id(r) in keep], dropped


def check_same_settings(spec: TableSpec, method: str, part: str, runs) -> None:
    """The runs averaged in one row are seeds of one experiment: refuse runs trained with other settings (another
    lr, round count, client count...) than the row's first, naming the settings and both settings digests."""
    from ..utils.provenance import json_digest, short

    configs = [(r, identity) for r, identity in ((r, run_identity(r)) for r in runs) if identity is not None]
    for r, cfg in configs[1:]:
        first, base = configs[0]
        changed = sorted(k for k in set(base) | set(cfg) if base.get(k) != cfg.get(k))
        if changed:
            shown = ", ".join(f"{k} {shown_repr(base.get(k))} vs {shown_repr(cfg.get(k))}" for k in changed[:3])
            raise ConfigError(f"{spec.key} row {method} {part}: {first.name} and {r.name} were trained with other "
                              f"settings ({shown}; settings sha256 {short(json_digest(base))} vs "
                              f"{short(json_digest(cfg))}) and cannot be averaged as seeds; report them separately")


def method_keys(spec: TableSpec, *methods: str) -> set[str]:
    """The settings that make ``methods`` what they are in ``spec``'s plan (the algorithm, optimizer and regularizer,
    and what each method sets: its hyper-parameters, FedAlign's clipping), as :func:`training_settings` keys."""
    from ..paper_tables import REPRODUCED

    keys = set(_METHOD_KEYS)
    table = REPRODUCED.get(spec.key)
    planned = [m.settings for m in (table.methods if table else ()) if m.label in methods]
    # a setting the plan gives the methods alike is no part of what tells them apart
    for settings in planned:
        keys |= {k for k, v in settings.items()
                 if len(planned) < 2 or any(k not in other or other[k] != v for other in planned)}
    return keys | {f"params.{k}" for k in keys}


def settings_differences(spec: TableSpec, method_a: str, training_a, method_b: str, training_b) -> list[str]:
    """How two rows' runs were trained differently, the method aside: ['rounds 2 vs 3', ...] (empty when they are
    the same experiment but for the method, or when a row does not say how its runs were trained: ``training_*``
    not a dict). A hyper-parameter only one of the two methods reads belongs to that method."""
    if not isinstance(training_a, dict) or not isinstance(training_b, dict):
        return []
    skip = method_keys(spec, method_a, method_b)
    out = []
    for k in sorted(set(training_a) | set(training_b)):
        if k in skip or (k.startswith("params.") and (k not in training_a or k not in training_b)):
            continue
        if training_a.get(k) != training_b.get(k):
            out.append(f"{k.removeprefix('params.').replace('_', '-')} {shown_value(training_a.get(k))} vs "
                       f"{shown_value(training_b.get(k))}")
    return out
