"""Measured quantities (:mod:`flatfl.analysis.estimators.quantities`, ``flatfl hessian --measure``): the squared
Frobenius norm against ``numpy.linalg.eigh`` of a dense Hessian and against diagonal matrices (where its estimator
has no variance); a quantity registered from outside flatfl, one function, carried through the analysis, hessian.json,
the result line and the report's tables and runs.csv, checked against flatfl's exact trace; the registry's checks,
plug-ins that fail to load, and hessian.json's ``quantities`` checked where read."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import flatfl
from flatfl.analysis.commands.hessian_command import compute
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.analysis.commands.result_files import ResultFileError, read_hessian_file
from flatfl.analysis.estimators.quantities import (Quantity, parse_measure, quantity, quantity_names,
                                                   register_quantity, unregister_quantity)
from flatfl.analysis.operators.hessian import HessianOperator
from flatfl.analysis.operators.linear_operator import MatrixOperator
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.report.metrics import unregister_metric
from dense import dense_hessian
from test_eigen_which import trained  # noqa: F401 - the fixture: a small trained float64 network
from tiny_run import analyse_tiny, train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(flatfl.__file__).resolve().parent.parent
FROBENIUS = HessianSettings(top=0, trace=False, measure="frobenius", trace_hvps=3000, trace_rtol=0.01)


def test_the_squared_frobenius_norm_is_the_sum_of_the_squared_eigenvalues(trained):
    """On the trained network of tests/test_eigen_which.py (227 parameters, eigenvalues of both signs)."""
    model, x, y = trained
    eigenvalues = np.linalg.eigvalsh(dense_hessian(model, x, y))
    truth = float(np.sum(eigenvalues ** 2))
    assert eigenvalues.min() < 0 < eigenvalues.max()  # both signs: a trace would let them cancel, this does not
    report, _, _ = compute(HessianOperator(model, (x, y)), FROBENIUS)
    record = report["quantities"]["frobenius"]
    assert abs(record["estimate"] - truth) <= 4 * record["stderr"], (record, truth)
    assert record["target_reached"] and record["stderr"] <= 0.01 * record["estimate"]  # it stopped at --trace-rtol
    assert record["hvps"] == record["probes"] < FROBENIUS.trace_hvps
    again, _, _ = compute(HessianOperator(model, (x, y)), FROBENIUS)
    assert again["quantities"] == report["quantities"]  # its own seed stream: the same draw every time
    other, _, _ = compute(HessianOperator(model, (x, y)), HessianSettings(**{**FROBENIUS.to_dict(), "seed": 1}))
    assert other["quantities"]["frobenius"]["estimate"] != record["estimate"]


def test_a_diagonal_matrix_gives_the_exact_norm_without_variance():
    """For a diagonal D, ||D z||^2 = sum d_i^2 for every Rademacher z: the estimate is exact and its standard error 0,
    whatever the budget; a matrix with off-diagonal entries has a spread the standard error states."""
    d = torch.tensor([3.0, -2.0, 0.5, 7.0, -1.25], dtype=torch.float64)
    report, _, _ = compute(MatrixOperator(torch.diag(d)), HessianSettings(top=0, trace=False, measure="frobenius",
                                                                          trace_hvps=12, trace_rtol=None))
    record = report["quantities"]["frobenius"]
    assert record["estimate"] == pytest.approx(float((d ** 2).sum()), rel=1e-15) and record["stderr"] == 0.0
    assert record["hvps"] == 12
    A = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    A = A + A.T
    report, _, _ = compute(MatrixOperator(A), HessianSettings(top=0, trace=False, measure="frobenius",
                                                              trace_hvps=2000, trace_rtol=0.005))
    record = report["quantities"]["frobenius"]
    assert record["stderr"] > 0 and abs(record["estimate"] - float((A ** 2).sum())) <= 4 * record["stderr"]


def test_the_diagonals_squared_norm_is_the_dense_hessians(trained):
    """--measure diagonal on the trained network (227 parameters): within 4 standard errors of sum_i H_ii^2 of the
    dense Hessian (numpy), stopped at --trace-rtol in whole pairs; on a diagonal matrix every pair gives the value
    exactly (standard error 0); a budget of one product is refused in one line."""
    model, x, y = trained
    truth = float(np.sum(np.diag(dense_hessian(model, x, y)) ** 2))
    settings = HessianSettings(top=0, trace=False, measure="diagonal", trace_hvps=4000, trace_rtol=0.02)
    report, _, _ = compute(HessianOperator(model, (x, y)), settings)
    record = report["quantities"]["diagonal"]
    assert abs(record["estimate"] - truth) <= 4 * record["stderr"], (record, truth)
    assert record["target_reached"] and record["hvps"] == 2 * record["pairs"] < settings.trace_hvps
    frobenius = float(np.sum(dense_hessian(model, x, y) ** 2))
    assert truth < frobenius  # the couplings left out: a different number from the Frobenius norm
    d = torch.tensor([3.0, -2.0, 0.5, 7.0, -1.25], dtype=torch.float64)
    report, _, _ = compute(MatrixOperator(torch.diag(d)), HessianSettings(top=0, trace=False, measure="diagonal",
                                                                          trace_hvps=13, trace_rtol=None))
    record = report["quantities"]["diagonal"]
    assert record["estimate"] == pytest.approx(float((d ** 2).sum()), rel=1e-15) and record["stderr"] == 0.0
    assert record["hvps"] == 12 and record["pairs"] == 6  # the 13th product would start a pair it cannot finish
    with pytest.raises(ConfigError, match="--measure diagonal takes two products a sample: --trace-hvps 1"):
        compute(MatrixOperator(torch.diag(d)), HessianSettings(top=0, trace=False, measure="diagonal", trace_hvps=1))


def test_a_zero_curvature_and_a_single_sample_are_results_not_refusals():
    """A zero matrix (a loss linear in the parameters): each quantity is 0 +- 0, its target reached; one pair of
    probes: an estimate without a standard error, its target not reached (relative_stderr None), as one trace probe."""
    zero = MatrixOperator(torch.zeros(5, 5, dtype=torch.float64))
    report, _, _ = compute(zero, HessianSettings(top=0, trace=False, measure="diagonal,frobenius", trace_hvps=40))
    for record in report["quantities"].values():
        assert record["estimate"] == 0.0 and record["stderr"] == 0.0 and record["target_reached"] is True
    d = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)) + 0.5
    report, _, _ = compute(MatrixOperator(d), HessianSettings(top=0, trace=False, measure="diagonal", trace_hvps=3))
    record = report["quantities"]["diagonal"]
    assert record["pairs"] == 1 and record["stderr"] is None
    assert record["relative_stderr"] is None and record["target_reached"] is False


def _exact_diagonal_sum(op, settings, seed):
    """A quantity of a plug-in's: the trace from the products of the unit vectors (exact, no error)."""
    eye = torch.eye(op.dim, dtype=op.dtype, device=op.device)
    return {"estimate": float(torch.diagonal(op.matmat(eye)).sum()), "stderr": 0.0, "hvps": op.dim,
            "method": "unit vectors"}


@pytest.fixture
def unit_trace():
    entry = register_quantity(Quantity("unit_trace", "trace by unit vectors", "the trace from the unit vectors' "
                                       "products", _exact_diagonal_sum, lambda settings, dim: dim, short="tr(e)"))
    yield entry
    unregister_quantity("unit_trace")
    unregister_metric("unit_trace")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("quantities") / "runs" / "run")


def test_a_quantity_of_ones_own_runs_through_the_command_and_the_report(tiny, unit_trace, tmp_path):
    """One registered function: ``--measure`` takes it, the result line names it, hessian.json records it, and a
    report of the run gets its column in runs.csv; its value equals flatfl's exact trace of the same matrix (the
    GGN's, from per-sample Jacobians)."""
    r, h = analyse_tiny(tiny, tmp_path / "h", "--measure", "unit_trace", "--curvature", "ggn", "--trace-method",
                        "exact", "--top", "0", "--samples", "48")
    assert r.exit_code == 0, r.output
    record = h["quantities"]["unit_trace"]
    assert h["trace"]["method"] == "exact"
    assert record["estimate"] == pytest.approx(h["trace"]["estimate"], rel=1e-5)  # float32 products
    assert record["hvps"] == h["num_params"] and h["settings"]["measure"] == "unit_trace"
    assert f"trace by unit vectors: {record['estimate']:.6g} +- 0 (unit vectors, {h['num_params']} HVPs)" in r.output
    assert "trace by unit vectors" in r.output.splitlines()[-1]
    assert read_hessian_file(tmp_path / "h" / "hessian.json")["quantities"] == h["quantities"]
    # a report asking for it computes it into the run's folder and shows it
    rep = CliRunner().invoke(main, ["report", str(tiny.parent), "--out", str(tmp_path / "rep"), "--compute-missing",
                                    "--measure", "unit_trace", "--samples", "48", "--threads", "1"])
    # the report computes the default Hessian (not the GGN): its own analysis, the plug-in's quantity of it
    assert rep.exit_code == 0, rep.output
    rows = list(csv.DictReader((tmp_path / "rep" / "runs.csv").open()))
    computed = json.loads((tiny / rows[0]["hessian_dir"] / "hessian.json").read_text())
    assert computed["curvature"] == "hessian" and computed["settings"]["measure"] == "unit_trace"
    value = computed["quantities"]["unit_trace"]["estimate"]
    assert len(rows) == 1 and float(rows[0]["unit_trace"]) == value and float(rows[0]["unit_trace_stderr"]) == 0
    assert abs(value - computed["trace"]["estimate"]) <= 4 * computed["trace"]["stderr"]  # Hutch++'s, of the same
    # re-rendered from its runs.csv alone: the column kept, and no column said missing (the smallest eigenvalue's
    # are absent because no run measured it, not because the file is an older flatfl's)
    again = CliRunner().invoke(main, ["report", str(tmp_path / "rep" / "runs.csv"), "--out", str(tmp_path / "rep2")])
    assert again.exit_code == 0, again.output
    assert "has no column" not in again.output and "re-rendered from runs.csv" in again.output
    (row,) = list(csv.DictReader((tmp_path / "rep2" / "runs.csv").open()))
    assert float(row["unit_trace"]) == value
    assert rows[0]["unit_trace_setting"].startswith("all-clients average, unit vectors")


def test_a_quantity_named_like_a_report_column_replaces_nothing(tiny, tmp_path):
    """A quantity called test_acc (runs.csv's accuracy column) or trace (a metric's) gets the column quantity_<name>;
    the accuracy and the trace stay the run's."""
    def fixed(op, settings, seed):
        return {"estimate": 555.0, "stderr": 0.0, "hvps": 0}

    for name in ("test_acc", "trace"):
        register_quantity(Quantity(name, f"my {name}", "a fixed number", fixed, lambda s, d: 0))
    try:
        rep = CliRunner().invoke(main, ["report", str(tiny.parent), "--out", str(tmp_path / "rep"),
                                        "--compute-missing", "--measure", "test_acc,trace", "--samples", "48",
                                        "--threads", "1"])
        assert rep.exit_code == 0, rep.output
        (row,) = list(csv.DictReader((tmp_path / "rep" / "runs.csv").open()))
        assert float(row["quantity_test_acc"]) == float(row["quantity_trace"]) == 555.0
        assert 0 <= float(row["test_acc"]) <= 100 and float(row["trace"]) != 555.0
    finally:
        for name in ("test_acc", "trace"):
            unregister_quantity(name)
            unregister_metric(f"quantity_{name}")


def test_measure_is_checked_where_it_enters(tiny, tmp_path):
    assert parse_measure(None) == parse_measure(" ") == ()
    assert parse_measure("frobenius") == ("frobenius",)
    with pytest.raises(ConfigError, match="unknown quantity 'nope'.*frobenius"):
        HessianSettings(measure="nope").validate()
    with pytest.raises(ConfigError, match="names the quantity 'frobenius' twice"):
        HessianSettings(measure="frobenius, frobenius").validate()
    with pytest.raises(ConfigError, match="separated by commas"):
        HessianSettings(measure="frobenius,").validate()
    with pytest.raises(ConfigError, match="--measure must be a string"):
        HessianSettings(measure=3).validate()
    HessianSettings(top=0, trace=False, measure="frobenius").validate()  # a quantity alone is something to compute
    r = CliRunner().invoke(main, ["hessian", str(tiny), "--measure", "frobnius", "--quiet", "--out",
                                  str(tmp_path / "h")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "frobenius" in r.output, r.output
    assert not (tmp_path / "h").exists()


def test_an_analysis_with_other_quantities_is_not_replaced(tiny, tmp_path):
    r, h = analyse_tiny(tiny, tmp_path / "h", "--measure", "frobenius", "--samples", "32", "--trace-hvps", "20",
                        "--top", "0")
    assert r.exit_code == 0, r.output
    record = h["quantities"]["frobenius"]  # 20 products: above its 1% target, which its line says as the trace's does
    assert record["target_reached"] is False and record["relative_stderr"] > 0.01
    assert (f"(hutchinson on H^2, 20 HVPs; the target of 1% relative error was not reached in the budget "
            f"({100 * record['relative_stderr']:.3g}% at 20 HVPs))") in r.output, r.output
    r2, _ = analyse_tiny(tiny, tmp_path / "h", "--samples", "32", "--trace-hvps", "20", "--top", "0")
    assert r2.exit_code == 2 and "--measure frobenius there, none here" in r2.output, r2.output
    assert json.loads((tmp_path / "h" / "hessian.json").read_text()) == h


def test_a_quantitys_own_mistakes_are_one_line_naming_it(tiny, tmp_path):
    def bad(op, settings, seed):
        return {"estimate": float("nan"), "stderr": None, "hvps": 0}

    register_quantity(Quantity("bad_one", "a bad one", "gives NaN", bad, lambda s, d: 0))
    try:
        r, _ = analyse_tiny(tiny, tmp_path / "h", "--measure", "bad_one", "--samples", "16", "--top", "0",
                            "--no-trace")
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert "the quantity 'bad_one' gave the estimate nan, not a finite number" in r.output
        assert not (tmp_path / "h" / "hessian.json").exists()
        register_quantity(Quantity("bad_one", "a bad one", "bounds badly", _exact_diagonal_sum, lambda s, d: "lots"),
                          replace=True)
        r, _ = analyse_tiny(tiny, tmp_path / "h", "--measure", "bad_one", "--samples", "16", "--top", "0",
                            "--no-trace")
        assert r.exit_code == 2 and "the quantity 'bad_one' bounds its products by 'lots', not a count" in r.output
    finally:
        unregister_quantity("bad_one")
    def raises(op, settings, seed):
        raise RuntimeError("boom from the author")

    def huge(op, settings, seed):
        return {"estimate": 1e200, "stderr": 0.0, "hvps": 0}

    def endless_error(op, settings, seed):
        return {"estimate": 1.0, "stderr": float("inf"), "hvps": 0}

    def not_json(op, settings, seed):
        return {"estimate": 1.0, "stderr": 0.0, "hvps": 0, "probes": {1, 2}}

    def uncounted(op, settings, seed):
        op.matmat(torch.ones(op.dim, 2, dtype=op.dtype))
        return {"estimate": 1.0, "stderr": 0.0, "hvps": 0}

    for function, says in ((raises, ("the quantity 'bad_one' failed in test_a_quantitys_own_mistakes_are_one_line_"
                                     "naming_it.<locals>.raises at ", "test_quantities.py:",
                                     ": RuntimeError: boom from the author")),
                           (uncounted, ("the quantity 'bad_one' says it spent 0 products; the operator counted 2",)),
                           (endless_error, ("the quantity 'bad_one' gave the standard error inf, not a finite number",)),
                           (not_json, ("the quantity 'bad_one' gave a record that is not JSON of finite numbers",)),
                           (huge, ("the analysis gave 1e+200 in its quantities (a damping, a quantity or a loss this "
                                   "large?), beyond what a result file holds (+-1e+150); nothing was written",))):
        register_quantity(Quantity("bad_one", "a bad one", "fails", function, lambda s, d: 0))
        try:
            r, _ = analyse_tiny(tiny, tmp_path / "h", "--measure", "bad_one", "--samples", "16", "--top", "0",
                                "--no-trace")
        finally:
            unregister_quantity("bad_one")
        assert r.exit_code == 2 and r.output.count("\n") == 1 and all(w in r.output for w in says), r.output
        assert "internal error" not in r.output and not (tmp_path / "h" / "hessian.json").exists()
    with pytest.raises(ConfigError, match="already registered"):
        register_quantity(Quantity("frobenius", "x", "y", bad, lambda s, d: 0))
    with pytest.raises(ConfigError, match="lower-case letters"):
        register_quantity(Quantity("Frob-2", "x", "y", bad, lambda s, d: 0))
    with pytest.raises(ConfigError, match="title must be one non-empty line"):
        register_quantity(Quantity("two_lines", "x\ny", "y", bad, lambda s, d: 0))
    with pytest.raises(ConfigError, match="function must be a function"):
        register_quantity(Quantity("not_callable", "x", "y", "mod:fn", lambda s, d: 0))
    assert "bad_one" not in quantity_names() and quantity("frobenius").name == "frobenius"


@pytest.mark.parametrize("quantities, says", [
    ({"frobenius": 3.0}, "'frobenius' is float, not an object"),
    ({"frobenius": {"estimate": "big", "stderr": 1.0}}, "'frobenius' has the estimate 'big'"),
    ({"frobenius": {"estimate": 2.0, "stderr": -1.0}}, "'frobenius' has the stderr -1.0"),
    ({"frobenius": {"estimate": 2.0, "stderr": True}}, "'frobenius' has the stderr True"),
    ({"frobenius": {"estimate": 1e300, "stderr": 1.0}}, "holds 1e+300"),
    ([1, 2], "its 'quantities' is list"),
    ({}, "'frobenius' is asked in its settings but not recorded"),
    (None, "'frobenius' is asked in its settings but not recorded"),
])
def test_hessian_json_quantities_are_checked_where_read(tmp_path, quantities, says):
    path = tmp_path / "hessian.json"
    path.write_text(json.dumps({"top_eigenvalues": [1.0], "quantities": quantities,
                                "settings": {"measure": "frobenius"}}))
    with pytest.raises(ResultFileError, match="not a flatfl hessian.json") as caught:
        read_hessian_file(path)
    assert says in str(caught.value)


PLUGIN = '''
from flatfl.analysis.estimators.quantities import Quantity

def raises():
    raise RuntimeError("cannot build it")

def _zero(op, settings, seed):
    return {"estimate": 0.0, "stderr": 0.0, "hvps": 0}

good = Quantity("plugged", "a plugged-in quantity", "from another package", _zero, lambda s, d: 0)
taken = Quantity("frobenius", "another Frobenius", "takes a built-in name", _zero, lambda s, d: 0)
'''


def test_quantity_plugins_load_in_isolation_and_the_built_ins_without_torch(tmp_path):
    site = tmp_path / "site"
    info = site / "qplug-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flatfl.quantities]\nbroken = qplugmod:raises\ngood = qplugmod:good\n"
                                           "taken = qplugmod:taken\n")
    (site / "qplugmod.py").write_text(textwrap.dedent(PLUGIN))
    script = ("import sys; from flatfl.analysis.estimators.quantities import quantity_names; "
              "print(quantity_names()); print('torch' in sys.modules)")
    early = ("from flatfl.analysis.estimators.quantities import Quantity, register_quantity\n"
             "register_quantity(Quantity('frobenius', 'mine', 'first', print, print))")
    r = subprocess.run([sys.executable, "-c", early], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    # a built-in's name is taken before the registry is first asked too
    assert r.returncode != 0 and "a quantity called 'frobenius' is already registered" in r.stderr, r.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["('diagonal', 'frobenius', 'plugged')", "False"]  # found, listed, torch never imported
    warnings = r.stderr.strip().splitlines()
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("flatfl: warning: the quantity plug-in broken = qplugmod:raises of the "
                                  "distribution qplug 0.1") and "RuntimeError: cannot build it" in warnings[0]
    assert warnings[1].endswith("a quantity called 'frobenius' is already registered (a plug-in cannot replace it)")


def test_every_module_of_the_package_is_a_quantity():
    """A new quantity is one file: each module of flatfl/analysis/estimators/quantities/ defines QUANTITY, which the
    registry holds under its name."""
    import importlib
    import pkgutil

    from flatfl.analysis.estimators import quantities

    modules = [m.name for m in pkgutil.iter_modules(quantities.__path__)]
    assert modules, "no built-in quantity"
    for name in modules:
        entry = importlib.import_module(f"{quantities.__name__}.{name}").QUANTITY
        assert quantity(entry.name) is entry


def test_the_pyhessian_style_object_measures_the_same(trained):
    """``hessian(...).measure(name)``: the command's record, from the same seed stream and budget."""
    from flatfl.analysis import hessian

    model, x, y = trained
    settings = HessianSettings(top=0, trace=False, measure="frobenius", trace_hvps=40, trace_rtol=None)
    report, _, _ = compute(HessianOperator(model, (x, y)), settings)
    record = hessian(model, torch.nn.CrossEntropyLoss(), data=(x, y), cuda=False).measure("frobenius", max_hvps=40,
                                                                                         rtol=None)
    expected = report["quantities"]["frobenius"]
    assert record["hvps"] == expected["hvps"] == 40 and "target_reached" not in record  # no target: the budget
    assert record["estimate"] == pytest.approx(expected["estimate"], rel=1e-12)
    assert record["stderr"] == pytest.approx(expected["stderr"], rel=1e-10)
    with pytest.raises(ConfigError, match="unknown quantity"):
        hessian(model, torch.nn.CrossEntropyLoss(), data=(x, y), cuda=False).measure("frob")


def test_measuring_more_in_a_folder_adds_outputs_and_measuring_less_is_refused(tiny, tmp_path):
    """An analysis of the same settings that measures more quantities replaces the folder's (it adds outputs);
    one that would drop a measured quantity is refused in one line and leaves the file as it was; with no trace,
    a quantity's budget (--trace-hvps) is one of the settings compared."""
    out = tmp_path / "h"
    flags = ("--top", "1", "--no-trace", "--samples", "48")
    r, _ = analyse_tiny(tiny, out, *flags)
    assert r.exit_code == 0, r.output
    r, h = analyse_tiny(tiny, out, *flags, "--measure", "frobenius")
    assert r.exit_code == 0, r.output
    assert set(h["quantities"]) == {"frobenius"}
    before = (out / "hessian.json").read_bytes()
    r, _ = analyse_tiny(tiny, out, *flags)
    assert r.exit_code == 2 and "--measure frobenius there, none here" in r.output, r.output
    r, _ = analyse_tiny(tiny, out, *flags, "--measure", "frobenius", "--trace-hvps", "40")
    assert r.exit_code == 2 and "--trace-hvps" in r.output, r.output
    assert (out / "hessian.json").read_bytes() == before
