"""What identifies a network of the user's beyond its parameter shapes, as plain data: recorded with a run
(a custom model spec's ``structure``) and compared whenever the network is built again from its factory.

:func:`network_structure` records three things.

* ``modules``: one ``[name, class, settings]`` per module in ``named_modules()`` order, the settings as its
  ``extra_repr()`` shows them (sizes, ``eps``, ``p``, ``inplace``...): a ReLU that became a Tanh, or a Dropout whose
  ``p`` changed, tells.
* ``values``: what a module of the user's holds besides parameters, buffers and submodules (an activation function
  passed in, a scale, a settings object, a tensor kept as a plain attribute), and every non-persistent buffer of
  any module, which no checkpoint saves: the factory must build it again the same way. Functions are named
  (``torch.tanh``; one of the user's by its source's digest), tensors by dtype, shape and the sha256 of their
  values, settings objects by their fields.
* ``code``: the sha256 of the syntax tree (comments, blank lines and docstrings left out) of the code the network
  runs that is the user's own: each class of the network (its own bases included), the factory, and, followed
  through the names their source uses, the functions, classes and module-level constants of the user's modules
  they call, so that a helper called in ``forward`` tells. None where Python cannot show the source.

A difference in ``modules`` or ``values`` is another network (:func:`structure_difference`: refused by the
callers); changed ``code`` may be a refactoring, so it is said aloud (:func:`code_changes`). Records of an older
flatfl lack ``values`` and some ``code`` entries: what they lack is not compared.
"""
from __future__ import annotations

import ast
import collections
import functools
import hashlib
import inspect
import sys
import sysconfig
import textwrap
import types
from pathlib import Path

import torch
from torch import nn

__all__ = ["describe_model_class", "network_structure", "structure_difference", "code_changes"]

MAX_CODE_ENTRIES = 200  # the user's functions, classes and constants followed from one network
MAX_TEXT = 500  # characters of one recorded setting or value
_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # what every nn.Module instance holds (hooks, registries)
BUFFER = "non-persistent buffer "  # how ``values`` marks one
_NOT_USERS = ("torch", "flatfl", "numpy", "builtins", "functools", "math", "typing", "collections")


def describe_model_class(model: nn.Module) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def _qualified(obj) -> str:
    """``module.name`` of a function or class (a builtin such as ``torch.tanh`` by its plain name)."""
    name = getattr(obj, "__name__", None) if inspect.isbuiltin(obj) else None
    name = name or getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{getattr(obj, '__module__', None) or '?'}.{name}"


@functools.lru_cache(maxsize=1)
def _library_folders() -> tuple[Path, ...]:
    """Where installed packages and the standard library live: code there is a library's, not the user's."""
    paths = sysconfig.get_paths()
    return tuple({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _is_users(obj) -> bool:
    """A function or class of the user's: defined in a module that is neither torch's, flatfl's nor an installed
    library's (a class or function typed at the prompt counts)."""
    name = getattr(obj, "__module__", None)
    if not isinstance(name, str) or name.split(".")[0] in _NOT_USERS:
        return False
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if file is None:
        return name == "__main__" or module is None
    where = Path(file).resolve()
    return not any(where.is_relative_to(folder) for folder in _library_folders())


def _source_tree(obj) -> ast.AST | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError, ValueError, IndentationError):
        return None
    for node in ast.walk(tree):  # docstrings are no code
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _source_digest(obj) -> str | None:
    tree = _source_tree(obj)
    return None if tree is None else hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _constant(value) -> bool:
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return True
    return isinstance(value, (tuple, frozenset)) and len(value) <= 64 and all(_constant(v) for v in value)


def _names_used(obj, tree: ast.AST):
    """What the names in ``obj``'s source refer to in its module (``helper``, ``helpers.scale`` of an imported
    module of the user's, a constant), each once."""
    scope = getattr(obj, "__globals__", None)
    if scope is None:
        scope = vars(sys.modules[obj.__module__]) if obj.__module__ in sys.modules else {}
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            key, value = node.id, scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and isinstance(scope.get(node.value.id), types.ModuleType):
            key = f"{node.value.id}.{node.attr}"
            value = getattr(scope[node.value.id], node.attr, None)
        else:
            continue
        if key not in seen and value is not None:
            seen.add(key)
            yield key, value


def _code_of(roots) -> dict:
    """``{name: digest}`` of ``roots`` (every class of the network that is not torch's, and the factory) and of what
    the source of the user's among them uses of the user's modules, followed to the end (those at most
    :data:`MAX_CODE_ENTRIES`); each source parsed once."""
    code, module_constants = {}, {}
    todo = collections.deque((obj, True) for obj in roots)
    while todo:
        obj, root = todo.popleft()
        name = _qualified(obj)
        if name in code or not root and len(code) >= MAX_CODE_ENTRIES:
            continue
        tree = _source_tree(obj)
        code[name] = None if tree is None else hashlib.sha256(ast.dump(tree).encode()).hexdigest()
        if tree is None or not _is_users(obj):  # a library's class: by its name and code, not followed
            continue
        if inspect.isclass(obj):
            todo.extend((base, False) for base in obj.__mro__[1:] if _is_users(base))
        for key, value in _names_used(obj, tree):
            if isinstance(value, functools.partial):
                value = value.func
            if (inspect.isfunction(value) or inspect.isclass(value)) and _is_users(value):
                todo.append((value, False))
            elif _constant(value) and "." not in key:
                module_constants[f"{obj.__module__}.{key}"] = value
    for name, value in module_constants.items():  # SCALE = 2.0 at the top of the user's module
        if name not in code and len(code) < MAX_CODE_ENTRIES:
            code[name] = hashlib.sha256(repr(value).encode()).hexdigest()
    return code


def _code(model: nn.Module, factory) -> dict:
    """``code`` of :func:`network_structure`."""
    roots = list(dict.fromkeys(type(m) for m in model.modules() if not _torch_class(type(m))))
    if isinstance(factory, functools.partial):
        factory = factory.func
    if inspect.isfunction(factory):
        roots.append(factory)
    return _code_of(roots)


def _tensor_text(t: torch.Tensor) -> str:
    kind = f"tensor {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    try:
        data = t.detach().to("cpu").contiguous()
        raw = data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    except (RuntimeError, TypeError, NotImplementedError):  # sparse, quantized, meta: no plain bytes to digest
        return f"{kind} (values not digested)"
    return f"{kind} sha256 {hashlib.sha256(raw).hexdigest()[:16]}"


def _value_text(value, depth: int = 0) -> str:
    """How a module's attribute is recorded: plain values as written, functions by name (the user's by the digest
    of their source), tensors by dtype, shape and digest, settings objects (a dataclass) by their fields, other
    objects by their class."""
    if _constant(value) or (isinstance(value, (list, tuple)) and depth < 2 and len(value) <= 64
                            and all(_constant(v) for v in value)):
        return repr(value)[:MAX_TEXT]
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, functools.partial):
        args = ", ".join([*(_value_text(a, depth + 1) for a in value.args),
                          *(f"{k}={_value_text(v, depth + 1)}" for k, v in sorted(value.keywords.items()))])
        return f"partial({_value_text(value.func, depth + 1)}, {args})"[:MAX_TEXT]
    if callable(value) and hasattr(value, "__qualname__") or inspect.isbuiltin(value):
        if (inspect.isfunction(value) or inspect.isclass(value)) and _is_users(value):
            return f"{_qualified(value)} (code {(_source_digest(value) or '?')[:16]})"
        return _qualified(value)
    if isinstance(value, (list, tuple, dict)) and depth < 2 and len(value) <= 64:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        inner = ", ".join(f"{k!r}: {_value_text(v, depth + 1)}" for k, v in items)
        return f"{type(value).__name__}({inner})"[:MAX_TEXT]
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(value, (nn.Module, types.ModuleType)) and depth < 2 \
            and len(fields) <= 64:  # a settings object (a dataclass, a config): its fields
        inner = ", ".join(f"{k}={_value_text(v, depth + 1)}" for k, v in sorted(fields.items()))
        return f"{kind}({inner})"[:MAX_TEXT]
    return f"a {kind}"


def _values(model: nn.Module) -> dict:
    """``{"module.attribute": text}``: the attributes of the user's modules that are not parameters, buffers or
    submodules, and every non-persistent buffer."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for buffer in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            value = module._buffers.get(buffer)
            out[f"{prefix}{buffer}"] = BUFFER + ("None" if value is None else _tensor_text(value))
        if not _is_users(type(module)):
            continue  # torch's modules: their settings are in extra_repr
        for attr, value in vars(module).items():
            if attr in _MODULE_INTERNALS or attr.startswith("flatfl") or attr.startswith("__"):
                continue
            try:
                out[f"{prefix}{attr}"] = _value_text(value)
            except Exception:  # a repr of the user's that fails: the value counts by its class
                out[f"{prefix}{attr}"] = f"a {type(value).__module__}.{type(value).__qualname__}"
    return dict(sorted(out.items()))


def _torch_class(cls) -> bool:
    """torch's own classes are named alone, without their file (they move between files) and code."""
    return cls.__module__.split(".")[0] == "torch"


def _modules(model: nn.Module) -> list[list[str]]:
    out = []
    for name, module in model.named_modules():
        cls = type(module)
        qualified = f"torch.{cls.__qualname__}" if _torch_class(cls) else _qualified(cls)
        try:
            settings = " ".join(str(module.extra_repr()).split())[:MAX_TEXT]
        except Exception:  # an extra_repr of the user's that fails: the class still counts
            settings = "?"
        out.append([name, qualified, settings])
    return out


def network_structure(model: nn.Module, factory=None) -> dict:
    """``{"modules", "values", "code"}`` of ``model`` (see the module's docstring); ``factory``: the function that
    built it, whose code is recorded too."""
    return {"modules": _modules(model), "values": _values(model), "code": _code(model, factory)}


def _module_text(entry) -> str:
    name, qualified, settings = entry
    where = f"module {name!r}" if name else "the network itself"
    return f"{where} is {qualified.rsplit('.', 1)[-1]}({settings})"


def _value_difference(recorded: dict, now: dict) -> str | None:
    for key in sorted(set(recorded) | set(now)):
        old, new = recorded.get(key), now.get(key)
        if old != new:
            module, _, attr = key.rpartition(".")
            kind = "non-persistent buffer" if BUFFER in f"{old} {new}" else "attribute"
            old, new = (None if v is None else v.replace(BUFFER, "") for v in (old, new))
            where = f"{kind} {attr!r} of {f'module {module!r}' if module else 'the network'}"
            if old is None:
                return f"there is now {where} ({new}), the trained network had none"
            if new is None:
                return f"there is no {where}, the trained network had {old}"
            hint = "; no checkpoint saves it: the factory must build it alike" if kind != "attribute" else ""
            return f"{where} is {new}, trained as {old}{hint}"
    return None


def structure_difference(recorded, model: nn.Module) -> str | None:
    """How ``model`` differs from the ``recorded`` :func:`network_structure` in its modules or values (one phrase
    naming the first difference), or None when they match or nothing usable was recorded (files of older flatfl)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("modules"), list):
        return None
    want = [list(e) for e in recorded["modules"] if isinstance(e, (list, tuple)) and len(e) == 3]
    have = _modules(model)
    for old, new in zip(want, have):
        if old != new:
            if old[0] != new[0]:
                return f"the trained network's {_module_text(old)}, the network now has {_module_text(new)}"
            return f"{_module_text(new)}, trained as {old[1].rsplit('.', 1)[-1]}({old[2]})"
    if len(want) != len(have):
        extra = (have if len(have) > len(want) else want)[min(len(want), len(have))]
        return (f"it has {len(have)} modules, the trained network had {len(want)} (first "
                f"{'new' if len(have) > len(want) else 'missing'}: {_module_text(extra)})")
    values = recorded.get("values")
    if isinstance(values, dict):
        return _value_difference({str(k): str(v) for k, v in values.items()}, _values(model))
    return None


def code_changes(recorded, model: nn.Module, factory=None) -> list[str]:
    """The classes, functions and constants of the user's that ``model`` runs (and ``factory``, that built it)
    whose code changed since the ``recorded`` :func:`network_structure` was taken (where both are readable)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("code"), dict):
        return []
    now = _code(model, factory)
    then = recorded["code"]
    return [name for name, digest in now.items()
            if isinstance(digest, str) and isinstance(then.get(name), str) and then[name] != digest]
