"""The local training of a round's clients (algorithms.md section 0), N of them at once (N = 1: one at a time).

E epochs over each client's data in shuffled batches of B (the last partial batch kept); every step builds each
client's local objective in a closure - the regularizer's data loss plus the algorithm's loss terms, one value per
client - and hands the sum to the local optimizer together with the algorithm's gradient correction. The clients'
losses are independent functions of their own blocks of the stacked network, so the gradient of the sum is each
client's own gradient.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from ..errors import DivergenceError
from .algorithms.base import Algorithm
from .context import ClientContext, Cohort, StepContext
from .optimizers import LocalOptimizer
from .regularizers.base import Regularizer


def local_steps(n: int, batch_size: int, epochs: int) -> int:
    """K = E * ceil(n / B)."""
    return epochs * math.ceil(n / batch_size)


def batch_schedule(cctx: ClientContext, *, epochs: int, batch_size: int, steps: int | None,
                   augment: Callable | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Client ``cctx``'s local batches (x, y), one per step, drawn lazily from its own generator: ``epochs``
    shuffled epochs, or exactly ``steps`` steps over as many freshly shuffled epochs as they need (the last one cut
    short; the FedDyn code's SCAFFOLD loop). The draws depend on the client's stream alone, so training clients
    together or one at a time gives every client the same batches."""
    n = cctx.num_samples
    per_epoch = math.ceil(n / batch_size)
    total = epochs * per_epoch if steps is None else int(steps)
    gen = cctx.generator
    taken = 0
    for _ in range(math.ceil(total / per_epoch)):
        perm = torch.randperm(n, generator=gen).to(cctx.x.device)
        for s in range(0, n, batch_size):
            if taken == total:
                return
            idx = perm[s:s + batch_size]
            x, y = cctx.x[idx], cctx.y[idx]
            if augment is not None:
                x = augment(x, gen)
            taken += 1
            yield x, y


def train_cohort(cohort: Cohort, *, algo: Algorithm, reg: Regularizer, opt: LocalOptimizer, epochs: int,
                 batch_size: int, steps: list[int], augment: Callable | None = None) -> torch.Tensor:
    """Run the local steps of the cohort's clients on ``cohort.network`` (already holding their start parameters).
    Client k takes ``steps[k]`` steps of its own batches (:func:`batch_schedule`). At each step the clients that
    still train and whose batches have one size train as one batched computation; clients that have finished, or
    whose batch is of another size, sit out that computation (no padding, no fake samples).

    Returns each client's mean loss over its steps, (N,). Raises DivergenceError if one is not finite."""
    cohort.network.train()
    n = cohort.n
    dev = cohort.device
    schedules = [batch_schedule(c, epochs=epochs, batch_size=batch_size, steps=k, augment=augment)
                 for c, k in zip(cohort.clients, steps)]
    total = torch.zeros(n, device=dev, dtype=torch.float32)
    longest = max(steps) if steps else 0
    params = cohort.layout.params
    for s in range(longest):
        batches = {k: next(schedules[k]) for k in range(n) if s < steps[k]}
        by_size: dict[int, list[int]] = {}
        for k, (_, y) in batches.items():
            by_size.setdefault(len(y), []).append(k)
        for group in by_size.values():
            rows = None if len(group) == n else torch.tensor(group, device=dev)
            if len(group) == 1:  # no copy
                x, y = batches[group[0]][0].unsqueeze(0), batches[group[0]][1].unsqueeze(0)
            else:
                x = torch.stack([batches[k][0] for k in group])
                y = torch.stack([batches[k][1] for k in group])
            step = StepContext(cohort, x, y, rows)
            algo.prepare_batch(step)

            def closure(step=step):
                for p in params:
                    p.grad = None
                loss = reg.forward(step)
                extra = algo.loss_terms(step)
                if extra is not None:
                    loss = loss + extra
                loss.sum().backward()
                return loss

            loss = opt.step(closure, lambda step=step: algo.correct_gradient(step), rows)
            if rows is None:
                total += loss.detach()
            else:
                total[rows] += loss.detach()
    mean = total / torch.tensor([max(k, 1) for k in steps], device=dev, dtype=total.dtype)
    bad = ~torch.isfinite(mean)
    if bool(bad.any()):
        who = cohort.clients[int(bad.nonzero()[0])]
        raise DivergenceError(f"the local loss of client {who.client_id} became non-finite in round "
                              f"{cohort.round.index + 1}")
    return mean
