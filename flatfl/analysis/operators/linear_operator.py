"""The contract every curvature operator keeps (docs/analysis-protocols.md §1).

An estimator of :mod:`flatfl.analysis` (eigenvalues, trace, density, cross-client metrics, surface directions) takes
a :class:`CurvatureOperator`: a symmetric linear operator on flat vectors of length ``dim``, and calls its members
directly:

* ``dim``, ``dtype``, ``device``: the vectors it takes and returns;
* ``matmat(V)``: ``H V`` for a block ``V`` of shape ``(dim, k)`` (``matvec(v)`` is derived from it);
* ``hvps``: the products computed so far (one per vector), ``on_hvp``: called with the count after each block;
* ``products`` and ``product_error``: how a model's products are computed and their stated relative error (None for
  an explicit matrix or an exact product);
* ``param_shapes``: the parameter blocks of the flat layout (a plain matrix: one block of ``dim``), and
  ``has_param_layout``: whether those are a model's parameters (False for a plain matrix); ``param_names``: the
  blocks' names where the operator knows them (a model's parameter names), else None;
* ``preferred_block_size``: how many vectors a block should hold (1 when a product costs the same alone);
* ``release()``: free what the operator keeps between products (nothing, for most);
* ``product_error_along(V)``: the products' relative error measured along given directions (None when exact);
* ``locked``: the orthonormal rows ``X`` taken out of the operator (:class:`DeflatedOperator`), else None;
* ``product_source``: the operator whose products its ``hvps`` counts (itself, but for a multiple or a deflation of
  another: :class:`TransformedOperator`);
* ``as_linear_operator()``: the operator as a ``scipy.sparse.linalg.LinearOperator`` in its own dtype, for scipy's
  solvers (``eigsh``, ``cg``, ``lobpcg``...); every operator inherits it.

Implemented by :class:`~flatfl.analysis.operators.hessian.HessianOperator`, :class:`MatrixOperator` (an explicit matrix),
:class:`FunctionOperator` (a function ``v -> H v``) and :class:`DeflatedOperator`. :func:`as_operator` is the one
place where anything else is turned into an operator or refused in one line.
"""
from __future__ import annotations

import abc
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from ...errors import ConfigError

__all__ = ["CurvatureOperator", "ProductSource", "MatrixOperator", "FunctionOperator", "DerivedOperator",
           "TransformedOperator", "DeflatedOperator", "ForwardedOperator", "as_operator", "project_out", "block_size_for"]


class CurvatureOperator(abc.ABC):
    """A symmetric linear operator on flat vectors, with what the estimators read (see the module docstring).

    Subclasses set ``dim``, ``dtype`` and ``device`` and implement :meth:`matmat` (counting ``hvps``); the other
    members have defaults a subclass overrides where it knows better."""

    dim: int
    dtype: torch.dtype
    device: torch.device
    hvps: int = 0
    on_hvp: Callable[[int], None] | None = None
    #: the names of the :attr:`param_shapes` blocks where known (a model's parameter names), else None
    param_names: list[str] | None = None
    #: how a model's curvature computes its products (``"double-backward"``, ``"forward-over-reverse"``,
    #: ``"finite-difference"``); None for an explicit matrix or a function
    products: str | None = None
    #: the stated relative error of a product where it is not exact (finite differences), else None
    product_error: float | None = None

    @abc.abstractmethod
    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``H V`` for ``V`` of shape ``(dim, k)``, in ``dtype`` on ``device``; adds k to ``hvps``."""

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` for a flat vector of length ``dim``: one column through :meth:`matmat`."""
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the parameter blocks of the flat layout, in order (here: one block of ``dim``)."""
        return [(int(self.dim),)]

    @property
    def has_param_layout(self) -> bool:
        """Whether :attr:`param_shapes` are a model's parameters (False here: one flat block)."""
        return False

    @property
    def preferred_block_size(self) -> int:
        """How many vectors estimators should push through one :meth:`matmat` (here 1)."""
        return 1

    @property
    def locked(self) -> torch.Tensor | None:
        """Orthonormal rows ``X`` (k, dim) deflated out of this operator (``P H P``, ``P = I - X^T X``); None here."""
        return None

    @property
    def product_source(self) -> "CurvatureOperator":
        """The operator whose products this one's :attr:`hvps` counts: itself here; a multiple of another its
        (:class:`~.combined.ScaledOperator`), so that a sum counts each source's products once."""
        return self

    def release(self) -> None:
        """Free what the operator keeps between products (rebuilt when needed); nothing here."""

    def product_error_along(self, V: torch.Tensor) -> float | None:
        """The relative error of the products along the columns of ``V`` (dim, k), measured there, where they are
        not exact (finite differences: the largest over the columns, its products counted in :attr:`hvps`); None
        for exact products, as here. An estimator asks it along what it found: a product's error depends on the
        direction, and :attr:`product_error` was measured along one random direction."""
        return None

    def exact_trace(self, seed: int = 0):
        """The trace computed rather than estimated (:mod:`.exact_trace`): a model's curvature has one (a
        :class:`~.loss_curvature.LossCurvature`, or one over ranks); any other operator refuses in one line."""
        raise ConfigError(f"the exact trace needs the curvature of a model's loss (a Hessian, GGN or empirical-Fisher "
                          f"operator), not a {type(self).__name__}; use the hutchpp trace method")

    def as_linear_operator(self):
        """This curvature as a ``scipy.sparse.linalg.LinearOperator`` of shape ``(dim, dim)`` in the operator's dtype
        (float32 or float64), for scipy's solvers: ``eigsh(op.as_linear_operator(), k=5, which="LA")``.

        ``matvec`` and ``matmat`` take numpy arrays (of any real or complex dtype, cast to the operator's; a complex
        one is applied to its real and imaginary parts) and return numpy arrays computed by :meth:`matmat` on the
        operator's device, one block of products per call, counted in :attr:`hvps`. The operator is symmetric, so
        its adjoint is itself."""
        return _scipy_view(self)


def _scipy_view(op: CurvatureOperator):
    """The scipy ``LinearOperator`` of ``op`` (:meth:`CurvatureOperator.as_linear_operator`; scipy is imported only
    when one is asked for)."""
    from scipy.sparse.linalg import LinearOperator

    try:
        dtype = np.dtype(str(op.dtype).removeprefix("torch."))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "f":
        raise ConfigError(f"a scipy LinearOperator needs a float32 or float64 operator, this one is {op.dtype}")
    n = int(op.dim)

    def block(X):
        X = np.asarray(X)
        if np.iscomplexobj(X):  # H is real: H (a + ib) = H a + i H b
            return block(X.real) + 1j * block(X.imag)
        if X.ndim != 2 or X.shape[0] != n:
            raise ConfigError(f"expected a ({n}, k) array for an operator of dimension {n}, got shape {X.shape}")
        V = torch.as_tensor(np.ascontiguousarray(X, dtype=dtype)).to(device=op.device, dtype=op.dtype)
        return op.matmat(V).detach().to("cpu").numpy().astype(dtype, copy=False)

    def vector(x):
        x = np.asarray(x)
        return block(x.reshape(n, 1)).reshape(x.shape)

    return LinearOperator((n, n), matvec=vector, rmatvec=vector, matmat=block, rmatmat=block, dtype=dtype)


@runtime_checkable
class ProductSource(Protocol):
    """The products part of the contract, for objects of other packages: :func:`as_operator` forwards to them."""

    dim: int
    dtype: torch.dtype
    device: torch.device
    hvps: int
    param_shapes: Sequence[tuple[int, ...]]
    preferred_block_size: int

    def matmat(self, V: torch.Tensor) -> torch.Tensor: ...


def project_out(V: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``(I - X^T X) V`` for orthonormal rows X (k, dim) and columns V (dim, m)."""
    return V - X.T @ (X @ V)


class MatrixOperator(CurvatureOperator):
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
        self.on_hvp = None

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        V = torch.as_tensor(V).to(device=self.device, dtype=self.dtype)
        self.hvps += V.shape[1]
        if self.on_hvp is not None:
            self.on_hvp(V.shape[1])
        return self.matrix @ V


class FunctionOperator(CurvatureOperator):
    """A function ``fn(v) -> H v`` on flat vectors of length ``dim`` as an operator (one call per column)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 1:
            raise ConfigError(f"a function operator needs its dimension dim >= 1, got {dim!r}")
        self.fn = fn
        self.dim = int(dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.hvps = 0
        self.on_hvp = None

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        V = torch.as_tensor(V).to(device=self.device, dtype=self.dtype)
        out = torch.stack([torch.as_tensor(self.fn(V[:, j])).to(device=self.device, dtype=self.dtype).reshape(-1)
                           for j in range(V.shape[1])], dim=1)
        self.hvps += V.shape[1]
        if self.on_hvp is not None:
            self.on_hvp(V.shape[1])
        return out


class ForwardedOperator(CurvatureOperator):
    """An object of another package that has the products part of the contract (:class:`ProductSource`), with
    nothing kept to release and nothing deflated; products and their count are its own."""

    def __init__(self, source: ProductSource) -> None:
        self.source = source
        self.dim, self.dtype, self.device = source.dim, source.dtype, source.device

    @property
    def hvps(self) -> int:
        return int(self.source.hvps)

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.source.param_shapes]

    @property
    def has_param_layout(self) -> bool:
        return True

    @property
    def preferred_block_size(self) -> int:
        return int(self.source.preferred_block_size)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        return self.source.matmat(V)


class ForwardedMember:
    """A read-only member of an operator made from another that is ``op``'s member of the same name, read when
    asked (assigning it is an error: it is ``op``'s)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner: type | None = None):
        return self if obj is None else getattr(obj.op, self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is the operator's it is made from")


class DerivedOperator(CurvatureOperator):
    """An operator made from another one, ``op``: it acts on ``op``'s vectors (``__init__`` sets ``op``, ``dim``,
    ``dtype`` and ``device``) and keeps its layout (parameter blocks and their flag) and preferred block size; a
    subclass overrides what it changes."""

    op: CurvatureOperator
    has_param_layout = ForwardedMember()
    preferred_block_size = ForwardedMember()
    param_shapes = ForwardedMember()

    def __init__(self, op: CurvatureOperator) -> None:
        self.op = op
        self.dim, self.dtype, self.device = op.dim, op.dtype, op.device


class TransformedOperator(DerivedOperator):
    """An operator each of whose products is one of ``op``'s, transformed exactly (a multiple, a projection): the
    products it counts (``hvps``, ``product_source``), their method, and the relative errors ``op`` states and
    measures, read when asked (a finite-difference operator states its error after its first product); ``release``
    frees ``op``'s. For a multiple those errors are its own; a projection ``P H P`` can make a product's relative
    error larger than ``op``'s where ``H P v`` lies mostly along the removed vectors (not eigenvectors)."""

    hvps = ForwardedMember()
    product_source = ForwardedMember()
    products = ForwardedMember()
    product_error = ForwardedMember()

    def product_error_along(self, V: torch.Tensor) -> float | None:
        return self.op.product_error_along(V)

    def release(self) -> None:
        self.op.release()


class DeflatedOperator(TransformedOperator):
    """``P H P`` with ``P = I - X^T X`` (X: orthonormal rows): ``op`` with the vectors X taken out (``locked``)."""

    def __init__(self, op: CurvatureOperator, X: torch.Tensor) -> None:
        super().__init__(op)
        self.X = X

    @property
    def locked(self) -> torch.Tensor:
        return self.X

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        return project_out(self.op.matmat(project_out(V, self.X)), self.X)


def as_operator(candidate, who: str = "the estimator") -> CurvatureOperator:
    """``candidate`` as a :class:`CurvatureOperator`: an operator as it is, a square matrix (torch or numpy) as a
    :class:`MatrixOperator`, an object with the products part of the contract (:class:`ProductSource`) forwarded;
    anything else is one ConfigError line (wrap a function ``v -> H v`` in :class:`FunctionOperator`)."""
    if isinstance(candidate, CurvatureOperator):
        return candidate
    if isinstance(candidate, (torch.Tensor, np.ndarray)):
        return MatrixOperator(torch.as_tensor(candidate))
    if isinstance(candidate, ProductSource):
        return ForwardedOperator(candidate)
    name = type(candidate).__name__
    raise ConfigError(f"{who} needs a curvature operator (flatfl.analysis.CurvatureOperator: HessianOperator, "
                      f"MatrixOperator, FunctionOperator), got {'None' if candidate is None else 'a ' + name}: wrap a "
                      "matrix in MatrixOperator(matrix) or a function v -> H v in FunctionOperator(fn, dim)")


def block_size_for(op: CurvatureOperator, requested: int | None = None) -> int:
    """The number of vectors to push through the operator at once (``requested`` wins)."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"block size must be >= 1, got {requested}")
        return int(requested)
    return int(op.preferred_block_size)
