"""The Hessian of a model's mean loss as a linear operator (docs/analysis-protocols.md §1).

:class:`HessianOperator` is the Hessian of the **sample-weighted mean** loss over a fixed, deterministic evaluation
set, exposed through ``matvec(v)`` and ``matmat(V)`` on flat vectors (the concatenation of the selected parameters in
``model.parameters()`` order). Every estimator in :mod:`flatfl.analysis` takes any object with ``matvec``, ``dim``,
``device`` and ``dtype`` (and uses ``matmat`` when present), so an explicit matrix (:class:`MatrixOperator`) or
another curvature operator can stand in for it.

How a product is computed (Pearlmutter's double backward). For every batch b the first-order gradient
``g_b = d loss_b / d theta`` is built with ``create_graph=True``; then ``H_b v = d (g_b . v) / d theta`` is one more
backward pass through that graph, and ``H v = sum_b (n_b / N) H_b v``. The first-order graphs are kept between
products while they fit in a memory budget (``cache_graph``), so a product costs one double backward instead of a
forward, a backward and a double backward. Measured on the MAN CIFAR CNN (815k parameters, 512 CIFAR-shaped inputs,
2 CPU cores, torch 2.13): a gradient 0.56 s; an HVP with the graph kept 1.0 s (1.8x a gradient); an HVP rebuilding the
graph 1.9 s; ``torch.func`` jvp-of-grad 1.5 s; batching several vectors through one double backward
(``is_grads_batched``) 1.4-1.6 s per vector. Double backward with a kept graph is therefore the method used. The
graph costs memory (about 1.2 MB per CIFAR input for that CNN); batches beyond the budget are recomputed at every
product, and then ``matmat`` shares each batch's forward and first backward among all the vectors of a block.

Batched products (``products="forward-over-reverse"``): ``matmat`` pushes a block of vectors through one pass of
``torch.func.vmap`` over ``jvp(grad(loss))`` per batch, the block sized from free memory (CUDA ``mem_get_info``,
else available RAM) and halved on an out-of-memory error. On an H100 a block of 32 cost 0.82x a gradient per vector
against 1.70x for the double backward (issue 14); on this 2-core CPU it lost (MAN CNN, 512 inputs: 6.4x a gradient
per vector at a block of 16 against 1.8x; ``benchmarks/hessian_products.py``). At one thread it lost again on the
MAN CNN (1.97x the double backward at best, blocks of 1, 4, 16) and was within noise on the 13.7k-parameter digits
CNN (0.76x at a block of 4, 1.47x at 16; ``benchmarks/results/hessian_products_cpu_1thread.txt``), where a block
also costs the Lanczos solver more products than one vector at a time (on the trained digits CNN, top 200: 633
products one vector at a time, 684 in blocks of 4). So ``products="auto"`` means forward-over-reverse on CUDA and
double backward elsewhere. Both give the same numbers to rounding.

Parameters that receive no gradient (unused layers, frozen branches) are rows and columns of zeros, where PyHessian
fails. The model's mode is set for every product (``eval`` by default: BatchNorm running statistics, no dropout) and
each module's own mode is restored afterwards; in ``train`` mode the buffers (BatchNorm running statistics) are
restored after each pass and the random state is re-seeded per batch, so the operator stays deterministic.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError

__all__ = ["HessianOperator", "MatrixOperator", "as_batches", "apply_block", "block_size_for", "free_memory",
           "random_block", "seeded_generator"]

_MODES = ("eval", "train")
PRODUCTS = ("auto", "double-backward", "forward-over-reverse")
# The product method "auto" picks per device, by measurement (benchmarks/hessian_products.py, one run each):
# forward-over-reverse (torch.func jvp of grad under vmap over a block of vectors) on CUDA, where a block of 32
# costs 0.82x a gradient per vector on an H100 (MAN CIFAR CNN, 512 inputs); on CPU the per-vector double backward
# through the kept first-order graph, which the measurement there found faster (see that script's output).
_AUTO_PRODUCTS = {"cuda": "forward-over-reverse"}


class HessianOperator:
    """Hessian of the sample-weighted mean loss of ``model`` over ``batches``.

    Parameters
    ----------
    model: any ``nn.Module``; its parameters stay untouched.
    batches: the evaluation set: one ``(inputs, targets)`` batch, a list of them, or a DataLoader (any iterable)
        yielding them (:func:`as_batches`). It is read once and kept (moved to the model's device), so the operator
        is deterministic. ``model(inputs)`` gives the outputs and
        ``loss_fn(outputs, targets)`` must be the **mean** loss over the batch; the batch size is ``len(targets)``.
    loss_fn: defaults to cross-entropy.
    params: the parameters to differentiate (default: every parameter with ``requires_grad``), all of one floating
        dtype. The flat layout follows this order.
    mode: ``"eval"`` (default, as PyHessian) or ``"train"``.
    cache_graph: ``True`` keeps every batch's first-order graph, ``False`` none, ``"auto"`` keeps them while their
        saved tensors fit in ``cache_bytes`` (default 2 GiB on CPU, half the free memory on CUDA).
    products: ``"auto"`` (default: by device, see the module docstring), ``"double-backward"`` or
        ``"forward-over-reverse"`` (batched; needs parameters registered in ``model``).
    block_size: vectors per batched pass (default: sized from free memory, at most 256).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Iterable,
        loss_fn: Callable | None = None,
        params: Sequence[torch.Tensor] | None = None,
        mode: str = "eval",
        cache_graph: bool | str = "auto",
        cache_bytes: int | None = None,
        products: str = "auto",
        block_size: int | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ConfigError(f"unknown Hessian mode {mode!r}; choose one of {', '.join(_MODES)}")
        if products not in PRODUCTS:
            raise ConfigError(f"unknown product method {products!r}; choose one of {', '.join(PRODUCTS)}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
        if cache_graph not in (True, False, "auto"):
            raise ConfigError(f"cache_graph must be True, False or 'auto', got {cache_graph!r}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.mode = mode
        self.params = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ConfigError(f"all parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
        self.dtype: torch.dtype = self.params[0].dtype
        self.device: torch.device = self.params[0].device

        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self.param_shapes = [tuple(p.shape) for p in self.params]
        self._numels = [p.numel() for p in self.params]
        self._offsets = [0]
        for n in self._numels:
            self._offsets.append(self._offsets[-1] + n)
        self.dim: int = self._offsets[-1]

        self.batches = as_batches(batches, self.device)
        sizes = [len(t) for _, t in self.batches]
        self.num_samples: int = int(sum(sizes))
        self._weights = [n / self.num_samples for n in sizes]

        self.cache_graph = cache_graph
        if cache_bytes is None:
            if self.device.type == "cuda":
                cache_bytes = int(torch.cuda.mem_get_info(self.device)[0] * 0.5)
            else:
                cache_bytes = 2 * 2**30
        self.cache_bytes = int(cache_bytes)
        self._graphs: list | None = None  # per batch: cached first-order graph or None
        self._cached_bytes = 0
        self.requested_products = products
        self.products: str = products if products != "auto" else _AUTO_PRODUCTS.get(self.device.type,
                                                                                      "double-backward")
        self._param_keys: list[str] | None = None
        if self.products == "forward-over-reverse":
            self._param_keys = self._functional_names()
            if self._param_keys is None:
                if products != "auto":
                    raise ConfigError("forward-over-reverse products need parameters that belong to the model")
                self.products = "double-backward"
        self.block_size = block_size  # vectors per batched pass (None: sized from free memory)
        self._block_limit: int | None = None
        self.hvps = 0  # Hessian-vector products computed so far (one per vector)
        self.on_hvp: Callable[[int], None] | None = None  # called with the count after every product

    # ------------------------------------------------------------------ layout helpers
    def unflatten(self, vector: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        """Views of a flat vector shaped like the parameters, keyed by parameter name."""
        if vector.shape != (self.dim,):
            raise ConfigError(f"expected a vector of length {self.dim}, got shape {tuple(vector.shape)}")
        return OrderedDict(
            (name, vector[a:b].view(shape))
            for name, shape, a, b in zip(self.param_names, self.param_shapes, self._offsets, self._offsets[1:])
        )

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Concatenate per-parameter tensors (``None`` meaning zeros) into one flat vector."""
        out = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
        for t, a, b in zip(tensors, self._offsets, self._offsets[1:]):
            if t is not None:
                out[a:b] = t.reshape(-1)
        return out

    # ------------------------------------------------------------------ mode handling
    @contextlib.contextmanager
    def _model_mode(self):
        """Set the requested mode on every module; restore each module's own mode (and train-mode buffers)."""
        modules = list(self.model.modules())
        previous = [m.training for m in modules]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()] if self.mode == "train" else []
        self.model.train(self.mode == "train")
        try:
            yield
        finally:
            for m, was_training in zip(modules, previous):
                m.training = was_training
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    @contextlib.contextmanager
    def _batch_rng(self, index: int):
        """In train mode, give every batch the same random state at every pass (dropout masks stay fixed)."""
        if self.mode != "train":
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(1_000_003 * index + 17)
            yield

    # ------------------------------------------------------------------ first-order graphs
    def _batch_loss(self, index: int) -> torch.Tensor:
        inputs, targets = self.batches[index]
        with self._batch_rng(index):
            loss = self.loss_fn(self.model(inputs), targets)
        if loss.dim() != 0:
            raise ConfigError("loss_fn must return a scalar (the mean loss over the batch)")
        return loss

    def _build_graph(self, index: int, count_bytes: bool):
        """First-order gradient of batch ``index`` with its graph: list of (parameter index, gradient)."""
        saved = {}
        param_ptrs = {p.data_ptr() for p in self.params}

        def pack(t):
            try:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in param_ptrs:
                    saved[ptr] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # pragma: no cover - exotic tensor subclasses
                pass
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_bytes else contextlib.nullcontext()
        with torch.enable_grad(), hooks:
            loss = self._batch_loss(index)
            grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
        graph = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
        return graph, sum(saved.values())

    def _prepare(self) -> None:
        """Decide (once) which batches keep their first-order graph, building the kept ones."""
        if self._graphs is not None:
            return
        self._graphs = [None] * len(self.batches)
        if self.cache_graph is False:
            return
        with self._model_mode():
            for i in range(len(self.batches)):
                graph, nbytes = self._build_graph(i, count_bytes=self.cache_graph == "auto")
                if self.cache_graph == "auto" and self._cached_bytes + nbytes > self.cache_bytes:
                    break
                self._graphs[i] = graph
                self._cached_bytes += nbytes

    @property
    def fully_cached(self) -> bool:
        """True when every batch's first-order graph is kept (a product costs one double backward)."""
        self._prepare()
        return all(g is not None for g in self._graphs)

    @property
    def preferred_block_size(self) -> int:
        """How many vectors estimators should push through one pass.

        Forward-over-reverse: the block that fits in memory (at most 32). Double backward: 1 when graphs are cached
        (a product is then one double backward whatever the block), else 8 (a block shares the first-order pass).
        """
        if self.products == "forward-over-reverse":
            return min(32, self.block_limit())
        return 1 if self.fully_cached else 8

    def release(self) -> None:
        """Free the cached first-order graphs (they are rebuilt on the next product)."""
        self._graphs = None
        self._cached_bytes = 0

    # ------------------------------------------------------------------ products
    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """H v for a flat vector ``v`` of length ``dim``; returns a vector of ``dtype`` on ``device``."""
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """H V for ``V`` of shape ``(dim, k)``: k products sharing each batch's first-order pass."""
        V = torch.as_tensor(V)
        if V.dim() != 2 or V.shape[0] != self.dim:
            raise ConfigError(f"expected a ({self.dim}, k) block of vectors, got shape {tuple(V.shape)}")
        rows = V.to(device=self.device, dtype=self.dtype).T.contiguous()  # (k, dim): each vector contiguous
        k = rows.shape[0]
        if self.products == "forward-over-reverse":
            out = self._batched_matmat(rows)
        else:
            out = self._double_backward_matmat(rows)
        self.hvps += k
        if self.on_hvp is not None:
            self.on_hvp(k)
        return out.T

    def _double_backward_matmat(self, rows: torch.Tensor) -> torch.Tensor:
        """Pearlmutter's double backward, one vector at a time through each batch's first-order graph."""
        k = rows.shape[0]
        out = torch.zeros_like(rows)
        self._prepare()
        with self._model_mode():
            for index, weight in enumerate(self._weights):
                graph = self._graphs[index]
                if graph is None:
                    graph, _ = self._build_graph(index, count_bytes=False)
                    keep = False
                else:
                    keep = True
                if not graph:  # the loss does not depend on the parameters twice: this block of H is zero
                    continue
                outputs = [g for _, g in graph]
                for j in range(k):
                    grad_outputs = [self._slice(rows[j], i) for i, _ in graph]
                    hv = torch.autograd.grad(
                        outputs, self.params, grad_outputs=grad_outputs,
                        retain_graph=keep or j < k - 1, allow_unused=True,
                    )
                    for i, h in enumerate(hv):
                        if h is not None:
                            out[j, self._offsets[i]:self._offsets[i + 1]].add_(h.reshape(-1), alpha=weight)
                del graph, outputs
        return out

    # ------------------------------------------------------------------ batched forward-over-reverse products
    def _functional_names(self) -> list[str] | None:
        """Names of the selected parameters in ``model.named_parameters()`` (None if one is not the model's)."""
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        keys = [names.get(id(p)) for p in self.params]
        return None if any(k is None for k in keys) else keys

    @contextlib.contextmanager
    def _no_running_stats(self):
        """Train mode under torch.func: BatchNorm must not update its running statistics in place (the double
        backward path restores them afterwards anyway), so tracking is switched off for the pass and restored."""
        changed = []
        if self.mode == "train":
            for m in self.model.modules():
                if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
                    m.track_running_stats = False
                    changed.append(m)
        try:
            yield
        finally:
            for m in changed:
                m.track_running_stats = True

    def _saved_bytes(self, index: int) -> int:
        """Bytes the forward pass of batch ``index`` saves for backward (parameters excluded)."""
        saved = {}
        param_ptrs = {p.data_ptr() for p in self.params}

        def pack(t):
            try:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in param_ptrs:
                    saved[ptr] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # pragma: no cover - exotic tensor subclasses
                pass
            return t

        with self._model_mode(), self._no_running_stats(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self._batch_loss(index)
        return sum(saved.values())

    def block_limit(self) -> int:
        """Most vectors one batched pass takes: ``block_size`` if given, else sized from free memory.

        A vector in a forward-over-reverse pass keeps about three times what the first-order pass saves (forward
        values, their tangents, the backward's); the block takes half the free memory (CUDA: ``mem_get_info``;
        CPU: available physical memory) at that rate, capped at 256. An out-of-memory error halves it later.
        """
        if self.block_size is not None:
            return int(min(self.block_size, self._block_limit or self.block_size))
        if self._block_limit is None:
            per_vector = 3 * max(self._saved_bytes(i) for i in range(len(self.batches))) + 4 * self.dim * 4
            self._block_limit = max(1, min(256, int(0.5 * free_memory(self.device) // max(per_vector, 1))))
        return self._block_limit

    def _batched_matmat(self, rows: torch.Tensor) -> torch.Tensor:
        """H V by ``torch.func``: ``vmap`` over the block of ``jvp(grad(loss))`` (forward-over-reverse)."""
        from torch.func import functional_call, grad, jvp, vmap

        k = rows.shape[0]
        out = torch.zeros_like(rows)
        keys = self._param_keys
        primals = {key: p.detach() for key, p in zip(keys, self.params)}
        with self._model_mode(), self._no_running_stats():
            for index, weight in enumerate(self._weights):
                inputs, targets = self.batches[index]

                def loss_of(params, inputs=inputs, targets=targets):
                    loss = self.loss_fn(functional_call(self.model, params, (inputs,)), targets)
                    if loss.dim() != 0:
                        raise ConfigError("loss_fn must return a scalar (the mean loss over the batch)")
                    return loss

                gradient = grad(loss_of)

                def hvp(tangent):
                    return jvp(gradient, (primals,), (tangent,))[1]

                start = 0
                while start < k:
                    size = min(self.block_limit(), k - start)
                    chunk = rows[start:start + size]
                    tangents = {key: chunk[:, a:b].view(size, *shape) for key, shape, a, b in
                                zip(keys, self.param_shapes, self._offsets, self._offsets[1:])}
                    try:
                        with self._batch_rng(index):
                            result = vmap(hvp, randomness="same")(tangents)
                    except torch.OutOfMemoryError:
                        if size == 1:
                            raise
                        self._block_limit = max(1, size // 2)  # smaller blocks from now on
                        if self.device.type == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    for key, a, b in zip(keys, self._offsets, self._offsets[1:]):
                        out[start:start + size, a:b].add_(result[key].reshape(size, -1), alpha=weight)
                    del result
                    start += size
        return out

    def _slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self._offsets[i]:self._offsets[i + 1]].view(self.param_shapes[i])

    # ------------------------------------------------------------------ first-order quantities
    def loss(self) -> float:
        """The mean loss over the evaluation set."""
        total = 0.0
        with self._model_mode(), torch.no_grad():
            for index, weight in enumerate(self._weights):
                total += weight * float(self._batch_loss(index))
        return total

    def gradient(self) -> torch.Tensor:
        """Flat gradient of the mean loss (no graph kept): the unit of cost HVPs are compared with."""
        out = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
        with self._model_mode(), torch.enable_grad():
            for index, weight in enumerate(self._weights):
                grads = torch.autograd.grad(self._batch_loss(index), self.params, allow_unused=True)
                for i, g in enumerate(grads):
                    if g is not None:
                        out[self._offsets[i]:self._offsets[i + 1]].add_(g.reshape(-1), alpha=weight)
        return out


class MatrixOperator:
    """An explicit symmetric matrix with the operator interface (tests, or curvature matrices formed elsewhere)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        matrix = torch.as_tensor(matrix)
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ConfigError(f"expected a square matrix, got shape {tuple(matrix.shape)}")
        self.matrix = matrix
        self.dim = matrix.shape[0]
        self.dtype = matrix.dtype
        self.device = matrix.device
        self.hvps = 0
        self.on_hvp: Callable[[int], None] | None = None

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        V = torch.as_tensor(V).to(device=self.device, dtype=self.dtype)
        self.hvps += V.shape[1]
        if self.on_hvp is not None:
            self.on_hvp(V.shape[1])
        return self.matrix @ V


def apply_block(op, V: torch.Tensor) -> torch.Tensor:
    """``op`` applied to the columns of ``V`` (dim, k): one ``matmat`` call if the operator has it."""
    if hasattr(op, "matmat"):
        return op.matmat(V)
    return torch.stack([op.matvec(V[:, j]) for j in range(V.shape[1])], dim=1)


def block_size_for(op, requested: int | None = None) -> int:
    """The number of vectors to push through the operator at once (``requested`` wins)."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"block size must be >= 1, got {requested}")
        return int(requested)
    return int(getattr(op, "preferred_block_size", 1))


def free_memory(device: torch.device) -> int:
    """Free memory (bytes) for the block of a batched product: CUDA's free memory, else available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX systems
        return 4 * 2**30


#: what an evaluation set may be, as error messages name it
ACCEPTED_DATA = "one (inputs, targets) batch, a list of such batches, or a DataLoader that yields them"


def as_batches(data, device: torch.device | str | None = None) -> list[tuple]:
    """The evaluation set ``data`` as a list of ``(inputs, targets)`` batches (moved to ``device`` when given).

    ``data`` is one batch ``(x, y)`` (PyHessian's ``data=``), a list of batches, or any iterable of them (a
    ``DataLoader``, PyHessian's ``dataloader=``; read once). A batch is a pair whose targets hold one entry per input
    (``len(targets)`` is the batch size); the inputs are a tensor or anything the model takes (a tuple or dict of
    tensors). Anything else is a :class:`ConfigError` line naming what was given and the accepted forms.
    """
    if _is_single_batch(data):
        items = [data]
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        raise ConfigError(f"the data must be {ACCEPTED_DATA}; got a {type(data).__name__} (a dataset of single "
                          "samples): wrap it in a DataLoader, e.g. DataLoader(dataset, batch_size=128)")
    elif data is None or isinstance(data, (torch.Tensor, str, bytes, dict)) or not hasattr(data, "__iter__"):
        raise ConfigError(f"the data must be {ACCEPTED_DATA}; got {_describe(data)}")
    else:
        items = data
    batches = []
    for i, batch in enumerate(items):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigError(f"batch {i} is {_describe(batch)}, not an (inputs, targets) pair; the data must be "
                              f"{ACCEPTED_DATA}")
        inputs, targets = batch
        if isinstance(targets, torch.Tensor) and targets.dim() == 0 or not hasattr(targets, "__len__"):
            raise ConfigError(f"batch {i}: the targets are {_describe(targets)}, not one entry per input; the data "
                              f"must be {ACCEPTED_DATA}")
        if len(targets) == 0:
            raise ConfigError(f"batch {i} is empty: every batch needs at least one sample")
        if isinstance(inputs, torch.Tensor) and (inputs.dim() == 0 or inputs.shape[0] != len(targets)):
            raise ConfigError(f"batch {i} has {_describe(inputs)} but {len(targets)} targets: the inputs' first "
                              "dimension is the batch")
        if device is not None:
            inputs, targets = _to_device(inputs, device), _to_device(targets, device)
        batches.append((inputs, targets))
    if not batches:
        raise ConfigError(f"the data is empty (no batch); give {ACCEPTED_DATA}")
    return batches


def _is_single_batch(data) -> bool:
    """``(x, y)`` with tensor targets: one batch (a list of batches never has a tensor as its second item)."""
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], torch.Tensor)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} item{'s' if len(x) != 1 else ''}"
    if isinstance(x, dict):
        return f"a dict with keys {', '.join(map(repr, list(x)[:4]))}"
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(t, device) for t in x)
    if isinstance(x, dict):
        return {k: _to_device(t, device) for k, t in x.items()}
    return x


def seeded_generator(seed: int, device) -> torch.Generator:
    """A random generator on ``device`` seeded with ``seed``: estimators draw their random vectors where they are
    used (no host-to-device copy per block). The same seed gives the same vectors on every CPU; a CUDA generator
    gives another stream than the CPU's, so hessian.json records where the vectors were drawn."""
    device = torch.device(device)
    try:
        return torch.Generator(device=device).manual_seed(int(seed))
    except RuntimeError:  # pragma: no cover - a device without its own generator: draw on the CPU
        return torch.Generator().manual_seed(int(seed))


def random_block(kind: str, dim: int, k: int, generator: torch.Generator, dtype, device) -> torch.Tensor:
    """k random vectors as rows, shape (k, dim): ``"rademacher"`` (+-1) or ``"gaussian"`` (standard normal).

    Drawn on the generator's device (see :func:`seeded_generator`) and moved only if that is not ``device``.
    """
    where = generator.device
    if kind == "rademacher":
        block = torch.randint(0, 2, (k, dim), generator=generator, device=where).mul_(2).sub_(1)
    elif kind == "gaussian":
        block = torch.randn(k, dim, generator=generator, dtype=torch.float64, device=where)
    else:  # pragma: no cover - internal misuse
        raise ValueError(kind)
    block = block.to(dtype=dtype)
    return block if block.device == torch.device(device) else block.to(device)
