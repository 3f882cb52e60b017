"""benchmarks/flsam_cost.py, the training-cost benchmark in FL-SAM's and pfl-research's configurations: bad options
are refused in one line, the ratios it prints are the hand-computed ones, and a tiny run trains in forked children
and reports seconds and a peak memory no smaller than the clients' models it must hold."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "flsam_cost.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import flsam_cost as fc  # noqa: E402


@pytest.mark.parametrize("argv,words", [
    (["--config", "leaf"], "--config must be one of flsam, pfl"),
    (["--size", "huge"], "--size must be small or full"),
    (["--models", "vgg"], "--models: unknown 'vgg'"),
    (["--methods", "FedAvg", "FedProx"], "--methods: unknown 'FedProx'"),
    (["--rounds", "0"], "--rounds must be an integer from 1 to 1000"),
    (["--threads", "two"], "--threads must be an integer from 1 to 1000"),
    (["--precision", "float16"], "--precision must be float32 or float64"),
    (["--parallel-clients", "0"], "--parallel-clients must be 'all' or an integer"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N]"),
    (["--json", "/nonexistent-folder/x.json"], "--json /nonexistent-folder/x.json: give a file in an existing folder"),
])
def test_a_bad_option_is_one_line_and_exit_2(capsys, argv, words):
    assert fc.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err


def run(cpu: list[float], error: str | None = None) -> dict:
    return dict(error=error) if error else dict(cpu=cpu, wall=[99.0] * len(cpu), peak_bytes=2**20)


def test_ratios_are_the_hand_computed_ones():
    figures = dict(config="flsam", device_type="cpu", models=dict(cnn=dict(rows={
        "FedAvg": {"none": run([1.0, 3.0]), "man": run([2.2])},
        "FedSAM": {"none": run([5.0, 4.0, 9.0]), "man": run([], error="out of memory")},
        "FedGMT": "not registered (no 'fedgmt' in this flatfl)"})))
    got = fc.ratios(figures, "cnn")
    # medians: FedAvg 2.0 (CPU seconds, not the wall ones), FedAvg + MAN 2.2, FedSAM 5.0
    assert got["FedAvg"]["none"]["seconds"] == 2.0 and got["FedAvg"]["none"]["x_fedavg"] == 1.0
    assert got["FedAvg"]["man"]["x_fedavg"] == pytest.approx(1.1)
    assert got["FedAvg"]["man_x_method"] == pytest.approx(1.1)
    assert got["FedSAM"]["none"]["x_fedavg"] == 2.5 and got["FedSAM"]["man"] == {"error": "out of memory"}
    assert got["FedSAM"]["man_x_method"] is None
    assert got["FedSAM"]["flsam_x_fedavg"] == pytest.approx(7.64 / 2.72)  # FL-SAM's README, CNN column
    assert got["FedGMT"].startswith("not registered")
    lines = fc.table(figures, "cnn")
    assert any(line.startswith("FedSAM") and "2.50x" in line and "out of memory" in line and "2.81x" in line
               for line in lines)
    figures["device_type"] = "cuda"  # on CUDA the wall seconds count
    assert fc.ratios(figures, "cnn")["FedAvg"]["none"]["seconds"] == 99.0
    figures["config"] = "pfl"  # nothing of FL-SAM's beside pfl-research's configuration
    assert fc.ratios(figures, "cnn")["FedAvg"]["flsam_x_fedavg"] is None


def test_a_tiny_run_reports_seconds_and_the_memory_of_every_clients_model(tmp_path):
    figures_path = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", "pfl", "--size", "small", "--models", "cnn",
                           "--methods", "fedavg", "--rounds", "1", "--threads", "1", "--device", "cpu",
                           "--json", str(figures_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(figures_path.read_text())
    assert figures["complete"] and figures["shape"] == list(fc.SHAPES[("pfl", "small")])
    data = figures["models"]["cnn"]
    assert data["parameters"] == 2_156_490
    for reg in ("none", "man"):
        result = data["rows"]["FedAvg"][reg]
        assert len(result["cpu"]) == 1 and result["cpu"][0] > 0 and result["together"] == 1
        # every client's latest model is kept (clients x parameters float32): the child's memory grew by more
        assert result["peak_bytes"] >= fc.SHAPES[("pfl", "small")].clients * 2_156_490 * 4
    assert "pfl-research: no published seconds a round" in done.stdout
    assert any(line.startswith("FedAvg") and "1.00x" in line for line in done.stdout.splitlines())
