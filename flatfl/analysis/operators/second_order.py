"""Operations without a second derivative, named in one line (docs/reliability.md, docs/analysis.md).

A Hessian-vector product differentiates the loss twice. Two kinds of operation cannot be differentiated twice:

* a ``torch.autograd.Function`` whose ``backward`` is marked ``@once_differentiable``: torch computes its backward
  without a graph, so the first-order gradient silently stops depending on the parameters before it, and the
  Hessian would come out with rows of zeros. :func:`check_loss_graph` walks a loss's graph before any product and
  names such a Function;
* an operation whose backward has no derivative in torch (``cdist``'s ``_cdist_backward``, ...): torch raises
  ``the derivative for 'X' is not implemented``; :func:`second_order_errors` turns that into one line naming ``X``.

* a ``torch.autograd.Function`` whose ``backward`` is made of operations that have no backward themselves (another
  Function without one): torch fails at the second backward pass; :func:`double_backward_failure` names the custom
  Functions of the first-order gradient's graph.

Each message suggests finite-difference products (:class:`flatfl.analysis.operators.products.FiniteDifference`), which need
first derivatives only. Forward-over-reverse products (``torch.func``) also need every ``autograd.Function`` to support ``torch.func``
(``setup_context``, a ``jvp``); :func:`needs_double_backward` recognises that failure, on which ``products="auto"``
falls back to double backward.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from ...errors import ConfigError

__all__ = ["SecondDerivativeError", "check_loss_graph", "second_order_errors", "needs_double_backward",
           "custom_functions", "double_backward_failure", "graph_nodes"]

_HOW = ("a Hessian needs every operation between the parameters and the loss differentiable twice; replace it with "
        "one torch can differentiate twice, or use finite-difference products, which need first derivatives only "
        "(--products finite-difference; products='finite-difference')")


class SecondDerivativeError(ConfigError):
    """The loss goes through an operation without a second derivative (the message names it)."""


def graph_nodes(roots) -> Iterator:
    """Every node of the autograd graph behind the tensors ``roots`` (depth first from the last root), each once."""
    seen, stack = set(), [t.grad_fn for t in roots if isinstance(t, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(f for f, _ in node.next_functions)


def _function_classes(root: torch.Tensor) -> list[type]:
    """The ``torch.autograd.Function`` classes met in ``root``'s graph, in the order met, each once."""
    found = []
    for node in graph_nodes([root]):
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and cls not in found:
            found.append(cls)
    return found


def custom_functions(loss: torch.Tensor) -> list[tuple[str, bool]]:
    """``(name, once_differentiable)`` of every ``torch.autograd.Function`` in ``loss``'s graph, in the order met."""
    found = []
    for cls in _function_classes(loss):
        entry = (cls.__qualname__, hasattr(getattr(cls, "backward", None), "__wrapped__"))  # @once_differentiable
        if entry not in found:
            found.append(entry)
    return found


def check_loss_graph(loss: torch.Tensor) -> None:
    """A :class:`SecondDerivativeError` when ``loss`` goes through a Function marked ``@once_differentiable``."""
    once = [name for name, flag in custom_functions(loss) if flag]
    if once:
        raise SecondDerivativeError(
            f"the loss has no second derivative: it goes through torch.autograd.Function {once[0]!r}, whose backward "
            f"is marked @once_differentiable (torch cannot differentiate it again); {_HOW}; or give the Function a "
            "backward made of differentiable torch operations")


_NOT_IMPLEMENTED = re.compile(r"derivative for '?([\w.:]+)'? is not implemented")
_FORWARD_AD = re.compile(r"forward AD with '?([\w.:]+)'? that does not support it|"
                         r"autograd\.Function with functorch transforms|does not support forward.mode")


@contextlib.contextmanager
def second_order_errors():
    """Within the block, torch's "the derivative for 'X' is not implemented" is a :class:`SecondDerivativeError`
    naming ``X``."""
    try:
        yield
    except RuntimeError as e:  # NotImplementedError is a RuntimeError
        match = _NOT_IMPLEMENTED.search(str(e))
        if match is None:
            raise
        op = match.group(1)
        what = f" (the backward of '{op[:-len('_backward')].lstrip('_')}')" if op.endswith("_backward") else ""
        raise SecondDerivativeError(f"the loss has no second derivative: torch does not implement the derivative of "
                                    f"'{op}'{what}, an operation between the parameters and the loss; {_HOW}") from None


def double_backward_failure(error: RuntimeError, gradients) -> SecondDerivativeError | None:
    """The one line for ``error``, raised while differentiating the first-order ``gradients`` again, when their
    graph holds custom ``torch.autograd.Function`` nodes (the backward of a Function met in the forward pass): it
    names them, those without a backward of their own first. None when there is none (another failure)."""
    if isinstance(error, torch.OutOfMemoryError):
        return None
    found: list[tuple[str, bool]] = []
    for g in gradients:
        if isinstance(g, torch.Tensor) and g.grad_fn is not None:
            found += [f for f in _functions_with_backward(g) if f not in found]
    if not found:
        return None
    found.sort(key=lambda f: f[1])  # the Functions without a backward first
    names = ", ".join(repr(name) for name, _ in found[:3])
    detail = " ".join(str(error).split())[:160]
    return SecondDerivativeError(f"the loss has no second derivative: torch failed to differentiate the backward "
                                 f"pass again at torch.autograd.Function {names} ({detail}); {_HOW}")


def _functions_with_backward(g: torch.Tensor) -> list[tuple[str, bool]]:
    """``(name, has_backward)`` of the custom Functions in ``g``'s graph."""
    return [(cls.__qualname__, "backward" in vars(cls) or "vjp" in vars(cls)) for cls in _function_classes(g)]


def needs_double_backward(e: BaseException) -> bool:
    """True for a failure of forward-over-reverse products that double backward does not have (an
    ``autograd.Function`` without ``torch.func`` support, an operation without forward-mode derivatives)."""
    return isinstance(e, RuntimeError) and _FORWARD_AD.search(str(e)) is not None
