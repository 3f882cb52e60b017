"""Slimmable layers: run a layer on the first ceil(w * C) of its channels (docs/update-rules.md §18-19).

FedAlign re-runs the last ResNet stage at width w = 0.25 and GradAug runs the whole network at widths in
[0.25, 1] (Yu & Huang's "universally slimmable" layers, as used by the FedAlign code). Each layer here holds its
full-width weights and, at width ``w < 1``, uses the leading slice of them:

* a convolution uses ``weight[:ceil(w*C_out), :ceil(w*C_in)]`` (either side can be kept at full width, e.g. the
  image input of the stem or the class output of the classifier);
* a BatchNorm uses the leading slice of its affine parameters. In eval mode it normalises with the leading slice of
  its running statistics; in training mode a narrow network normalises with batch statistics and leaves the running
  statistics untouched, so sub-networks never disturb the full network's statistics (the FedAlign / GradAug code
  does the same: its narrow BatchNorm keeps no running statistics);
* a GroupNorm keeps its number of groups and uses the leading slice of its affine parameters.

``set_width(1.0)`` makes every layer exactly the ordinary PyTorch layer again.

Channel rounding: flatfl uses ``ceil(w * C)`` (the spec's rule). The FedAlign code rounds with
``make_divisible(w * C, 8)``; both give the same counts for ResNet-56's last stage at w = 0.25 (32 of 128 input
channels, 16 of 64, 64 of 256), but differ for layers narrower than 32 channels.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError


def slim_channels(channels: int, width: float) -> int:
    """The number of active channels, ceil(width * channels), and at least one.

    A tiny tolerance absorbs floating-point error so that e.g. ``0.3 * 10`` counts as exactly 3.
    """
    return max(1, math.ceil(width * channels - 1e-9))


def check_width(width: float) -> float:
    """Return ``width`` as a float, or raise :class:`ConfigError` unless it lies in (0, 1]."""
    try:
        value = float(width)
    except (TypeError, ValueError):
        raise ConfigError(f"width multiplier must be a number in (0, 1], got {width!r}") from None
    if not (0.0 < value <= 1.0):
        raise ConfigError(f"width multiplier must lie in (0, 1], got {width!r}")
    return value


class Slimmable:
    """Mixin holding the current width multiplier of one layer (also the channel-stacked layers of
    :mod:`flatfl.models.stacking`)."""

    width: float = 1.0

    def set_width(self, width: float) -> None:
        self.width = check_width(width)

    def leading(self, channels: int, follows: bool = True) -> int:
        """How many of ``channels`` run at the current width: the leading ceil(width * channels) when this side
        follows the width multiplier, else all of them."""
        return slim_channels(channels, self.width) if follows else channels


def check_group_width(width: float, channels: int, groups: int) -> float:
    """Return the validated width, or raise :class:`ConfigError` if the leading channels it leaves do not split
    into ``groups`` GroupNorm groups."""
    width = check_width(width)
    c = slim_channels(channels, width)
    if c % groups:
        raise ConfigError(f"width {width:g} leaves {c} of {channels} channels, which GroupNorm cannot "
                          f"split into {groups} groups")
    return width


class SlicedWeight(Slimmable):
    """Mixin of a layer with a weight of shape (out, in, ...) that runs on the leading slice of either side
    (``slim_in`` / ``slim_out``: which side follows the width multiplier); subclasses give :meth:`sliced`."""

    slim_in: bool = True
    slim_out: bool = True

    @property
    def active_in(self) -> int:
        return self.leading(self.weight.shape[1], self.slim_in)

    @property
    def active_out(self) -> int:
        return self.leading(self.weight.shape[0], self.slim_out)

    def sliced(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.width == 1.0:
            return super().forward(x)
        n_out, n_in = self.active_out, self.active_in
        bias = None if self.bias is None else self.bias[:n_out]
        return self.sliced(x, self.weight[:n_out, :n_in], bias)


class SlimConv2d(SlicedWeight, nn.Conv2d):
    """A 2-D convolution (no groups) that can run on its leading input / output channels.

    ``slim_in`` / ``slim_out`` say which side follows the width multiplier.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = False, slim_in: bool = True, slim_out: bool = True):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)
        self.slim_in = slim_in
        self.slim_out = slim_out
        self.width = 1.0

    def sliced(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, 1)


class SlimLinear(SlicedWeight, nn.Linear):
    """A linear layer whose input (and optionally output) follows the width multiplier.

    It is an ``nn.Linear``, so code that looks for the final ``nn.Linear`` classifier finds it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 slim_in: bool = True, slim_out: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.slim_in = slim_in
        self.slim_out = slim_out
        self.width = 1.0

    def sliced(self, x, weight, bias):
        return F.linear(x, weight, bias)


class SlimBatchNorm2d(Slimmable, nn.BatchNorm2d):
    """BatchNorm over the leading ceil(w * C) channels (see the module docstring for the statistics rule)."""

    def __init__(self, num_features: int):
        super().__init__(num_features)
        self.width = 1.0

    @property
    def active(self) -> int:
        return self.leading(self.num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.width == 1.0:
            return super().forward(x)
        c = self.active
        weight, bias = self.weight[:c], self.bias[:c]
        if self.training:
            # Batch statistics; the full network's running statistics stay as they are.
            return F.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
        return F.batch_norm(x, self.running_mean[:c], self.running_var[:c], weight, bias, False, 0.0, self.eps)


class SlimGroupNorm(Slimmable, nn.GroupNorm):
    """GroupNorm over the leading ceil(w * C) channels with the same number of groups."""

    def __init__(self, num_groups: int, num_channels: int):
        super().__init__(num_groups, num_channels)
        self.width = 1.0

    @property
    def active(self) -> int:
        return self.leading(self.num_channels)

    def check_width(self, width: float) -> float:
        """Return the validated width, or raise :class:`ConfigError` if its channels do not split into groups."""
        return check_group_width(width, self.num_channels, self.num_groups)

    def set_width(self, width: float) -> None:
        self.width = self.check_width(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.width == 1.0:
            return super().forward(x)
        c = self.active
        return F.group_norm(x, self.num_groups, self.weight[:c], self.bias[:c], self.eps)


SLIMMABLE_TYPES = (Slimmable,)


def set_module_width(module: nn.Module, width: float) -> None:
    """Set ``width`` on every slimmable layer inside ``module`` (itself included)."""
    width = check_width(width)
    layers = [m for m in module.modules() if isinstance(m, SLIMMABLE_TYPES)]
    for layer in layers:  # validate every layer first, so a failure leaves no half-set network
        if callable(getattr(layer, "check_width", None)):
            layer.check_width(width)
    for layer in layers:
        layer.set_width(width)
