"""The round loop: sample clients, train them locally, aggregate, evaluate, checkpoint, resume.

The engine knows nothing about particular algorithms, optimizers or regularizers: it calls the interfaces in
``algorithms/base.py``, ``optimizers.py`` and ``regularizers/base.py``.

Determinism: every random choice derives from the run's seed: the initial model from ``seed``, round t's client
sample from (seed, t), client i's batch order, augmentation and any in-model randomness in round t from
(seed, t, i). A resumed run therefore repeats exactly what an uninterrupted run does, whatever point it was killed at.
"""
from __future__ import annotations

import copy
import csv
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..version import __version__
from .config import RunConfig
from ..data import load_dataset
from ..data.partition import Partition, make_partition
from ..errors import ConfigError, DivergenceError
from ..utils.io import atomic_torch_save, atomic_write_bytes, atomic_write_json, atomic_write_text
from ..utils.device import resolve_device
from ..utils.environment import environment
from ..utils.provenance import settings_digest
from ..utils.run_identity import differing_keys
from .algorithms.base import Algorithm, weighted_mean
from ..checkpoint import FINAL_FILE, save_checkpoint, save_clients_average
from .catalog import load_all
from .components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from .context import ClientContext, Cohort, RoundContext, client_rng, frozen_copy
from .evaluate import evaluate
from .identity import run_settings
from .local import train_cohort
from .resume import load_resume_state, rng_state, save_resume_state
from ..models.params import ParamLayout, float_buffers

METRIC_COLUMNS = ["round", "lr", "clients", "local_loss", "train_loss", "train_acc", "test_loss", "test_acc",
                  "all_test_loss", "all_test_acc", "seconds"]
CACHE_LIMIT_BYTES = 1 << 30  # normalised copies of a split are kept in memory below this size
CUSTOM_DATA_FILE = "data.pt"  # a custom dataset saved with its run (tensors only)
CUSTOM_DATA_LIMIT_BYTES = 1 << 30


def sample_clients(seed: int, rnd: int, num_clients: int, participation: float, method: str) -> np.ndarray:
    """Round ``rnd``'s participants. 'bernoulli': each client joins independently with probability p, redrawn if
    none joins (FedDyn code); 'fraction': a uniform sample of max(1, round(p N)) clients."""
    rng = np.random.default_rng([seed, rnd, 0])
    if method == "bernoulli":
        while True:
            active = rng.uniform(size=num_clients) <= participation
            if active.any():
                return np.flatnonzero(active)
    m = max(1, int(round(participation * num_clients)))
    return np.sort(rng.choice(num_clients, size=m, replace=False))


def client_seed(seed: int, rnd: int, client: int) -> int:
    # int() before the shift: numpy 1.x turns uint64 >> a Python int into float64 and refuses the shift
    return int(np.random.SeedSequence([seed, rnd, client, 1]).generate_state(1, dtype=np.uint64)[0]) >> 1


def set_global_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class Trainer:
    """Builds a run from its config and runs (or resumes) it. ``run()`` returns the path of ``final.pt``."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, quiet: bool = False,
                 log: Callable[[str], None] | None = None, dataset=None, model: torch.nn.Module | None = None,
                 test_dataset=None, model_factory: str | None = None, observer=None):
        """``observer``: what else to measure on some rounds, e.g. the curvature (``--track-hessian K``, made by
        :func:`flatfl.analysis.tracking.curvature_observer`; the engine knows nothing of Hessians). It has ``columns``
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
          ``torch.manual_seed(seed)`` before building it for a repeatable run."""
        load_all()
        from ..utils.memory import keep_freed_memory

        keep_freed_memory()  # reuse freed activation memory across steps (see flatfl/utils/memory.py)
        self.cfg = cfg
        if cfg.track_hessian and observer is None:
            raise ConfigError("--track-hessian needs the observer that computes the curvature: "
                              "Trainer(..., observer=flatfl.analysis.tracking.curvature_observer(cfg))")
        self.observer = observer
        self.observer_seconds = 0.0
        self.run_dir = Path(run_dir)
        self.quiet = quiet
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.device = resolve_device(cfg.device)
        from ..utils.precision import set_float32_matmul

        set_float32_matmul(cfg.float32_matmul)  # a recorded setting, never torch's default (flatfl.utils.precision)
        if cfg.threads is not None:  # None: leave the process's setting (the CLI sets the default of utils.threads)
            from ..utils.threads import apply_threads

            apply_threads(cfg.threads)
        torch.use_deterministic_algorithms(False)
        set_global_seed(cfg.seed)

        from ..data.datasets import DATASETS, as_image_dataset, load_saved_dataset

        if dataset is None and resume and (self.run_dir / CUSTOM_DATA_FILE).is_file():
            dataset = load_saved_dataset(self.run_dir / CUSTOM_DATA_FILE)
        elif dataset is None and resume and (_saved_run_info(self.run_dir).get("dataset") or {}).get("custom"):
            raise ConfigError(f"{self.run_dir} was trained on a custom dataset that was not saved with it: resume it "
                              "from Python, Trainer(cfg, run_dir, resume=True, dataset=...)")
        self.ds = as_image_dataset(dataset, test_dataset) if dataset is not None else \
            load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
        self.custom_data = self.ds.name.lower().replace("-", "").replace("_", "") not in DATASETS
        self.augment = cfg.augment if cfg.augment is not None else self.ds.augment_default
        labels = self.ds.train_y.numpy()
        part_file = self.run_dir / "partition.json"
        if resume and part_file.is_file():
            try:
                self.partition = Partition.from_dict(json.loads(part_file.read_text(encoding="utf-8")))
            except Exception:
                raise ConfigError(f"--resume: {part_file} is corrupt; restore it or start a new run") from None
        else:
            self.partition = make_partition(labels, cfg.clients, cfg.partition, cfg.alpha, cfg.seed)
        if (self.partition.sizes == 0).any():
            raise ConfigError(f"partition left {int((self.partition.sizes == 0).sum())} clients without data: "
                              "use fewer clients")
        self.label_counts = torch.as_tensor(self.partition.label_counts(labels, self.ds.num_classes))

        # The model: seeded so that every run with this seed starts from the same weights (MAN reuses one init).
        from ..models import architecture_spec, build_model

        torch.manual_seed(cfg.seed)
        if model is None and model_factory is None and resume:
            model_factory = _saved_factory(self.run_dir)
            if model_factory is not None:  # named by config.json: only a module of the current directory
                from ..models.factory import check_recorded_factory

                model_factory = check_recorded_factory(model_factory, str(Path(self.run_dir) / "config.json"))
        if model is None and model_factory is not None:
            from ..models.factory import model_from_factory

            model = model_from_factory(model_factory)
        if model is None:
            model = build_model(cfg.resolved_model(), num_classes=self.ds.num_classes,
                                in_channels=self.ds.in_channels, image_size=self.ds.image_size, **cfg.model_args)
        else:
            model = copy.deepcopy(model)
            _check_model_fits_data(model, self.ds)  # your network on your data: one item, before any training
        if getattr(model, "flatfl_spec", None):
            self.model_spec = dict(model.flatfl_spec)
        else:
            from ..models.factory import check_factory_name, describe_model_class, network_structure

            # the structure (modules, their settings, your classes' code) lets analysis tell when the factory
            # builds another network than the one trained (before the algorithm wraps it)
            self.model_spec = {"name": "custom", "kwargs": {}, "custom": True, "class": describe_model_class(model),
                               "factory": None if model_factory is None else check_factory_name(model_factory),
                               "structure": network_structure(model)}
            if resume:
                _check_same_network(self.run_dir, model, self.log)
        _check_no_batch_of_one(model, self.partition.sizes, cfg.batch_size, self.ds.input_shape)
        self.algo_cls = ALGORITHMS.get_class(cfg.algo)
        self.reg_cls = REGULARIZERS.get_class(cfg.reg)
        self.opt_cls = LOCAL_OPTIMIZERS.get_class(self.algo_cls.local_optimizer(cfg.local_opt))
        algo_hp, reg_hp = (c.resolve(cfg.params) for c in (self.algo_cls, self.reg_cls))
        self.opt_hp = self.opt_cls.resolve(self.algo_cls.optimizer_settings(cfg.params))
        model = self.algo_cls.wrap_model(model, algo_hp)
        model = self.reg_cls.prepare_model(model, reg_hp)
        # the checkpoint stores the architecture as trained (projection head, survival): analysis rebuilds it
        # from flatfl.models alone, without this run's algorithm or regularizer
        self.model_spec = architecture_spec(model, self.model_spec)
        _check_spec_rebuilds(model, self.model_spec, self.algo_cls.name, self.reg_cls.name)
        self.model = model.to(self.device)
        if observer is not None and hasattr(observer, "check_model"):
            observer.check_model(self.model)  # its settings against this network, before anything is trained
        self.layout = ParamLayout(self.model)
        self.resolved = {"algorithm": {"name": self.algo_cls.name, **algo_hp},
                         "local_opt": {"name": self.opt_cls.name, **self.opt_hp},
                         "regularizer": {"name": self.reg_cls.name, **reg_hp}}

        n = self.partition.num_clients
        self.algo: Algorithm = self.algo_cls(algo_hp, num_clients=n, client_sizes=self.partition.sizes,
                                             layout=self.layout, device=self.device, config=cfg)
        self.reg = self.reg_cls(reg_hp, num_classes=self.ds.num_classes, config=cfg)
        self.algo.attach(self.model)
        self.reg.attach(self.model)

        self.theta = self.layout.get()
        self.buffers = {k: v.detach().clone() for k, v in float_buffers(self.model).items()}
        self.latest = self.theta.unsqueeze(0).repeat(n, 1)  # each client's most recent local model
        self.latest_buffers = {k: v.unsqueeze(0).repeat(n, *[1] * v.dim()) for k, v in self.buffers.items()}
        self._networks: dict[int, tuple] = {}
        self.parallel, self.parallel_reason = self._choose_parallel()
        self.graphs = self._choose_graphs()
        self._noticed = False
        self.metrics: list[dict] = []
        self.start_round = 0
        self.elapsed = 0.0

        self._train_cache = self._maybe_cache(self.ds.train_x)
        self._test_cache = self._maybe_cache(self.ds.test_x)
        if resume:
            self._load_resume_state()

    # ----- data -----
    def _maybe_cache(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.numel() * 4 <= CACHE_LIMIT_BYTES:
            return self._as_model_dtype(self.ds.normalize(x.to(self.device)))
        return None

    def _as_model_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs in the floating type of the model's parameters (float32; float64 for a float64 model)."""
        dtype = self.theta.dtype
        return x if x.dtype == dtype else x.to(dtype)

    def client_data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``i``'s training data on the run's device: normalised inputs (no augmentation) and labels."""
        idx = torch.from_numpy(self.partition.client_indices[i])
        y = self.ds.train_y[idx].to(self.device)
        if self._train_cache is not None:
            return self._train_cache[idx.to(self.device)], y
        return self._as_model_dtype(self.ds.normalize(self.ds.train_x[idx].to(self.device))), y

    def _augment_fn(self):
        if not self.augment:
            return None
        from ..data.transforms import augment_flip_crop

        return augment_flip_crop

    # ----- models -----
    def load_into_model(self, params: torch.Tensor, buffers: dict[str, torch.Tensor]) -> None:
        """Put a flat parameter vector and float buffers (e.g. ``theta`` and ``buffers``: the server model) into
        ``self.model``."""
        self.layout.set(params)
        for k, v in buffers.items():
            self.model.get_buffer(k).copy_(v)

    def _frozen_global(self, theta: torch.Tensor) -> Callable[[], torch.nn.Module]:
        """A builder of the frozen copy of the model the server sent (built at most once per round, on demand)."""

        def build():
            m = copy.deepcopy(self.model)
            ParamLayout(m).set(theta)
            for k, v in self.buffers.items():
                m.get_buffer(k).copy_(v)
            return frozen_copy(m)

        return build

    def all_clients_params(self) -> torch.Tensor:
        """The average of all clients' latest models ("all" in docs/update-rules.md section 0)."""
        if self.algo_cls.all_model_weighting == "uniform":
            return self.latest.mean(0)
        return weighted_mean(list(self.latest), self.partition.sizes)

    # ----- the loop -----
    def run(self) -> Path:
        from ..utils.lock import folder_lock

        with folder_lock(self.run_dir):
            return self._run()

    def _run(self) -> Path:
        cfg = self.cfg
        if self.start_round >= cfg.rounds:
            if not (self.run_dir / FINAL_FILE).is_file():  # killed between resume.pt and final.pt
                last = self.run_dir / "checkpoints" / f"round_{self.start_round:04d}.pt"
                if last.is_file():  # the same payload as final.pt
                    atomic_write_bytes(self.run_dir / FINAL_FILE, last.read_bytes())
                else:
                    save_checkpoint(self.run_dir / FINAL_FILE, self._model_payload(self.start_round))
                self.log(f"run {self.run_dir}: wrote the missing final.pt of round {self.start_round}")
            else:
                self.log(f"run {self.run_dir} already finished ({cfg.rounds} rounds)")
            return self.run_dir / FINAL_FILE
        self._write_run_files()
        from tqdm.auto import tqdm

        bar = tqdm(range(self.start_round, cfg.rounds), initial=self.start_round, total=cfg.rounds, unit="round",
                   desc="train", disable=self.quiet or not sys.stderr.isatty(), leave=False)
        last_logged = time.monotonic()
        for r in bar:
            t0 = time.perf_counter()
            try:
                row = self.run_round(r)
            except DivergenceError as e:
                bar.close()
                good = self._last_good()
                raise DivergenceError(f"{e}; stopped. Last good checkpoint: {good}") from None
            self.elapsed += time.perf_counter() - t0
            if row is not None:
                row["seconds"] = round(self.elapsed, 3)
                if self.observer is not None and self.observer.wants(r + 1, cfg.rounds):
                    t1 = time.perf_counter()
                    row.update(self.observer(self._model_payload(r + 1), self.run_dir))
                    self.observer_seconds += time.perf_counter() - t1
                    row["observer_seconds"] = round(self.observer_seconds, 3)
                self.metrics.append(row)
                self._write_metrics()
                bar.set_postfix(acc=f"{row['test_acc']:.3f}", loss=f"{row['train_loss']:.3f}")
                if not self.quiet and (bar.disable and (time.monotonic() - last_logged > 10 or r + 1 == cfg.rounds)):
                    self.log(f"round {r + 1}/{cfg.rounds}: train loss {row['train_loss']:.4f}, "
                             f"test acc {row['test_acc']:.4f} (all-clients avg {row['all_test_acc']:.4f})")
                    last_logged = time.monotonic()
            if (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds:
                self._checkpoint(r + 1, final=(r + 1 == cfg.rounds))
        bar.close()
        if self.observer is not None and not self.quiet:
            share = self.observer_seconds / max(self.elapsed, 1e-9)
            self.log(f"{self.observer.name}: {self.observer_seconds:.1f} s, {100 * share:.1f}% of the training time "
                     f"({self.elapsed:.1f} s)")
        return self.run_dir / FINAL_FILE

    def run_round(self, r: int) -> dict | None:
        """Round ``r`` (0-based): sample clients, train them, aggregate into the server model; returns the round's
        metrics when it is evaluated (every ``eval_every`` rounds and the last), else None. :meth:`run` calls it
        for each round; benchmarks time it. It writes no files."""
        cfg = self.cfg
        lr = cfg.lr * cfg.lr_decay ** r
        participants = sample_clients(cfg.seed, r, self.partition.num_clients, cfg.participation, cfg.sampling)
        rctx = RoundContext(r, lr, self.theta, _build_model=self._frozen_global(self.theta))
        self.algo.round_start(rctx)
        augment = self._augment_fn()
        results, client_buffers = [], []
        pending = participants.tolist()
        while pending:
            ids, pending = pending[:self.parallel], pending[self.parallel:]
            saved = self._client_state_rows(ids) if len(ids) > 1 else {}
            try:
                cohort_results, cohort_buffers = self._train_cohort(rctx, ids, lr, augment)
            except torch.OutOfMemoryError:
                if len(ids) == 1:
                    raise
                self._restore_client_state_rows(ids, saved)  # steps already taken leave no trace
                self._halve_parallel(len(ids))
                pending = ids + pending
                continue
            results += cohort_results
            client_buffers += cohort_buffers
        theta = self.algo.aggregate(rctx, results)
        if not torch.isfinite(theta).all():
            raise DivergenceError(f"the server model became non-finite in round {r + 1}")
        self.theta = theta
        if self.buffers:
            sizes = [res.num_samples for res in results]
            self.buffers = {k: weighted_mean([b[k] for b in client_buffers], sizes) for k in self.buffers}
        if (r + 1) % cfg.eval_every != 0 and r + 1 != cfg.rounds and \
                not (self.observer is not None and self.observer.wants(r + 1, cfg.rounds)):
            return None
        return self._evaluate_row(r, lr, len(participants), float(np.mean([res.loss for res in results])))

    # ----- cohorts -----
    def _choose_parallel(self) -> tuple[int, str]:
        """(N, why): how many of a round's participants train at once (``--parallel-clients``)."""
        asked = self.cfg.parallel_clients
        if asked is None:
            asked = "all" if self.device.type == "cuda" else 1
        most = self.partition.num_clients
        n = most if asked == "all" else min(int(asked), most)
        if n == 1:
            return 1, "one client at a time"
        from ..models.stacking import stacking_refusal

        refusal = None
        why = self.reg.cohort_refusal(self.model)
        if why is not None:
            refusal = f"--reg {self.reg_cls.name} trains one client at a time: {why}"
        else:
            why = stacking_refusal(self.model)
            if why is not None:
                refusal = f"the model cannot be stacked: {why}"
        if refusal is not None:
            self.log(f"--parallel-clients {asked}: training one client at a time ({refusal})")
            return 1, refusal
        why = f"up to {n} clients at once (--parallel-clients {asked}" + \
            (", the default on CUDA)" if self.cfg.parallel_clients is None else ")")
        if not self.quiet:
            self.log(f"training {why}")
        return n, why

    def _choose_graphs(self) -> bool:
        """Whether cohorts' full steps are captured and replayed as CUDA graphs (``--cuda-graphs``)."""
        if not self.cfg.cuda_graphs:
            return False
        from .step_graph import capture_refusal

        why = capture_refusal(self.device)
        if why is not None:
            raise ConfigError(why)
        if self.augment:
            self.log("--cuda-graphs: steps run eagerly (augmentation draws on the host at every step)")
            return False
        return True

    def _notice_once(self, line: str) -> None:
        """The first notice of the run's step graphs (why steps run eagerly); later ones say the same for other
        cohorts."""
        if not self._noticed:
            self._noticed = True
            self.log(line)

    def _client_state_rows(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """Copies of the algorithm's per-client state rows of clients ``ids`` (FedRobust changes its rows while the
        clients train), to undo a cohort that ran out of memory part-way."""
        index = torch.tensor(ids, device=self.device)
        return {k: v.index_select(0, index.to(v.device)).clone() for k, v in self.algo.clients.items()}

    def _restore_client_state_rows(self, ids: list[int], saved: dict[str, torch.Tensor]) -> None:
        for k in list(self.algo.clients):
            if k not in saved:  # created by this attempt (FedRobust's state, on first sight of the inputs)
                del self.algo.clients[k]
            else:
                v = self.algo.clients[k]
                v.index_copy_(0, torch.tensor(ids, device=v.device), saved[k].to(v.device))

    def _halve_parallel(self, tried: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.parallel = max(1, tried // 2)
        self._networks.clear()
        self.log(f"--parallel-clients: {tried} clients did not fit in GPU memory; training {self.parallel} at once")

    def working_network(self, n: int):
        """The working network for a cohort of ``n`` clients (the model itself for one, else ``n`` stacked copies
        of it, hooked by the algorithm and the regularizer) and its (N, dim) layout, built once per size."""
        from ..models.stacking import StackedLayout, stack_network

        if n not in self._networks:
            if len(self._networks) >= 4:
                self._networks.pop(next(k for k in self._networks if k != 1))
            net = stack_network(self.model, n)
            if n > 1:
                net = net.to(self.device)
                self.algo.attach(net)
                self.reg.attach(net)
            self._networks[n] = (net, StackedLayout(net, n, self.layout))
        return self._networks[n]

    def _train_cohort(self, rctx: RoundContext, ids: list[int], lr: float, augment) -> tuple[list, list]:
        """Train the clients ``ids`` of round ``rctx`` together; returns their ClientResults and float buffers."""
        cfg = self.cfg
        contexts, starts, taken_steps = [], [], []
        for i in ids:
            s = client_seed(cfg.seed, rctx.index, i)
            if len(ids) == 1:  # torch's generators (CUDA's too) at the client's seed; the CPU one is set to its
                torch.manual_seed(s)  # in-model stream once its client_start has drawn (below)
            x, y = self.client_data(i)
            n_i = len(y)
            taken, k_i = self.algo.local_step_counts(n_i, cfg.batch_size, cfg.local_epochs)
            gen = torch.Generator().manual_seed(s)
            cctx = ClientContext(  # gen's fresh state doubles as the seed of the client's in-model stream
                client_id=i, round=rctx, x=x, y=y, num_samples=n_i, weight=float(self.algo.weights[i]),
                label_counts=self.label_counts[i], steps=k_i, lr=lr, generator=gen, rng_state=gen.get_state())
            with client_rng(cctx):  # in-model draws of client_start (MimeLite's pass through stochastic depth)
                starts.append(self.algo.client_start(cctx))
            contexts.append(cctx)
            taken_steps.append(taken)
        if len(ids) == 1:  # one client: its in-model draws go on from torch's global generator, in its stream
            torch.set_rng_state(contexts[0].rng_state)
        network, layout = self.working_network(len(ids))
        layout.set(torch.stack(starts))
        layout.set_buffers(self.buffers)
        cohort = Cohort(contexts, rctx, network, layout, lr)
        self.algo.start_cohort(cohort)
        self.reg.start_cohort(cohort)
        decay = cohort.numbers([cfg.weight_decay + self.algo.extra_weight_decay(c) for c in contexts])
        opt = self.opt_cls(layout, lr=lr, weight_decay=decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           clip=cfg.clip, hp=self.opt_hp)
        losses = train_cohort(cohort, algo=self.algo, reg=self.reg, opt=opt, epochs=cfg.local_epochs,
                              batch_size=cfg.batch_size, augment=augment, steps=taken_steps, graphs=self.graphs,
                              notice=self._notice_once)
        self.reg.end_cohort(cohort)
        self.algo.end_cohort(cohort)
        new = layout.get()
        buffers = layout.get_buffers()
        results, client_buffers = [], []
        for k, cctx in enumerate(contexts):
            i = cctx.client_id
            params = new[k].clone()
            results.append(self.algo.client_end(cctx, params, float(losses[k])))
            self.latest[i] = params
            bufs = {name: b[k].view_as(self.buffers[name]).clone() for name, b in buffers.items()}
            for name, v in bufs.items():
                self.latest_buffers[name][i] = v
            client_buffers.append(bufs)
        return results, client_buffers

    def _evaluate_row(self, r: int, lr: float, n_clients: int, local_loss: float) -> dict:
        cfg = self.cfg
        ds = self.ds
        norm = None if self._test_cache is not None else ds.normalize
        test_x = self._test_cache if self._test_cache is not None else ds.test_x
        train_x = self._train_cache if self._train_cache is not None else ds.train_x
        tnorm = None if self._train_cache is not None else ds.normalize
        self.load_into_model(self.theta, self.buffers)
        test_loss, test_acc = evaluate(self.model, test_x, ds.test_y, cfg.eval_batch_size, norm)
        train_loss, train_acc = evaluate(self.model, train_x, ds.train_y, cfg.eval_batch_size, tnorm)
        self.load_into_model(self.all_clients_params(), self.buffers)
        all_loss, all_acc = evaluate(self.model, test_x, ds.test_y, cfg.eval_batch_size, norm)
        return {"round": r + 1, "lr": lr, "clients": n_clients, "local_loss": local_loss,
                "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc,
                "all_test_loss": all_loss, "all_test_acc": all_acc}

    # ----- files -----
    def _write_run_files(self) -> None:
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_dict()
        cfg["out"] = str(d)
        record = {"flatfl_version": __version__, "config": cfg, "model": self.model_spec, "resolved": self.resolved,
                  "dataset": self._dataset_info(), "environment": environment(), "training_path": self.training_path(),
                  **({"tracking": self.observer.settings} if self.observer else {})}
        earlier = _saved_run_info(d) if self.start_round > 0 else {}
        if isinstance(earlier.get("environment"), dict):
            # a resumed run keeps the versions its earlier rounds were trained with; each resumption is added
            resumed = earlier.get("resumed") if isinstance(earlier.get("resumed"), list) else []
            record.update(flatfl_version=earlier.get("flatfl_version", __version__), environment=earlier["environment"],
                          training_path=earlier.get("training_path"),
                          resumed=resumed + [{"from_round": self.start_round, "environment": environment(),
                                              "training_path": self.training_path()}])
        atomic_write_json(d / "config.json", record)
        if self.custom_data and not (d / CUSTOM_DATA_FILE).is_file():
            from ..data.datasets import dataset_payload

            if self._dataset_info()["file"]:
                atomic_torch_save(dataset_payload(self.ds), d / CUSTOM_DATA_FILE)
            else:
                self.log(f"the custom dataset is over {CUSTOM_DATA_LIMIT_BYTES >> 20} MiB and was not saved with "
                         "the run: analyse it from Python (flatfl.analysis.HessianOperator(model, batches))")
        if not (d / "partition.json").is_file():
            pd = self.partition.to_dict()
            pd["label_counts"] = self.label_counts.tolist()
            atomic_write_json(d / "partition.json", pd)

    def training_path(self) -> dict:
        """Which computation trained the run: the device, how many clients trained at once and why, how float32
        products ran, the parameters' floating type. Recorded in config.json; the report's scale line names it."""
        dev = self.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
        return {"device": str(dev), **({"device_name": name} if name else {}), "clients_at_once": self.parallel,
                "clients_at_once_why": self.parallel_reason, "float32_matmul": self.cfg.float32_matmul,
                "cuda_graphs": self.graphs,
                "dtype": str(self.theta.dtype).replace("torch.", "")}

    def _dataset_info(self) -> dict:
        """Where the run's data comes from: a dataset name, or (custom data) the run's data.pt when saved."""
        info = {"name": self.ds.name, "custom": self.custom_data, "file": None}
        if self.custom_data:
            size = sum(t.numel() * t.element_size() for t in (self.ds.train_x, self.ds.train_y, self.ds.test_x,
                                                             self.ds.test_y))
            info["file"] = CUSTOM_DATA_FILE if size <= CUSTOM_DATA_LIMIT_BYTES else None
        return info

    def _write_metrics(self) -> None:
        """metrics.csv; the observer's columns (blank on rounds it skipped) in full precision."""
        extra = list(self.observer.columns) + ["observer_seconds"] if self.observer is not None else []
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=METRIC_COLUMNS + extra, extrasaction="ignore")
        w.writeheader()
        for row in self.metrics:
            w.writerow({k: (v if k in extra else f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()})
        atomic_write_text(self.run_dir / "metrics.csv", buf.getvalue())

    def _model_payload(self, rnd: int) -> dict:
        self.load_into_model(self.theta, self.buffers)
        server = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        self.load_into_model(self.all_clients_params(), self.buffers)
        all_sd = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        cfg = self.cfg.to_dict()
        cfg["out"] = str(self.run_dir)
        return {
            "flatfl_version": __version__,
            "model_spec": self.model_spec,
            "state_dict": server,
            "all_state_dict": all_sd,
            "dataset": {"name": self.ds.name, "data_dir": str(Path(self.cfg.data_dir).resolve()),
                        "num_classes": self.ds.num_classes, "input_shape": list(self.ds.input_shape),
                        **self._dataset_info()},
            "partition": self.partition.to_dict(),
            "config": cfg,
            "resolved": self.resolved,
            "round": rnd,
            "metrics": list(self.metrics),
            "rng": {"torch": torch.get_rng_state(), "seed": self.cfg.seed},
        }

    def _checkpoint(self, rnd: int, final: bool) -> None:
        d = self.run_dir
        payload = self._model_payload(rnd)
        (d / "checkpoints").mkdir(exist_ok=True)
        save_checkpoint(d / "checkpoints" / f"round_{rnd:04d}.pt", payload)
        if self.cfg.save_clients:
            atomic_torch_save({"round": rnd, "run_settings_sha256": settings_digest(payload["config"]),
                               "params": self.latest.cpu(),
                               "buffers": {k: v.cpu() for k, v in self.latest_buffers.items()},
                               "num_samples": torch.as_tensor(self.partition.sizes)}, d / "clients.pt")
        state = {
            "round": rnd, "finished": final, "theta": self.theta.cpu(), "buffers": {k: v.cpu() for k, v in self.buffers.items()},
            "latest": self.latest.cpu(), "latest_buffers": {k: v.cpu() for k, v in self.latest_buffers.items()},
            "algorithm": self.algo.state_dict(), "metrics": list(self.metrics), "elapsed": self.elapsed,
            "observer_seconds": self.observer_seconds, "rng": rng_state(), "settings": run_settings(self.cfg.to_dict()),
        }
        if final:  # final.pt first: a run whose resume.pt says finished always has its final.pt
            save_clients_average(d, payload)  # the all-clients average, a checkpoint of its own
            save_checkpoint(d / FINAL_FILE, payload)
        save_resume_state(d / "resume.pt", state)

    def _last_good(self) -> str:
        cks = sorted((self.run_dir / "checkpoints").glob("round_*.pt"))
        return str(cks[-1]) if cks else "none (no round completed a checkpoint)"

    def _load_resume_state(self) -> None:
        f = self.run_dir / "resume.pt"
        if not f.is_file():
            # Killed before the first checkpoint: start from round 0 (everything derives from the seed).
            return
        st = load_resume_state(f)
        saved = st.get("settings")
        if isinstance(saved, dict):
            # a setting added after the run started: the run had it at its default (run_settings fills it in)
            now, saved = run_settings(self.cfg.to_dict()), run_settings(saved)
            changed = differing_keys(saved, now)
            if changed:
                shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
                raise ConfigError(f"--resume: the settings of {self.run_dir} changed since the run started ({shown}); "
                                  "restore config.json or start a new run with another --out")
        dev = self.device
        if st["theta"].numel() != self.layout.dim:
            raise ConfigError(f"{f} does not match this run's model ({st['theta'].numel()} vs {self.layout.dim} parameters)")
        self.theta = st["theta"].to(dev)
        self.buffers = {k: v.to(dev) for k, v in st["buffers"].items()}
        self.latest = st["latest"].to(dev)
        self.latest_buffers = {k: v.to(dev) for k, v in st["latest_buffers"].items()}
        self.algo.load_state_dict(st["algorithm"])
        self.metrics = list(st["metrics"])
        self.elapsed = float(st.get("elapsed", 0.0))
        self.observer_seconds = float(st.get("observer_seconds", 0.0))
        self.start_round = int(st["round"])


def _saved_run_info(run_dir: Path) -> dict:
    try:
        info = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def _saved_factory(run_dir: Path) -> str | None:
    """The model factory a custom-model run recorded (resuming it without a model); an error when it has none."""
    spec = _saved_run_info(run_dir).get("model") or {}
    if spec.get("name") != "custom":
        return None
    if not spec.get("factory"):
        raise ConfigError(f"{run_dir} was trained on a custom network ({spec.get('class', '?')}) with no model "
                          "factory recorded: resume it from Python, Trainer(cfg, run_dir, resume=True, model=net)")
    return spec["factory"]


def _check_same_network(run_dir: Path, model, log) -> None:
    """Resuming a custom-network run: the network is the one its earlier rounds trained (the structure config.json
    recorded); another one is refused, changed code of your classes is said aloud. Runs without a record pass."""
    from ..models.factory import code_changes, structure_difference

    saved = (_saved_run_info(run_dir).get("model") or {}).get("structure")
    differs = structure_difference(saved, model)
    if differs:
        raise ConfigError(f"--resume {run_dir}: your network is not the one the run trained ({differs}); resume "
                          "with the network it was trained with")
    changed = code_changes(saved, model)
    if changed:
        log(f"notice: the code of {', '.join(changed)} changed since {run_dir} was trained; training goes on with "
            "the code as it is now")


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The config of an existing run directory (for --resume)."""
    d = Path(run_dir)
    f = d / "config.json"
    if not d.is_dir():
        raise ConfigError(f"--resume: {d} is not a directory")
    if not f.is_file():
        raise ConfigError(f"--resume: {d} is not a flatfl run (no config.json)")
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        cfg = RunConfig.from_dict(raw["config"])
    except Exception:
        raise ConfigError(f"--resume: {f} is corrupt") from None
    return cfg.validate()


#: normalisations whose training statistics are taken over the batch: they need two values per channel in a batch
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
INSTANCE_NORMS = (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d)


def _values_per_channel(model: torch.nn.Module, input_shape) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, layer, values per channel of one sample) of each batch or instance normalisation that one input of
    ``input_shape`` reaches: a shape probe (eval mode, no gradient, the random generators untouched). Empty when
    the model has no such layer or cannot run the probe (the data check reports that)."""
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, BATCH_NORMS + INSTANCE_NORMS)]
    if not norms:
        return []
    seen: dict[int, int] = {}

    def probe(module, inputs, output):
        x = inputs[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] > 0 and x.shape[1] > 0:
            seen.setdefault(id(module), x.numel() // (x.shape[0] * x.shape[1]))

    param = next(iter(model.parameters()), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.get_default_dtype()
    device = param.device if param is not None else None
    handles = [m.register_forward_hook(probe) for _, m in norms]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.zeros(1, *input_shape, dtype=dtype, device=device))
    except Exception:
        return []
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [(name, m, seen[id(m)]) for name, m in norms if id(m) in seen]


def _check_no_batch_of_one(model: torch.nn.Module, sizes, batch_size: int, input_shape) -> None:
    """A batch normalisation needs more than one value per channel in a training batch: refuse, before training,
    a client whose data leaves a last batch of one sample (n mod B == 1) when some batch normalisation sees a single
    value per channel of one sample (BatchNorm1d; BatchNorm2d on a 1x1 map, e.g. ResNet-18's last stage on 8x8
    inputs), naming the client, the layer and what to change. An instance normalisation over one value fails on
    every batch: refused too. Found by a shape probe of one input."""
    found = _values_per_channel(model, input_shape)
    single = [(name, m) for name, m, values in found if values == 1]
    instance = next((name for name, m in single if isinstance(m, INSTANCE_NORMS)), None)
    if instance is not None:
        raise ConfigError(f"the network's {instance} normalises a single value per channel of each sample; it "
                          f"cannot train on {'x'.join(str(s) for s in input_shape[1:])} inputs")
    if not single:
        return
    layer = single[0][0] or "BatchNorm"
    for k, n in enumerate(int(x) for x in sizes):
        if n % batch_size == 1:
            raise ConfigError(f"client {k} holds {n} samples: with --batch-size {batch_size} its last batch has 1 "
                              f"sample, on which the network's batch normalisation {layer} (one value per channel "
                              "and sample) cannot train; choose another --batch-size or --clients")


def _check_model_fits_data(model: torch.nn.Module, ds) -> None:
    """One forward pass of one training item through the user's network (eval mode, no gradient, the random
    generators untouched): a network that cannot take the inputs, or has fewer outputs than the data has classes,
    is one ConfigError line now instead of a torch error mid-training."""
    param = next(iter(model.parameters()), None)
    x = ds.normalize(ds.train_x[:1])
    if param is not None:
        x = x.to(device=param.device, dtype=param.dtype if param.is_floating_point() else x.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(x)
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ConfigError(f"your network cannot take the data's inputs (one item of shape {tuple(x.shape[1:])}): "
                          f"{type(e).__name__}: {reason}") from None
    finally:
        model.train(was_training)
    if isinstance(out, torch.Tensor):
        if out.dim() != 2 or out.shape[0] != 1:
            raise ConfigError(f"your network returns shape {tuple(out.shape)} for one item; it must return one row "
                              "of class scores per input (batch, classes)")
        if out.shape[1] < ds.num_classes:
            raise ConfigError(f"the data's labels go up to {ds.num_classes - 1} ({ds.num_classes} classes) but your "
                              f"network has {out.shape[1]} outputs")


def _check_spec_rebuilds(model, spec: dict, algo: str, reg: str) -> None:
    """The network rebuilt from ``spec`` has the trained model's parameters and buffers (names and shapes): an
    algorithm or regularizer that changes the architecture must record the change in the spec
    (:mod:`flatfl.models.spec`), or analysis could not load its checkpoints. Custom networks are rebuilt by their
    factory and are not checked here. Draws no random numbers from the run's generators."""
    if spec.get("name") == "custom":
        return
    from ..models import model_from_spec

    with torch.random.fork_rng(devices=[]):
        rebuilt = model_from_spec(spec)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}:
        raise RuntimeError(f"--algo {algo} / --reg {reg} change the network beyond what its spec records "
                           "(flatfl.models.spec): checkpoints would not load for analysis")
