"""The algorithm interface: server state, client state, the local objective's terms, the aggregation.

An algorithm is a :class:`Algorithm` subclass registered under its name. The engine calls, every round::

    round_start(rctx)                      server prepares what it sends (theta^t is rctx.global_params)
    for each cohort of the sampled clients (N at a time, trained together; N = 1 is one at a time):
        start = client_start(cctx)         for each client i: the parameters it starts from (default theta^t)
        start_cohort(cohort)               work shared by the cohort (MOON's previous models)
        ... local steps, all clients at once: loss = regularizer.forward(step) + loss_terms(step), one value
            per client; backward of their sum; correct_gradient(step) adds the algorithm's gradient terms to
            each client's row; clip each row; optimizer step ...
        client_end(cctx, theta_i) -> ClientResult   for each client: update its state, say what it uploads
    aggregate(rctx, results) -> theta^{t+1}

Parameters travel as flat vectors (see :class:`flatfl.models.params.ParamLayout`); inside a step a cohort's
parameters and gradients are (N, dim) rows (:class:`flatfl.models.stacking.StackedLayout`,
``step.cohort.layout``), and per-client vectors computed in ``client_start`` are stacked with
``cohort.stack(key)``. State that must survive
``--resume`` is kept in ``self.server`` (name -> tensor) and ``self.clients`` (name -> (N, ...) tensor, one row per
client), which :meth:`state_dict` saves; subclasses declare them in :meth:`init_state`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError
from ..components import ALGORITHMS, Component
from ..context import ClientContext, Cohort, RoundContext, StepContext
from ...models.params import ParamLayout


@dataclass
class ClientResult:
    client_id: int
    num_samples: int
    params: torch.Tensor  # theta_i after local training, flat
    loss: float  # mean local training loss over the client's steps
    extras: dict[str, Any] = field(default_factory=dict)


class Algorithm(Component):
    kind: ClassVar[str] = "algorithm"
    #: how the "all clients' latest models" average is weighted (docs/update-rules.md section 0): by sample count for
    #: FedAvg/FedProx, uniformly for FedDyn, SCAFFOLD, FedDC, FedSpeed.
    all_model_weighting: ClassVar[str] = "samples"
    #: the local optimizer the algorithm is defined with (FedSAM, FedSpeed, MoFedSAM: "sam"; FedASAM: "asam"); None: the
    #: user's ``--local-opt``. See :meth:`local_optimizer`.
    local_opt: ClassVar[str | None] = None

    def __init__(self, hp: dict[str, Any], *, num_clients: int, client_sizes: np.ndarray, layout: ParamLayout,
                 device: torch.device, config: Any = None):
        self.hp = dict(hp)
        for k, v in hp.items():
            setattr(self, k, v)
        self.num_clients = num_clients
        self.client_sizes = np.asarray(client_sizes, dtype=np.int64)
        self.weights = self.client_sizes / self.client_sizes.mean()  # w_i = n_i / mean(n)
        self.layout = layout
        self.dim = layout.dim
        self.device = device
        self.config = config
        self.server: dict[str, torch.Tensor] = {}
        self.clients: dict[str, torch.Tensor] = {}
        self.init_state()

    # ----- state -----
    def init_state(self) -> None:
        """Create ``self.server`` / ``self.clients`` tensors. Default: no state."""

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, self.dim, device=self.device)

    def state_dict(self) -> dict:
        return {"server": {k: v.detach().cpu() for k, v in self.server.items()},
                "clients": {k: v.detach().cpu() for k, v in self.clients.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.get("server", {}).items():
            self.server[k] = v.to(self.device)
        for k, v in state.get("clients", {}).items():
            self.clients[k] = v.to(self.device)

    # ----- local optimizer -----
    @classmethod
    def local_optimizer(cls, requested: str) -> str:
        """The local optimizer to run: the user's ``--local-opt``, or the one the algorithm is defined with
        (``local_opt``), which replaces the default "sgd"; asking for a third one is an error."""
        if cls.local_opt is None or requested.lower() == cls.local_opt:
            return requested
        if requested.lower() != "sgd":
            raise ConfigError(f"--algo {cls.name} runs with --local-opt {cls.local_opt}, not {requested!r}")
        return cls.local_opt

    @classmethod
    def optimizer_settings(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """The settings the local optimizer resolves its hyper-parameters from: the user's, over this algorithm's
        own defaults for the flags it shares with the optimizer (FedSpeed's ``--rho`` defaults to 0.1, SAM's to
        0.05)."""
        return {**{hp.key: hp.default for hp in cls.hparams}, **settings}

    # ----- model -----
    @classmethod
    def wrap_model(cls, model: nn.Module, hp: dict[str, Any]) -> nn.Module:
        """Change the architecture if the algorithm needs to (MOON adds a projection head). Default: unchanged."""
        return model

    def attach(self, network: nn.Module) -> None:
        """Called once with each working network (the model; a network of stacked clients) before it trains: install
        hooks (MOON captures its projection). What is hooked is found by module name, so that the plain and the
        stacked network hook the same modules. Default: nothing."""

    # ----- the round -----
    def local_step_counts(self, num_samples: int, batch_size: int, epochs: int) -> tuple[int, int]:
        """(steps client i takes this round, the K its update divides by). Default: both K_i = E * ceil(n_i / B),
        the client's own epochs (docs/update-rules.md section 4). SCAFFOLD and FedDC offer the official scripts' rule
        (``--steps-rule mean``)."""
        k = epochs * math.ceil(num_samples / batch_size)
        return k, k

    def round_start(self, rctx: RoundContext) -> None:
        """Server-side work before clients train."""

    def client_start(self, cctx: ClientContext) -> torch.Tensor:
        """The parameters client i starts from. Default: what the server sent."""
        return cctx.global_params.clone()

    def start_cohort(self, cohort: Cohort) -> None:
        """Work for a cohort after its clients' ``client_start`` (the start parameters are loaded). Default: none."""

    def end_cohort(self, cohort: Cohort) -> None:
        """Called after a cohort's local training. Default: nothing."""

    def prepare_batch(self, step: StepContext) -> None:
        """Change a step's batches (M, B, ...) before the forward pass (FedRobust's input perturbation). Default:
        nothing."""

    def loss_terms(self, step: StepContext) -> torch.Tensor | None:
        """Data-dependent terms of each client's local objective, (M,), added to the regularized cross-entropy
        inside the loss closure (so SAM-type optimizers see them in both passes). Default: none."""
        return None

    def correct_gradient(self, step: StepContext) -> None:
        """Add parameter-dependent gradient terms (proximal, linear drift or control-variate terms) to each client's
        gradient row (``step.cohort.layout``), after backward and before clipping. Rows of clients that sit out the
        step may be changed too: their parameters do not move. Default: none."""

    def extra_weight_decay(self, cctx: ClientContext) -> float:
        """Weight decay added to the optimizer's (applied inside the step, after clipping). Default: 0."""
        return 0.0

    def client_end(self, cctx: ClientContext, params: torch.Tensor, loss: float) -> ClientResult:
        """Update client i's state from its new model and say what it uploads. Default: its parameters."""
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss)

    def aggregate(self, rctx: RoundContext, results: list[ClientResult]) -> torch.Tensor:
        """theta^{t+1}. Default: the sample-weighted mean of the participants' models (FedAvg)."""
        return weighted_mean([r.params for r in results], [r.num_samples for r in results])


def weighted_mean(vectors: list[torch.Tensor], weights) -> torch.Tensor:
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64) / float(np.sum(weights)), dtype=vectors[0].dtype,
                        device=vectors[0].device)
    return torch.einsum("k,kd->d", w, torch.stack(vectors))


def plain_mean(results: list[ClientResult]) -> torch.Tensor:
    """mean_{i in P_t} theta_i, unweighted (the FedDyn-family server average)."""
    return torch.stack([r.params for r in results]).mean(0)


def register(cls):
    return ALGORITHMS.register(cls)
