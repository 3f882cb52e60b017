"""Your own network, named as ``module:function`` (``--model-factory my_models:my_net``).

The function is imported (the current directory is searched first, as ``python -m`` does) and called with no
arguments; it must return an ``nn.Module`` of the architecture the checkpoint was trained with. Only the weights come
from the checkpoint (``torch.load(weights_only=True)``): the model object itself is never unpickled.
"""
from __future__ import annotations

import importlib
import os
import sys

from torch import nn

from ..errors import ConfigError

__all__ = ["check_factory_name", "model_from_factory", "describe_model_class"]


def check_factory_name(spec) -> str:
    """``module:function`` (dotted module path, dotted attribute path), else a :class:`ConfigError`."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"--model-factory must be 'module:function' (e.g. my_models:my_net), got {spec!r}")
    module, func = spec.split(":")
    parts = module.split(".") + func.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"--model-factory must be 'module:function' (e.g. my_models:my_net), got {spec!r}")
    return spec


def model_from_factory(spec: str) -> nn.Module:
    """Import ``module:function``, call it with no arguments and check that it returns an ``nn.Module``."""
    module_name, func_name = check_factory_name(spec).split(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # kept: worker processes unpickling the model import it too
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model-factory {spec}: cannot import {module_name!r} ({e})") from None
    except SyntaxError as e:
        raise ConfigError(f"--model-factory {spec}: {module_name!r} has a syntax error ({os.path.basename(e.filename or '?')} "
                          f"line {e.lineno}: {e.msg})") from None
    except Exception as e:  # the module raised while it was imported
        raise ConfigError(f"--model-factory {spec}: importing {module_name!r} failed: {type(e).__name__}: "
                          f"{str(e)[:160]}") from None
    target = module
    for part in func_name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"--model-factory {spec}: {module_name!r} has no {func_name!r}")
    if not callable(target):
        raise ConfigError(f"--model-factory {spec}: {func_name!r} is not callable")
    try:
        model = target()
    except Exception as e:
        raise ConfigError(f"--model-factory {spec}: calling {func_name}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model-factory {spec}: {func_name}() returned a {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model


def check_recorded_factory(spec, source: str) -> str:
    """A factory named *inside a file* (a checkpoint's model spec) is imported only when its module lies in the
    current directory, where the user's own ``my_models.py`` is: a checkpoint from someone else cannot make flatfl
    import and call an installed module (``os:fork``). Anything else needs ``--model-factory`` given explicitly."""
    from pathlib import Path

    name = check_factory_name(spec).split(":")[0]
    top = name.split(".")[0]
    cwd = Path.cwd().resolve()
    found = None
    for cand in (cwd / top, cwd / f"{top}.py"):
        if cand.is_dir() and (cand / "__init__.py").is_file() or cand.is_file():
            found = cand
    loaded = sys.modules.get(top)
    origin = getattr(loaded, "__file__", None) if loaded is not None else found
    if found is None or origin is None or not Path(origin).resolve().is_relative_to(cwd):
        raise ConfigError(f"{source} names the model factory {spec!r}, whose module is not in the current "
                          "directory; flatfl imports it only when you pass --model-factory "
                          f"{spec} yourself")
    return spec


def describe_model_class(model: nn.Module) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"
