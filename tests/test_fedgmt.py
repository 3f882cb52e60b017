"""FedGMT (docs/update-rules.md §30) against a float64 port of its authors' loop (FL-SAM ``clientGMT.train`` and
``FedGMT.train``), with and without MAN, one client at a time and clients together; its defaults, refusals, the
clients-together differential case on the ``tiny`` model and --resume."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from authors_loops import (MAN_ZETA, PORT_RUN, ActivationPenalty, check_refusals, check_together_equals_alone, close,
                           load_vector, resumed_state, run64, run_beside_port, tanh_mlp as mlp, vector)
from fl_harness import as_numpy, make_dataset
from flatfl.train.catalog import describe, load_all
from flatfl.train.components import ALGORITHMS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def port_client(model, ema, x, y, dual, *, lr, epochs, momentum, wd, gamma, tau, beta, zeta):
    """``clientGMT.train`` on one full batch per epoch: SGD (momentum, weight decay), loss = CE [+ MAN's penalty]
    + gamma tau^2 KLDiv(batchmean) of the EMA's tempered prediction + (1 / beta) <w, dual>; no clipping. Returns
    the update theta_i - theta^t."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd, momentum=momentum)
    man = ActivationPenalty(model, zeta)
    start = vector(model).detach().clone()
    for _ in range(epochs):
        with torch.no_grad():
            out_t = ema(x)
        out = man.forward(model, x)
        loss = F.cross_entropy(out, y) + man.value()
        loss = loss + gamma * tau ** 2 * nn.KLDivLoss(reduction="batchmean")(F.log_softmax(out / tau, dim=1),
                                                                            F.softmax(out_t / tau, dim=1))
        loss = loss - torch.dot(vector(model), -(1 / beta) * dual)
        opt.zero_grad()
        loss.backward()
        opt.step()
    man.remove()
    return vector(model).detach() - start


def port_fedgmt(model0, data, rounds, participants, *, lr, lr_decay, local_epochs, momentum, weight_decay, **hp):
    """``FedGMT.train``: the participants train from the global model with the EMA as teacher; the dual of each
    gains its update; the server takes the sample-weighted mean of the participants' models plus the mean dual over
    all clients, and moves the EMA towards it."""
    alpha = hp.pop("alpha")
    global_model, ema = copy.deepcopy(model0), copy.deepcopy(model0)
    duals = torch.zeros(len(data), vector(model0).numel(), dtype=torch.float64)
    for t in range(rounds):
        models, sizes = [], []
        for i in participants[t]:
            x, y = (torch.from_numpy(a) for a in data[i])
            model = copy.deepcopy(global_model)
            duals[i] += port_client(model, copy.deepcopy(ema), x, y, duals[i].clone(), lr=lr * lr_decay ** t,
                                    epochs=local_epochs, momentum=momentum, wd=weight_decay, **hp)
            models.append(vector(model).detach())
            sizes.append(len(y))
        weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        theta = sum(w * m for w, m in zip(weights, models)) + duals.mean(0)
        load_vector(global_model, theta)
        load_vector(ema, vector(ema).detach() * alpha + theta * (1 - alpha))
    return vector(global_model).detach(), vector(ema).detach(), duals


@pytest.mark.parametrize("parallel", [1, "all"])
@pytest.mark.parametrize("reg", ["none", "man"])
def test_fedgmt_equals_a_port_of_the_authors_loop(tmp_path, reg, parallel):
    """Three rounds of 3 unequal clients joining with probability 0.5 (the dual's mean over all clients differs
    from the participants'), two full-batch steps with momentum and weight decay, a decaying rate, no clipping (the
    code has none); a tanh MLP so that MAN has an activation to penalise."""
    gamma, alpha, tau, beta, rounds = 0.7, 0.6, 2.0, 4.0, 3
    tr, model0, data, who = run_beside_port(tmp_path, "fedgmt", reg, parallel, {"gmt_gamma": gamma, "gmt_alpha": alpha,
                                            "gmt_tau": tau, "gmt_beta": beta}, rounds=rounds, seed=51)
    assert tr.opt_cls.name == "sgd" and tr.cfg.reg == reg
    theta, ema, duals = port_fedgmt(model0, data, rounds, who, **PORT_RUN, gamma=gamma, alpha=alpha, tau=tau,
                                    beta=beta, zeta=MAN_ZETA if reg == "man" else None)
    assert close(as_numpy(tr.theta), theta.numpy()), np.abs(as_numpy(tr.theta) - theta.numpy()).max()
    assert close(as_numpy(tr.algo.server["trajectory"]), ema.numpy())
    assert close(as_numpy(tr.algo.clients["dual"]), duals.numpy())
    assert duals.abs().max() > 1e-2 and (ema - theta).abs().max() > 1e-3


def test_each_term_moves_the_numbers(tmp_path):
    """The trajectory's KL, its temperature and the dual each change the trained model (a term that does nothing
    would pass the port's check only if the port dropped it too)."""
    ds = make_dataset(num_samples=26)
    kw = dict(rounds=3, clients=3, local_epochs=2, lr=0.3, algo="fedgmt", dataset=ds)
    base = run64(tmp_path / "a", model=mlp(52), params={"gmt_alpha": 0.5}, **kw).theta
    for name, value in (("gmt_gamma", 0.0), ("gmt_tau", 1.0), ("gmt_beta", 1e9)):
        other = run64(tmp_path / name, model=mlp(52), params={"gmt_alpha": 0.5, name: value}, **kw).theta
        assert (other - base).abs().max() > 1e-6, name


def test_fedgmt_is_listed_with_the_codes_defaults_and_refuses_bad_values(tmp_path):
    load_all()
    listing = describe(ALGORITHMS)
    assert "fedgmt: FedGMT" in listing and ALGORITHMS["fedgmt"].label() == "FedGMT"
    for flag in ("--gmt-gamma", "--gmt-alpha", "--gmt-tau", "--gmt-beta"):
        assert flag in listing
    ds = make_dataset()
    a = run64(tmp_path / "a", algo="fedgmt", dataset=ds, model=mlp(53))
    assert (a.algo.gamma, a.algo.alpha, a.algo.tau, a.algo.beta) == (1.0, 0.95, 3.0, 10.0)
    assert type(a.algo).all_model_weighting == "samples"
    check_refusals(tmp_path, "fedgmt", {"gmt_alpha": (1.5, "in \\[0, 1\\]"), "gmt_tau": (0.0, "> 0"),
                                        "gmt_beta": (-1.0, "> 0"), "gmt_gamma": (-0.5, ">= 0")},
                   dataset=ds, model=mlp(53))


@pytest.mark.parametrize("reg", ["none", "man"])
def test_clients_together_equal_one_at_a_time(tmp_path, reg):
    check_together_equals_alone(tmp_path, "fedgmt", "sgd", reg)


def test_resume_after_crash_equals_uninterrupted(tmp_path, crash_in_round):
    """The trajectory and the duals survive --resume."""
    state = resumed_state(tmp_path, crash_in_round, "fedgmt")
    assert {"trajectory"} <= set(state["server"]) and {"dual"} <= set(state["clients"])
