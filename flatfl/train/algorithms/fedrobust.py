"""FedRobust (Reisizadeh et al. NeurIPS 2020, "Robust Federated Learning: The Case of Affine Distribution Shifts";
docs/update-rules.md section 12). **Not verified against code**: no official repository was found; every default is
unverified.

Each client i holds a private affine perturbation (Lambda_i, delta_i), initialised to (I, 0), applied to its
(normalised) inputs, x -> Lambda_i x + delta_i. The problem is::

    min_theta max_{Lambda_i, delta_i} mean_i [ E l(f_theta(Lambda_i x + delta_i), y)
                                               - lam (||Lambda_i - I||_F^2 + ||delta_i||^2) ]
    subject to ||Lambda_i - I||_F <= eps1,  ||delta_i|| <= eps2

Local: stochastic gradient descent-ascent. Each step takes one gradient of the local objective at the current
(theta, Lambda_i, delta_i); theta descends along it (clipping, weight decay and the local optimizer as usual),
(Lambda_i, delta_i) ascend with rate ``--robust-lr`` and are projected back onto the balls. The input gradient
G = dL/dx' of the batch gives the ascent directions: dL/dLambda = sum_b G_b x_b^T, dL/ddelta = sum_b G_b. With a
SAM-type optimizer the ascent uses the first pass's gradient (at theta, not theta + eps).

Server: averages theta as FedAvg; (Lambda_i, delta_i) stay with the client, persistent across rounds.

``--robust-affine full`` is the paper's Lambda_i in R^{d x d} on the flattened input (d = C H W); it needs
N d^2 numbers of state (3.8 GB for 100 CIFAR clients), so runs above 2^28 are refused. ``channel`` restricts
Lambda_i to a C x C mixing of each pixel's channels (delta_i stays per element), for large images.

Defaults (unverified): eps1 = 0.4, eps2 = 1 (a summary of the paper's CIFAR-10 setting), ascent rate 0.1, no
Lagrangian penalty (lam = 0: the constrained variant).
"""
from __future__ import annotations

import torch

from ...errors import ConfigError
from ..components import HParam
from .algorithm import Algorithm, register

FULL_STATE_LIMIT = 1 << 28  # numbers of Lambda state for --robust-affine full


def project_ball(v: torch.Tensor, radius: float) -> torch.Tensor:
    """The point of the ball ||v|| <= radius (Frobenius norm for matrices) closest to v: v * min(1, radius / ||v||),
    the factor in float64 on v's device (no host synchronisation)."""
    norm = torch.linalg.vector_norm(v).double()
    return v * torch.clamp(torch.full_like(norm, radius) / norm, max=1.0).to(v.dtype)


@register
class FedRobust(Algorithm):
    name, display_name = "fedrobust", "FedRobust"
    summary = "FedRobust: descent on theta, ascent on each client's affine input shift (Lambda_i, delta_i)"
    hparams = (
        HParam("ascent_lr", 0.1, "ascent rate on (Lambda_i, delta_i) (unverified)", flag="robust-lr",
               check="nonnegative"),
        HParam("eps_lambda", 0.4, "radius eps1 of ||Lambda_i - I||_F (unverified)", flag="robust-eps-lambda",
               check="nonnegative"),
        HParam("eps_delta", 1.0, "radius eps2 of ||delta_i|| (unverified)", flag="robust-eps-delta",
               check="nonnegative"),
        HParam("penalty", 0.0, "Lagrangian weight lam of ||Lambda_i - I||_F^2 + ||delta_i||^2 in the ascent "
               "(0: constraints only; unverified)", flag="robust-penalty", check="nonnegative"),
        HParam("affine", "full", "Lambda_i acts on the flattened input ('full', the paper's) or mixes each "
               "pixel's channels ('channel')", flag="robust-affine", choices=("full", "channel")),
    )

    # ----- state: created when the input shape is first seen -----
    def _ensure_state(self, input_shape: torch.Size) -> None:
        if "Lambda" in self.clients:
            return
        channels, d = input_shape[0], input_shape.numel()
        side = d if self.affine == "full" else channels
        if self.num_clients * side * side > FULL_STATE_LIMIT:
            raise ConfigError(f"FedRobust's full affine shift needs {self.num_clients} x {d}^2 numbers of client "
                              "state: use --robust-affine channel")
        eye = torch.eye(side, device=self.device)
        self.clients["Lambda"] = eye.expand(self.num_clients, side, side).clone()
        self.clients["delta"] = torch.zeros(self.num_clients, d, device=self.device)

    def shift(self, lam: torch.Tensor, delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Lambda x + delta on a batch x of shape (B, C, H, W) (or any (B, ...))."""
        if self.affine == "full":
            return (x.flatten(1) @ lam.T + delta).view_as(x)
        return torch.einsum("cd,bd...->bc...", lam, x) + delta.view(x.shape[1:])

    def shift_gradients(self, g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dL/dLambda, dL/ddelta) from the input gradient g = dL/dx' and the clean batch x."""
        if self.affine == "full":
            return g.flatten(1).T @ x.flatten(1), g.flatten(1).sum(0)
        return torch.einsum("bc...,bd...->cd", g, x), g.flatten(1).sum(0)

    # ----- local steps -----
    def client_start(self, cctx):
        self._ensure_state(cctx.x.shape[1:])
        return super().client_start(cctx)

    def prepare_batch(self, step) -> None:
        clean = step.x
        with torch.no_grad():
            shifted = torch.stack([self.shift(self.clients["Lambda"][c.client_id], self.clients["delta"][c.client_id],
                                              clean[k]) for k, c in enumerate(step.clients)])
        shifted.requires_grad_(True)
        record = {"x": clean, "grad": None}

        def keep_first(grad):  # SAM's second pass must not replace the gradient at theta
            if record["grad"] is None:
                record["grad"] = grad.detach().clone()

        shifted.register_hook(keep_first)
        step.x = shifted
        step.scratch["robust_record"] = record

    @torch.no_grad()
    def correct_gradient(self, step) -> None:
        record = step.scratch.pop("robust_record", None)
        if record is None or record["grad"] is None:
            return
        for k, c in enumerate(step.clients):  # each client's ascent on its own shift
            i = c.client_id
            lam, delta = self.clients["Lambda"][i], self.clients["delta"][i]
            g_lam, g_delta = self.shift_gradients(record["grad"][k], record["x"][k])
            eye = torch.eye(lam.shape[0], device=lam.device)
            offset = lam - eye + self.ascent_lr * (g_lam - 2.0 * self.penalty * (lam - eye))
            delta_new = delta + self.ascent_lr * (g_delta - 2.0 * self.penalty * delta)
            self.clients["Lambda"][i] = eye + project_ball(offset, self.eps_lambda)
            self.clients["delta"][i] = project_ball(delta_new, self.eps_delta)
