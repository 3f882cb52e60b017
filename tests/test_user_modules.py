"""A user's own network trains with its clients together (torch.func: :mod:`flatfl.models.functional_stack`), or is
refused by name, in one notice, and trains one client at a time.

The numbers of whole runs, together against one at a time, for the own networks of ``tests/combinations.py``
(GELU and a LayerNorm residual block, SiLU and a buffer used in forward, a tied weight, a module used twice, a frozen
layer, BatchNorm with momentum=None) with MAN, FedDyn + MAN, FedAlign and MOON: ``tests/test_every_path.py``. Here:
which path stacks which shape, each client of a stacked network against its own plain network (float64), and the
refusals.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from combinations import (GeluLayerNormResidual, MomentumNone, TiedWeight, case_data, case_settings,
                          sequential_reused, Combination)
from flatfl.models import build_model
from flatfl.models.functional_stack import StackingRefused
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import (StackedLayout, probe_stacking, stack_inputs, stack_network, stacking_path,
                                    stacking_refusal, unstack_outputs)
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


class EmaBuffer(nn.Module):
    """A float buffer assigned anew in every training forward (an exponential average of the features)."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(64, 6), nn.SiLU(), nn.Linear(6, 4)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x):
        h = self.act(self.fc(x.flatten(1)))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return self.out(h - self.ema)


class Branchy(nn.Module):
    """A branch on a tensor's value (data-dependent control flow)."""

    def __init__(self):
        super().__init__()
        self.fc, self.gate, self.out = nn.Linear(64, 6), Gate(), nn.Linear(6, 4)

    def forward(self, x):
        return self.out(self.gate(self.fc(x.flatten(1))))


class Gate(nn.Module):
    def forward(self, h):
        if h.mean() > 0:
            return torch.relu(h)
        return torch.tanh(h)


class Counting(nn.Module):
    """An integer buffer the forward counts up (one client at a time counts across clients)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1))


def test_which_path_stacks_which_network():
    cnn = build_model("digits-cnn", num_classes=10, in_channels=1, image_size=8)
    assert stacking_path(cnn) == "channels"
    for net in (GeluLayerNormResidual(), TiedWeight(), sequential_reused(), EmaBuffer()):
        assert stacking_path(net) == "torch.func" and stacking_refusal(net) is None
    why = stacking_refusal(MomentumNone())
    assert stacking_path(MomentumNone()) is None and "bn" in why and "momentum=None" in why
    bn = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 4))
    assert "momentum=None" in stacking_refusal(bn)


@pytest.mark.parametrize("make", [GeluLayerNormResidual, TiedWeight, sequential_reused, EmaBuffer],
                         ids=["gelu-layernorm", "tied", "sequential-reused", "ema-buffer"])
def test_each_stacked_client_is_its_own_network(make):
    """Outputs, gradients and buffers of each client of a torch.func stack against its plain network (float64)."""
    torch.manual_seed(0)
    base = make()
    n = 3
    stacked = stack_network(base, n)
    layout = StackedLayout(stacked, n, ParamLayout(base))
    models = [copy.deepcopy(base) for _ in range(n)]
    for k, m in enumerate(models):
        with torch.no_grad():
            for p in ParamLayout(m).params:
                p.add_(0.1 * (k + 1) * torch.randn_like(p))
    layout.set(torch.stack([ParamLayout(m).get() for m in models]))
    x = torch.randn(n, 5, 1, 8, 8)
    for _ in range(2):  # a buffer written in the first forward is read in the second
        out = unstack_outputs(stacked(stack_inputs(x)), n)
    out.sum().backward()
    grads = torch.cat([g.reshape(n, -1) for g in layout.grads(touch=False)], 1)
    for k, m in enumerate(models):
        for _ in range(2):
            ref = m(x[k])
        ref.sum().backward()
        assert rel(out[k].detach(), ref.detach()) < 1e-12
        assert rel(grads[k], torch.cat([p.grad.flatten() for p in ParamLayout(m).params])) < 1e-12
        for name, b in layout.get_buffers().items():
            assert rel(b[k].view_as(m.get_buffer(name)), m.get_buffer(name)) < 1e-12 or not b.abs().max()


@pytest.mark.parametrize("make,words", [(Branchy, ["gate (Gate)", "if h.mean() > 0", "data-dependent"]),
                                        (Counting, ["calls", "integer buffer"])], ids=["branch", "counter"])
def test_what_torch_func_cannot_run_is_one_notice_naming_the_module_and_the_operation(tmp_path, make, words):
    torch.manual_seed(0)
    said = []
    settings = case_settings(Combination("own-frozen-layer", "none", "fedavg", "sgd"))
    cfg = RunConfig(**{**settings, "rounds": 1}, parallel_clients="all").validate()
    tr = Trainer(cfg, tmp_path, quiet=True, log=said.append, dataset=case_data(8), model=make())
    assert tr.parallel == 1 and len(said) == 1 and "one client at a time" in said[0], said
    assert all(w in said[0] for w in words), said
    assert "\n" not in said[0] and tr.training_path()["clients_at_once_why"].startswith("the model cannot be stacked")
    tr.run_round(0)  # and it trains, one client at a time


def test_a_hook_that_changes_an_output_is_refused_by_name():
    torch.manual_seed(0)
    net = GeluLayerNormResidual()
    stacked = stack_network(net, 2)
    stacked.act1.register_forward_hook(lambda module, inputs, output: output * 2)
    with pytest.raises(StackingRefused, match=r"hook on act1 \(GELU\) changes its output"):
        stacked(stack_inputs(torch.randn(2, 3, 1, 8, 8)))
    assert probe_stacking(net, torch.randn(3, 1, 8, 8)) is None  # the network itself (hooks are the pieces')
