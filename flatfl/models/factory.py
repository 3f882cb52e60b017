"""Your own network, named as ``module:function`` (``--model-factory my_models:my_net``) or by its file,
``path/to/file.py:function`` (``--model-factory ../nets/my_models.py:my_net``, from any folder).

The function is imported (a module name: the current directory is searched first, as ``python -m`` does, then
``sys.path``; a file: its folder is put first on ``sys.path`` and the module imported by its name) and called with no
arguments; it must return an ``nn.Module`` of the architecture the checkpoint was trained with. Only the weights come
from the checkpoint (``torch.load(weights_only=True)``): the model object itself is never unpickled. A factory that a
checkpoint or ``config.json`` names, rather than the user, is imported only from the current directory
(:func:`check_recorded_factory`). What the import and the call change of the process (the working directory, torch's
grad mode, the standard streams) is put back (:mod:`flatfl.utils.user_code`).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from ..utils.user_code import guard_forward, user_code

__all__ = ["check_factory_name", "import_function", "model_from_factory", "check_recorded_factory"]


def split_factory(spec, flag: str = "--model-factory", example: str = "my_models:my_net") -> tuple[str, str, str | None]:
    """``(module, function, file)`` of a function's name: ``module:function`` (dotted module path, dotted attribute
    path; file None) or ``path/to/file.py:function`` (the module is the file's name), else a :class:`ConfigError`
    naming ``flag``."""
    forms = f"'module:function' or 'path/to/file.py:function' (e.g. {example})"
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{flag} must be {forms}, got {spec!r}")
    where, func = spec.rsplit(":", 1)
    file = None
    if where.endswith(".py"):
        file = where
        module = os.path.basename(where)[:-3]
        parts = [module] + func.split(".")
    else:
        module = where
        parts = module.split(".") + func.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{flag} must be {forms}, got {spec!r}")
    return module, func, file


def check_factory_name(spec) -> str:
    """``module:function`` or ``path/to/file.py:function``, else a :class:`ConfigError`."""
    split_factory(spec)
    return spec


def _import_file(spec: str, flag: str, module_name: str, file: str):
    """The module of ``file``: its folder first on ``sys.path`` (worker processes unpickling the model import it
    the same way), then imported by its name; a different module of that name already imported is refused."""
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{flag} {spec}: no file {file} (from {os.getcwd()})")
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        if origin is None or Path(origin).resolve() != path:
            raise ConfigError(f"{flag} {spec}: another module named {module_name!r} is already imported "
                              f"(from {origin or 'a built-in'}); rename {path.name}")
        return loaded
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(module_name)


def import_function(spec: str, flag: str = "--model-factory", example: str = "my_models:my_net"):
    """The function ``spec`` names (``module:function``: the current directory is searched first, as ``python -m``
    does, then ``sys.path``; ``path/to/file.py:function``: that file's folder first), imported, not called: nothing
    but the named module is imported. Every failure is one :class:`ConfigError` line naming ``flag``."""
    module_name, func_name, file = split_factory(spec, flag, example)
    top = module_name.split(".")[0]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # kept: worker processes unpickling the model import it too
        sys.path.insert(0, cwd)
    try:
        with user_code(f"{flag} {spec} (while imported)"):
            module = importlib.import_module(module_name) if file is None else \
                _import_file(spec, flag, module_name, file)
    except ModuleNotFoundError as e:
        if file is None and e.name == top:
            raise ConfigError(f"{flag} {spec}: cannot import {module_name!r}: no {top}.py in the current "
                              f"directory ({cwd}) nor on PYTHONPATH; run flatfl from the folder that holds it, or "
                              f"name its file: {flag} PATH/{top}.py:{func_name}") from None
        raise ConfigError(f"{flag} {spec}: cannot import {module_name!r} ({e})") from None
    except SystemExit as e:  # sys.exit() while imported: an error, not flatfl's own exit status
        raise ConfigError(f"{flag} {spec}: importing {module_name!r} called sys.exit({e.code!r}); the "
                          "module must define the function, not exit") from None
    except ImportError as e:
        raise ConfigError(f"{flag} {spec}: cannot import {module_name!r} ({e})") from None
    except SyntaxError as e:
        raise ConfigError(f"{flag} {spec}: {module_name!r} has a syntax error ({os.path.basename(e.filename or '?')} "
                          f"line {e.lineno}: {e.msg})") from None
    except Exception as e:  # the module raised while it was imported
        raise ConfigError(f"{flag} {spec}: importing {module_name!r} failed: {type(e).__name__}: "
                          f"{str(e)[:160]}") from None
    target = module
    for part in func_name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{flag} {spec}: {module_name!r} has no {func_name!r}")
    if not callable(target):
        raise ConfigError(f"{flag} {spec}: {func_name!r} is not callable")
    return target


def model_from_factory(spec: str) -> nn.Module:
    """Import ``module:function`` (or ``path/to/file.py:function``), call it with no arguments and check that it
    returns an ``nn.Module``."""
    target = import_function(spec)
    func_name = spec.rsplit(":", 1)[1]
    try:
        with user_code(f"--model-factory {spec}"):
            model = target()
    except SystemExit as e:
        raise ConfigError(f"--model-factory {spec}: {func_name}() called sys.exit({e.code!r}) instead of returning "
                          "a network") from None
    except Exception as e:
        raise ConfigError(f"--model-factory {spec}: calling {func_name}() failed: {type(e).__name__}: "
                          f"{str(e)[:200]}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model-factory {spec}: {func_name}() returned a {type(model).__name__}, "
                          "not a torch.nn.Module")
    # what its forward changes of the process (folder, grad mode, streams) put back after every call
    return guard_forward(model, f"the network of --model-factory {spec}")


def check_recorded_factory(spec, source: str) -> str:
    """A factory named *inside a file* (a checkpoint's model spec) is imported only when its module lies in the
    current directory, where the user's own ``my_models.py`` is: a checkpoint from someone else cannot make flatfl
    import and call an installed module (``os:fork``). Anything else needs ``--model-factory`` given explicitly."""
    name, func, file = split_factory(spec)
    top = name.split(".")[0]
    cwd = Path.cwd().resolve()
    found = None
    if file is not None:  # a file the run named: inside the current directory, links resolved
        cand = (cwd / Path(file).expanduser()).resolve()
        found = cand if cand.is_file() and cand.is_relative_to(cwd) else None
    else:
        for cand in (cwd / top, cwd / f"{top}.py"):
            if cand.is_dir() and (cand / "__init__.py").is_file() or cand.is_file():
                found = cand
    loaded = sys.modules.get(top)
    origin = getattr(loaded, "__file__", None) if loaded is not None else found
    if found is None or origin is None or not Path(origin).resolve().is_relative_to(cwd):
        hint = "" if file is not None else \
            f" (run from the folder that holds {top}.py, or put it on PYTHONPATH), or --model-factory PATH/{top}.py:{func}"
        raise ConfigError(f"{source} names the model factory {spec!r}, whose module is not in the current "
                          f"directory; flatfl imports it only when you name it yourself: --model-factory {spec}{hint}")
    return spec
