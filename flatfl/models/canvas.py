"""Many sub-networks of a stacked network, each at its own width and input size, in one pass: the canvas.

GradAug (docs/update-rules.md §19) trains each client's sub-networks, each at its own width on the batch resized to its own
resolution. A stacked network (:mod:`flatfl.models.stacking`) runs M clients side by side along the channel axis;
:meth:`Canvas.slots` runs n sub-networks of each of them, n * M *slots* (slot t * M + k is client k's t-th
sub-network), in one pass:

* the stacked convolutions and the classifier use each client's weights once per sub-network (:class:`Repeated`,
  their adapter for the pass), so a slot's gradient reaches its client's weights;
* each slot's images, resized to the slot's size r (bilinear, ``align_corners=True``, as one product with an r x s
  interpolation matrix on each side), sit in the top-left r x r corner of an s x s canvas, zeros elsewhere;
* a zero-padded convolution whose input is zero outside the slot's corner computes, inside the corner of its output
  (the output size it has on the r x r image), what it computes on the small image: a position past the corner
  reads a zero where the small image reads padding. So does the stem's max-pool, which follows a ReLU (its inputs
  are >= 0, so a zero never exceeds a window's maximum); its output is then zeroed outside its corner;
* each BatchNorm normalises a slot with the statistics of the slot's corner and zeroes everything outside it, and
  the channels beyond the slot's width (:class:`NormRegion`, its adapter for the pass), so the next convolution
  again reads zeros;
* the global average pool scales the canvas mean by canvas area / corner area.

So every slot computes its client's slimmed sub-network on its resized images, up to summation order, and its
gradient. Running statistics are untouched (a slimmed BatchNorm trains on batch statistics). Where each layer's
corner lies for each input size comes from a shape probe of the network on meta tensors (no data is read).

Only flatfl's ResNets are laid on a canvas (:func:`canvas_refusal`): the argument above needs every convolution
followed by a BatchNorm, max-pooling only after a ReLU and pooling only global.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .resnet import ResidualBlock, ResNet
from .slimmable import slim_channels
from .stacking import StackedBatchNorm2d, StackedConv2d, StackedGroupNorm, StackedLinear, stacked_clients


class Repeated:
    """The adapter (:class:`~flatfl.models.stacking.LayerAdapter`) of a stacked convolution or linear layer that
    runs each client's weights ``repeats`` times side by side: the layout of repeats * N clients whose block
    t * N + k is client k's. Full width only."""

    def __init__(self, repeats: int):
        self.repeats = repeats

    def weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's (N*out, ...) or (N, ...) weight and bias as ``repeats`` copies of all N clients' blocks."""
        if layer.width != 1.0:
            raise RuntimeError("a stacked layer repeats its clients' weights at full width only")
        w, b = layer.weight, layer.bias
        return (w.repeat(self.repeats, *[1] * (w.dim() - 1)),
                None if b is None else b.repeat(self.repeats, *[1] * (b.dim() - 1)))

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weights(layer)
        if isinstance(layer, StackedLinear):
            return layer.product(x, weight, bias)
        n = layer.weight.shape[0] // layer.out_channels
        return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups * n * self.repeats)


@dataclasses.dataclass
class NormRegion:
    """The adapter (:class:`~flatfl.models.stacking.LayerAdapter`) of a stacked BatchNorm in a pass of J slots:
    slot j's valid corner of the (H, W) map and its active channels. Masks broadcast over (B, J, C, H, W) or
    (B, J*C, H, W).

    Each slot is normalised with the batch statistics of its valid corner alone, running statistics untouched, and
    its output is zero outside that corner and beyond its width. With rho the canvas area over the corner's, the
    input z = sqrt(rho) x inside the corner and sqrt(rho) times the corner's mean outside has canvas mean
    sqrt(rho) mean(x) and canvas variance var(x) (over the corner), so torch's batch norm of z with weight
    gamma / sqrt(rho) is the corner's own normalisation, eps included. The fill value is computed from x, so
    autograd differentiates the corner's normalisation exactly."""
    inside: torch.Tensor  # (1, J, 1, H, W): sqrt(rho_j) inside slot j's corner, 0 outside
    outside: torch.Tensor  # (1, J, 1, H, W): 1 outside the corner, 0 inside
    rho: torch.Tensor  # (J, 1): canvas area / corner area
    root: torch.Tensor  # (J, 1): sqrt(rho)
    keep: torch.Tensor  # (1, J*C, H, W): 1 on a slot's active channels inside its corner, 0 elsewhere

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        c, j = layer.per_client, self.rho.shape[0]
        a = x.view(b, j, c, h, w) * self.inside
        fill = a.mean((0, 3, 4)) * self.rho  # sqrt(rho) * the corner's mean, (J, C)
        z = torch.addcmul(a, fill.view(1, j, c, 1, 1), self.outside).view(b, j * c, h, w)
        if layer.affine:
            m = layer.weight.shape[0] // c  # clients; J = repeats * m slots
            weight = (layer.weight.view(1, m, c) / self.root.view(j // m, m, 1)).reshape(-1)
            bias = layer.bias.view(1, m, c).expand(j // m, m, c).reshape(-1)
        else:
            weight, bias = (1.0 / self.root).expand(j, c).reshape(-1), None
        return F.batch_norm(z, None, None, weight, bias, True, 0.0, layer.eps) * self.keep


def interpolation_matrix(size: int, out: int) -> torch.Tensor:
    """The (out, size) float64 matrix P with P x P^T = bilinear resizing of a size x size image to out x out with
    ``align_corners=True`` (torch's source index i * (size - 1) / (out - 1), its clamping and weights)."""
    p = torch.zeros(out, size, dtype=torch.float64)
    scale = (size - 1) / (out - 1) if out > 1 else 0.0
    for i in range(out):
        src = i * scale
        i0 = min(math.floor(src), size - 1)
        lam = min(max(src - i0, 0.0), 1.0)
        i1 = i0 + (1 if i0 < size - 1 else 0)
        p[i, i0] += 1.0 - lam
        p[i, i1] += lam
    return p


def canvas_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s sub-networks cannot share a canvas (see the module docstring), or None when they can."""
    if not isinstance(model, ResNet):
        return f"{type(model).__name__} is not one of flatfl's ResNets"
    known = (ResNet, ResidualBlock, nn.Conv2d, nn.BatchNorm2d, nn.Linear, nn.ReLU, nn.MaxPool2d, nn.AdaptiveAvgPool2d,
             nn.Flatten, nn.Identity, nn.Sequential, StackedConv2d, StackedLinear)
    for name, module in model.named_modules():
        if isinstance(module, (nn.GroupNorm, StackedGroupNorm)):
            return (f"{name} is a GroupNorm, whose group statistics would span the whole canvas and each client's "
                    f"masked channels")
        if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
            return f"{name} pads with {module.padding_mode!r}"
        if isinstance(module, nn.MaxPool2d) and name != "stem_pool":
            return f"{name} is a max-pool that does not follow a ReLU"
        if isinstance(module, nn.AdaptiveAvgPool2d) and module.output_size not in (1, (1, 1)):
            return f"{name} pools to {module.output_size}, not globally"
        if not isinstance(module, known):
            return f"{name} is a {type(module).__name__}"
    return None


class _Tables:
    """A canvas's constant tensors on one device and dtype: the interpolation matrices (R, s, s) and, per layer
    geometry, the corner masks (R, 3, H, W) [sqrt(rho) inside, 1 outside, 1 inside] and (R, 2) [rho, sqrt(rho)]
    for each of the R input sizes (rho = canvas area / corner area); ``arange`` per channel count."""

    def __init__(self, canvas: "Canvas", dtype: torch.dtype, device: torch.device):
        s = canvas.size
        interp = torch.zeros(len(canvas.sizes), s, s, dtype=torch.float64)
        for i, r in enumerate(canvas.sizes):
            interp[i, :r] = interpolation_matrix(s, r)
        self.interp = interp.to(device, dtype)
        self.masks: dict[tuple, torch.Tensor] = {}
        self.scales: dict[tuple, torch.Tensor] = {}
        for geo in set(canvas.geometry.values()):
            (hh, ww), corners = geo
            masks = torch.zeros(len(corners), 3, hh, ww, dtype=torch.float64)
            scales = torch.zeros(len(corners), 2, dtype=torch.float64)
            for i, (h, w) in enumerate(corners):
                rho = (hh * ww) / (h * w)
                masks[i, 0, :h, :w] = math.sqrt(rho)
                masks[i, 1] = 1.0
                masks[i, 1, :h, :w] = 0.0
                masks[i, 2, :h, :w] = 1.0
                scales[i] = torch.tensor([rho, math.sqrt(rho)], dtype=torch.float64)
            self.masks[geo] = masks.to(device, dtype)
            self.scales[geo] = scales.to(device, dtype)
        self.arange = {c: torch.arange(c, device=device)
                       for c in sorted({bn.per_client for bn in canvas.norms})}


class Canvas:
    """The sub-networks of a stacked flatfl ResNet on a canvas of ``size`` x ``size`` for inputs resized to one of
    ``sizes`` (the module docstring). Built once per network; :meth:`slots` runs one pass."""

    def __init__(self, network: nn.Module, size: int, sizes: Sequence[int]):
        why = canvas_refusal(network)
        if why is not None:
            raise ValueError(why)
        if not sizes or any(not 1 <= r <= size for r in sizes):
            raise ValueError(f"input sizes {list(sizes)} must lie in [1, {size}]")
        self.network, self.size, self.sizes = network, size, list(sizes)
        self.clients = stacked_clients(network)
        self.norms = [m for m in network.modules() if isinstance(m, StackedBatchNorm2d)]
        self.pools = [m for m in network.modules() if isinstance(m, nn.AdaptiveAvgPool2d)]
        self.maxpools = [m for m in network.modules() if isinstance(m, nn.MaxPool2d)]
        self.repeated = [m for m in network.modules() if isinstance(m, (StackedConv2d, StackedLinear))]
        #: layer -> ((H, W) on the canvas, ((h, w) of its corner for each input size)): a BatchNorm's and a global
        #: pool's input, a max-pool's output
        self.geometry = self._probe()
        self._tables: dict[tuple, _Tables] = {}

    def _probe(self) -> dict[nn.Module, tuple]:
        """Each layer's spatial size for the canvas and for every input size, from passes on meta tensors."""
        seen: dict[nn.Module, tuple[int, int]] = {}

        def before(module, args):
            seen[module] = tuple(args[0].shape[-2:])

        def after(module, args, out):
            seen[module] = tuple(out.shape[-2:])

        handles = [m.register_forward_pre_hook(before) for m in self.norms + self.pools]
        handles += [m.register_forward_hook(after) for m in self.maxpools]
        tensors = {k: torch.empty_like(v, device="meta")
                   for k, v in itertools.chain(self.network.named_parameters(), self.network.named_buffers())}
        stem = next(m for m in self.network.modules() if isinstance(m, StackedConv2d))
        shapes = {}
        try:
            for r in [self.size] + self.sizes:
                seen.clear()
                x = torch.empty(2, self.clients * stem.in_channels, r, r, device="meta")  # 2: a 1x1 map trains
                with torch.no_grad():
                    torch.func.functional_call(self.network, tensors, (x,))
                shapes[r] = dict(seen)
        finally:
            for h in handles:
                h.remove()
        return {m: (shapes[self.size][m], tuple(shapes[r][m] for r in self.sizes))
                for m in self.norms + self.pools + self.maxpools}

    def tables(self, dtype: torch.dtype, device: torch.device) -> _Tables:
        key = (dtype, str(device))
        if key not in self._tables:
            self._tables[key] = _Tables(self, dtype, device)
        return self._tables[key]

    @contextlib.contextmanager
    def slots(self, x: torch.Tensor, widths: Sequence[float], picks: Sequence[int]) -> Iterator[torch.Tensor]:
        """Open a pass of the slots t * M + k (client k's t-th sub-network; M = x.shape[0]) at ``widths[j]`` on
        the images ``x`` (M, B, C, s, s) resized to ``sizes[picks[j]]``: yields the slots' canvas inputs (n*M, B, C,
        s, s) for the stacked network (or :func:`~flatfl.models.stacking.run_rows` of M of its clients), which
        runs the slots while the context is open."""
        m, j = x.shape[0], len(widths)
        if x.shape[-1] != self.size or x.shape[-2] != self.size:
            raise ValueError(f"a canvas of {self.size} x {self.size} got images of {tuple(x.shape[-2:])}")
        if j % m or len(picks) != j:
            raise ValueError(f"{j} widths and {len(picks)} input sizes for {m} clients")
        n = j // m
        t = self.tables(x.dtype, x.device)
        counts = list(t.arange)
        host = [int(p) for p in picks] + [slim_channels(c, w) for c in counts for w in widths]
        ints = torch.tensor(host, dtype=torch.long).to(x.device)
        pick = ints[:j]
        on = {c: ints[j * (i + 1):j * (i + 2)].view(j, 1, 1, 1) for i, c in enumerate(counts)}
        corners = {geo: (masks[pick], t.scales[geo][pick]) for geo, masks in t.masks.items()}
        keeps: dict[tuple, torch.Tensor] = {}
        for bn in self.norms:
            geo, c = self.geometry[bn], bn.per_client
            masks, scales = corners[geo]
            if (geo, c) not in keeps:  # channel within the slot's width and position inside its corner
                keeps[geo, c] = ((t.arange[c].view(1, c, 1, 1) < on[c]) * masks[:, 2:3]).view(1, j * c, *geo[0])
            per_slot = (1, j, 1, *geo[0])
            bn.adapter = NormRegion(inside=masks[:, 0].view(per_slot), outside=masks[:, 1].view(per_slot),
                                   rho=scales[:, 0:1], root=scales[:, 1:2], keep=keeps[geo, c])

        def pooled(module, args, out):  # canvas mean -> corner mean
            rho = corners[self.geometry[module]][1][:, 0]
            return (out.reshape(out.shape[0], j, -1) * rho.view(1, j, 1)).view(out.shape)

        def cornered(module, args, out):  # zero outside the corner
            inside = corners[self.geometry[module]][0][:, 2]
            return (out.view(out.shape[0], j, -1, *out.shape[2:]) * inside.unsqueeze(1)).view(out.shape)

        handles = [p.register_forward_hook(pooled) for p in self.pools]
        handles += [p.register_forward_hook(cornered) for p in self.maxpools]
        repeated = Repeated(n)
        for layer in self.repeated:
            layer.adapter = repeated
        try:
            interp = t.interp[pick].view(n, m, 1, 1, self.size, self.size)
            yield torch.matmul(torch.matmul(interp, x.unsqueeze(0)), interp.transpose(-1, -2)).view(j, *x.shape[1:])
        finally:
            for h in handles:
                h.remove()
            for layer in self.repeated + self.norms:
                layer.adapter = None
