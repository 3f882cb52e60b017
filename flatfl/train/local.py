"""One client's local training in one round (algorithms.md section 0).

E epochs over the client's data in shuffled batches of B (the last partial batch kept); every step builds the
local objective in a closure - the regularizer's data loss plus the algorithm's loss terms - and hands it to the
local optimizer together with the algorithm's gradient correction.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import DivergenceError
from .algorithms.base import Algorithm
from .context import ClientContext, StepContext
from .optimizers import LocalOptimizer
from .regularizers.base import Regularizer


def local_steps(n: int, batch_size: int, epochs: int) -> int:
    """K = E * ceil(n / B)."""
    return epochs * math.ceil(n / batch_size)


def train_client(cctx: ClientContext, *, algo: Algorithm, reg: Regularizer, make_optimizer: Callable[..., LocalOptimizer],
                 epochs: int, batch_size: int, augment: Callable | None = None,
                 steps: int | None = None) -> torch.Tensor:
    """Run the client's local steps on ``cctx.model`` (already holding its start parameters): ``epochs`` epochs, or,
    when ``steps`` is given, exactly that many steps over as many freshly shuffled epochs as they need (the last one
    cut short; the FedDyn code's SCAFFOLD loop).

    Returns the mean loss over steps (a 0-d tensor). Raises DivergenceError if the loss is not finite."""
    model = cctx.model
    model.train()
    opt = make_optimizer(weight_decay_extra=algo.extra_weight_decay(cctx))
    params = opt.params
    n = cctx.num_samples
    total = torch.zeros((), device=cctx.x.device)
    per_epoch = math.ceil(n / batch_size)
    total_steps = epochs * per_epoch if steps is None else int(steps)
    steps = 0
    gen = cctx.generator
    correct = lambda: algo.correct_gradient(cctx)  # noqa: E731
    for _ in range(math.ceil(total_steps / per_epoch)):
        perm = torch.randperm(n, generator=gen).to(cctx.x.device)
        for s in range(0, n, batch_size):
            if steps == total_steps:
                break
            idx = perm[s:s + batch_size]
            x, y = cctx.x[idx], cctx.y[idx]
            if augment is not None:
                x = augment(x, gen)
            step = StepContext(cctx, x, y)
            algo.prepare_batch(step)

            def closure(step=step):
                for p in params:
                    p.grad = None
                loss = reg.forward(step)
                extra = algo.loss_terms(step)
                if extra is not None:
                    loss = loss + extra
                loss.backward()
                return loss

            loss = opt.step(closure, correct)
            total += loss.detach()
            steps += 1
    mean = total / max(steps, 1)
    if not torch.isfinite(mean):
        raise DivergenceError(f"the local loss of client {cctx.client_id} became non-finite in round "
                              f"{cctx.round.index + 1}")
    return mean
