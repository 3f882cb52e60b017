"""An algorithm defined outside the package (``tests/external_algorithm.py``) trains through the real engine and
its round equals a hand computation (numpy softmax regression). That clients trained together give its numbers of
one at a time is a case of ``tests/test_every_path.py``."""
import numpy as np
import pytest
import torch

from external_algorithm import ProxServerStep, registered
from fl_harness import Linear, client_arrays, make_dataset, np_ce_grad, run
from flatfl.train.components import ALGORITHMS

DIM, C = 3, 3


@pytest.fixture
def external():
    with registered() as cls:
        yield cls


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def _reference(trainer, theta0, steps, lr, mu, server_lr):
    """One round: each client takes ``steps`` full-batch steps of CE + (mu/2)|theta - theta0|^2 from theta0; the
    server moves theta0 by server_lr times the sample-weighted mean update."""
    news, sizes = [], []
    for i in range(trainer.partition.num_clients):
        x, y = client_arrays(trainer, i)
        th = theta0.copy()
        for _ in range(steps):
            th = th - lr * (np_ce_grad(th, x, y, C) + mu * (th - theta0))
        news.append(th)
        sizes.append(len(y))
    mean = sum(n * t for n, t in zip(np.asarray(sizes, float) / sum(sizes), news))
    return theta0 + server_lr * (mean - theta0)


@pytest.mark.parametrize("parallel", [1, "all"])
def test_the_outside_algorithm_round_equals_hand_computation(tmp_path, external, parallel):
    ds = make_dataset(num_samples=25)  # clients of 13 and 12 samples: the weighting matters
    torch.manual_seed(5)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    lr, mu, server_lr = 0.4, 0.7, 0.6
    tr = run(tmp_path, rounds=1, local_epochs=3, lr=lr, algo=external.name, dataset=ds, model=model,
             params={"server_lr": server_lr, "proxstep_mu": mu}, parallel_clients=parallel)
    assert type(tr.algo) is ProxServerStep
    got = tr.theta.double().numpy()
    assert np.abs(got - _reference(tr, theta0, 3, lr, mu, server_lr)).max() < 1e-5
    # each part counts: without the server step or without the proximal term the result is another
    assert np.abs(got - _reference(tr, theta0, 3, lr, mu, 1.0)).max() > 1e-3
    assert np.abs(got - _reference(tr, theta0, 3, lr, 0.0, server_lr)).max() > 1e-3


def test_registered_only_inside_the_block():
    with registered() as cls:
        assert ALGORITHMS.get_class("proxstep") is cls
    assert "proxstep" not in ALGORITHMS
