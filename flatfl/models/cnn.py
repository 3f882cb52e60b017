"""Plain convolutional and fully connected models.

Every non-linearity is its own module instance (never ``F.relu``, never reused) so forward hooks on
``activation_modules()`` capture each activation exactly once (docs/update-rules.md §16). Non-linearities are not in-place,
so a captured activation is never overwritten later in the forward pass. Weights use PyTorch's default
initialisation, drawn from torch's global generator (the engine seeds it before building a model).

The spatial sizes follow the input: a model accepts any square input whose feature maps do not vanish, and the
first fully connected layer is sized from the flattened map (e.g. 1600 for the CIFAR CNN on 32x32).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ..errors import ConfigError
from .contract import FeatureClassifier, conv_output_size, require_positive_size


def conv_stages(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The two convolution stages the CNNs here share: conv1 -> ReLU -> pool1, conv2 -> ReLU -> pool2."""
    x = net.pool1(net.relu1(net.conv1(x)))
    return net.pool2(net.relu2(net.conv2(x)))


class CifarCNN(FeatureClassifier):
    """The FedDyn / MAN CIFAR CNN (docs/update-rules.md §20; MAN supp. Table 4, left column).

    Conv(in->64, 5x5, no padding) -> ReLU -> MaxPool2 -> Conv(64->64, 5x5) -> ReLU -> MaxPool2 -> flatten (1600 on
    32x32) -> FC 384 -> ReLU -> FC 192 -> ReLU -> FC C. No normalisation layers.
    MAN's activations (§16): conv1 and conv2 after ReLU and before pooling, fc1 and fc2 after ReLU.

    ``channels`` (the two convolutions) and ``hidden`` (the two hidden FC layers) set the widths; the defaults are the
    paper's. The same network at LeNet-5's widths, ``channels=(6, 16), hidden=(120, 84)``, is the family's small
    member (44,426 parameters on 1x28x28), the fmnist-cnn reproduction's network.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32,
                 channels: Sequence[int] = (64, 64), hidden: Sequence[int] = (384, 192)):
        super().__init__()
        c1, c2 = _two_widths("cifar-cnn", "channels", channels)
        h1, h2 = _two_widths("cifar-cnn", "hidden", hidden)
        s1 = conv_output_size(image_size, 5)
        require_positive_size("cifar-cnn", image_size, s1, "conv1")
        p1 = s1 // 2
        require_positive_size("cifar-cnn", image_size, p1, "pool1")
        s2 = conv_output_size(p1, 5)
        require_positive_size("cifar-cnn", image_size, s2, "conv2")
        p2 = s2 // 2
        require_positive_size("cifar-cnn", image_size, p2, "pool2")
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=5)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(c2 * p2 * p2, h1)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(h1, h2)
        self.relu4 = nn.ReLU()
        self.feature_dim = h2
        self.classifier = nn.Linear(h2, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu3(self.fc1(self.flatten(conv_stages(self, x))))
        return self.relu4(self.fc2(x))

    def activation_modules(self) -> list[nn.Module]:
        return [self.relu1, self.relu2, self.relu3, self.relu4]


class TinyImageNetCNN(FeatureClassifier):
    """The MAN Tiny-ImageNet ConvNet (MAN supp. Table 4, right column; fedMAN ``utils_models.py`` 'ConvNet').

    3 x [Conv(3x3, padding 1, 64 channels) -> GroupNorm(4, 64) -> ReLU -> MaxPool2] -> flatten (4096 on 64x64)
    -> FC 512 -> ReLU -> FC 384 -> ReLU -> FC C.
    MAN's activations follow the ``man_code_sam`` definition (§16): conv1 and conv2 after ReLU and before pooling,
    conv3 *after* its pooling (so the hooked module is ``pool3``), fc1 and fc2 after ReLU.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 64):
        super().__init__()
        size = image_size
        for stage in (1, 2, 3):
            size //= 2
            require_positive_size("tiny-cnn", image_size, size, f"pool{stage}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, padding=1)
        self.norm1 = nn.GroupNorm(4, 64)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.norm2 = nn.GroupNorm(4, 64)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2, 2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.norm3 = nn.GroupNorm(4, 64)
        self.relu3 = nn.ReLU()
        self.pool3 = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64 * size * size, 512)
        self.relu4 = nn.ReLU()
        self.fc2 = nn.Linear(512, 384)
        self.relu5 = nn.ReLU()
        self.feature_dim = 384
        self.classifier = nn.Linear(384, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.norm1(self.conv1(x))))
        x = self.pool2(self.relu2(self.norm2(self.conv2(x))))
        x = self.pool3(self.relu3(self.norm3(self.conv3(x))))
        x = self.relu4(self.fc1(self.flatten(x)))
        return self.relu5(self.fc2(x))

    def activation_modules(self) -> list[nn.Module]:
        return [self.relu1, self.relu2, self.pool3, self.relu4, self.relu5]


class ConvPoolNet(FeatureClassifier):
    """Two 'same'-padded convolutions, each followed by ReLU and 2x2 max pooling, then one hidden fully connected
    layer with ReLU and the classifier; MAN's activations are the three ReLUs."""

    def __init__(self, name: str, num_classes: int, in_channels: int, image_size: int, channels: tuple[int, int],
                 kernel: int, hidden: int):
        super().__init__()
        size = image_size
        for stage in (1, 2):
            size //= 2
            require_positive_size(name, image_size, size, f"pool{stage}")
        self.conv1 = nn.Conv2d(in_channels, channels[0], kernel_size=kernel, padding=kernel // 2)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size=kernel, padding=kernel // 2)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(channels[1] * size * size, hidden)
        self.relu3 = nn.ReLU()
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu3(self.fc1(self.flatten(conv_stages(self, x))))

    def activation_modules(self) -> list[nn.Module]:
        return [self.relu1, self.relu2, self.relu3]


class EmnistCNN(ConvPoolNet):
    """The LEAF FEMNIST CNN (Caldas et al. 2018, ``models/femnist/cnn.py``), the standard CNN for 28x28 EMNIST.

    Conv(in->32, 5x5, 'same') -> ReLU -> MaxPool2 -> Conv(32->64, 5x5, 'same') -> ReLU -> MaxPool2 -> flatten
    (3136 on 28x28) -> FC 2048 -> ReLU -> FC C. (The FedSAM slides do not name their EMNIST model; LEAF's is the
    common choice of the FL literature for EMNIST/FEMNIST.) Hidden activations: both conv ReLUs (before pooling,
    as in the CIFAR CNN) and the fc1 ReLU. ``channels`` (two ints) and ``hidden`` (one int) give narrower networks
    of the same structure.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, image_size: int = 28, channels=(32, 64),
                 hidden=2048):
        super().__init__("emnist-cnn", num_classes, in_channels, image_size, *conv_pool_widths("emnist-cnn", channels,
                                                                                              hidden, 5))


class DigitsCNN(ConvPoolNet):
    """A small, fast CNN for 8x8 grey digits (scikit-learn ``load_digits``), the default of the quick runs.

    Conv(in->16, 3x3, pad 1) -> ReLU -> MaxPool2 -> Conv(16->32, 3x3, pad 1) -> ReLU -> MaxPool2 -> flatten
    (128 on 8x8) -> FC 64 -> ReLU -> FC C: 13,706 parameters for 1x8x8 inputs and 10 classes. Pooling after each
    convolution keeps the second convolution and the first FC layer small, so Hessian top-200 runs stay cheap.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, image_size: int = 8):
        super().__init__("digits-cnn", num_classes, in_channels, image_size, (16, 32), 3, 64)


class FlsamCNN(ConvPoolNet):
    """FL-SAM's CIFAR-10 CNN (harrylee999/FL-SAM, ``system/flcore/trainmodel/CNN.py`` ``FedAvgNetCIFAR``), the "CNN"
    of its README's seconds-a-round table.

    Conv(in->32, 5x5, pad 2) -> ReLU -> MaxPool2 -> Conv(32->64, 5x5, pad 2) -> ReLU -> MaxPool2 -> flatten (4096 on
    32x32) -> FC 512 -> ReLU -> FC C: 2,156,490 parameters for 3x32x32 inputs and 10 classes. The layers of
    ``emnist-cnn`` with a hidden layer of 512. ``channels`` (two ints) and ``hidden`` (one int) give narrower
    networks of the same structure. FL-SAM's code applies one ReLU module three times; here each is its
    own module (MAN hooks each activation once).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, channels=(32, 64),
                 hidden=512):
        super().__init__("flsam-cnn", num_classes, in_channels, image_size, *conv_pool_widths("flsam-cnn", channels,
                                                                                             hidden, 5))


def conv_pool_widths(model_name: str, channels, hidden, kernel: int) -> tuple[tuple[int, int], int, int]:
    """A :class:`ConvPoolNet`'s checked (channels, kernel, hidden): two positive channel counts and one positive
    hidden width, or one ConfigError line naming the model."""
    widths = _two_widths(model_name, "channels", channels)
    sizes = hidden_sizes(model_name, hidden)
    if len(sizes) != 1:
        raise ConfigError(f"model '{model_name}': hidden must be one positive int (its one hidden layer), got "
                          f"{hidden!r}")
    return widths, kernel, sizes[0]


def _two_widths(model_name: str, what: str, widths) -> tuple[int, int]:
    """Two positive layer widths (a list or tuple of two ints), or one ConfigError line."""
    if (isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or len(widths) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        raise ConfigError(f"model '{model_name}': {what} must be two positive ints, got {widths!r}")
    return int(widths[0]), int(widths[1])


def hidden_sizes(model_name: str, hidden) -> tuple[int, ...]:
    """Normalise a hidden-layer spec (an int or a sequence of ints) to a tuple of positive ints."""
    if isinstance(hidden, bool):
        raise ConfigError(f"model '{model_name}': hidden must be a positive int or a list of them, got {hidden!r}")
    if isinstance(hidden, int):
        hidden = (hidden,)
    if not isinstance(hidden, Sequence) or isinstance(hidden, str):
        raise ConfigError(f"model '{model_name}': hidden must be a positive int or a list of them, got {hidden!r}")
    sizes = tuple(hidden)
    if any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in sizes):
        raise ConfigError(f"model '{model_name}': hidden sizes must be positive ints, got {list(sizes)}")
    return sizes


class MLP(FeatureClassifier):
    """Flatten -> [Linear -> non-linearity] per hidden size -> Linear C, for any input size.

    ``activation`` is "relu" (the ``mlp`` model) or "tanh" (the ``tiny`` model: smooth, so its Hessian is that of a
    twice-differentiable function everywhere). With no hidden layers the features are the flattened input.
    """

    def __init__(self, num_classes: int, in_features: int, hidden: Sequence[int] = (64,), activation: str = "relu"):
        super().__init__()
        nonlinearities = {"relu": nn.ReLU, "tanh": nn.Tanh}
        if activation not in nonlinearities:
            raise ConfigError(f"unknown activation '{activation}'; choose one of {sorted(nonlinearities)}")
        self.flatten = nn.Flatten()
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nonlinearities[activation]()]
            width = size
        self.hidden = nn.Sequential(*layers)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden(self.flatten(x))

    def activation_modules(self) -> list[nn.Module]:
        return [m for m in self.hidden if not isinstance(m, nn.Linear)]
