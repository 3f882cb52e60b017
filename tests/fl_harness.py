"""Small exact FL problems for hand-checking algorithm updates through the real engine.

A softmax-regression model (one nn.Linear) on a few synthetic samples; full-batch local steps (batch size larger
than any client) so the batch order cannot matter, clipping and weight decay off unless a test turns them on.
``np_ce_grad`` is the independent reference: the closed-form gradient of the mean cross-entropy.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flatfl.train.config import RunConfig
from flatfl.data.datasets import ImageDataset
from flatfl.train.engine import Trainer


def make_dataset(num_samples: int = 24, dim: int = 3, classes: int = 3, seed: int = 0) -> ImageDataset:
    """Integer features 0..3 as uint8 images of shape (1, 1, dim); normalisation is the identity."""
    g = np.random.default_rng(seed)
    x = torch.from_numpy(g.integers(0, 4, size=(num_samples, 1, 1, dim)).astype(np.uint8))
    y = torch.from_numpy(np.arange(num_samples) % classes).long()
    return ImageDataset(name="synthetic", train_x=x, train_y=y, test_x=x.clone(), test_y=y.clone(),
                        num_classes=classes, mean=(0.0,), std=(1.0,), max_value=1.0)


class Linear(nn.Module):
    """Softmax regression with the model interface flatfl's pieces expect (features / classifier)."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.flatten = nn.Flatten()
        self.classifier = nn.Linear(dim, classes)
        self.feature_dim = dim

    def features(self, x):
        return self.flatten(x)

    def forward(self, x):
        return self.classifier(self.features(x))

    def activation_modules(self):
        return []


def run(tmp_path, *, rounds: int = 1, clients: int = 2, algo: str = "fedavg", params: dict | None = None,
        dataset: ImageDataset | None = None, model: nn.Module | None = None, **overrides) -> Trainer:
    """Train ``rounds`` rounds with every client participating; returns the Trainer (``trainer.theta`` etc.)."""
    ds = dataset or make_dataset()
    dim = int(np.prod(ds.input_shape))
    torch.manual_seed(0)
    model = model or Linear(dim, ds.num_classes)
    settings = dict(dataset="digits", partition="iid", clients=clients, rounds=rounds, participation=1.0,
                    sampling="bernoulli", local_epochs=1, batch_size=10_000, lr=0.1, lr_decay=1.0, weight_decay=0.0,
                    clip=0.0, algo=algo, params=params or {}, eval_every=10_000, checkpoint_every=10_000, seed=0,
                    precision=str(torch.get_default_dtype()).replace("torch.", ""))  # the type the test computes in
    settings.update(overrides)
    cfg = RunConfig(**settings).validate()
    trainer = Trainer(cfg, tmp_path / "run", quiet=True, dataset=ds, model=model)
    trainer.run()
    return trainer


def client_arrays(trainer: Trainer, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Client i's inputs (n, d) as float64 and labels (n,)."""
    idx = trainer.partition.client_indices[i]
    x = trainer.ds.normalize(trainer.ds.train_x[torch.from_numpy(idx)]).reshape(len(idx), -1).double().numpy()
    return x, trainer.ds.train_y[torch.from_numpy(idx)].numpy()


def split_theta(theta: np.ndarray, dim: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat parameters of :class:`Linear` -> (W (classes, dim), b (classes,))."""
    return theta[: dim * classes].reshape(classes, dim), theta[dim * classes:]


def np_ce_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray, classes: int) -> np.ndarray:
    """Gradient of mean cross-entropy of softmax(x W^T + b) w.r.t. the flat (W, b), in float64."""
    d = x.shape[1]
    W, b = split_theta(theta, d, classes)
    z = x @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return np.concatenate([(p.T @ x).ravel(), p.sum(0)])


def flat_params(model: nn.Module) -> np.ndarray:
    """A model's parameters as one float64 numpy vector (the order of ``model.parameters()``)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a float64 numpy array on the host."""
    return t.detach().double().cpu().numpy()


def check_resume_equals_uninterrupted(cfg: RunConfig, tmp_path, crash_in_round) -> dict:
    """Train ``cfg`` through, and again with a crash in round 3 (after the round-2 checkpoint; ``crash_in_round``:
    the conftest fixture) then ``--resume``: the resumed run starts at round 2 and ends with the same weights and
    the same algorithm state, key for key. Returns that state."""
    import pytest

    ref = Trainer(cfg, tmp_path / "ref", quiet=True)
    ref.run()
    with crash_in_round(3), pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(cfg, tmp_path / "crashed", quiet=True).run()
    resumed = Trainer(cfg, tmp_path / "crashed", resume=True, quiet=True)
    assert resumed.start_round == 2
    resumed.run()
    assert torch.equal(ref.theta, resumed.theta)
    a, b = ref.algo.state_dict(), resumed.algo.state_dict()
    assert a["server"].keys() == b["server"].keys() and a["clients"].keys() == b["clients"].keys()
    assert all(torch.equal(a[s][k], b[s][k]) for s in ("server", "clients") for k in a[s])
    return a


def client_data(trainer: Trainer) -> tuple[list, np.ndarray, np.ndarray]:
    """Each client's (x, y) arrays, their sample counts n_i and weights w_i = n_i / mean(n)."""
    data = [client_arrays(trainer, i) for i in range(trainer.partition.num_clients)]
    n = np.array([len(y) for _, y in data], float)
    return data, n, n / n.mean()
