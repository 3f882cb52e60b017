"""Over several ranks (torchrun; here gloo ranks spawned on this machine by tests/ranks.py), every number equals one
process's: each registered estimator, the per-layer blocks, the PyHessian-style API and a ``loss=`` objective in
float64 over 1, 2 and 3 ranks with unequal shards (1e-12); every registered curvature kind over 2 ranks (1e-12;
finite-difference products within their stated error, one step and one stated error on every rank); a case of every
registered algorithm, regularizer and local optimizer trained over 2 and 3 ranks (1e-9; the cases are read off the
registries, so a piece registered later is covered); and the commands under torch's own launcher. A rank killed with SIGKILL ends the others within a
minute with one line, and the run resumes."""
from __future__ import annotations

import json
import math
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flatfl.analysis.operators.distributed import shard_batches, shard_ranges
from flatfl.errors import ConfigError
from ranks import run_job, start_ranks, torchrun
from rank_jobs import curvature_cases, curvature_results, estimator_results, training_cases, training_results
from sampled_fisher import registered

pytestmark = pytest.mark.usefixtures("one_thread")


def _close(a, b, rtol: float, where: str) -> list[str]:
    """What differs between two results (nested dicts of tensors and numbers) by more than ``rtol`` relative."""
    if isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [line for k in b for line in _close(a[k], b[k], rtol, f"{where} {k}")]
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return [f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"]
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return [] if diff <= rtol * max(scale, 1e-300) else [f"{where}: {diff:.3g} off (scale {scale:.3g})"]



def test_the_worlds_split_rules():
    """The named rules every split goes through: ``share`` is numpy's array_split (contiguous, the first ranks one
    item more), ``dealt`` / ``owns`` every R-th item; together the ranks' parts are every item once; a world of one
    keeps everything and gathers its own object."""
    from flatfl.utils.ranks import World

    for n in (0, 1, 5, 7, 12):
        items = np.arange(n) * 10
        for size in (1, 2, 3, 5):
            worlds = [World(rank, size) for rank in range(size)]
            shares = [w.share(items) for w in worlds]
            for got, want in zip(shares, np.array_split(items, size)):
                np.testing.assert_array_equal(got, want)
            dealt = [w.dealt(list(items)) for w in worlds]
            assert sorted(sum(dealt, [])) == list(items)
            assert all(w.owns(k) == (items[k] in w.dealt(list(items))) for w in worlds for k in range(n))
    one = World()
    assert one.main and not one.distributed and one.gather({"a": 1}) == [{"a": 1}]
    assert list(one.share(range(4))) == list(one.dealt(range(4))) == [0, 1, 2, 3]

def test_shards_cover_the_samples_once_and_differ_by_at_most_one():
    """37 samples in batches of 8 over 3 ranks: 13, 12, 12 samples, batches cut where a range ends."""
    assert shard_ranges([8, 8, 8, 8, 5], 3) == [(0, 13), (13, 25), (25, 37)]
    x = torch.arange(37.0)
    batches = [(x[a:a + 8], x[a:a + 8].long()) for a in range(0, 37, 8)]
    parts = [shard_batches(batches, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([b[0] for part in parts for b in part]), x)
    assert [sum(len(b[1]) for b in part) for part in parts] == [13, 12, 12]
    dicts = [{"inputs": a, "labels": b, "scale": 2.0} for a, b in batches]
    mine = shard_batches(dicts, 1, 3, objective=True)
    assert torch.equal(torch.cat([d["inputs"] for d in mine]), x[13:25]) and all(d["scale"] == 2.0 for d in mine)
    with pytest.raises(ConfigError, match="fewer than the 4 ranks"):
        shard_ranges([3], 4)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_estimator_over_ranks_equals_one_process(tmp_path, ranks):
    """Every registered estimator (read from the registry in the job), per-layer blocks, the PyHessian-style API
    and a dict-batch objective over ``ranks`` ranks: within 1e-12 of one process in float64, on every rank."""
    reference = estimator_results()
    run_job("estimators", ranks, str(tmp_path / "est"))
    for rank in range(ranks):
        got = torch.load(tmp_path / f"est.rank{rank}.pt", weights_only=True)
        off = _close(got, reference, 1e-12, f"rank {rank} of {ranks}")
        assert not off, off
        assert got["hvps"] == reference["hvps"]


@pytest.fixture(scope="module")
def curvatures_over_two_ranks(tmp_path_factory):
    """Every curvature case computed in this process and by one job of 2 ranks: (reference, [rank 0's, rank 1's])."""
    reference = curvature_results()
    out = tmp_path_factory.mktemp("curvatures") / "curv"
    run_job("curvatures", 2, str(out))
    return reference, [torch.load(f"{out}.rank{rank}.pt", weights_only=True) for rank in range(2)]


with registered():
    CURVATURE_CASES = curvature_cases()  # every registered kind (and the sampled-label Fisher of the job)


@pytest.mark.parametrize("curvature,products", CURVATURE_CASES)
def test_every_curvature_over_two_ranks_equals_one_process(curvatures_over_two_ranks, curvature, products):
    """Every registered curvature kind (read from the registry here and in the job), the Hessian by each product
    method, and a kind that draws random numbers (labels sampled per sample from its seed): products, loss,
    gradient, top eigenvalue, trace and every registered measured quantity over 2 ranks within 1e-12 of one process
    in float64, on every rank.
    Finite differences: every rank takes the same step and states the same error (calibrated on the whole
    evaluation set); their products differ from one process's by the rounding of a difference quotient (eps
    ||g|| / h, some 1e-11 here, whatever the step: the ranks sum the gradients in another order), within their
    stated error; the trace, loss and gradient within 1e-12, and the eigenvalues, which the products determine,
    within twice the products' measured difference (an eigenvalue of A + E is within ||E|| of A's: 1e-12 is more
    than a difference quotient's rounding allows)."""
    reference, got = curvatures_over_two_ranks
    key = f"{curvature} {products}"
    mine = {k: v for k, v in reference.items() if k.startswith(f"{key} ")}
    assert f"{key} products" in mine
    finite = products == "finite-difference"
    for rank, result in enumerate(got):
        exact = {k: v for k, v in mine.items() if not (finite and k.endswith((" products", " stated error",
                                                                              " step factor", " eigenvalue")))}
        off = _close({k: result[k] for k in exact}, exact, 1e-12, f"rank {rank} of 2")
        assert not off, off
        if finite:
            P, Q = result[f"{key} products"], mine[f"{key} products"]
            apart = float(((P - Q).norm(dim=0) / Q.norm(dim=0)).max())
            eigen = {k: v for k, v in mine.items() if k.endswith(" eigenvalue")}
            assert len(eigen) == 2  # the top eigenvalue and the damped one
            off = _close({k: result[k] for k in eigen}, eigen, max(1e-12, 2 * apart), f"rank {rank} of 2")
            assert not off, (off, apart)
    if finite:
        assert float(got[0][f"{key} step factor"]) == float(got[1][f"{key} step factor"])
        error = float(got[0][f"{key} stated error"])
        assert error == float(got[1][f"{key} stated error"])
        one = float(mine[f"{key} stated error"])
        assert 0.5 < error / one < 2.0, (error, one)  # one estimate of the same error, from the whole set
        for result in got:
            P, Q = result[f"{key} products"], mine[f"{key} products"]
            assert bool(((P - Q).norm(dim=0) <= min(error, one) * Q.norm(dim=0)).all())


@pytest.fixture(scope="module")
def one_process_training(tmp_path_factory):
    """Every training case in this process, one client at a time: the reference."""
    return training_results(tmp_path_factory.mktemp("one"), parallel=1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_training_over_ranks_equals_one_process(tmp_path, ranks, one_process_training):
    """A case of every registered algorithm, regularizer and optimizer (5 clients of unequal sizes, cohorts of 5,
    3 and 1 clients: shares of 3+2, 2+1, 1+0 over 2 ranks; 2+2+1, 1+1+1, 1+0+0 over 3), each rank stacking its
    share: server weights, clients' models, buffers and the algorithm's state within 1e-9 of one process training
    one client at a time, on every rank."""
    from flatfl.train.catalog import load_all
    from flatfl.train.components import ALGORITHMS

    load_all()
    assert {c.algo for c in training_cases()} >= set(ALGORITHMS)
    reference = one_process_training
    run_job("training", ranks, str(tmp_path / "train"), timeout=600)
    for rank in range(ranks):
        got = torch.load(tmp_path / f"train.rank{rank}.pt", weights_only=True)
        off = _close(got, reference, 1e-9, f"rank {rank} of {ranks}")
        assert not off, off


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A digits run of 2 rounds with its clients' models saved."""
    from click.testing import CliRunner

    from flatfl.cli import main

    out = tmp_path_factory.mktemp("dist") / "run"
    res = CliRunner().invoke(main, ["train", "--rounds", "2", "--clients", "6", "--save-clients", "--threads", "1",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _flatfl(*args) -> SimpleNamespace:
    """``flatfl ARGS --threads 1`` as one process, the reference the ranks are compared with: run in this process
    (as the other tests run the commands; a process of its own would only add its start-up, several seconds of
    imports). Its exit code, stdout and stderr, as a finished process's."""
    from click.testing import CliRunner

    from flatfl.cli import main

    res = CliRunner().invoke(main, [*args, "--threads", "1"])
    crash = "" if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr + crash)


def test_hessian_under_torchrun_equals_one_process(tiny_run, tmp_path):
    """``torchrun --nproc-per-node 2 -m flatfl hessian RUN --top 3 --samples 1001``: the single process's
    eigenvalues within 1e-5 and trace within 1e-4 (float32), the world size in hessian.json, one set of files."""
    one = _flatfl("hessian", str(tiny_run), "--top", "3", "--samples", "1001", "--trace-hvps", "40",
                  "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = torchrun(["hessian", str(tiny_run), "--top", "3", "--samples", "1001", "--trace-hvps", "40",
                    "--threads", "1", "--out", str(tmp_path / "two")], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    a = json.loads((tmp_path / "one" / "hessian.json").read_text())
    b = json.loads((tmp_path / "two" / "hessian.json").read_text())
    assert np.allclose(b["top_eigenvalues"], a["top_eigenvalues"], rtol=1e-5, atol=0)
    assert math.isclose(b["trace"]["estimate"], a["trace"]["estimate"], rel_tol=1e-4)
    assert b["distributed"] == {"world_size": 2, "backend": "gloo"} and b["num_samples"] == 1001
    assert a["distributed"] == {"world_size": 1, "backend": None}
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert two.stdout.count("top eigenvalues") == 1  # rank 0 alone prints


def test_hessian_clients_and_surface_under_torchrun_equal_one_process(tiny_run, tmp_path):
    """hessian-clients over 2 ranks (each probes every other client): every metric within 1e-4 of one process;
    surface grid points over 2 ranks: the same grid."""
    args = ["hessian-clients", str(tiny_run), "--probes", "8", "--samples", "48"]
    one = _flatfl(*args, "--out", str(tmp_path / "c1"))
    assert one.returncode == 0, one.stderr
    two = torchrun([*args, "--threads", "1", "--out", str(tmp_path / "c2")], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    a = json.loads((tmp_path / "c1" / "clients-default.json").read_text())
    b = json.loads((tmp_path / "c2" / "clients-default.json").read_text())
    for key in ("H_N", "H_D", "H_N_stderr", "diag_norms", "pair_H_N"):
        assert np.allclose(np.asarray(b[key], dtype=float), np.asarray(a[key], dtype=float), rtol=1e-4,
                           equal_nan=True), key
    assert b["hvps"] == a["hvps"] and b["distributed"]["world_size"] == 2
    args = ["surface", str(tiny_run), "--grid", "5", "--samples", "64"]
    one = _flatfl(*args, "--out", str(tmp_path / "s1"))
    two = torchrun([*args, "--threads", "1", "--out", str(tmp_path / "s2")], 2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr[-3000:])
    g1, g2 = np.load(tmp_path / "s1" / "surface.npz"), np.load(tmp_path / "s2" / "surface.npz")
    assert np.array_equal(g1["loss"], g2["loss"]) and g2["done"].all()


def test_train_under_torchrun_equals_one_process(tmp_path):
    """``flatfl train`` over 2 ranks: the server weights within 1e-5 of one process (float32), the evaluation (its
    batches dealt out to the ranks) the same, the world size in config.json and the report's scale line."""
    from flatfl.report.layouts import training_path_label

    args = ["train", "--rounds", "2", "--algo", "scaffold", "--clients", "6", "--seed", "4"]
    one = _flatfl(*args, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = torchrun([*args, "--threads", "1", "--out", str(tmp_path / "two")], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    a = torch.load(tmp_path / "one" / "final.pt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "two" / "final.pt", weights_only=False)["state_dict"]
    assert all(torch.allclose(b[k], a[k], rtol=1e-5, atol=1e-7) for k in a)
    import csv

    rows = [list(csv.DictReader(open(tmp_path / name / "metrics.csv"))) for name in ("one", "two")]
    for key in ("test_acc", "train_acc", "all_test_acc", "test_loss", "train_loss"):  # evaluation split too
        assert [float(r[key]) for r in rows[1]] == pytest.approx([float(r[key]) for r in rows[0]], rel=1e-6), key
    path = json.loads((tmp_path / "two" / "config.json").read_text())["training_path"]
    assert path["world_size"] == 2 and path["backend"] == "gloo"
    assert "clients over 2 ranks (gloo)" in training_path_label([SimpleNamespace(training_path=path)])


def test_a_killed_rank_ends_the_others_in_one_line_and_the_run_resumes(tmp_path):
    """SIGKILL to rank 1 while a 2-rank run trains: rank 0 ends within a minute with one error line (no traceback,
    non-zero exit); the rerun with --resume finishes, and its weights equal an uninterrupted run's."""
    out = tmp_path / "run"
    args = ["-m", "flatfl", "train", "--rounds", "12", "--clients", "4", "--checkpoint-every", "1", "--threads", "1",
            "--out", str(out)]
    procs = start_ranks(args, 2)
    try:
        deadline = time.monotonic() + 120
        while not (out / "resume.pt").exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert (out / "resume.pt").exists(), procs[0].communicate(timeout=5)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    assert procs[0].returncode not in (0, None) and len(lines) == 1 and "another rank" in lines[0], err
    assert "Traceback" not in err
    procs = start_ranks(["-m", "flatfl", "train", "--threads", "1", "--resume", str(out)], 2)
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    fresh = _flatfl(*args[2:-2], "--out", str(tmp_path / "fresh"))
    assert fresh.returncode == 0, fresh.stderr
    a = torch.load(tmp_path / "fresh" / "final.pt", weights_only=False)["state_dict"]
    b = torch.load(out / "final.pt", weights_only=False)["state_dict"]
    assert all(torch.allclose(b[k], a[k], rtol=1e-5, atol=1e-7) for k in a)


def test_a_bad_input_is_one_line_from_rank_0_and_every_rank_exits_2(tmp_path):
    """An input error (a missing checkpoint) under 2 ranks: one line in all, the same exit code on every rank."""
    procs = start_ranks(["-m", "flatfl", "hessian", str(tmp_path / "missing"), "--out", str(tmp_path / "h")], 2)
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    lines = [line for _, err in results for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flatfl: error:"), results
