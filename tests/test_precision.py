"""How float32 products run on CUDA is a recorded setting: training sets it from --float32-matmul, analysis always
runs in full precision, and both say so in their result files."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.train.config import RunConfig
from flatfl.utils.precision import float32_matmul_now, set_float32_matmul


def switches() -> tuple[str, str]:
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


def test_the_modes_set_torchs_switches_for_products_and_convolutions_together():
    try:
        set_float32_matmul("tf32")
        assert switches() == ("tf32", "tf32") and float32_matmul_now() == "tf32"
        set_float32_matmul("full")
        assert switches() == ("ieee", "ieee") and float32_matmul_now() == "full"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's own default: convolutions in TF32 only
        assert float32_matmul_now() == "mixed"
    finally:
        set_float32_matmul("full")
    with pytest.raises(ConfigError, match="--float32-matmul must be one of full, tf32"):
        RunConfig(float32_matmul="fast").validate()


def test_training_records_its_mode_and_analysis_runs_in_full_precision(tmp_path):
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--rounds", "1", "--clients", "4", "--float32-matmul", "tf32", "--out",
                                  str(run), "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["training_path"]["float32_matmul"] == "tf32"
    assert switches() == ("tf32", "tf32")
    r = CliRunner().invoke(main, ["hessian", str(run), "--top", "1", "--samples", "64", "--out", str(tmp_path / "h"),
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "h" / "hessian.json").read_text())["float32_matmul"] == "full"
    assert switches() == ("ieee", "ieee")
