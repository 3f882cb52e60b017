"""How :class:`~flatfl.analysis.operators.hessian.HessianOperator` computes ``H V`` (docs/analysis-protocols.md §1).

* :class:`LossTerms`: the mean loss as its batch terms (model, parameters, batches, their weights, the mode), with
  the mode set and restored around every pass and, in train mode, a fixed random state per batch;
* :class:`DoubleBackward`: Pearlmutter's double backward. For every batch b the first-order gradient
  ``g_b = d loss_b / d theta`` is built with ``create_graph=True``; then ``H_b v = d (g_b . v) / d theta`` is one
  more backward pass through that graph, and ``H v = sum_b (n_b / N) H_b v``. The first-order graphs are kept
  between products while they fit in a memory budget (``cache_graph``), so a product costs one double backward
  instead of a forward, a backward and a double backward; batches beyond the budget are recomputed at every
  product, and then a block of vectors shares each batch's forward and first backward;
* :class:`ForwardOverReverse`: a block of vectors through one pass of ``torch.func.vmap`` over ``jvp(grad(loss))``
  per batch, the block sized from free memory (CUDA ``mem_get_info``, else available RAM) and halved on an
  out-of-memory error;
* :class:`FiniteDifference`: central differences of first-order gradients, ``H v ~ (g(theta + h v) - g(theta - h
  v)) / 2h``, for models with an operation torch cannot differentiate twice: two gradients per vector, no second
  derivative anywhere; the weights are moved for each gradient and copied back exactly afterwards. The step starts
  at ``h = eps^(1/3) max(1, max_i |theta_i|) / ||v||`` (eps: the dtype's machine epsilon) and is calibrated on the first
  product, where :attr:`FiniteDifference.error`, the stated relative error of a product, is measured (Richardson's
  comparison with the step ``2h``, plus the rounding), over the whole evaluation set: on a shard of several ranks
  from the all-reduced quantities (:meth:`LossTerms.whole`), so that every rank takes the same step.

The first two give the same numbers to rounding; which one ``products="auto"`` picks per device, and why, is in
docs/performance.md.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch

from ...errors import ConfigError, FlatflError, raised_in, user_frame
from ...models.convolution import matmul_convolutions
from .objective import batch_samples
from .second_order import check_loss_graph, double_backward_failure, graph_nodes, second_order_errors
from .vectors import free_memory

__all__ = ["LossTerms", "ProductMethod", "DoubleBackward", "ForwardOverReverse", "FiniteDifference",
           "saved_bytes_of"]


def saved_bytes_of(roots: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages the autograd graph behind ``roots`` keeps for backward (parameters excluded),
    read from its nodes (every ``_saved_*`` attribute of torch's nodes, a custom Function's ``saved_tensors``).

    The graph is walked after it is built, not watched with ``saved_tensors_hooks``: a pack hook that returns the
    tensor itself makes every node that saves its own output hold that output strongly, a reference cycle through
    torch's C++ graph that Python's garbage collector cannot break, so that every graph counted that way (the kept
    first-order graphs of a Hessian analysis, hundreds of MB each) stayed in memory until the process ended."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    sizes: dict = {}
    for node in graph_nodes(roots):
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                try:
                    value = getattr(node, name)
                except (RuntimeError, AttributeError):  # released, or not a tensor attribute
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        try:
                            storage = t.untyped_storage()
                        except (RuntimeError, NotImplementedError):  # pragma: no cover - exotic subclasses
                            continue
                        if storage.data_ptr() not in param_ptrs:
                            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


class _Objective(torch.nn.Module):
    """``loss(model, batch)`` as a module of one argument, so that ``torch.func.functional_call`` can put other
    parameter values into ``model`` (their names gain the prefix ``model.``)."""

    def __init__(self, model: torch.nn.Module, loss: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, batch):
        return self.loss(self.model, batch)


class LossTerms:
    """The sample-weighted mean loss of ``model`` over ``batches`` as its batch terms, for the parameters
    ``params`` laid out flat in order (``offsets``, ``shapes``). A batch's term is ``loss_fn(model(inputs),
    targets)``, or ``objective(model, batch)`` when an objective is given (batches of any structure; a batch's
    weight is its number of samples, :func:`flatfl.analysis.operators.objective.batch_samples`)."""

    def __init__(self, model: torch.nn.Module, batches: list, loss_fn: Callable, params: Sequence[torch.Tensor],
                 mode: str, objective: Callable | None = None) -> None:
        self.model, self.batches, self.loss_fn, self.params, self.mode = model, batches, loss_fn, list(params), mode
        self.objective = objective
        self.second_order = True  # False: only first derivatives are taken (no once-differentiable check)
        self.wrapper = _Objective(model, objective) if objective is not None else None
        self.checked: set[int] = set()  # batches whose loss graph was checked for once-differentiable Functions
        self.shapes = [tuple(p.shape) for p in self.params]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.dim = self.offsets[-1]
        self.device = self.params[0].device
        #: float64 on the CPU: convolutions as one matrix product each in the passes of batch_loss (double backward,
        #: finite differences, gradients; flatfl.models.convolution: the same numbers to rounding, without torch's
        #: per-sample float64 fallback)
        #: (only for a model with a Conv2d: elsewhere the mode would only add its cost to every operation)
        self.matmul_convolutions = (self.device.type == "cpu" and any(p.dtype == torch.float64 for p in self.params)
                                    and any(isinstance(m, torch.nn.Conv2d) for m in model.modules()))
        sizes = [batch_samples(b, i) for i, b in enumerate(self.batches)] if objective is not None else \
            [len(t) for _, t in self.batches]
        self.num_samples = int(sum(sizes))
        self.weights = [n / self.num_samples for n in sizes]
        #: None in one process; on a shard of several ranks, what turns a quantity of this shard's mean loss into the
        #: whole evaluation set's (:meth:`flatfl.analysis.operators.loss_curvature.LossCurvature.as_shard`)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def whole(self, quantity: torch.Tensor) -> torch.Tensor:
        """``quantity`` of this set's mean loss (a gradient, a product) as the whole evaluation set's: itself in one
        process, on a shard the sample-weighted sum over the ranks (a new tensor: ``quantity`` is kept)."""
        return quantity if self.reduce is None else self.reduce(quantity)

    @contextlib.contextmanager
    def model_mode(self):
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
                    if not torch.equal(b, saved):  # an unchanged buffer keeps its version: graphs kept that saved it
                        b.copy_(saved)  # (an eval-mode BatchNorm's running statistics) stay valid

    @contextlib.contextmanager
    def batch_rng(self, index: int):
        """In train mode, give every batch the same random state at every pass (dropout masks stay fixed)."""
        if self.mode != "train":
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(1_000_003 * index + 17)
            yield

    @contextlib.contextmanager
    def no_running_stats(self):
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

    def batch_loss(self, index: int) -> torch.Tensor:
        """The mean loss of batch ``index`` (a scalar, with its graph when grad is enabled)."""
        with self.batch_rng(index), matmul_convolutions(self.matmul_convolutions):
            if self.objective is not None:
                loss = user_call(self.objective, self.model, self.batches[index], index=index)
            else:
                inputs, targets = self.batches[index]
                loss = self.loss_fn(check_outputs(self.model(inputs)), targets)
        check_scalar(loss, self.objective is not None)
        if torch.is_grad_enabled() and not loss.requires_grad:
            check_differentiable(loss, self.objective is not None)
        if index not in self.checked and torch.is_grad_enabled() and loss.requires_grad:
            if self.second_order:
                check_loss_graph(loss)  # a Function marked @once_differentiable would give rows of zeros: refused
            check_finite(loss, index, self.objective is not None)  # no eigensolver converges on NaN products
            self.checked.add(index)
        return loss

    def gradient(self) -> torch.Tensor:
        """The flat gradient of the mean loss at the current weights (no graph kept; the mode set by the caller)."""
        out = torch.zeros(self.dim, dtype=self.params[0].dtype, device=self.device)
        with torch.enable_grad(), self.no_running_stats():
            for index, weight in enumerate(self.weights):
                grads = torch.autograd.grad(self.batch_loss(index), self.params, allow_unused=True)
                for i, g in enumerate(grads):
                    if g is not None:
                        out[self.offsets[i]:self.offsets[i + 1]].add_(g.reshape(-1), alpha=weight)
        return out

    def functional_loss(self, index: int, keys: list[str], params: dict) -> torch.Tensor:
        """Batch ``index``'s loss with the parameters ``params`` (by name, ``keys`` order) put into the model."""
        from torch.func import functional_call

        # torch's own convolutions here: this runs under vmap, which has no batching rule for the matrix-product
        # form's unfold_backward (torch would loop over the block)
        batch = self.batches[index]
        if self.objective is not None:
            loss = user_call(functional_call, self.wrapper, {f"model.{k}": v for k, v in params.items()}, (batch,),
                             index=index, name=self.objective)
        else:
            inputs, targets = batch
            loss = self.loss_fn(check_outputs(functional_call(self.model, params, (inputs,))), targets)
        check_scalar(loss, self.objective is not None)
        return loss

    def part(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of a flat vector, shaped like it (a view)."""
        return flat[self.offsets[i]:self.offsets[i + 1]].view(self.shapes[i])

    def saved_bytes(self, index: int) -> int:
        """Bytes the forward pass of batch ``index`` saves for backward (parameters excluded)."""
        with self.model_mode(), self.no_running_stats(), torch.enable_grad():
            loss = self.batch_loss(index)
        return saved_bytes_of([loss], self.params)


def check_scalar(loss, objective: bool) -> None:
    """A batch's loss is a scalar tensor (ConfigError otherwise)."""
    name = "loss(model, batch)" if objective else "loss_fn (the criterion)"
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{name} must return a scalar tensor (the mean loss over the batch), got a "
                          f"{type(loss).__name__}")
    if loss.dim() != 0:
        raise ConfigError(f"{name} must return a scalar (the mean loss over the batch), got a tensor of shape "
                          f"{tuple(loss.shape)}")
    if loss.is_complex():  # no real Hessian (an integer loss is refused as having no graph)
        raise ConfigError(f"{name} must return a real floating-point scalar (the mean loss over the batch), got "
                          f"{str(loss.dtype).replace('torch.', '')}")


def check_outputs(outputs):
    """The model's outputs for the criterion: a tensor (ConfigError naming what it returned otherwise)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    keys = f" with keys {', '.join(map(repr, list(outputs)[:4]))}" if isinstance(outputs, dict) else ""
    raise ConfigError(f"the model returns a {type(outputs).__name__}{keys}, not a tensor of scores (batch, classes) "
                      "for the criterion; give a loss(model, batch) (--loss) that takes what the model returns")


def check_differentiable(loss: torch.Tensor, objective: bool) -> None:
    """A batch's loss has a graph to the parameters (ConfigError otherwise: there is no Hessian to take)."""
    name = "loss(model, batch)" if objective else "loss_fn (the criterion)"
    if not loss.is_floating_point():
        raise ConfigError(f"{name} returned a {loss.dtype} tensor ({loss.item()!r}); it must return the mean loss as "
                          "a floating-point scalar computed from the model's outputs")
    raise ConfigError(f"{name} returned a tensor with no graph to the parameters (detached, computed under "
                      "torch.no_grad(), or not from the model's outputs); the Hessian needs the loss as computed")


def user_call(fn: Callable, *args, index: int, name: Callable | None = None):
    """``fn(*args)`` for the user's loss (``name``: the loss, when ``fn`` only calls it): an exception raised in it
    (sys.exit included) is one ConfigError naming the loss and where it was raised, not a data or internal error."""
    try:
        return fn(*args)
    except (FlatflError, KeyboardInterrupt, MemoryError, torch.OutOfMemoryError):
        raise
    except (Exception, SystemExit) as e:
        if isinstance(e, RuntimeError) and user_frame(e, innermost=True) is None:
            raise  # torch's own (a forward-mode derivative missing: products="auto" falls back on it)
        loss = name or fn
        what = f"{getattr(loss, '__module__', '?')}.{getattr(loss, '__qualname__', type(loss).__name__)}"
        where = raised_in(e)
        did = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else \
            f"raised {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        place = f" (in {where})" if where else ""
        raise ConfigError(f"the loss {what}(model, batch) {did} on batch {index}{place}; the loss is called with "
                          "the model and one batch as the data holds it, and returns that batch's mean loss") from None


def check_finite(loss: torch.Tensor, index: int, objective: bool) -> None:
    """A batch's loss is finite (ConfigError naming the batch otherwise): its Hessian would be NaN."""
    value = float(loss.detach())
    if not math.isfinite(value):
        name = "loss(model, batch)" if objective else "the model's loss on its data"
        raise ConfigError(f"the loss is not finite ({value}) on evaluation batch {index}: {name} gives no Hessian")


class ProductMethod:
    """What a product method shares: the batched-block size (``block_size`` if given, else from free memory)."""

    name = ""

    def __init__(self, terms: LossTerms, block_size: int | None) -> None:
        self.terms = terms
        self.block_size = block_size
        self.limit: int | None = None  # the block that fits (None: not measured yet)

    def error_along(self, rows: torch.Tensor) -> float | None:
        """The products' relative error along the rows of ``rows`` (k, dim), where they are not exact; None here
        (exact products: rounding only)."""
        return None

    def block_limit(self) -> int:
        """Most vectors one batched pass takes: ``block_size`` if given, else sized from free memory.

        A vector in a forward-over-reverse pass keeps about three times what the first-order pass saves (forward
        values, their tangents, the backward's); the block takes half the free memory (CUDA: ``mem_get_info``;
        CPU: available physical memory) at that rate, capped at 256. An out-of-memory error halves it later.
        """
        if self.block_size is not None:
            return int(min(self.block_size, self.limit or self.block_size))
        if self.limit is None:
            terms = self.terms
            per_vector = 3 * max(terms.saved_bytes(i) for i in range(len(terms.batches))) + 4 * terms.dim * 4
            self.limit = max(1, min(256, int(0.5 * free_memory(terms.device) // max(per_vector, 1))))
        return self.limit

    @property
    def fully_cached(self) -> bool:
        return False

    def add_in_blocks(self, out: torch.Tensor, rows: torch.Tensor, keys: list[str], weight: float,
                      compute: Callable[[dict], dict]) -> None:
        """``out += weight * compute(V)`` for the rows of ``rows`` in blocks of at most :meth:`block_limit` (halved
        on an out-of-memory error): ``compute`` takes a block as parameter-shaped tangents by name, ``(size,
        *shape)``, and returns the products the same way."""
        terms = self.terms
        k, start = rows.shape[0], 0
        while start < k:
            size = min(self.block_limit(), k - start)
            chunk = rows[start:start + size]
            tangents = {key: chunk[:, a:b].view(size, *shape) for key, shape, a, b in
                        zip(keys, terms.shapes, terms.offsets, terms.offsets[1:])}
            try:
                result = compute(tangents)
            except torch.OutOfMemoryError:
                if size == 1:
                    raise
                self.limit = max(1, size // 2)  # smaller blocks from now on
                if terms.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            for key, a, b in zip(keys, terms.offsets, terms.offsets[1:]):
                out[start:start + size, a:b].add_(result[key].reshape(size, -1), alpha=weight)
            del result
            start += size

    @property
    def preferred_block_size(self) -> int:  # pragma: no cover - every method has its own
        raise NotImplementedError

    def release(self) -> None:
        """Free what is kept between products."""

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:  # pragma: no cover - every method has its own
        """``H`` applied to each row of ``rows`` (k, dim)."""
        raise NotImplementedError


class DoubleBackward(ProductMethod):
    """Pearlmutter's double backward, one vector at a time through each batch's first-order graph."""

    name = "double-backward"

    def __init__(self, terms: LossTerms, block_size: int | None, cache_graph: bool | str, cache_bytes: int) -> None:
        super().__init__(terms, block_size)
        self.cache_graph, self.cache_bytes = cache_graph, cache_bytes
        self.graphs: list | None = None  # per batch: cached first-order graph or None
        self.cached_bytes = 0

    def build_graph(self, index: int, count_bytes: bool):
        """First-order gradient of batch ``index`` with its graph: list of (parameter index, gradient)."""
        terms = self.terms
        # train mode: BatchNorm normalizes by the batch either way; without tracking it leaves its running statistics
        # alone, which a kept graph would otherwise hold at the version the restore after the pass moves on
        with torch.enable_grad(), terms.no_running_stats():
            loss = terms.batch_loss(index)
            grads = torch.autograd.grad(loss, terms.params, create_graph=True, allow_unused=True)
        graph = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
        return graph, saved_bytes_of([loss] + [g for _, g in graph], terms.params) if count_bytes else 0

    def prepare(self) -> None:
        """Decide (once) which batches keep their first-order graph, building the kept ones."""
        if self.graphs is not None:
            return
        self.graphs = [None] * len(self.terms.batches)
        if self.cache_graph is False:
            return
        with self.terms.model_mode(), second_order_errors():
            for i in range(len(self.terms.batches)):
                graph, nbytes = self.build_graph(i, count_bytes=self.cache_graph == "auto")
                if self.cache_graph == "auto" and self.cached_bytes + nbytes > self.cache_bytes:
                    break
                self.graphs[i] = graph
                self.cached_bytes += nbytes

    @property
    def fully_cached(self) -> bool:
        """True when every batch's first-order graph is kept (a product costs one double backward)."""
        self.prepare()
        return all(g is not None for g in self.graphs)

    @property
    def preferred_block_size(self) -> int:
        """1 when graphs are cached (a product is then one double backward whatever the block), else 8 (a block
        shares the first-order pass)."""
        return 1 if self.fully_cached else 8

    def release(self) -> None:
        self.graphs = None
        self.cached_bytes = 0

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        terms = self.terms
        k = rows.shape[0]
        out = torch.zeros_like(rows)
        self.prepare()
        with terms.model_mode(), second_order_errors():
            for index, weight in enumerate(terms.weights):
                graph = self.graphs[index]
                if graph is None:
                    graph, _ = self.build_graph(index, count_bytes=False)
                    keep = False
                else:
                    keep = True
                if not graph:  # the loss does not depend on the parameters twice: this block of H is zero
                    continue
                outputs = [g for _, g in graph]
                for j in range(k):
                    grad_outputs = [terms.part(rows[j], i) for i, _ in graph]
                    try:
                        hv = torch.autograd.grad(
                            outputs, terms.params, grad_outputs=grad_outputs,
                            retain_graph=keep or j < k - 1, allow_unused=True,
                        )
                    except RuntimeError as e:  # a custom Function whose backward torch cannot differentiate
                        failure = double_backward_failure(e, outputs)
                        if failure is None:
                            raise
                        raise failure from None
                    for i, h in enumerate(hv):
                        if h is not None:
                            out[j, terms.offsets[i]:terms.offsets[i + 1]].add_(h.reshape(-1), alpha=weight)
                del graph, outputs
        return out


class ForwardOverReverse(ProductMethod):
    """``H V`` by ``torch.func``: ``vmap`` over a block of ``jvp(grad(loss))`` per batch; ``keys`` are the
    parameters' names in ``model.named_parameters()`` (:meth:`names_of`)."""

    name = "forward-over-reverse"

    def __init__(self, terms: LossTerms, block_size: int | None, keys: list[str]) -> None:
        super().__init__(terms, block_size)
        self.keys = keys

    @staticmethod
    def names_of(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[str] | None:
        """Names of ``params`` in ``model.named_parameters()`` (None if one is not the model's)."""
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        keys = [names.get(id(p)) for p in params]
        return None if any(k is None for k in keys) else keys

    @property
    def preferred_block_size(self) -> int:
        """The block that fits in memory, at most 32."""
        return min(32, self.block_limit())

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        from torch.func import grad, jvp, vmap

        terms = self.terms
        out = torch.zeros_like(rows)
        keys = self.keys
        primals = {key: p.detach() for key, p in zip(keys, terms.params)}
        with terms.model_mode(), terms.no_running_stats(), second_order_errors():
            for index, weight in enumerate(terms.weights):
                if index not in terms.checked:
                    with torch.enable_grad():
                        terms.batch_loss(index)  # the graph checked once (a @once_differentiable Function)

                def loss_of(params, index=index):
                    return terms.functional_loss(index, keys, params)

                gradient = grad(loss_of)

                def hvp(tangent):
                    return jvp(gradient, (primals,), (tangent,))[1]

                def block(tangents, index=index):
                    with terms.batch_rng(index):
                        return vmap(hvp, randomness="same")(tangents)

                self.add_in_blocks(out, rows, keys, weight, block)
        return out


class FiniteDifference(ProductMethod):
    """``H v`` by central differences of gradients (see the module docstring): two first-order gradients per
    vector, the weights moved by ``+- h v`` and copied back exactly after each product.

    The first product calibrates the step: from ``h0 = eps^(1/3) max(1, max_i |theta_i|) / ||v||`` the truncation
    error (Richardson: ``||D(2h) - D(h)|| / 3``, which grows as ``h^2``) and the rounding error (``eps ||g|| / h``)
    are measured, and the step that balances them, ``h = h0 (rounding / 2 truncation)^(1/3)`` (between ``h0 /
    1000`` and ``10 h0``), is kept for every product. :attr:`error`, the stated relative error of a product
    (``||D - H v|| / ||D||``), is measured at that step: ``(||D(2h) - D(h)|| + eps ||g|| / h) / ||D(h)||``
    (three times Richardson's estimate of the truncation, plus the rounding); None before the first product."""

    name = "finite-difference"

    def __init__(self, terms: LossTerms, block_size: int | None) -> None:
        super().__init__(terms, block_size)
        terms.second_order = False
        self.error: float | None = None
        self.eps = float(torch.finfo(terms.params[0].dtype).eps)
        self.factor: float | None = None  # the calibrated step over the first guess (None: not calibrated yet)

    @property
    def preferred_block_size(self) -> int:
        return 1  # a product costs two gradients whatever the block

    def step(self, v: torch.Tensor) -> float:
        """The step ``h`` for the direction ``v``: ``factor eps^(1/3) max(1, max |theta_i|) / ||v||``."""
        theta = max(float(p.detach().abs().max()) for p in self.terms.params)
        return (self.factor or 1.0) * self.eps ** (1.0 / 3.0) * max(1.0, theta) / max(float(v.double().norm()),
                                                                                       1e-300)

    def quotient(self, v: torch.Tensor, h: float, saved: list[torch.Tensor]) -> torch.Tensor:
        """``(g(theta + h v) - g(theta - h v)) / 2h``; the weights copied back from ``saved`` after each gradient."""
        terms = self.terms
        out = None
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for i, p in enumerate(terms.params):
                    p.add_(terms.part(v, i), alpha=sign * h)
            try:
                g = terms.gradient()
            finally:
                with torch.no_grad():
                    for p, s in zip(terms.params, saved):
                        p.copy_(s)
            out = g if out is None else (out - g) / (2 * h)
        return out

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        saved = [p.detach().clone() for p in self.terms.params]
        with self.terms.model_mode():
            for j in range(rows.shape[0]):
                v = rows[j]
                if not bool(v.any()):
                    out[j] = 0
                elif self.factor is None:
                    out[j] = self.calibrate(v, saved)
                else:
                    out[j] = self.quotient(v, self.step(v), saved)
        return out

    def error_along(self, rows: torch.Tensor) -> float | None:
        """The relative error of a product along each row ``v`` of ``rows`` (k, dim) at the calibrated step,
        measured as :attr:`error` is (``(||D(2h) v - D(h) v|| + eps ||g|| / h) / ||D(h) v||``, on the whole
        evaluation set): the largest over the rows; two products a row. None before the step is calibrated."""
        if self.factor is None:
            return None
        saved = [p.detach().clone() for p in self.terms.params]
        whole = self.terms.whole
        worst = 0.0
        with self.terms.model_mode():
            rounding = self.eps * float(whole(self.terms.gradient()).double().norm())
            for v in rows:
                if not bool(v.any()):
                    continue
                h = self.step(v)
                fine = whole(self.quotient(v, h, saved))
                difference = float((whole(self.quotient(v, 2 * h, saved)) - fine).double().norm())
                worst = max(worst, (difference + rounding / h) / max(float(fine.double().norm()), 1e-300))
        return worst

    def calibrate(self, v: torch.Tensor, saved: list[torch.Tensor]) -> torch.Tensor:
        """The first product: the step chosen and :attr:`error` measured (see the class docstring), from the
        whole evaluation set's gradient and quotients (``terms.whole``): on a shard of several ranks every rank
        measures the same numbers, so all take one step and state one error. Returns this set's product."""
        whole = self.terms.whole
        rounding = self.eps * float(whole(self.terms.gradient()).double().norm())  # times 1 / h
        h0 = self.step(v)
        fine = self.quotient(v, h0, saved)
        truncation = float((whole(self.quotient(v, 2 * h0, saved)) - whole(fine)).double().norm()) / 3.0
        ratio = rounding / h0 / (2.0 * truncation) if truncation > 0 else 1.0
        self.factor = min(10.0, max(1e-3, ratio ** (1.0 / 3.0)))
        h = self.step(v)
        if self.factor != 1.0:
            fine = self.quotient(v, h, saved)
        overall = whole(fine)
        difference = float((whole(self.quotient(v, 2 * h, saved)) - overall).double().norm())
        self.error = (difference + rounding / h) / max(float(overall.double().norm()), 1e-300)
        return fine
