"""FedSMOO, FedGAMMA, FedLESAM (and its -S / -D variants), FedGloSS, FedNSAM, FedWMSAM (docs/update-rules.md §23-26,
§28-29) against hand
computations of their equations in float64 numpy through the real engine; each with and without MAN on the
``tiny`` model; clients trained together against one at a time (float64, the differential case of
``tests/combinations.py``); and the one-line refusals of the optimizers they replace."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_harness import (Linear, as_numpy as _np, check_resume_equals_uninterrupted,
                        client_data as _clients, flat_params as _flat, make_dataset, np_ce_grad, run)
from combinations import Combination, case_settings, differences, train_case
from authors_loops import run64
from flatfl.errors import ConfigError
from flatfl.train.catalog import describe, load_all
from flatfl.train.components import ALGORITHMS

DIM, C = 3, 3
RTOL = 1e-9

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _setup(seed, num_samples=25):
    """25 samples over 2 clients: sizes 13 and 12, so w_i = n_i / mean(n) differs from 1; a float64 model."""
    ds = make_dataset(num_samples=num_samples)
    torch.manual_seed(seed)
    model = Linear(DIM, C).double()
    return ds, model, _flat(model)


def g(theta, x, y):
    return np_ce_grad(theta, x, y, C)


def sam_eps(d, rho):
    """flatfl's SAM ascent: rho d / (||d|| + 1e-16)."""
    return rho * d / (np.linalg.norm(d) + 1e-16)


def close(a, b, tol=1e-9):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


def test_the_family_is_registered_and_listed():
    load_all()
    listed = [line.split(":")[0] for line in describe(ALGORITHMS).splitlines() if not line.startswith(" ")]
    for name, label in (("fedsmoo", "FedSMOO"), ("fedgamma", "FedGAMMA"), ("fedlesam", "FedLESAM"),
                        ("fedgloss", "FedGloSS"), ("fednsam", "FedNSAM"), ("fedwmsam", "FedWMSAM")):
        assert name in listed and ALGORITHMS[name].label() == label


# ------------------------------------------------------------------------------------------------ FedSMOO (section 23)
def test_fedsmoo_equals_hand_computation(tmp_path):
    """Two rounds (the second uses the server's s), three full-batch steps, unequal clients (lambda_i = lambda/w_i),
    weight decay on."""
    ds, model, theta = _setup(31)
    lr, K, lam, rho, wd = 0.3, 3, 0.2, 0.15, 0.02
    tr = run64(tmp_path, rounds=2, local_epochs=K, lr=lr, weight_decay=wd, algo="fedsmoo",
             params={"fedsmoo_lambda": lam, "rho": rho}, dataset=ds, model=model)
    assert tr.opt_cls.name == "sam"
    data, n, w = _clients(tr)
    h = np.zeros((2, theta.size))
    mu = np.zeros((2, theta.size))
    s = np.zeros_like(theta)
    for _ in range(2):
        news = []
        for i, (x, y) in enumerate(data):
            a, p = lam / w[i], theta.copy()
            for _ in range(K):
                eps = sam_eps(g(p, x, y) - mu[i] - s, rho)
                mu[i] += eps - s
                p = p - lr * (g(p + eps, x, y) + a * (h[i] - theta) + (a + wd) * p)
            h[i] += p - theta
            news.append(p)
        m = mu.mean(0)
        s = rho * m / (np.linalg.norm(m) + 1e-7)
        theta = np.mean(news, 0) + h.mean(0)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.clients["h"]), h)
    assert close(_np(tr.algo.clients["mu"]), mu) and close(_np(tr.algo.server["s"]), s)
    assert np.abs(s).max() > 1e-3 and abs(np.linalg.norm(s) - rho) < 1e-6


def test_fedsmoo_refuses_another_sam_type_optimizer(tmp_path):
    ds, model, _ = _setup(32)
    with pytest.raises(ConfigError, match="--algo fedsmoo runs with --local-opt sam, not 'asam'"):
        run(tmp_path, algo="fedsmoo", local_opt="asam", dataset=ds, model=model)


# ----------------------------------------------------------------------------------------------- FedGAMMA (section 24)
@pytest.mark.parametrize("ascent", ["plain", "corrected"])
def test_fedgamma_equals_hand_computation(tmp_path, ascent):
    """Three rounds (c and c_i non-zero from round 2), two full-batch steps, unequal clients (v_i = c/w_i - c_i),
    decaying rate, server rate 0.8."""
    ds, model, theta = _setup(33)
    lr, decay, K, rho, wd, server_lr = 0.4, 0.9, 2, 0.12, 0.01, 0.8
    tr = run64(tmp_path, rounds=3, local_epochs=K, lr=lr, lr_decay=decay, weight_decay=wd, algo="fedgamma",
               params={"rho": rho, "server_lr": server_lr, "gamma_ascent": ascent}, dataset=ds, model=model)
    assert tr.opt_cls.name == "sam" and tr.opt_hp == {"rho": rho}
    data, n, w = _clients(tr)
    c, ci = np.zeros_like(theta), np.zeros((2, theta.size))
    for t in range(3):
        eta = lr * decay ** t
        news, dc = [], 0.0
        for i, (x, y) in enumerate(data):
            v, p = c / w[i] - ci[i], theta.copy()
            for _ in range(K):
                d = g(p, x, y) + (v if ascent == "corrected" else 0.0)
                p = p - eta * (g(p + sam_eps(d, rho), x, y) + v + wd * p)
            new_ci = ci[i] - c + (theta - p) / (K * eta)
            dc = dc + w[i] * (new_ci - ci[i])
            ci[i] = new_ci
            news.append(p)
        c = c + dc / 2
        theta = theta + server_lr * (np.mean(news, 0) - theta)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["c"]), c)
    assert close(_np(tr.algo.clients["c"]), ci) and np.abs(c).max() > 1e-2


def test_fedgamma_ascent_choice_changes_the_numbers_and_asam_is_refused(tmp_path):
    ds, model, _ = _setup(34)
    a = run64(tmp_path / "a", rounds=2, local_epochs=2, algo="fedgamma", dataset=ds, model=model)
    b = run64(tmp_path / "b", rounds=2, local_epochs=2, algo="fedgamma", params={"gamma_ascent": "corrected"},
              dataset=ds, model=model)
    assert a.algo.ascent == "plain" and a.opt_hp == {"rho": 0.1} and a.algo.server_lr == 1.0
    assert not torch.equal(a.theta, b.theta)
    with pytest.raises(ConfigError, match="--algo fedgamma runs with --local-opt sam, not 'asam'"):
        run(tmp_path / "c", algo="fedgamma", local_opt="asam", dataset=ds, model=model)


# ----------------------------------------------------------------------------------------------- FedLESAM (section 25)
def _direction_norm(d, norm):
    if norm == "global":
        return np.linalg.norm(d)
    return np.linalg.norm(d[: DIM * C]) + np.linalg.norm(d[DIM * C:])  # Linear's two tensors, W and b


@pytest.mark.parametrize("variant, estimate, norm", [
    ("fedlesam", "round", "tensors"), ("fedlesam", "client", "global"), ("s", "round", "tensors"),
    ("s", "client", "tensors"), ("d", "round", "global"), ("d", "client", "tensors")])
def test_fedlesam_equals_hand_computation(tmp_path, variant, estimate, norm):
    """Four rounds of 3 unequal clients joining with probability 0.5 (so a client's last global model differs from
    the last round's), two full-batch steps each."""
    from flatfl.train.rounds import sample_clients

    ds, model, theta = _setup(35, num_samples=26)
    lr, decay, K, rho, lam, wd, server_lr, rounds = 0.4, 0.9, 2, 0.2, 0.3, 0.01, 0.9, 4
    tr = run64(tmp_path, rounds=rounds, clients=3, participation=0.5, local_epochs=K, lr=lr, lr_decay=decay,
               weight_decay=wd, algo="fedlesam", dataset=ds, model=model,
               params={"rho": rho, "lesam_variant": variant, "lesam_estimate": estimate, "lesam_norm": norm,
                       "fedlesam_lambda": lam, "server_lr": server_lr})
    assert tr.opt_cls.name == "sgd"
    data, n, w = _clients(tr)
    N = len(data)
    update, c, ci, h = np.zeros_like(theta), np.zeros_like(theta), np.zeros((N, theta.size)), np.zeros((N, theta.size))
    old, seen = np.zeros((N, theta.size)), np.zeros(N, bool)
    joined = []
    for t in range(rounds):
        eta = lr * decay ** t
        who = sample_clients(0, t, N, 0.5, "bernoulli")
        joined.append(len(who))
        news, dc = [], 0.0
        for i in who:
            x, y = data[i]
            d = -update if estimate == "round" else ((old[i] - theta) if seen[i] else np.zeros_like(theta))
            eps = rho * d / (_direction_norm(d, norm) + 1e-7)
            a = lam / w[i] if variant == "d" else 0.0
            corr = {"fedlesam": 0.0, "s": lam * (c / w[i] - ci[i]), "d": a * (h[i] - theta)}[variant]
            p = theta.copy()
            for _ in range(K):
                p = p - eta * (g(p + eps, x, y) + corr + (wd + a) * p)
            if variant == "s":
                new_ci = ci[i] - c + (theta - p) / (K * eta)
                dc = dc + w[i] * (new_ci - ci[i])
                ci[i] = new_ci
            if variant == "d":
                h[i] += p - theta
            old[i], seen[i] = theta, True
            news.append(p)
        if variant == "d":
            new = np.mean(news, 0) + h.mean(0)
        else:
            c = c + dc / N
            new = theta + server_lr * (np.mean(news, 0) - theta)
        update, theta = new - theta, new
    assert sorted(set(joined)) != [N]  # some round leaves a client out
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["update"]), update)
    if variant == "s":
        assert close(_np(tr.algo.server["c"]), c) and close(_np(tr.algo.clients["c"]), ci)
    if variant == "d":
        assert close(_np(tr.algo.clients["h"]), h)
    if estimate == "client":
        assert close(_np(tr.algo.clients["old"]), old) and np.array_equal(_np(tr.algo.clients["seen"]) > 0, seen)


def test_fedlesam_estimates_differ_and_sam_is_refused(tmp_path):
    """The paper's per-client estimate and the code's last-round change give other numbers under partial
    participation; --local-opt sam is refused in one line."""
    ds, model, _ = _setup(36, num_samples=26)
    kw = dict(rounds=4, clients=3, participation=0.5, local_epochs=2, algo="fedlesam", dataset=ds, model=model)
    a = run64(tmp_path / "a", **kw)
    b = run64(tmp_path / "b", params={"lesam_estimate": "client"}, **kw)
    assert (a.algo.rho, a.algo.variant, a.algo.estimate, a.algo.norm, a.algo.lam) == (0.1, "fedlesam", "round",
                                                                                      "tensors", 0.1)
    assert not torch.equal(a.theta, b.theta)
    with pytest.raises(ConfigError, match="--algo fedlesam runs with --local-opt sgd, not 'sam'"):
        run(tmp_path / "c", algo="fedlesam", local_opt="sam", dataset=ds, model=model)


# ----------------------------------------------------------------------------------------------- FedGloSS (section 26)
def test_fedgloss_equals_hand_computation(tmp_path):
    """Three rounds (the server perturbs from round 2), two full-batch local SAM steps, unequal clients (the
    pseudo-gradient weighted by n_i), decaying rate, server rate 0.7."""
    ds, model, theta = _setup(37)
    lr, decay, K, rho, rho_s, beta, wd, server_lr = 0.4, 0.9, 2, 0.1, 0.3, 2.0, 0.01, 0.7
    tr = run64(tmp_path, rounds=3, local_epochs=K, lr=lr, lr_decay=decay, weight_decay=wd, algo="fedgloss",
               params={"rho": rho, "gloss_rho": rho_s, "gloss_beta": beta, "server_lr": server_lr},
               dataset=ds, model=model)
    assert tr.opt_cls.name == "sam" and tr.opt_hp == {"rho": rho}
    data, n, w = _clients(tr)
    N = len(data)
    G, sigma, sig_i = np.zeros_like(theta), np.zeros_like(theta), np.zeros((N, theta.size))
    for t in range(3):
        eta = lr * decay ** t
        start = theta + (rho_s * G / np.linalg.norm(G) if np.linalg.norm(G) > 0 else 0.0)
        deltas = []
        for i, (x, y) in enumerate(data):
            p = start.copy()
            for _ in range(K):
                g0 = g(p, x, y)
                p = p - eta * (g(p + sam_eps(g0, rho), x, y) - sig_i[i] + (p - start) / beta + wd * p)
            sig_i[i] -= (p - start) / beta
            deltas.append(p - start)
        sigma = sigma - np.sum(deltas, 0) / (beta * N * N)
        mean = np.sum([ni * d for ni, d in zip(n, deltas)], 0) / n.sum()
        G = -mean
        theta = theta + server_lr * mean - beta * sigma
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["pseudo_grad"]), G)
    assert close(_np(tr.algo.server["sigma"]), sigma) and close(_np(tr.algo.clients["sigma"]), sig_i)
    assert np.abs(sigma).max() > 1e-3


def test_fedgloss_defaults_and_asam_is_refused(tmp_path):
    ds, model, _ = _setup(38)
    a = run64(tmp_path / "a", rounds=2, local_epochs=1, algo="fedgloss", dataset=ds, model=model)
    assert a.opt_hp == {"rho": 0.15} and (a.algo.server_rho, a.algo.beta, a.algo.server_lr) == (0.15, 10.0, 1.0)
    with pytest.raises(ConfigError, match="--algo fedgloss runs with --local-opt sam, not 'asam'"):
        run(tmp_path / "b", algo="fedgloss", local_opt="asam", dataset=ds, model=model)


# ------------------------------------------------------------------------------------------------ FedNSAM (section 28)
@pytest.mark.parametrize("rule", ["released", "accumulated"])
def test_fednsam_equals_hand_computation(tmp_path, rule):
    """Four rounds of 3 unequal clients joining with probability 0.5 (the mean over the round's participants), two
    full-batch local SAM steps from theta + gamma m, decaying rate, weight decay on; the server momentum as the
    authors' loop runs it (apply_weights_avgACG: the mean, then gamma mean + mean) or as apply_weights_avgACG2
    (gamma m + mean)."""
    from flatfl.train.rounds import sample_clients

    ds, model, theta = _setup(39, num_samples=26)
    lr, decay, K, rho, gamma, wd, rounds = 0.4, 0.9, 2, 0.15, 0.7, 0.01, 4
    tr = run64(tmp_path, rounds=rounds, clients=3, participation=0.5, local_epochs=K, lr=lr, lr_decay=decay,
               weight_decay=wd, algo="fednsam", params={"rho": rho, "nsam_gamma": gamma, "nsam_momentum": rule},
               dataset=ds, model=model)
    assert tr.opt_cls.name == "sam" and tr.opt_hp == {"rho": rho}
    data, n, w = _clients(tr)
    m, joined = np.zeros_like(theta), []
    for t in range(rounds):
        eta = lr * decay ** t
        who = sample_clients(0, t, len(data), 0.5, "bernoulli")
        joined.append(len(who))
        start = theta + gamma * m
        deltas = []
        for i in who:
            x, y = data[i]
            p = start.copy()
            for _ in range(K):
                p = p - eta * (g(p + sam_eps(g(p, x, y), rho), x, y) + wd * p)
            deltas.append(p - start)
        mean = np.mean(deltas, 0)
        m = gamma * m + mean if rule == "accumulated" else (mean if t == 0 else gamma * mean + mean)
        theta = theta + m
    assert sorted(set(joined)) != [len(data)]  # some round leaves a client out
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["momentum"]), m)
    assert np.abs(m).max() > 1e-2


def test_fednsam_defaults_and_asam_is_refused(tmp_path):
    ds, model, _ = _setup(40)
    a = run64(tmp_path / "a", rounds=2, local_epochs=1, algo="fednsam", dataset=ds, model=model)
    assert a.opt_hp == {"rho": 0.05} and a.algo.gamma == 0.85 and a.algo.momentum_rule == "released"
    with pytest.raises(ConfigError, match="--algo fednsam runs with --local-opt sam, not 'asam'"):
        run(tmp_path / "b", algo="fednsam", local_opt="asam", dataset=ds, model=model)
    with pytest.raises(ConfigError, match="unknown --nsam-momentum value for fednsam 'acg2'"):
        run(tmp_path / "c", algo="fednsam", params={"nsam_momentum": "acg2"}, dataset=ds, model=model)


# ----------------------------------------------------------------------------------------------- FedWMSAM (section 29)
@pytest.mark.parametrize("direction, norm", [("code", "tensors"), ("paper", "global")])
def test_fedwmsam_equals_hand_computation(tmp_path, direction, norm):
    """Four rounds of 3 unequal clients joining with probability 0.5 (c over N, v_i = c/w_i - c_i), three
    full-batch steps each (the target moves by m_i a step), alpha adapted every round, decaying rate, server rate
    0.8, weight decay on."""
    from flatfl.train.rounds import sample_clients

    ds, model, theta = _setup(41, num_samples=26)
    lr, decay, K, rho, alpha, wd, server_lr, rounds = 0.4, 0.9, 3, 0.2, 0.4, 0.01, 0.8, 4
    tr = run64(tmp_path, rounds=rounds, clients=3, participation=0.5, local_epochs=K, lr=lr, lr_decay=decay,
               weight_decay=wd, algo="fedwmsam", dataset=ds, model=model,
               params={"rho": rho, "wmsam_alpha": alpha, "wmsam_direction": direction, "wmsam_norm": norm,
                       "server_lr": server_lr})
    assert tr.opt_cls.name == "sgd"
    data, n, w = _clients(tr)
    N = len(data)
    m, c, ci, alphas = np.zeros_like(theta), np.zeros_like(theta), np.zeros((N, theta.size)), [alpha]
    for t in range(rounds):
        eta = lr * decay ** t
        who = sample_clients(0, t, N, 0.5, "bernoulli")
        news, dc, estimates, agree = [], 0.0, [], []
        for i in who:
            x, y = data[i]
            mi = m + (c / w[i] - ci[i]) * alpha / (1 - alpha)
            p = theta.copy()
            for b in range(K):
                d = p - (theta + b * mi)
                d = d if direction == "code" else -d
                eps = rho * d / (_direction_norm(d, norm) + 1e-7)
                p = p - eta * (alpha * g(p + eps, x, y) + (1 - alpha) * mi + wd * p)
            new_ci = ci[i] - c + (theta - p) / (K * eta)
            dc = dc + w[i] * (new_ci - ci[i])
            ci[i] = new_ci
            u = p - theta
            size = np.linalg.norm(u) * np.linalg.norm(m)
            agree.append(0.0 if size == 0 else u @ m / size + 1.0)
            estimates.append(-u / (K * eta))
            news.append(p)
        c = c + dc / N
        alpha = 0.99 * alpha + 0.01 * min(max(np.mean(agree), 0.1), 0.9)
        alphas.append(alpha)
        m = np.mean(estimates, 0)
        theta = theta + server_lr * (np.mean(news, 0) - theta)
    assert close(_np(tr.theta), theta) and close(_np(tr.algo.server["momentum"]), m)
    assert close(_np(tr.algo.server["c"]), c) and close(_np(tr.algo.clients["c"]), ci)
    assert abs(float(tr.algo.server["alpha"]) - alpha) <= 1e-12 and len(set(np.round(alphas, 12))) > 2
    assert np.abs(c).max() > 1e-2 and np.abs(m).max() > 1e-2


def test_fedwmsam_choices_change_the_numbers_and_bad_settings_are_refused(tmp_path):
    ds, model, _ = _setup(42)
    kw = dict(rounds=3, local_epochs=2, algo="fedwmsam", dataset=ds, model=model)
    a = run64(tmp_path / "a", **kw)
    b = run64(tmp_path / "b", params={"wmsam_direction": "paper"}, **kw)
    assert (a.algo.rho, a.algo.alpha, a.algo.direction, a.algo.norm, a.algo.server_lr) == (0.1, 0.1, "code",
                                                                                          "tensors", 1.0)
    assert not torch.equal(a.theta, b.theta)
    with pytest.raises(ConfigError, match="--algo fedwmsam runs with --local-opt sgd, not 'sam'"):
        run(tmp_path / "c", algo="fedwmsam", local_opt="sam", dataset=ds, model=model)
    with pytest.raises(ConfigError, match="--wmsam-alpha for fedwmsam must be below 1"):
        run(tmp_path / "d", algo="fedwmsam", params={"wmsam_alpha": 1.0}, dataset=ds, model=model)


# ------------------------------------------------------------------------------- every one: MAN, clients together
FAMILY = [("fedsmoo", {}), ("fedgamma", {}), ("fedgamma", {"gamma_ascent": "corrected"}), ("fedlesam", {}),
          ("fedlesam", {"lesam_variant": "s", "lesam_estimate": "client"}),
          ("fedlesam", {"lesam_variant": "d", "lesam_norm": "global"}), ("fedgloss", {}), ("fednsam", {}),
          ("fedwmsam", {}), ("fedwmsam", {"wmsam_direction": "paper", "wmsam_norm": "global"})]


@pytest.mark.parametrize("reg", ["none", "man"])
@pytest.mark.parametrize("algo, params", FAMILY, ids=lambda v: v if isinstance(v, str) else "-".join(v.values()))
def test_trains_with_and_without_man_and_together_equals_one_at_a_time(tmp_path, algo, params, reg):
    """The differential case of tests/combinations.py on the ``tiny`` model (5 unequal clients, Bernoulli 0.5, 2
    rounds, batches of 4 with steps only some clients take, momentum): N = 1, all and 2 give the same server
    weights, client models and algorithm state in float64."""
    case = Combination("tiny", reg, algo, "sgd")

    def settings(c):
        return {**case_settings(c), "params": dict(params)}

    one = train_case(case, tmp_path / "one", 1, settings=settings)
    assert one.theta.dtype == torch.float64 and torch.isfinite(one.theta).all()
    assert one.cfg.reg == reg and one.algo.hp == type(one.algo).resolve(params)
    for parallel in ("all", 2):
        other = train_case(case, tmp_path / str(parallel), parallel, settings=settings)
        assert other.parallel != 1
        off = {k: v for k, v in differences(one, other).items() if not v <= RTOL}
        assert not off, f"N={parallel} vs N=1: {off}"


# -------------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("algo, params", [("fedsmoo", {}), ("fedlesam", {"lesam_estimate": "client"}),
                                          ("fedgloss", {}), ("fednsam", {}), ("fedwmsam", {})],
                         ids=["fedsmoo", "fedlesam-client", "fedgloss", "fednsam", "fedwmsam"])
def test_resume_after_crash_equals_uninterrupted(tmp_path, crash_in_round, algo, params):
    """The server and client state (s and mu_i; the last global models; G and the duals; FedNSAM's momentum;
    FedWMSAM's momentum, c, c_i and alpha) survive --resume."""
    from flatfl.train.config import RunConfig

    cfg = RunConfig(dataset="digits", model="tiny", clients=6, participation=0.5, rounds=5, local_epochs=1,
                    batch_size=64, algo=algo, params=params, eval_every=1000, checkpoint_every=2, seed=0).validate()
    check_resume_equals_uninterrupted(cfg, tmp_path, crash_in_round)
