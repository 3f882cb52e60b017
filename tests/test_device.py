"""One device resolver: every command and library entry refuses a device it cannot use with the same line."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from flatfl.checkpoint import load_checkpoint
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.utils.device import resolve_device

NO_CUDA = "device 'cuda' asked for, but CUDA is not available on this machine"
BOGUS = "unknown device 'bogus': use cpu, cuda, cuda:N or mps"


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def entry_points(tmp_path) -> dict[str, list[str]]:
    """Each command's arguments, up to (not including) ``--device``; none of them reaches any work."""
    ckpt = str(tmp_path / "no-such-run")
    return {
        "train": ["train", "--out", str(tmp_path / "train")],
        "hessian": ["hessian", ckpt, "--out", str(tmp_path / "h")],
        "hessian-clients": ["hessian-clients", ckpt, "--out", str(tmp_path / "hc")],
        "surface": ["surface", ckpt, "--out", str(tmp_path / "s")],
        "report --compute-missing": ["report", ckpt, "--out", str(tmp_path / "rep"), "--compute-missing"],
        "reproduce": ["reproduce", "man-table6", "--preset", "tiny", "--workers", "1", "--out",
                      str(tmp_path / "r"), "--runs-dir", str(tmp_path / "runs")],
    }


@pytest.mark.parametrize("device, message", [("cuda", NO_CUDA), ("bogus", BOGUS)])
def test_every_entry_point_gives_the_same_line(tmp_path, no_cuda, device, message):
    for name, args in entry_points(tmp_path).items():
        res = CliRunner().invoke(main, args + ["--device", device])
        assert res.exit_code == 2, (name, res.output)
        assert res.stderr.splitlines() == [f"flatfl: error: {message}"], (name, res.stderr)
        assert "Traceback" not in res.output
    assert not (tmp_path / "train").exists() and not (tmp_path / "runs").exists()
    assert not any((tmp_path / d).exists() for d in ("h", "hc", "s"))
    with pytest.raises(ConfigError) as e:
        load_checkpoint(tmp_path / "no-such-run", device=device)
    assert str(e.value) == message


def test_train_config_file_device_is_checked_the_same_way(tmp_path, no_cuda):
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cuda"\n')
    res = CliRunner().invoke(main, ["train", "--config", str(cfg), "--out", str(tmp_path / "t")])
    assert res.exit_code == 2 and res.stderr.splitlines() == [f"flatfl: error: {NO_CUDA}"]
    assert not (tmp_path / "t").exists()


def test_resolver_cases(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("meta", "CPU", "", "cuda:x", "cuda:-1", 3.5, None):
        with pytest.raises(ConfigError, match=r"^unknown device .*: use cpu, cuda, cuda:N or mps$"):
            resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda:2")
    assert str(e.value) == "device 'cuda:2' asked for, but this machine has 2 GPU(s): use cuda:0 to cuda:1"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        resolve_device("mps")
    assert str(e.value) == "device 'mps' asked for, but MPS is not available on this machine"
