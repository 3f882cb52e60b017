"""A run folder read into a :class:`RunRecord`: its config, accuracy curve and every analysis result, checked
against its weights (:mod:`.provenance`), with the analyses of one model selected for the tables.

Method names follow the papers: the base algorithm's name (FedAvg, FedSAM = FedAvg with local SAM, FedDyn...),
then ``+`` and the regularizer's (FedAvg+MAN, FedAvg+Mixup), each the ``display_name`` of its class in ``train/``.
Partitions are written ``dirichlet-0.3``, ``fedml-dirichlet-0.5`` or ``iid``, as in ``paper_values.csv``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, unknown_name
from ..train.catalog import display_name
from ..train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from ..train.identity import data_identity
from .metrics import data_setting, report_metric
from .run_checks import check_provenance, check_runs_belong_together, recorded_versions
from .run_reader import (MODELS, analysis_model, clients_results, measured_round, protocol_order, read_analyses,
                        read_metrics)

__all__ = ["RunRecord", "load_run", "collect_runs", "find_run_dirs", "method_label", "partition_label",
           "choose_clients_protocol", "own_data_digest", "measures_defaults"]


def method_label(cfg: dict) -> str:
    """The paper-style name of a run's method: FedAvg, FedSAM, FedDyn+MAN, FedAvg+Mixup, FedDyn(SAM)+MAN..."""
    algo = str(cfg.get("algo", "fedavg")).lower()
    opt = str(cfg.get("local_opt", "sgd")).lower()
    reg = str(cfg.get("reg", "none")).lower()
    name = display_name(ALGORITHMS, algo)
    if opt != "sgd" and opt in LOCAL_OPTIMIZERS:  # display_name loaded the registries
        opt_name = display_name(LOCAL_OPTIMIZERS, opt)
        name = f"Fed{opt_name}" if algo == "fedavg" else f"{name}({opt_name})"
    if reg != "none":
        name += "+" + display_name(REGULARIZERS, reg)
    return name


def partition_label(cfg: dict) -> str:
    part = str(cfg.get("partition", "dirichlet"))
    return part if part == "iid" else f"{part}-{float(cfg.get('alpha', 0.3)):g}"


def choose_clients_protocol(records) -> str | None:
    """The H_N / H_D protocol a table uses: the one the most runs hold (ties: the preference order of
    :func:`.run_files.protocol_order`), so that a column is one protocol wherever the runs allow it; a run without
    it keeps its own (and is marked)."""
    held = [p for r in records for p in r.clients_all]
    if not held:
        return None
    return min(protocol_order(set(held)), key=lambda p: -held.count(p))


@dataclass
class RunRecord:
    """What the report knows about one run directory. ``analyses`` holds every Hessian analysis found
    (folder name -> hessian.json); :meth:`select` picks the one of a model (and settings) as ``hessian``."""

    run_dir: Path
    config: dict
    method: str
    partition: str
    dataset: str
    seed: int
    rounds_done: int
    curve: list[dict] = field(default_factory=list)  # metrics.csv rows (numbers)
    hessian: dict | None = None  # the table's analysis (of ``model``)
    hessian_path: Path | None = None
    spectrum: dict | None = None  # the top-k and density for the Fig. 4 pages (of ``model``), if any
    surface_path: Path | None = None
    analyses: dict = field(default_factory=dict)
    clients: dict | None = None  # the H_N / H_D used (select_clients)
    model: str = "server"
    stale: dict = field(default_factory=dict)  # analyses of an earlier round than the run's last (folder -> round)
    clients_all: dict = field(default_factory=dict)  # protocol -> H_N / H_D results (clients_results)
    tracking: dict = field(default_factory=dict)  # config.json's curvature-tracking settings (--track-hessian)
    training_path: dict = field(default_factory=dict)  # config.json's record of how it trained (device, clients at once)
    machine: dict = field(default_factory=dict)  # config.json's environment: the machine it trained on (CPU, BLAS...)
    weights_sha256: str | None = None  # the digest of final.pt's weights (a finished run)
    versions: dict = field(default_factory=dict)  # (flatfl, torch) -> what was made with them ('training', ...)
    network: dict | None = None  # config.json's record of the network ('model': a custom network's class, structure)
    data: dict | None = None  # config.json's record of the data ('dataset': custom, the file saved)
    data_digest: str | None = None  # of the own data saved with the run (data.pt; :func:`own_data_digest`)

    @property
    def identity(self) -> dict:
        """What decides this run's numbers besides its seed (:func:`flatfl.train.identity.experiment_settings`, the
        network and data of the user's by their records)."""
        from ..train.identity import experiment_settings

        return experiment_settings(self.config, network=self.network, data=self.data, data_digest=self.data_digest)

    @property
    def network_label(self) -> str | None:
        """'custom my_models.Net' for a network of the user's; None for flatfl's own (its settings name it)."""
        from ..train.identity import network_identity

        return network_identity(self.network).get("model")

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def finished(self) -> bool:
        """Trained to its last round: final.pt written and metrics.csv reaching the rounds config.json asks for (a
        run killed earlier has only resume.pt and round checkpoints)."""
        rounds = self.config.get("rounds")
        rounds = rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None
        return (self.run_dir / "final.pt").is_file() and (rounds is None or self.rounds_done >= rounds)

    def candidates(self, model: str, kind: str = "hessian") -> list[str]:
        """Folders holding a ``kind`` ('hessian' or 'spectrum') analysis of ``model``, the canonical one first."""
        from ..run_layout import analysis_dir

        canon = analysis_dir(kind, model)
        names = [n for n, h in self.analyses.items() if n.split("-")[0] == kind and analysis_model(h) == model]
        return sorted(names, key=lambda n: (n != canon, n))

    def select(self, model: str, settings_ok: Callable[[dict], bool] | None = None) -> "RunRecord":
        """Use the analyses of ``model`` ('server' / 'clients-average'); with ``settings_ok`` only a Hessian
        analysis whose settings it accepts. Sets ``hessian``, ``spectrum``, ``surface_path``; returns self."""
        from ..run_layout import analysis_dir

        if model not in MODELS:
            raise unknown_name("model", model, MODELS)
        self.model = model
        names = [n for n in self.candidates(model) if settings_ok is None or settings_ok(self.analyses[n])]
        # an analysis of the default split and loss first (the one other runs' are comparable with), then one
        # with a top eigenvalue and a trace, which the table needs
        names.sort(key=lambda n: (not measures_defaults(self.analyses[n]),
                                  not (self.analyses[n].get("top_eigenvalues")
                                       and (self.analyses[n].get("trace") or {}).get("estimate") is not None)))
        self.hessian = self.analyses[names[0]] if names else None
        self.hessian_path = self.run_dir / names[0] / "hessian.json" if names else None
        spec = sorted(self.candidates(model, "spectrum"), key=lambda n: not measures_defaults(self.analyses[n]))
        self.spectrum = self.analyses[spec[0]] if spec else None
        surface = self.run_dir / analysis_dir("surface", model) / "surface.npz"
        self.surface_path = surface if surface.is_file() else None
        return self

    def select_clients(self, protocol: str | None) -> "RunRecord":
        """Use the H_N / H_D of ``protocol`` when the run has it, else its first in preference order."""
        order = protocol_order(self.clients_all)
        pick = protocol if protocol in self.clients_all else (order[0] if order else None)
        self.clients = self.clients_all.get(pick) if pick else None
        return self

    @property
    def has_hessian(self) -> bool:
        """Whether the run has a Hessian analysis of its selected model."""
        return bool(self.hessian)

    @property
    def hessian_dir(self) -> str | None:
        return None if self.hessian_path is None else self.hessian_path.parent.name

    def accuracy(self, column: str) -> float | None:
        """The last evaluated ``column`` of metrics.csv, in percent."""
        for row in reversed(self.curve):
            v = row.get(column)
            if v is not None and math.isfinite(v):
                return 100.0 * v
        return None

    def value(self, metric: str) -> float | None:
        """``metric`` of this run's selected model, as its registry entry reads it (:mod:`.metrics`)."""
        return report_metric(metric).value(self)

    def stderr(self, metric: str) -> float | None:
        """The estimator's own error of ``metric`` where the analysis gives one (its registry entry's ``error``:
        the trace's standard error, the top eigenvalue's error estimate or else its residual norm, H_N / H_D's
        standard errors), as a non-negative finite number."""
        v = report_metric(metric).error(self)
        return None if v is None or not math.isfinite(float(v)) else abs(float(v))

    def setting(self, metric: str) -> str | None:
        """The settings that change ``metric``'s number, as one short string (model, method, samples, protocol);
        two runs whose strings differ must not be compared without a mark."""
        return report_metric(metric).setting(self)


def measures_defaults(h: dict | None) -> bool:
    """A hessian.json measured on the default split with the default loss (the one a preset asks for)."""
    return data_setting((h or {}).get("settings") or {}) == ""


_DATA_DIGESTS: dict = {}


def own_data_digest(path: Path) -> str | None:
    """sha256 of the own data a run saved (``data.pt``: its four tensors, then its other fields as JSON), None
    without the file; a damaged one is one ConfigError line. Kept per (path, size, mtime) within a process."""
    from ..utils.provenance import json_digest, state_digest

    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DATA_DIGESTS:
        import torch

        from ..utils.torch_files import PLAIN_PICKLE, check_nesting, load_weights_only, plain_pickle

        try:
            d = load_weights_only(path)
            tensors = {k: d[k] for k in ("train_x", "train_y", "test_x", "test_y")}
            if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise TypeError
        except Exception:
            plain = f" ({PLAIN_PICKLE})" if plain_pickle(path) else ""
            raise ConfigError(f"{path} is not a readable flatfl data file{plain}: the run's data cannot be "
                              "identified; restore it") from None
        check_nesting(d, path, ConfigError)  # before the digest walks it
        rest = {k: v for k, v in d.items() if k not in tensors and k not in ("name", "class_names")}
        _DATA_DIGESTS[key] = json_digest([state_digest(tensors), rest])
    return _DATA_DIGESTS[key]


def _read_config(d: Path) -> dict:
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{d} is not a flatfl run directory (no config.json)")
    from .bounded import check_depth

    try:
        info = json.loads(f.read_text())
        info["config"]
    except RecursionError:
        raise ConfigError(f"{f}: JSON nested too deeply to be a flatfl run config") from None
    except Exception:
        raise ConfigError(f"{f} is not a readable flatfl run config") from None
    check_depth(info, f)
    if not isinstance(info["config"], dict):
        raise ConfigError(f"{f} is not a readable flatfl run config (its 'config' is not a table)")
    return info


def _final_round(d: Path, cfg: dict) -> int | None:
    """The round a finished run ended at (it trained them all); None for a run not finished."""
    rounds = cfg.get("rounds") if (d / "final.pt").is_file() else None
    return rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None


def load_run(run_dir: str | Path, model: str = "server") -> RunRecord:
    """Read a run directory (config.json, metrics.csv, every Hessian analysis, H_N / H_D, the loss surface) and
    select the analyses of ``model``."""
    d = Path(run_dir)
    info = _read_config(d)
    cfg = info["config"]
    tracking = info.get("tracking") if isinstance(info.get("tracking"), dict) else {}
    path = info.get("training_path") if isinstance(info.get("training_path"), dict) else {}
    analyses = read_analyses(d)
    curve = read_metrics(d / "metrics.csv")
    rounds_done = int(curve[-1]["round"]) if curve and curve[-1].get("round") else 0
    # A Hessian of an earlier round (measured before the run was resumed) is never shown beside the final accuracy.
    final_round = _final_round(d, cfg)
    stale = {n: measured_round(h) for n, h in analyses.items()
             if final_round is not None and measured_round(h) not in (None, final_round)}
    analyses = {n: h for n, h in analyses.items() if n not in stale}
    clients_all = clients_results(d, analyses, final_round)
    network = info.get("model") if isinstance(info.get("model"), dict) else None
    data = info.get("dataset") if isinstance(info.get("dataset"), dict) else None
    digests = check_provenance(d, cfg, rounds_done, analyses, clients_all, network=network, data=data)
    own = data_identity(data, None)
    digest = own_data_digest(d / "data.pt") if own and not isinstance(data.get("sha256"), str) else None
    rec = RunRecord(run_dir=d, config=cfg, method=method_label(cfg), partition=partition_label(cfg),
                    dataset=own.get("dataset") or str(cfg.get("dataset", "?")), seed=int(cfg.get("seed", 0)),
                    network=network, data=data, data_digest=digest,
                    rounds_done=rounds_done, curve=curve, analyses=analyses,
                    clients_all=clients_all, stale=stale, tracking=tracking, training_path=path,
                    machine=info["environment"] if isinstance(info.get("environment"), dict) else {},
                    weights_sha256=digests.get("server"),
                    versions=recorded_versions(d, analyses, clients_all))
    return rec.select(model).select_clients(None)


def find_run_dirs(paths) -> list[Path]:
    """Run directories among ``paths``: a path holding config.json is a run; any other directory contributes the
    runs directly inside it (so a sweep's or a reproduction's root can be passed as one argument)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            found.append(p)
        elif p.is_dir():
            inner = sorted(q for q in p.iterdir() if (q / "config.json").is_file())
            if not inner:
                runs = p / "runs"
                inner = sorted(q for q in runs.iterdir() if (q / "config.json").is_file()) if runs.is_dir() else []
            if not inner:
                raise ConfigError(f"{p} holds no flatfl run (no config.json in it or in its sub-directories)")
            found += inner
        else:
            raise ConfigError(f"run directory not found: {p}")
    return list(dict.fromkeys(q.resolve() for q in found))


def collect_runs(paths, model: str = "server") -> list[RunRecord]:
    """Every run under ``paths`` (:func:`find_run_dirs`) read with the analyses of ``model``; two runs holding the
    same final weights are refused."""
    records = [load_run(d, model) for d in find_run_dirs(paths)]
    check_runs_belong_together(records)
    return records
