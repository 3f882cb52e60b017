"""Stochastic depth (Huang et al. ECCV 2016) as a local regularizer (FedAlign baseline; docs/update-rules.md §19).

:meth:`StochDepth.prepare_model` sets each residual block's survival probability linearly from 1.0 (first block) to
``--survival-last`` (last block) with :func:`flatfl.models.set_stochastic_depth`. The blocks do the rest: in
training one Bernoulli(p) draw per block and forward pass keeps or drops the residual branch (torch's global
generator, seeded by the engine per client and round); in eval mode a block computes relu(shortcut + p * branch), so
the server model is evaluated (and its Hessian measured) as the expected network. The survival values are recorded
in the model's spec, so a checkpoint rebuilds the same evaluation network. The data loss is the plain CE.

A wrapped ResNet (MOON's projection-head model) gets the schedule on its inner network.

Clients trained together (a channel-stacked network, ``--parallel-clients``): at the first gated block of each
forward pass every client draws all its blocks' keep/drop values from its own stream (:func:`client_rng`), in block
order, as it does alone; they reach the device as one (blocks, M) tensor, and each block multiplies its branch by
the clients' 0/1 gates (:meth:`flatfl.models.resnet.ResidualBlock._gated`; a block kept or dropped by all needs no
mask). So the cohort gets each client's numbers, and a step costs about one client's kernels. Every network
:func:`~flatfl.models.stacking.stack_network` builds gets, through its stacking hook (:func:`guard_gated_blocks`),
gated blocks that refuse to run in training mode until :meth:`StochDepth.attach` gives them the cohort's draws: one
draw for the whole stacked network would give every client the same blocks.

``--survival-last``: default 0.9, the FedAlign paper's rho_L (Sec. 3.2); the FedAlign code's argparse default
``stoch_depth`` is 0.5. Models without residual blocks raise :class:`ConfigError`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...models.resnet import BlockGate, ResidualBlock, set_stochastic_depth
from ...models.stacking import on_stack, stacked_clients
from ..components import REGULARIZERS, HParam
from ..context import Cohort, StepContext, client_rng
from .regularizer import Regularizer


@on_stack
def guard_gated_blocks(stacked: nn.Module, n: int) -> None:
    """The stacking hook: each gated block of a stacked network refuses to train until :meth:`StochDepth.attach`
    supplies the clients' own draws."""
    for block in stacked.modules():
        if isinstance(block, ResidualBlock) and block.survival < 1.0:
            block.gate_source = _no_gate_source


def _no_gate_source(block: nn.Module):
    raise RuntimeError("a stacked network's stochastic-depth block ran in training mode without per-client draws "
                       "(only --reg stochdepth supplies them)")


@REGULARIZERS.register
class StochDepth(Regularizer):
    name, display_name = "stochdepth", "StochDepth"
    summary = "stochastic depth: residual blocks dropped at random, survival 1.0 -> --survival-last"
    hparams = (HParam("survival_last", 0.9, "stochastic depth: survival probability of the last residual block "
                      "(linear from 1.0 at the first)", check="unit"),)

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._step: StepContext | None = None  # the step whose forward passes run now (stacked networks)
        self._idle: list[list[bool]] | None = None  # per block and client: dropped in all of the step's passes

    @classmethod
    def prepare_model(cls, model: nn.Module, hp: dict[str, Any]) -> nn.Module:
        # the ResNet itself, or the one inside a wrapper (MOON's projection-head model)
        resnet = next((m for m in model.modules() if callable(getattr(m, "residual_blocks", None))), model)
        set_stochastic_depth(resnet, hp["survival_last"])  # ConfigError for models without residual blocks
        return model

    def attach(self, model: nn.Module) -> None:
        if stacked_clients(model) == 1:
            return  # one client: the blocks draw from torch's global generator, seeded per client and round
        named = [(name, b) for name, b in model.named_modules() if isinstance(b, ResidualBlock) and b.survival < 1.0]
        # each block's branch parameters by name: a step of some clients only runs the network on their gathered
        # parameters (flatfl.models.stacking.run_rows), so the module's tensors are not the layout's then
        branches = [[f"{name}.{p}" for p, _ in b.named_parameters() if not p.startswith("shortcut")]
                    for name, b in named]
        source = _CohortGates([b for _, b in named], branches, self)
        for _, block in named:
            block.gate_source = source

    def forward(self, step: StepContext) -> torch.Tensor:
        self._step = step  # whose streams the stacked network's draws come from, until the next step
        self._idle = None
        return super().forward(step)

    def end_cohort(self, cohort: Cohort) -> None:
        self._step = None
        cohort.layout.live.clear()


class _CohortGates:
    """The keep/drop draws of a stacked network's gated blocks, one set per forward pass: drawn at its first gated
    block for every client of the step, from the client's own stream, in block order (the order a client alone
    draws them), and handed to the blocks one by one.

    A client that drops a branch in every forward pass of a step leaves its branch parameters without a gradient
    when it trains alone, and torch's SGD step then skips them (no weight decay, no momentum); those rows are marked
    in the layout's ``live`` so the cohort's SGD step skips them too."""

    def __init__(self, blocks: list[ResidualBlock], branches: list[list[str]], reg: StochDepth):
        self.blocks = blocks
        self.branches = branches  # per block: the names of its branch's parameters in the network
        self.reg = reg
        self.pending: list[BlockGate] = []
        self.branch_params: list[list[int]] | None = None  # per block: its branch's indices in the layout
        self.thresholds: list[float] | None = None

    def __call__(self, block: ResidualBlock) -> BlockGate:
        if not self.pending:
            self.pending = self._draw(block)
        gate = self.pending.pop(0)
        if self.blocks[len(self.blocks) - len(self.pending) - 1] is not block:
            raise RuntimeError("stochastic depth: the stacked network ran its blocks out of order")
        return gate

    def _draw(self, first: ResidualBlock) -> list[BlockGate]:
        step = self.reg._step
        if step is None or first is not self.blocks[0]:
            raise RuntimeError("stochastic depth: a stacked network ran in training mode outside a local step")
        layout = step.cohort.layout
        if self.thresholds is None:  # each survival as the draws' dtype holds it: rand() < p compares there
            self.thresholds = torch.tensor([b.survival for b in self.blocks]).tolist()
        keeps = []
        for c in step.clients:
            with client_rng(c):  # one draw per block, in block order: the values a client alone draws one by one
                draws = torch.rand(len(self.blocks)).tolist()
            keeps.append([u < p for u, p in zip(draws, self.thresholds)])
        per_block = [list(row) for row in zip(*keeps)]  # per block: each of the step's clients' keep
        # idle (N rows): dropped in every forward pass of this step so far, by a client that steps now
        rows = list(range(layout.n)) if step.rows is None else step.rows.tolist()
        idle = self.reg._idle
        if idle is None:
            idle = [[k in rows for k in range(layout.n)] for _ in self.blocks]
        for i, row in enumerate(per_block):
            for j, k in enumerate(rows):
                idle[i][k] = idle[i][k] and not row[j]
        self.reg._idle = idle
        param = next(first.parameters())
        host = torch.tensor([row + [not v for v in row_idle] for row, row_idle in zip(per_block, idle)],
                            dtype=param.dtype)
        both = host.to(param.device)  # (blocks, M + N): the gates and the live rows, one copy per forward
        m = len(rows)
        dropped = [[k for k, keep in enumerate(row) if not keep] for row in per_block]
        flat = torch.tensor([k for d in dropped for k in d], dtype=torch.long).to(param.device)
        self._mark_live(layout, both[:, m:], [any(r) for r in idle])
        gates, start = [], 0
        for i, d in enumerate(dropped):
            gates.append(BlockGate(both[i, :m], flat[start:start + len(d)], not d, len(d) == m))
            start += len(d)
        return gates

    def _mark_live(self, layout, live: torch.Tensor, any_idle: list[bool]) -> None:
        """Set ``layout.live`` of each block's branch parameters: the block's row of ``live`` where some client
        that steps dropped it in every pass so far, none (every row live) otherwise."""
        if self.branch_params is None:
            index = {name: k for k, name in enumerate(layout.names)}
            self.branch_params = [[index[name] for name in names] for names in self.branches]
        for i, ks in enumerate(self.branch_params):
            row = live[i] if any_idle[i] else None  # one view per block: its parameters share one mask
            for k in ks:
                if row is not None:
                    layout.live[k] = row
                else:
                    layout.live.pop(k, None)
