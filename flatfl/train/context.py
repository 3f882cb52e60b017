"""What algorithms and regularizers see while a client trains.

* :class:`RoundContext` - one per round: the round index, learning rate, the model the server sent (flat vector
  and, built on first use, a frozen copy of the network).
* :class:`ClientContext` - one per participating client per round: its data, sizes, label counts, state.
* :class:`Cohort` - the participants that train together (N of them; N = 1 is one at a time): the stacked network
  and its (N, dim) parameter layout.
* :class:`StepContext` - one per local step (and per SAM pass): the clients' batches (M, B, ...), their logits, and
  a scratch dict where pieces leave what later pieces need (teacher outputs, projection features).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class RoundContext:
    """One round as algorithms and regularizers see it. ``build_model``: a function of no argument that returns
    the frozen copy of the network the server sent (:attr:`global_model` calls it once, on first use; a round
    whose pieces never ask for that copy never builds it). Without one, :attr:`global_model` is refused."""
    index: int  # 0-based index of this round
    lr: float
    global_params: torch.Tensor  # theta^t, flat
    build_model: Callable[[], nn.Module] | None = field(repr=False, default=None)
    participants: tuple[int, ...] = ()  # the clients sampled this round (every rank's, in order)
    _global_model: nn.Module | None = field(repr=False, default=None)

    _trainable: nn.Module | None = field(repr=False, default=None)

    @property
    def global_model(self) -> nn.Module:
        """A frozen copy of the network the server sent this round (eval mode, no gradients)."""
        if self._global_model is None:
            if self.build_model is None:
                raise TypeError("RoundContext(..., build_model=None): this round has no network to copy")
            self._global_model = self.build_model()
        return self._global_model

    @property
    def trainable_global_model(self) -> nn.Module:
        """A copy of the network the server sent this round in training mode, with gradients (MimeLite's
        full-batch gradient at theta^t). Its BatchNorm statistics move when it runs; the server's do not."""
        if self._trainable is None:
            m = copy.deepcopy(self.global_model)
            m.train()
            for p in m.parameters():
                p.requires_grad_(True)
            self._trainable = m
        return self._trainable


@dataclass
class ClientContext:
    """One participating client in one round: its data, sizes and state (what per-client bookkeeping reads)."""
    client_id: int
    round: RoundContext
    x: torch.Tensor  # this client's training inputs, normalised float, on the device
    y: torch.Tensor
    num_samples: int
    weight: float  # w_i = n_i / mean(n) (FedDyn code)
    label_counts: torch.Tensor  # (C,) over the client's whole training set
    steps: int  # K the update divides by: E * ceil(n_i / B), or see Algorithm.local_step_counts
    lr: float
    generator: torch.Generator  # the client's random stream for this round (batch order, augmentation)
    rng_state: torch.Tensor | None = None  # torch's global CPU generator state for the client's in-model draws
    extras: dict[str, Any] = field(default_factory=dict)  # per-client scratch of algorithms/regularizers

    @property
    def global_params(self) -> torch.Tensor:
        return self.round.global_params


@dataclass
class Cohort:
    """The clients of a round that train together: N :class:`ClientContext` and one channel-stacked network
    (:mod:`flatfl.models.stacking`) whose k-th block is client k's model. Sequential training is N = 1."""
    clients: list[ClientContext]
    round: RoundContext
    network: nn.Module  # the stacked working network (the model itself when N = 1)
    layout: Any  # flatfl.models.stacking.StackedLayout
    lr: float
    extras: dict[str, Any] = field(default_factory=dict)  # scratch of algorithms/regularizers for this cohort

    @property
    def n(self) -> int:
        return len(self.clients)

    @property
    def global_params(self) -> torch.Tensor:
        return self.round.global_params

    @property
    def device(self) -> torch.device:
        return self.global_params.device

    def stack(self, key: str) -> torch.Tensor:
        """The clients' ``extras[key]`` (tensors or numbers) stacked into one (N, ...) tensor, built once."""
        cached = self.extras.get(("stack", key))
        if cached is None:
            values = [c.extras[key] for c in self.clients]
            if isinstance(values[0], torch.Tensor):
                cached = torch.stack(values)
            else:
                cached = self.numbers(values)
            self.extras[("stack", key)] = cached
        return cached

    def numbers(self, values) -> torch.Tensor:
        """One number per client as an (N,) float tensor on the device."""
        return torch.tensor([float(v) for v in values], device=self.device, dtype=torch.float64)


@dataclass
class StepContext:
    """One local step (and SAM pass) of a cohort: ``x`` (M, B, ...) and ``y`` (M, B) for the M clients in ``rows``
    (indices into ``cohort.clients``; None = all N, the usual case; fewer when clients of unequal sizes take
    unequal batches or steps). ``logits`` (M, B, K) once the data loss ran."""
    cohort: Cohort
    x: torch.Tensor
    y: torch.Tensor
    rows: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def clients(self) -> list[ClientContext]:
        if self.rows is None:
            return self.cohort.clients
        return [self.cohort.clients[i] for i in self.rows.tolist()]

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of an (N, ...) per-client tensor that this step trains."""
        return t if self.rows is None else t[self.rows]

    def single(self) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """(network, x, y) of a one-client step, for pieces that train one client at a time."""
        if self.cohort.n != 1:
            raise RuntimeError("a one-client piece ran in a cohort of several clients")
        return self.cohort.network, self.x[0], self.y[0]

    def model(self, x: torch.Tensor) -> torch.Tensor:
        """The working networks of this step's clients on their inputs: (M, B, ...) -> (M, B, K)."""
        return self._run(x, "forward")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The working networks' ``features``: (M, B, ...) -> (M, B, F)."""
        return self._run(x, "features")

    def _run(self, x: torch.Tensor, method: str) -> torch.Tensor:
        """``method`` of the stacked network for this step's clients, on their inputs stacked and split back."""
        from ..models.stacking import run_rows, stack_inputs, unstack_outputs

        net, xs = self.cohort.network, stack_inputs(x)
        if self.rows is None:
            out = net(xs) if method == "forward" else getattr(net, method)(xs)
        else:
            out = run_rows(net, self.cohort.layout, self.rows, xs, method)
        return unstack_outputs(out, x.shape[0])


@contextlib.contextmanager
def client_rng(cctx: ClientContext):
    """A context in which torch's global CPU generator is client ``cctx``'s in-model stream (restored after)."""
    outer = torch.get_rng_state()
    torch.set_rng_state(cctx.rng_state)
    try:
        yield
    finally:
        cctx.rng_state = torch.get_rng_state()
        torch.set_rng_state(outer)


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
