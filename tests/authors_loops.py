"""Test support (not part of the package): what the tests that set an algorithm beside a float64 port of its authors'
loop share (tests/test_sam_family.py, tests/test_fedgmt.py, tests/test_fedscar.py) - a run of the engine in float64,
the authors' codes' ``param_to_vector`` / ``vector_to_param``, a smooth MLP with an activation for MAN to penalise,
MAN's penalty computed from forward hooks, a relative comparison, and the two checks every such algorithm gets:
clients trained together against one at a time, and --resume against an uninterrupted run."""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from combinations import Combination, differences, train_case
from fl_harness import check_resume_equals_uninterrupted, client_data, make_dataset, run
from flatfl.errors import ConfigError
from flatfl.models.cnn import MLP

__all__ = ["run64", "vector", "load_vector", "tanh_mlp", "ActivationPenalty", "close", "PORT_RUN", "MAN_ZETA",
           "run_beside_port", "check_refusals", "check_together_equals_alone", "resumed_state"]


def run64(tmp_path, **kw):
    """``fl_harness.run`` in float64 (the model's and the run's tensors)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        tr = run(tmp_path, **kw)
    finally:
        torch.set_default_dtype(old)
    assert tr.theta.dtype == torch.float64
    return tr


def vector(model: nn.Module) -> torch.Tensor:
    """The authors' ``param_to_vector``: the parameters in order, flattened, keeping the graph."""
    return torch.cat([p.reshape(-1) for p in model.parameters()])


def load_vector(model: nn.Module, flat: torch.Tensor) -> None:
    """The authors' ``vector_to_param``: ``flat`` copied into the parameters in order."""
    index = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[index:index + p.numel()].view(p.shape))
            index += p.numel()


def tanh_mlp(seed: int, dim: int = 3, classes: int = 3, hidden: int = 4) -> nn.Module:
    """Flatten -> Linear -> tanh -> Linear in float64: smooth, and with one activation for MAN."""
    torch.manual_seed(seed)
    return MLP(classes, dim, hidden=(hidden,), activation="tanh").double()


class ActivationPenalty:
    """MAN's (zeta / 2) sum_l mean(a_l^2) of the last forward pass of ``model``, from forward hooks on its
    ``activation_modules()`` (the fedMAN code's loss term, computed here independently of flatfl's MAN); zeta None
    gives 0."""

    def __init__(self, model: nn.Module, zeta: float | None):
        self.zeta, self.seen = zeta, []
        self.hooks = [m.register_forward_hook(lambda mod, inp, out: self.seen.append(out))
                      for m in model.activation_modules()]

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's output on ``x``, its activations recorded afresh."""
        self.seen.clear()
        return model(x)

    def value(self) -> torch.Tensor | float:
        return 0.0 if self.zeta is None else self.zeta / 2 * sum(a.pow(2).mean() for a in self.seen)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def close(a, b, tol: float = 1e-10) -> bool:
    """max |a - b| within ``tol`` of max(1, max |b|)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


#: the local training of the port tests: two full-batch steps with momentum and weight decay, a decaying rate, no
#: clipping (fl_harness's default; the authors' codes clip nothing)
PORT_RUN = {"lr": 0.3, "lr_decay": 0.9, "local_epochs": 2, "momentum": 0.5, "weight_decay": 0.01}
#: MAN's weight in the port tests' MAN runs
MAN_ZETA = 0.4


def run_beside_port(tmp_path, algo: str, reg: str, parallel, params: dict, *, rounds: int, seed: int):
    """``algo`` trained in float64 with ``params`` (and MAN at :data:`MAN_ZETA` when ``reg`` is "man") for ``rounds``
    rounds of :data:`PORT_RUN` on 3 unequal clients (26 samples) joining with probability 0.5, a :func:`tanh_mlp`
    seeded ``seed``, ``parallel`` clients at once. Returns the trainer, a copy of the initial model, each client's
    (x, y) and each round's participants, for a port to replay."""
    from flatfl.train.rounds import sample_clients

    model = tanh_mlp(seed)
    model0 = copy.deepcopy(model)
    params = dict(params, **({"zeta": MAN_ZETA} if reg == "man" else {}))
    tr = run64(tmp_path, rounds=rounds, clients=3, participation=0.5, algo=algo, reg=reg, params=params,
               dataset=make_dataset(num_samples=26), model=model, parallel_clients=parallel, **PORT_RUN)
    data = client_data(tr)[0]
    who = [sample_clients(0, t, len(data), 0.5, "bernoulli") for t in range(rounds)]
    assert {len(w) for w in who} != {len(data)} and min(len(w) for w in who) >= 1  # some round leaves one out
    return tr, model0, data, who


def check_refusals(tmp_path, algo: str, bad: dict, **kw) -> None:
    """Each setting of ``bad`` (settings key -> (value, what the value must be)) refused for ``algo`` in the one line
    ``--flag for algo must be ...``; ``kw``: the rest of the run (``fl_harness.run``'s arguments)."""
    import pytest

    for key, (value, why) in bad.items():
        flag = "--" + key.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag} for {algo} must be {why}"):
            run(tmp_path / key, algo=algo, params={key: value}, **kw)


def check_together_equals_alone(tmp_path, algo: str, opt: str, reg: str) -> None:
    """The differential case of tests/combinations.py on the ``tiny`` model (5 unequal clients, Bernoulli 0.5, 2
    rounds, batches of 4 with steps only some clients take, momentum): N = 1, all and 2 give the same server
    weights, client models and algorithm state in float64."""
    case = Combination("tiny", reg, algo, opt)
    one = train_case(case, tmp_path / "one", 1)
    assert one.theta.dtype == torch.float64 and torch.isfinite(one.theta).all()
    for parallel in ("all", 2):
        other = train_case(case, tmp_path / str(parallel), parallel)
        off = {k: v for k, v in differences(one, other).items() if not v <= 1e-9}
        assert not off, f"N={parallel} vs N=1: {off}"


def resumed_state(tmp_path, crash_in_round, algo: str) -> dict:
    """``algo`` on digits (6 clients, Bernoulli 0.5, 5 rounds, the ``tiny`` model) crashed in round 3 and resumed
    ends as the uninterrupted run, weights and algorithm state alike; that state."""
    from flatfl.train.config import RunConfig

    cfg = RunConfig(dataset="digits", model="tiny", clients=6, participation=0.5, rounds=5, local_epochs=1,
                    batch_size=64, algo=algo, eval_every=1000, checkpoint_every=2, seed=0).validate()
    return check_resume_equals_uninterrupted(cfg, tmp_path, crash_in_round)
