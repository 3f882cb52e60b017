"""Result files from other people's runs are checked where they enter (flatfl/analysis/commands/result_files.py):
the numbers readers compute with must be finite and within +-1e150, or the file is refused in one line naming it
and the field. The independent truth: files written here with the offending number, and the exit and output of
``flatfl report`` on a run holding one."""
from __future__ import annotations

import json
import math
import re

import pytest
from click.testing import CliRunner

from flatfl.analysis.commands.result_files import (MAX_MAGNITUDE, ResultFileError, read_clients_file,
                                                   read_hessian_file)
from flatfl.cli import main
from tiny_run import train_tiny

GOOD = {"top_eigenvalues": [2.5, 1.0], "residuals": [1e-9, 2e-9], "error_estimates": [None, 1e-12],
        "trace": {"estimate": 11.0, "stderr": 0.3, "method": "hutchpp"}, "loss": 0.4,
        "density": {"nodes": [[-0.1, 2.5]], "weights": [[0.5, 0.5]]}, "settings": {"top": 2}}


def write(path, data) -> None:
    path.write_text(json.dumps(data, allow_nan=True))


@pytest.mark.parametrize("field,value", [
    ("top_eigenvalues", [1e308, 1.0]), ("top_eigenvalues", [math.nan]), ("residuals", [-math.inf]),
    ("top_eigenvalues", [10**400]),  # an exact JSON integer too large for a float
    ("error_estimates", [2e150]), ("trace", {"estimate": -1e200, "stderr": 0.1}), ("loss", math.inf),
    ("density", {"nodes": [[0.0, 1e151]], "weights": [[0.5, 0.5]]}),
])
def test_a_hessian_file_with_a_number_out_of_range_is_refused_naming_the_field(tmp_path, field, value):
    path = tmp_path / "hessian.json"
    write(path, GOOD)
    assert read_hessian_file(path)["top_eigenvalues"] == [2.5, 1.0]  # in range: read as written
    write(path, dict(GOOD, **{field: value}))
    with pytest.raises(ResultFileError, match=f"its '{field}' holds .*within {re.escape(f'+-{MAX_MAGNITUDE:g}')}"):
        read_hessian_file(path)


@pytest.mark.parametrize("record,said", [
    ({"error_estimates": ["x", 1e-12]}, "its error_estimates holds 'x', not a number"),
    ({"residuals": ["y", 1e-9]}, "its residuals holds 'y', not a number"),
    ({"top_eigenvalues": [None, 1.0]}, "its top_eigenvalues holds 'None', not a number"),
    ({"top_eigenvalues": [True]}, "its top_eigenvalues holds 'True', not a number"),
    ({"smallest_eigenvalues": {"values": -0.5}}, "its smallest_eigenvalues: values is float, not a list of numbers"),
    ({"smallest_eigenvalues": {"values": [-0.5], "residuals": [1e-9], "error_estimates": [{}]}},
     "its smallest_eigenvalues: error_estimates holds '{}', not a number"),
])
def test_a_hessian_file_whose_eigenvalue_lists_hold_other_things_is_refused(tmp_path, record, said):
    """The per-eigenvalue lists, which the report averages and sets against each other, hold numbers (an error
    estimate may be null): anything else is one line naming the file and the list, not 'invalid data' later."""
    path = tmp_path / "hessian.json"
    write(path, dict(GOOD, smallest_eigenvalues={"values": [-0.5], "residuals": [1e-9], "error_estimates": [None]}))
    assert read_hessian_file(path)["smallest_eigenvalues"]["values"] == [-0.5]
    write(path, dict(GOOD, **record))
    with pytest.raises(ResultFileError, match=re.escape(f"{path} is not a flatfl hessian.json ({said}); ")):
        read_hessian_file(path)


def test_a_clients_file_with_a_number_out_of_range_is_refused(tmp_path):
    path = tmp_path / "clients-default.json"
    write(path, {"protocol": "default", "H_N": 0.5, "H_D": 0.1, "H_N_stderr": 0.01})
    assert read_clients_file(path)["H_N"] == 0.5
    write(path, {"protocol": "default", "H_N": 1e300, "H_D": 0.1})
    with pytest.raises(ResultFileError, match="its 'H_N' holds 1e\\+300"):
        read_clients_file(path)


def test_report_on_a_run_whose_analysis_holds_1e308_is_one_line_and_writes_nothing(tmp_path):
    run = train_tiny(tmp_path / "run", "--threads", "1")
    r = CliRunner().invoke(main, ["hessian", str(run), "--top", "1", "--samples", "32", "--trace-hvps", "12",
                                  "--quiet", "--threads", "1", "--out", str(run / "hessian")])
    assert r.exit_code == 0, r.output
    path = run / "hessian" / "hessian.json"
    data = json.loads(path.read_text())
    write(path, dict(data, top_eigenvalues=[1e308]))
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["report", str(run), "--model", "server", "--out", str(out)])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"{path} is not a flatfl hessian.json (its 'top_eigenvalues' holds 1e+308" in r.output
    assert not out.exists()
