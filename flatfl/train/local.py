"""The local training of a round's clients (docs/update-rules.md section 0), N of them at once (N = 1: one at a time).

E epochs over each client's data in shuffled batches of B (the last partial batch kept); every step builds each
client's local objective in a closure - the regularizer's data loss plus the algorithm's loss terms, one value per
client - and hands the sum to the local optimizer together with the algorithm's gradient correction. The clients'
losses are independent functions of their own blocks of the stacked network, so the gradient of the sum is each
client's own gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..errors import DivergenceError
from ..models.convolution import stacked_convolutions
from .algorithms.algorithm import Algorithm
from .context import ClientContext, Cohort, StepContext
from .optimizers import LocalOptimizer
from .regularizers.regularizer import Regularizer


def batch_schedule(cctx: ClientContext, *, epochs: int, batch_size: int, steps: int | None
                   ) -> Iterator[torch.Tensor]:
    """Client ``cctx``'s local batches, one per step, as indices into its data (a host tensor), drawn lazily from
    its own generator: ``epochs`` shuffled epochs, or exactly ``steps`` steps over as many freshly shuffled epochs
    as they need (the last one cut short; the FedDyn code's SCAFFOLD loop). The draws depend on the client's stream
    alone, so training clients together or one at a time gives every client the same batches."""
    n = cctx.num_samples
    per_epoch = math.ceil(n / batch_size)
    total = epochs * per_epoch if steps is None else int(steps)
    gen = cctx.generator
    taken = 0
    for _ in range(math.ceil(total / per_epoch)):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            if taken == total:
                return
            taken += 1
            yield perm[s:s + batch_size]


class CohortData:
    """The training data of a cohort's clients as one tensor (their inputs side by side along the sample axis,
    gathered once per cohort), so that one step's batches of M clients are one gather, (M, B, ...), however many
    clients train."""

    def __init__(self, cohort: Cohort):
        clients = cohort.clients
        self.x = torch.cat([c.x for c in clients])
        self.y = torch.cat([c.y for c in clients])
        self.offsets = np.cumsum([0] + [c.num_samples for c in clients[:-1]])
        self.device = self.x.device

    def host_index(self, group: list[int], picks: dict[int, torch.Tensor]) -> np.ndarray:
        """The rows of the cohort's data that the clients ``group`` whose indices are ``picks`` take, (M, B), on the
        host."""
        return np.stack([picks[k].numpy() + self.offsets[k] for k in group])

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches (x, y), (M, B, ...) and (M, B), of the rows ``index`` (M, B), a tensor on the data's device."""
        return self.x[index], self.y[index]

    def batches(self, group: list[int], picks: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches (x, y), (M, B, ...) and (M, B), of the clients ``group`` whose indices are ``picks``."""
        return self.gather(torch.from_numpy(self.host_index(group, picks)).to(self.device))


@dataclass(frozen=True)
class LocalSchedule:
    """The batches a cohort's clients train on: ``epochs`` shuffled epochs of batches of ``batch_size``, client k
    taking ``steps[k]`` steps of them (:func:`batch_schedule`), each batch passed through ``augment`` (a function
    ``(x, generator) -> x``, each client's draws from its own generator) when given."""

    epochs: int
    batch_size: int
    steps: list[int]
    augment: Callable | None = None


def train_cohort(cohort: Cohort, *, algo: Algorithm, reg: Regularizer, opt: LocalOptimizer,
                 schedule: LocalSchedule, graphs: bool = False,
                 notice: Callable[[str], None] = lambda line: None) -> torch.Tensor:
    """Run the local steps of the cohort's clients on ``cohort.network`` (already holding their start parameters).
    Client k takes ``schedule.steps[k]`` steps of its own batches (:func:`batch_schedule`). At each step the
    clients that still train and whose batches have one size train as one batched computation; clients that have
    finished, or whose batch is of another size, sit out that computation (no padding, no fake samples).

    ``graphs``: the steps of every client on a full batch are captured once and replayed
    (:class:`~flatfl.train.step_graph.GraphedSteps`; not with ``schedule.augment``); ``notice`` gets the one line
    saying why they run eagerly instead, when they do.

    Returns each client's mean loss over its steps, (N,). Raises DivergenceError if one is not finite."""
    epochs, batch_size, steps, augment = schedule.epochs, schedule.batch_size, schedule.steps, schedule.augment
    cohort.network.train()
    n = cohort.n
    dev = cohort.device
    data = CohortData(cohort)
    schedules = [batch_schedule(c, epochs=epochs, batch_size=batch_size, steps=k)
                 for c, k in zip(cohort.clients, steps)]
    total = torch.zeros(n, device=dev, dtype=torch.float32)
    longest = max(steps) if steps else 0
    params = cohort.layout.params

    def train_step(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None) -> None:
        step = StepContext(cohort, x, y, rows)
        algo.prepare_batch(step)

        def closure():
            for p in params:
                p.grad = None
            loss = reg.forward(step)
            extra = algo.loss_terms(step)
            if extra is not None:
                loss = loss + extra
            loss.sum().backward()
            return loss

        loss = opt.step(closure, lambda: algo.correct_gradient(step), rows)
        if rows is None:
            total.add_(loss.detach())
        else:
            total[rows] += loss.detach()

    graphed = None
    if graphs and augment is None:
        from .step_graph import GraphedSteps

        pieces = {"algorithm": algo, "regularizer": reg, "optimizer": opt, "cohort": cohort.extras,
                  "clients": cohort.clients, "round": cohort.round, "network": list(cohort.network.modules())}
        graphed = GraphedSteps(dev, n, batch_size, pieces=pieces, params=params, notice=notice)
    # float64 on the CPU: a stacked cohort's grouped convolutions as batched matrix products (torch's float64
    # fallback loops over clients and samples); the same numbers to rounding (flatfl/models/convolution.py)
    stacked = n > 1 and dev.type == "cpu" and any(p.dtype == torch.float64 for p in params)
    with stacked_convolutions(stacked):
        for s in range(longest):
            picks = {k: next(schedules[k]) for k in range(n) if s < steps[k]}
            by_size: dict[int, list[int]] = {}
            for k, idx in picks.items():
                by_size.setdefault(len(idx), []).append(k)
            for size, group in by_size.items():
                if graphed is not None and len(group) == n and size == batch_size:
                    graphed.run(data.host_index(group, picks), lambda index: train_step(*data.gather(index), None))
                    continue
                rows = None if len(group) == n else torch.tensor(group, device=dev)
                x, y = data.batches(group, picks)
                if augment is not None:  # each client's draws from its own generator, right after its batch's
                    x = torch.stack([augment(x[j], cohort.clients[k].generator) for j, k in enumerate(group)])
                train_step(x, y, rows)
    mean = total / torch.tensor([max(k, 1) for k in steps], device=dev, dtype=total.dtype)
    bad = ~torch.isfinite(mean)
    if bool(bad.any()):
        who = cohort.clients[int(bad.nonzero()[0])]
        raise DivergenceError(f"the local loss of client {who.client_id} became non-finite in round "
                              f"{cohort.round.index + 1}")
    return mean
