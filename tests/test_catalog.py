"""An algorithm or a regularizer is one file: every module of the two packages is registered without being listed
anywhere, a module dropped into a copy of the package is found, and each piece's class carries the name tables
print."""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flatfl.report.records import method_label
from flatfl.train.catalog import load_all
from flatfl.train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "flatfl" / "train"


@pytest.mark.parametrize("package, registry", [("algorithms", ALGORITHMS), ("regularizers", REGULARIZERS)])
def test_every_module_of_the_packages_registers_a_piece(package, registry):
    load_all()
    interface = {"algorithms": "algorithm", "regularizers": "regularizer"}[package]  # the piece's base class
    files = sorted(p.stem for p in (TRAIN / package).glob("*.py") if p.stem not in ("__init__", interface))
    assert files, package
    registered = {cls.__module__.rpartition(".")[2] for cls in registry.values()}
    assert [f for f in files if f not in registered] == [], f"modules of train/{package} registering nothing"


NEW_PIECES = {
    "algorithms/fedfoo.py": '''
from .algorithm import register
from .fedavg import FedAvg


@register
class FedFoo(FedAvg):
    name = "fedfoo"
    display_name = "FedFoo"
    summary = "FedFoo: a test algorithm"
''',
    "regularizers/barreg.py": '''
from ..components import REGULARIZERS
from .regularizer import NoRegularizer


@REGULARIZERS.register
class BarReg(NoRegularizer):
    name = "barreg"
    display_name = "BarReg"
    summary = "BarReg: a test regularizer"
''',
}
FIND = r"""
import json
from click.testing import CliRunner
from flatfl.cli import main
from flatfl.report.records import method_label
from flatfl.train.config import RunConfig

listing = CliRunner().invoke(main, ["algos"]).output
RunConfig(algo="fedfoo", reg="barreg").validate()
print(json.dumps({"label": method_label({"algo": "fedfoo", "reg": "barreg", "local_opt": "sam"}),
                  "listed": [line.split(":")[0] for line in listing.splitlines() if line.startswith(("fedfoo", "barreg"))]}))
"""


def copy_with_new_pieces(tmp_path: Path, *extra: str) -> Path:
    """A copy of the package in ``tmp_path`` (and of ``extra``: folders or files beside it) with NEW_PIECES dropped
    into its algorithm and regularizer packages; returns ``tmp_path``."""
    shutil.copytree(ROOT / "flatfl", tmp_path / "flatfl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in extra:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, tmp_path / name)
    for rel, text in NEW_PIECES.items():
        (tmp_path / "flatfl" / "train" / rel).write_text(text)
    return tmp_path


def run_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """``python3 *args`` in ``folder``, importing flatfl from there."""
    return subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS="1"))


def test_a_module_dropped_into_a_copy_of_the_package_is_registered(tmp_path):
    """No __init__, registry or table is edited: the new file alone makes --algo / --reg, `flatfl algos` and the
    report's method name know the piece."""
    r = run_in(copy_with_new_pieces(tmp_path), "-c", FIND)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"label": "FedFoo(SAM)+BarReg", "listed": ["fedfoo", "barreg"]}
    assert importlib.util.find_spec("flatfl.train.algorithms.fedfoo") is None  # the copy only


# tests that read the registries' names: an extension must break none of them
REGISTRY_TESTS = ["tests/test_catalog.py", "tests/test_names.py", "tests/test_hessian_settings.py",
                  "tests/test_analysis_settings.py"]
NEW_ESTIMATORS = '''
register_estimator("krylov", "eigenvalues", "flatfl.analysis.estimators.by_name:lanczos", label="largest algebraic",
                   title="Krylov", residuals="lanczos relation")
register_estimator("girard", "trace", "flatfl.analysis.estimators.trace:hutchinson_trace", title="Girard")
'''


def test_pieces_dropped_into_a_copy_train_and_break_no_test_of_the_registries(tmp_path):
    """A new algorithm, regularizer and eigenvalue and trace estimator (two lines added to the built-in list), and
    nothing else edited: the new algorithm trains with the new regularizer, and the tests that read the registries
    pass on the copy (but for the tests that make copies)."""
    folder = copy_with_new_pieces(tmp_path, "tests", "docs", "README.md", "pyproject.toml")
    (registry,) = [p for p in (folder / "flatfl").rglob("*.py") if "\ndef register_estimator(" in p.read_text()]
    registry.write_text(registry.read_text() + NEW_ESTIMATORS)
    r = run_in(folder, "-m", "flatfl", "train", "--algo", "fedfoo", "--reg", "barreg", "--model", "tiny",
               "--rounds", "1", "--clients", "2", "--local-epochs", "1", "--batch-size", "64", "--threads", "1",
               "--quiet", "--out", "run")
    assert r.returncode == 0 and (folder / "run" / "final.pt").is_file(), r.stderr[-2000:]
    config = json.loads((folder / "run" / "config.json").read_text())["config"]
    assert (config["algo"], config["reg"]) == ("fedfoo", "barreg")
    r = run_in(folder, "-c", "from flatfl.analysis.estimators.registry import estimator_names as n; "
                             "print(n('eigenvalues')[-1], n('trace')[-1])")
    assert r.stdout.split() == ["krylov", "girard"], r.stderr[-2000:]  # the copy's registry holds them
    # in one process (-p no:xdist): a few seconds of tests, which starting pytest-xdist workers would only slow
    r = run_in(folder, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *REGISTRY_TESTS, "-k",
               "not copy")
    assert r.returncode == 0, r.stdout[-3000:]


# the paper's spelling of each built-in piece (written out, not read from the classes): a piece added later needs no
# line here; its name is checked by the rules every piece keeps (below)
PAPER_NAMES = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "feddyn": "FedDyn", "feddc": "FedDC",
    "fedspeed": "FedSpeed", "fedsam": "FedSAM", "fedasam": "FedASAM", "fedcm": "FedCM", "mofedsam": "MoFedSAM",
    "mimelite": "MimeLite", "fedrobust": "FedRobust", "moon": "MOON", "fedntd": "FedNTD", "feddisco": "FedDisco",
    "man": "MAN", "asd": "ASD", "fedalign": "FedAlign", "gradaug": "GradAug", "mixup": "Mixup",
    "stochdepth": "StochDepth", "sam": "SAM", "asam": "ASAM",
    "fedsmoo": "FedSMOO", "fedgamma": "FedGAMMA", "fedlesam": "FedLESAM", "fedgloss": "FedGloSS",
    "fednsam": "FedNSAM", "fedwmsam": "FedWMSAM",
}
REGISTRIES = {"algorithm": ALGORITHMS, "regularizer": REGULARIZERS, "local optimizer": LOCAL_OPTIMIZERS}


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_piece_has_a_name_of_its_own_to_print(kind):
    """Each registered piece: its registry key is its ``name``, and the label tables print is a non-empty word that
    no other piece of its kind prints (two methods of one report would read alike)."""
    load_all()
    registry = REGISTRIES[kind]
    assert all(registry[key].name == key for key in registry)
    labels = {key: registry[key].label() for key in registry}
    assert all(isinstance(label, str) and label and label == label.strip() for label in labels.values()), labels
    assert len(set(labels.values())) == len(labels), labels


def test_display_names_are_the_papers_and_make_the_method_labels():
    load_all()
    printed = {key: cls.display_name for registry in REGISTRIES.values() for key, cls in registry.items()}
    assert {key: printed.get(key) for key in PAPER_NAMES} == PAPER_NAMES  # every built-in piece, as its paper spells it
    assert REGULARIZERS["none"].display_name == ""  # no regularizer prints nothing
    assert method_label({}) == "FedAvg"
    assert method_label({"algo": "fedavg", "local_opt": "sam"}) == "FedSAM"
    assert method_label({"algo": "fedavg", "local_opt": "asam", "reg": "man"}) == "FedASAM+MAN"
    assert method_label({"algo": "feddyn", "local_opt": "sam", "reg": "man"}) == "FedDyn(SAM)+MAN"
    assert method_label({"algo": "mofedsam", "reg": "stochdepth"}) == "MoFedSAM+StochDepth"
    assert method_label({"algo": "scaffold", "local_opt": "sgd", "reg": "none"}) == "SCAFFOLD"
    assert method_label({"algo": "fedgone", "reg": "oldreg"}) == "fedgone+oldreg"  # a run of another version


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = {"--algo": ("algorithm", ALGORITHMS), "--reg": ("regularizer", REGULARIZERS),
         "--local-opt": ("local optimizer", LOCAL_OPTIMIZERS)}


def test_the_names_the_docs_write_are_registered():
    """Every ``--algo X``, ``--reg X`` and ``--local-opt X`` in the README and docs/ names a registered piece, but
    for a name shown being refused (``unknown algorithm 'X'``) on the same line."""
    load_all()
    seen = set()
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            for flag, name in re.findall(r"(--algo|--reg|--local-opt)[ =]+([a-z][a-z0-9_-]*)", line):
                kind, registry = FLAGS[flag]
                if f"unknown {kind} '{name}'" not in line:
                    assert name in registry, f"{doc.name}: {flag} {name} is no registered {kind}"
                    seen.add(flag)
    assert seen == set(FLAGS)  # the docs do use each flag: the search found them


def test_each_module_cites_the_update_rules_section_of_its_piece():
    """A piece's module docstring that cites docs/update-rules.md (``section N`` or ``§N``) leads to a section whose
    heading names the piece as tables print it."""
    load_all()
    headings = dict(re.findall(r"^## (\d+)\. (.+)$", (ROOT / "docs" / "update-rules.md").read_text(), re.M))
    for registry in (ALGORITHMS, REGULARIZERS):
        for cls in registry.values():
            doc = sys.modules[cls.__module__].__doc__ or ""
            found = re.search(r"docs/update-rules\.md\s+(?:section\s+|§)(\d+)", doc)
            assert found or cls.name not in PAPER_NAMES, f"{cls.__module__} cites no section of update-rules.md"
            if found:
                assert cls.label() in headings.get(found.group(1), ""), (cls.name, found.group(0))
