"""Evaluation of a model on a split: mean cross-entropy and accuracy, batched, no augmentation, eval mode. Under
torchrun the batches are dealt out to the ranks (every R-th batch to a rank) and the sums meet in one all-reduce:
the same batches, so the same numbers up to the order of the float64 sum."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import ranks


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 500,
             normalize=None, world: ranks.World = ranks.World()) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on (x, y). ``normalize`` maps a raw batch to model input if given;
    ``world``: the ranks the batches are dealt to (:meth:`~flatfl.utils.ranks.World.dealt`; a world of one: all)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for s in world.dealt(list(range(0, len(y), batch_size))):
        xb = x[s:s + batch_size].to(device)
        yb = y[s:s + batch_size].to(device)
        if normalize is not None:
            xb = normalize(xb)
        logits = model(xb)
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        correct += (logits.argmax(1) == yb).sum()
    model.train(was_training)
    n = max(len(y), 1)
    if world.distributed:
        totals = ranks.all_reduce_sum(torch.stack([loss_sum, correct.double()]))
        loss_sum, correct = totals[0], totals[1]
    return float(loss_sum) / n, float(correct) / n
