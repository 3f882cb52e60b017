"""Clients trained together (``--parallel-clients``) give the numbers of clients trained one at a time.

The truth each test checks against is independent of the batched code: per-client forward passes of separate
models, torch's own SGD, and the same run trained one client at a time (N = 1). Runs are in float64, so that a
difference of summation order (around 1e-16) cannot be mistaken for a bug (around 1e-3 and more), and the
tolerance, 1e-9 relative, is far tighter than the issue's 1e-5.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from flatfl.errors import ConfigError
from flatfl.models import build_model
from flatfl.models.resnet import ResNet
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import (StackedLayout, stack_inputs, stack_network, stacking_path, stacking_refusal,
                                    unstack_outputs)
from flatfl.train import local as local_module
from flatfl.train.catalog import load_all
from flatfl.train.config import RunConfig, parallel_clients_value
from flatfl.train.engine import Trainer
from flatfl.train.optimizers import RowSGD
from flatfl.train.regularizers import stochdepth

load_all()
RTOL = 1e-9


@contextlib.contextmanager
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def train(tmp_path, parallel, rounds=2, resume=False, log=None, network=None, **settings):
    """A run of ``rounds`` rounds on digits: 10 clients of unequal sizes, 3 of them a round (``network``: a model of
    one's own instead of the config's)."""
    base = dict(dataset="digits", model="digits-cnn", clients=10, participation=0.3, sampling="fraction",
                rounds=rounds, local_epochs=1, batch_size=48, partition="fedml-dirichlet", alpha=0.5, seed=3,
                momentum=0.5, eval_every=rounds, checkpoint_every=rounds, parallel_clients=parallel, precision="float64")
    base.update(settings)
    cfg = RunConfig(**base).validate()
    with float64():
        tr = Trainer(cfg, tmp_path / f"run-{parallel}", quiet=True, resume=resume, log=log or (lambda s: None),
                     model=None if network is None else network())
        for r in range(rounds):
            tr.run_round(r)
    assert tr.theta.dtype == torch.float64
    return tr


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_same(tmp_path, **settings):
    one = train(tmp_path, 1, **settings)
    together = train(tmp_path, "all", **settings)
    assert together.parallel == 10, together.parallel_reason
    assert rel(together.theta, one.theta) < RTOL
    assert rel(together.latest, one.latest) < RTOL
    for name, v in one.buffers.items():
        assert rel(together.buffers[name], v) < RTOL
    for name, v in one.algo.clients.items():
        assert rel(together.algo.clients[name], v) < RTOL or torch.equal(together.algo.clients[name], v)


# Every model, regularizer, algorithm and optimizer, N = 1 against N = all and N = 2: tests/test_every_path.py (its
# cases are generated from the registries). The tests below check what that matrix does not: that the batched path
# is really exercised (unequal steps, per-client drops), and the pieces one by one.


def test_unequal_clients_take_unequal_steps_and_batches(tmp_path, monkeypatch):
    real = local_module.StepContext
    partial = []

    def counting(cohort, x, y, rows=None, **kwargs):
        if rows is not None:
            partial.append(len(rows))
        return real(cohort, x, y, rows, **kwargs)

    monkeypatch.setattr(local_module, "StepContext", counting)
    tr = train(tmp_path, "all", rounds=1)
    monkeypatch.undo()
    sizes = tr.partition.sizes
    assert len(set(sizes.tolist())) == len(sizes)  # every client a different size
    assert partial and min(partial) >= 1 and max(partial) < 3  # steps where only some of the 3 clients trained
    check_same(tmp_path / "asam", algo="feddyn", reg="man", local_opt="asam")
    check_same(tmp_path / "mean", algo="scaffold", params={"steps_rule": "mean"}, local_epochs=2)


def tiny_resnet() -> ResNet:
    """A two-stage ResNet (one BasicBlock a stage, 8 and 16 channels) for the digits: flatfl's ResNet class, small
    enough to run every algorithm with the network-changing regularizers."""
    torch.manual_seed(0)  # the same initial weights for every run
    return ResNet("basic", (1, 1), (8, 16), num_classes=10, in_channels=1)


def test_stochdepth_drops_differ_per_client_in_a_cohort_step(tmp_path, monkeypatch):
    """The batched path is exercised: some cohort steps have a block that some clients keep and others drop."""
    mixed = []
    real = stochdepth.BlockGate

    def spy(values, dropped, kept_by_all, dropped_by_all):
        mixed.append(not kept_by_all and not dropped_by_all)
        return real(values, dropped, kept_by_all, dropped_by_all)

    monkeypatch.setattr(stochdepth, "BlockGate", spy)
    train(tmp_path, "all", network=tiny_resnet, reg="stochdepth", params={"survival_last": 0.5}, rounds=1)
    assert any(mixed) and not all(mixed)


def test_gradaug_trains_one_client_at_a_time_where_per_client_widths_cannot_be_masked(tmp_path):
    """GroupNorm networks and --width 1: the engine says why, in one line, and trains one client at a time."""
    gn = dict(model="resnet18", model_args={"norm": "gn", "gn_groups": 1})
    for name, settings, words in (("gn", gn, "GroupNorm"), ("w1", dict(model="resnet20", params={"width": 1.0}),
                                                             "--width 1")):
        said = []
        cfg = RunConfig(dataset="digits", clients=10, participation=0.3, rounds=1, reg="gradaug",
                        parallel_clients="all", **settings).validate()
        tr = Trainer(cfg, tmp_path / name, quiet=True, log=said.append)
        assert tr.parallel == 1 and len(said) == 1 and words in said[0], said
    # GroupNorm of 2 groups cannot split most random widths (one at a time either): refused before training
    cfg = RunConfig(dataset="digits", clients=10, model="resnet18", model_args={"norm": "gn"}, reg="gradaug",
                    params={"width": 0.5}).validate()
    with pytest.raises(ConfigError, match="GroupNorm with 2 groups cannot split"):
        Trainer(cfg, tmp_path / "gn2", quiet=True)


@pytest.mark.parametrize("name,kwargs,width", [("resnet20", {}, 0.8), ("resnet20", {}, 0.25),
                                               ("resnet18", {"norm": "gn"}, 0.5)])
def test_a_stacked_network_at_a_width_is_each_clients_slimmed_network(name, kwargs, width):
    """``set_width`` on a stacked ResNet gives each client's slimmed network (conv, BatchNorm in both modes,
    GroupNorm, classifier). (Per-client widths in one pass, as GradAug uses them: tests/test_canvas.py.)"""
    torch.manual_seed(0)
    with float64():
        base = build_model(name, num_classes=10, in_channels=1, image_size=8, **kwargs)
        models = [copy.deepcopy(base) for _ in range(3)]
        for k, m in enumerate(models):
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.01 * (k + 1) * torch.randn_like(p))
        stacked = stack_network(base, 3)
        layout = StackedLayout(stacked, 3, ParamLayout(base))
        layout.set(torch.stack([ParamLayout(m).get() for m in models]))
        x = torch.randn(3, 4, 1, 8, 8)
        for training in (True, False):
            stacked.train(training)
            stacked.set_width(width)
            out = unstack_outputs(stacked(stack_inputs(x)), 3)
            stacked.set_width(1.0)
            for k, m in enumerate(models):
                m.train(training)
                m.set_width(width)
                assert rel(out[k].detach(), m(x[k]).detach()) < 1e-12, (name, width, training)
                m.set_width(1.0)


def test_row_sgd_is_torch_sgd_per_client():
    """Clients decaying at different rates, some sitting a step out: each row follows torch.optim.SGD alone."""
    torch.manual_seed(1)
    with float64():
        base = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
        stacked = stack_network(base, 3)
        layout = StackedLayout(stacked, 3, ParamLayout(base))
        start = torch.randn(3, layout.dim)
        layout.set(start)
        decay = torch.tensor([0.0, 0.01, 0.1])
        opt = RowSGD(layout, lr=0.1, momentum=0.9, weight_decay=decay, nesterov=True)
        refs = []
        for k in range(3):
            m = copy.deepcopy(base)
            ParamLayout(m).set(start[k])
            refs.append((m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=float(decay[k]),
                                            nesterov=True)))
        for step, rows in enumerate([None, torch.tensor([0, 2]), None, torch.tensor([1])]):
            grads = torch.randn(3, layout.dim)
            for p in layout.params:
                p.grad = None
            layout.add_to_grads(grads)
            opt.step(rows)
            for k, (m, o) in enumerate(refs):
                if rows is not None and k not in rows.tolist():
                    continue
                o.zero_grad()
                ParamLayout(m).set(ParamLayout(m).get())
                for p, g in zip(ParamLayout(m).params, ParamLayout(m).views(grads[k])):
                    p.grad = g.clone()
                o.step()
        for k, (m, _) in enumerate(refs):
            assert rel(layout.get()[k], ParamLayout(m).get()) < 1e-12


def test_models_that_cannot_be_stacked_are_named():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x.flatten(1))

    # a class of one's own is stacked by torch.func (tests/test_user_modules.py); what neither path stacks is named
    assert stacking_refusal(Custom()) is None and stacking_path(Custom()) == "torch.func"
    assert stacking_refusal(build_model("digits-cnn", num_classes=10, in_channels=1, image_size=8)) is None
    cumulative = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None), nn.Linear(3, 2))
    assert "2 is a BatchNorm1d with momentum=None" in stacking_refusal(cumulative)
    with pytest.raises(ValueError):
        stack_network(cumulative, 2)


@pytest.mark.parametrize("bad", [0, -1, "none", "1.5", True, 2.0])
def test_bad_parallel_clients_values(bad):
    with pytest.raises(ConfigError, match="--parallel-clients"):
        parallel_clients_value(bad)
    assert parallel_clients_value("ALL") == "all" and parallel_clients_value("4") == 4


def test_clients_that_do_not_fit_are_split_and_the_log_says_so(tmp_path, monkeypatch):
    """Out of memory part-way through a cohort of more than 2 clients (as a GPU would be): N is halved until the
    cohort fits, the log says so in one line, the steps already taken leave no trace (FedRobust changes its client
    state at every step) and the numbers are those of one client at a time."""
    real = local_module.StepContext
    seen = {"n": 0}

    def small_memory(cohort, *args, **kwargs):
        if cohort.n > 2:
            seen["n"] += 1
            if seen["n"] == 3:  # two steps taken, the third does not fit
                seen["n"] = 0
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(cohort, *args, **kwargs)

    for algo, reg in (("feddyn", "man"), ("fedrobust", "none")):
        one = train(tmp_path / algo, 1, algo=algo, reg=reg, participation=0.5)
        monkeypatch.setattr(local_module, "StepContext", small_memory)
        said = []
        split = train(tmp_path / algo, "all", algo=algo, reg=reg, participation=0.5, log=said.append)
        monkeypatch.setattr(local_module, "StepContext", real)
        assert split.parallel == 2
        assert [s for s in said if "did not fit" in s] == [
            "--parallel-clients: 5 clients did not fit in GPU memory; training 2 at once"], said
        assert rel(split.theta, one.theta) < RTOL
        for name, v in one.algo.clients.items():
            assert rel(split.algo.clients[name], v) < RTOL or torch.equal(split.algo.clients[name], v), name
