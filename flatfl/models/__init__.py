"""flatfl's models, built by name: ``build_model(name, num_classes, in_channels, image_size, **kwargs)``.

Every model has ``features(x)``, ``classifier`` (the final ``nn.Linear``), ``feature_dim``, ``activation_modules()``
and ``flatfl_spec``; ResNets add ``set_width`` / ``forward_stages`` / ``forward_last_stage`` (FedAlign, GradAug)
and per-block ``survival`` (stochastic depth). :mod:`flatfl.models.model_spec` describes a trained network (projection
head, survival) as plain data and rebuilds it.
"""
from .contract import FeatureClassifier
from .projection import ProjectionHeadModel
from .model_registry import build_model, model_names
from .resnet import ResNet, set_stochastic_depth
from .slimmable import slim_channels
from .model_spec import architecture_spec, model_from_spec

__all__ = ["FeatureClassifier", "ProjectionHeadModel", "ResNet", "architecture_spec", "build_model", "model_from_spec",
           "model_names", "set_stochastic_depth", "slim_channels"]
