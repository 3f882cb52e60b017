"""Every FL algorithm against a hand computation (numpy, float64, from docs/update-rules.md's formulas) through the real
engine, their losses/weights against independent computations, a short learning run each on digits, and resume."""
import json

import numpy as np
import pytest
import scipy.stats
import torch

import flatfl
from fl_harness import (Linear, as_numpy as _np, check_resume_equals_uninterrupted,
                        client_data as _clients, flat_params as _flat, make_dataset, np_ce_grad, run, split_theta)
from flatfl.train.config import RunConfig
from flatfl.errors import ConfigError
from flatfl.train.algorithms.feddisco import disco_weights
from flatfl.train.algorithms.fedntd import FedNTD
from flatfl.train.algorithms.fedrobust import FedRobust
from flatfl.train.algorithms.moon import Moon, MoonModel
from flatfl.train.context import ClientContext, Cohort, RoundContext, StepContext, frozen_copy
from flatfl.train.engine import Trainer
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import StackedLayout
from flatfl.train.regularizers.regularizer import NoRegularizer

DIM, C = 3, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _setup(seed, num_samples=25):
    """25 samples over 2 clients: sizes 13 and 12, so w_i = n_i / mean(n) differs from 1."""
    ds = make_dataset(num_samples=num_samples)
    torch.manual_seed(seed)
    model = Linear(DIM, C)
    return ds, model, _flat(model)


def g(theta, x, y):
    return np_ce_grad(theta, x, y, C)


def sam_grad(theta, x, y, rho):
    g0 = g(theta, x, y)
    return g(theta + rho * g0 / (np.linalg.norm(g0) + 1e-16), x, y)


def close(a, b, tol=1e-5):
    return np.abs(np.asarray(a) - np.asarray(b)).max() < tol


# ----------------------------------------------------------------------------------------------- SCAFFOLD (section 4)
@pytest.mark.parametrize("cv_lr", ["current", "initial"])
def test_scaffold_three_rounds_equal_hand_computation(tmp_path, cv_lr):
    ds, model, theta = _setup(10)
    lr, decay, K = 0.5, 0.8, 3
    tr = run(tmp_path, rounds=3, local_epochs=K, lr=lr, lr_decay=decay, algo="scaffold", params={"cv_lr": cv_lr},
             dataset=ds, model=model)
    data, n, w = _clients(tr)
    c, ci = np.zeros_like(theta), np.zeros((2, theta.size))
    for t in range(3):  # the third round's start depends on the second round's eta in the c update
        eta = lr * decay ** t
        eta_cv = eta if cv_lr == "current" else lr
        news, dc = [], 0.0
        for i, (x, y) in enumerate(data):
            p = theta.copy()
            for _ in range(K):
                p = p - eta * (g(p, x, y) + c / w[i] - ci[i])
            new_ci = ci[i] - c + (theta - p) / (K * eta_cv)
            dc = dc + w[i] * (new_ci - ci[i])
            ci[i] = new_ci
            news.append(p)
        theta, c = np.mean(news, 0), c + dc / 2
    assert close(_np(tr.theta), theta)
    assert close(_np(tr.algo.server["c"]), c) and close(_np(tr.algo.clients["c"]), ci)
    assert np.abs(c).max() > 1e-3 and np.abs(ci).max() > 1e-2  # the state is not trivially zero


# ------------------------------------------------------------------------------------------------- FedDyn (section 5)
def test_feddyn_two_rounds_equal_hand_computation(tmp_path):
    ds, model, theta = _setup(11)
    lr, K, alpha, wd = 0.3, 3, 0.4, 0.02
    tr = run(tmp_path, rounds=2, local_epochs=K, lr=lr, weight_decay=wd, algo="feddyn",
             params={"feddyn_alpha": alpha}, dataset=ds, model=model)
    data, n, w = _clients(tr)
    h = np.zeros((2, theta.size))
    for _ in range(2):
        news = []
        for i, (x, y) in enumerate(data):
            a, p = alpha / w[i], theta.copy()
            for _ in range(K):
                p = p - lr * (g(p, x, y) + a * (h[i] - theta) + (a + wd) * p)
            h[i] += p - theta
            news.append(p)
        theta = np.mean(news, 0) + h.mean(0)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.clients["h"]), h)
    assert np.abs(h.mean(0)).max() > 1e-2


# -------------------------------------------------------------------------------------------------- FedDC (section 6)
@pytest.mark.parametrize("cv_lr", ["current", "initial"])
def test_feddc_three_states_equal_hand_computation(tmp_path, cv_lr):
    ds, model, theta = _setup(12)
    lr, decay, K, alpha, wd = 0.3, 0.8, 3, 0.4, 0.02
    tr = run(tmp_path, rounds=3, local_epochs=K, lr=lr, lr_decay=decay, weight_decay=wd, algo="feddc",
             params={"feddc_alpha": alpha, "cv_lr": cv_lr}, dataset=ds, model=model)
    data, n, w = _clients(tr)
    h, gi, G = np.zeros((2, theta.size)), np.zeros((2, theta.size)), np.zeros(theta.size)
    for t in range(3):
        eta = lr * decay ** t
        eta_cv = eta if cv_lr == "current" else lr
        news, dG = [], 0.0
        for i, (x, y) in enumerate(data):
            a, p = alpha / w[i], theta.copy()
            for _ in range(K):
                p = p - eta * (g(p, x, y) + a * (p - theta + h[i]) + G / w[i] - gi[i] + wd * p)
            drift = p - theta
            h[i] += drift
            new_g = gi[i] - G / w[i] - drift / (K * eta_cv)
            dG = dG + w[i] * (new_g - gi[i])
            gi[i] = new_g
            news.append(p)
        G = G + dG / 2
        theta = np.mean(news, 0) + h.mean(0)
    assert close(_np(tr.theta), theta)
    assert close(_np(tr.algo.clients["h"]), h) and close(_np(tr.algo.clients["g"]), gi)
    assert close(_np(tr.algo.server["G"]), G) and np.abs(G).max() > 1e-3


# ------------------------------------------------- unequal client sizes: --steps-rule own | mean (issue 17.1)
def _unequal_run(tmp_path, monkeypatch, algo, params):
    """Two clients of 30 and 10 samples, each holding copies of one sample (so every batch's mean gradient is that
    sample's, whatever the batch order); batch 4, 2 epochs: K_0 = 2 * 8 = 16, K_1 = 2 * 3 = 6, the official
    scripts' n_minibatch = 2 * ceil(20 / 4) = 10."""
    from flatfl.data.datasets import ImageDataset
    from flatfl.data.partition import Partition

    x = torch.tensor([[2, 0, 1]] * 30 + [[1, 3, 0]] * 10, dtype=torch.uint8).reshape(40, 1, 1, 3)
    y = torch.tensor([0] * 30 + [2] * 10)
    ds = ImageDataset(name="synthetic", train_x=x, train_y=y, test_x=x.clone(), test_y=y.clone(), num_classes=C,
                      mean=(0.0,), std=(1.0,), max_value=1.0)
    part = Partition("iid", None, 0, [np.arange(30), np.arange(30, 40)])
    monkeypatch.setattr("flatfl.train.engine.make_partition", lambda *a, **k: part)
    torch.manual_seed(13)
    model = Linear(DIM, C)
    theta = _flat(model)
    tr = run(tmp_path, algo=algo, params=params, dataset=ds, model=model, local_epochs=2, batch_size=4, lr=0.2)
    data, n, w = _clients(tr)
    assert list(n) == [30, 10] and list(w) == [1.5, 0.5]
    return tr, data, w, theta


@pytest.mark.parametrize("rule", ["own", "mean"])
def test_scaffold_steps_rule_with_unequal_clients_equals_hand_computation(tmp_path, monkeypatch, rule):
    tr, data, w, theta = _unequal_run(tmp_path, monkeypatch, "scaffold", {"steps_rule": rule})
    lr = 0.2
    ks = [16, 6] if rule == "own" else [10, 10]  # steps taken = the divisor, per client
    news, c, ci = [], np.zeros_like(theta), np.zeros((2, theta.size))
    for i, (x, y) in enumerate(data):
        p = theta.copy()
        for _ in range(ks[i]):  # c = c_i = 0 in round 1
            p = p - lr * g(p, x[:1], y[:1])
        ci[i] = (theta - p) / (ks[i] * lr)
        c = c + w[i] * ci[i] / 2
        news.append(p)
    assert close(_np(tr.theta), np.mean(news, 0))
    assert close(_np(tr.algo.clients["c"]), ci, 1e-6) and close(_np(tr.algo.server["c"]), c, 1e-6)
    other = [10, 10] if rule == "own" else [16, 6]  # the other rule gives another client-1 state
    p = theta.copy()
    for _ in range(other[1]):
        p = p - lr * g(p, data[1][0][:1], data[1][1][:1])
    assert not close(_np(tr.algo.clients["c"][1]), (theta - p) / (other[1] * lr), 1e-3)


@pytest.mark.parametrize("rule", ["own", "mean"])
def test_feddc_steps_rule_with_unequal_clients_equals_hand_computation(tmp_path, monkeypatch, rule):
    alpha, lr = 0.4, 0.2
    tr, data, w, theta = _unequal_run(tmp_path, monkeypatch, "feddc", {"feddc_alpha": alpha, "steps_rule": rule})
    divisor = [16, 6] if rule == "own" else [10, 10]  # both rules train E = 2 full epochs: 16 and 6 steps
    news, h, gi, G = [], np.zeros((2, theta.size)), np.zeros((2, theta.size)), np.zeros(theta.size)
    for i, (x, y) in enumerate(data):
        a, p = alpha / w[i], theta.copy()
        for _ in (16, 6)[i] * [None]:  # h = g_i = G = 0 in round 1
            p = p - lr * (g(p, x[:1], y[:1]) + a * (p - theta))
        h[i] = p - theta
        gi[i] = -h[i] / (divisor[i] * lr)
        G = G + w[i] * gi[i] / 2
        news.append(p)
    assert close(_np(tr.theta), np.mean(news, 0) + h.mean(0))
    assert close(_np(tr.algo.clients["h"]), h)
    assert close(_np(tr.algo.clients["g"]), gi, 1e-6) and close(_np(tr.algo.server["G"]), G, 1e-6)
    other = np.array([[10], [10]] if rule == "own" else [[16], [6]])  # the other rule's divisor: another g_i
    assert not close(_np(tr.algo.clients["g"]), -h / (other * lr), 1e-4)


# ----------------------------------------------------------------------------------------------- FedSpeed (section 7)
def test_fedspeed_perturbed_gradient_and_correction_equal_hand_computation(tmp_path):
    ds, model, theta = _setup(13)
    lr, K, lam, rho, wd = 0.3, 3, 0.4, 0.2, 0.02
    tr = run(tmp_path, rounds=2, local_epochs=K, lr=lr, weight_decay=wd, algo="fedspeed",
             params={"fedspeed_lambda": lam, "rho": rho}, dataset=ds, model=model)
    assert tr.opt_cls.name == "sam"
    data, n, w = _clients(tr)
    h = np.zeros((2, theta.size))
    for _ in range(2):
        news = []
        for i, (x, y) in enumerate(data):
            a, p = lam / w[i], theta.copy()
            for _ in range(K):
                p = p - lr * (sam_grad(p, x, y, rho) + a * (h[i] - theta) + (a + wd) * p)
            h[i] += p - theta
            news.append(p)
        theta = np.mean(news, 0) + h.mean(0)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.clients["h"]), h)


def test_fedspeed_defaults_and_feddyn_with_sam(tmp_path):
    """FedSpeed's own --rho default (0.1) reaches the SAM step; FedDyn + --local-opt sam with the same alpha and rho
    is the same computation (any algorithm takes SAM)."""
    ds, model, _ = _setup(14)
    speed = run(tmp_path / "a", rounds=2, local_epochs=2, algo="fedspeed", dataset=ds, model=model)
    assert speed.opt_hp == {"rho": 0.1} and speed.algo.lam == 0.01
    dyn = run(tmp_path / "b", rounds=2, local_epochs=2, algo="feddyn", local_opt="sam",
              params={"feddyn_alpha": 0.01, "rho": 0.1}, dataset=ds, model=model)
    assert torch.equal(speed.theta, dyn.theta)
    plain = run(tmp_path / "c", rounds=2, local_epochs=2, algo="feddyn", dataset=ds, model=model)
    assert plain.opt_hp == {} and not torch.equal(plain.theta, dyn.theta)
    sam = run(tmp_path / "d", rounds=1, local_epochs=1, local_opt="sam", dataset=ds, model=model)
    assert sam.opt_hp == {"rho": 0.05}


# ------------------------------------------------------------------------------------- FedCM, MoFedSAM (sections 9-10)
@pytest.mark.parametrize("algo", ["fedcm", "mofedsam"])
def test_fedcm_and_mofedsam_momentum_equal_hand_computation(tmp_path, algo):
    ds, model, theta = _setup(15, num_samples=24)  # equal sizes: the simulator's single K is every client's K
    lr, decay, K, alpha, server_lr, wd = 0.4, 0.9, 2, 0.3, 0.8, 0.01
    tr = run(tmp_path, rounds=3, local_epochs=K, lr=lr, lr_decay=decay, weight_decay=wd, algo=algo,
             params={"fedcm_alpha": alpha, "server_lr": server_lr}, dataset=ds, model=model)
    data, n, w = _clients(tr)
    rho = 0.1 if algo == "mofedsam" else None  # MoFedSAM's own default
    assert tr.opt_hp == ({"rho": 0.1} if rho else {})
    delta = np.zeros_like(theta)
    for t in range(3):
        eta = lr * decay ** t
        news, estimates = [], []
        for x, y in data:
            p = theta.copy()
            for _ in range(K):
                grad = sam_grad(p, x, y, rho) if rho else g(p, x, y)
                p = p - eta * (alpha * grad + (1 - alpha) * delta + wd * p)
            news.append(p)
            estimates.append((theta - p) / (K * eta))
        delta = np.mean(estimates, 0)
        theta = theta + server_lr * (np.mean(news, 0) - theta)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["delta"]), delta)
    assert np.abs(delta).max() > 1e-2


# ----------------------------------------------------------------------------------------------- MimeLite (section 11)
@pytest.mark.parametrize("delta_clip", [0.0, 0.05])
def test_mimelite_equals_hand_computation(tmp_path, delta_clip):
    ds, model, theta = _setup(16)
    lr, K, beta, server_lr, wd = 0.5, 3, 0.6, 0.8, 0.01
    tr = run(tmp_path, rounds=2, local_epochs=K, lr=lr, weight_decay=wd, algo="mimelite",
             params={"mime_beta": beta, "server_lr": server_lr, "mime_clip": delta_clip}, dataset=ds, model=model)
    data, n, w = _clients(tr)
    m = np.zeros_like(theta)
    for _ in range(2):
        deltas, grad_sums = [], []
        for x, y in data:
            grad_sums.append(len(y) * g(theta, x, y))  # full-batch gradient sum at the round's start
            p = theta.copy()
            for _ in range(K):
                p = p - lr * ((1 - beta) * g(p, x, y) + beta * m + wd * p)
            d = theta - p
            if delta_clip:
                d = d * min(1.0, delta_clip / np.linalg.norm(d))
            deltas.append(d)
        theta = theta - server_lr * sum(ni * d for ni, d in zip(n, deltas)) / n.sum()
        m = (1 - beta) * sum(grad_sums) / n.sum() + beta * m
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["momentum"]), m)


# ---------------------------------------------------------------------------------------------- FedRobust (section 12)
def _project(v, r, active):
    nv = np.linalg.norm(v)
    active.append(nv > r)
    return v * (r / nv) if nv > r else v


@pytest.mark.parametrize("affine", ["full", "channel"])
def test_fedrobust_descent_ascent_equals_hand_computation(tmp_path, affine):
    ds, model, theta = _setup(17)
    lr, K, ascent, eps_l, eps_d, pen = 0.4, 3, 0.5, 0.02, 10.0, 0.1
    tr = run(tmp_path, rounds=2, local_epochs=K, lr=lr, algo="fedrobust", dataset=ds, model=model,
             params={"robust_lr": ascent, "robust_eps_lambda": eps_l, "robust_eps_delta": eps_d,
                     "robust_penalty": pen, "robust_affine": affine})
    data, n, w = _clients(tr)
    side = DIM if affine == "full" else 1  # the harness images have one channel
    lam = np.stack([np.eye(side)] * 2)
    dl = np.zeros((2, DIM))
    projected = []
    for _ in range(2):
        news = []
        for i, (x, y) in enumerate(data):
            p = theta.copy()
            for _ in range(K):
                shifted = (x @ lam[i].T if affine == "full" else lam[i][0, 0] * x) + dl[i]
                W, b = split_theta(p, DIM, C)
                z = shifted @ W.T + b
                r = np.exp(z - z.max(1, keepdims=True))
                r /= r.sum(1, keepdims=True)
                r[np.arange(len(y)), y] -= 1.0
                r /= len(y)
                gx = r @ W  # dL/dx' per sample
                g_lam = gx.T @ x if affine == "full" else np.array([[np.sum(gx * x)]])
                p = p - lr * g(p, shifted, y)
                eye = np.eye(side)
                lam[i] = eye + _project(lam[i] - eye + ascent * (g_lam - 2 * pen * (lam[i] - eye)), eps_l, projected)
                dl[i] = _project(dl[i] + ascent * (gx.sum(0) - 2 * pen * dl[i]), eps_d, [])
            news.append(p)
        theta = sum(ni * t for ni, t in zip(n, news)) / n.sum()
    assert close(_np(tr.theta), theta)
    assert close(_np(tr.algo.clients["Lambda"]), lam) and close(_np(tr.algo.clients["delta"]), dl)
    assert any(projected)  # the projection was exercised


def test_fedrobust_refuses_a_full_affine_shift_too_large_to_store():
    layout = ParamLayout(Linear(DIM, C))
    big = FedRobust(FedRobust.resolve({}), num_clients=100, client_sizes=np.full(100, 500), layout=layout,
                    device=torch.device("cpu"))
    images = torch.zeros(1, 3, 32, 32)  # a client of 32 x 32 colour images: the state is made when it starts
    start = ClientContext(client_id=0, round=RoundContext(0, 0.1, layout.get()), x=images,
                          y=torch.zeros(1, dtype=torch.long), num_samples=1, weight=1.0,
                          label_counts=torch.ones(C), steps=1, lr=0.1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="--robust-affine channel"):
        big.client_start(start)
    channel = FedRobust(FedRobust.resolve({"robust_affine": "channel"}), num_clients=100,
                        client_sizes=np.full(100, 500), layout=layout, device=torch.device("cpu"))
    channel.client_start(start)
    assert channel.clients["Lambda"].shape == (100, 3, 3) and channel.clients["delta"].shape == (100, 3 * 32 * 32)


# ---------------------------------------------------------------------------------------------------- MOON (section 13)
def _contexts(model, global_params, x, y, client=0):
    """Round and client contexts as the engine builds them, around ``model`` and a server model ``global_params``."""
    layout = ParamLayout(model)

    def build():
        m = frozen_copy(model)
        with torch.no_grad():
            for (name, p), v in zip(m.named_parameters(), layout.views(global_params)):
                p.copy_(v)
        return m

    rctx = RoundContext(0, 0.1, global_params, build_model=build)
    cctx = ClientContext(client_id=client, round=rctx, x=x, y=y, num_samples=len(y), weight=1.0,
                         label_counts=torch.bincount(y, minlength=C), steps=1, lr=0.1,
                         generator=torch.Generator().manual_seed(0),
                         rng_state=torch.Generator().manual_seed(client).get_state())
    return layout, rctx, cctx


def _one_client_step(algo, model, cctx):
    """The engine's one-client cohort around ``model`` (N = 1: the network is the model itself), started by
    ``algo``, and a step on the client's whole data with the leading client dimension: x (1, B, ...), y (1, B)."""
    cohort = Cohort([cctx], cctx.round, model, StackedLayout(model, 1, ParamLayout(model)), cctx.lr)
    algo.start_cohort(cohort)
    return StepContext(cohort, cctx.x.unsqueeze(0), cctx.y.unsqueeze(0))


def _one_loss(losses):
    """The one client's value of a one-client step's per-client values, which must have shape (1,)."""
    assert losses.shape == (1,), losses.shape
    return losses[0]


def _np_projection(theta_named, x):
    """z = W2 relu(W1 x + b1) + b2 of MoonModel around the harness Linear, in float64."""
    t = {k: _np(v) for k, v in theta_named.items()}
    hidden = np.maximum(x @ t["projection.0.weight"].T + t["projection.0.bias"], 0.0)
    return hidden @ t["projection.2.weight"].T + t["projection.2.bias"]


def test_moon_model_keeps_the_flatfl_interface():
    torch.manual_seed(0)
    model = Moon.wrap_model(Linear(DIM, C), {"proj_dim": 7})
    x = torch.randn(5, DIM)
    assert model.feature_dim == 7 and model.classifier.in_features == 7 and model.classifier.out_features == C
    assert torch.allclose(model(x), model.classifier(model.features(x)))
    assert model.activation_modules() == [model.projection[1]]
    assert Moon.wrap_model(model, {"proj_dim": 7}) is model
    # the encoder's own classifier is gone: every parameter is used
    assert len(ParamLayout(model).names) == 6
    with pytest.raises(ConfigError, match="MOON needs"):
        MoonModel(torch.nn.Linear(3, 3))


def test_moon_contrastive_loss_equals_numpy():
    torch.manual_seed(1)
    mu, tau = 0.7, 0.4
    hp = Moon.resolve({"moon_mu": mu, "moon_tau": tau, "moon_proj_dim": 5})
    model = Moon.wrap_model(Linear(DIM, C), hp)
    layout = ParamLayout(model)
    algo = Moon(hp, num_clients=2, client_sizes=np.array([8, 8]), layout=layout, device=torch.device("cpu"))
    theta_prev, theta_glob = torch.randn(layout.dim), torch.randn(layout.dim)
    algo.clients["prev"][0] = theta_prev
    x, y = torch.randn(8, DIM), torch.randint(0, C, (8,))
    _, _, cctx = _contexts(model, theta_glob, x, y)
    model.train()
    algo.client_start(cctx)
    step = _one_client_step(algo, model, cctx)
    NoRegularizer({}, num_classes=C).forward(step)
    loss = _one_loss(algo.loss_terms(step))

    named = lambda th: dict(zip(layout.names, layout.views(th)))  # noqa: E731
    xs = x.double().numpy()
    z, zg, zp = (_np_projection(named(t), xs) for t in (layout.get(), theta_glob, theta_prev))
    cos = lambda a, b: (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))  # noqa: E731
    sg, sp = cos(z, zg) / tau, cos(z, zp) / tau
    ref = mu * np.mean(-sg + np.log(np.exp(sg) + np.exp(sp)))
    assert abs(float(loss.detach()) - ref) < 1e-5 and ref > 0.1
    # its gradient flows into the working model's projection (z is the closure's own, not a detached copy)
    loss.backward()
    assert model.projection[0].weight.grad.abs().sum() > 0


def test_moon_keeps_each_clients_previous_model(tmp_path):
    ds = make_dataset(num_samples=24)
    torch.manual_seed(2)
    tr = run(tmp_path, rounds=2, clients=3, local_epochs=2, algo="moon", params={"moon_mu": 2.0}, dataset=ds,
             model=Linear(DIM, C))
    assert torch.equal(tr.algo.clients["prev"], tr.latest)
    assert isinstance(tr.model, MoonModel)


# -------------------------------------------------------------------------------------------------- FedNTD (section 14)
def test_fedntd_not_true_distillation_equals_numpy():
    torch.manual_seed(3)
    tau, beta = 2.0, 0.7
    hp = FedNTD.resolve({"ntd_tau": tau, "ntd_beta": beta})
    model = Linear(DIM, 4)
    layout = ParamLayout(model)
    algo = FedNTD(hp, num_clients=1, client_sizes=np.array([6]), layout=layout, device=torch.device("cpu"))
    theta_glob = torch.randn(layout.dim)
    x, y = torch.randn(6, DIM), torch.tensor([0, 1, 2, 3, 1, 2])
    _, _, cctx = _contexts(model, theta_glob, x, y)
    step = _one_client_step(algo, model, cctx)
    NoRegularizer({}, num_classes=4).forward(step)
    loss = float(_one_loss(algo.loss_terms(step)).detach())

    def logits(theta):
        W, b = _np(theta[:DIM * 4]).reshape(4, DIM), _np(theta[DIM * 4:])
        return x.double().numpy() @ W.T + b

    ref = 0.0
    for lo, gl, yi in zip(logits(layout.get()), logits(theta_glob), y.numpy()):
        lo, gl = np.delete(lo, yi) / tau, np.delete(gl, yi) / tau
        q, p = np.exp(gl) / np.exp(gl).sum(), np.exp(lo) / np.exp(lo).sum()
        ref += scipy.stats.entropy(q, p)
    ref = beta * tau ** 2 * ref / len(y)
    assert abs(loss - ref) < 1e-5 and ref > 1e-2


# ------------------------------------------------------------------------------------------------ FedDisco (section 15)
def test_feddisco_weights_equal_formula_and_drive_the_aggregation(tmp_path):
    counts = np.array([[5, 5, 5], [9, 1, 0], [0, 0, 4]])
    sizes = counts.sum(1)
    kl = np.array([scipy.stats.entropy(c / c.sum(), np.full(3, 1 / 3)) for c in counts])
    raw = np.maximum(sizes / sizes.sum() - 0.5 * kl / kl.sum() + 0.1, 0)
    assert np.allclose(disco_weights(sizes, counts, 0.5, 0.1), raw / raw.sum())
    assert np.allclose(disco_weights(sizes, np.ones((3, 3)), 0.5, 0.1), (sizes / sizes.sum() + 0.1) / 1.3)

    ds = make_dataset(num_samples=60)
    torch.manual_seed(4)
    tr = run(tmp_path, rounds=1, clients=3, local_epochs=2, partition="fedml-dirichlet", alpha=0.5, algo="feddisco",
             dataset=ds, model=Linear(DIM, C))
    lc = tr.label_counts.numpy()
    p = disco_weights(lc.sum(1), lc, 0.5, 0.1)
    assert not np.allclose(p, lc.sum(1) / lc.sum(), atol=1e-3)  # differs from FedAvg's weights
    assert close(_np(tr.theta), sum(pk * _np(t) for pk, t in zip(p, tr.latest)))


# ------------------------------------------------------------------------------------ FedSAM / FedASAM (section 8)
def test_fedsam_is_fedavg_with_sam(tmp_path):
    ds, model, _ = _setup(18)
    named = run(tmp_path / "a", rounds=2, local_epochs=2, algo="fedsam", params={"rho": 0.2}, dataset=ds, model=model)
    plain = run(tmp_path / "b", rounds=2, local_epochs=2, local_opt="sam", params={"rho": 0.2}, dataset=ds,
                model=model)
    assert named.opt_cls.name == "sam" and torch.equal(named.theta, plain.theta)
    asam = run(tmp_path / "c", rounds=1, local_epochs=1, algo="fedasam", dataset=ds, model=model)
    assert asam.opt_cls.name == "asam" and asam.opt_hp == {"rho": 0.5, "eta": 0.2}
    assert json.loads((tmp_path / "c" / "run" / "config.json").read_text())["resolved"]["local_opt"]["name"] == "asam"
    with pytest.raises(ConfigError, match="--algo fedsam runs with --local-opt sam"):
        run(tmp_path / "d", rounds=1, algo="fedsam", local_opt="asam", dataset=ds, model=model)


# ------------------------------------------------------------------------------------------- learning, end to end
ALGORITHMS = ["scaffold", "feddyn", "feddc", "fedspeed", "fedsam", "fedasam", "mofedsam", "fedcm", "mimelite",
              "fedrobust", "moon", "fedntd", "feddisco"]


def _digits_config(algo, **kw):
    settings = dict(dataset="digits", model="mlp", clients=10, participation=1.0, rounds=8, local_epochs=1,
                    batch_size=32, algo=algo, eval_every=1000, checkpoint_every=1000, seed=0)
    settings.update(kw)
    return RunConfig(**settings).validate()


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_learns_digits(tmp_path, algo):
    tr = Trainer(_digits_config(algo), tmp_path / "run", quiet=True)
    final = tr.run()
    acc = tr.metrics[-1]["test_acc"]
    assert acc > 0.6, f"{algo}: test accuracy {acc:.3f} after 8 rounds (chance 0.1)"
    ck = flatfl.load_checkpoint(final)  # the checkpoint rebuilds the model (MOON's wrapper included)
    xs, ys = zip(*ck.eval_batches("test", batch_size=500))
    got = float(torch.cat([ck.model(x).argmax(1) for x in xs]).eq(torch.cat(ys)).float().mean())
    assert abs(got - acc) < 1e-6


# -------------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("algo", ["feddyn", "scaffold", "fedrobust", "moon"])
def test_resume_after_crash_equals_uninterrupted(tmp_path, crash_in_round, algo):
    cfg = _digits_config(algo, clients=6, participation=0.5, rounds=5, checkpoint_every=2)
    state = check_resume_equals_uninterrupted(cfg, tmp_path, crash_in_round)
    assert state["server"] or state["clients"]

