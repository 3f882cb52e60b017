"""A model's full architecture as plain data, and the network rebuilt from it: what a checkpoint stores so that
the analysis tools rebuild the trained network from :mod:`flatfl.models` alone.

A spec is ``{"name": registry name, "kwargs": {...}}`` (:func:`flatfl.models.build_model`; ``name`` is
``"custom"`` for a network of the user's, rebuilt by its factory) plus what training changed on top of it:

* ``projection_head``: the output size of a :class:`~flatfl.models.projection.ProjectionHeadModel` around the
  network (MOON);
* ``survival``: the survival probability of each residual block (stochastic depth), when any is below 1;
* ``survival_last`` (checkpoints of format 1): the last block's survival of the linear schedule
  :func:`~flatfl.models.resnet.set_stochastic_depth` sets (1.0 at the first block).

:func:`architecture_spec` reads these off a built model; :func:`model_from_spec` applies them again.
"""
from __future__ import annotations

import copy

from torch import nn

from ..errors import ConfigError
from .projection import ProjectionHeadModel
from .model_registry import build_model
from .resnet import set_stochastic_depth

MAX_PROJECTION = 1 << 16  # a bound on the head a file may ask for (MOON uses 256)


def residual_network(model: nn.Module) -> nn.Module | None:
    """The module holding residual blocks (the model itself, or the network inside a wrapper), else None."""
    return next((m for m in model.modules() if callable(getattr(m, "residual_blocks", None))), None)


def architecture_spec(model: nn.Module, base: dict | None = None) -> dict:
    """The full spec of ``model``: ``base`` (default: ``model.flatfl_spec``) with the projection head and the
    blocks' survival probabilities of the model as it is now. A new dict; ``base`` is not changed."""
    base = base if base is not None else getattr(model, "flatfl_spec", None)
    if not isinstance(base, dict):
        raise ConfigError(f"{type(model).__name__} has no flatfl_spec: pass the base spec")
    spec = copy.deepcopy({k: v for k, v in base.items() if k not in ("projection_head", "survival", "survival_last")})
    if isinstance(model, ProjectionHeadModel):
        spec["projection_head"] = model.proj_dim
    net = residual_network(model)
    if net is not None:
        survival = [float(b.survival) for b in net.residual_blocks()]
        if any(s != 1.0 for s in survival):
            spec["survival"] = survival
    return spec


def set_survival(model: nn.Module, survival) -> None:
    """Give each residual block of ``model`` its recorded survival probability."""
    net = residual_network(model)
    blocks = net.residual_blocks() if net is not None else []
    if not isinstance(survival, (list, tuple)) or len(survival) != len(blocks):
        raise ConfigError(f"the spec records {len(survival) if isinstance(survival, (list, tuple)) else '?'} "
                          f"residual-block survival values; {type(model).__name__} has {len(blocks)} blocks")
    for block, value in zip(blocks, survival):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
            raise ConfigError(f"a residual block's survival must lie in (0, 1], got {value!r}")
        block.survival = float(value)


def model_from_spec(spec: dict, model: nn.Module | None = None) -> nn.Module:
    """The network ``spec`` describes: built by name (or ``model``, the user's network for a custom spec, or the
    base network to complete), with the recorded survival probabilities and projection head. Bad entries raise
    :class:`ConfigError`."""
    if not isinstance(spec, dict):
        raise ConfigError(f"a model spec must be a table, got {type(spec).__name__}")
    if model is None:
        kwargs = spec.get("kwargs")
        if not isinstance(spec.get("name"), str) or not isinstance(kwargs, dict):
            raise ConfigError("a model spec needs a 'name' and a table of 'kwargs'")
        model = build_model(spec["name"], **kwargs)
    if spec.get("survival_last") is not None:
        net = residual_network(model)
        set_stochastic_depth(net if net is not None else model, spec["survival_last"])  # ConfigError without blocks
    if spec.get("survival") is not None:
        set_survival(model, spec["survival"])
    head = spec.get("projection_head")
    if head is not None and not isinstance(model, ProjectionHeadModel):
        if isinstance(head, bool) or not isinstance(head, int) or not 1 <= head <= MAX_PROJECTION:
            raise ConfigError(f"projection_head must be an integer in 1..{MAX_PROJECTION}, got {head!r}")
        model = ProjectionHeadModel(model, head)
    return model
