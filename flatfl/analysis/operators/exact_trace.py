"""The exact trace of a model's curvature from per-sample squared norms (docs/analysis.md, "The exact trace").

For the sample-weighted mean loss over the evaluation set, the generalized Gauss-Newton matrix is
``G = sum_b w_b sum_{i in b} J_i^T H_i J_i``, with ``J_i`` the Jacobian of sample i's outputs and ``H_i`` the Hessian of
batch b's loss in them. With a factor ``H_i = B_i B_i^T`` (K columns ``b_ik``),

    tr(G) = sum_b w_b sum_i sum_k ||J_i^T b_ik||^2,

the squared norms of per-sample vector-Jacobian products: K backward passes per batch, no curvature product. For a
network whose differentiated parameters all sit in ``nn.Linear`` and ``nn.Conv2d`` layers, the per-sample gradient of
a layer's weight is ``delta_i a_i^T`` (``delta_i`` the signal backpropagated to the layer's output, ``a_i`` its input,
or the input's sliding windows for a convolution, summed over positions), and its squared norm is a contraction of
the two that never forms the per-sample gradient (:func:`weight_norms`). Each batch costs one forward pass and K
backward passes to the layers' outputs.

* **GGN** (cross-entropy): ``H_i = a_i (diag(p_i) - p_i p_i^T)`` (:class:`~.cross_entropy.SoftmaxHessian`), whose
  factor has the columns ``b_ic = sqrt(a_i p_ic) (e_c - p_i)``: K = C.
* **Empirical Fisher**: ``(1 / N) sum_i g_i g_i^T`` has the trace ``(1 / N) sum_i ||g_i||^2``: one column, the
  gradient of sample i's loss (a batch of one) in its outputs.
* **Hessian**: ``H = G + sum_i sum_k (d l / d f_ik) nabla^2 f_ik``. A network that is linear in each layer's
  parameters (every parametrised layer called once, and between them only operations whose second derivative is
  zero: ReLU, max pooling, flattening, further linear layers) has ``nabla^2_{theta_l theta_l} f = 0`` for each layer
  ``l``: the second term has a zero diagonal and ``tr(H) = tr(G)``, exactly (torch's second derivative of ReLU and
  max pooling is zero). This is checked on every batch, not assumed: ``d/dz_l <d(w . f)/dz_l, u>`` at each layer's
  output ``z_l``, for random ``w`` and ``u``, must vanish; a network where it does not (tanh, normalisation of a
  layer's output, attention, a layer called twice) is refused in one line naming the layer.

Also checked on every batch: every differentiated parameter belongs to one supported layer, each layer runs once,
and the per-sample gradients summed over the samples equal torch's gradient of the same backward pass (a parameter
used outside its layer would break this). Rounding: the stated error bound is ``eps * (dim + K * samples)`` times the
trace, the worst case of the sums (docs/analysis.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...models.convolution import matmul_convolutions
from .cross_entropy import SoftmaxHessian, cross_entropy_form
from .products import LossTerms, check_outputs

__all__ = ["ExactTrace", "exact_trace_of", "softmax_columns", "gradient_columns", "weight_norms"]

#: the layer types whose per-sample gradient norms are computed here (their own forward, not a subclass's)
LAYERS = (torch.nn.Linear, torch.nn.Conv2d)


@dataclass
class ExactTrace:
    """The trace of a curvature: per differentiated parameter (``per_param``, the flat layout's order), their sum
    (:attr:`value`) and a bound on its rounding error (``error``); ``passes``: backward passes spent."""

    per_param: torch.Tensor
    error: float
    passes: int

    @property
    def value(self) -> float:
        return float(self.per_param.sum())


def softmax_columns(loss_fn: Callable, outputs: torch.Tensor, targets: torch.Tensor, what: str) -> torch.Tensor:
    """The factor ``B_i`` (n, C, C) of a cross-entropy's Hessian in each sample's scores: ``b_ic = sqrt(a_i p_ic)
    (e_c - p_i)``; a loss that is not recognisably cross-entropy is refused in one line."""
    form = cross_entropy_form(loss_fn)
    if form is None:
        raise ConfigError(f"the exact trace of the {what} needs a cross-entropy loss (F.cross_entropy or "
                          f"nn.CrossEntropyLoss), got {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}; "
                          "use --trace-method hutchpp")
    if outputs.dim() != 2:
        raise ConfigError(f"the exact trace needs outputs of shape (samples, classes), got {tuple(outputs.shape)}; "
                          "use --trace-method hutchpp")
    softmax = SoftmaxHessian(form, outputs, targets)
    bad = softmax.worst_coefficient()
    if bad is not None:
        raise ConfigError(f"the cross-entropy is not convex at sample {bad[1]} (coefficient {bad[0]:.4g}): its "
                          "Gauss-Newton factor has no square root; use --trace-method hutchpp")
    p, a = softmax.probabilities, softmax.coefficients  # (n, C), (n, 1)
    eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
    # columns[i, :, c] = sqrt(a_i p_ic) (e_c - p_i)
    return (eye.unsqueeze(0) - p.unsqueeze(2)) * (a * p).clamp_min(0).sqrt().unsqueeze(1)


def gradient_columns(loss_fn: Callable, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
    """One column per sample: the gradient of the sample's own loss (a batch of one) in its outputs, divided by
    ``sqrt(batch_size)`` (the empirical Fisher of a batch is the mean of the outer products)."""
    from torch.func import grad, vmap

    def sample_loss(out, target):
        return loss_fn(out.unsqueeze(0), target.unsqueeze(0))

    g = vmap(grad(sample_loss))(outputs.detach(), targets)
    return (g / batch_size ** 0.5).unsqueeze(-1)


def _layers(terms: LossTerms, what: str) -> list[tuple[str, torch.nn.Module, int | None, int | None]]:
    """(name, layer, index of its weight, index of its bias) in the flat layout, for every layer holding a
    differentiated parameter; a parameter outside a supported layer is refused in one line."""
    index = {id(p): i for i, p in enumerate(terms.params)}
    found, covered = [], set()
    for name, module in terms.model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) in index]
        if not own:
            continue
        supported = any(type(module).forward is kind.forward for kind in LAYERS)
        if isinstance(module, torch.nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                                      or isinstance(module.padding, str)):
            supported = False
        if not supported:
            raise ConfigError(f"the exact trace of the {what} needs every differentiated parameter in an nn.Linear or "
                              f"nn.Conv2d layer (ungrouped, zero-padded by numbers), and layer {name or 'the model'!r} is a "
                              f"{type(module).__name__}; use --trace-method hutchpp")
        weight = index.get(id(module.weight))
        bias = index.get(id(module.bias)) if module.bias is not None else None
        for i in (weight, bias):
            if i is not None and i in covered:
                raise ConfigError(f"the exact trace of the {what} needs each parameter in one layer, and parameter "
                                  f"{i} is shared (layer {name!r}); use --trace-method hutchpp")
            covered.add(i)
        found.append((name, module, weight, bias))
    missing = [i for i in range(len(terms.params)) if i not in covered]
    if missing:
        raise ConfigError(f"the exact trace of the {what} needs every differentiated parameter in a layer of the "
                          f"model, and parameter {missing[0]} is in none; use --trace-method hutchpp")
    return found


def _windows(module: torch.nn.Module, a: torch.Tensor) -> torch.Tensor:
    """A layer's input as (n, features, positions): a convolution's sliding windows (``F.unfold``), a linear
    layer's input with its middle dimensions as positions."""
    if isinstance(module, torch.nn.Conv2d):
        if a.dim() == 3:
            a = a.unsqueeze(0)
        return F.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding,
                        stride=module.stride)
    return a.reshape(a.shape[0], -1, a.shape[-1]).transpose(1, 2)


def weight_norms(delta: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """``||delta_i windows_i^T||_F^2`` per sample i for ``delta`` (n, out, L) and ``windows`` (n, in, L), by the
    cheaper of the per-sample product and the contraction of the two position Gram matrices."""
    n, out, positions = delta.shape
    features = windows.shape[1]
    if positions == 1:
        return delta.square().sum((1, 2)) * windows.square().sum((1, 2))
    if positions * positions * (out + features) < out * features * positions:
        gram_d = torch.bmm(delta.transpose(1, 2), delta)
        gram_w = torch.bmm(windows.transpose(1, 2), windows)
        return (gram_d * gram_w).sum((1, 2))
    return torch.bmm(delta, windows.transpose(1, 2)).square().sum((1, 2))


class _Recorder:
    """Forward hooks that keep each layer's input and output of one pass (and count its calls)."""

    def __init__(self, layers) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.calls: dict[int, int] = {}
        self.handles = [module.register_forward_hook(self.hook(k)) for k, (_, module, _, _) in enumerate(layers)]

    def hook(self, k: int):
        def record(module, args, output):
            self.calls[k] = self.calls.get(k, 0) + 1
            self.inputs[k], self.outputs[k] = args[0].detach(), output
        return record

    def clear(self) -> None:
        """Forget the last pass (before the next one)."""
        self.inputs.clear()
        self.outputs.clear()
        self.calls.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _check_linear(outputs: torch.Tensor, zs: list[torch.Tensor], layers, generator: torch.Generator,
                  what: str) -> None:
    """``d/dz <d(w . f)/dz, u> = 0`` at every layer's output z (the Hessian's condition, module docstring)."""
    w = torch.randn(outputs.shape, generator=generator, dtype=outputs.dtype).to(outputs.device)
    firsts = torch.autograd.grad(outputs, zs, grad_outputs=w, create_graph=True, retain_graph=True, allow_unused=True)
    eps = torch.finfo(outputs.dtype).eps
    for (name, _, _, _), z, first in zip(layers, zs, firsts):
        if first is None or not first.requires_grad:
            continue  # no path from z back into its own signal: the second derivative is zero by construction
        u = torch.randn(z.shape, generator=generator, dtype=z.dtype).to(z.device)
        (second,) = torch.autograd.grad((first * u).sum(), z, retain_graph=True, allow_unused=True)
        if second is None:
            continue
        scale = float(first.detach().abs().max()) * float(u.abs().max()) + torch.finfo(z.dtype).tiny
        worst = float(second.abs().max())
        if not worst <= 1e3 * eps * scale:
            raise ConfigError(f"the exact trace of the Hessian needs a network linear in each layer's parameters, and "
                              f"its outputs have second derivatives in the output of layer {name!r} ({worst:.3g} "
                              f"against a first derivative of {scale:.3g}): the Hessian's trace is not the Gauss-Newton "
                              "matrix's there; use --trace-method hutchpp")


def _check_sum(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]], dtype: torch.dtype, norms: float,
               samples: int, what: str) -> None:
    """The per-sample gradients summed over the samples are torch's gradient of the same pass: ``pairs`` of (the
    sum, torch's gradient) per differentiated parameter, None standing for zero."""
    eps = torch.finfo(dtype).eps
    total = 0.0
    for mine, torch_grad in pairs:
        if mine is None and torch_grad is None:
            continue
        difference = torch_grad if mine is None else mine if torch_grad is None else mine - torch_grad
        total += float(difference.square().sum())
    if not total ** 0.5 <= 1e3 * eps * samples ** 0.5 * max(norms, torch.finfo(dtype).tiny):
        raise ConfigError(f"the exact trace of the {what} found the model's gradient different from the sum of its "
                          "layers' per-sample gradients (a parameter used outside its layer?); use --trace-method "
                          "hutchpp")


def exact_trace_of(terms: LossTerms, columns: Callable, *, what: str, linear_layers: bool,
                   seed: int = 0) -> ExactTrace:
    """The trace of the curvature whose factor ``columns(outputs, targets, batch_size) -> (n, C, K)`` gives, per
    differentiated parameter (module docstring). ``linear_layers``: check that the network is linear in each
    layer's parameters (the Hessian's condition). ``what`` names the curvature in refusals."""
    if terms.objective is not None:
        raise ConfigError(f"the exact trace of the {what} needs a criterion of (outputs, targets), not a "
                          "loss(model, batch) objective; use --trace-method hutchpp")
    layers = _layers(terms, what)
    per_param = torch.zeros(len(terms.params), dtype=torch.float64)
    generator = torch.Generator().manual_seed(int(seed))
    passes, columns_total = 0, 0
    recorder = _Recorder(layers)
    try:
        with terms.model_mode():
            for index, weight in enumerate(terms.weights):
                inputs, targets = terms.batches[index]
                recorder.clear()
                with torch.enable_grad(), terms.no_running_stats(), terms.batch_rng(index), \
                        matmul_convolutions(terms.matmul_convolutions):
                    outputs = check_outputs(terms.model(inputs))
                    n = len(targets)
                    for k, (name, _, _, _) in enumerate(layers):
                        if recorder.calls.get(k, 0) > 1:
                            raise ConfigError(f"the exact trace of the {what} needs each layer run once a pass, and "
                                              f"layer {name!r} ran {recorder.calls.get(k, 0)} times; use --trace-method "
                                              "hutchpp")
                    used = [k for k in range(len(layers)) if recorder.calls.get(k, 0) == 1]  # a layer not run: 0
                    run = [layers[k] for k in used]
                    if not run:  # no layer ran on this batch: it adds nothing
                        continue
                    zs = [recorder.outputs[k] for k in used]
                    windows = [_windows(layers[k][1], recorder.inputs[k]) for k in used]
                    if linear_layers:
                        _check_linear(outputs, zs, run, generator, what)
                    factor = columns(outputs, targets, n)  # (n, C, K)
                    columns_total += n * factor.shape[2]
                    sums = torch.zeros(len(terms.params), dtype=outputs.dtype, device=outputs.device)
                    # (flat index, parameter) of the layers that ran: their gradients are checked on the first pass
                    params = [(i, p) for (_, module, wi, bi) in run for i, p in ((wi, module.weight), (bi, module.bias))
                              if i is not None]
                    for c in range(factor.shape[2]):
                        check = c == 0
                        wanted = zs + ([p for _, p in params] if check else [])
                        got = torch.autograd.grad(outputs, wanted, grad_outputs=factor[:, :, c].contiguous(),
                                                  retain_graph=True, allow_unused=True)
                        deltas = got[:len(zs)]
                        torch_grads = dict(zip((i for i, _ in params), got[len(zs):]))
                        passes += 1
                        mine: dict[int, torch.Tensor] = {}  # the per-sample gradients summed, by flat index
                        for k, (_, module, wi, bi) in enumerate(run):
                            delta = deltas[k]
                            if delta is None:  # the layer's output does not reach the outputs: its gradients are 0
                                continue
                            d = delta.reshape(n, delta.shape[1], -1) if isinstance(module, torch.nn.Conv2d) else \
                                delta.reshape(n, -1, delta.shape[-1]).transpose(1, 2)
                            if wi is not None:
                                sums[wi] += weight * weight_norms(d, windows[k]).sum()
                                if check:
                                    mine[wi] = torch.einsum("nol,nil->oi", d, windows[k]).reshape(module.weight.shape)
                            if bi is not None:
                                sums[bi] += weight * d.sum(2).square().sum()
                                if check:
                                    mine[bi] = d.sum((0, 2))
                        if check:
                            _check_sum([(mine.get(i), torch_grads[i]) for i, _ in params], outputs.dtype,
                                       float(sums.sum() / max(weight, 1e-300)) ** 0.5, n, what)
                    per_param += sums.to(torch.float64).cpu()
                del outputs, zs, windows
    finally:
        recorder.remove()
    per_param = terms.whole(per_param.to(terms.device, terms.params[0].dtype)).to(torch.float64).cpu() \
        if terms.reduce is not None else per_param
    eps = torch.finfo(terms.params[0].dtype).eps
    error = eps * (terms.dim + columns_total) * float(per_param.abs().sum())
    return ExactTrace(per_param, error, passes)
