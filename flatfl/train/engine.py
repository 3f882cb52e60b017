"""A training run: :class:`Trainer` builds it from its config, runs (or resumes) its rounds and writes its files.

The work is split by job: building the run (:mod:`flatfl.train.setup`, the network's checks in
:mod:`flatfl.train.network_checks`), one round (:mod:`flatfl.train.rounds`), the run's files
(:mod:`flatfl.train.run_folder`, the resume state in :mod:`flatfl.train.resume`). :class:`Trainer` composes them. The
engine knows nothing about particular algorithms, optimizers or regularizers: it calls the interfaces in
``algorithms/algorithm.py``, ``optimizers.py`` and ``regularizers/regularizer.py``.

Determinism: every random choice derives from the run's seed: the initial model from ``seed``, round t's client
sample from (seed, t), client i's batch order, augmentation and any in-model randomness in round t from
(seed, t, i). A resumed run therefore repeats exactly what an uninterrupted run does, whatever point it was killed at.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import FINAL_FILE
from ..data.partition import make_partition
from ..errors import DivergenceError
from ..utils import ranks
from ..utils.environment import environment
from ..utils.precision import computing_in, gpu_precision_notice, torch_dtype
from ..utils.provenance import settings_digest
from ..version import __version__
from .setup import (check_observer, check_resumed_data, choose_graphs, choose_parallel, build_network, fit_network,
                    is_custom_dataset, load_run_dataset, prepare_process, resolve_pieces, run_partition,
                    set_global_seed, ProcessSetup)
from .catalog import load_all
from .config import RunConfig
from .identity import run_settings
from .over_ranks import agree_on_run
from .network_checks import BATCH_NORMS
from .resume import rng_state
from .rounds import RoundDone, RoundLoop, RoundState, RunData, RunPieces, client_seed, sample_clients
from .run_folder import (METRIC_COLUMNS, dataset_info, last_good_checkpoint, load_resume, read_run_config,
                        recover_final, save_round, save_run_data, update_training_path, write_metrics,
                        write_run_record)

# Trainer, and the names callers import from here (defined in the modules named above)
__all__ = ["Trainer", "read_run_config", "sample_clients", "client_seed", "set_global_seed", "METRIC_COLUMNS",
           "BATCH_NORMS"]


def _state_field(name: str) -> property:
    """The Trainer's read-only view of one field of its :class:`~flatfl.train.rounds.RoundState`."""
    return property(lambda self: getattr(self.state, name), doc=f"``state.{name}`` (:class:`RoundState`)")


class Trainer:
    """Builds a run from its config and runs (or resumes) it. ``run()`` returns the path of ``final.pt``.

    It holds its round loop (:attr:`loop`, a :class:`~flatfl.train.rounds.RoundLoop`) and the state they change
    (:attr:`state`, a :class:`~flatfl.train.rounds.RoundState`: the server model, every client's latest model, how
    many clients train at once); ``theta``, ``buffers``, ``latest``, ``latest_buffers``, ``parallel`` and
    ``parallel_reason`` read that state."""

    theta = _state_field("theta")
    buffers = _state_field("buffers")
    latest = _state_field("latest")
    latest_buffers = _state_field("latest_buffers")
    parallel = _state_field("parallel")
    parallel_reason = _state_field("parallel_reason")

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, quiet: bool = False,
                 log: Callable[[str], None] | None = None, dataset=None, model: torch.nn.Module | None = None,
                 test_dataset=None, model_factory: str | None = None, observer=None,
                 process: ProcessSetup | None = None):
        """``observer``: what else to measure on some rounds, e.g. the curvature (``--track-hessian K``, made by
        :func:`flatfl.analysis.commands.tracking.curvature_observer`; the engine knows nothing of Hessians). It has ``columns``
        (extra metrics.csv columns), ``settings`` (recorded in config.json), ``wants(round, rounds)`` (the round is
        then evaluated) and ``__call__(payload, run_dir) -> dict`` (the columns' values for a checkpoint payload).

        Your own data and network, from Python, override the config's names:

        * ``dataset`` (and ``test_dataset``): a ``torch.utils.data.TensorDataset``, any map-style dataset of
          (image, label) pairs, an (inputs, labels) pair of tensors or an :class:`~flatfl.data.ImageDataset`
          (see :func:`flatfl.data.datasets.as_image_dataset`: without ``test_dataset`` a fixed 20% of each class is
          held out). A custom dataset is saved with the run (``data.pt``, tensors only, up to 1 GiB) so that
          ``flatfl hessian`` and ``--resume`` find it.
        * ``model``: any ``nn.Module`` (deep-copied); ``model_factory="module:function"`` names a function that
          builds it. The checkpoint records that the model is custom and the factory, if given, so that
          ``flatfl hessian CKPT`` (or ``--model-factory``) and ``flatfl.load_checkpoint(path, model=net)`` rebuild
          it from weights alone. Given ``model_factory`` alone, the network is built right after
          ``torch.manual_seed(cfg.seed)``, as the built-in models are: its initial weights follow the run's seed
          (X and X+MAN of one seed start alike). A ``model`` passed in keeps the weights it was built with: call
          ``torch.manual_seed(seed)`` before building it for a repeatable run.

        ``process``: the device and thread count the caller already set this process up with
        (:func:`flatfl.train.setup.start_process`; ``flatfl train`` does so before it makes the run's folder). By
        default the Trainer resolves ``cfg.device`` itself and sets torch's threads to ``cfg.threads`` when the
        config gives a count (else leaves them as the process has them)."""
        load_all()
        check_observer(cfg, observer)
        self.cfg, self.observer, self.run_dir, self.quiet = cfg, observer, Path(run_dir), quiet
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.device = prepare_process(cfg, process)
        self.world = ranks.world()  # the ranks training this run together (one process: a world of one)
        notice = gpu_precision_notice(cfg.precision, self.device)
        if notice and not quiet:
            self.log(notice)
        with computing_in(cfg.precision):  # the network, the data's and the pieces' tensors in the run's type
            self._load_data(resume, dataset, test_dataset)
            self._build_model(resume, model, model_factory)
            self._attach_pieces()
            self._start_rounds()
            if resume:
                self._resume()

    # ----- building (flatfl.train.setup), in the order that draws the run's random numbers -----
    def _load_data(self, resume: bool, dataset, test_dataset) -> None:
        """The data, whether it is custom (saved with the run), augmentation, the partition and its label counts."""
        self.ds = load_run_dataset(self.cfg, self.run_dir, resume, dataset, test_dataset)
        self.custom_data = is_custom_dataset(self.ds)
        if resume and dataset is not None and self.custom_data:  # its digest computed once, for config.json too
            check_resumed_data(self.run_dir, self._data_info().get("sha256"))
        self.augment = self.cfg.augment if self.cfg.augment is not None else self.ds.augment_default
        labels = self.ds.train_y.numpy()
        # make_partition looked up here, in this module, where tests replace it by a partition of their own
        self.partition = run_partition(self.cfg, self.run_dir, resume, labels, make=make_partition)
        self.label_counts = torch.as_tensor(self.partition.label_counts(labels, self.ds.num_classes))

    def _build_model(self, resume: bool, model, model_factory) -> None:
        """The network as the pieces change it, on the run's device, its spec and its parameter layout."""
        from ..models.params import ParamLayout

        model, spec = build_network(self.cfg, self.ds, self.partition, self.run_dir, resume, model=model,
                                    model_factory=model_factory, log=self.log)
        self.pieces = resolve_pieces(self.cfg)
        self.algo_cls, self.reg_cls, self.opt_cls = self.pieces.algo_cls, self.pieces.reg_cls, self.pieces.opt_cls
        self.opt_hp = self.pieces.opt_hp
        model, self.model_spec = fit_network(model, spec, self.pieces)
        self.model = model.to(device=self.device, dtype=torch_dtype(self.cfg.precision))
        if self.observer is not None and hasattr(self.observer, "check_model"):
            self.observer.check_model(self.model)  # its settings against this network, before anything is trained
        self.layout = ParamLayout(self.model)
        self.resolved = self.pieces.resolved

    def _attach_pieces(self) -> None:
        """The algorithm and the regularizer, attached to the network."""
        n = self.partition.num_clients
        self.algo = self.algo_cls(self.pieces.algo_hp, num_clients=n, client_sizes=self.partition.sizes,
                                  layout=self.layout, device=self.device, config=self.cfg)
        self.reg = self.reg_cls(self.pieces.reg_hp, num_classes=self.ds.num_classes, config=self.cfg)
        self.algo.attach(self.model)
        self.reg.attach(self.model)

    def _start_rounds(self) -> None:
        """Round 0: how many clients train at once and whether their steps replay as CUDA graphs, the server and
        every client at the network as built, no metrics yet; the round loop over them."""
        n = self.partition.num_clients
        parallel, why = choose_parallel(self.cfg, self.device, n, self.reg, self.model, log=self.log, quiet=self.quiet)
        self.graphs = choose_graphs(self.cfg, self.device, self.augment, self.log)
        self.state = RoundState.at_start(self.model, self.layout, n, parallel, why)
        self.metrics: list[dict] = []
        self.start_round, self.elapsed, self.observer_seconds = 0, 0.0, 0.0
        data = RunData(self.ds, self.partition, self.label_counts, self.augment, self.world)
        pieces = RunPieces(self.model, self.layout, self.algo, self.reg, self.opt_cls, self.opt_hp)
        self.loop = RoundLoop(self.cfg, self.state, data, pieces, device=self.device, graphs=self.graphs,
                              observer=self.observer, log=self.log)

    def _resume(self) -> None:
        """The state resume.pt holds (none when the run was killed before its first checkpoint)."""
        st = load_resume(self.run_dir, self.cfg.to_dict(), self.layout.dim)
        if st is None:
            return
        dev, state = self.device, self.state
        state.theta = st["theta"].to(dev)
        state.buffers = {k: v.to(dev) for k, v in st["buffers"].items()}
        state.latest = st["latest"].to(dev)
        state.latest_buffers = {k: v.to(dev) for k, v in st["latest_buffers"].items()}
        self.algo.load_state_dict(st["algorithm"])
        self.metrics = list(st["metrics"])
        self.elapsed = float(st.get("elapsed", 0.0))
        self.observer_seconds = float(st.get("observer_seconds", 0.0))
        self.start_round = int(st["round"])

    # ----- the loop (flatfl.train.rounds) -----
    def run_round(self, r: int) -> RoundDone:
        """Round ``r`` (:meth:`RoundLoop.run_round`): its metrics row (``.row``, None when the round is not
        evaluated) and whether the clients' training path changed in it (``.path_changed``). ``run()`` calls it for
        each round and writes what it returns; benchmarks time it. It writes no files."""
        return self.loop.run_round(r)

    def working_network(self, n: int):
        """The network a cohort of ``n`` clients trains and its layout (:meth:`RoundLoop.working_network`)."""
        return self.loop.working_network(n)

    def client_data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``i``'s training data on the run's device (:meth:`RoundLoop.client_data`)."""
        return self.loop.client_data(i)

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's files (config.json, metrics.csv, checkpoints): rank 0 of the ranks
        training together, or the only process; the other ranks hold the same state and write nothing. Every file
        of the run is written under this one test."""
        return self.world.main

    def run(self) -> Path:
        from ..utils.lock import folder_lock

        with folder_lock(self.run_dir), computing_in(self.cfg.precision):
            return self._run()

    def _run(self) -> Path:
        cfg = self.cfg
        if self.start_round >= cfg.rounds:
            if self.writes and recover_final(self.run_dir, self.start_round,
                                                       lambda: self._model_payload(self.start_round)):
                self.log(f"run {self.run_dir}: wrote the missing final.pt of round {self.start_round}")
            else:
                self.log(f"run {self.run_dir} already finished ({cfg.rounds} rounds)")
            return self.run_dir / FINAL_FILE
        agree_on_run(self.ds, self.partition, self.theta, self.buffers, self.world)  # the ranks built alike
        if self.writes:
            self._write_run_files()
        from tqdm.auto import tqdm

        bar = tqdm(range(self.start_round, cfg.rounds), initial=self.start_round, total=cfg.rounds, unit="round",
                   desc="train", disable=self.quiet or not sys.stderr.isatty(), leave=False)
        last_logged = time.monotonic()
        for r in bar:
            t0 = time.perf_counter()
            try:
                done = self.run_round(r)
            except DivergenceError as e:
                bar.close()
                good = last_good_checkpoint(self.run_dir)
                raise DivergenceError(f"{e}; stopped. Last good checkpoint: {good}") from None
            self.elapsed += time.perf_counter() - t0
            if done.path_changed and self.writes:  # clients no longer train together
                update_training_path(self.run_dir, self.training_path(), start_round=self.start_round, from_round=r + 1)
            row = done.row
            if row is not None:
                self._record_row(r, row)
                bar.set_postfix(acc=f"{row['test_acc']:.3f}", loss=f"{row['train_loss']:.3f}")
                if not self.quiet and (bar.disable and (time.monotonic() - last_logged > 10 or r + 1 == cfg.rounds)):
                    self.log(f"round {r + 1}/{cfg.rounds}: train loss {row['train_loss']:.4f}, "
                             f"test acc {row['test_acc']:.4f} (all-clients avg {row['all_test_acc']:.4f})")
                    last_logged = time.monotonic()
            if ((r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds) and self.writes:
                self._checkpoint(r + 1, final=(r + 1 == cfg.rounds))
        bar.close()
        if self.observer is not None and not self.quiet:
            share = self.observer_seconds / max(self.elapsed, 1e-9)
            self.log(f"{self.observer.name}: {self.observer_seconds:.1f} s, {100 * share:.1f}% of the training time "
                     f"({self.elapsed:.1f} s)")
        return self.run_dir / FINAL_FILE

    def _record_row(self, r: int, row: dict) -> None:
        """Round ``r``'s metrics with the time so far and the observer's columns, appended to metrics.csv."""
        row["seconds"] = round(self.elapsed, 3)
        if self.observer is not None and self.observer.wants(r + 1, self.cfg.rounds):
            t1 = time.perf_counter()
            row.update(self.observer(self._model_payload(r + 1), self.run_dir))
            self.observer_seconds += time.perf_counter() - t1
            row["observer_seconds"] = round(self.observer_seconds, 3)
        self.metrics.append(row)
        extra = list(self.observer.columns) + ["observer_seconds"] if self.observer is not None else []
        if self.writes:
            write_metrics(self.run_dir, self.metrics, extra)

    # ----- files (flatfl.train.run_folder) -----
    def training_path(self) -> dict:
        """Which computation trained the run: the device, how many clients trained at once and why, how float32
        products ran, the parameters' floating type. Recorded in config.json; the report's scale line names it."""
        dev = self.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
        return {"device": str(dev), **({"device_name": name} if name else {}), "clients_at_once": self.parallel,
                "clients_at_once_why": self.parallel_reason, "float32_matmul": self.cfg.float32_matmul,
                "cuda_graphs": self.graphs,
                "dtype": str(self.theta.dtype).replace("torch.", ""), **ranks.record()}

    def _recorded_config(self) -> dict:
        cfg = self.cfg.to_dict()
        cfg["out"] = str(self.run_dir)
        return cfg

    def _write_run_files(self) -> None:
        """config.json, and (once) partition.json and a custom dataset's data.pt."""
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        record = {"flatfl_version": __version__, "config": self._recorded_config(), "model": self.model_spec,
                  "resolved": self.resolved, "dataset": self._data_info(),
                  "environment": environment(self.device), "training_path": self.training_path(),
                  **({"tracking": self.observer.settings} if self.observer else {}),
                  **({"regularizer": self.reg.record()} if self.reg.record() else {})}
        write_run_record(d, record, start_round=self.start_round)
        save_run_data(d, self.ds, self.custom_data, self.partition, self.label_counts, self.log)

    def _data_info(self) -> dict:
        """config.json's and every checkpoint's record of the data (:func:`dataset_info`), its digest computed once."""
        if getattr(self, "_data_record", None) is None:
            self._data_record = dataset_info(self.ds, self.custom_data)
        return dict(self._data_record)

    def _model_payload(self, rnd: int) -> dict:
        """The checkpoint of round ``rnd`` (:mod:`flatfl.checkpoint`): the server model, the all-clients average,
        and what analysis needs to rebuild and evaluate them."""
        self.loop.load_into_model(self.theta, self.buffers)
        server = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        self.loop.load_into_model(self.loop.all_clients_params(), self.buffers)
        all_sd = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return {
            "flatfl_version": __version__,
            "model_spec": self.model_spec,
            "state_dict": server,
            "all_state_dict": all_sd,
            "dataset": {"name": self.ds.name, "data_dir": str(Path(self.cfg.data_dir).resolve()),
                        "num_classes": self.ds.num_classes, "input_shape": list(self.ds.input_shape),
                        **self._data_info()},
            "partition": self.partition.to_dict(),
            "config": self._recorded_config(),
            "resolved": self.resolved,
            "round": rnd,
            "metrics": list(self.metrics),
            "rng": {"torch": torch.get_rng_state(), "seed": self.cfg.seed},
        }

    def _checkpoint(self, rnd: int, final: bool) -> None:
        """Round ``rnd``'s checkpoint, clients.pt (``--save-clients``), final.pt on the last round, resume.pt."""
        payload = self._model_payload(rnd)
        clients = None
        if self.cfg.save_clients:
            clients = {"round": rnd, "run_settings_sha256": settings_digest(payload["config"]),
                       "params": self.latest.cpu(), "buffers": {k: v.cpu() for k, v in self.latest_buffers.items()},
                       "num_samples": torch.as_tensor(self.partition.sizes)}
        state = {
            "round": rnd, "finished": final, "theta": self.theta.cpu(), "buffers": {k: v.cpu() for k, v in self.buffers.items()},
            "latest": self.latest.cpu(), "latest_buffers": {k: v.cpu() for k, v in self.latest_buffers.items()},
            "algorithm": self.algo.state_dict(), "metrics": list(self.metrics), "elapsed": self.elapsed,
            "observer_seconds": self.observer_seconds, "rng": rng_state(), "settings": run_settings(self.cfg.to_dict()),
        }
        save_round(self.run_dir, rnd, payload, state, final=final, clients=clients)
