"""MOON: model-contrastive federated learning (Li et al. CVPR 2021), as in the official code
(``main.py::train_net_fedcon``, ``model.py::ModelFedCon``; docs/update-rules.md section 13).

Model: the network's encoder output h -> projection head [Linear(d, d), ReLU, Linear(d, 256)] -> z ->
classifier Linear(256, C). :meth:`Moon.wrap_model` builds it around any flatfl model (``features`` / ``classifier``
/ ``feature_dim``); the wrapped model keeps that interface, with ``features(x) = z``, so MAN, checkpoints and the
Hessian tools see an ordinary flatfl model. The head is part of the model's spec (``projection_head``), so a
checkpoint rebuilds it from :mod:`flatfl.models` alone.

Local objective of client i::

    CE + mu * CE( [cos(z, z_glob) / tau, cos(z, z_prev) / tau], target 0 )

z_glob from the frozen model the server sent this round, z_prev from the client's own previous local model (a
buffer of one); both without gradients. A client that never trained holds the initial weights as its previous
model (then z_prev = z_glob in round 1 and the term has zero gradient). The previous models live in
``self.clients["prev"]`` so they survive ``--resume``; they are evaluated with the server's buffers (BatchNorm
statistics) of the round. Clients trained together (a cohort) have their previous models stacked into one frozen
network (:mod:`flatfl.models.stacking`), built in :meth:`Moon.start_cohort`.

z is the projection the working model computed in the closure's own forward pass (captured by a forward hook on
the projection head, only in training mode); if that pass did not run the projection on this batch, z is computed
again from ``step.x``. Server: FedAvg (sample-weighted), as the MOON code does.

Defaults: tau = 0.5 (paper, code), mu = 1 (paper for CIFAR-100 / Tiny-ImageNet, FedAlign's choice; the code's
CIFAR-10 README example uses 5). The MOON code's local optimizer (momentum 0.9, wd 1e-5) is set with the run's
``--momentum`` / ``--weight-decay``.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ...models.projection import ProjectionHeadModel
from ...models.stacking import StackedLayout, run_rows, stack_inputs, stacked_copy, unstack_outputs
from ..components import HParam
from ..regularizers.regularizer import per_client_cross_entropy
from .algorithm import Algorithm, register

MoonModel = ProjectionHeadModel  # the network MOON trains (flatfl.models.projection)




def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """mean_b -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) ), one client."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], 1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def clients_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Each client's mean_b -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) ):
    (M, B, d) projections -> (M,)."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], -1) / tau
    m, b = logits.shape[:2]
    return per_client_cross_entropy(logits, torch.zeros(m, b, dtype=torch.long, device=z.device))


MAX_PROJ_DIM = 65_536  # --moon-proj-dim: the projection head's weights and each batch's projections scale with it


@register
class Moon(Algorithm):
    name, display_name = "moon", "MOON"
    summary = "MOON: CE + mu * model-contrastive loss (projection head; previous local model as negative)"
    hparams = (
        HParam("mu", 1.0, "MOON contrastive weight mu (paper: 1 on CIFAR-100/Tiny-ImageNet, 5 in the code's "
               "CIFAR-10 example)", flag="moon-mu", check="nonnegative"),
        HParam("tau", 0.5, "MOON temperature tau (paper, code)", flag="moon-tau", check="positive"),
        HParam("proj_dim", 256, "output size of MOON's projection head (code: 256)", flag="moon-proj-dim",
               check="positive", most=MAX_PROJ_DIM),
    )

    @classmethod
    def wrap_model(cls, model, hp):
        return model if isinstance(model, ProjectionHeadModel) else ProjectionHeadModel(model, int(hp["proj_dim"]))

    def __init__(self, hp, **kwargs):
        super().__init__(hp, **kwargs)
        self._captured: list[torch.Tensor] = []  # z of the current closure's forward pass (at most one)
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # the working networks carrying the capture hook

    def init_state(self) -> None:
        self.clients["prev"] = self.layout.get().to(self.device).unsqueeze(0).repeat(self.num_clients, 1)

    def attach(self, network: nn.Module) -> None:
        self._hook(network)

    def _hook(self, model: nn.Module) -> None:
        """Capture the projection output z of a working network's first training forward per closure."""
        if model in self._hooked:
            return
        captured = self._captured

        def capture(module, inputs, output):
            if module.training and torch.is_grad_enabled() and not captured:
                captured.append(output)

        model.projection.register_forward_hook(capture)
        self._hooked.add(model)

    def start_cohort(self, cohort):
        """Build the clients' previous local models as one frozen network (the working network is hooked since
        :meth:`attach`)."""
        self._hook(cohort.network)
        self._captured.clear()
        prev_rows = torch.stack([self.clients["prev"][c.client_id] for c in cohort.clients])
        network = stacked_copy(cohort.round.global_model, cohort.n)
        for p in network.parameters():
            p.requires_grad_(False)
        layout = StackedLayout(network, cohort.n, self.layout)
        layout.set(prev_rows)
        cohort.extras["moon_prev"] = network
        cohort.extras["moon_prev_layout"] = layout

    def end_cohort(self, cohort):
        cohort.extras.pop("moon_prev", None)
        cohort.extras.pop("moon_prev_layout", None)

    def _previous_features(self, step) -> torch.Tensor:
        """z_prev of each client of the step: (M, B, d)."""
        net = step.cohort.extras["moon_prev"]
        xs = stack_inputs(step.x)
        if step.rows is None:
            z = net.features(xs)
        else:
            z = run_rows(net, step.cohort.extras["moon_prev_layout"], step.rows, xs, "features")
        return unstack_outputs(z, step.m)

    def loss_terms(self, step):
        m, b = step.y.shape
        z = self._captured[0] if self._captured else None
        self._captured.clear()
        if z is None or z.shape[0] != b:
            z = step.features(step.x)
        else:
            z = unstack_outputs(z, m)
        cached = step.scratch.get("moon_targets")
        if cached is None or cached[0] is not step.x:
            with torch.no_grad():
                z_glob = step.cohort.round.global_model.features(step.x.reshape(m * b, *step.x.shape[2:]))
                z_glob = z_glob.view(m, b, -1)
                z_prev = self._previous_features(step)
            cached = step.scratch["moon_targets"] = (step.x, z_glob, z_prev)
        if m == 1:  # one client's batch: the MOON code's formula, whose sums the batched one orders otherwise
            return self.mu * model_contrastive_loss(z[0], cached[1][0], cached[2][0], self.tau).reshape(1)
        return self.mu * clients_contrastive_loss(z, cached[1], cached[2], self.tau)

    def client_end(self, cctx, params, loss):
        self.clients["prev"][cctx.client_id] = params
        return super().client_end(cctx, params, loss)
