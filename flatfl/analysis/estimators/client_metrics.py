"""Cross-client Hessian metrics H_N and H_D (FedAlign Eq. 3-4; docs/analysis-protocols.md §5).

For clients k and j with Hessian "diagonals" d_k and d_j::

    H_N(k, j) = (||d_k|| - ||d_j||)^2                      (Eq. 3, "Hessian norm" gap; lower = more alike)
    H_D(k, j) = <d_k, d_j> / (||d_k|| ||d_j||)             (Eq. 4, cosine, "Hessian direction"; higher = more alike)

and the paper reports their means over client pairs. Two protocols, by name:

``default`` (flatfl's): the **global** model's Hessian on **each client's own training data**; d_k is the
per-coordinate diagonal, estimated by Hutchinson's diagonal estimator ``E[z * Hz]`` over Rademacher probes
(:func:`flatfl.analysis.estimators.trace.hutchinson_diagonal`, Bekas et al. 2007), independent probes per client; the mean runs
over **distinct** pairs k < j. Plugging noisy diagonals into Eq. 3-4 is biased: ``E||d_hat||^2 = ||d||^2 + sum_i
Var(d_hat_i)``, and on a network with many coordinates the noise term dominates (norms inflated, cosines pulled
towards 0). The default therefore uses the unbiased U-statistic ``sum_{a != b} <x_a, x_b> / (n (n - 1))`` for
``||d_k||^2`` (x_a the probe vectors ``z_a * H z_a``); the cross inner products ``<d_hat_k, d_hat_j>`` are already
unbiased because the clients' probes are independent. The plug-in values (Eq. 3-4 applied to the estimated
diagonals as they are) are reported beside them.

``fedalign``: what the FedAlign code did (mmendiet/FedAlign ``pyhessian/compute_hessian.py`` and
``parse_logs.py``): the Hessian of **client k's local model** (its last local training) on the **global training
set** (10 batches of 64); "Diag(H)" is one Hutchinson block trace per **parameter tensor** (PyHessian's ``trace()``
``diag``: per tensor, the mean over probes of ``z_p . (Hz)_p``, with PyHessian's per-tensor Rademacher draws and its
stopping rule: at most 100 probes, stop when the running mean of the total changes by less than ``tol`` relative);
plug-in Eq. 3-4; the mean over the **whole K x K matrix, self-pairs included** (H_N = 0 and H_D = 1 on the diagonal,
which pulls H_D towards 1 and H_N towards 0). Every client gets the same probe seed, as FedAlign's per-process
``set_random_seed(1)`` gave every client the same Rademacher vectors. Not reproduced: FedAlign's data loader applied
training augmentation and reshuffled the training set for every Hessian-vector product (a different random operator
per product); flatfl draws the 640 samples once with a seed and uses them unaugmented, so the operator is fixed.

Standard errors (both protocols): a delete-a-group jackknife. Each client's probes are split into G groups
(default 10); replicate g drops group g of every client and recomputes every quantity; the standard error is
``sqrt((G - 1) / G * sum_g (theta_g - mean_g theta_g)^2)``. Everything is computed from the Gram matrix of the
per-group probe sums of all clients (a (K G) x (K G) matrix), so the replicates cost no extra products and the
probe vectors are never all kept in memory (group sums are kept, spilling to a temporary file past a memory budget).

Python API: :func:`cross_client_metrics` on any operators (``HessianOperator(model, batches)`` per client, or
explicit matrices), :func:`pairwise_metrics` on known diagonals; :func:`flatfl.analysis.commands.clients_command.run_client_metrics`
for a checkpoint (``flatfl hessian-clients``).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ...errors import ConfigError, unknown_name
from ...utils.io import json_safe
from ...utils.ranks import World
from ..operators.linear_operator import CurvatureOperator, as_operator
from .trace import hutchinson_diagonal

__all__ = ["PROTOCOLS", "ClientMetrics", "ProbeSums", "cross_client_metrics", "pairwise_metrics",
           "coordinate_probe_sums", "block_probe_rows", "group_rows", "metrics_from_probe_sums",
           "FEDALIGN_SAMPLES", "FEDALIGN_BATCH"]

PROTOCOLS = ("default", "fedalign")
FEDALIGN_SAMPLES = 640  # 10 batches of 64 (compute_hessian.py: batch_size 64, dataloader_hv_product breaks after 10)
FEDALIGN_BATCH = 64


# ---------------------------------------------------------------------------------------------- exact formulas
def pairwise_metrics(diagonals, self_pairs: bool = False) -> dict:
    """Eq. 3-4 on known diagonals (a (K, D) array): per-pair matrices and their means.

    ``self_pairs=False`` averages over distinct pairs k < j; ``True`` over the whole K x K matrix (FedAlign's
    ``parse_logs.py``). Returns ``{"H_N", "H_D", "pair_H_N", "pair_H_D", "norms"}``.
    """
    d = np.asarray(diagonals, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 2:
        raise ConfigError(f"need the diagonals of at least 2 clients as a (K, D) array, got shape {d.shape}")
    norms = np.linalg.norm(d, axis=1)
    pair_n = (norms[:, None] - norms[None, :]) ** 2
    with np.errstate(invalid="ignore", divide="ignore"):
        pair_d = (d @ d.T) / (norms[:, None] * norms[None, :])
    return {"H_N": _pair_mean(pair_n, self_pairs), "H_D": _pair_mean(pair_d, self_pairs),
            "pair_H_N": pair_n, "pair_H_D": pair_d, "norms": norms}


def _pair_mean(matrix: np.ndarray, self_pairs: bool) -> float:
    if self_pairs:
        return float(np.mean(matrix))
    upper = np.triu_indices(matrix.shape[0], k=1)
    return float(np.mean(matrix[upper]))


# ---------------------------------------------------------------------------------------------- probing
@dataclass
class ProbeSums:
    """One client's probes, reduced per group: counts (G,), sums (G, D) of the probe vectors, and sums (G,) of
    their squared norms. A probe vector is ``z * Hz`` (coordinates) or its per-block sums (block traces)."""

    counts: np.ndarray
    sums: np.ndarray
    sq_norms: np.ndarray
    hvps: int = 0
    seconds: float = 0.0

    @property
    def probes(self) -> int:
        return int(self.counts.sum())

    @property
    def mean(self) -> np.ndarray:
        return self.sums.sum(axis=0) / self.probes


def _group_sizes(total: int, groups: int) -> list[int]:
    base, extra = divmod(total, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


def _stream_seed(*keys: int) -> int:
    """An independent 63-bit seed for a (seed, client, group) stream (numpy's SeedSequence hashing)."""
    # int() before the shift: numpy 1.x turns uint64 >> a Python int into float64 and refuses the shift
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, np.uint64)[0]) >> 1


def coordinate_probe_sums(op: CurvatureOperator, probes: int = 100, groups: int = 10, seed: int = 0,
                          stream: int = 0) -> ProbeSums:
    """Hutchinson's per-coordinate diagonal of ``op`` in ``groups`` groups of probes (each its own seed stream).

    Each group is one call of :func:`~flatfl.analysis.estimators.trace.hutchinson_diagonal`; its mean and per-coordinate
    standard error give back the group's sum and the sum of squared probe norms exactly:
    ``sum_a ||x_a||^2 = n (n - 1) sum_i stderr_i^2 + n ||mean||^2``.
    """
    op = as_operator(op, "coordinate_probe_sums")
    start, hvps0 = time.perf_counter(), op.hvps
    sizes = _group_sizes(probes, groups)
    sums = np.empty((len(sizes), op.dim), dtype=np.float64 if op.dtype == torch.float64 else np.float32)
    sq = np.empty(len(sizes))
    for g, n in enumerate(sizes):
        mean, stderr = hutchinson_diagonal(op, samples=n, seed=_stream_seed(seed, stream, g))
        mean64 = mean.detach().double().cpu()
        se64 = stderr.detach().double().cpu()
        sums[g] = (mean64 * n).numpy()
        sq[g] = float(n * (n - 1) * se64.square().sum() + n * mean64.square().sum())
    return ProbeSums(np.asarray(sizes, dtype=np.int64), sums, sq, op.hvps - hvps0,
                     time.perf_counter() - start)


def block_probe_rows(op: CurvatureOperator, block_shapes: Sequence[tuple], max_probes: int = 100, tol: float = 1e-3,
                     seed: int = 0) -> np.ndarray:
    """PyHessian's ``trace()`` ``diag``: per probe, ``z_p . (Hz)_p`` for every parameter block p (rows, (n, P)).

    Draws per block ``torch.randint(0, 2, shape)`` from a generator seeded with ``seed`` (zeros become -1), the
    draws :func:`~flatfl.analysis.estimators.trace.pyhessian_trace` uses, and stops by PyHessian's rule on the running mean
    of the totals: ``|mean - previous| / (previous + 1e-6) < tol``, at most ``max_probes``.
    """
    op = as_operator(op, "block_probe_rows")
    sizes = [int(np.prod(s)) if len(s) else 1 for s in block_shapes]
    if sum(sizes) != op.dim:
        raise ConfigError(f"parameter blocks cover {sum(sizes)} coordinates but the operator has {op.dim}")
    gen = torch.Generator().manual_seed(int(seed))
    ends = np.cumsum(sizes)
    rows: list[np.ndarray] = []
    previous = 0.0
    for _ in range(max_probes):
        parts = [torch.randint(0, 2, tuple(s), generator=gen, dtype=torch.float32).reshape(-1) for s in block_shapes]
        z = torch.cat(parts).mul_(2).sub_(1).to(dtype=op.dtype, device=op.device)
        products = (z * op.matvec(z)).double().cpu().numpy()
        cumulative = np.concatenate([[0.0], np.cumsum(products)])
        rows.append(cumulative[ends] - cumulative[np.concatenate([[0], ends[:-1]])])
        mean = float(np.mean([r.sum() for r in rows]))
        if abs(mean - previous) / (previous + 1e-6) < tol:
            break
        previous = mean
    return np.asarray(rows)


def group_rows(rows: np.ndarray, groups: int) -> ProbeSums:
    """Per-probe rows (n, D) reduced to ``groups`` contiguous groups."""
    sizes = _group_sizes(rows.shape[0], groups)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    sums = np.stack([rows[a:b].sum(axis=0) for a, b in zip(bounds, bounds[1:])])
    sq = np.array([float(np.square(rows[a:b]).sum()) for a, b in zip(bounds, bounds[1:])])
    return ProbeSums(np.asarray(sizes, dtype=np.int64), sums, sq)


# ---------------------------------------------------------------------------------------------- metrics
def _gram(stack: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """``stack @ stack.T`` in float64, a slab of columns at a time (the stack may be a memory-mapped file)."""
    rows = stack.shape[0]
    gram = np.zeros((rows, rows))
    for a in range(0, stack.shape[1], chunk):
        block = np.asarray(stack[:, a:a + chunk], dtype=np.float64)
        gram += block @ block.T
    return gram


def _replicate(gram4, counts, sq, keep, debiased: bool, self_pairs: bool):
    """Every quantity for the probes of the groups in ``keep`` (a 0/1 vector over groups)."""
    n = counts @ keep  # (K,) probes per client
    tt = np.einsum("g,kgjh,h->kj", keep, gram4, keep)  # <T_k, T_j>, T the probe sums
    inner = tt / np.outer(n, n)
    if debiased:
        with np.errstate(invalid="ignore", divide="ignore"):
            sqnorm = (np.diag(tt) - sq @ keep) / (n * (n - 1))
    else:
        sqnorm = np.diag(inner).copy()
    norms = np.sqrt(np.clip(sqnorm, 0.0, None))
    pair_n = (norms[:, None] - norms[None, :]) ** 2
    with np.errstate(invalid="ignore", divide="ignore"):
        pair_d = inner / np.outer(norms, norms)
    undefined = ~(sqnorm > 0)  # a zero (or, debiased, negative) squared norm has no direction
    pair_d[undefined, :] = np.nan
    pair_d[:, undefined] = np.nan
    if debiased:  # a client's debiased diagonal is not compared with itself
        np.fill_diagonal(pair_n, np.nan)
        np.fill_diagonal(pair_d, np.nan)
    else:
        np.fill_diagonal(pair_n, 0.0)
        np.fill_diagonal(pair_d, np.where(sqnorm > 0, 1.0, np.nan))
    return {"H_N": _pair_mean(pair_n, self_pairs), "H_D": _pair_mean(pair_d, self_pairs),
            "pair_H_N": pair_n, "pair_H_D": pair_d, "norms": norms, "sqnorms": sqnorm}


def _jackknife(full: dict, replicates: list[dict]) -> dict:
    """Delete-a-group jackknife standard error of every entry of ``full``."""
    g = len(replicates)
    out = {}
    for key in full:
        values = np.stack([np.asarray(r[key], dtype=float) for r in replicates])
        out[key] = np.sqrt((g - 1) / g * np.sum((values - values.mean(axis=0)) ** 2, axis=0))
    return out


def metrics_from_probe_sums(per_client: Sequence[ProbeSums], *, debiased: bool, self_pairs: bool,
                            stack: np.ndarray | None = None) -> tuple[dict, dict]:
    """Eq. 3-4 and their jackknife standard errors from every client's grouped probe sums.

    ``stack`` may hold the (K G, D) group sums already (the clients' ``sums`` are then ignored). Returns
    ``(values, stderrs)``, dicts with keys H_N, H_D, pair_H_N, pair_H_D, norms, sqnorms.
    """
    k = len(per_client)
    groups = {len(p.counts) for p in per_client}
    if len(groups) != 1:
        raise ConfigError("every client needs the same number of probe groups")
    g = groups.pop()
    if stack is None:
        stack = np.concatenate([p.sums for p in per_client])
    gram4 = _gram(stack).reshape(k, g, k, g)
    counts = np.stack([p.counts for p in per_client]).astype(np.float64)
    sq = np.stack([p.sq_norms for p in per_client])
    full = _replicate(gram4, counts, sq, np.ones(g), debiased, self_pairs)
    if g < 2:
        return full, {key: np.full_like(np.asarray(v, dtype=float), np.nan) for key, v in full.items()}
    reps = []
    for drop in range(g):
        keep = np.ones(g)
        keep[drop] = 0.0
        reps.append(_replicate(gram4, counts, sq, keep, debiased, self_pairs))
    return full, _jackknife(full, reps)


@dataclass
class ClientMetrics:
    """H_N and H_D over client pairs, with per-pair matrices, diagonal norms and jackknife standard errors."""

    protocol: str
    H_N: float
    H_D: float
    H_N_stderr: float
    H_D_stderr: float
    pair_H_N: np.ndarray
    pair_H_D: np.ndarray
    pair_H_N_stderr: np.ndarray
    pair_H_D_stderr: np.ndarray
    diag_norms: np.ndarray
    diag_norms_stderr: np.ndarray
    probes: list[int]
    hvps: int
    groups: int
    seconds: float
    diagonal: str
    pairs: str
    estimator: str
    plugin: dict | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return json_safe({
            "protocol": self.protocol, "diagonal": self.diagonal, "pairs": self.pairs, "estimator": self.estimator,
            "num_clients": len(self.diag_norms),
            "H_N": self.H_N, "H_N_stderr": self.H_N_stderr, "H_D": self.H_D, "H_D_stderr": self.H_D_stderr,
            "pair_H_N": self.pair_H_N, "pair_H_N_stderr": self.pair_H_N_stderr,
            "pair_H_D": self.pair_H_D, "pair_H_D_stderr": self.pair_H_D_stderr,
            "diag_norms": self.diag_norms, "diag_norms_stderr": self.diag_norms_stderr,
            "plugin": self.plugin, "probes": self.probes, "hvps": self.hvps, "groups": self.groups,
            "stderr_method": f"delete-a-group jackknife over {self.groups} groups of probes",
            "seconds": self.seconds, "notes": self.notes,
        })


class _GroupSumStore:
    """The (K G, D) group sums of all clients: in memory, or in a temporary file past ``budget`` bytes."""

    def __init__(self, rows: int, dim: int, budget: int, dtype=np.float32):
        self._tmp = None
        if rows * dim * np.dtype(dtype).itemsize <= budget:
            self.array = np.empty((rows, dim), dtype=dtype)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="flatfl-clients-")
            self.array = np.memmap(Path(self._tmp.name) / "group_sums.bin", dtype=dtype, mode="w+",
                                   shape=(rows, dim))

    def close(self) -> None:
        if self._tmp is not None:
            del self.array
            self._tmp.cleanup()


def cross_client_metrics(
    operators: Sequence,
    *,
    protocol: str = "default",
    probes: int = 100,
    groups: int = 10,
    seed: int = 0,
    tol: float = 1e-3,
    blocks: Sequence[int] | None = None,
    memory_budget: int = 2 * 2**30,
    progress: Callable[[int], None] | None = None,
    spread: World | None = None,
) -> ClientMetrics:
    """H_N and H_D across clients, one Hessian operator per client (see the module docstring for the protocols).

    ``operators``: per client a :class:`~flatfl.analysis.operators.linear_operator.CurvatureOperator` (e.g.
    ``HessianOperator(model_k, batches_k)``, or an explicit matrix), or a function of no argument returning one
    (built when needed and released after, so only one client's first-order graphs are in memory at a time).
    ``probes``: Rademacher probes per client (``fedalign``: the most, as PyHessian's ``maxIter``). ``groups``:
    jackknife groups. ``blocks``: for ``fedalign`` on operators without a parameter layout (``has_param_layout``),
    the sizes of the parameter blocks. ``progress(k)`` is called after each
    client. ``spread``: the ranks the clients are dealt to (a :class:`flatfl.utils.ranks.World`; None: a world of one): each
    rank probes its own clients (:meth:`~flatfl.utils.ranks.World.owns`) and the probe sums meet before the metrics,
    which are then one process's.
    """
    if protocol not in PROTOCOLS:
        raise unknown_name("cross-client protocol", protocol, PROTOCOLS)
    if len(operators) < 2:
        raise ConfigError(f"cross-client metrics need at least 2 clients, got {len(operators)}")
    if not isinstance(groups, int) or groups < 2:
        raise ConfigError(f"the number of jackknife groups must be an integer >= 2, got {groups!r}")
    minimum = 4 if protocol == "default" else 2
    if not isinstance(probes, int) or probes < minimum:
        raise ConfigError(f"the {protocol} protocol needs at least {minimum} probes per client, got {probes!r}")
    if not tol > 0:
        raise ConfigError(f"tol must be positive, got {tol}")
    start = time.perf_counter()
    count = len(operators)
    hvps = 0
    notes: list[str] = []
    spread = spread if spread is not None else World()
    if protocol == "default":
        g = min(groups, probes // 2)
        store, dim = None, None
        per_client = [None] * count
        try:
            for k, item in enumerate(operators):
                if not spread.owns(k):
                    continue
                op, built = _client_operator(item, k)
                if store is None:
                    dtype = np.float64 if op.dtype == torch.float64 else np.float32
                    store = _GroupSumStore(count * g, op.dim, memory_budget, dtype)
                    dim = op.dim
                elif op.dim != dim:
                    raise ConfigError(f"client {k}'s operator has {op.dim} coordinates, client 0's {dim}")
                sums = coordinate_probe_sums(op, probes, g, seed=seed, stream=k)
                store.array[k * g:(k + 1) * g] = sums.sums
                per_client[k] = ProbeSums(sums.counts, np.empty((g, 0), np.float32), sums.sq_norms, sums.hvps)
                if built:
                    op.release()  # a lazily built operator's cached graphs are freed once its client is done
                if progress is not None:
                    progress(k)
            if spread.distributed:
                store = _meet(spread, store, per_client, g, memory_budget)
            hvps = sum(p.hvps for p in per_client)
            values, errors = metrics_from_probe_sums(per_client, debiased=True, self_pairs=False, stack=store.array)
            plugin_values, plugin_errors = metrics_from_probe_sums(per_client, debiased=False, self_pairs=False,
                                                                   stack=store.array)
        finally:
            if store is not None:
                store.close()
        probe_counts = [p.probes for p in per_client]
        plugin = {"H_N": plugin_values["H_N"], "H_N_stderr": plugin_errors["H_N"],
                  "H_D": plugin_values["H_D"], "H_D_stderr": plugin_errors["H_D"],
                  "diag_norms": plugin_values["norms"]}
        if np.any(values["sqnorms"] <= 0):
            bad = [int(i) for i in np.flatnonzero(values["sqnorms"] <= 0)]
            every = " (every client: H_N is then 0 by construction)" if len(bad) == count else ""
            notes.append(f"clients {bad}: the probe noise exceeds the diagonal's squared norm (debiased estimate "
                         f"<= 0), so their H_D is undefined and their norm enters H_N as 0, understating it"
                         f"{every}; use more probes")
        diagonal, pairs, estimator = "coordinate", "distinct", "debiased"
    else:
        all_rows, client_hvps = [None] * count, [0] * count
        for k, item in enumerate(operators):
            if not spread.owns(k):
                continue
            op, built = _client_operator(item, k)
            shapes = _block_shapes(op, blocks)
            before = op.hvps
            all_rows[k] = block_probe_rows(op, shapes, max_probes=probes, tol=tol, seed=seed)
            client_hvps[k] = op.hvps - before
            if built:
                op.release()
            if progress is not None:
                progress(k)
        for part in spread.gather((all_rows, client_hvps)) if spread.distributed else ():
            for k in range(count):
                if part[0][k] is not None:
                    all_rows[k], client_hvps[k] = part[0][k], part[1][k]
        hvps = sum(client_hvps)
        if len({r.shape[1] for r in all_rows}) != 1:
            raise ConfigError("the clients' operators have different parameter blocks")
        probe_counts = [r.shape[0] for r in all_rows]
        g = min(groups, min(probe_counts))
        if g < 2:
            notes.append("a client's probes stopped after 1 sample (PyHessian's rule): no standard error")
            g = 1
        per_client = [group_rows(r, g) for r in all_rows]
        values, errors = metrics_from_probe_sums(per_client, debiased=False, self_pairs=True)
        plugin = None
        diagonal, pairs, estimator = "parameter-block", "all (K x K, self-pairs included)", "plugin"
        if g >= 2:
            notes.append("jackknife groups are contiguous runs of each client's probes; the clients share their "
                         "probes (one seed), so the standard errors are approximate")
    return ClientMetrics(
        protocol=protocol, H_N=values["H_N"], H_D=values["H_D"], H_N_stderr=float(errors["H_N"]),
        H_D_stderr=float(errors["H_D"]), pair_H_N=values["pair_H_N"], pair_H_D=values["pair_H_D"],
        pair_H_N_stderr=errors["pair_H_N"], pair_H_D_stderr=errors["pair_H_D"], diag_norms=values["norms"],
        diag_norms_stderr=errors["norms"], probes=probe_counts, hvps=hvps, groups=g,
        seconds=time.perf_counter() - start, diagonal=diagonal, pairs=pairs, estimator=estimator, plugin=plugin,
        notes=notes,
    )


def _meet(spread: World, store, per_client: list, g: int, budget: int, chunk: int = 1 << 16):
    """Every rank's clients' group sums in every rank's store (a slab of coordinates at a time) and their
    :class:`ProbeSums` in ``per_client``; returns the store (made here on a rank that probed no client)."""
    count = len(per_client)
    mine = [k for k in range(count) if per_client[k] is not None]
    shape = (store.array.shape[1], str(store.array.dtype)) if store is not None else None
    known = spread.gather((shape, {k: per_client[k] for k in mine}))
    for s, parts in known:
        shape = shape or s
        for k, p in parts.items():
            per_client[k] = p
    if shape is None:
        raise ConfigError("no rank probed a client")
    if store is None:
        store = _GroupSumStore(count * g, shape[0], budget, np.dtype(shape[1]))
    for a in range(0, shape[0], chunk):
        slabs = spread.gather({k: np.asarray(store.array[k * g:(k + 1) * g, a:a + chunk]) for k in mine})
        for part in slabs:
            for k, slab in part.items():
                store.array[k * g:(k + 1) * g, a:a + chunk] = slab
    return store


def _client_operator(item, k: int) -> tuple[CurvatureOperator, bool]:
    """Client ``k``'s operator and whether it was built here (``item`` a function of no argument returning one)."""
    if isinstance(item, CurvatureOperator):
        return item, False
    if callable(item) and not isinstance(item, (torch.Tensor, np.ndarray)):
        return as_operator(item(), f"client {k}'s operator"), True
    return as_operator(item, f"client {k}'s operator"), False


def _block_shapes(op: CurvatureOperator, blocks):
    if blocks is not None:
        return [(int(b),) for b in blocks]
    if not op.has_param_layout:
        raise ConfigError("the fedalign protocol needs the parameter blocks: pass blocks=[sizes] for this operator")
    return [tuple(s) for s in op.param_shapes]
