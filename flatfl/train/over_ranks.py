"""A round's clients over the ranks of a torchrun launch (docs/distributed.md).

Every rank holds the whole run: the server model, every client's state, the data. Round t's participants (drawn
from the run's seed, the same on every rank) are cut into contiguous shares, one a rank (:meth:`flatfl.utils.ranks.World.share`; shares
differ by at most one client), and each rank trains its share as one process would (in cohorts stacked as usual;
a client's randomness comes from (seed, t, client), whoever trains it). Then :func:`exchange` hands every rank what
the others computed: the clients' uploads (:class:`~flatfl.train.algorithms.algorithm.ClientResult`), their float
buffers, their latest models and the rows of the algorithm's per-client state (``algo.clients``) they changed, in
the participants' order. Every rank aggregates the same uploads in the same order, so the server model and the
algorithm's server state stay equal on every rank without being sent, and a round equals one process's. Before the
first round, :func:`agree_on_run` has the ranks compare what each built: a rank given other data, another client
split or another starting model would mix its numbers into the others'.
"""
from __future__ import annotations

import numpy as np
import torch

from ..utils import ranks
from ..utils.batch_walk import map_tensors

__all__ = ["exchange", "agree_on_run"]


def agree_on_run(ds, partition, theta: torch.Tensor, buffers: dict, world: ranks.World) -> None:
    """Before the first round (nothing written yet): every rank holds the same training and test sets (``ds``, an
    :class:`~flatfl.data.ImageDataset`), the same clients' split (``partition``) and the same server model to start
    from (``theta`` and its ``buffers``: the seeded network, or a resumed run's; compared by
    :func:`~flatfl.utils.ranks.fingerprint`, blind to last-bit differences between processors); a difference ends
    every rank with one line naming it and the rank (:func:`flatfl.utils.ranks.agree`). Nothing in a world of one."""
    if not world.distributed:
        return
    ranks.agree({"training data": ranks.digest(ds.train_x, ds.train_y),
                 "test data": ranks.digest(ds.test_x, ds.test_y),
                 "clients' split": ranks.digest([np.asarray(ix) for ix in partition.client_indices]),
                 "starting server model": ranks.fingerprint(None, [theta, *buffers.values()])})


def _to(x, device):
    """``x`` (ClientResults, buffers: any nesting :mod:`flatfl.utils.batch_walk` walks) with its tensors detached and
    moved to ``device``."""
    return map_tensors(x, lambda t: t.detach().to(device))


def exchange(ids: list[int], results: list, client_buffers: list[dict], *, clients_state: dict,
             latest: torch.Tensor, latest_buffers: dict, created: set[str], world: ranks.World) -> tuple[list, list]:
    """Share what this rank's clients ``ids`` produced with every rank; returns every participant's results and
    buffers in the participants' order. ``clients_state`` (the algorithm's per-client rows), ``latest`` and
    ``latest_buffers`` are updated in place with the other ranks' rows; ``created``: per-client state keys this
    rank created during the round (an algorithm's state made on first sight of the data), sent whole so that a
    rank whose share never made them gets the same tensor. Nothing to share in a world of one (``world``)."""
    if not world.distributed:
        return results, client_buffers
    cpu = torch.device("cpu")
    index = torch.tensor(ids, dtype=torch.long)
    mine = {
        "ids": list(ids),
        "results": [_to(r, cpu) for r in results],
        "buffers": _to(client_buffers, cpu),
        "state": {k: v.index_select(0, index.to(v.device)).to(cpu) for k, v in clients_state.items()},
        "created": {k: clients_state[k].to(cpu) for k in sorted(created)},
        "latest": latest.index_select(0, index.to(latest.device)).to(cpu),
        "latest_buffers": {k: v.index_select(0, index.to(v.device)).to(cpu) for k, v in latest_buffers.items()},
    }
    everyone = world.gather(mine)
    device = latest.device
    for part in everyone:  # state made on first sight by some rank: the first rank's whole tensor
        for k, v in part["created"].items():
            if k not in clients_state:
                clients_state[k] = v.to(device)
    all_results, all_buffers = [], []
    for part in everyone:
        rows = torch.tensor(part["ids"], dtype=torch.long, device=device)
        all_results += [_to(r, device) for r in part["results"]]
        all_buffers += _to(part["buffers"], device)
        if not part["ids"]:
            continue
        for k, v in part["state"].items():
            clients_state[k].index_copy_(0, rows.to(clients_state[k].device), v.to(clients_state[k].device))
        latest.index_copy_(0, rows, part["latest"].to(device))
        for k, v in part["latest_buffers"].items():
            latest_buffers[k].index_copy_(0, rows, v.to(device))
    return all_results, all_buffers
