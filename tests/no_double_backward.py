"""A custom autograd Function torch cannot differentiate twice: ``Square``'s backward goes through a Function without
a backward of its own (``TwiceNoBackward``), so torch fails at the second backward pass. ``squared_logits`` is a
``loss(model, batch)`` through it, for ``flatfl hessian --loss tests/no_double_backward.py:squared_logits``."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TwiceNoBackward(torch.autograd.Function):
    """2 x g, with no backward of its own: what a hand-written backward calls."""

    @staticmethod
    def forward(ctx, x, g):
        return 2 * x * g


class Square(torch.autograd.Function):
    """x^2 whose backward torch cannot differentiate again (it goes through TwiceNoBackward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return TwiceNoBackward.apply(x, g)


def squared_logits(model, batch):
    """Cross-entropy of the squared logits, the square taken by :class:`Square`."""
    inputs, targets = batch
    return F.cross_entropy(Square.apply(model(inputs)), targets)
