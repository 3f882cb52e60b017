"""Building a run from its config, one step a function, in the order :class:`~flatfl.train.engine.Trainer` calls
them (the order draws the run's random numbers in, so it is part of the run's numbers):

1. :func:`check_observer`, :func:`prepare_process`: the process (device and threads, once:
   :func:`start_process`; float32 products, the global seeds);
2. :func:`load_run_dataset`, :func:`run_partition`: the data and its split over the clients;
3. :func:`build_network`: the network, seeded so that every run of a seed starts from the same weights, and checked
   against the data (:mod:`flatfl.train.network_checks`);
4. :func:`resolve_pieces`, :func:`fit_network`: the algorithm, local optimizer and regularizer with their
   hyper-parameters, and the network as they change it, recorded in its spec;
5. :func:`choose_parallel`, :func:`choose_graphs`: how the clients train (how many at once, CUDA graphs).
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..data import load_dataset
from ..data.partition import Partition, make_partition
from ..errors import ConfigError
from ..utils import ranks
from ..utils.device import resolve_device
from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from .config import RunConfig
from .network_checks import check_model_fits_data, check_no_batch_of_one, check_spec_rebuilds
from .run_folder import (CONFIG_FILE, CUSTOM_DATA_FILE, saved_factory, saved_partition, saved_run_info)

__all__ = ["set_global_seed", "check_observer", "ProcessSetup", "start_process", "prepare_process", "load_run_dataset", "is_custom_dataset",
           "check_resumed_data", "run_partition", "build_network", "check_same_network", "Pieces", "resolve_pieces",
           "fit_network", "choose_parallel", "choose_graphs"]


def set_global_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def check_observer(cfg: RunConfig, observer) -> None:
    """``--track-hessian`` needs the observer that computes the curvature (the engine knows nothing of Hessians)."""
    if cfg.track_hessian and observer is None:
        raise ConfigError("--track-hessian needs the observer that computes the curvature: "
                          "Trainer(..., observer=flatfl.analysis.commands.tracking.curvature_observer(cfg))")
    if observer is not None:  # its columns go beside metrics.csv's own: a name twice would be read as the other
        from .run_folder import METRIC_COLUMNS

        columns = getattr(observer, "columns", None)
        if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) and c for c in columns):
            raise ConfigError(f"the observer {type(observer).__name__} has no list of column names (columns)")
        taken = [c for i, c in enumerate(columns) if c in (*METRIC_COLUMNS, "observer_seconds") or c in columns[:i]]
        if taken:
            raise ConfigError(f"the observer's column {taken[0]!r} is metrics.csv's own or named twice: name its "
                              "columns apart")


@dataclass(frozen=True)
class ProcessSetup:
    """How this process computes a run, as :func:`start_process` set it: the device (under torchrun this rank's,
    the ranks joined) and torch's thread count."""
    device: torch.device
    threads: int


def start_process(device: str, threads: int | None, *, set_threads: bool = True) -> ProcessSetup:
    """Resolve ``device`` (one line naming the problem when it cannot be used), join the ranks under torchrun, and
    set torch's threads to ``threads`` (None: the machine's default, :func:`flatfl.utils.threads.default_threads`;
    ``set_threads=False``: left as the process has them). Once per run: ``flatfl train`` calls it before it makes
    the run's folder (the ranks meet there) and hands the result to the Trainer."""
    dev = ranks.join(resolve_device(device))  # under torchrun: the process group, this rank's device
    if set_threads:
        from ..utils.threads import apply_threads

        return ProcessSetup(dev, apply_threads(threads))
    return ProcessSetup(dev, torch.get_num_threads())


def prepare_process(cfg: RunConfig, process: ProcessSetup | None = None) -> torch.device:
    """Set the process up for the run and return its device: ``process`` (by default :func:`start_process` with
    the config's device and thread count, None leaving torch's threads as the process has them, which the command
    line sets), freed activation memory reused across steps (:mod:`flatfl.utils.memory`), float32 products as
    recorded (never torch's default, :mod:`flatfl.utils.precision`), and python's, numpy's and torch's generators
    at the run's seed."""
    from ..utils.memory import keep_freed_memory
    from ..utils.precision import set_float32_matmul

    if process is not None and not isinstance(process, ProcessSetup):
        raise ConfigError(f"Trainer(process=...) takes what flatfl.train.setup.start_process returns, "
                          f"not {type(process).__name__}")
    keep_freed_memory()
    if process is None:
        process = start_process(cfg.device, cfg.threads, set_threads=cfg.threads is not None)
    set_float32_matmul(cfg.float32_matmul)
    if torch.are_deterministic_algorithms_enabled():  # (setting it imports torch._inductor: seconds a process)
        torch.use_deterministic_algorithms(False)
    set_global_seed(cfg.seed)
    return process.device


def load_run_dataset(cfg: RunConfig, run_dir: Path, resume: bool, dataset=None, test_dataset=None):
    """The run's :class:`~flatfl.data.ImageDataset`: ``dataset`` (and ``test_dataset``) when given (see
    :func:`flatfl.data.datasets.as_image_dataset`), else a resumed run's saved custom data (data.pt), else the
    config's dataset by name. A resumed custom-data run whose data was not saved is refused."""
    from ..data.datasets import as_image_dataset

    if dataset is None and resume and (run_dir / CUSTOM_DATA_FILE).is_file():
        from ..checkpoint import load_run_data

        recorded = (saved_run_info(run_dir).get("dataset") or {}).get("sha256")
        dataset = load_run_data(run_dir / CUSTOM_DATA_FILE, recorded, run_dir)  # another run's data.pt is refused
    elif dataset is None and resume and (saved_run_info(run_dir).get("dataset") or {}).get("custom"):
        raise ConfigError(f"{run_dir} was trained on a custom dataset that was not saved with it: resume it "
                          "from Python, Trainer(cfg, run_dir, resume=True, dataset=...)")
    if dataset is not None:
        return as_image_dataset(dataset, test_dataset)
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.download)


def check_resumed_data(run_dir: Path, digest: str | None) -> None:
    """Data given again to a resumed run (``digest``: its sha256, as config.json records it) is the data the run
    trained on, where the run recorded a digest."""
    recorded = (saved_run_info(run_dir).get("dataset") or {}).get("sha256")
    if isinstance(recorded, str) and digest != recorded:
        raise ConfigError(f"resuming {run_dir}: the data given is not the data the run trained on (sha256 "
                          f"{str(digest)[:12]}..., the run recorded {recorded[:12]}...): resume it with its own data")


def is_custom_dataset(ds) -> bool:
    """Whether ``ds`` is none of flatfl's named datasets (then it is saved with the run)."""
    from ..data.datasets import DATASETS

    return ds.name.lower().replace("-", "").replace("_", "") not in DATASETS


def run_partition(cfg: RunConfig, run_dir: Path, resume: bool, labels: np.ndarray,
                  make: Callable[..., Partition] = make_partition) -> Partition:
    """The clients' split of the training set: a resumed run's partition.json, else ``make`` (the config's
    partition, from its seed). A client left without data is refused."""
    partition = saved_partition(run_dir) if resume else None
    if partition is None:
        partition = make(labels, cfg.clients, cfg.partition, cfg.alpha, cfg.seed)
    if (partition.sizes == 0).any():
        raise ConfigError(f"partition left {int((partition.sizes == 0).sum())} clients without data: "
                          "use fewer clients")
    return partition


def build_network(cfg: RunConfig, ds, partition: Partition, run_dir: Path, resume: bool, *,
                  model: torch.nn.Module | None = None, model_factory: str | None = None,
                  log: Callable[[str], None] = print) -> tuple[torch.nn.Module, dict]:
    """(network, spec) before the pieces change it. Built after ``torch.manual_seed(cfg.seed)``, so that every run
    of a seed starts from the same weights (X and X+MAN alike): the config's model, or ``model_factory``'s (a
    resumed custom-network run: the factory its config.json recorded), or a deep copy of ``model``, which keeps the
    weights it was built with. Checked before anything trains: your network against your data, a resumed custom
    network against the one the run trained, every client's last batch against the batch normalisations."""
    from ..models import build_model

    torch.manual_seed(cfg.seed)
    if model is None and model_factory is None and resume:
        model_factory = saved_factory(run_dir)
        if model_factory is not None:  # named by config.json: only a module of the current directory
            from ..models.factory import check_recorded_factory

            model_factory = check_recorded_factory(model_factory, str(Path(run_dir) / CONFIG_FILE))
    if model is None and model_factory is not None:
        from ..models.factory import model_from_factory

        model = model_from_factory(model_factory)
    if model is None:
        model = build_model(cfg.resolved_model(), num_classes=ds.num_classes, in_channels=ds.in_channels,
                            image_size=ds.image_size, **cfg.model_args)
    else:
        model = copy.deepcopy(model)
        check_model_fits_data(model, ds)  # your network on your data: one item, before any training
    if getattr(model, "flatfl_spec", None):
        spec = dict(model.flatfl_spec)
    else:
        from ..models.factory import check_factory_name, import_function
        from ..models.structure import describe_model_class, network_structure

        # the structure (modules, their settings and values, the code of yours they and the factory run) lets
        # analysis tell when the factory builds another network than the one trained (before the algorithm wraps it)
        factory = None if model_factory is None else import_function(check_factory_name(model_factory))
        spec = {"name": "custom", "kwargs": {}, "custom": True, "class": describe_model_class(model),
                "factory": model_factory, "structure": network_structure(model, factory)}
        if resume:
            check_same_network(run_dir, model, log, factory)
    check_no_batch_of_one(model, partition.sizes, cfg.batch_size, ds.input_shape)
    return model, spec


def check_same_network(run_dir: Path, model, log: Callable[[str], None], factory=None) -> None:
    """Resuming a custom-network run: the network is the one its earlier rounds trained (the structure config.json
    recorded); another one is refused, changed code of yours (classes, helpers, the factory) is said aloud. Runs
    without a record pass."""
    from ..models.structure import code_changes, structure_difference

    saved = (saved_run_info(run_dir).get("model") or {}).get("structure")
    differs = structure_difference(saved, model)
    if differs:
        raise ConfigError(f"--resume {run_dir}: your network is not the one the run trained ({differs}); resume "
                          "with the network it was trained with")
    changed = code_changes(saved, model, factory)
    if changed:
        log(f"notice: the code of {', '.join(changed)} changed since {run_dir} was trained; training goes on with "
            "the code as it is now")


@dataclass
class Pieces:
    """The run's algorithm, local optimizer and regularizer classes and their resolved hyper-parameters."""

    algo_cls: type
    opt_cls: type
    reg_cls: type
    algo_hp: dict
    opt_hp: dict
    reg_hp: dict

    @property
    def resolved(self) -> dict:
        """Each piece's name and hyper-parameters, as config.json and the checkpoints record them."""
        return {"algorithm": {"name": self.algo_cls.name, **self.algo_hp},
                "local_opt": {"name": self.opt_cls.name, **self.opt_hp},
                "regularizer": {"name": self.reg_cls.name, **self.reg_hp}}


def resolve_pieces(cfg: RunConfig) -> Pieces:
    """The config's pieces (the local optimizer as the algorithm chooses it) and their hyper-parameters."""
    algo_cls = ALGORITHMS.get_class(cfg.algo)
    reg_cls = REGULARIZERS.get_class(cfg.reg)
    opt_cls = LOCAL_OPTIMIZERS.get_class(algo_cls.local_optimizer(cfg.local_opt))
    algo_hp, reg_hp = (c.resolve(cfg.params) for c in (algo_cls, reg_cls))
    opt_hp = opt_cls.resolve(algo_cls.optimizer_settings(cfg.params))
    return Pieces(algo_cls, opt_cls, reg_cls, algo_hp, opt_hp, reg_hp)


def fit_network(model: torch.nn.Module, spec: dict, pieces: Pieces) -> tuple[torch.nn.Module, dict]:
    """The network as the algorithm wraps it and the regularizer prepares it, and its spec as trained (projection
    head, survival): analysis rebuilds it from :mod:`flatfl.models` alone, without this run's pieces."""
    from ..models import architecture_spec

    model = pieces.algo_cls.wrap_model(model, pieces.algo_hp)
    model = pieces.reg_cls.prepare_model(model, pieces.reg_hp)
    spec = architecture_spec(model, spec)
    check_spec_rebuilds(model, spec, pieces.algo_cls.name, pieces.reg_cls.name)
    return model, spec


def choose_parallel(cfg: RunConfig, device: torch.device, num_clients: int, reg, model: torch.nn.Module, *,
                    log: Callable[[str], None], quiet: bool) -> tuple[int, str]:
    """(N, why): how many of a round's participants train at once (``--parallel-clients``; None: all on CUDA, one
    elsewhere). One at a time, said once, when the regularizer ``reg`` or the network cannot train stacked."""
    asked = cfg.parallel_clients
    if asked is None:
        asked = "all" if device.type == "cuda" else 1
    n = num_clients if asked == "all" else min(int(asked), num_clients)
    if n == 1:
        return 1, "one client at a time"
    from ..models.stacking import stacking_refusal

    refusal = None
    why = reg.cohort_refusal(model)
    if why is not None:
        refusal = f"--reg {reg.name} trains one client at a time: {why}"
    else:
        why = stacking_refusal(model)
        if why is not None:
            refusal = f"the model cannot be stacked: {why}"
    if refusal is not None:
        log(f"--parallel-clients {asked}: training one client at a time ({refusal})")
        return 1, refusal
    why = f"up to {n} clients at once (--parallel-clients {asked}" + \
        (", the default on CUDA)" if cfg.parallel_clients is None else ")")
    if not quiet:
        log(f"training {why}")
    return n, why


def choose_graphs(cfg: RunConfig, device: torch.device, augment: bool, log: Callable[[str], None]) -> bool:
    """Whether cohorts' full steps are captured and replayed as CUDA graphs (``--cuda-graphs``)."""
    if not cfg.cuda_graphs:
        return False
    from .step_graph import capture_refusal

    why = capture_refusal(device)
    if why is not None:
        raise ConfigError(why)
    if augment:
        log("--cuda-graphs: steps run eagerly (augmentation draws on the host at every step)")
        return False
    return True
