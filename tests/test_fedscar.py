"""FedScar (docs/update-rules.md §31) against a float64 port of its authors' loop (``clientScar.train``,
``FedScar.send_models`` / ``train``, ``ESAM`` / ``ERM``), with and without MAN, one client at a time and clients
together; its defaults, refusals, the clients-together differential case on the ``tiny`` model and --resume."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from authors_loops import (MAN_ZETA, PORT_RUN, ActivationPenalty, check_refusals, check_together_equals_alone, close,
                           load_vector, resumed_state, run64, run_beside_port, tanh_mlp, vector)
from fl_harness import as_numpy, make_dataset, run
from flatfl.errors import ConfigError
from flatfl.train.catalog import describe, load_all
from flatfl.train.components import ALGORITHMS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

#: the constant of the SAM ascent's denominator: flatfl's SAM step's (§27); the code's ESAM adds 1e-7
ASCENT_CONSTANT = 1e-16


def port_esam_gradient(model, man, x, y, rho):
    """``ESAM.step`` (``ERM.step`` at rho 0): the gradient of the loss at w + rho g / (||g|| + c), then w restored.
    The code restores w by subtracting the perturbation, which leaves w off by rounding; the port restores it
    exactly, as flatfl does (docs/update-rules.md §31 says why it matters here). The loss is the code's
    cross-entropy, plus MAN's penalty."""
    def loss():
        return F.cross_entropy(man.forward(model, x), y) + man.value()

    model.zero_grad()
    loss().backward()
    if rho == 0:
        return
    with torch.no_grad():
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in model.parameters()]), p=2)
        saved = [p.clone() for p in model.parameters()]
        for p in model.parameters():
            p.add_(p.grad * (rho / (norm + ASCENT_CONSTANT)))
    model.zero_grad()
    loss().backward()
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved):
            p.copy_(w)


def port_fedscar(model0, data, rounds, participants, *, lr, lr_decay, local_epochs, momentum, weight_decay, rho,
                 alpha, gamma, beta, zeta):
    """``FedScar.train`` with ``send_models`` and ``clientScar.train``, full batches, no clipping."""
    global_model = copy.deepcopy(model0)
    n, dim = len(data), vector(model0).numel()
    duals, biases = torch.zeros(n, dim, dtype=torch.float64), torch.zeros(n, dim, dtype=torch.float64)
    previous, var = [None] * n, [0.0] * n  # client.model's parameters after its last training; client.var
    for t in range(rounds):
        biases.mul_(gamma)
        theta = vector(global_model).detach()
        starts = {}
        for i in participants[t]:  # send_models
            if previous[i] is not None:
                v = theta - previous[i]
                biases[i].add_(v.mul(var[i] / v.norm(p=2)))
            starts[i] = theta + biases[i]
        bias_mean = torch.mean(biases, dim=0)
        models, sizes = [], []
        for i in participants[t]:  # clientScar.train
            x, y = (torch.from_numpy(a) for a in data[i])
            model = copy.deepcopy(global_model)
            load_vector(model, starts[i])
            base = torch.optim.SGD(model.parameters(), lr=lr * lr_decay ** t, weight_decay=weight_decay,
                                   momentum=momentum)
            man = ActivationPenalty(model, zeta)
            origin = vector(model).detach()
            main, delta = duals[i] + biases[i], bias_mean - biases[i]
            last = origin if previous[i] is None else previous[i]
            for _ in range(local_epochs):
                port_esam_gradient(model, man, x, y, rho)
                w = vector(model)
                loss = beta / 2 * torch.norm(w - last, 2) + beta * torch.dot(w, main)
                loss.backward()
                with torch.no_grad():
                    index = 0
                    for p in model.parameters():  # vec_add_to_grad
                        p.grad += delta[index:index + p.numel()].view(p.shape)
                        index += p.numel()
                base.step()
            man.remove()
            w = vector(model).detach()
            duals[i] += w - origin
            previous[i], var[i] = w, alpha
            models.append(w)
            sizes.append(len(y))
        weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        theta = sum(wt * m for wt, m in zip(weights, models)) + beta * torch.mean(duals - biases, dim=0)
        load_vector(global_model, theta)
    return vector(global_model).detach(), duals, biases


@pytest.mark.parametrize("reg, parallel, rho", [("none", 1, 0.2), ("none", "all", 0.2), ("man", 1, 0.2),
                                                ("man", "all", 0.2), ("none", 1, 0.0)])
def test_fedscar_equals_a_port_of_the_authors_loop(tmp_path, reg, parallel, rho):
    """Four rounds of 3 unequal clients joining with probability 0.5 (clients return, so their biases gain the
    injection; one joins late), two full-batch SAM steps (rho 0: the code's ERM) with momentum and weight decay, a
    decaying rate, no clipping (the code has none); a tanh MLP so that MAN has an activation to penalise."""
    alpha, gamma, beta, rounds = 0.3, 0.8, 0.2, 4
    tr, model0, data, who = run_beside_port(tmp_path, "fedscar", reg, parallel, {"rho": rho, "scar_alpha": alpha,
                                            "scar_gamma": gamma, "scar_beta": beta}, rounds=rounds, seed=61)
    assert tr.opt_cls.name == "sam" and tr.opt_hp == {"rho": rho}
    returning = [i for t in range(1, rounds) for i in who[t] if any(i in who[s] for s in range(t))]
    assert returning
    theta, duals, biases = port_fedscar(model0, data, rounds, who, **PORT_RUN, rho=rho, alpha=alpha, gamma=gamma,
                                        beta=beta, zeta=MAN_ZETA if reg == "man" else None)
    assert close(as_numpy(tr.theta), theta.numpy())
    assert close(as_numpy(tr.algo.clients["dual"]), duals.numpy())
    assert close(as_numpy(tr.algo.clients["bias"]), biases.numpy())
    assert biases.abs().max() > 1e-2 and duals.abs().max() > 1e-2


def test_each_term_moves_the_numbers(tmp_path):
    """The bias injection, its decay and the penalty each change the trained model."""
    ds = make_dataset(num_samples=26)
    kw = dict(rounds=4, clients=3, participation=0.5, local_epochs=2, lr=0.3, algo="fedscar", dataset=ds)
    base = run64(tmp_path / "a", model=tanh_mlp(62), **kw).theta
    for name, value in (("scar_alpha", 0.0), ("scar_gamma", 0.0), ("scar_beta", 0.0)):
        other = run64(tmp_path / name, model=tanh_mlp(62), params={name: value}, **kw).theta
        assert (other - base).abs().max() > 1e-6, name


def test_without_bias_and_penalty_it_is_fedsam(tmp_path):
    """alpha = beta = 0 leaves no bias, no dual and no norm term: FedScar's steps are FedSAM's, and its server's
    sample-weighted mean is FedSAM's (FedAvg's) aggregation."""
    ds = make_dataset(num_samples=26)
    kw = dict(rounds=3, clients=3, participation=0.5, local_epochs=2, lr=0.3, momentum=0.5, weight_decay=0.01,
              dataset=ds)
    scar = run64(tmp_path / "scar", model=tanh_mlp(64), algo="fedscar",
                 params={"rho": 0.2, "scar_alpha": 0.0, "scar_beta": 0.0}, **kw)
    sam = run64(tmp_path / "sam", model=tanh_mlp(64), algo="fedsam", params={"rho": 0.2}, **kw)
    assert torch.equal(scar.theta, sam.theta)


def test_fedscar_is_listed_with_the_codes_defaults_and_refuses_bad_values(tmp_path):
    load_all()
    listing = describe(ALGORITHMS)
    assert "fedscar: FedScar" in listing and ALGORITHMS["fedscar"].label() == "FedScar"
    for flag in ("--scar-alpha", "--scar-gamma", "--scar-beta"):
        assert flag in listing
    ds = make_dataset()
    a = run64(tmp_path / "a", algo="fedscar", dataset=ds, model=tanh_mlp(63))
    assert (a.algo.alpha, a.algo.gamma, a.algo.beta) == (0.1, 0.9, 0.06) and a.opt_hp == {"rho": 0.1}
    with pytest.raises(ConfigError, match="--algo fedscar runs with --local-opt sam, not 'asam'"):
        run(tmp_path / "b", algo="fedscar", local_opt="asam", dataset=ds, model=tanh_mlp(63))
    check_refusals(tmp_path, "fedscar", {"scar_gamma": (1.5, "in \\[0, 1\\]"), "scar_alpha": (-0.1, ">= 0"),
                                         "scar_beta": (-1.0, ">= 0")}, dataset=ds, model=tanh_mlp(63))


@pytest.mark.parametrize("reg", ["none", "man"])
def test_clients_together_equal_one_at_a_time(tmp_path, reg):
    check_together_equals_alone(tmp_path, "fedscar", "sam", reg)


def test_resume_after_crash_equals_uninterrupted(tmp_path, crash_in_round):
    """The duals, biases, last local models and who has trained survive --resume."""
    state = resumed_state(tmp_path, crash_in_round, "fedscar")
    assert {"dual", "bias", "last", "trained"} <= set(state["clients"])
    assert float(state["clients"]["bias"].abs().max()) > 0
