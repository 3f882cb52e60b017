"""Loss surfaces: filter-normalised directions (Li et al. 2018), the exact quadratic along Hessian eigenvectors,
the checkpoint's loss at the origin, resume of a partial grid, worker processes, and bad input on the command line."""
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

import flatfl
from flatfl.analysis.estimators.directions import hessian_directions, random_directions
from flatfl.analysis.estimators.surface import grid_coordinates, loss_surface
from flatfl.analysis.estimators.surface_files import GridFile
from flatfl.cli import main
from flatfl.errors import ConfigError
from tiny_run import train_tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_random_directions_are_filter_normalised():
    model = small_cnn()
    params = list(model.parameters())
    d1, d2 = random_directions(model, seed=3)
    for w, a, b in zip(params, d1, d2):
        assert a.shape == w.shape and b.shape == w.shape
        if w.dim() > 1:  # every output filter has its weight filter's norm
            for d in (a, b):
                np.testing.assert_allclose(d.reshape(d.shape[0], -1).norm(dim=1).numpy(),
                                           w.detach().reshape(w.shape[0], -1).norm(dim=1).numpy(), rtol=1e-5)
            assert not torch.allclose(a, b)
        else:  # biases and BatchNorm affine parameters are ignored by default
            assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
    # reproducible per seed, different across seeds
    again = random_directions(model, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(d1, again[0]))
    assert not torch.allclose(d1[0], random_directions(model, seed=4)[0][0])
    # include_bn_bias: 1-D tensors follow the weights (loss-landscape without 'biasbn'); the rest is unchanged
    e1, _ = random_directions(model, seed=3, include_bn_bias=True)
    for w, a, b in zip(params, d1, e1):
        assert torch.equal(b, w.detach()) if w.dim() <= 1 else torch.equal(a, b)


class Quadratic(nn.Module):
    """A model whose loss is exactly L(theta) = 0.5 theta^T A theta + b^T theta (the inputs are ignored)."""

    def __init__(self, A, b, theta):
        super().__init__()
        self.register_buffer("A", A)
        self.register_buffer("b", b)
        self.theta = nn.Parameter(theta.clone())

    def forward(self, x):
        value = 0.5 * self.theta @ self.A @ self.theta + self.b @ self.theta
        return value.expand(x.shape[0])


def quadratic_loss(outputs, targets):
    return outputs.mean()


def test_surface_along_hessian_eigenvectors_is_the_exact_quadratic():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    lambdas = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, -0.7], dtype=torch.float64)
    A = Q @ torch.diag(lambdas) @ Q.T
    b = torch.randn(6, generator=g, dtype=torch.float64)
    minimum = -torch.linalg.solve(A, b)  # the stationary point: the gradient vanishes there
    model = Quadratic(A, b, minimum)
    batches = [(torch.zeros(4, 1), torch.zeros(4))]
    (d1, d2), values, info = hessian_directions(model, batches, loss_fn=quadratic_loss)
    top2 = np.sort(np.linalg.eigvalsh(A.numpy()))[::-1][:2]
    np.testing.assert_allclose(values, top2, rtol=1e-10)
    assert float(d1[0].norm()) == pytest.approx(1.0) and float(d2[0].norm()) == pytest.approx(1.0)
    result = loss_surface(model, batches, (d1, d2), grid=7, range=0.8, loss_fn=quadratic_loss)
    X, Y = np.meshgrid(result.xs, result.ys)
    L0 = float(0.5 * minimum @ A @ minimum + b @ minimum)
    expected = L0 + 0.5 * (top2[0] * X**2 + top2[1] * Y**2)
    np.testing.assert_allclose(result.loss, expected, rtol=1e-10, atol=1e-12)
    assert np.isnan(result.accuracy).all()  # not a classifier: no accuracy
    assert torch.equal(model.theta.detach(), minimum)  # the weights are restored


def classification_problem():
    model = small_cnn()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 1, 8, 8, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    with torch.no_grad():  # BatchNorm statistics away from the defaults: eval mode must be used
        model[1].running_mean.fill_(0.3)
        model[1].running_var.fill_(2.0)
    return model, [(x[:20], y[:20]), (x[20:], y[20:])], x, y


def test_grid_points_are_the_perturbed_models_loss_and_accuracy():
    model, batches, x, y = classification_problem()
    model.train()
    dirs = random_directions(model, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    result = loss_surface(model, batches, dirs, grid=3, range=0.5)
    assert model.training and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # independent truth: build the perturbed model from scratch for a corner and evaluate the whole set at once
    corner = small_cnn()
    corner.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p, a, b in zip(corner.parameters(), *dirs):
            p.add_(-0.5 * a + 0.5 * b)  # (x, y) = (-0.5, 0.5): ix 0, iy 2
    corner.eval()
    with torch.no_grad():
        out = corner(x)
        loss, acc = F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()
    assert result.loss[2, 0] == pytest.approx(loss, rel=1e-5)
    assert result.accuracy[2, 0] == pytest.approx(acc)
    with torch.no_grad():
        model.eval()
        centre = F.cross_entropy(model(x), y).item()
    assert result.loss[1, 1] == pytest.approx(centre, rel=1e-6)


def test_a_grid_file_of_another_shape_or_with_bad_values_is_refused(tmp_path):
    """surface.npz is read back checked: a grid of another shape, a NaN or an accuracy above 1 at a point marked
    done, or a ``done`` that is not boolean is one line (resume refused), never a plotting error or a kept value."""
    from flatfl.errors import CheckpointError

    grid = GridFile.new(tmp_path / "surface.npz", np.linspace(-1, 1, 3), {"a": 1})
    for i, (loss, acc) in enumerate([(0.5, 0.9)] * 9):
        grid.record(i, loss, acc)
    grid.save()
    assert GridFile.load(grid.path).done.all()
    z = dict(np.load(grid.path, allow_pickle=False))
    bad = {"shape": dict(z, loss=np.zeros((5, 7))), "nan": dict(z, loss=np.where(np.eye(3, dtype=bool), np.nan, 0.5)),
           "accuracy": dict(z, accuracy=np.full((3, 3), 1.5)), "done": dict(z, done=np.full((3, 3), "yes"))}
    for name, arrays in bad.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(CheckpointError, match="is not a readable flatfl surface grid; delete it or pass --force"):
            GridFile.load(path)
    partial = dict(z, done=np.eye(3, dtype=bool), loss=np.where(np.eye(3, dtype=bool), 0.5, np.nan))
    np.savez(tmp_path / "partial.npz", **partial)  # the points not done may hold anything: never read
    assert GridFile.load(tmp_path / "partial.npz").done.sum() == 3


def test_partial_grid_resumes_without_recomputing_finished_points(tmp_path):
    model, batches, _, _ = classification_problem()
    dirs = random_directions(model, seed=0)
    reference = loss_surface(model, batches, dirs, grid=5, range=1.0)
    path = tmp_path / "surface.npz"

    class Killed(Exception):
        pass

    def kill_after_seven(done, total):
        if done == 7:
            raise Killed

    with pytest.raises(Killed):
        loss_surface(model, batches, dirs, grid=5, range=1.0, grid_file=path, fingerprint={"a": 1}, save_every=3,
                     progress=kill_after_seven)
    partial = GridFile.load(path)
    assert partial.done.sum() == 6  # saved atomically after points 3 and 6; point 7 was lost with the "kill"
    np.testing.assert_array_equal(partial.loss[partial.done], reference.loss[partial.done])

    calls = []

    def counting_loss(outputs, targets):
        calls.append(1)
        return F.cross_entropy(outputs, targets)

    resumed = loss_surface(model, batches, dirs, grid=5, range=1.0, grid_file=path, fingerprint={"a": 1},
                           loss_fn=counting_loss, save_every=3)
    assert resumed.computed == 25 - 6 and len(calls) == (25 - 6) * len(batches)
    assert resumed.complete
    np.testing.assert_allclose(resumed.loss, reference.loss, rtol=1e-6)
    np.testing.assert_array_equal(GridFile.load(path).done, np.ones((5, 5), bool))
    # the grid file refuses other settings
    with pytest.raises(ConfigError, match="other settings"):
        loss_surface(model, batches, dirs, grid=5, range=1.0, grid_file=path, fingerprint={"a": 2})


def test_two_workers_give_the_same_grid():
    model, batches, _, _ = classification_problem()
    dirs = random_directions(model, seed=1)
    one = loss_surface(model, batches, dirs, grid=4, range=0.7)
    two = loss_surface(model, batches, dirs, grid=4, range=0.7, workers=2, save_every=2)
    assert two.workers == 2 and two.computed == 16
    np.testing.assert_allclose(two.loss, one.loss, rtol=1e-5)
    np.testing.assert_array_equal(two.accuracy, one.accuracy)


# ---------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("surface") / "run", "--participation", "1.0")


def test_surface_command_centre_is_the_checkpoints_loss_and_resumes(run_dir, tmp_path):
    out = tmp_path / "s"
    args = ["surface", str(run_dir), "--grid", "3", "--range", "0.4", "--samples", "300", "--out", str(out),
            "--quiet"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for name in ("surface.csv", "surface.npz", "surface.json", "directions.pt", "surface_contour.png",
                 "surface_contour.pdf", "surface_3d.png", "surface_3d.pdf"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "surface.json").read_text())
    ckpt = flatfl.load_checkpoint(run_dir)
    x, y = (torch.cat(t) for t in zip(*ckpt.eval_batches("train", samples=300, batch_size=300, seed=0)))
    with torch.no_grad():
        expected = F.cross_entropy(ckpt.model(x), y).item()
    assert summary["loss_at_origin"] == pytest.approx(expected, rel=1e-5)
    rows = (out / "surface.csv").read_text().strip().splitlines()
    assert rows[0] == "x,y,loss,accuracy" and len(rows) == 1 + 9
    assert [float(v) for v in rows[5].split(",")[:2]] == [0.0, 0.0]
    # rerunning finds every point done: nothing is recomputed
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0 and json.loads((out / "surface.json").read_text())["points_computed_now"] == 0


def test_surface_command_with_saved_eigenvectors(run_dir, tmp_path):
    h = tmp_path / "h"
    r = CliRunner().invoke(main, ["hessian", str(run_dir), "--top", "2", "--no-trace", "--samples", "200",
                                  "--save-eigenvectors", "--quiet", "--out", str(h)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = tmp_path / "s"
    r = CliRunner().invoke(main, ["surface", str(run_dir), "--directions", "hessian", "--eigenvectors",
                                  str(h / "eigenvectors.pt"), "--grid", "3", "--samples", "200", "--quiet",
                                  "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    saved = torch.load(h / "eigenvectors.pt", weights_only=True)["vectors"][:2]
    used = torch.stack(torch.load(out / "directions.pt", weights_only=True)["vectors"])
    assert torch.equal(saved, used)
    summary = json.loads((out / "surface.json").read_text())
    assert summary["directions"]["kind"] == "hessian"


def _one_line_error(result):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("flatfl: error:"), result.stderr
    return lines[0]


def test_surface_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path):
    out = tmp_path / "out"
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    cases = [
        (["--grid", "1"], "--grid"),
        (["--range", "0"], "--range"),
        (["--range", "-1"], "--range"),
        (["--workers", "0"], "--workers"),
        (["--directions", "pca"], "direction"),
        (["--eigenvectors", str(garbage)], "--directions hessian"),
        (["--directions", "hessian", "--eigenvectors", str(garbage)], "eigenvector"),
        (["--split", "valid"], "split"),
    ]
    for extra, words in cases:
        line = _one_line_error(CliRunner().invoke(main, ["surface", str(run_dir), "--out", str(out), *extra]))
        assert words in line, (extra, line)
        assert not out.exists(), extra
    line = _one_line_error(CliRunner().invoke(main, ["surface", str(garbage), "--out", str(out)]))
    assert "checkpoint" in line and not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(CliRunner().invoke(main, ["surface", str(empty), "--out", str(out)]))
    assert not out.exists()
    # a grid of other settings already in --out is refused, and left as it was
    shutil.rmtree(out, ignore_errors=True)
    ok = CliRunner().invoke(main, ["surface", str(run_dir), "--grid", "2", "--samples", "50", "--quiet", "--out",
                                   str(out)])
    assert ok.exit_code == 0, ok.output
    before = (out / "surface.npz").read_bytes()
    line = _one_line_error(CliRunner().invoke(main, ["surface", str(run_dir), "--grid", "3", "--samples", "50",
                                                     "--out", str(out)]))
    assert "--force" in line and (out / "surface.npz").read_bytes() == before
    assert grid_coordinates(3, 1.0).tolist() == [-1.0, 0.0, 1.0]
