"""A run's identity as the training registries see it: its recorded settings with every default filled in and only
the hyper-parameters its pieces read (which settings change no number: :mod:`flatfl.utils.run_identity`).

* :func:`run_settings`: what a resumed run, or an existing run folder a sweep finds, must share with the run asked
  for: everything but where and how fast it ran.
* :func:`experiment_settings`: what decides a run's numbers besides its seed: two runs with equal experiment
  settings are seeds of one experiment (a report row averages them; a pair of rows compares them).
"""
from __future__ import annotations

import json
from typing import Iterable, Mapping

from ..errors import ConfigError
from ..utils.run_identity import NO_NUMBER_SETTINGS, RESUMABLE_CHANGES, without_settings

__all__ = ["run_settings", "experiment_settings", "piece_hparams"]


def piece_hparams(config: Mapping) -> dict | None:
    """{key: default} of every hyper-parameter the run's algorithm, the local optimizer it runs and its regularizer
    read; None for a piece this version does not know."""
    from .catalog import load_all
    from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
    from .config import RunConfig

    load_all()
    try:
        algo = ALGORITHMS.get_class(str(config.get("algo", RunConfig.algo)))
        pieces = (algo, LOCAL_OPTIMIZERS.get_class(algo.local_optimizer(str(config.get("local_opt",
                                                                                        RunConfig.local_opt)))),
                  REGULARIZERS.get_class(str(config.get("reg", RunConfig.reg))))
    except (ConfigError, TypeError, AttributeError):
        return None
    return {hp.key: hp.default for cls in pieces for hp in cls.hparams}


def _filled(config: Mapping, drop: Iterable[str]) -> dict:
    """``config`` (as JSON would store it) with RunConfig's defaults for what it lacks, less ``drop``, its
    ``params`` restricted to the hyper-parameters its pieces read (all of them, where a piece is unknown)."""
    from .config import with_defaults

    out = without_settings(with_defaults(json.loads(json.dumps(dict(config), default=str))), drop)
    read = piece_hparams(out)
    if isinstance(out.get("params"), dict) and read is not None:
        out["params"] = {k: v for k, v in out["params"].items() if k in read}
    return out


def run_settings(config: Mapping) -> dict:
    """The settings a run folder holds that a resumption of it, or a sweep that finds it, must ask for alike: all
    but :data:`~flatfl.utils.run_identity.RESUMABLE_CHANGES`."""
    return _filled(config, RESUMABLE_CHANGES)


def experiment_settings(config: Mapping) -> dict:
    """What decides a run's numbers besides its seed: its settings (a missing one at its default) less those that
    change no number, the network by its resolved name, and every hyper-parameter its algorithm, local optimizer
    and regularizer read, at its value or the piece's default (keyed ``params.<flag>``)."""
    from .config import RunConfig

    full = _filled(config, (*NO_NUMBER_SETTINGS, "seed"))
    params = full.pop("params", None)
    params = dict(params) if isinstance(params, dict) else {}
    try:
        full["model"] = RunConfig.from_dict(full).resolved_model()
    except (ConfigError, TypeError, AttributeError):
        pass
    for key, default in (piece_hparams(full) or {}).items():
        params.setdefault(key, default)
    full.update({f"params.{k}": v for k, v in params.items()})
    return full
