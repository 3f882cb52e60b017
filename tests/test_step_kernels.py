"""The cohort step's kernel count (benchmarks/step_kernels.py, the CPU proxy of a GPU step's cost) stays near one
client's: a regression that brings back per-client work inside the step loop (a gather, a norm or a coefficient
per client) is caught here, on a tiny network, long before a GPU shows it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_kernels import KernelCounter, step_counts  # noqa: E402

from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402

TARGET = 1.3  # the issue's: a cohort step of 10 clients at most 1.3x one client's kernels


def test_the_counter_counts_kernels_and_not_views():
    a = torch.randn(4, 6)
    with KernelCounter() as c:
        b = a.t().reshape(6, 4).unsqueeze(0)[0]  # views only
        (b * 2).sum().item()  # two kernels and a host synchronisation (a copy to the host)
    assert c.kernels == 3 and dict(c.ops) == {"mul": 1, "sum": 1, "_local_scalar_dense": 1}
    assert sum(c.syncs.values()) == 1


@pytest.mark.parametrize("model,algo,reg,params", [
    ("digits-cnn", "feddyn", "man", {}),
    ("digits-cnn", "fedavg", "fedalign", {}),
    ("resnet20", "fedavg", "stochdepth", {}),  # survival 1 -> 0.9: most steps, some clients drop a block
    ("resnet20", "fedavg", "gradaug", {}),  # every client's sub-networks in one canvas pass
])
def test_a_cohort_step_of_ten_clients_costs_about_one_clients_kernels(tmp_path, model, algo, reg, params):
    clients, batch = 10, 4
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(clients * 2 * batch, 1, 8, 8, generator=g), torch.arange(clients * 2 * batch) % 10
    train, test = TensorDataset(x, y), TensorDataset(x[:20], y[:20])

    def make(epochs, parallel):
        cfg = RunConfig(dataset="digits", model=model, partition="iid", clients=clients, participation=1.0,
                        sampling="fraction", rounds=10, local_epochs=epochs, batch_size=batch, lr=0.1,
                        weight_decay=1e-3, clip=10.0, momentum=0.5, algo=algo, reg=reg, seed=0, params=params,
                        parallel_clients=parallel).validate()
        return Trainer(cfg, tmp_path / f"{epochs}-{parallel}", quiet=True, log=lambda s: None, dataset=train,
                       test_dataset=test)

    c = step_counts(make, clients)
    assert c.per_client_step > 30  # a real step was counted (forward, backward, clipping, the update)
    assert c.ratio <= TARGET, (c.per_client_step, c.per_cohort_step, sorted(c.step_ops.items()))
    assert c.syncs_per_step() == 0, c.batched[1].syncs  # no host synchronisation inside the step loop
