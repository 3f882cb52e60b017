"""One round of federated training: sample the clients, train them locally in cohorts (:func:`train_cohort`),
aggregate into the server model, evaluate. A cohort that runs out of GPU memory is undone and trained again in
halves, so the numbers stay those of one client at a time.

Determinism: round t's client sample derives from (seed, t) (:func:`sample_clients`), client i's batch order,
augmentation and in-model randomness in round t from (seed, t, i) (:func:`client_seed`): a round's numbers depend on
the state it starts from only, whatever ran before it in the process.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..data.partition import Partition
from ..errors import DivergenceError
from ..models.functional_stack import StackingRefused
from ..models.params import ParamLayout, float_buffers
from ..utils import ranks
from ..utils.precision import computing_in
from .algorithms.algorithm import Algorithm, weighted_mean
from .config import FLOAT32_MAX, RunConfig
from .context import ClientContext, Cohort, RoundContext, client_rng, frozen_copy
from .evaluate import evaluate
from .local import LocalSchedule, train_cohort
from .over_ranks import exchange
from .regularizers.regularizer import Regularizer

__all__ = ["CACHE_LIMIT_BYTES", "sample_clients", "client_seed", "RoundState", "RoundDone", "RunData", "RunPieces",
           "RoundLoop"]

CACHE_LIMIT_BYTES = 1 << 30  # normalised copies of a split are kept in memory below this size


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


@contextlib.contextmanager
def _overflow_is_divergence(r: int):
    """A scalar too large for the weights' float type inside a step (torch: "value cannot be converted to type
    float without overflow") ends the run as diverged in round ``r + 1``, in one line, as a non-finite loss does.
    Settings beyond the float32 range are refused before training (:meth:`RunConfig.validate`); this catches one
    that grows there."""
    try:
        yield
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        raise DivergenceError(f"the run diverged in round {r + 1}: a step overflowed the weights' float type "
                              f"({' '.join(str(e).split())[:120]})") from None


@dataclass
class RoundState:
    """What the rounds change, in one object: the :class:`~flatfl.train.engine.Trainer` holds it and saves it
    (checkpoints, resume.pt), restores it (``--resume``) and records how its clients trained (config.json's
    training path); its :class:`RoundLoop` updates it, round after round."""
    theta: torch.Tensor  # the server model's parameters (dim,)
    buffers: dict[str, torch.Tensor]  # its float buffers (BatchNorm statistics)
    latest: torch.Tensor  # each client's most recent local model (clients, dim)
    latest_buffers: dict[str, torch.Tensor]  # and its buffers, each (clients, ...)
    parallel: int  # clients trained at once (halved when they do not fit in GPU memory, 1 when they cannot stack)
    parallel_reason: str  # why (config.json's clients_at_once_why)

    @classmethod
    def at_start(cls, model: torch.nn.Module, layout: ParamLayout, num_clients: int, parallel: int,
                 parallel_reason: str) -> RoundState:
        """Round 0: the server model from the network as built and every client's latest model at it."""
        theta = layout.get()
        buffers = {k: v.detach().clone() for k, v in float_buffers(model).items()}
        return cls(theta, buffers, theta.unsqueeze(0).repeat(num_clients, 1),
                   {k: v.unsqueeze(0).repeat(num_clients, *[1] * v.dim()) for k, v in buffers.items()},
                   parallel, parallel_reason)

    def clients_at_once(self) -> tuple[int, str]:
        """How the clients train: (clients at once, why)."""
        return self.parallel, self.parallel_reason


@dataclass
class RoundDone:
    """What :meth:`RoundLoop.run_round` returns: the round's metrics row (None when the round is not evaluated)
    and whether its clients stopped training together during it (out of GPU memory, or a network that could not be
    stacked after all): the run's training path changed, and config.json is to record it."""
    row: dict | None
    path_changed: bool


@dataclass(frozen=True, eq=False)
class RunData:
    """The data a run trains on: its dataset (``ds``, a :class:`~flatfl.data.ImageDataset`), the clients'
    partition, their label counts (clients, classes), whether their batches are augmented, and the ranks it is
    split over (``world``: a round's participants shared out, evaluation batches dealt; a world of one by default)."""
    ds: Any
    partition: Partition
    label_counts: torch.Tensor
    augment: bool
    world: ranks.World = ranks.World()


@dataclass(frozen=True, eq=False)
class RunPieces:
    """What a run trains: the plain network (``model``, which the server model is loaded into for evaluation) and
    its parameter layout, the algorithm and the regularizer attached to it, and the local optimizer's class and
    hyper-parameters (an optimizer is made of them for each cohort)."""
    model: torch.nn.Module
    layout: ParamLayout
    algo: Algorithm
    reg: Regularizer
    opt_cls: type
    opt_hp: dict


class RoundLoop:
    """The rounds of a built run: the run's parts, given once, read only; :attr:`state` (a :class:`RoundState`),
    which every round changes. :class:`~flatfl.train.engine.Trainer` builds the parts and holds the loop."""

    def __init__(self, cfg: RunConfig, state: RoundState, data: RunData, pieces: RunPieces, *,
                 device: torch.device, graphs: bool, observer, log: Callable[[str], None]):
        """``graphs``: whether full-batch steps replay as CUDA graphs; ``observer``: see
        :class:`~flatfl.train.engine.Trainer` (or None; its ``wants`` makes a round evaluated). Normalised copies of
        the splits are kept on the device (up to :data:`CACHE_LIMIT_BYTES` each), and a network that only
        torch.func stacks is tried stacked once, here."""
        self.cfg, self.state, self.device = cfg, state, device
        self.ds, self.partition, self.label_counts, self.augment = (data.ds, data.partition, data.label_counts,
                                                                    data.augment)
        self.world = data.world
        self.model, self.layout, self.algo, self.reg = pieces.model, pieces.layout, pieces.algo, pieces.reg
        self.opt_cls, self.opt_hp = pieces.opt_cls, pieces.opt_hp
        self.graphs, self.observer, self.log = graphs, observer, log
        self._networks: dict[int, tuple] = {}
        self._noticed = False
        self._train_cache = self._maybe_cache(self.ds.train_x)
        self._test_cache = self._maybe_cache(self.ds.test_x)
        self._probe_stacking()

    def _probe_stacking(self) -> None:
        """Before training (config.json records the outcome): a network that only torch.func stacks runs one
        stacked step on a few of the data's inputs (:func:`~flatfl.models.stacking.probe_stacking`); one it cannot
        run trains one client at a time, said in one line."""
        from ..models.stacking import probe_stacking, stacking_path

        if self.state.parallel > 1 and stacking_path(self.model) == "torch.func":
            x = self._as_model_dtype(self.ds.normalize(self.ds.train_x[:4].to(self.device)))
            why = probe_stacking(self.model, x)
            if why is not None:
                self._refuse_stacking(why)

    def _refuse_stacking(self, why: str) -> None:
        """One client at a time from now on, said in one line: the model cannot be stacked (``why``)."""
        self.log(f"--parallel-clients {self.cfg.parallel_clients or 'all'}: training one client at a time (the "
                 f"model cannot be stacked: {why})")
        self.state.parallel, self.state.parallel_reason = 1, f"the model cannot be stacked: {why}"
        self._networks = {k: v for k, v in self._networks.items() if k == 1}

    # ----- data -----
    def _maybe_cache(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.numel() * 4 <= CACHE_LIMIT_BYTES:
            return self._as_model_dtype(self.ds.normalize(x.to(self.device)))
        return None

    def _as_model_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs in the floating type of the model's parameters (float32; float64 for a float64 model)."""
        dtype = self.state.theta.dtype
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
            for k, v in self.state.buffers.items():
                m.get_buffer(k).copy_(v)
            return frozen_copy(m)

        return build

    def all_clients_params(self) -> torch.Tensor:
        """The average of all clients' latest models ("all" in docs/update-rules.md section 0)."""
        if type(self.algo).all_model_weighting == "uniform":
            return self.state.latest.mean(0)
        return weighted_mean(list(self.state.latest), self.partition.sizes)

    # ----- a round -----
    def run_round(self, r: int) -> RoundDone:
        """Round ``r`` (0-based), its new tensors in the run's floating type: sample clients, train them, aggregate
        into the server model. Returns the round's metrics when it is evaluated (every ``eval_every`` rounds, the
        last, and those the observer wants; else None) and whether the clients' training path changed in it.
        ``Trainer.run`` calls it for each round. It writes no files."""
        before = self.state.clients_at_once()
        with computing_in(self.cfg.precision):
            row = self._round(r)
        return RoundDone(row, self.state.clients_at_once() != before)

    def _round(self, r: int) -> dict | None:
        cfg = self.cfg
        try:
            lr = cfg.lr * cfg.lr_decay ** r
        except OverflowError:
            lr = math.inf
        if not lr <= FLOAT32_MAX:  # --lr-decay > 1 over many rounds
            raise DivergenceError(f"the run diverged in round {r + 1}: the learning rate --lr {cfg.lr:g} x --lr-decay "
                                  f"{cfg.lr_decay:g}^{r} is beyond the float32 range")
        participants = sample_clients(cfg.seed, r, self.partition.num_clients, cfg.participation, cfg.sampling)
        rctx = RoundContext(r, lr, self.state.theta, build_model=self._frozen_global(self.state.theta),
                            participants=tuple(int(i) for i in participants))
        self.algo.round_start(rctx)
        augment = self._augment_fn()
        results, client_buffers = [], []
        share = self.world.share(participants).tolist()  # under torchrun: this rank's clients (else all)
        state_keys = set(self.algo.clients)
        pending = list(share)
        while pending:
            ids, pending = pending[:self.state.parallel], pending[self.state.parallel:]
            saved = self._client_state_rows(ids) if len(ids) > 1 else {}
            try:
                with _overflow_is_divergence(r):
                    cohort_results, cohort_buffers = self.run_cohort(rctx, ids, lr, augment)
            except torch.OutOfMemoryError:
                if len(ids) == 1:
                    raise
                self._restore_client_state_rows(ids, saved)  # steps already taken leave no trace
                self._halve_parallel(len(ids))
                pending = ids + pending
                continue
            except StackingRefused as e:  # torch.func met an operation it cannot run for several clients
                self._restore_client_state_rows(ids, saved)
                self._refuse_stacking(str(e))
                pending = ids + pending
                continue
            results += cohort_results
            client_buffers += cohort_buffers
        results, client_buffers = exchange(share, results, client_buffers, clients_state=self.algo.clients,
                                           latest=self.state.latest, latest_buffers=self.state.latest_buffers,
                                           created=set(self.algo.clients) - state_keys, world=self.world)
        with _overflow_is_divergence(r):
            theta = self.algo.aggregate(rctx, results)
        if not torch.isfinite(theta).all():
            raise DivergenceError(f"the server model became non-finite in round {r + 1}")
        self.state.theta = theta
        if self.state.buffers:
            sizes = [res.num_samples for res in results]
            self.state.buffers = {k: weighted_mean([b[k].reshape(-1) for b in client_buffers], sizes).view_as(v)
                                  for k, v in self.state.buffers.items()}  # any shape (a user's (C, 1, 1) gain)
        if (r + 1) % cfg.eval_every != 0 and r + 1 != cfg.rounds and \
                not (self.observer is not None and self.observer.wants(r + 1, cfg.rounds)):
            return None
        return self._evaluate_row(r, lr, len(participants), float(np.mean([res.loss for res in results])))

    # ----- cohorts -----
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
        self.state.parallel = max(1, tried // 2)
        self.state.parallel_reason = f"{tried} clients at once did not fit in GPU memory"
        self._networks.clear()
        self.log(f"--parallel-clients: {tried} clients did not fit in GPU memory; training {self.state.parallel} at "
                 "once")

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

    def run_cohort(self, rctx: RoundContext, ids: list[int], lr: float, augment) -> tuple[list, list]:
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
        layout.set_buffers(self.state.buffers)
        cohort = Cohort(contexts, rctx, network, layout, lr)
        self.algo.start_cohort(cohort)
        self.reg.start_cohort(cohort)
        decay = cohort.numbers([cfg.weight_decay + self.algo.extra_weight_decay(c) for c in contexts])
        opt = self.opt_cls(layout, lr=lr, weight_decay=decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           clip=cfg.clip, hp=self.opt_hp)
        schedule = LocalSchedule(cfg.local_epochs, cfg.batch_size, taken_steps, augment)
        losses = train_cohort(cohort, algo=self.algo, reg=self.reg, opt=opt, schedule=schedule, graphs=self.graphs,
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
            self.state.latest[i] = params
            bufs = {name: b[k].view_as(self.state.buffers[name]).clone() for name, b in buffers.items()}
            for name, v in bufs.items():
                self.state.latest_buffers[name][i] = v
            client_buffers.append(bufs)
        return results, client_buffers

    # ----- evaluation -----
    def _evaluate_row(self, r: int, lr: float, n_clients: int, local_loss: float) -> dict:
        """Round ``r``'s metrics row: the server model on the test and training splits, the average of all
        clients' latest models on the test split."""
        cfg = self.cfg
        ds = self.ds
        norm = None if self._test_cache is not None else ds.normalize
        test_x = self._test_cache if self._test_cache is not None else ds.test_x
        train_x = self._train_cache if self._train_cache is not None else ds.train_x
        tnorm = None if self._train_cache is not None else ds.normalize
        self.load_into_model(self.state.theta, self.state.buffers)
        test_loss, test_acc = evaluate(self.model, test_x, ds.test_y, cfg.eval_batch_size, norm, self.world)
        train_loss, train_acc = evaluate(self.model, train_x, ds.train_y, cfg.eval_batch_size, tnorm, self.world)
        self.load_into_model(self.all_clients_params(), self.state.buffers)
        all_loss, all_acc = evaluate(self.model, test_x, ds.test_y, cfg.eval_batch_size, norm, self.world)
        return {"round": r + 1, "lr": lr, "clients": n_clients, "local_loss": local_loss,
                "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc,
                "all_test_loss": all_loss, "all_test_acc": all_acc}
