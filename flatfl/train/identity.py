"""A run's identity as the training registries see it: its recorded settings with every default filled in and only
the hyper-parameters its pieces read (which settings change no number: :mod:`flatfl.utils.run_identity`).

* :func:`run_settings`: what a resumed run, or an existing run folder a sweep finds, must share with the run asked
  for: everything but where and how fast it ran.
* :func:`experiment_settings`: what decides a run's numbers besides its seed: two runs with equal experiment
  settings are seeds of one experiment (a report row averages them; a pair of rows compares them). A run trained
  from Python on a network or data of the user's records them beside its settings (config.json's ``model`` and
  ``dataset``, :mod:`flatfl.train.run_folder`), while its settings keep the defaults (``dataset: digits``,
  ``model: None``): given those records, the network and data they name replace the defaults
  (:func:`network_identity`, :func:`data_identity`).
"""
from __future__ import annotations

import json
from typing import Iterable, Mapping

from ..errors import ConfigError
from ..utils.run_identity import NO_NUMBER_SETTINGS, RESUMABLE_CHANGES, without_settings

__all__ = ["run_settings", "experiment_settings", "piece_hparams", "network_identity", "data_identity",
           "OWN_DATA_UNSAVED"]

#: the data identity of a run on own data that records no digest and has no data.pt (a run of an older flatfl
#: whose data was over the size limit)
OWN_DATA_UNSAVED = "not saved with the run"


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


def network_identity(spec: Mapping | None) -> dict:
    """What identifies a network of the user's (a model spec with ``custom`` set, as config.json's ``model`` and a
    checkpoint's ``model_spec`` record it): ``{"model": "custom <class>", "model_factory": ..., "model_structure":
    <sha256 of its structure: modules, their settings, the code of the user's classes>}``; {} for a network of
    flatfl's own (its settings name it) or no record."""
    from ..utils.provenance import json_digest

    if not isinstance(spec, Mapping) or not (spec.get("custom") or spec.get("name") == "custom"):
        return {}
    structure = spec.get("structure")
    return {"model": f"custom {spec.get('class') or '?'}", "model_factory": spec.get("factory"),
            "model_structure": json_digest(structure) if structure is not None else None}


def data_identity(info: Mapping | None, digest: str | None = None) -> dict:
    """What identifies data of the user's (config.json's ``dataset`` record with ``custom`` set): ``{"dataset":
    "custom <name>", "data_sha256": <the recorded digest, else ``digest`` (of the data.pt saved with the run), else
    :data:`OWN_DATA_UNSAVED`>}``; {} for a data set of flatfl's own (its settings name it) or no record."""
    if not isinstance(info, Mapping) or not info.get("custom"):
        return {}
    recorded, name = info.get("sha256"), info.get("name")
    return {"dataset": "custom" if name in (None, "", "custom") else f"custom {name}",
            "data_sha256": recorded if isinstance(recorded, str) else digest or OWN_DATA_UNSAVED}


def experiment_settings(config: Mapping, *, network: Mapping | None = None, data: Mapping | None = None,
                        data_digest: str | None = None) -> dict:
    """What decides a run's numbers besides its seed: its settings (a missing one at its default) less those that
    change no number, the network by its resolved name, and every hyper-parameter its algorithm, local optimizer
    and regularizer read, at its value or the piece's default (keyed ``params.<flag>``).

    ``network`` / ``data``: the run's records of its network and data (config.json's ``model`` and ``dataset``);
    a network or data of the user's is identified by them (:func:`network_identity`, :func:`data_identity`, with
    ``data_digest`` the digest of the data saved with the run), not by the defaults its settings keep."""
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
    own_network, own_data = network_identity(network), data_identity(data, data_digest)
    if own_network:
        full.pop("model_args", None)  # flatfl's networks' arguments: no part of a network of the user's
    full.update(own_network)
    full.update(own_data)
    return full
