"""SAM and ASAM local steps against a numpy computation (docs/update-rules.md section 8), through the real engine."""
import numpy as np
import pytest
import torch

from fl_harness import Linear, client_arrays, make_dataset, np_ce_grad, run, split_theta
from flatfl.train.optimizers import SAM
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import StackedLayout

DIM, C = 3, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def sam_eps(theta, g, rho, eta=None):
    """SAM: rho g / (||g|| + 1e-16); ASAM (eta given): rho T^2 g / (||T g|| + 1e-16), T = |W| + eta on the weight,
    1 on the bias."""
    if eta is None:
        return rho * g / (np.linalg.norm(g) + 1e-16)
    W, _ = split_theta(theta, DIM, C)
    t = np.concatenate([np.abs(W).ravel() + eta, np.ones(C)])
    return rho * t * t * g / (np.linalg.norm(t * g) + 1e-16)


def reference_steps(theta, x, y, steps, lr, rho, eta=None, wd=0.0, clip=0.0, correction=lambda th: 0.0):
    for _ in range(steps):
        g0 = np_ce_grad(theta, x, y, C)
        g1 = np_ce_grad(theta + sam_eps(theta, g0, rho, eta), x, y, C) + correction(theta)
        if clip > 0:
            g1 = g1 * min(1.0, clip / np.linalg.norm(g1))
        theta = theta - lr * (g1 + wd * theta)
    return theta


@pytest.mark.parametrize("opt,params,eta", [("sam", {"rho": 0.3}, None), ("asam", {"rho": 0.8, "eta": 0.1}, 0.1)])
def test_sam_and_asam_steps_equal_numpy(tmp_path, opt, params, eta):
    ds = make_dataset(num_samples=20)
    torch.manual_seed(5)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    tr = run(tmp_path, rounds=1, clients=1, local_epochs=3, lr=0.5, local_opt=opt, params=params, dataset=ds,
             model=model)
    x, y = client_arrays(tr, 0)
    ref = reference_steps(theta0, x, y, 3, 0.5, params["rho"], eta)
    got = tr.theta.double().numpy()
    assert np.abs(got - ref).max() < 1e-5
    plain = reference_steps(theta0, x, y, 3, 0.5, 0.0)  # rho = 0 is SGD: the perturbation must matter
    assert np.abs(got - plain).max() > 1e-3
    if eta is not None:  # and ASAM's scaling must matter
        assert np.abs(got - reference_steps(theta0, x, y, 3, 0.5, params["rho"])).max() > 1e-3


def test_sam_clip_and_weight_decay_follow_the_perturbed_gradient(tmp_path):
    ds = make_dataset(num_samples=20)
    torch.manual_seed(6)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    tr = run(tmp_path, rounds=1, clients=1, local_epochs=2, lr=0.5, clip=0.05, weight_decay=0.1, local_opt="sam",
             params={"rho": 0.5}, dataset=ds, model=model)
    x, y = client_arrays(tr, 0)
    ref = reference_steps(theta0, x, y, 2, 0.5, 0.5, wd=0.1, clip=0.05)
    assert np.abs(tr.theta.double().numpy() - ref).max() < 1e-6


def test_fedprox_with_sam_takes_its_correction_at_the_unperturbed_point(tmp_path):
    ds = make_dataset(num_samples=24)
    torch.manual_seed(7)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    mu = 0.8
    tr = run(tmp_path, rounds=1, clients=1, local_epochs=4, lr=0.4, algo="fedprox", local_opt="sam",
             params={"mu": mu, "rho": 0.4}, dataset=ds, model=model)
    x, y = client_arrays(tr, 0)
    ref = reference_steps(theta0, x, y, 4, 0.4, 0.4, correction=lambda th: mu * (th - theta0))
    assert np.abs(tr.theta.double().numpy() - ref).max() < 1e-5


def test_sam_restores_theta_exactly_before_correct():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    layout = StackedLayout(model, 1, ParamLayout(model))  # one client: the network is the model itself
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    theta = layout.get().clone()
    seen, losses = [], []

    def closure():
        for p in layout.params:
            p.grad = None
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        return loss.reshape(1)  # the per-client losses of the one client

    opt = SAM(layout, lr=0.1, hp={"rho": 0.5})
    returned = opt.step(closure, lambda: seen.append(layout.get().clone()))
    assert len(losses) == 2 and losses[1] > losses[0]  # the second pass ran at the (ascent) perturbed point
    assert returned.shape == (1,) and float(returned[0].detach()) == losses[0]
    assert torch.equal(seen[0], theta)  # correct() saw theta bit for bit
