"""An algorithm or a regularizer is one file: every module of the two packages is registered without being listed
anywhere, a module dropped into a copy of the package is found, and each piece's class carries the name tables
print."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flatfl.report.tables import method_label
from flatfl.train.catalog import load_all
from flatfl.train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "flatfl" / "train"


@pytest.mark.parametrize("package, registry", [("algorithms", ALGORITHMS), ("regularizers", REGULARIZERS)])
def test_every_module_of_the_packages_registers_a_piece(package, registry):
    load_all()
    files = sorted(p.stem for p in (TRAIN / package).glob("*.py") if p.stem not in ("__init__", "base"))
    assert files, package
    registered = {cls.__module__.rpartition(".")[2] for cls in registry.values()}
    assert [f for f in files if f not in registered] == [], f"modules of train/{package} registering nothing"


NEW_PIECES = {
    "algorithms/fedfoo.py": '''
from .base import register
from .fedavg import FedAvg


@register
class FedFoo(FedAvg):
    name = "fedfoo"
    display_name = "FedFoo"
    summary = "FedFoo: a test algorithm"
''',
    "regularizers/barreg.py": '''
from ..components import REGULARIZERS
from .base import NoRegularizer


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
from flatfl.report.tables import method_label
from flatfl.train.config import RunConfig

listing = CliRunner().invoke(main, ["algos"]).output
RunConfig(algo="fedfoo", reg="barreg").validate()
print(json.dumps({"label": method_label({"algo": "fedfoo", "reg": "barreg", "local_opt": "sam"}),
                  "listed": [line.split(":")[0] for line in listing.splitlines() if line.startswith(("fedfoo", "barreg"))]}))
"""


def test_a_module_dropped_into_a_copy_of_the_package_is_registered(tmp_path):
    """No __init__, registry or table is edited: the new file alone makes --algo / --reg, `flatfl algos` and the
    report's method name know the piece."""
    shutil.copytree(ROOT / "flatfl", tmp_path / "flatfl", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in NEW_PIECES.items():
        (tmp_path / "flatfl" / "train" / rel).write_text(text)
    r = subprocess.run([sys.executable, "-c", FIND], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"label": "FedFoo(SAM)+BarReg", "listed": ["fedfoo", "barreg"]}
    assert importlib.util.find_spec("flatfl.train.algorithms.fedfoo") is None  # the copy only


# the labels report/tables.py printed from its own tables before the names moved onto the classes
PAPER_NAMES = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "feddyn": "FedDyn", "feddc": "FedDC",
    "fedspeed": "FedSpeed", "fedsam": "FedSAM", "fedasam": "FedASAM", "fedcm": "FedCM", "mofedsam": "MoFedSAM",
    "mimelite": "MimeLite", "fedrobust": "FedRobust", "moon": "MOON", "fedntd": "FedNTD", "feddisco": "FedDisco",
    "man": "MAN", "asd": "ASD", "fedalign": "FedAlign", "gradaug": "GradAug", "mixup": "Mixup",
    "stochdepth": "StochDepth", "sam": "SAM", "asam": "ASAM",
    "fedsmoo": "FedSMOO", "fedgamma": "FedGAMMA", "fedlesam": "FedLESAM", "fedgloss": "FedGloSS",
}


def test_display_names_are_the_papers_and_make_the_method_labels():
    load_all()
    assert {k: ALGORITHMS[k].display_name for k in ALGORITHMS} == {k: PAPER_NAMES[k] for k in ALGORITHMS}
    assert {k: REGULARIZERS[k].display_name for k in REGULARIZERS if k != "none"} == \
        {k: PAPER_NAMES[k] for k in REGULARIZERS if k != "none"}
    assert LOCAL_OPTIMIZERS["sam"].display_name == "SAM" and LOCAL_OPTIMIZERS["asam"].display_name == "ASAM"
    assert method_label({}) == "FedAvg"
    assert method_label({"algo": "fedavg", "local_opt": "sam"}) == "FedSAM"
    assert method_label({"algo": "fedavg", "local_opt": "asam", "reg": "man"}) == "FedASAM+MAN"
    assert method_label({"algo": "feddyn", "local_opt": "sam", "reg": "man"}) == "FedDyn(SAM)+MAN"
    assert method_label({"algo": "mofedsam", "reg": "stochdepth"}) == "MoFedSAM+StochDepth"
    assert method_label({"algo": "scaffold", "local_opt": "sgd", "reg": "none"}) == "SCAFFOLD"
    assert method_label({"algo": "fedgone", "reg": "oldreg"}) == "fedgone+oldreg"  # a run of another version
