"""Cross-client Hessian metrics H_N, H_D (FedAlign Eq. 3-4): exact values on known diagonals, honest standard errors
on noisy Hutchinson estimates, FedAlign's K x K self-pair convention, and the ``hessian-clients`` command."""
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import flatfl
from flatfl.analysis import HessianOperator, MatrixOperator, pyhessian_trace
from flatfl.analysis.estimators.client_metrics import block_probe_rows, cross_client_metrics, pairwise_metrics
from flatfl.cli import main
from flatfl.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def symmetric_with_diagonal(diag: np.ndarray, offdiag: float, rng) -> np.ndarray:
    a = rng.normal(size=(len(diag), len(diag))) * offdiag
    a = (a + a.T) / 2
    np.fill_diagonal(a, diag)
    return a


def test_pairwise_metrics_by_hand():
    # ||(3, 4)|| = 5, ||(0, 2)|| = 2: H_N = (5 - 2)^2 = 9, H_D = 8 / (5 * 2) = 0.8
    m = pairwise_metrics([[3.0, 4.0], [0.0, 2.0]])
    assert m["H_N"] == pytest.approx(9.0) and m["H_D"] == pytest.approx(0.8)
    # FedAlign's parse_logs.py: mean over the whole 2 x 2 matrix, self-pairs (0 and 1) included
    full = pairwise_metrics([[3.0, 4.0], [0.0, 2.0]], self_pairs=True)
    assert full["H_N"] == pytest.approx((0 + 9 + 9 + 0) / 4) and full["H_D"] == pytest.approx((1 + 0.8 + 0.8 + 1) / 4)


def test_diagonal_operators_give_exact_values_and_zero_stderr():
    rng = np.random.default_rng(0)
    diags = rng.uniform(0.2, 3.0, size=(5, 40)) * np.array([1, 1.5, 0.7, 1, 2])[:, None]
    diags[2, :5] *= -1  # negative curvature in places: the cosine is not trivially near 1
    ops = [MatrixOperator(torch.tensor(np.diag(d))) for d in diags]
    m = cross_client_metrics(ops, protocol="default", probes=8, groups=4)
    exact = pairwise_metrics(diags)
    # on a diagonal matrix every probe z * Hz is the diagonal itself: the estimates are exact, the noise zero
    assert m.H_N == pytest.approx(exact["H_N"], rel=1e-12)
    assert m.H_D == pytest.approx(exact["H_D"], rel=1e-12)
    np.testing.assert_allclose(m.diag_norms, np.linalg.norm(diags, axis=1), rtol=1e-12)
    upper = np.triu_indices(5, 1)
    np.testing.assert_allclose(m.pair_H_D[upper], exact["pair_H_D"][upper], rtol=1e-12)
    assert m.H_N_stderr == pytest.approx(0, abs=1e-9) and m.H_D_stderr == pytest.approx(0, abs=1e-12)
    assert m.pairs == "distinct" and np.isnan(m.pair_H_N[0, 0])  # no self-pairs in the default protocol
    assert m.probes == [8] * 5 and m.hvps == 40


def test_a_client_whose_debiased_norm_is_not_positive_is_said_to_understate_h_n():
    """A client whose diagonal's debiased squared norm comes out <= 0 (here a zero Hessian: exactly 0) has no H_D,
    and its norm enters H_N as 0: the note says both, and when every client is so, that H_N is 0 by construction."""
    zero = MatrixOperator(torch.zeros(6, 6, dtype=torch.float64))
    some = MatrixOperator(torch.diag(torch.linspace(1, 2, 6, dtype=torch.float64)))
    one = cross_client_metrics([zero, some, some], protocol="default", probes=4, groups=2)
    assert one.notes[0].startswith("clients [0]: the probe noise exceeds the diagonal's squared norm") and \
        "their norm enters H_N as 0, understating it; use more probes" in one.notes[0]
    every = cross_client_metrics([zero, zero], protocol="default", probes=4, groups=2)
    assert every.H_N == 0 and "(every client: H_N is then 0 by construction)" in every.notes[0]


def test_fedalign_protocol_reproduces_its_full_matrix_mean_of_block_traces():
    rng = np.random.default_rng(1)
    blocks = [6, 10, 4]
    diags = rng.uniform(0.1, 2.0, size=(4, sum(blocks)))
    diags[3] *= 3.0
    ops = [MatrixOperator(torch.tensor(np.diag(d))) for d in diags]
    m = cross_client_metrics(ops, protocol="fedalign", blocks=blocks)
    # FedAlign's "Diag(H)": the trace of each parameter block; exact for a diagonal matrix
    edges = np.cumsum([0] + blocks)
    block_traces = np.stack([[d[a:b].sum() for a, b in zip(edges, edges[1:])] for d in diags])
    # parse_logs.py, written out: norm and direction matrices over all K x K pairs, then np.mean of each
    K = len(diags)
    norm_matrix = np.zeros((K, K))
    dir_matrix = np.zeros((K, K))
    for k in range(K):
        for j in range(K):
            nk, nj = np.linalg.norm(block_traces[k]), np.linalg.norm(block_traces[j])
            norm_matrix[k, j] = (nk - nj) ** 2
            dir_matrix[k, j] = block_traces[k] @ block_traces[j] / (nk * nj)
    assert m.H_N == pytest.approx(norm_matrix.mean(), rel=1e-12)
    assert m.H_D == pytest.approx(dir_matrix.mean(), rel=1e-12)
    np.testing.assert_allclose(np.diag(m.pair_H_D), 1.0)
    np.testing.assert_allclose(np.diag(m.pair_H_N), 0.0)
    # the self-pairs matter: the distinct-pair mean is a different number
    distinct = pairwise_metrics(block_traces)
    assert abs(distinct["H_D"] - m.H_D) > 1e-3 and abs(distinct["H_N"] - m.H_N) > 1e-3
    # PyHessian's rule stops after the second probe when the estimate does not move
    assert m.probes == [2] * 4


def test_fedalign_block_probes_are_pyhessians_trace_draws():
    rng = np.random.default_rng(2)
    op = MatrixOperator(torch.tensor(symmetric_with_diagonal(rng.uniform(1, 2, 30), 0.5, rng)))
    rows = block_probe_rows(op, [(30,)], max_probes=50, tol=1e-3, seed=7)
    reference = pyhessian_trace(op, max_iter=50, tol=1e-3, seed=7)
    np.testing.assert_allclose(rows.sum(axis=1), reference.samples, rtol=1e-12)


def test_hutchinson_estimates_are_unbiased_within_their_standard_errors():
    """Noisy diagonals (off-diagonal mass): the debiased default is within its jackknife errors over many seeds,
    while Eq. 3-4 plugged in as they are pull H_D down (the probe noise inflates every norm)."""
    rng = np.random.default_rng(3)
    K, D = 4, 150
    diags = rng.uniform(0.5, 3.0, size=(K, D))
    diags[1] *= 1.4
    ops = [MatrixOperator(torch.tensor(symmetric_with_diagonal(d, 0.2, rng))) for d in diags]
    exact = pairwise_metrics(diags)
    z = []
    for seed in range(12):
        m = cross_client_metrics(ops, probes=40, groups=10, seed=seed)
        z.append([(m.H_N - exact["H_N"]) / m.H_N_stderr, (m.H_D - exact["H_D"]) / m.H_D_stderr,
                  (m.plugin["H_D"] - exact["H_D"]) / m.plugin["H_D_stderr"]])
        norm_z = (m.diag_norms - np.linalg.norm(diags, axis=1)) / m.diag_norms_stderr
        assert np.all(np.abs(norm_z) < 5), norm_z
    z = np.array(z)
    assert np.all(np.abs(z[:, :2]) < 5), z[:, :2]
    assert abs(z[:, 0].mean()) < 1.2 and abs(z[:, 1].mean()) < 1.2, z.mean(axis=0)  # sd of a 12-mean: ~0.35
    assert z[:, 2].mean() < -2.0, z[:, 2]  # the plug-in cosine is biased low by several standard errors


def test_cross_client_metrics_on_model_hessians_match_the_dense_diagonals():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(0)
    clients = []
    for k in range(3):  # three clients with differently shifted inputs and skewed labels
        x = torch.randn(40, 4, generator=g, dtype=torch.float64) + k
        y = torch.randint(0, 3, (40,), generator=g) * (k % 2) + (1 - k % 2) * (torch.arange(40) % 2)
        clients.append([(x, y)])
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def dense_diagonal(batches):
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])

        def loss(*flat):
            out = torch.func.functional_call(model, dict(zip(names, flat)), (x,))
            return torch.nn.functional.cross_entropy(out, y)

        hess = torch.autograd.functional.hessian(loss, tuple(p.detach() for p in params))
        return torch.cat([hess[i][i].reshape(p.numel(), p.numel()).diagonal() for i, p in enumerate(params)])

    diags = np.stack([dense_diagonal(b).numpy() for b in clients])
    exact = pairwise_metrics(diags)
    m = cross_client_metrics([lambda b=b: HessianOperator(model, b) for b in clients], probes=60, groups=10, seed=0)
    assert abs(m.H_N - exact["H_N"]) < 4 * m.H_N_stderr + 1e-9
    assert abs(m.H_D - exact["H_D"]) < 4 * m.H_D_stderr
    assert np.all(np.abs(m.diag_norms - np.linalg.norm(diags, axis=1)) < 4 * m.diag_norms_stderr)


def test_cross_client_metrics_rejects_bad_input():
    op = MatrixOperator(torch.eye(3))
    with pytest.raises(ConfigError, match="protocol"):
        cross_client_metrics([op, op], protocol="nope")
    with pytest.raises(ConfigError, match="at least 2 clients"):
        cross_client_metrics([op])
    with pytest.raises(ConfigError, match="parameter blocks"):
        cross_client_metrics([op, op], protocol="fedalign")
    with pytest.raises(ConfigError, match="probes"):
        cross_client_metrics([op, op], probes=3)


# ---------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("clients") / "run"
    r = CliRunner().invoke(main, ["train", "--model", "tiny", "--clients", "4", "--participation", "1.0",
                                  "--rounds", "1", "--local-epochs", "1", "--batch-size", "64", "--save-clients",
                                  "--quiet", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def _one_line_error(result):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("flatfl: error:"), result.stderr
    return lines[0]


def test_hessian_clients_command_writes_its_file_and_heatmap(run_dir, tmp_path):
    out = tmp_path / "h"
    out.mkdir()
    ckpt = flatfl.load_checkpoint(run_dir)
    # an existing hessian.json of the same checkpoint is left as it is (a user's file of that name too: it is read,
    # never written)
    before = json.dumps({"checkpoint": str(ckpt.path), "top_eigenvalues": [1.5]})
    (out / "hessian.json").write_text(before)
    r = CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(out), "--probes", "8",
                                  "--groups", "4", "--samples", "64", "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (out / "hessian.json").read_text() == before
    c = json.loads((out / "clients-default.json").read_text())
    assert c["protocol"] == "default" and c["num_clients"] == 4 and c["probes"] == [8] * 4
    sizes = flatfl.load_checkpoint(run_dir).partition.sizes  # what was used, not only what was asked
    used = sorted({min(64, int(n)) for n in sizes if n > 0})
    drawn = str(used[0]) if len(used) == 1 else f"{used[0]}-{used[-1]}"
    assert c["data"].startswith(f"each client's own training data ({drawn} samples a client: 64 asked, drawn once "
                                "per client with seed 0"), c["data"]
    for key in ("H_N", "H_N_stderr", "seconds", "hvps"):
        assert isinstance(c[key], (int, float)), key
    # with 8 probes on 2,410 coordinates a client's debiased squared norm may come out <= 0: then H_D is
    # undefined and the report says why
    assert isinstance(c["H_D"], float) or (c["H_D"] is None and c["notes"])
    assert isinstance(c["plugin"]["H_D"], float)
    assert np.array(c["pair_H_N"], dtype=float).shape == (4, 4)
    upper = np.triu_indices(4, 1)
    assert c["H_N"] == pytest.approx(np.mean(np.array(c["pair_H_N"], dtype=float)[upper]))
    assert (out / "clients_heatmap-default.png").stat().st_size > 0
    assert (out / "clients_heatmap-default.pdf").stat().st_size > 0

    # FedAlign's protocol: local models, K x K mean with self-pairs
    out2 = tmp_path / "h2"
    r = CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(out2), "--protocol", "fedalign",
                                  "--probes", "4", "--samples", "128", "--quiet"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    c = json.loads((out2 / "clients-fedalign.json").read_text())
    pair_n, pair_d = np.array(c["pair_H_N"], dtype=float), np.array(c["pair_H_D"], dtype=float)
    assert c["H_N"] == pytest.approx(pair_n.mean()) and c["H_D"] == pytest.approx(pair_d.mean())
    np.testing.assert_allclose(np.diag(pair_d), 1.0)
    assert len(c["diag_norms"]) == 4 and c["deviations_from_fedalign_code"]


def test_hessian_clients_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(run_dir / "final.pt", lone / "final.pt")  # a checkpoint without clients.pt
    out = tmp_path / "out"
    line = _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(lone), "--out", str(out)]))
    assert "--save-clients" in line and not out.exists()
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(garbage), "--out", str(out)]))
    line = _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(out),
                                                     "--protocol", "pyhessian"]))
    assert "protocol" in line
    _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(out), "--probes", "1"]))
    assert not out.exists()
    other = tmp_path / "other"
    other.mkdir()
    from flatfl.utils.io import atomic_write_json

    atomic_write_json(other / "hessian.json", {"checkpoint": "/elsewhere/final.pt"})
    names = sorted(p.name for p in other.iterdir())
    line = _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(other)]))
    assert "belongs to" in line and sorted(p.name for p in other.iterdir()) == names
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "clients-default.json").write_text("{}")  # a file of the user's that shares the output's name
    line = _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(run_dir), "--out", str(mine)]))
    assert "not written by flatfl" in line and [p.name for p in mine.iterdir()] == ["clients-default.json"]
    assert (mine / "clients-default.json").read_text() == "{}"


def test_the_readmes_two_protocols_live_side_by_side(run_dir, tmp_path):
    """The README's two `hessian-clients` commands into one folder keep both results; the same protocol with other
    settings is refused in one line (nothing changed); the same command again replaces its own file."""
    run = tmp_path / "x"
    shutil.copytree(run_dir, run)
    out = run / "hessian"

    def clients(*extra):
        return CliRunner().invoke(main, ["hessian-clients", str(run), "--out", str(out), "--probes", "4", "--groups",
                                         "2", "--samples", "32", "--quiet", *extra])

    assert clients().exit_code == 0
    first = (out / "clients-default.json").read_text()
    assert clients("--protocol", "fedalign").exit_code == 0
    assert (out / "clients-default.json").read_text() == first  # not overwritten
    fa = json.loads((out / "clients-fedalign.json").read_text())
    assert fa["protocol"] == "fedalign" and fa["settings"]["samples"] == 32
    assert json.loads(first)["protocol"] == "default"
    assert {p.name for p in out.glob("clients_heatmap-*.png")} == {"clients_heatmap-default.png",
                                                                    "clients_heatmap-fedalign.png"}
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    line = _one_line_error(CliRunner().invoke(main, ["hessian-clients", str(run), "--out", str(out), "--probes",
                                                     "6", "--groups", "2", "--samples", "32", "--quiet"]))
    assert "clients-default.json" in line and "probes 4 (now 6)" in line and "another --out" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert clients().exit_code == 0  # the same settings again: its own file recomputed (the same numbers)
    assert json.loads((out / "clients-default.json").read_text())["H_N"] == json.loads(first)["H_N"]


def test_hessian_after_hessian_clients_keeps_the_clients_results(tmp_path):
    """`flatfl hessian` into a folder holding `hessian-clients` results of the same checkpoint keeps them."""
    import json

    from click.testing import CliRunner

    from flatfl.cli import main

    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--model", "tiny", "--clients", "3", "--rounds", "1", "--local-epochs", "1",
                                  "--save-clients", "--quiet", "--out", str(run)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "h"
    r = CliRunner().invoke(main, ["hessian-clients", str(run), "--probes", "10", "--groups", "5", "--samples", "60",
                                  "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    clients = (out / "clients-default.json").read_text()
    r = CliRunner().invoke(main, ["hessian", str(run), "--samples", "60", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "clients-default.json").read_text() == clients
    assert json.loads((out / "hessian.json").read_text())["top_eigenvalues"]
