"""FedAlign: align the Lipschitz constant of a slimmed final block with the full one (Mendieta et al. CVPR 2022,
Eq. 5-7, Alg. 1; docs/update-rules.md §18).

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
f_{L-1} and f_L are captured by forward hooks during the model's ordinary forward pass (so the block is found also
inside a wrapper such as MOON's projection-head model):

* ResNets: the last stage (``layer3`` of ResNet-20/56, ``layer4`` of ResNet-18); the student is
  ``set_width(omega, stages="last")`` + ``forward_last_stage`` on the detached f_{L-1}; the width is restored to 1.0
  afterwards, also on errors, so the server model is always the full network.
* Plain CNNs and MLPs (flatfl's choice; the paper only uses ResNets): the last hidden fully connected layer with its
  non-linearity, i.e. the last ``nn.Linear`` before the classifier and the last activation module, when they form
  ``classifier(act(linear(f_{L-1})))`` (``fc2``+ReLU of the CIFAR CNN, ``fc1``+ReLU of the digits and EMNIST CNNs).
  f_{L-1} is that layer's (flattened) input, f_L its activation output; the student uses the leading
  ceil(omega * D_in) inputs and ceil(omega * D_out) units of the same weights (for a flattened convolutional map the
  leading inputs are its leading channels). Features are vectors (H = W = 1), so X is the outer product
  f_{L-1} f_L^T and sigma = |f_{L-1}| |f_L|.
* Anything else raises :class:`ConfigError`: at ``attach`` when no candidate exists, at the first step when the
  forward pass shows that the candidate layers do not feed the classifier (e.g. MOON's head around a CNN).

Numerical guard (not in the code): the power-iteration norm is clamped at 1e-12 before division and square root, so
a sample whose features are all zero gets sigma = 1e-6 with zero gradient instead of NaN; for every other sample
the formula is the code's. When L_lip is exactly 0 the term is 0.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.slimmable import check_width, slim_channels
from ...models.stacking import counterparts, run_rows, source_network
from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .regularizer import Regularizer, per_client_cross_entropy
from .man import NONLINEARITIES, default_activation_modules

POWER_ITERATIONS = 10
WIDTH_HELP = "width omega of the slimmed sub-network: FedAlign's final block, GradAug's minimum width"
_NORM_FLOOR = 1e-12


def _as_maps(f_prev: torch.Tensor, f_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C_prev, HW), (B, C_last, HW): vectors count as 1x1 maps; f_prev is adaptive-average-pooled to f_last's
    spatial size when larger (FedAlign code)."""
    if f_prev.dim() == 2:
        f_prev = f_prev[:, :, None, None]
    if f_last.dim() == 2:
        f_last = f_last[:, :, None, None]
    if f_prev.shape[2] > f_last.shape[2]:
        f_prev = F.adaptive_avg_pool2d(f_prev, f_last.shape[2:])
    return f_prev.flatten(2), f_last.flatten(2)


def transmitting_matrix(f_prev: torch.Tensor, f_last: torch.Tensor) -> torch.Tensor:
    """Per-sample FSP matrix X = f_prev f_last^T / (H W), shape (B, C_prev, C_last)."""
    a, b = _as_maps(f_prev, f_last)
    return torch.bmm(a, b.transpose(1, 2)) / a.shape[2]


def spectral_norm(f_prev: torch.Tensor, f_last: torch.Tensor, iterations: int = POWER_ITERATIONS) -> torch.Tensor:
    """sigma = sqrt(lambda_max(K)), K = X X^T with X the transmitting matrix, per sample: ``iterations`` power-
    iteration steps on K from the all-ones vector, v <- K v / |K v|, and sigma = sqrt(|K v|) at the last step (the
    FedAlign code's estimate). With X = A B^T / HW (A, B the flattened maps), K v = A (B^T (B (A^T v))) / HW^2 is
    computed without forming X or K, as broadcast products (much faster than batched GEMV on CPU). For 1x1 maps
    (vectors) the estimate is |a| |b| in closed form. Shape (B,)."""
    a, b = _as_maps(f_prev, f_last)
    if a.shape[2] == 1:
        # vector features: X = a b^T has rank one, and the first step from all-ones already lands on its top
        # eigenvector (unless a is orthogonal to the ones vector), so every estimate equals |a| |b| exactly
        return (a.flatten(1).norm(dim=1) * b.flatten(1).norm(dim=1)).clamp_min(_NORM_FLOOR ** 0.5)
    scale = float(a.shape[2]) ** -2
    v = torch.ones(a.shape[0], a.shape[1], 1, device=a.device, dtype=a.dtype)
    norm = None
    for _ in range(iterations):
        u = (a * v).sum(1, keepdim=True)  # (B, 1, HW)    A^T v
        w = (b * u).sum(2, keepdim=True)  # (B, C_last, 1) B A^T v = X^T v * HW
        u = (b * w).sum(1, keepdim=True)  # (B, 1, HW)
        m = (a * u).sum(2, keepdim=True) * scale  # (B, C_prev, 1) = K v
        norm = m.norm(dim=1, keepdim=True).clamp_min(_NORM_FLOOR)
        v = m / norm
    return norm.reshape(-1).sqrt()


def lipschitz_loss(student: tuple[torch.Tensor, torch.Tensor],
                   teacher: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """MSE between the student's and the detached teacher's spectral norms; each pair is (f_prev, f_last)."""
    sigma_s = spectral_norm(*student)
    with torch.no_grad():
        sigma_t = spectral_norm(*teacher)
    return F.mse_loss(sigma_s, sigma_t)


def client_samples(t: torch.Tensor, m: int) -> torch.Tensor:
    """A feature of M stacked clients, (B, M*C, H, W), (B, M*C) or (B, M, C), as (B*M, C, ...): one 'sample' per
    (sample, client), client k's at rows k, M + k, ..."""
    b = t.shape[0]
    if t.dim() == 4:
        return t.reshape(b * m, t.shape[1] // m, *t.shape[2:])
    return t.reshape(b * m, -1)


def clients_lipschitz_loss(student: tuple[torch.Tensor, torch.Tensor], teacher: tuple[torch.Tensor, torch.Tensor],
                           m: int) -> torch.Tensor:
    """:func:`lipschitz_loss` of each of M stacked clients, (M,): each pair holds stacked features."""
    sigma_s = spectral_norm(*(client_samples(t, m) for t in student))
    with torch.no_grad():
        sigma_t = spectral_norm(*(client_samples(t, m) for t in teacher))
    return (sigma_s - sigma_t).view(-1, m).pow(2).mean(0)


class _FinalBlock:
    """Captures, during the model's ordinary forward pass, the input f_{L-1} and output f_L of the final block, and
    runs the block at reduced width. Hooks are closures (a deep copy of the model shares them but never records:
    they check the module's identity and a recording flag), and captured tensors are dropped after each use."""

    def __init__(self) -> None:
        self.recording = False
        self.seen: dict[str, torch.Tensor] = {}
        self.handles: list = []

    def _hook(self, module: nn.Module, input_key: str | None, output_key: str | None) -> None:
        """Record ``module``'s first input under ``input_key`` and its output under ``output_key`` (None: skip)."""
        def hook(mod, inputs, output) -> None:
            if self.recording and mod is module:
                if input_key is not None:
                    self.seen[input_key] = inputs[0]
                if output_key is not None:
                    self.seen[output_key] = output

        self.handles.append(module.register_forward_hook(hook))

    def capture(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(f_prev, f_last, logits) of one ordinary forward pass."""
        self.seen = {}
        self.recording = True
        try:
            logits = model(x)
        finally:
            self.recording = False
        seen, self.seen = self.seen, {}
        return (*self.check(seen), logits)

    def capture_clients(self, step: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(f_prev, f_last, logits) of the step's M clients from one forward pass of the stacked network: the
        features stacked, the logits (M, B, K)."""
        self.seen = {}
        self.recording = True
        try:
            logits = step.model(step.x)
        finally:
            self.recording = False
        seen, self.seen = self.seen, {}
        return (*self.check(seen), logits)

    def check(self, seen: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def student(self, f_prev: torch.Tensor, width: float) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def clients_student(self, f_prev: torch.Tensor, width: float, step: StepContext
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        """:meth:`student` of each of the step's clients on the stacked f_prev: (student input, output), stacked."""
        raise NotImplementedError


class _ResNetStage(_FinalBlock):
    """The last residual stage of a flatfl ResNet (also inside a wrapper such as MOON's), slimmed with
    ``set_width(omega, stages="last")`` and re-run by ``forward_last_stage``; the width is restored afterwards."""

    def __init__(self, backbone: nn.Module, width: float):
        super().__init__()
        self.backbone = backbone
        backbone.set_width(width, stages="last")  # raises ConfigError when e.g. GroupNorm cannot split
        backbone.set_width(1.0)
        self._hook(backbone.last_stage, "prev", "last")

    def check(self, seen):
        if "prev" not in seen:
            raise ConfigError("fedalign: the model's forward did not run its last residual stage")
        return seen["prev"], seen["last"]

    def student(self, f_prev, width):
        net = self.backbone
        prev_width, prev_stages = net.width, net.width_stages
        net.set_width(width, stages="last")
        try:
            return f_prev.detach()[:, :net.last_stage_in_channels], net.forward_last_stage(f_prev.detach())
        finally:
            net.set_width(prev_width, stages=prev_stages)

    def clients_student(self, f_prev, width, step):
        net, m = self.backbone, step.m
        b, channels, h, w = f_prev.shape
        needed = slim_channels(net.last_stage[0].conv1.in_channels, width)  # each client's slice of its f_prev
        xs = f_prev.detach().view(b, m, channels // m, h, w)[:, :, :needed].reshape(b, m * needed, h, w)
        prev_width, prev_stages = net.width, net.width_stages
        net.set_width(width, stages="last")
        try:
            if step.rows is None:
                return xs, net.last_stage(xs)
            return xs, run_rows(net, step.cohort.layout, step.rows, xs, "last_stage")
        finally:
            net.set_width(prev_width, stages=prev_stages)


class _DenseLayer(_FinalBlock):
    """The last hidden Linear + non-linearity of a plain CNN / MLP, feeding the classifier directly."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # chosen on the plain network and found by name in a network of stacked clients (flatfl.models.stacking)
        source = source_network(model)
        name = type(source).__name__
        head = getattr(source, "classifier", None)
        modules = list(source.modules())
        if not isinstance(head, nn.Linear) or not any(m is head for m in modules):
            raise ConfigError(f"fedalign needs a ResNet or a model with a final nn.Linear 'classifier'; "
                              f"{name} has none")
        end = next(i for i, m in enumerate(modules) if m is head)
        linears = [m for m in modules[:end] if isinstance(m, nn.Linear)]
        acts = default_activation_modules(source)
        if not linears or not acts or not isinstance(acts[-1], NONLINEARITIES):
            raise ConfigError(f"fedalign cannot find a final block in {name}: it needs a ResNet or a model whose last "
                              "hidden layer is a Linear and a non-linearity feeding the classifier")
        self.name = name
        try:
            self.linear, self.act, head = counterparts(model, [linears[-1], acts[-1], head])
        except ValueError as e:
            raise ConfigError(f"fedalign: {e}; activation_modules() must list modules of the model itself") from None
        self._hook(self.linear, "prev", "linear_out")
        self._hook(self.act, "act_in", "last")
        self._hook(head, "head_in", None)

    def check(self, seen):
        # the structure must be classifier(act(linear(f_prev))): the very same tensors pass from one to the next
        if len(seen) < 5 or seen["act_in"] is not seen["linear_out"] or seen["head_in"] is not seen["last"]:
            raise ConfigError(f"fedalign cannot find a final block in {self.name}: its last hidden Linear and "
                              "non-linearity do not feed the classifier directly")
        return seen["prev"].flatten(1), seen["last"]

    def student(self, f_prev, width):
        n_in = slim_channels(self.linear.in_features, width)
        n_out = slim_channels(self.linear.out_features, width)
        bias = None if self.linear.bias is None else self.linear.bias[:n_out]
        x = f_prev.detach()[:, :n_in]
        # .forward skips the module's hooks (MAN's, this block's): the student is no activation of the model
        return x, self.act.forward(F.linear(x, self.linear.weight[:n_out, :n_in], bias))

    def clients_student(self, f_prev, width, step):
        n_in = slim_channels(self.linear.in_features, width)
        n_out = slim_channels(self.linear.out_features, width)
        weight, bias = self.linear.weight, self.linear.bias  # (N, out, in), (N, out)
        if step.rows is not None:
            weight = weight[step.rows]
            bias = None if bias is None else bias[step.rows]
        x = f_prev.detach().reshape(f_prev.shape[0], step.m, -1)[:, :, :n_in].transpose(0, 1)  # (M, B, n_in)
        w = weight[:, :n_out, :n_in].transpose(1, 2)
        out = torch.bmm(x, w) if bias is None else torch.baddbmm(bias[:, None, :n_out], x, w)
        return x.transpose(0, 1), self.act.forward(out).transpose(0, 1)  # (B, M, n_in), (B, M, n_out)


def find_final_block(model: nn.Module, width: float) -> _FinalBlock:
    """The ResNet last stage when the model is or contains a flatfl ResNet, else the dense final layer."""
    for module in model.modules():
        if callable(getattr(module, "forward_last_stage", None)) and callable(getattr(module, "set_width", None)):
            return _ResNetStage(module, width)
    return _DenseLayer(model)


@REGULARIZERS.register
class FedAlign(Regularizer):
    name, display_name = "fedalign", "FedAlign"
    summary = "FedAlign: match the Lipschitz constant of the final block at width omega to the full one"
    hparams = (
        HParam("mu", 0.45, "FedAlign weight mu: the Lipschitz loss is rescaled to mu * CE", flag="fedalign-mu",
               check="nonnegative"),
        HParam("width", 0.25, WIDTH_HELP, check="unit"),
    )

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # working network -> its block

    def attach(self, model: nn.Module) -> None:
        check_width(self.width)
        self._blocks[model] = find_final_block(model, self.width)

    def forward(self, step: StepContext) -> torch.Tensor:
        if step.cohort.n == 1:
            return self.client_loss(step).reshape(1)
        return self.clients_loss(step)

    def clients_loss(self, step: StepContext) -> torch.Tensor:
        """Each of the step's M clients' loss, (M,), from one pass of the stacked network and one of its stacked
        last block at width omega; the rescaling coefficient mu * CE / L_lip of each client is a detached (M,)
        tensor (no host synchronisation), the value of the one-client ``.item()`` rescaling."""
        block = self._blocks[step.cohort.network]
        f_prev, f_last, logits = block.capture_clients(step)
        step.logits = logits
        ce = per_client_cross_entropy(logits, step.y)
        if not self.mu:
            return ce
        s_in, s_out = block.clients_student(f_prev, self.width, step)
        lip = clients_lipschitz_loss((s_in, s_out), (f_prev.detach(), f_last.detach()), step.m)
        with torch.no_grad():
            coef = torch.where(lip != 0, self.mu * ce / lip, torch.zeros_like(lip))
        step.scratch["fedalign_lip"] = lip.detach()
        return ce + coef * lip

    def client_loss(self, step: StepContext) -> torch.Tensor:
        """The loss of a cohort of one client: the FedAlign code's formulas, ``.item()`` rescaling included."""
        model, x, y = step.single()
        block = self._blocks[model]
        f_prev, f_last, logits = block.capture(model, x)
        step.logits = logits.unsqueeze(0)
        ce = F.cross_entropy(logits, y)
        if not self.mu:
            return ce
        s_in, s_out = block.student(f_prev, self.width)
        lip = lipschitz_loss((s_in, s_out), (f_prev.detach(), f_last.detach()))
        lip_value = lip.item()  # the code's .item() rescaling: value mu * CE, direction of L_lip's gradient
        step.scratch["fedalign_lip"] = lip_value
        if lip_value == 0.0:
            return ce
        return ce + (self.mu * ce.item() / lip_value) * lip
