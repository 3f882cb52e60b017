"""The package's layers, checked on the source (``ast``, every import: at module level and inside functions).

From the bottom: ``errors`` / ``version``; ``utils``; ``models`` and ``data``; ``checkpoint`` (the format where
training and analysis meet); ``train`` and ``analysis`` side by side; ``runs`` (a run folder's layout and its
analyses) and ``executors``; ``paper_tables`` (each reproduced table's layout and runs); ``sweep`` and ``report``
side by side; ``reproduce``; ``cli`` and the package root on
top, then ``__main__`` and the package root (``flatfl/__init__.py``). A module imports only from its own unit or from lower layers; units of one layer never import each other;
there is no import cycle; no private name (``_x``) is used outside its module. And, run in a fresh interpreter:
the analysis of MOON and stochastic-depth checkpoints never imports the training code.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flatfl"

# (layer name, its units), bottom first; a unit is a module or a package (with everything under it)
LAYERS = (
    ("base", ("flatfl.errors", "flatfl.version")),
    ("utils", ("flatfl.utils",)),
    ("models and data", ("flatfl.models", "flatfl.data")),
    ("checkpoint format", ("flatfl.checkpoint",)),
    ("train and analysis", ("flatfl.train", "flatfl.analysis")),
    ("run folders and executors", ("flatfl.run_layout", "flatfl.executors")),
    ("paper tables", ("flatfl.paper_tables",)),  # each table's layout and run plan (data): report and reproduce read it
    ("sweep and report", ("flatfl.sweep", "flatfl.report")),
    ("reproduce", ("flatfl.reproduce",)),
    ("command line", ("flatfl.cli",)),
    ("entry points", ("flatfl.__main__", "flatfl")),  # the package root: flatfl.load_checkpoint, __version__
)

# inside flatfl.analysis, bottom first: the operators, the estimators on them, the commands on both, and the
# package's own modules (the PyHessian-style API, the names it exports) on top
ANALYSIS_LAYERS = (
    ("operators", ("flatfl.analysis.operators",)),
    ("estimators", ("flatfl.analysis.estimators",)),
    ("commands", ("flatfl.analysis.commands",)),
    ("the package's API", ("flatfl.analysis.model_hessian", "flatfl.analysis")),
)

def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package in ``package_dir``."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ``from ... import`` statement of module ``name`` (file ``path``) names, relative ones made
    absolute."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path], top: str = "flatfl") -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of the package's own modules in the file,
    wherever it stands. ``from pkg import sub`` counts as an import of the module ``pkg.sub``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == top]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, path, node)
            if target.split(".")[0] != top:
                continue
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{target}.{n}" in modules]
            found += [(f"{target}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                found.append((target, rest, node.lineno))
    return found


def import_graph(package_dir: Path) -> dict[str, list[tuple[str, list[str], int]]]:
    modules = module_files(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def unit_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer index, unit) of a module: the longest unit that is the module or a package above it (the package
    root, a unit without a dot, is only itself: its ``__init__``)."""
    best = None
    for rank, (_, units) in enumerate(layers):
        for unit in units:
            if (module == unit or ("." in unit and module.startswith(unit + "."))) and (best is None or len(unit) > len(best[1])):
                best = (rank, unit)
    return best


def layer_violations(graph, layers=LAYERS) -> list[str]:
    problems = []
    for source, edges in graph.items():
        src = unit_of(source, layers)
        for target, _, line in edges:
            dst = unit_of(target, layers)
            if src is None or dst is None or src[1] == dst[1]:
                continue
            if dst[0] > src[0]:
                problems.append(f"{source}:{line} imports {target}, a higher layer ({layers[dst[0]][0]})")
            elif dst[0] == src[0]:
                problems.append(f"{source}:{line} imports {target}, beside it in layer '{layers[src[0]][0]}'")
    return problems


def import_cycles(graph, allowed=frozenset()) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), the ``allowed`` edges left out."""
    edges = {m: sorted({t for t, _, _ in e if t in graph and (m, t) not in allowed}) for m, e in graph.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


#: the public names of a named tuple, which start with "_" so as not to clash with its fields
NAMEDTUPLE_API = {"_make", "_replace", "_asdict", "_fields", "_field_defaults"}


def private_uses(files: dict[str, Path], modules: dict[str, Path], top: str = "flatfl") -> list[str]:
    """``from flatfl.x import _y``, ``m._y`` (``m`` a name bound to a flatfl module, or to anything imported from
    one: a class, a function) and ``setattr(m, "_y", ...)`` / ``monkeypatch.setattr("flatfl.x._y", ...)`` outside
    the module defining ``_y``."""
    problems = []
    for name, path in files.items():
        for target, names, line in imports_of(name, path, modules, top):
            problems += [f"{path.name}:{line} imports {target}.{n}" for n in names
                         if n.startswith("_") and not n.startswith("__")]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bound = set()  # names bound to modules of the package, or to what was imported from them, in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom) and resolve(name, path, node).split(".")[0] == top:
                bound |= {a.asname or a.name for a in node.names}

        def private(attr: str) -> bool:
            return attr.startswith("_") and not attr.startswith("__") and attr not in NAMEDTUPLE_API

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bound:
                    problems.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and node.args
                  and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "setattr"):
                first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):  # setattr("flatfl.x._y", v)
                    dotted = first.value.split(".")
                    if dotted[0] == top and private(dotted[-1]):
                        problems.append(f"{path.name}:{node.lineno} sets {first.value}")
                elif (isinstance(first, ast.Name) and first.id in bound and isinstance(second, ast.Constant)
                      and isinstance(second.value, str) and private(second.value)):
                    problems.append(f"{path.name}:{node.lineno} sets {first.id}.{second.value}")
    return problems


# ------------------------------------------------------------------------------------------------------ the rules
def test_every_module_has_a_layer():
    loose = [m for m in module_files(PACKAGE) if unit_of(m) is None]
    assert not loose, f"modules in no layer (add them to LAYERS and to the drawing in docs/development.md): {loose}"


def test_no_import_from_a_higher_layer_or_a_unit_beside():
    problems = layer_violations(import_graph(PACKAGE))
    assert not problems, "\n".join(problems)


def test_analysis_sublayers_import_only_downward():
    """operators <- estimators <- commands <- the API: no module of flatfl.analysis imports one of a sub-layer above
    it (a name table the operators need lives with the operators, not in a command's settings)."""
    graph = {m: e for m, e in import_graph(PACKAGE).items() if m == "flatfl.analysis" or m.startswith("flatfl.analysis.")}
    assert all(unit_of(m, ANALYSIS_LAYERS) is not None for m in graph)
    problems = layer_violations(graph, ANALYSIS_LAYERS)
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    cycles = import_cycles(import_graph(PACKAGE))
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_used_outside_its_module():
    modules = module_files(PACKAGE)
    files = dict(modules)
    for folder in ("tests", "benchmarks"):
        files.update({f"{folder}.{p.stem}": p for p in sorted((ROOT / folder).glob("*.py"))})
    problems = private_uses(files, modules)
    assert not problems, "\n".join(problems)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A small package with an upward import, a sideways import, a cycle (through a function-level import), a
    private import and private attributes used and set from outside: each is reported, and a cycle is gone once its
    edges are allowed."""
    pkg = tmp_path / "flatfl"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import g\n")  # upward, inside a function
    (pkg / "low" / "b.py").write_text("from .c import _hidden\n")  # a private name of another module
    (pkg / "low" / "c.py").write_text("from . import b\n_hidden = b._x\n")  # b <-> c; a private attribute
    (pkg / "side.py").write_text("from flatfl import other\n")
    (pkg / "other.py").write_text("")
    (pkg / "high.py").write_text("from .low import a\n")
    layers = (("low", ("flatfl.low",)), ("middle", ("flatfl.side", "flatfl.other")), ("high", ("flatfl.high",)),
              ("root", ("flatfl",)))
    graph = import_graph(pkg)
    problems = layer_violations(graph, layers)
    assert any("flatfl.low.a:2 imports flatfl.high, a higher layer" in p for p in problems), problems
    assert any("flatfl.side:1 imports flatfl.other, beside it" in p for p in problems), problems
    assert len(problems) == 2, problems
    assert import_cycles(graph) == [["flatfl.high", "flatfl.low.a"], ["flatfl.low.b", "flatfl.low.c"]]
    assert import_cycles(graph, {("flatfl.low.c", "flatfl.low.b"), ("flatfl.low.a", "flatfl.high")}) == []
    modules = module_files(pkg)
    assert private_uses(modules, modules) == ["b.py:1 imports flatfl.low.c._hidden", "c.py:2 uses b._x"]
    user = tmp_path / "test_user.py"  # a test reaching into a class it imported, directly and by monkeypatching
    user.write_text('from flatfl.low.c import K\nK._x\nsetattr(K, "_y", 1)\nmonkeypatch.setattr("flatfl.low.c._z", 2)\n'
                    'K._make([])\nK.x._y\n')
    assert private_uses({"tests.test_user": user}, modules) == [
        "test_user.py:2 uses K._x", "test_user.py:3 sets K._y", "test_user.py:4 sets flatfl.low.c._z",
        "test_user.py:6 uses K.x._y"]


# ------------------------------------------------------------------------- analysis without the training code
ANALYSE = r"""
import json, sys
import flatfl.analysis
import flatfl
from flatfl.analysis.commands.hessian_command import run_hessian
from flatfl.analysis.commands.hessian_settings import HessianSettings

out = {}
for name, path in json.loads(sys.argv[1]).items():
    ckpt = flatfl.load_checkpoint(path)
    model = ckpt.model
    inner = getattr(model, "encoder", model)
    blocks = inner.residual_blocks() if hasattr(inner, "residual_blocks") else []
    report = run_hessian(path, sys.argv[2] + "/" + name, HessianSettings(top=1, trace=False, samples=64), quiet=True)
    out[name] = {"class": type(model).__name__, "proj_dim": getattr(model, "proj_dim", None),
                 "survival": [b.survival for b in blocks], "top": report["top_eigenvalues"]}
out["modules"] = sorted(m for m in sys.modules if m == "flatfl.train" or m.startswith("flatfl.train."))
print(json.dumps(out))
"""


def _train(tmp_path, name: str, **settings) -> Path:
    import torch

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = RunConfig(rounds=1, clients=2, participation=1.0, local_epochs=1, batch_size=100, eval_every=1,
                        seed=0, **settings).validate()
        return Trainer(cfg, tmp_path / name, quiet=True).run()
    finally:
        torch.set_num_threads(threads)


def test_analysis_of_moon_and_stochastic_depth_checkpoints_imports_no_training_code(tmp_path):
    moon = _train(tmp_path, "moon", model="tiny", algo="moon", params={"moon_proj_dim": 8})
    stoch = _train(tmp_path, "stoch", model="resnet20", reg="stochdepth", params={"survival_last": 0.5})
    r = subprocess.run([sys.executable, "-c", ANALYSE, json.dumps({"moon": str(moon), "stoch": str(stoch)}),
                        str(tmp_path / "hessian")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["modules"] == [], f"analysis imported training code: {out['modules']}"
    assert out["moon"]["class"] == "ProjectionHeadModel" and out["moon"]["proj_dim"] == 8
    assert out["stoch"]["survival"] == pytest.approx([1 - 0.5 * i / 8 for i in range(9)])
    assert out["stoch"]["survival"][-1] == 0.5 and out["stoch"]["class"] == "ResNet"
    assert all(isinstance(out[k]["top"][0], float) for k in ("moon", "stoch"))
