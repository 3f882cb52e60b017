"""FedAvg and FedProx against a hand computation (numpy softmax regression), through the real engine."""
import numpy as np
import torch

from fl_harness import Linear, client_arrays, make_dataset, np_ce_grad, run

DIM, C = 3, 3


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def _reference(trainer, theta0, rounds, epochs, lr, local_grad, weights="samples"):
    theta = theta0.copy()
    for _ in range(rounds):
        news, sizes = [], []
        for i in range(trainer.partition.num_clients):
            x, y = client_arrays(trainer, i)
            th = theta.copy()
            for _ in range(epochs):
                th = th - lr * local_grad(th, theta, x, y)
            news.append(th)
            sizes.append(len(y))
        w = np.asarray(sizes, float) / sum(sizes)
        theta = sum(wi * t for wi, t in zip(w, news))
    return theta


def test_fedavg_two_rounds_equals_hand_computation(tmp_path):
    ds = make_dataset(num_samples=25)  # 25 samples over 2 clients: sizes 13 and 12, so weighting matters
    torch.manual_seed(1)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    tr = run(tmp_path, rounds=2, local_epochs=3, lr=0.5, dataset=ds, model=model)
    ref = _reference(tr, theta0, 2, 3, 0.5, lambda th, g, x, y: np_ce_grad(th, x, y, C))
    assert np.abs(tr.theta.double().numpy() - ref).max() < 1e-5
    # and it moved: the check is not vacuous
    assert np.abs(ref - theta0).max() > 1e-2


def test_fedavg_weight_decay_is_in_the_step(tmp_path):
    ds = make_dataset(num_samples=24)
    torch.manual_seed(2)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    wd = 0.05
    tr = run(tmp_path, rounds=1, local_epochs=2, lr=0.3, weight_decay=wd, dataset=ds, model=model)
    ref = _reference(tr, theta0, 1, 2, 0.3, lambda th, g, x, y: np_ce_grad(th, x, y, C) + wd * th)
    assert np.abs(tr.theta.double().numpy() - ref).max() < 1e-5


def test_fedprox_equals_hand_computation(tmp_path):
    ds = make_dataset(num_samples=24)
    torch.manual_seed(3)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    mu = 0.7
    tr = run(tmp_path, rounds=2, local_epochs=4, lr=0.4, algo="fedprox", params={"mu": mu}, dataset=ds, model=model)
    ref = _reference(tr, theta0, 2, 4, 0.4, lambda th, g, x, y: np_ce_grad(th, x, y, C) + mu * (th - g))
    plain = _reference(tr, theta0, 2, 4, 0.4, lambda th, g, x, y: np_ce_grad(th, x, y, C))
    got = tr.theta.double().numpy()
    assert np.abs(got - ref).max() < 1e-5
    assert np.abs(got - plain).max() > 1e-3  # the proximal term changed the result


def test_clipping_bounds_the_step(tmp_path):
    """With clip c, one full-batch step moves theta by at most lr * c (no weight decay)."""
    ds = make_dataset(num_samples=24)
    torch.manual_seed(4)
    model = Linear(DIM, C)
    theta0 = _flat(model)
    tr = run(tmp_path, rounds=1, clients=1, local_epochs=1, lr=1.0, clip=0.01, dataset=ds, model=model)
    x, y = client_arrays(tr, 0)
    g = np_ce_grad(theta0, x, y, C)
    expected = theta0 - 1.0 * g * min(1.0, 0.01 / np.linalg.norm(g))
    assert np.abs(tr.theta.double().numpy() - expected).max() < 1e-6
