"""Reliability promises (docs/reliability.md) that need more than one command line: file modes follow the umask, a killed
writer's temporaries are cleaned up by the next writer (and nothing else is), derived results record and check
what they came from, a killed sweep leaves no worker behind, the Python API raises FlatflError."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import FlatflError

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--clients", "4", "--participation", "1", "--local-epochs", "1", "--batch-size", "64",
        "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli(*argv):
    r = CliRunner().invoke(main, [str(a) for a in argv])
    return r


def ok(*argv):
    r = cli(*argv)
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny 2-round run with a checkpoint per round and the clients' models, trained once."""
    d = tmp_path_factory.mktemp("reliability") / "run"
    ok("train", *FAST, "--rounds", "2", "--checkpoint-every", "1", "--save-clients", "--out", d)
    return d


def modes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_follow_the_umask(run, tmp_path, umask, expected):
    """Every file flatfl writes (checkpoint, hessian.json, report files, manifests) gets 0666 less the umask."""
    old = os.umask(umask)
    try:
        if umask == 0o022:  # every kind of output once; the other umasks on hessian's
            ok("train", *FAST, "--rounds", "1", "--out", tmp_path / "r")
            ok("report", run, "--out", tmp_path / "rep")
        ok("hessian", run / "final.pt", "--top", "1", "--no-trace", "--samples", "32", "--quiet",
           "--out", tmp_path / "h")
    finally:
        os.umask(old)
    for folder, must in (("r", "final.pt"), ("h", "hessian.json"), ("rep", "runs.csv")):
        if folder != "h" and umask != 0o022:
            continue
        got = modes(tmp_path / folder)
        assert must in got, (folder, sorted(got))
        assert set(got.values()) == {expected}, (folder, {k: oct(v) for k, v in got.items()})
        assert stat.S_IMODE((tmp_path / folder).stat().st_mode) == 0o777 & ~umask


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_writer_leaves_a_temporary_that_the_next_run_removes(run, tmp_path):
    """A process killed inside an atomic write leaves ``.NAME.PID.XXXXXXXX.tmp``; the next flatfl writer of that
    folder removes it (and only temporaries flatfl named, whose writer is gone)."""
    out = tmp_path / "surf"
    out.mkdir()
    code = ("import os, sys\nfrom flatfl.utils.io import atomic_open\n"
            "with atomic_open(sys.argv[1] + '/surface.npz') as f:\n    f.write(b'half')\n    os._exit(9)\n")
    p = subprocess.run([sys.executable, "-c", code, str(out)], env=ENV)
    assert p.returncode == 9
    left = [q.name for q in out.iterdir() if q.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".surface.npz."), left  # a half-done write
    sub = out / "sub"
    sub.mkdir()
    stale_sub = sub / f".eigenvalues.png.{_dead_pid()}.abcd1234.tmp"
    stale_sub.write_bytes(b"x")
    keep = {
        out / ".notes.tmp": b"mine",  # a user's file that looks temporary
        out / f".draft.{_dead_pid()}.tmp": b"mine",  # not flatfl's pattern (no random part)
        out / f".surface.csv.{os.getppid()}.abcd1234.tmp": b"a live writer's",  # its writer is alive
    }
    for path, data in keep.items():
        path.write_bytes(data)
    ok("surface", run / "final.pt", "--grid", "3", "--samples", "16", "--quiet", "--out", out)
    names = {q.name for q in out.iterdir()}
    assert left[0] not in names and not stale_sub.exists()
    for path, data in keep.items():
        assert path.read_bytes() == data
    assert "surface.json" in names


def test_resume_removes_a_killed_checkpoint_write(run, tmp_path):
    """A train killed while writing a round checkpoint leaves a temporary in checkpoints/: the resume removes it."""
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run, d)
    (d / "final.pt").unlink()
    stale = d / "checkpoints" / f".round_0002.pt.{_dead_pid()}.k9_x0abc.tmp"
    stale.write_bytes(b"half a checkpoint")
    r = cli("train", "--resume", d, "--quiet")
    assert r.exit_code == 0, r.output
    assert not stale.exists()
    assert not [q for q in d.rglob("*.tmp")]


def test_hessian_keeps_or_refuses_hessian_clients_results(run, tmp_path):
    """A hessian.json written by older flatfl versions holds hessian-clients results as its 'clients' section: a
    later `hessian` of the same weights (named by another path) keeps them; of other weights, `hessian` refuses (one
    line, nothing changed) instead of dropping them."""
    from flatfl.utils.io import atomic_write_json

    out = tmp_path / "h"
    ok("hessian", run / "final.pt", "--top", "1", "--no-trace", "--samples", "32", "--quiet", "--out", out)
    report = json.loads((out / "hessian.json").read_text())
    section = {"H_N": 0.5, "H_D": 0.9, "protocol": "default", "round": report["round"]}
    atomic_write_json(out / "hessian.json", dict(report, clients=section))  # the older layout
    link = tmp_path / "same-weights.pt"
    link.symlink_to(run / "final.pt")
    ok("hessian", link, "--top", "1", "--no-trace", "--samples", "32", "--quiet", "--out", out)
    report = json.loads((out / "hessian.json").read_text())
    assert report["clients"] == section and report["top_eigenvalues"]

    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = cli("hessian", run / "checkpoints" / "round_0001.pt", "--top", "1", "--no-trace", "--samples", "32",
            "--out", out)
    assert r.exit_code == 2 and "hessian-clients" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_report_does_not_show_a_hessian_of_an_earlier_round(run, tmp_path, reports_undrawn):
    """A Hessian measured at round 1 (before the run went on to round 2) is not shown beside the final accuracy:
    the report lists it as missing, and --compute-missing measures the final model into a folder of its own."""
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run, d)
    hs = ["--top", "1", "--samples", "32"]
    ok("hessian", d / "checkpoints" / "round_0001.pt", *hs, "--quiet", "--out", d / "hessian")
    old = json.loads((d / "hessian" / "hessian.json").read_text())
    assert old["round"] == 1
    with reports_undrawn():  # what the reports list and use; their figures are drawn by the report tests
        ok("report", d, "--model", "server", "--out", tmp_path / "rep", *hs)
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert any("measured round 1" in m for m in summary["missing"]), summary["missing"]
    rows = (tmp_path / "rep" / "runs.csv").read_text()
    assert str(old["top_eigenvalues"][0])[:8] not in rows

    with reports_undrawn():
        ok("report", d, "--model", "server", "--out", tmp_path / "rep2", "--compute-missing", *hs)
    new = json.loads((d / "hessian-round2" / "hessian.json").read_text())
    assert new["round"] == 2 and new["top_eigenvalues"][0] != old["top_eigenvalues"][0]
    assert json.loads((d / "hessian" / "hessian.json").read_text()) == old  # kept where it was
    import csv

    with (tmp_path / "rep2" / "runs.csv").open() as f:
        row = next(csv.DictReader(f))
    assert row["hessian_dir"] == "hessian-round2"
    assert float(row["top_eigenvalue"]) == pytest.approx(new["top_eigenvalues"][0], rel=1e-6)


def test_load_checkpoint_bad_device_is_a_flatfl_error(run):
    from flatfl.checkpoint import load_checkpoint

    with pytest.raises(FlatflError, match="bogus"):
        load_checkpoint(run / "final.pt", device="bogus")
    with pytest.raises(FlatflError):
        load_checkpoint(run / "final.pt", device=3.5)
    with pytest.raises(FlatflError, match="not found"):
        load_checkpoint(run / "nope.pt")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return not Path("/proc").is_dir()


def test_killing_a_sweep_leaves_no_worker_running(tmp_path):
    """SIGKILL to `sweep --workers 2` (no chance to clean up): its two workers are gone within seconds."""
    runs = tmp_path / "runs"
    grid = tmp_path / "grid.toml"
    grid.write_text(f'out = "{runs}"\nthreads = 1\n[fixed]\nmodel = "tiny"\nclients = 4\nrounds = 400\n'
                    'local_epochs = 1\n[grid]\nalgo = ["fedavg", "fedprox"]\n')
    proc = subprocess.Popen([sys.executable, "-m", "flatfl", "sweep", str(grid), "--workers", "2"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:  # each worker holds its run folder's lock, which names its pid
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "the workers did not start in time"
            for lock in runs.glob("*/.flatfl.lock"):
                text = lock.read_text().strip() if lock.is_file() else ""
                if text.isdigit():
                    pids.add(int(text))
            time.sleep(0.05)
        assert proc.pid not in pids
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a worker kept running after the sweep was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing should be left; never leave a stray process behind
        except (ProcessLookupError, PermissionError):
            pass


def test_a_checkpoint_cannot_name_code_outside_the_current_directory(run, tmp_path, monkeypatch):
    """A checkpoint's recorded model factory is imported only from the current directory: one naming an importable
    module elsewhere (here on sys.path, as an installed package would be) is refused and never called."""
    import shutil

    import torch

    elsewhere = tmp_path / "site"
    elsewhere.mkdir()
    marker = tmp_path / "PWNED"
    (elsewhere / "evil_factory_mod.py").write_text(
        f"def make():\n    open({str(marker)!r}, 'w').close()\n    import torch\n    return torch.nn.Linear(1, 1)\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    ckpt = tmp_path / "final.pt"
    shutil.copy(run / "final.pt", ckpt)
    payload = torch.load(ckpt, weights_only=True)
    payload["model_spec"] = dict(payload["model_spec"], name="custom", factory="evil_factory_mod:make")
    from flatfl.utils.provenance import json_digest

    payload["model_spec_sha256"] = json_digest(payload["model_spec"])  # a forger updates the spec's digest too
    torch.save(payload, ckpt)
    for argv in (["hessian", ckpt, "--out", work / "h"], ["surface", ckpt, "--out", work / "s"]):
        r = cli(*argv)
        assert r.exit_code == 2 and "--model-factory evil_factory_mod:make" in r.stderr, r.output
        assert len(r.stderr.strip().splitlines()) == 1 and not marker.exists()
    assert list(work.iterdir()) == []
    # named by the user, it is trusted
    r = cli("hessian", ckpt, "--model-factory", "evil_factory_mod:make", "--out", work / "h")
    assert marker.exists()
