"""Per-layer curvature: the Hessian's diagonal blocks, one per module (docs/analysis.md, "Per-layer curvature").

A block is the principal sub-matrix ``H_bb`` of the Hessian for one group of parameters. By default a group is a
**module**'s own parameters (a ``Linear``'s or ``Conv2d``'s weight and bias together, a norm layer's scale and
shift; parameters registered directly on the root module form the group ``(model)``); ``grouping="parameter"``
makes every named parameter a block of its own. For each block: its top eigenvalue(s) and its trace with a standard
error. Two facts the results keep (and the tests check against a dense Hessian): the blocks' traces add up to the
whole trace (the trace is the sum of the diagonal), and no block's top eigenvalue exceeds the whole Hessian's
(a principal sub-matrix's largest eigenvalue is at most the matrix's, by Cauchy's interlacing theorem); blocks say
nothing about the coupling between layers, the off-diagonal blocks.

How: a block's products are the whole operator's products on vectors that are zero outside the block, read back
inside the block (:class:`BlockOperator`), so they share the operator's cached first-order graphs. The blocks run in
lockstep (:class:`Lockstep`): every block's estimator runs in a thread of its own, and whenever each unfinished
block has asked for its next products, all of them go through the operator as one batched product of block-masked
vectors, so the whole analysis costs about as many passes as the longest block's (``info["batched_products"]``),
with the same numbers as block by block (each block runs the same code on the same seeds). A block of at
most ``dense_up_to`` parameters (default: the trace budget, so it costs no more products than the estimate would)
is formed exactly, column by column, and solved with ``numpy.linalg.eigh`` (method ``dense``: exact eigenvalues,
exact trace, standard error 0); a larger one gets the registered estimators named by ``method`` and
``trace_method`` (:mod:`flatfl.analysis.estimators.registry`; by default thick-restart Lanczos and Hutch++, method
``lanczos+hutchpp``). Block ``i`` draws its random vectors from the seed ``seed + i``.
"""
from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import ConfigError
from ...utils.csv_cells import csv_row
from .by_name import estimate_eigenvalues, estimate_trace
from ..operators.linear_operator import CurvatureOperator, DerivedOperator, as_operator
from .registry import DEFAULT_EIGEN_METHOD, DEFAULT_TRACE_METHOD, estimator

__all__ = ["GROUPINGS", "BlockOperator", "Lockstep", "LayerCurvature", "PerLayerResult", "layer_groups", "layer_sizes",
           "per_layer_curvature",
           "per_layer_csv", "per_layer_figure"]

GROUPINGS = ("module", "parameter")
ROOT = "(model)"


class BlockOperator(DerivedOperator):
    """The principal block ``H[idx, idx]`` of ``op`` for the flat indices ``idx`` (in order)."""

    def __init__(self, op: CurvatureOperator, index: torch.Tensor, shapes: list[tuple[int, ...]] | None = None) -> None:
        self.op = op
        self.index = torch.as_tensor(index, dtype=torch.long, device=op.device)
        self.dim = int(self.index.numel())
        self.dtype, self.device = op.dtype, op.device
        self.shapes = shapes or [(self.dim,)]
        self.hvps = 0
        self.on_hvp = None
        self.lockstep: Lockstep | None = None  # set: products batched with the other blocks'

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        return list(self.shapes)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        V = torch.as_tensor(V).to(device=self.device, dtype=self.dtype)
        if self.lockstep is not None:
            out = self.lockstep.product(self.index, V)
        else:
            full = torch.zeros(self.op.dim, V.shape[1], dtype=self.dtype, device=self.device)
            full[self.index] = V
            out = self.op.matmat(full)[self.index]
        self.hvps += V.shape[1]
        if self.on_hvp is not None:
            self.on_hvp(V.shape[1])
        return out


class Lockstep:
    """Runs one job per block, each in a thread, and batches their products: when every unfinished job has asked
    for its next block of vectors (:meth:`product`), the requests go through ``op`` as one ``matmat`` of the
    block-masked vectors side by side, and each job gets its own rows of its own columns back. ``batched`` counts
    those batched products. A job's failure stops the others and is raised from :meth:`run`."""

    def __init__(self, op: CurvatureOperator) -> None:
        self.op = op
        self.batched = 0
        self._lock = threading.Condition()
        self._live = 0
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._results: dict[int, torch.Tensor] = {}
        self._failed: BaseException | None = None

    def product(self, index: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """``H[:, index] V`` read at ``index``, once every other job has asked too (called from a job's thread)."""
        me = threading.get_ident()
        with self._lock:
            self._pending[me] = (index, V)
            self._lock.notify_all()
            while me not in self._results and self._failed is None:
                self._lock.wait()
            if self._failed is not None and me not in self._results:
                raise RuntimeError("another block's job failed")
            return self._results.pop(me)

    def _serve(self) -> None:
        """Compute the batched products while jobs are live (in the calling thread)."""
        while True:
            with self._lock:
                while self._live and len(self._pending) < self._live and self._failed is None:
                    self._lock.wait()
                if not self._live or self._failed is not None:
                    return
                requests = sorted(self._pending.items(), key=lambda r: int(r[1][0][0]))  # in the layout's order
                self._pending.clear()
            width = sum(V.shape[1] for _, (_, V) in requests)
            full = torch.zeros(self.op.dim, width, dtype=self.op.dtype, device=self.op.device)
            start = 0
            for _, (index, V) in requests:
                full[index, start:start + V.shape[1]] = V
                start += V.shape[1]
            try:
                out = self.op.matmat(full)
            except BaseException as e:  # noqa: BLE001 - handed to run(), which raises it
                with self._lock:
                    self._failed = e
                    self._lock.notify_all()
                return
            self.batched += 1
            with self._lock:
                start = 0
                for who, (index, V) in requests:
                    self._results[who] = out[index, start:start + V.shape[1]]
                    start += V.shape[1]
                self._lock.notify_all()

    def run(self, jobs: list) -> list:
        """Each job's result, the jobs (functions of no argument) run in lockstep."""
        results: list = [None] * len(jobs)

        def work(i, job):
            try:
                results[i] = job()
            except BaseException as e:  # noqa: BLE001 - raised from run()
                with self._lock:
                    self._failed = self._failed or e  # the first failure; the others follow from it
            finally:
                with self._lock:
                    self._live -= 1
                    self._lock.notify_all()

        threads = [threading.Thread(target=work, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
        self._live = len(threads)
        for t in threads:
            t.start()
        self._serve()
        for t in threads:
            t.join()
        if self._failed is not None:
            raise self._failed
        return results


@dataclass
class LayerCurvature:
    """One block: the ``module`` (or parameter) it belongs to, its ``params`` (names), ``dim`` (entries), its top
    ``eigenvalues`` (descending) with ``residuals`` ``||Hv - lambda v||``, ``trace`` +- ``trace_stderr``, the
    ``method`` (``dense`` or ``lanczos+hutchpp``) and the products it cost (``hvps``)."""

    module: str
    params: list[str]
    dim: int
    eigenvalues: np.ndarray
    residuals: np.ndarray
    trace: float
    trace_stderr: float
    method: str
    hvps: int

    def as_dict(self) -> dict:
        return {"module": self.module, "params": list(self.params), "dim": self.dim,
                "top_eigenvalues": [float(v) for v in self.eigenvalues],
                "residuals": [float(r) for r in self.residuals], "trace": float(self.trace),
                "trace_stderr": float(self.trace_stderr), "method": self.method, "hvps": int(self.hvps)}


@dataclass
class PerLayerResult:
    """Every block's :class:`LayerCurvature`, in the parameters' order; ``trace_sum`` +- ``trace_sum_stderr`` is
    the whole trace they add up to (standard errors added in quadrature: the blocks' probes are independent; the
    exact trace's rounding bounds added as they are, bounds not being independent errors)."""

    blocks: list[LayerCurvature]
    grouping: str
    top: int
    hvps: int
    info: dict = field(default_factory=dict)

    @property
    def trace_sum(self) -> float:
        return float(sum(b.trace for b in self.blocks))

    @property
    def trace_sum_stderr(self) -> float:
        bounds = sum(b.trace_stderr for b in self.blocks if b.method.endswith("+exact"))
        return float(bounds + math.sqrt(sum(b.trace_stderr ** 2 for b in self.blocks
                                            if not b.method.endswith("+exact"))))

    def as_dict(self) -> dict:
        return {"grouping": self.grouping, "top": self.top, "blocks": [b.as_dict() for b in self.blocks],
                "trace_sum": self.trace_sum, "trace_sum_stderr": self.trace_sum_stderr, "hvps": int(self.hvps),
                **self.info}


def layer_groups(names: list[str], grouping: str = "module") -> list[tuple[str, list[int]]]:
    """``(group name, parameter indices)`` in first-appearance order: by owning module (the name up to its last
    dot; ``(model)`` for parameters of the root module), or one group per parameter."""
    if grouping not in GROUPINGS:
        raise ConfigError(f"unknown per-layer grouping {grouping!r}; choose one of {', '.join(GROUPINGS)}")
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        key = name if grouping == "parameter" else (name.rpartition(".")[0] or ROOT)
        groups.setdefault(key, []).append(i)
    return list(groups.items())


def _dense_block(block: BlockOperator, chunk: int) -> np.ndarray:
    eye = torch.eye(block.dim, dtype=block.dtype, device=block.device)
    cols = [block.matmat(eye[:, a:a + chunk]) for a in range(0, block.dim, chunk)]
    dense = torch.cat(cols, dim=1).double().cpu().numpy()
    return (dense + dense.T) / 2


def per_layer_curvature(op: CurvatureOperator, top: int = 1, *, grouping: str = "module", tol: float = 1e-3,
                        trace_hvps: int = 100, trace_rtol: float | None = 1e-2, seed: int = 0,
                        dense_up_to: int | None = None, method: str = DEFAULT_EIGEN_METHOD,
                        trace_method: str = DEFAULT_TRACE_METHOD, on_block=None) -> PerLayerResult:
    """Each block's top ``top`` eigenvalues and trace +- standard error (see the module docstring). ``op``: a
    :class:`~flatfl.analysis.operators.hessian.HessianOperator` (its ``param_names`` give the modules) or any operator with a
    parameter layout (blocks named ``param0``, ``param1``...). ``method`` / ``trace_method``: the registered
    eigenvalue and trace estimators of a block too large to form. ``on_block(i)``: called as block ``i`` begins."""
    op = as_operator(op, "per-layer curvature")
    estimator("eigenvalues", method), estimator("trace", trace_method)  # an unknown name: one line, before any work
    if not isinstance(top, (int, np.integer)) or isinstance(top, bool) or top < 1:
        raise ConfigError(f"the number of eigenvalues per layer must be a positive integer, got {top!r}")
    shapes = [tuple(s) for s in op.param_shapes]
    names = list(op.param_names or [f"param{i}" for i in range(len(shapes))])
    sizes = [int(np.prod(s)) if s else 1 for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    if offsets[-1] != op.dim:
        raise ConfigError(f"the operator's parameter shapes cover {offsets[-1]} entries, not its {op.dim}")
    dense_up_to = int(trace_hvps if dense_up_to is None else dense_up_to)
    start = op.hvps
    lockstep = Lockstep(op)
    # the exact trace (no products) gives every parameter's share at once: a block's trace is the sum of its own
    exact = op.exact_trace(seed=seed) if trace_method == "exact" else None

    def job(i, module, members):
        index = torch.cat([torch.arange(offsets[j], offsets[j + 1]) for j in members])
        block = BlockOperator(op, index, [shapes[j] for j in members])
        block.lockstep = lockstep
        if on_block is not None:
            on_block(i)
        k = min(int(top), block.dim)
        if block.dim == 0:  # parameters of no entries (a zero-element tensor): an empty block, of trace 0 exactly
            values, residuals, trace, stderr, how = [], [], 0.0, 0.0, "empty"
        elif block.dim <= dense_up_to:
            dense = _dense_block(block, max(1, min(block.dim, 32)))
            values, vectors = np.linalg.eigh(dense)
            order = np.argsort(values)[::-1][:k]
            values = values[order]
            residuals = np.linalg.norm(dense @ vectors[:, order] - vectors[:, order] * values, axis=0)
            trace, stderr, how = float(np.trace(dense)), 0.0, "dense"
        else:
            eig = estimate_eigenvalues(block, method, k, tol=tol, seed=seed + i)
            values, residuals = eig.eigenvalues, eig.residuals
            if exact is not None:  # the bound is proportional to the trace (exact_trace.py): a block's, to its own
                trace = float(sum(exact.per_param[j] for j in members))
                stderr = exact.error * abs(trace) / max(abs(exact.value), 1e-300)
            else:
                tr = estimate_trace(block, trace_method, max_hvps=trace_hvps, rtol=trace_rtol, seed=seed + i)
                trace, stderr = tr.estimate, tr.stderr
            how = f"{method}+{trace_method}"
        return LayerCurvature(module, [names[j] for j in members], block.dim, np.asarray(values, dtype=float),
                              np.asarray(residuals, dtype=float), float(trace), float(stderr), how, block.hvps)

    groups = layer_groups(names, grouping)
    widest = max((sum(sizes[j] for j in g), m) for m, g in groups) if groups else (0, "")
    if top > widest[0]:  # each block finds at most its size; more than the widest has is asked of none
        raise ConfigError(f"--per-layer-top {top} is larger than the largest block ({widest[1]}: {widest[0]:,} "
                          "parameters)")
    blocks = lockstep.run([lambda i=i, m=m, g=g: job(i, m, g) for i, (m, g) in enumerate(groups)])
    return PerLayerResult(blocks, grouping, int(top), op.hvps - start,
                          info={"tol": tol, "trace_hvps": trace_hvps, "trace_rtol": trace_rtol,
                                "dense_up_to": dense_up_to, "batched_products": lockstep.batched})


def layer_sizes(op: CurvatureOperator, grouping: str = "module") -> list[int]:
    """Each per-layer block's number of entries, in the order :func:`per_layer_curvature` takes them."""
    shapes = [tuple(s) for s in op.param_shapes]
    names = list(op.param_names or [f"param{i}" for i in range(len(shapes))])
    sizes = [int(np.prod(s)) if s else 1 for s in shapes]
    return [sum(sizes[j] for j in members) for _, members in layer_groups(names, grouping)]


def per_layer_csv(result: dict) -> str:
    """``per_layer.csv`` of a :meth:`PerLayerResult.as_dict`: one row per block, ``eigenvalue_1 .. eigenvalue_k``
    (empty where a block has fewer entries than k), the trace and its standard error."""
    import csv

    k = int(result.get("top") or 1)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["module", "parameters", "size", "method", *(f"eigenvalue_{j + 1}" for j in range(k)), "trace",
                     "trace_stderr", "hvps"])
    for b in result["blocks"]:
        values = [repr(float(v)) for v in b["top_eigenvalues"]] + [""] * (k - len(b["top_eigenvalues"]))
        writer.writerow(csv_row([b["module"], " ".join(b["params"]), b["dim"], b["method"], *values,
                                 repr(float(b["trace"])), repr(float(b["trace_stderr"])), b["hvps"]]))
    return out.getvalue()


def per_layer_figure(result: dict, fmt: str, title: str = "", whole: dict | None = None,
                     curvature: str = "Hessian") -> bytes:
    """The per-layer figure: (a) each block's top eigenvalue (the whole matrix's as a dashed line when ``whole``
    has ``top_eigenvalues``), (b) each block's trace with its standard error as an error bar; ``curvature`` names
    the matrix ('Hessian', 'GGN', 'empirical Fisher')."""
    from ...utils.plots import finish, label_axes, new_figure, saved

    blocks = result["blocks"]
    names = [b["module"] for b in blocks]
    top = [b["top_eigenvalues"][0] if b["top_eigenvalues"] else np.nan for b in blocks]
    traces = [b["trace"] for b in blocks]
    errors = [b["trace_stderr"] for b in blocks]
    height = max(3.0, 0.28 * len(blocks) + 1.6)
    fig = new_figure((10.0, height))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    y = np.arange(len(blocks))
    ax1.barh(y, top, color="tab:blue")
    whole_top = (whole or {}).get("top_eigenvalues") or []
    if whole_top:
        ax1.axvline(float(whole_top[0]), color="0.3", linestyle="--", linewidth=1,
                    label=f"whole {curvature}: {float(whole_top[0]):.4g}")
        ax1.legend(fontsize=8, loc="lower right")
    ax2.barh(y, traces, xerr=errors, color="tab:orange", ecolor="0.2", capsize=2)
    for ax in (ax1, ax2):
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
    label_axes(ax1, "top eigenvalue of the block", "module" if result.get("grouping") == "module" else "parameter",
               "(a) top eigenvalue per layer")
    label_axes(ax2, "trace of the block (+- standard error)", "",
               f"(b) trace per layer; sum {result['trace_sum']:.4g} +- {result['trace_sum_stderr']:.2g}")
    finish(fig, f"{title}, per-layer {curvature} blocks" if title else f"per-layer {curvature} blocks")
    return saved(fig, fmt)
