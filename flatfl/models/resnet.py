"""Slimmable ResNets with stochastic depth: ResNet-20, ResNet-56 (FedAlign / FedML), ResNet-18.

Architectures
-------------
* ``resnet56``: FedAlign's CIFAR model (``models/resnet_fedalign.py``, itself FedML's ``resnet56``): a 3x3 stem
  conv with 16 channels, then three stages of Bottleneck blocks [6, 6, 6] with widths 16 / 32 / 64 and expansion
  4 (stage outputs 64 / 128 / 256 channels; the stride-2 sits on the 3x3 conv of a stage's first block), global
  average pooling and a 256 -> C classifier. Projection shortcuts are a 1x1 conv + norm wherever the shape changes.
* ``resnet20``: He et al.'s CIFAR ResNet-20: the same stem, BasicBlocks [3, 3, 3] with widths 16 / 32 / 64, and
  the same 1x1-conv projection shortcuts as FedML's models (He et al.'s "option B", not the zero-padding option A).
* ``resnet18``: BasicBlocks [2, 2, 2, 2] with widths 64 / 128 / 256 / 512 and a 512 -> C classifier. ``stem="cifar"``
  (default) is a 3x3 stride-1 conv; ``stem="imagenet"`` is torchvision's 7x7 stride-2 conv + 3x3 stride-2 max-pool,
  the stem of both MAN's ``Resnet18`` (torchvision's, with every BatchNorm swapped for GroupNorm(2, C)) and FedAlign's
  ImageNet-200 ResNet-18 (BatchNorm). ``norm="gn"`` uses GroupNorm with ``gn_groups`` (2, as in MAN's code) groups.
* ``widths`` (each of the three): the per-stage widths, one positive int per stage (default the widths above; the
  stem takes the first stage's width), e.g. ``widths=(4, 8, 8)`` for a slim ResNet-20 of the same structure (blocks,
  strides, projection shortcuts, norms) as the differential tests train (``tests/combinations.py``).

Initialisation follows the FedAlign / torchvision code: Kaiming-normal (fan_out, ReLU) convolutions, unit-scale
zero-shift norms, PyTorch's default for the classifier, drawn from torch's global generator.

Slimming (docs/update-rules.md §18-19)
-------------------------------
Every convolution, norm and the classifier input are slimmable layers (:mod:`flatfl.models.slimmable`).
``set_width(w, stages="all")`` runs the whole network on the first ceil(w*C) channels of every layer (GradAug);
``set_width(w, stages="last")`` narrows only the last stage and the classifier input (the rest at full width).
``forward_stages(x)`` returns (f_prev, f_last, logits) with f_prev the second-to-last stage's output (layer2 for the
CIFAR ResNets) and f_last the last stage's; ``forward_last_stage(f_prev)`` runs the last stage at the current width
on the first ``last_stage_in_channels`` channels of f_prev, FedAlign's re-run of layer3 on a detached slice.

Stochastic depth (docs/update-rules.md §19; FedAlign ``models/resnet_stochdepth.py``)
----------------------------------------------------------------------------
Each block has ``survival`` (default 1.0). With survival p < 1, in training mode one Bernoulli(p) draw per block
and forward (from torch's global CPU generator) keeps or drops the residual branch for the whole batch; in eval mode
the block computes shortcut + p * branch. The block's output ReLU follows in every case, as in the FedAlign code.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..errors import ConfigError
from .contract import FeatureClassifier
from .slimmable import SlimBatchNorm2d, SlimConv2d, SlimGroupNorm, SlimLinear, check_width, set_module_width

NORMS = ("bn", "gn")
STEMS = ("cifar", "imagenet")


def make_norm(kind: str, channels: int, gn_groups: int) -> nn.Module:
    """A slimmable BatchNorm ("bn") or GroupNorm with ``gn_groups`` groups ("gn")."""
    if kind == "bn":
        return SlimBatchNorm2d(channels)
    return SlimGroupNorm(gn_groups, channels)


class ResidualBlock(nn.Module):
    """A residual block: relu_out(shortcut(x) + gate * branch(x)), the stochastic-depth gate as in the module doc."""

    expansion = 1

    def __init__(self):
        super().__init__()
        self.survival: float = 1.0
        #: in a channel-stacked network (several clients' copies side by side), where the per-client keep/drop
        #: draws come from: a callable ``gate_source(block) -> BlockGate`` (StochDepth sets it); None otherwise
        self.gate_source = None

    def branch(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.shortcut(x)
        if self.survival >= 1.0:
            total = shortcut + self.branch(x)
        elif self.training and self.gate_source is not None:
            total = self._gated(x, shortcut, self.gate_source(self))
        elif self.training:
            keep = bool(torch.rand(()) < self.survival)
            total = shortcut + self.branch(x) if keep else shortcut
        else:
            total = shortcut + self.survival * self.branch(x)
        return self.relu_out(total)

    def _gated(self, x: torch.Tensor, shortcut: torch.Tensor, gate: "BlockGate") -> torch.Tensor:
        """The clients of a stacked network, each keeping or dropping the branch by its own draw: the branch runs
        for all of them and is multiplied by each client's 0/1 gate, and the branch's BatchNorm running statistics
        of the clients that dropped it are put back, so each client gets what it gets alone (a dropped branch
        neither contributes nor moves its statistics)."""
        if gate.kept_by_all:
            return shortcut + self.branch(x)
        if gate.dropped_by_all:
            return shortcut
        m = gate.values.shape[0]
        norms = [mod for name, mod in self.named_modules()
                 if isinstance(mod, nn.BatchNorm2d) and mod.track_running_stats and not name.startswith("shortcut")]
        saved = [(mod, [getattr(mod, k).view(m, -1)[gate.dropped] for k in ("running_mean", "running_var")])
                 for mod in norms if mod.running_mean is not None]
        out = self.branch(x)
        for mod, (mean, var) in saved:  # through .data: the BatchNorm backward holds the statistics (unread)
            mod.running_mean.data.view(m, -1)[gate.dropped] = mean
            mod.running_var.data.view(m, -1)[gate.dropped] = var
        gated = out.reshape(out.shape[0], m, -1) * gate.values.view(1, m, 1)
        return shortcut + gated.view(out.shape)


class BlockGate:
    """One residual block's keep/drop draws for the M clients of a stacked network's forward pass: ``values`` a
    (M,) 0/1 tensor on the device, ``dropped`` the indices of the clients that drop the branch (a device tensor),
    and the two cases that need no masking, known on the host."""

    def __init__(self, values: torch.Tensor, dropped: torch.Tensor, kept_by_all: bool, dropped_by_all: bool):
        self.values, self.dropped = values, dropped
        self.kept_by_all, self.dropped_by_all = kept_by_all, dropped_by_all


def _shortcut(in_channels: int, out_channels: int, stride: int, norm: str, gn_groups: int) -> nn.Module:
    """Identity when shapes agree, else a 1x1 projection conv + norm (FedML / torchvision 'downsample')."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(SlimConv2d(in_channels, out_channels, 1, stride=stride),
                         make_norm(norm, out_channels, gn_groups))


class BasicBlock(ResidualBlock):
    """3x3 conv - norm - ReLU - 3x3 conv - norm, plus the shortcut, then ReLU."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int, norm: str, gn_groups: int):
        super().__init__()
        self.conv1 = SlimConv2d(in_channels, planes, 3, stride=stride, padding=1)
        self.norm1 = make_norm(norm, planes, gn_groups)
        self.relu1 = nn.ReLU()
        self.conv2 = SlimConv2d(planes, planes, 3, padding=1)
        self.norm2 = make_norm(norm, planes, gn_groups)
        self.shortcut = _shortcut(in_channels, planes, stride, norm, gn_groups)
        self.relu_out = nn.ReLU()

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(self.relu1(self.norm1(self.conv1(x)))))


class Bottleneck(ResidualBlock):
    """1x1 conv (planes) - 3x3 conv (planes, carries the stride) - 1x1 conv (4 * planes), norms and ReLUs between."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int, norm: str, gn_groups: int):
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = SlimConv2d(in_channels, planes, 1)
        self.norm1 = make_norm(norm, planes, gn_groups)
        self.relu1 = nn.ReLU()
        self.conv2 = SlimConv2d(planes, planes, 3, stride=stride, padding=1)
        self.norm2 = make_norm(norm, planes, gn_groups)
        self.relu2 = nn.ReLU()
        self.conv3 = SlimConv2d(planes, out_channels, 1)
        self.norm3 = make_norm(norm, out_channels, gn_groups)
        self.shortcut = _shortcut(in_channels, out_channels, stride, norm, gn_groups)
        self.relu_out = nn.ReLU()

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.norm1(self.conv1(x)))
        x = self.relu2(self.norm2(self.conv2(x)))
        return self.norm3(self.conv3(x))


BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(FeatureClassifier):
    """A slimmable ResNet: stem, stages ``layer1 .. layerN`` (the first at stride 1, the rest at stride 2), global
    average pooling, classifier. See the module docstring for the architectures, slimming and stochastic depth.
    """

    def __init__(self, block: str, blocks_per_stage: tuple[int, ...], stage_widths: tuple[int, ...],
                 num_classes: int, in_channels: int = 3, stem_width: int | None = None, stem: str = "cifar",
                 norm: str = "bn", gn_groups: int = 2):
        super().__init__()
        if block not in BLOCKS:
            raise ConfigError(f"unknown residual block '{block}'; choose one of {sorted(BLOCKS)}")
        if norm not in NORMS:
            raise ConfigError(f"unknown norm '{norm}'; choose one of {list(NORMS)}")
        if stem not in STEMS:
            raise ConfigError(f"unknown stem '{stem}'; choose one of {list(STEMS)}")
        if isinstance(gn_groups, bool) or not isinstance(gn_groups, int) or gn_groups < 1:
            raise ConfigError(f"gn_groups must be a positive integer, got {gn_groups!r}")
        if len(blocks_per_stage) != len(stage_widths) or len(stage_widths) < 2:
            raise ConfigError("a ResNet needs at least two stages and one width per stage")
        block_cls = BLOCKS[block]
        stem_width = stage_widths[0] if stem_width is None else stem_width
        all_widths = [stem_width] + [w * block_cls.expansion for w in stage_widths] + list(stage_widths)
        if norm == "gn" and any(c % gn_groups for c in all_widths):
            raise ConfigError(f"GroupNorm with {gn_groups} groups does not divide the channel counts {all_widths}")

        if stem == "cifar":
            self.stem_conv = SlimConv2d(in_channels, stem_width, 3, padding=1, slim_in=False)
            self.stem_pool = nn.Identity()
        else:
            self.stem_conv = SlimConv2d(in_channels, stem_width, 7, stride=2, padding=3, slim_in=False)
            self.stem_pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.stem_norm = make_norm(norm, stem_width, gn_groups)
        self.stem_relu = nn.ReLU()

        channels = stem_width
        self.num_stages = len(stage_widths)
        for index, (planes, count) in enumerate(zip(stage_widths, blocks_per_stage)):
            stride = 1 if index == 0 else 2
            blocks = []
            for b in range(count):
                blocks.append(block_cls(channels, planes, stride if b == 0 else 1, norm, gn_groups))
                channels = planes * block_cls.expansion
            setattr(self, f"layer{index + 1}", nn.Sequential(*blocks))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.feature_dim = channels
        self.classifier = SlimLinear(channels, num_classes, slim_in=True, slim_out=False)
        self.width = 1.0
        self.width_stages = "all"

        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    # ----- structure -----
    def stages(self) -> list[nn.Sequential]:
        """The residual stages ``layer1 .. layerN`` in order."""
        return [getattr(self, f"layer{i + 1}") for i in range(self.num_stages)]

    @property
    def last_stage(self) -> nn.Sequential:
        return getattr(self, f"layer{self.num_stages}")

    def residual_blocks(self) -> list[ResidualBlock]:
        """Every residual block, first to last."""
        return [block for stage in self.stages() for block in stage]

    def activation_modules(self) -> list[nn.Module]:
        """Each residual block's output ReLU, in forward order."""
        return [block.relu_out for block in self.residual_blocks()]

    # ----- forward passes -----
    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem_pool(self.stem_relu(self.stem_norm(self.stem_conv(x))))

    def _pool(self, f_last: torch.Tensor) -> torch.Tensor:
        return self.flatten(self.pool(f_last))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Global-average-pooled output of the last stage, (B, active channels)."""
        x = self._stem(x)
        for stage in self.stages():
            x = stage(x)
        return self._pool(x)

    def forward_stages(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(f_prev, f_last, logits): the second-to-last and last stage outputs and the logits (FedAlign step 1)."""
        x = self._stem(x)
        for stage in self.stages()[:-1]:
            x = stage(x)
        f_prev = x
        f_last = self.forward_last_stage(f_prev)
        return f_prev, f_last, self.classifier(self._pool(f_last))

    @property
    def last_stage_in_channels(self) -> int:
        """How many leading channels of f_prev the last stage reads at the current width."""
        return self.last_stage[0].conv1.active_in

    def forward_last_stage(self, f_prev: torch.Tensor) -> torch.Tensor:
        """Run the last stage at the current width on the first ``last_stage_in_channels`` channels of f_prev."""
        needed = self.last_stage_in_channels
        if f_prev.dim() != 4 or f_prev.shape[1] < needed:
            raise ValueError(f"forward_last_stage needs a (B, >={needed}, H, W) feature map, got {tuple(f_prev.shape)}")
        return self.last_stage(f_prev[:, :needed])

    # ----- width -----
    def set_width(self, width: float, stages: str = "all") -> None:
        """Run on the first ceil(width * C) channels: of every layer (``stages="all"``) or of the last stage and the
        classifier input only (``stages="last"``, everything before at full width). ``set_width(1.0)`` restores the
        full network exactly."""
        width = check_width(width)
        if stages == "all":
            set_module_width(self, width)
        elif stages == "last":
            set_module_width(self, 1.0)
            set_module_width(self.last_stage, width)
            set_module_width(self.classifier, width)
        else:
            raise ConfigError(f"set_width stages must be 'all' or 'last', got {stages!r}")
        self.width = width
        self.width_stages = stages


def set_stochastic_depth(model: nn.Module, last: float = 0.5) -> list[float]:
    """Set block survival probabilities linearly from 1.0 (first block) to ``last`` (last block) (docs/update-rules.md §19).

    ``last=1.0`` switches stochastic depth off. Returns the survival of each block. When the model records a
    ``flatfl_spec`` with a ``stochastic_depth`` entry, it is updated so that a rebuilt model evaluates the same.
    """
    try:
        last = float(last)
    except (TypeError, ValueError):
        raise ConfigError(f"stochastic depth survival must be a number in (0, 1], got {last!r}") from None
    if not (0.0 < last <= 1.0) or math.isnan(last):
        raise ConfigError(f"stochastic depth survival must lie in (0, 1], got {last!r}")
    if not hasattr(model, "residual_blocks"):
        raise ConfigError(f"{type(model).__name__} has no residual blocks; stochastic depth needs a ResNet")
    blocks = model.residual_blocks()
    n = len(blocks)
    survivals = [1.0 - (1.0 - last) * i / (n - 1) if n > 1 else 1.0 for i in range(n)]
    for block, survival in zip(blocks, survivals):
        block.survival = survival
    spec = getattr(model, "flatfl_spec", None)
    if isinstance(spec, dict) and "stochastic_depth" in spec.get("kwargs", {}):
        spec["kwargs"]["stochastic_depth"] = last
    return survivals
