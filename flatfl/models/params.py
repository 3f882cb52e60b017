"""Flat views of a model's parameters: the vectors FL algorithms reason about (theta, h_i, c_i, ...)."""
from __future__ import annotations

import torch
from torch import nn


class ParamLayout:
    """The shapes of a model's trainable parameters, to move between a flat vector and per-tensor views."""

    def __init__(self, model: nn.Module):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.dim = sum(self.numels)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into ``flat`` (no copy)."""
        return [t.view(s) for t, s in zip(torch.split(flat, self.numels), self.shapes)]

    def get(self) -> torch.Tensor:
        """The model's parameters as a new flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def set(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the model's parameters."""
        torch._foreach_copy_(self.params, self.views(flat.to(self.params[0].device)))

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient, created as zeros where backward left none."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    @torch.no_grad()
    def add_to_grads(self, flat: torch.Tensor, alpha: float = 1.0) -> None:
        """grad += alpha * flat."""
        torch._foreach_add_(self.grads(), self.views(flat), alpha=alpha)

    @torch.no_grad()
    def add_params_to_grads(self, alpha: float) -> None:
        """grad += alpha * theta (a proximal or quadratic term's gradient)."""
        torch._foreach_add_(self.grads(), self.params, alpha=alpha)


def float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that are averaged across clients (BatchNorm running statistics)."""
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}
