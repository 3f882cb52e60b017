"""FedAlign: align the Lipschitz constant of a slimmed final block with the full one (Mendieta et al. CVPR 2022,
Eq. 5-7, Alg. 1; algorithms.md §18).

Per batch:

1. full-width forward giving f_{L-1} (the input of the final block), f_L (its output) and the logits; CE;
2. the final block re-runs at width omega (``--width``, 0.25) on the first ceil(omega * C) channels of the
   **detached** f_{L-1}, giving the student output f^s_L (so only the final block's weights get the new gradient);
3. per sample, the transmitting (FSP) matrix X = f_{L-1} f_L^T / (H W) (C_{L-1} x C_L; f_{L-1} adaptive-average-
   pooled to f_L's spatial size when larger), for the student (sliced input, narrow output) and the teacher (the
   detached full-width features);
4. sigma = sqrt(lambda_max(X X^T)) by 10 power iterations from the all-ones vector (:func:`spectral_norm`);
5. L_lip = MSE(sigma_student, sigma_teacher), rescaled to mu * (CE.item() / L_lip.item()) * L_lip, so its value is
   mu * CE and its gradient keeps L_lip's direction (``--fedalign-mu``, 0.45).

The final block
---------------
* ResNets: the last stage (``layer3`` of ResNet-20/56, ``layer4`` of ResNet-18), through the model's
  ``forward_stages`` / ``set_width(omega, stages="last")`` / ``forward_last_stage``; the width is restored to 1.0
  afterwards, also on errors, so the server model is always the full network.
* Plain CNNs and MLPs (flatfl's choice; the paper only uses ResNets): the last hidden fully connected layer with its
  non-linearity, i.e. the last ``nn.Linear`` before the classifier and the last activation module (``fc2``+ReLU of
  the CIFAR CNN, ``fc1``+ReLU of the digits and EMNIST CNNs). f_{L-1} is that layer's (flattened) input, f_L its
  activation output; the student uses the leading ceil(omega * D_in) inputs and ceil(omega * D_out) units of the same
  weights (for a flattened convolutional map the leading inputs are its leading channels). Features are vectors
  (H = W = 1), so X is the outer product f_{L-1} f_L^T and sigma = |f_{L-1}| |f_L|.
* Anything else raises :class:`ConfigError` at ``attach``.

Numerical guard (not in the code): the power-iteration norm is clamped at 1e-12 before division and square root, so
a sample whose features are all zero gets sigma = 1e-6 with zero gradient instead of NaN; for every other sample
the formula is the code's. When L_lip is exactly 0 the term is 0.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.slimmable import check_width, slim_channels
from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .base import Regularizer
from .man import NONLINEARITIES

POWER_ITERATIONS = 10
WIDTH_HELP = ("width omega of the slimmed sub-network: FedAlign's final block (default 0.25), GradAug's "
              "minimum width (default 0.8)")
_NORM_FLOOR = 1e-12


def transmitting_matrix(f_prev: torch.Tensor, f_last: torch.Tensor) -> torch.Tensor:
    """Per-sample FSP matrix f_prev f_last^T / (H W), shape (B, C_prev, C_last). Vectors count as 1x1 maps."""
    if f_prev.dim() == 2:
        f_prev = f_prev[:, :, None, None]
    if f_last.dim() == 2:
        f_last = f_last[:, :, None, None]
    if f_prev.shape[2] > f_last.shape[2]:
        f_prev = F.adaptive_avg_pool2d(f_prev, f_last.shape[2:])
    a = f_prev.flatten(2)  # (B, C_prev, HW)
    b = f_last.flatten(2)  # (B, C_last, HW)
    return torch.bmm(a, b.transpose(1, 2)) / a.shape[2]


def spectral_norm(x: torch.Tensor, iterations: int = POWER_ITERATIONS) -> torch.Tensor:
    """sigma = sqrt(lambda_max(X X^T)) per sample by power iteration on K = X X^T from the all-ones vector. (B,)."""
    k = torch.bmm(x, x.transpose(1, 2))
    v = torch.ones(k.shape[0], k.shape[1], 1, device=k.device, dtype=k.dtype)
    norm = None
    for _ in range(iterations):
        m = torch.bmm(k, v)
        norm = m.norm(dim=1, keepdim=True).clamp_min(_NORM_FLOOR)
        v = m / norm
    return norm.reshape(-1).sqrt()


def lipschitz_loss(student: tuple[torch.Tensor, torch.Tensor], teacher: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """MSE between the student's and the detached teacher's spectral norms."""
    sigma_s = spectral_norm(transmitting_matrix(*student))
    with torch.no_grad():
        sigma_t = spectral_norm(transmitting_matrix(*teacher))
    return F.mse_loss(sigma_s, sigma_t)


class _DenseFinalBlock:
    """The last hidden Linear + non-linearity of a plain CNN / MLP, with hooks capturing its input and output."""

    def __init__(self, model: nn.Module):
        head = getattr(model, "classifier", None)
        modules = list(model.modules())
        if not isinstance(head, nn.Linear) or not any(m is head for m in modules):
            raise ConfigError(f"fedalign needs a model with a final nn.Linear 'classifier'; {type(model).__name__} "
                              "has none")
        end = next(i for i, m in enumerate(modules) if m is head)
        linears = [m for m in modules[:end] if isinstance(m, nn.Linear)]
        acts = getattr(model, "activation_modules", None)
        acts = list(acts()) if callable(acts) else [m for m in modules[:end] if isinstance(m, NONLINEARITIES)]
        if not linears or not acts or not isinstance(acts[-1], NONLINEARITIES):
            raise ConfigError(f"fedalign cannot find a final block in {type(model).__name__}: it needs a ResNet or a "
                              "model whose last hidden layer is a Linear followed by an element-wise non-linearity")
        self.linear, self.act = linears[-1], acts[-1]
        if self.linear.out_features != head.in_features:
            raise ConfigError(f"fedalign: the last hidden Linear of {type(model).__name__} has "
                              f"{self.linear.out_features} outputs but the classifier reads {head.in_features}")
        self.recording = False
        self.f_prev: torch.Tensor | None = None
        self.f_last: torch.Tensor | None = None
        self.handles = [self.linear.register_forward_hook(self._grab_input),
                        self.act.register_forward_hook(self._grab_output)]

    def _grab_input(self, module, inputs, output) -> None:
        if self.recording and module is self.linear:
            self.f_prev = inputs[0]

    def _grab_output(self, module, inputs, output) -> None:
        if self.recording and module is self.act:
            self.f_last = output

    def forward(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.f_prev = self.f_last = None
        self.recording = True
        try:
            logits = model(x)
        finally:
            self.recording = False
        if self.f_prev is None or self.f_last is None:
            raise ConfigError("fedalign: the model's forward did not run its final hidden block")
        return self.f_prev.flatten(1), self.f_last.flatten(1), logits

    def student(self, f_prev: torch.Tensor, width: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(sliced input, narrow output) of the block at ``width`` on the detached f_prev."""
        n_in = slim_channels(self.linear.in_features, width)
        n_out = slim_channels(self.linear.out_features, width)
        bias = None if self.linear.bias is None else self.linear.bias[:n_out]
        x = f_prev.detach()[:, :n_in]
        # .forward skips the module's hooks: the student must not be recorded as an activation
        return x, self.act.forward(F.linear(x, self.linear.weight[:n_out, :n_in], bias))


@REGULARIZERS.register
class FedAlign(Regularizer):
    name = "fedalign"
    summary = "FedAlign: match the Lipschitz constant of the final block at width omega to the full one"
    hparams = (
        HParam("mu", 0.45, "FedAlign weight mu: the Lipschitz loss is rescaled to mu * CE", flag="fedalign-mu",
               check="nonnegative"),
        HParam("width", 0.25, WIDTH_HELP, check="unit"),
    )

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._dense: _DenseFinalBlock | None = None

    def attach(self, model: nn.Module) -> None:
        check_width(self.width)
        self._dense = None
        if callable(getattr(model, "forward_stages", None)) and callable(getattr(model, "set_width", None)):
            model.set_width(self.width, stages="last")  # raises ConfigError when e.g. GroupNorm cannot split
            model.set_width(1.0)
        else:
            self._dense = _DenseFinalBlock(model)

    def forward(self, step: StepContext) -> torch.Tensor:
        model = step.model
        if self._dense is None:
            f_prev, f_last, logits = model.forward_stages(step.x)
            prev_width, prev_stages = model.width, model.width_stages
            model.set_width(self.width, stages="last")
            try:
                s_in = f_prev.detach()[:, :model.last_stage_in_channels]
                s_out = model.forward_last_stage(f_prev.detach())
            finally:
                model.set_width(prev_width, stages=prev_stages)
        else:
            f_prev, f_last, logits = self._dense.forward(model, step.x)
            s_in, s_out = self._dense.student(f_prev, self.width)
        step.logits = logits
        ce = F.cross_entropy(logits, step.y)
        if not self.mu:
            return ce
        lip = lipschitz_loss((s_in, s_out), (f_prev.detach(), f_last.detach()))
        step.scratch["fedalign_lip"] = lip.detach()
        lip_value = lip.detach()
        scale = torch.where(lip_value > 0, ce.detach() / lip_value.clamp_min(torch.finfo(lip_value.dtype).tiny), 0.0)
        return ce + self.mu * scale * lip
