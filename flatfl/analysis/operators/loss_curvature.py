"""The curvature of a model's loss, what every kind shares, and the contract a kind keeps (docs/analysis.md,
"Other curvatures"; docs/design.md, "A curvature kind").

:class:`LossCurvature` is the base of the Hessian (:mod:`.hessian`), the generalized Gauss-Newton matrix and the
empirical Fisher (:mod:`.curvatures`), siblings none of which derives from another: the loss (cross-entropy, a
criterion, or ``loss(model, batch)``), the evaluation set and its sample weights (:class:`~.products.LossTerms`),
the parameters and their flat layout, the product counting, ``matmat``/``matvec``, ``release``, ``loss()``,
``gradient()`` and ``as_linear_operator()``. A kind adds how its products are computed (:meth:`product_method`, a
:class:`~.products.ProductMethod`) and registers itself with :func:`~.kinds.curvature_kind` (:mod:`.kinds`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import ConfigError
from .batches import as_batches
from .kinds import kind_of
from .linear_operator import CurvatureOperator
from .objective import loss_batches
from .products import LossTerms, ProductMethod

__all__ = ["LossCurvature", "curvature_operator", "RANDOMNESS", "MODES"]

MODES = ("eval", "train")
#: what a kind may declare as its ``randomness``: None (its products draw no random number) or "per-sample" (every
#: draw comes from :meth:`LossCurvature.sample_generator` of the sample it is for)
RANDOMNESS = (None, "per-sample")


class LossCurvature(CurvatureOperator):
    """A curvature matrix ``C`` of the sample-weighted mean loss of ``model`` over ``batches``: what every kind
    shares. The contract a kind keeps:

    1. **A fixed symmetric linear map.** For the duration of an analysis ``matmat(V)`` is ``C V`` for one symmetric
       ``C``, whatever the block, its columns' order and the products computed before; ``C`` depends on the weights,
       the evaluation set, the loss, the kind's settings and its ``seed`` only. The estimators (Lanczos, Hutch++,
       SLQ) assume it: a map that changes between products gives numbers of no matrix.
    2. **A sum over samples, weighted by sample counts.** ``C = (1 / N) sum_i C_i``, each ``C_i`` a function of
       sample ``i`` alone (batch b's mean loss gives ``sum_b (n_b / N) C_b``): so an evaluation set cut into shards
       of ``n_r`` samples has ``C = sum_r (n_r / N) C_r``, what
       :class:`~flatfl.analysis.operators.distributed.DistributedOperator` computes over ranks. A kind whose matrix
       is not such a sum (batch statistics in ``train`` mode) is refused over several ranks.
    3. **Randomness drawn per sample, from the operator's seed.** A kind that draws random numbers (labels sampled
       from the model, probe vectors) declares ``randomness = "per-sample"`` and draws only from
       :meth:`sample_generator` ``(i)``, seeded by :attr:`seed` and sample i's index in the whole evaluation set
       (:attr:`first_sample` + its place in this operator's batches): every product then applies the same map (1),
       and every rank draws the same numbers for the same sample whatever the split (2), so ranks apply one map.
       :class:`DistributedOperator` reads the attribute: it agrees the seed over the ranks and gives each shard its
       first sample; any other value is refused when the class is defined.
    4. **Choices made once for all shards.** What decides how products are computed from measured quantities (a
       finite-difference step) measures them over the whole evaluation set: through ``terms.whole(t)``, which
       turns a quantity of this operator's mean loss into the whole set's (itself in one process; the
       sample-weighted sum over ranks under :meth:`as_shard`). Every rank then takes the same step and states the
       same error, and one process computes exactly what it did before.

    A kind's constructor takes ``(model, batches, loss_fn=None, params=None, mode="eval", ...)`` and ``loss``,
    ``cache_bytes`` and ``block_size`` by these names (a kind registered with ``takes_products`` also ``products``
    and ``cache_graph``, a randomized kind ``seed``) and calls ``LossCurvature.__init__``, which builds the terms
    and then the product method (:meth:`product_method`). Parameters: ``model`` any ``nn.Module`` (its parameters stay untouched); ``batches``
    one ``(inputs, targets)`` batch, a list of them or a DataLoader (:func:`~.batches.as_batches`), read once and
    kept on the model's device; ``loss_fn`` the criterion of ``(outputs, targets)`` (default cross-entropy), or
    instead ``loss(model, batch)`` over batches of any structure (:mod:`.objective`); ``params`` the parameters
    differentiated (default: every one with ``requires_grad``), all of one floating dtype, in the flat layout's
    order; ``mode`` ``"eval"`` or ``"train"``; ``cache_bytes`` what the products may keep between calls (default 2
    GiB on the CPU, half the free memory on CUDA); ``block_size`` vectors per batched pass (default: from free
    memory).
    """

    #: the kind's name in the registry (set by :func:`~.kinds.curvature_kind`)
    curvature: str = ""
    #: how the kind's products use random numbers (:data:`RANDOMNESS`; the contract's point 3)
    randomness: str | None = None
    #: the seed of a randomized kind's draws (:meth:`sample_generator`)
    seed: int = 0
    #: the index, in the whole evaluation set, of this operator's first sample (0 but on a shard of several ranks)
    first_sample: int = 0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.randomness not in RANDOMNESS:
            raise ConfigError(f"the curvature {cls.__name__} declares randomness = {cls.randomness!r}; a curvature is "
                              "one fixed map, the same on every rank, so its random numbers are drawn per sample from "
                              "its seed (randomness = 'per-sample', sample_generator) or none are (None)")

    def __init__(self, model: torch.nn.Module, batches: Iterable, loss_fn: Callable | None = None,
                 params: Sequence[torch.Tensor] | None = None, mode: str = "eval", cache_bytes: int | None = None,
                 block_size: int | None = None, *, loss: Callable | None = None) -> None:
        if loss is not None and loss_fn is not None:
            raise ConfigError("give loss_fn (a criterion of (outputs, targets)) or loss (a function of (model, "
                              "batch)), not both")
        if loss is not None and not callable(loss):
            raise ConfigError(f"loss must be a function loss(model, batch) -> scalar, got a {type(loss).__name__}")
        if mode not in MODES:
            raise ConfigError(f"unknown Hessian mode {mode!r}; choose one of {', '.join(MODES)}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else (None if loss is not None else F.cross_entropy)
        self.objective = loss
        self.mode = mode
        self.params = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ConfigError(f"all parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
        if next(iter(dtypes)) in (torch.float16, torch.bfloat16):
            raise ConfigError(f"the parameters are {next(iter(dtypes))}: Hessian products in 16-bit floating point are "
                              "tens of percent off; cast the model first (model.float() or model.double())")
        self.dtype: torch.dtype = self.params[0].dtype
        self.device: torch.device = self.params[0].device

        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self.batches = loss_batches(batches, self.device) if loss is not None else as_batches(batches, self.device)
        self.terms = LossTerms(model, self.batches, self.loss_fn, self.params, mode, objective=loss)
        self.dim: int = self.terms.dim
        self.num_samples: int = self.terms.num_samples

        if cache_bytes is None:
            if self.device.type == "cuda":
                cache_bytes = int(torch.cuda.mem_get_info(self.device)[0] * 0.5)
            else:
                cache_bytes = 2 * 2**30
        self.cache_bytes = int(cache_bytes)
        self.block_size = block_size  # vectors per batched pass (None: sized from free memory)
        self.method: ProductMethod = self.product_method()
        self.products: str = self.method.name
        self.hvps = 0  # products computed so far (one per vector)
        self.on_hvp: Callable[[int], None] | None = None  # called with the count after every block of products

    def product_method(self) -> ProductMethod:  # pragma: no cover - every kind has its own
        """How this kind computes ``C V`` (called once the terms are built)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ layout
    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """The selected parameters' shapes, in the flat layout's order."""
        return self.terms.shapes

    @property
    def has_param_layout(self) -> bool:
        return True

    def unflatten(self, vector: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        """Views of a flat vector shaped like the parameters, keyed by parameter name."""
        if vector.shape != (self.dim,):
            raise ConfigError(f"expected a vector of length {self.dim}, got shape {tuple(vector.shape)}")
        offsets = self.terms.offsets
        return OrderedDict(
            (name, vector[a:b].view(shape))
            for name, shape, a, b in zip(self.param_names, self.param_shapes, offsets, offsets[1:])
        )

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Concatenate per-parameter tensors (``None`` meaning zeros) into one flat vector."""
        out = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
        for t, a, b in zip(tensors, self.terms.offsets, self.terms.offsets[1:]):
            if t is not None:
                out[a:b] = t.reshape(-1)
        return out

    # ------------------------------------------------------------------ products
    @property
    def product_error(self) -> float | None:
        """The stated relative error of a product where it is not exact (finite differences' estimate, None before
        the first product); None for exact products (rounding only)."""
        return getattr(self.method, "error", None)

    def product_error_along(self, V: torch.Tensor) -> float | None:
        """The products' relative error measured along the columns of ``V`` (finite differences: two products a
        column, counted in :attr:`hvps`); None for exact products."""
        V = torch.as_tensor(V)
        if V.dim() != 2 or V.shape[0] != self.dim:
            raise ConfigError(f"expected a ({self.dim}, k) block of vectors, got shape {tuple(V.shape)}")
        error = self.method.error_along(V.to(device=self.device, dtype=self.dtype).T.contiguous())
        if error is not None:
            self.hvps += 2 * V.shape[1]
        return error

    @property
    def preferred_block_size(self) -> int:
        """How many vectors estimators should push through one pass (the product method's choice)."""
        return self.method.preferred_block_size

    def block_limit(self) -> int:
        """Most vectors one batched pass takes (:meth:`flatfl.analysis.operators.products.ProductMethod.block_limit`)."""
        return self.method.block_limit()

    def release(self) -> None:
        """Free what the products keep between calls (rebuilt on the next product)."""
        self.method.release()

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``C v`` for a flat vector ``v`` of length ``dim``; returns a vector of ``dtype`` on ``device``."""
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``C V`` for ``V`` of shape ``(dim, k)``: k products, counted in :attr:`hvps`."""
        V = torch.as_tensor(V)
        if V.dim() != 2 or V.shape[0] != self.dim:
            raise ConfigError(f"expected a ({self.dim}, k) block of vectors, got shape {tuple(V.shape)}")
        rows = V.to(device=self.device, dtype=self.dtype).T.contiguous()  # (k, dim): each vector contiguous
        k = rows.shape[0]
        out = self.apply_method(rows)
        self.hvps += k
        if self.on_hvp is not None:
            self.on_hvp(k)
        return out.T

    def apply_method(self, rows: torch.Tensor) -> torch.Tensor:
        """The product method on the rows ``(k, dim)`` (a kind may fall back to another method here)."""
        return self.method.matmat(rows)

    # ------------------------------------------------------------------ over ranks, randomness
    def as_shard(self, whole: Callable[[torch.Tensor], torch.Tensor], first_sample: int) -> None:
        """Make this operator one shard of an evaluation set split over ranks (called by
        :class:`~flatfl.analysis.operators.distributed.DistributedOperator` before any product): ``whole(t)`` turns
        a quantity of this shard's mean loss into the whole set's (the contract's point 4); ``first_sample`` is the
        index of its first sample in the whole set (point 3)."""
        self.terms.reduce = whole
        self.first_sample = int(first_sample)

    def sample_generator(self, index: int) -> torch.Generator:
        """The generator of sample ``index`` of this operator's batches (counted from 0 over its batches in
        order): a CPU ``torch.Generator`` seeded by :attr:`seed` and the sample's index in the whole evaluation set,
        the same in one process and on whichever rank holds the sample (the contract's point 3)."""
        state = np.random.SeedSequence([int(self.seed), self.first_sample + int(index)]).generate_state(1, np.uint64)
        return torch.Generator().manual_seed(int(state[0]) & (2**63 - 1))

    # ------------------------------------------------------------------ the exact trace
    #: whether the kind's exact trace needs the network linear in each layer's parameters (the Hessian's, whose
    #: trace is then the Gauss-Newton matrix's: :mod:`.exact_trace`)
    exact_trace_needs_linear_layers = False

    def trace_columns(self, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The factor ``B_i`` (n, C, K) of the kind in each sample's outputs, for :meth:`exact_trace` (a kind
        without one refuses in one line)."""
        raise ConfigError(f"the {self.curvature_name()} has no exact trace; use --trace-method hutchpp")

    def exact_trace(self, seed: int = 0):
        """The trace of this curvature from per-sample squared norms, per parameter
        (:class:`~.exact_trace.ExactTrace`; :mod:`.exact_trace` says for which networks and losses)."""
        from .exact_trace import exact_trace_of

        return exact_trace_of(self.terms, self.trace_columns, what=self.curvature_name(),
                              linear_layers=self.exact_trace_needs_linear_layers, seed=seed)

    def curvature_name(self) -> str:
        """How a refusal names this curvature ('Gauss-Newton matrix'): its registered kind's full name."""
        return kind_of(self.curvature).full_name if self.curvature else type(self).__name__

    # ------------------------------------------------------------------ first-order quantities
    def loss(self) -> float:
        """The mean loss over the evaluation set (the sample-weighted mean of the batches' losses)."""
        terms = self.terms
        total = 0.0
        with terms.model_mode(), torch.no_grad():
            for index, weight in enumerate(terms.weights):
                total += weight * float(terms.batch_loss(index))
        return total

    def gradient(self) -> torch.Tensor:
        """Flat gradient of the mean loss (no graph kept): the unit of cost products are compared with."""
        with self.terms.model_mode():
            return self.terms.gradient()


def curvature_operator(curvature: str, model: torch.nn.Module, batches: Iterable, *, loss_fn: Callable | None = None,
                       loss: Callable | None = None, params: Sequence[torch.Tensor] | None = None,
                       mode: str = "eval", products: str = "auto", block_size: int | None = None,
                       cache_graph: bool | str = "auto", cache_bytes: int | None = None,
                       seed: int = 0) -> LossCurvature:
    """The operator of the registered curvature ``curvature`` (a name of :data:`~.kinds.CURVATURES`: ``"hessian"``
    a :class:`~.hessian.HessianOperator`, ``"ggn"`` a :class:`~.curvatures.GGNOperator`, ``"empirical-fisher"`` an
    :class:`~.curvatures.EmpiricalFisherOperator`, or any other kind registered) for the mean loss of ``model``
    over ``batches``. ``products`` and ``cache_graph`` go to a kind registered with ``takes_products`` (the
    Hessian's product method); any other kind computes its products its own way and takes ``products="auto"``
    only. ``seed`` goes to a kind that draws random numbers (``randomness``). The other arguments are
    :class:`LossCurvature`'s. An unknown name is one ConfigError line listing the registered ones."""
    kind = kind_of(curvature)
    kind.check_products(products)
    cls = kind.load()
    if not (isinstance(cls, type) and issubclass(cls, LossCurvature)):
        raise ConfigError(f"the curvature {curvature!r} names {kind.path}, which is not a LossCurvature (the base of "
                          "every curvature kind: flatfl.analysis.operators.loss_curvature)")
    options: dict = {"products": products, "cache_graph": cache_graph} if kind.takes_products else {}
    if cls.randomness is not None:
        options["seed"] = seed
    return cls(model, batches, loss_fn, params, mode, loss=loss, cache_bytes=cache_bytes, block_size=block_size,
               **options)
