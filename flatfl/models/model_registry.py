"""Build models by name: ``build_model(name, num_classes, in_channels, image_size, **kwargs)``.

The built model carries ``model.flatfl_spec = {"name": name, "kwargs": {...}}`` with every constructor argument,
defaults filled in, so ``build_model(spec["name"], **spec["kwargs"])`` rebuilds the same architecture (checkpoints
store this spec). Unknown names, unknown keyword arguments, bad values and inputs a model cannot take raise
:class:`flatfl.errors.ConfigError` with one line naming the problem.

Adding a model: write a builder ``f(num_classes, in_channels, image_size, *, extra=default, ...)`` that returns a
:class:`flatfl.models.contract.FeatureClassifier` and list it in ``_BUILDERS``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch.nn as nn

from ..errors import ConfigError, unknown_name
from .cnn import MLP, CifarCNN, DigitsCNN, EmnistCNN, FlsamCNN, TinyImageNetCNN, hidden_sizes
from .resnet import ResNet, set_stochastic_depth


def _cifar_cnn(num_classes, in_channels, image_size, channels=(64, 64), hidden=(384, 192)):
    return CifarCNN(num_classes, in_channels, image_size, channels, hidden)


def _tiny_cnn(num_classes, in_channels, image_size):
    return TinyImageNetCNN(num_classes, in_channels, image_size)


def _emnist_cnn(num_classes, in_channels, image_size, channels=(32, 64), hidden=2048):
    return EmnistCNN(num_classes, in_channels, image_size, channels, hidden)


def _flsam_cnn(num_classes, in_channels, image_size, channels=(32, 64), hidden=512):
    return FlsamCNN(num_classes, in_channels, image_size, channels, hidden)


def _digits_cnn(num_classes, in_channels, image_size):
    return DigitsCNN(num_classes, in_channels, image_size)


def _tiny(num_classes, in_channels, image_size, hidden=32):
    """Flatten -> Linear(hidden) -> tanh -> Linear C: 2,410 parameters on 1x8x8 with 10 classes (dense-Hessian
    tests). tanh keeps the loss twice differentiable everywhere."""
    return MLP(num_classes, in_channels * image_size * image_size, hidden_sizes("tiny", hidden), "tanh")


def _mlp(num_classes, in_channels, image_size, hidden=(64,)):
    return MLP(num_classes, in_channels * image_size * image_size, hidden_sizes("mlp", hidden), "relu")


def _with_stochastic_depth(model: ResNet, stochastic_depth) -> ResNet:
    set_stochastic_depth(model, stochastic_depth)
    return model


def _stage_widths(model_name: str, widths, stages: int) -> tuple[int, ...]:
    """A ResNet's per-stage widths (a list or tuple of ``stages`` positive ints), or one ConfigError line."""
    if (isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or len(widths) != stages
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        raise ConfigError(f"model '{model_name}': widths must be {stages} positive ints (one per stage), "
                          f"got {widths!r}")
    return tuple(int(w) for w in widths)


def _resnet20(num_classes, in_channels, image_size, norm="bn", gn_groups=2, stochastic_depth=1.0,
              widths=(16, 32, 64)):
    model = ResNet("basic", (3, 3, 3), _stage_widths("resnet20", widths, 3), num_classes, in_channels, norm=norm,
                   gn_groups=gn_groups)
    return _with_stochastic_depth(model, stochastic_depth)


def _resnet56(num_classes, in_channels, image_size, norm="bn", gn_groups=2, stochastic_depth=1.0,
              widths=(16, 32, 64)):
    model = ResNet("bottleneck", (6, 6, 6), _stage_widths("resnet56", widths, 3), num_classes, in_channels,
                   norm=norm, gn_groups=gn_groups)
    return _with_stochastic_depth(model, stochastic_depth)


def _resnet18(num_classes, in_channels, image_size, norm="bn", gn_groups=2, stem="cifar", stochastic_depth=1.0,
              widths=(64, 128, 256, 512)):
    model = ResNet("basic", (2, 2, 2, 2), _stage_widths("resnet18", widths, 4), num_classes, in_channels, stem=stem,
                   norm=norm, gn_groups=gn_groups)
    return _with_stochastic_depth(model, stochastic_depth)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "cifar-cnn": _cifar_cnn,
    "tiny-cnn": _tiny_cnn,
    "emnist-cnn": _emnist_cnn,
    "flsam-cnn": _flsam_cnn,
    "digits-cnn": _digits_cnn,
    "tiny": _tiny,
    "mlp": _mlp,
    "resnet20": _resnet20,
    "resnet56": _resnet56,
    "resnet18": _resnet18,
}

_REQUIRED = ("num_classes", "in_channels", "image_size")


def model_names() -> list[str]:
    """The names :func:`build_model` accepts, sorted."""
    return sorted(_BUILDERS)


def _positive_int(name: str, what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model '{name}': {what} must be a positive integer, got {value!r}")
    return value


def build_model(name: str, num_classes: int, in_channels: int, image_size: int, **kwargs) -> nn.Module:
    """Build the model ``name`` for ``in_channels`` x ``image_size`` x ``image_size`` inputs and ``num_classes``.

    Extra keyword arguments are the model's options (e.g. ``hidden`` for ``mlp``, ``norm`` for ``resnet18``).
    The result has ``flatfl_spec`` (see the module docstring) and is in training mode.
    """
    if name not in _BUILDERS:
        raise unknown_name("model", name, model_names())
    builder = _BUILDERS[name]
    signature = inspect.signature(builder)
    options = [p for p in signature.parameters if p not in _REQUIRED]
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        accepted = ", ".join(options) if options else "none"
        raise ConfigError(f"model '{name}' does not accept {', '.join(unknown)}; its options: {accepted}")
    arguments = {"num_classes": _positive_int(name, "num_classes", num_classes),
                 "in_channels": _positive_int(name, "in_channels", in_channels),
                 "image_size": _positive_int(name, "image_size", image_size)}
    for option in options:
        arguments[option] = kwargs.get(option, signature.parameters[option].default)
    model = builder(**arguments)
    model.flatfl_spec = {"name": name, "kwargs": dict(arguments)}
    return model
