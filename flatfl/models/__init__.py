"""flatfl's models, built by name: ``build_model(name, num_classes, in_channels, image_size, **kwargs)``.

Every model has ``features(x)``, ``classifier`` (the final ``nn.Linear``), ``feature_dim``, ``activation_modules()``
and ``flatfl_spec``; ResNets add ``set_width`` / ``forward_stages`` / ``forward_last_stage`` (FedAlign, GradAug)
and per-block ``survival`` (stochastic depth).
"""
from .base import FeatureClassifier
from .registry import build_model, model_names
from .resnet import ResNet, set_stochastic_depth
from .slimmable import slim_channels

__all__ = ["FeatureClassifier", "ResNet", "build_model", "model_names", "set_stochastic_depth", "slim_channels"]
