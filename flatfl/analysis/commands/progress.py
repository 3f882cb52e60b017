"""How far ``flatfl hessian`` is, and how long it may still take: its phases (top eigenvalues, smallest
eigenvalues, trace, density, per-layer blocks, measured quantities) each with the most Hessian-vector products it can spend under the
settings, so that the bar on a terminal shows an upper bound of the time left (products left at most, times the seconds a product has taken),
tightened at the end of every phase to what is really left.

The bounds are those the estimators enforce: Lanczos at most ``20 * basis`` products (the basis ``max(4k, k + 32)``
vectors; the dense eigendecomposition, ``dim`` products, when the basis would not be smaller than the operator),
power iteration ``max_iter`` per eigenvalue, a trace ``--trace-hvps``, the density ``steps x starts``, each per-layer
block its size (a dense block) or its own Lanczos and trace budgets, a measured quantity its own bound
(:attr:`~flatfl.analysis.estimators.quantities.Quantity.max_products`); each eigenvalue's explicit residual one more.
An estimator registered from outside flatfl has no known bound: the bar then counts products without a total."""
from __future__ import annotations

from ..estimators.quantities import quantity
from ..estimators.registry import estimator
from .hessian_settings import HessianSettings

__all__ = ["lanczos_bound", "phase_bounds", "PhasedProgress"]

#: the built-in estimators whose budgets are known, by kind
_KNOWN = {"eigenvalues": ("lanczos", "power"), "trace": ("hutchpp", "hutchinson", "pyhessian")}


def lanczos_bound(k: int, dim: int) -> int:
    """The most products :func:`flatfl.analysis.estimators.eigen.top_eigenvalues` spends on the top ``k`` of a ``dim``-sized
    operator with its defaults."""
    m = max(4 * k, k + 32)
    return int(dim) if m + 1 > dim else 20 * m


def _eigen_bound(method: str, k: int, dim: int, exact_residuals: bool) -> int | None:
    """The most products the eigenvalue estimator ``method`` spends on ``k`` eigenvalues (None: not known)."""
    if method == "lanczos":
        bound = lanczos_bound(k, dim)
    elif method == "power":
        bound = int(estimator("eigenvalues", "power").defaults.get("max_iter", 100)) * k
    else:
        return None
    return bound + (k if exact_residuals else 0)


def phase_bounds(s: HessianSettings, dim: int, blocks: list[int] | None = None) -> list[tuple[str, int | None]]:
    """``(phase, most products)`` for each phase the settings run, in order (None: not known). ``blocks``: the
    per-layer blocks' sizes."""
    phases: list[tuple[str, int | None]] = []
    if s.top > 0:
        phases.append(("top eigenvalues", _eigen_bound(s.method, s.top, dim, s.exact_residuals)))
    if s.smallest > 0:  # by the method when it finds them, else by Lanczos (HessianSettings.smallest_method)
        phases.append(("smallest eigenvalues", _eigen_bound(s.smallest_method, s.smallest, dim, s.exact_residuals)))
    if s.trace:
        phases.append(("trace", s.trace_hvps if s.resolved_trace_method in _KNOWN["trace"] else None))
    if s.density:
        phases.append(("density", min(s.density_steps, dim) * s.density_starts))
    if s.per_layer:
        for i, size in enumerate(blocks or []):
            dense = size <= s.trace_hvps
            bound = size if dense else lanczos_bound(min(s.per_layer_top, size), size) + s.trace_hvps
            phases.append((f"per-layer block {i + 1}/{len(blocks)}", bound))
    for name in s.quantities:  # each registered quantity bounds its own products
        entry = quantity(name)
        phases.append((entry.title, entry.bound(s, dim)))
    return phases


class PhasedProgress:
    """A tqdm ``bar`` counting products (``update``), whose total is the products left at most: the bounds of the
    phases not begun plus, for the phase running, its bound (:func:`phase_bounds`). ``next_phase()`` at the start
    of each phase; without a known bound for every phase left the bar has no total (no time left is shown)."""

    def __init__(self, bar, phases: list[tuple[str, int | None]]) -> None:
        self.bar, self.phases, self.index = bar, phases, -1
        self.phase_start = 0

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def next_phase(self, name: str | None = None) -> None:
        """The next phase begins (``name``: its name's start, checked against the plan; phases of the plan that did
        not run are skipped over)."""
        self.index += 1
        while name is not None and self.index < len(self.phases) and not self.phases[self.index][0].startswith(name):
            self.index += 1
        left = self.phases[self.index:] if self.index < len(self.phases) else []
        bounds = [b for _, b in left]
        done = self.bar.n
        self.bar.total = None if not left or None in bounds else done + sum(bounds)
        if left:
            self.bar.set_description(f"{left[0][0]} (time left: at most)", refresh=False)
        self.bar.refresh()
