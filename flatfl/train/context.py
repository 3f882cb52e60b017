"""What algorithms and regularizers see while a client trains.

* :class:`RoundContext` - one per round: the round index, learning rate, the model the server sent (flat vector
  and, built on first use, a frozen copy of the network).
* :class:`ClientContext` - one per participating client per round: its data, sizes, label counts, state.
* :class:`StepContext` - one per local step (and per SAM pass): the batch, the logits, and a scratch dict where
  pieces leave what later pieces need (captured activations, projection features).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class RoundContext:
    index: int  # 0-based index of this round
    lr: float
    global_params: torch.Tensor  # theta^t, flat
    _build_model: Callable[[], nn.Module] = field(repr=False, default=None)
    _global_model: nn.Module | None = field(repr=False, default=None)

    @property
    def global_model(self) -> nn.Module:
        """A frozen copy of the network the server sent this round (eval mode, no gradients)."""
        if self._global_model is None:
            self._global_model = self._build_model()
        return self._global_model


@dataclass
class ClientContext:
    client_id: int
    round: RoundContext
    model: nn.Module  # the local model being trained
    x: torch.Tensor  # this client's training inputs, normalised float, on the device
    y: torch.Tensor
    num_samples: int
    weight: float  # w_i = n_i / mean(n) (FedDyn code)
    label_counts: torch.Tensor  # (C,) over the client's whole training set
    steps: int  # K the update divides by: E * ceil(n_i / B), or see Algorithm.local_step_counts
    lr: float
    generator: torch.Generator  # the client's random stream for this round
    extras: dict[str, Any] = field(default_factory=dict)  # per-client scratch of algorithms/regularizers

    @property
    def global_params(self) -> torch.Tensor:
        return self.round.global_params


@dataclass
class StepContext:
    client: ClientContext
    x: torch.Tensor
    y: torch.Tensor
    logits: torch.Tensor | None = None
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        return self.client.model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy in eval mode with no gradients and no hooks (hooks of the working model, such as MAN's
    activation capture, must not fire when a teacher runs)."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
        mod._backward_hooks.clear()
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m
