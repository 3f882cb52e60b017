"""The independent truth of the Hessian tests that need one: the dense Hessian of a model's mean cross-entropy, and
the small trained networks it is taken of (:func:`train_full_batch`)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def dense_hessian(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """The symmetrised dense Hessian of mean cross-entropy(model(x), y) with respect to the model's parameters, in
    their registration order (torch.autograd.functional.hessian over the flat parameter vector)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            params[n] = flat[i:i + k].view(s)
            i += k
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    h = torch.autograd.functional.hessian(loss, theta).numpy()
    return (h + h.T) / 2


def train_full_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> torch.nn.Module:
    """``model`` after ``steps`` full-batch SGD steps (rate ``lr``) on the mean cross-entropy of (x, y), in eval
    mode: a trained network, whose spectrum (an outlier or two over a bulk, both signs) the tests measure."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()
