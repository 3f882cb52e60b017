"""Top eigenvalues of a Hessian operator (docs/analysis-protocols.md §2).

* :func:`top_eigenvalues` (the default estimator, ``lanczos``): thick-restart block Lanczos (Wu & Simon 2000;
  block form as in Golub & Underwood 1977) with full re-orthogonalisation, for the ``k`` **largest algebraic**
  eigenvalues, or with ``which`` the ``k`` smallest (Lanczos ranks its Ritz values the other way round: the same
  steps as on ``-H``) or the ``k`` largest in magnitude (ranked by ``|theta|``, as ARPACK's ``which="LM"``: both
  ends of the spectrum kept at each restart). The Krylov basis is kept in the operator's dtype on its device; the
  small projected matrix is handled in float64 with numpy. As in ARPACK, a Ritz pair (theta, y) is accepted when its residual ``r = ||H y - theta y||``
  is below ``tol * |theta|`` (never below a floor of ``100 * eps(dtype) * max|theta|`` that float rounding of the
  products allows): some eigenvalue then lies within ``r`` of theta (Bauer-Fike), and the error is typically
  ``r^2 / gap`` (Kato-Temple), reported as ``error_bounds`` (the test is on r itself: one on that smaller estimate
  stops before close pairs of eigenvalues split, one Ritz value standing for two). Residuals come from the Lanczos
  relation ``H V = V T + Q_next R e_last^T`` at no cost in products;
  ``exact_residuals=True`` recomputes them with k more products. Small problems (basis as large as the dimension)
  are solved densely. No error estimate is stated below what the products' rounding allows,
  :func:`rounding_floor`: ``sqrt(dim) * eps(dtype) * max|theta|`` (plus a finite-difference product's stated
  relative error times ``max|theta|``). The relation's residuals are estimates: once they fall below the rounding
  of the products they understate the true ``||H v - lambda v||`` of the returned vectors (hessian.json says which kind it holds).
  Repeated eigenvalues: a Krylov space grown from b vectors holds at most b copies of one eigenvalue (rounding lets
  more appear late, one by one), so coinciding Ritz values may stand for more copies than were found. When the top
  k hold a cluster that ends before the last place, a check runs: a fresh random block, one wider than the cluster,
  orthogonal to the k vectors found, on the operator deflated by them; every value it finds above the k-th joins
  the result, until a check adds fewer than it asked for. ``info["multiplicity"]`` says what was seen and checked
  (``status``: ``none seen``, ``checked`` or ``more copies possible``). Spectra without coinciding values pay
  nothing; a repeated eigenvalue of which only one copy was seen cannot be detected (as with ARPACK).
* :func:`flatfl.analysis.estimators.power.power_iteration`: PyHessian's rule, exactly (a module of its own).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ...errors import ConfigError
from .registry import DEFAULT_WHICH, check_which
from ..operators.linear_operator import CurvatureOperator, DeflatedOperator, as_operator, block_size_for, project_out
from ..operators.vectors import free_memory, random_block, seeded_generator

__all__ = ["EigenResult", "top_eigenvalues", "check_k", "check_which", "rank_key", "rounding_floor",
           "products_error_along",
           "explicit_residuals", "dense_matrix", "error_bounds"]


@dataclass
class EigenResult:
    """Eigenvalues with their residual norms ``||H v - lambda v||`` (v of unit norm).

    ``eigenvectors`` (when asked for) is a ``(k, dim)`` tensor of unit rows in the operator's dtype and device.
    ``hvps`` counts every Hessian-vector product the method used (residual checks included). ``residual_kind``
    says what the residuals are (``"explicit"``: computed from the vectors; ``"lanczos relation"``: read off the
    recurrence); None leaves it to the estimator's registry entry. ``error_bounds``: each eigenvalue's error estimate,
    never below the products' rounding (``info["rounding_floor"]``, :func:`rounding_floor`); ``info["which"]``: which
    eigenvalues these are (:data:`~flatfl.analysis.estimators.registry.WHICH`), in that order.
    """

    eigenvalues: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray
    hvps: int
    method: str
    eigenvectors: torch.Tensor | None = None
    info: dict = field(default_factory=dict)
    error_bounds: np.ndarray | None = None
    residual_kind: str | None = None
    #: with ``quadrature_steps``: the Gauss quadrature (nodes, weights) of the spectrum seen from the run's own random
    #: start, the first ``quadrature_steps`` steps of a single-vector run (what a start of stochastic Lanczos
    #: quadrature computes; :func:`~flatfl.analysis.estimators.density.spectral_density` takes it as a start)
    quadrature: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def sorted(self) -> "EigenResult":
        """The same result in descending eigenvalue order."""
        order = np.argsort(-self.eigenvalues, kind="stable")
        vectors = None if self.eigenvectors is None else self.eigenvectors[torch.as_tensor(order.copy())]
        return replace(
            self,
            eigenvalues=self.eigenvalues[order],
            residuals=self.residuals[order],
            converged=self.converged[order],
            eigenvectors=vectors,
            error_bounds=None if self.error_bounds is None else self.error_bounds[order],
        )


def rank_key(theta: np.ndarray, which: str) -> np.ndarray:
    """What ``which`` ranks eigenvalues by, the first place to the largest key: theta (``largest``), -theta
    (``smallest``) or |theta| (``magnitude``)."""
    theta = np.asarray(theta, dtype=float)
    if which == "smallest":
        return -theta
    if which == "magnitude":
        return np.abs(theta)
    return theta


#: how many of the eigenvectors found the products' error is measured along (finite differences: two products each)
ERROR_ALONG_AT_MOST = 3


#: beyond this relative error along the eigenvectors found, finite-difference products are refused: the two
#: steps' difference that measures it no longer bounds the error (a network not smooth at that step)
MAX_ERROR_ALONG = 0.1


def products_error_along(op: CurvatureOperator, vectors) -> float | None:
    """Where the products are not exact (``op.product_error`` set: finite differences), their relative error
    measured along the first :data:`ERROR_ALONG_AT_MOST` of ``vectors`` (rows, or a function giving them): a
    product's error depends on the direction, and the stated one was measured along a random one, while the
    eigenvectors are where an eigenvalue's error comes from. None for exact products. Beyond
    :data:`MAX_ERROR_ALONG` the eigenvalues are refused in one line (their error cannot be bounded)."""
    if op.product_error is None:
        return None
    rows = vectors() if callable(vectors) else vectors
    along = op.product_error_along(rows[:ERROR_ALONG_AT_MOST].T)
    if along is not None and along > MAX_ERROR_ALONG:
        dtype = str(op.dtype).replace("torch.", "")
        raise ConfigError(f"the finite-difference products are not reliable along the eigenvectors found: their "
                          f"error measured there is {100 * along:.0f}% (stated {100 * float(op.product_error):.2g}% "
                          f"along a random direction), so the eigenvalues' error cannot be bounded; the network is "
                          f"not smooth at the step {dtype} needs (ReLU or max-pooling kinks): use exact products "
                          "(--products auto) or --precision float64")
    return along


def rounding_floor(op: CurvatureOperator, scale: float, along: float | None = None) -> float:
    """The smallest eigenvalue error an estimate may state for ``op``: ``(sqrt(dim) eps + e) * scale``, where eps is
    the machine epsilon of the operator's dtype, ``e`` the products' relative error (finite differences: the larger
    of the stated one and ``along``, the one measured along the eigenvectors found, :func:`products_error_along`;
    0 for exact products) and ``scale`` an estimate of ``||H||`` (the largest ``|eigenvalue|`` found).

    A product computed in floating point is ``H v + f`` with ``||f||`` of the order of eps ``||H||``, and each
    eigenvalue estimate is a Rayleigh quotient ``y^T (H y)``, an inner product of length ``dim`` whose rounding
    grows as ``sqrt(dim) eps`` (probabilistic rounding analysis, Higham & Mary 2019): an eigenvalue of the rounded
    computation can be off by that much whatever the residual says (docs/analysis-protocols.md §2)."""
    eps = torch.finfo(op.dtype).eps
    relative = math.sqrt(max(int(op.dim), 1)) * eps + max(float(op.product_error or 0.0), float(along or 0.0))
    return float(relative * abs(float(scale)))


def check_k(op: CurvatureOperator, k: int) -> None:
    """``k`` eigenvalues can be asked of ``op``: a positive integer at most its dimension (ConfigError)."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"the number of eigenvalues must be a positive integer, got {k!r}")
    if k > op.dim:
        raise ConfigError(f"asked for {k} eigenvalues but the operator has only {op.dim} dimensions (parameters)")


# ---------------------------------------------------------------------------------------------- Lanczos
def top_eigenvalues(
    op: CurvatureOperator,
    k: int = 1,
    *,
    which: str = DEFAULT_WHICH,
    tol: float = 1e-3,
    seed: int = 0,
    return_vectors: bool = False,
    basis_size: int | None = None,
    block_size: int | None = None,
    max_hvps: int | None = None,
    exact_residuals: bool = False,
    quadrature_steps: int | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenvalues of ``op``, descending, by thick-restart block Lanczos; ``which=
    "smallest"``: the ``k`` smallest, ascending (the most negative first); ``which="magnitude"``: the ``k`` largest
    in magnitude, by decreasing ``|lambda|``. Residuals, error estimates, the convergence test and the check for
    repeated eigenvalues are the same for each.

    ``basis_size`` (default ``max(4k, k + 32)``, less if that many vectors would take over a quarter of the free
    memory) is the number of Krylov vectors kept in memory; at a restart the best ``k + (basis_size - k) // 2`` Ritz
    vectors are kept (docs/performance.md: how the basis size and the block trade products). ``block_size``
    defaults to :func:`auto_block_size` (one vector for k <= 50, else a small block within the operator's preferred
    block). ``max_hvps`` (default ``20 * basis_size``) bounds the work; pairs
    not converged by then are flagged in ``converged``. ``quadrature_steps``: also keep the Gauss quadrature of the
    spectrum seen from the run's random (Gaussian) start after that many steps, as ``quadrature`` (a single-vector
    run that takes them before its first restart; None otherwise): a start of stochastic Lanczos quadrature the
    density need not compute again.
    """
    op = as_operator(op, "top_eigenvalues")
    check_which(which)
    check_k(op, k)
    if not tol > 0:
        raise ConfigError(f"tolerance must be positive, got {tol}")
    n = int(op.dim)
    start_hvps = op.hvps
    b = min(block_size_for(op, block_size), k) if block_size is not None else auto_block_size(op, k)
    m = int(basis_size) if basis_size is not None else _default_basis(op, k, b)
    if m < k + b:
        raise ConfigError(f"basis size {m} must be at least k + block size = {k + b}")
    m = b * math.ceil(m / b)
    if m + b > n:
        return _dense_top(op, k, return_vectors, start_hvps, which)
    max_hvps = int(max_hvps) if max_hvps is not None else 20 * m
    gen = seeded_generator(seed, op.device)

    found = _lanczos_pass(op, k, tol, gen, _Krylov(b, m, max_hvps, quadrature_steps), which=which)
    restarts, checks, complete = found.restarts, [], True
    # Copies of a repeated eigenvalue: a Krylov space from a block of b vectors holds at most b of them (in exact
    # arithmetic; rounding lets more appear, one by one and late), so coinciding Ritz values (a cluster) may stand for
    # more copies than were found. Check: a fresh random block orthogonal to the returned vectors, as wide as the
    # largest cluster plus one, on the operator deflated by them, for its top (width + 1) eigenvalues; those above the
    # k-th value join the result; repeat until fewer than asked for join (every copy above the k-th value is found).
    while found.converged.all():
        width = _open_cluster_width(found.theta, found.near)
        if not width:
            break
        kc = bc = width + 1
        mc = min(bc * math.ceil(max(4 * kc, kc + 32) / bc), bc * ((n - k - bc) // bc))
        if mc < kc + bc:  # the rest of the space is small: solve exactly
            found = _as_pass(_dense_top(op, k, True, start_hvps, which), which)
            checks.append({"width": width, "joined": None, "hvps": None, "dense": True})
            break
        used = op.hvps - start_hvps
        if used + mc > max_hvps:
            complete = False  # out of budget: more copies cannot be ruled out
            break
        X = found.vectors()
        before = op.hvps
        # a value ranked above the k-th one (and its tolerance) joins
        floor = float(rank_key(found.theta[-1:], which)[0]) + found.threshold[-1]
        extra = _lanczos_pass(DeflatedOperator(op, X), kc, tol, gen, _Krylov(bc, mc, max_hvps - used), floor, which)
        joined = int(np.sum(rank_key(extra.theta, which) > floor))
        checks.append({"width": width, "joined": joined, "hvps": op.hvps - before})
        restarts += extra.restarts
        if not extra.converged.all():
            complete = False
        found = found.merge(extra, k, X)
        if joined < kc or not complete:
            break
    vectors = found.vectors() if (return_vectors or exact_residuals) else None
    residuals = found.residuals
    if exact_residuals:
        residuals = explicit_residuals(op, found.theta, vectors, b)
    scale = max(found.scale, float(np.max(np.abs(found.theta))))  # ||H|| as the Ritz values estimate it
    along = products_error_along(op, vectors if vectors is not None else found.vectors)
    floor = rounding_floor(op, scale, along)
    info = {"which": which, "block_size": b, "basis_size": m, "restarts": restarts, "tol": tol,
            "rounding_floor": floor, "norm_estimate": scale,
            **({"product_error_along": along} if along is not None else {}),
            "multiplicity": _multiplicity_info(found, checks, complete)}
    return EigenResult(
        eigenvalues=found.theta.copy(),
        residuals=np.asarray(residuals, dtype=float),
        converged=found.converged.copy(),
        error_bounds=np.maximum(found.bounds, floor),
        hvps=op.hvps - start_hvps,
        method=found.method,
        eigenvectors=vectors if return_vectors else None,
        info=info if found.method == "lanczos" else {**info, "dense": True},
        residual_kind="lanczos relation" if found.method == "lanczos" and not exact_residuals else "explicit",
        quadrature=found.quadrature,
    )


# Up to this k, "auto" pushes one vector at a time through Lanczos (see auto_block_size).
ONE_VECTOR_UP_TO = 50


def auto_block_size(op: CurvatureOperator, k: int) -> int:
    """The Lanczos block of ``block_size=None``: one vector for ``k <= 50``, else at most ``k // 50`` vectors and the
    operator's preferred block.

    A block Lanczos run spends more products than a single-vector one for the same k (its Krylov space grows b
    vectors per step from b random starts), more than cheaper batched products pay back for small k; for larger k
    the extra share shrinks (docs/performance.md)."""
    if k <= ONE_VECTOR_UP_TO:
        return 1
    return max(1, min(block_size_for(op), k // ONE_VECTOR_UP_TO))


@dataclass
class _Pass:
    """The top Ritz pairs of one Lanczos pass, in ``which``'s order (:func:`rank_key`); ``vectors()`` forms the Ritz
    vectors on demand; ``scale``: the largest ``|theta|`` of the pass (an estimate of ``||H||``)."""

    theta: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray
    bounds: np.ndarray
    threshold: np.ndarray
    near: np.ndarray  # two values closer than the sum of theirs may be one eigenvalue (see _coincidence)
    restarts: int
    vectors: object  # () -> (k, dim) tensor
    method: str = "lanczos"
    which: str = DEFAULT_WHICH
    scale: float = 0.0
    quadrature: tuple | None = None

    def merge(self, other: "_Pass", k: int, X: torch.Tensor) -> "_Pass":
        """The top k of both (``X``: this pass's vectors, already formed)."""
        theta = np.concatenate([self.theta, other.theta])
        order = np.argsort(-rank_key(theta, self.which), kind="stable")[:k]
        Y = torch.cat([X, other.vectors()])[torch.as_tensor(order.copy())]
        pick = lambda a, b: np.concatenate([a, b])[order]  # noqa: E731
        return _Pass(theta[order], pick(self.residuals, other.residuals), pick(self.converged, other.converged),
                     pick(self.bounds, other.bounds), pick(self.threshold, other.threshold),
                     pick(self.near, other.near), self.restarts,
                     lambda: Y, self.method, self.which, max(self.scale, other.scale))


def _as_pass(result: "EigenResult", which: str) -> _Pass:
    vectors = result.eigenvectors
    zeros = np.zeros_like(result.eigenvalues)  # exact: no check needed
    return _Pass(result.eigenvalues, result.residuals, result.converged, result.error_bounds, zeros, zeros, 0,
                 lambda: vectors, result.method, which, float(result.info.get("norm_estimate", 0.0)))


def _coincidence(threshold: np.ndarray, theta_max: float, eps: float) -> np.ndarray:
    """How far apart the Ritz values of one repeated eigenvalue can lie: rounding (``10 eps max|theta|``) plus the
    second-order error of a pair converged to its tolerance t, ``t^2 / gap`` (Kato-Temple), the gap to the rest of
    the spectrum taken as 1% of ``max|theta|``: copies of one eigenvalue lie well inside it, the closest distinct
    pairs of a trained network's top eigenvalues well outside (docs/performance.md)."""
    scale = max(float(theta_max), 1e-300)
    return 10 * eps * scale + threshold ** 2 / (0.01 * scale)


def _clusters(theta: np.ndarray, near: np.ndarray) -> list[tuple[int, int]]:
    """Groups ``(first, last)`` (indices) of at least two coinciding values: neighbours (descending order) within
    the sum of their ``near`` (:func:`_coincidence`)."""
    groups, i = [], 0
    while i < theta.size:
        j = i
        while j + 1 < theta.size and abs(theta[j + 1] - theta[j]) <= near[j] + near[j + 1]:
            j += 1
        if j > i:
            groups.append((i, j))
        i = j + 1
    return groups


def _open_cluster_width(theta: np.ndarray, near: np.ndarray) -> int:
    """The width of the largest cluster that ends before the last place (more copies of it would change the top
    k); 0 when there is none. A cluster at the last places is complete as far as the top k go."""
    return max([j - i + 1 for i, j in _clusters(theta, near) if j < theta.size - 1], default=0)


def _multiplicity_info(found: _Pass, checks: list, complete: bool) -> dict:
    """What is known about repeated eigenvalues in the result (hessian.json's ``eigen.multiplicity``).

    ``status``: ``"none seen"`` (no two values coincide: a repeated eigenvalue of which Lanczos saw a single copy
    cannot be detected, see the README), ``"checked"`` (every cluster before the last place was checked for more
    copies), ``"more copies possible"`` (a check could not run or finish: out of budget, or not converged)."""
    groups = _clusters(found.theta, found.near)
    clusters = [{"value": float(found.theta[i]), "copies": j - i + 1, "first": i + 1} for i, j in groups]
    open_ = _open_cluster_width(found.theta, found.near) > 0
    if not complete or (open_ and not (checks and checks[-1].get("joined", 0) is not None
                                       and checks[-1]["joined"] < checks[-1]["width"] + 1)
                        and not (checks and checks[-1].get("dense"))):
        status = "more copies possible"
    elif checks:
        status = "checked"
    else:
        status = "none seen" if not clusters else "checked"
    return {"clusters": clusters, "checks": checks, "status": status}


@dataclass(frozen=True)
class _Krylov:
    """The Krylov space one Lanczos pass builds: blocks of ``block`` vectors, at most ``basis`` of them kept (a
    multiple of ``block``; a thick restart follows when it is full), and the products it may spend."""

    block: int
    basis: int
    max_hvps: int
    quadrature_steps: int | None = None  # keep the start's Gauss quadrature after this many steps (one vector)


def _lanczos_pass(op: CurvatureOperator, k: int, tol: float, gen, krylov: _Krylov, floor: float = -math.inf,
                  which: str = DEFAULT_WHICH) -> _Pass:
    """One thick-restart block Lanczos run for the top ``k`` Ritz pairs in ``which``'s ranking (:func:`rank_key`;
    the body of :func:`top_eigenvalues`), in the space ``krylov`` sizes.

    With a ``floor`` (a check: only the eigenvalues ranked above it matter, ``floor`` on the ranking's scale), the
    pass ends once the pairs converged in order from the top reach one below ``floor``: the eigenvalues after it
    are below it too."""
    b, m, max_hvps = krylov.block, krylov.basis, krylov.max_hvps
    n = int(op.dim)
    start_hvps = op.hvps
    eps = torch.finfo(op.dtype).eps
    V = torch.zeros(m + b, n, dtype=op.dtype, device=op.device)  # basis, one vector per row
    T = np.zeros((m, m))  # projected matrix; the upper triangle is filled, the lower mirrored
    start = random_block("gaussian", n, b, gen, op.dtype, op.device)
    locked = op.locked  # a check's operator: the vectors found are deflated out, and the start kept off them
    if locked is not None:
        start = project_out(start.T, locked).T
    Q, R = _device_qr(start)
    if not (np.abs(np.diag(_read(R).reshape(b, b))) > 0).all():  # a degenerate start (rare): rows replaced
        Q, _ = _orthonormalize_block(start, V[:0], start.norm(dim=1), eps, gen, locked)
    V[:b] = Q

    cur, restarts, R_last, segment_start = 0, 0, None, 0
    quadrature, plain = None, b == 1 and krylov.quadrature_steps is not None  # plain: the Krylov space of the start
    check_every = max(b, b * math.ceil(m / 100 / b))
    next_check = min(m, max(k + b, check_every))
    while True:
        block = V[cur:cur + b]
        W = op.matmat(block.T).T.contiguous()  # H applied to the block, rows
        scale = W.norm(dim=1)
        basis = V[:cur + b]
        # Local step first: the Lanczos recurrence couples a block only with itself and the previous block (and,
        # right after a restart, with every kept Ritz vector); removing those large components first makes one
        # full classical Gram-Schmidt pass enough (a second is made only if it cancels much), which halves the
        # memory traffic over the basis, the main cost besides the products when the basis is large.
        # Everything stays on the operator's device; the host reads one small packed tensor per block (the
        # projected coefficients, norms and R), so no product waits for the host (a GPU keeps its queue full).
        low = 0 if cur == segment_start else cur - b
        local = V[low:cur + b]
        c_local = local @ W.T
        W -= c_local.T @ local
        before = W.norm(dim=1)
        c_full = basis @ W.T
        W -= c_full.T @ basis
        Q, R = _device_qr(W)
        host = _read(c_full, c_local, scale, before, W.norm(dim=1), R)
        coef, c_loc, scale_h, before_h, after_h, R_h = _split(host, [(cur + b, b), (cur + b - low, b), (b,), (b,),
                                                                     (b,), (b, b)])
        coef[low:] += c_loc
        if not (after_h >= 0.5 * before_h).all():  # the pass cancelled much: a second one (rare)
            c_full = basis @ W.T
            W -= c_full.T @ basis
            Q, R = _device_qr(W)
            c2, R_h = _split(_read(c_full, R), [(cur + b, b), (b, b)])
            coef += c2
        if not (np.abs(np.diag(R_h)) > 100 * eps * np.maximum(scale_h, 0.0)).all():
            # an invariant subspace was found (rare): replace the lost rows by random ones, on the host's clock
            Q, R_h = _orthonormalize_block(W, basis, scale, eps, gen, locked)
            plain = False  # the basis is no longer the start's Krylov space
        T[:cur + b, cur:cur + b] = coef
        V[cur + b:cur + 2 * b], R_last = Q, R_h
        cur += b
        if plain and restarts == 0 and cur == krylov.quadrature_steps:
            nodes, vectors = _ritz(T, cur)  # the projection on the start's Krylov space: its Gauss quadrature
            quadrature = (nodes.copy(), vectors[0, :] ** 2)

        if cur >= next_check or cur == m:
            next_check = cur + check_every
            theta, S = _ritz(T, cur)
            key = rank_key(theta, which)
            top = np.argsort(-key, kind="stable")[:k]
            res = np.linalg.norm(R_last @ S[cur - b:cur, :], axis=0)
            theta_max = np.max(np.abs(theta)) if theta.size else 0.0
            bounds = error_bounds(theta, res)
            threshold = np.maximum(tol * np.abs(theta[top]), 100 * eps * theta_max)
            converged = res[top] <= threshold
            # below floor, a value needs only be known to stay there: a residual 1% of its distance to floor
            converged |= (key[top] < floor) & (res[top] <= 0.01 * (floor - key[top]))
            first_open = int(np.argmin(converged)) if not converged.all() else k
            if 0 < first_open < k and key[top[first_open - 1]] < floor:
                converged[first_open:] = True  # below floor, after a converged value below floor: not needed
            # the next check comes later while many are unconverged: each needs at least about one more step, and
            # a check (a dense eigensolve of the projected matrix) is not free when the basis is large
            next_check = cur + max(check_every, b * math.ceil(int((~converged).sum()) / 2 / b))
            used = op.hvps - start_hvps
            if converged.all() or used + b > max_hvps:
                S_top, basis_now = S[:, top].T.copy(), V[:cur]
                return _Pass(theta[top].copy(), res[top].copy(), converged, bounds[top].copy(), threshold,
                             _coincidence(threshold, theta_max, eps), restarts,
                             lambda: torch.as_tensor(S_top, dtype=op.dtype, device=op.device) @ basis_now,
                             which=which, scale=float(theta_max), quadrature=quadrature)
            if cur == m:  # thick restart: keep the best Ritz vectors and the residual block
                keep_count = k + (m - k) // 2
                keep_count = m - b * math.ceil((m - keep_count) / b)  # new blocks must fill the basis exactly
                if keep_count < k:
                    keep_count = m - b
                keep = np.argsort(-key, kind="stable")[:keep_count]
                S_keep = torch.as_tensor(S[:, keep].T.copy(), dtype=op.dtype, device=op.device)
                V[:keep_count] = S_keep @ V[:m]
                V[keep_count:keep_count + b] = V[m:m + b].clone()
                V[keep_count + b:] = 0
                T[:] = 0
                T[np.arange(keep_count), np.arange(keep_count)] = theta[keep]
                cur = segment_start = keep_count
                next_check = min(m, cur + check_every)
                restarts += 1


def _default_basis(op: CurvatureOperator, k: int, b: int) -> int:
    """``max(4k, k + 32)`` Krylov vectors, fewer (not below ``k + max(b, 32)``) if they would not fit in a quarter of
    the free memory: restarts cost products, so the basis is as large as memory allows up to where Lanczos rarely
    needs a restart for the top k."""
    m = max(4 * k, k + 32)
    itemsize = torch.empty(0, dtype=op.dtype).element_size()
    try:
        fits = int(0.25 * free_memory(op.device) // max(1, int(op.dim) * itemsize))
    except Exception:  # pragma: no cover - unknown device: keep the default
        fits = m
    return max(min(m, fits), k + max(b, 32))


def error_bounds(theta: np.ndarray, residuals: np.ndarray) -> np.ndarray:
    """Estimated eigenvalue errors ``min(r_i, r_i^2 / gap_i)`` of Ritz pairs (theta_i, r_i = residual norm).

    ``|theta - lambda| <= r`` always holds for some eigenvalue lambda (Bauer-Fike for symmetric matrices), and
    ``r^2 / gap`` when the rest of the spectrum is at least ``gap`` away (Kato-Temple). The gap is estimated from the
    other Ritz values, each moved towards theta_i by its own residual: ``gap_i = min_j |theta_i - theta_j| - r_j``.
    """
    if theta.size < 2:
        return residuals.copy()
    distance = np.abs(theta[:, None] - theta[None, :]) - residuals[None, :]
    np.fill_diagonal(distance, np.inf)
    gap = distance.min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        quadratic = np.where(gap > 0, residuals ** 2 / np.where(gap > 0, gap, 1.0), np.inf)
    return np.minimum(residuals, quadratic)


def _ritz(T: np.ndarray, size: int):
    upper = np.triu(T[:size, :size])
    with single_threaded_blas():
        return np.linalg.eigh(upper + np.triu(upper, 1).T)


def single_threaded_blas():
    """Small dense problems run far faster on one BLAS thread (threads thrash on a busy machine)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        return contextlib.nullcontext()
    return threadpool_limits(1)


def _device_qr(W: torch.Tensor):
    """Orthonormal rows Q and upper-triangular R with ``W = R^T Q``, on W's device (Householder QR; R's diagonal
    made non-negative). A row that is (nearly) a combination of the previous ones gets a tiny diagonal in R, which
    the caller checks on the host."""
    if W.shape[0] == 1:
        norm = W.norm(dim=1, keepdim=True)
        return W / norm.clamp_min(torch.finfo(W.dtype).tiny), norm
    Qt, R = torch.linalg.qr(W.T)
    sign = torch.where(torch.diagonal(R) < 0, -1.0, 1.0).to(W.dtype)
    return (Qt * sign).T.contiguous(), R * sign[:, None]


def _read(*tensors: torch.Tensor) -> np.ndarray:
    """The host's one read of a block: every tensor flattened into one float64 array (a single device-to-host copy)."""
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).numpy(force=True)


def _split(flat: np.ndarray, shapes) -> list[np.ndarray]:
    out, at = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[at:at + size].reshape(shape).copy())
        at += size
    return out


def _orthonormalize_block(W: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor, eps: float, gen, locked=None):
    """Orthonormalise the rows of W (already orthogonal to ``basis``) among themselves: W = R^T Q.

    A row whose remainder is at rounding level relative to ``scale`` (an invariant subspace was found) is replaced
    by a random vector orthogonal to everything so far (and to the ``locked`` rows), with a zero coupling in R.
    """
    b, n = W.shape
    Q = torch.zeros_like(W)
    R = np.zeros((b, b))
    for i in range(b):
        w = W[i].clone()
        r = np.zeros(i)
        for _ in range(2):
            if i:
                c = Q[:i] @ w
                w -= c @ Q[:i]
                r += c.double().cpu().numpy()
        R[:i, i] = r
        norm = float(w.norm())
        if norm > 100 * eps * max(float(scale[i]), 0.0) and norm > 0:
            Q[i] = w / norm
            R[i, i] = norm
        else:
            z = random_block("gaussian", n, 1, gen, W.dtype, W.device)[0]
            for _ in range(2):
                if locked is not None:
                    z -= (locked @ z) @ locked
                if basis.shape[0]:
                    z -= (basis @ z) @ basis
                if i:
                    z -= (Q[:i] @ z) @ Q[:i]
            Q[i] = z / z.norm()
    return Q, R


def explicit_residuals(op: CurvatureOperator, eigenvalues: np.ndarray, vectors: torch.Tensor,
                       block: int) -> np.ndarray:
    """``||H v - lambda v||`` of the unit rows of ``vectors``, ``block`` products at a time."""
    out = []
    for a in range(0, vectors.shape[0], block):
        rows = vectors[a:a + block]
        HV = op.matmat(rows.T).T
        lam = torch.as_tensor(eigenvalues[a:a + block], dtype=rows.dtype, device=rows.device)
        out.append((HV - lam[:, None] * rows).norm(dim=1).double().cpu().numpy())
    return np.concatenate(out)


def _dense_top(op: CurvatureOperator, k: int, return_vectors: bool, start_hvps: int,
               which: str = DEFAULT_WHICH) -> EigenResult:
    """Form H column by column (``dim`` products) and solve exactly: used when the basis would span everything.
    The matrix is exact to the products' rounding, so that is each eigenvalue's error (:func:`rounding_floor`; for
    finite differences, the products' error measured along the eigenvectors found, as Lanczos measures it)."""
    H = dense_matrix(op)
    evals, evecs = np.linalg.eigh(H)
    order = np.argsort(-rank_key(evals, which), kind="stable")[:k]
    theta, Y = evals[order], evecs[:, order]
    residuals = np.linalg.norm(H @ Y - Y * theta, axis=0)
    rows = torch.as_tensor(Y.T.copy(), dtype=op.dtype, device=op.device)
    along = products_error_along(op, rows)
    scale = float(np.max(np.abs(evals))) if evals.size else 0.0
    floor = rounding_floor(op, scale, along)
    return EigenResult(
        eigenvalues=theta, residuals=residuals, converged=np.ones(k, dtype=bool),
        error_bounds=np.maximum(residuals, floor), hvps=op.hvps - start_hvps, method="dense",
        eigenvectors=rows if return_vectors else None,
        info={"which": which, "rounding_floor": floor, "norm_estimate": scale,
              **({"product_error_along": along} if along is not None else {})}, residual_kind="explicit",
    )


def dense_matrix(op: CurvatureOperator, chunk: int = 64) -> np.ndarray:
    """The operator as a dense symmetric float64 numpy matrix, formed with ``dim`` products (small models only)."""
    op = as_operator(op, "dense_matrix")
    n = int(op.dim)
    H = np.empty((n, n))
    for a in range(0, n, chunk):
        cols = torch.zeros(n, min(chunk, n - a), dtype=op.dtype, device=op.device)
        cols[torch.arange(a, a + cols.shape[1]), torch.arange(cols.shape[1])] = 1
        H[:, a:a + cols.shape[1]] = op.matmat(cols).double().cpu().numpy()
    return 0.5 * (H + H.T)
