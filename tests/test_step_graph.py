"""Replayed steps (``--cuda-graphs``) give the eager steps' numbers, and a step a replay would get wrong is run
eagerly, with one line saying why.

A CUDA graph replays the kernels it recorded on the memory it recorded. On the CPU the tests replay steps with
those semantics (:class:`graph_replay.RecordedStep`: recorded operations rerun on the recorded tensors; Python not
rerun; random numbers drawn anew), put in place of the CUDA recorder for the ``cpu`` device type:

* for every algorithm, regularizer, local optimizer and model of the registries
  (``step_graph_combinations`` of ``tests/combinations.py``), a run with replayed steps gives exactly, to the last
  bit, the numbers of the same run stepped eagerly (float64, a cohort of 5 clients, full steps replayed between
  partial eager ones), and the steps were replayed unless a piece draws random numbers at every step (then the
  run says so in one line);
* each hazard the probe looks for (state replaced instead of updated, a Python counter, a host read, a random draw,
  host data) does change a replayed run's numbers when the probe is bypassed, and with the probe the run is eager
  and exact;
* on a CUDA device (skipped elsewhere) the real CUDA graphs give the eager numbers in float64.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import flatfl.train.step_graph as step_graph
from flatfl.cli import main
from flatfl.errors import ConfigError
from combinations import (CASE_CLASSES, case_data, differences, smallest_input, step_graph_combinations,
                          step_graph_settings, train_case)
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer
from flatfl.train.step_graph import GraphedSteps, StepProbe
from graph_replay import RecordedStep

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def replay_on_cpu(monkeypatch):
    """Steps on the CPU replayed by :class:`RecordedStep`."""
    monkeypatch.setitem(step_graph.CAPTURES, "cpu", RecordedStep)


def train(case, run_dir, *, graphs: bool, device: str = "cpu", log=lambda line: None):
    return train_case(case, run_dir, "all", device=device, log=log, settings=step_graph_settings, cuda_graphs=graphs)


@pytest.mark.parametrize("case", step_graph_combinations(), ids=lambda c: c.label)
def test_replayed_steps_give_the_eager_numbers(tmp_path, case, replay_on_cpu):
    try:
        eager = train(case, tmp_path / "eager", graphs=False)
    except ConfigError as e:
        assert "\n" not in str(e)
        pytest.skip(f"refused before training: {e}")
    notices: list[str] = []
    replays = RecordedStep.replays
    graphed = train(case, tmp_path / "graphed", graphs=True, log=notices.append)
    worst = {k: v for k, v in differences(eager, graphed).items() if v != 0.0}
    assert not worst, f"replayed vs eager: {worst}"
    if notices:  # only a piece that draws at every step is run eagerly
        assert len(notices) == 1 and "\n" not in notices[0], notices
        assert notices[0].startswith("--cuda-graphs: steps run eagerly (") and "a random draw" in notices[0]
        assert RecordedStep.replays == replays
    else:
        assert RecordedStep.replays > replays  # the comparison covered replayed steps


def test_the_cases_hold_every_registered_piece():
    from combinations import factors, large_model

    models, regs, algos, opts = factors()
    cases = step_graph_combinations()
    assert {c.algo for c in cases} == set(algos)
    assert {c.opt for c in cases} == set(opts)
    assert {c.reg for c in cases} == set(regs)
    assert {m for m in models if not large_model(m)} <= {c.model for c in cases}


# ----- the hazards, on a hand-made step -----

class Counter:
    def __init__(self):
        self.k = 0


def hazard_steps(kind: str):
    """(state, step): a step on a weight vector ``state["w"]`` of 4 numbers with the hazard ``kind``."""
    state = {"w": torch.ones(4, dtype=torch.float64), "m": torch.zeros(4, dtype=torch.float64), "n": Counter()}
    gen = torch.Generator().manual_seed(0)
    data = torch.arange(40, dtype=torch.float64).view(10, 4) / 10
    taken: list[int] = []

    def step(index: torch.Tensor) -> None:
        x = data[index].sum((0, 1))
        w = state["w"]
        if kind == "replaced":
            state["m"] = state["m"] * 0.5 + x  # momentum rebound to a new tensor
            w.sub_(0.1 * state["m"])
        elif kind == "counter":
            state["n"].k += 1
            w.sub_(0.1 * state["n"].k * x)
        elif kind == "host read":
            w.sub_(0.1 * x * (2.0 if float(w.sum()) > 0 else 1.0))
        elif kind == "random":
            w.sub_(0.1 * x * torch.rand(4, generator=gen, dtype=torch.float64))
        elif kind == "host data":  # a number of the host that changes at every step, outside the pieces
            taken.append(len(taken))
            w.sub_(torch.tensor([float(len(taken))] * 4, dtype=torch.float64) * 0.01 * x)
        elif kind == "in place":
            state["m"].mul_(0.5).add_(x)
            w.sub_(0.1 * state["m"])

    return state, step


def run_hazard(kind: str, mode: str) -> tuple[torch.Tensor, list[str]]:
    """The weights after 8 steps of ``kind``: ``mode`` eager, graphed (probed) or forced (the probe bypassed)."""
    state, step = hazard_steps(kind)
    notices: list[str] = []
    graphed = GraphedSteps(torch.device("cpu"), 1, 2, pieces={"state": state}, params=[], notice=notices.append)
    for s in range(8):
        index = np.array([[s % 10, (3 * s + 1) % 10]])
        if mode == "eager":
            step(torch.from_numpy(index))
        else:
            graphed.run(index, step)
    return state["w"], notices


@pytest.mark.parametrize("kind,reason", [("replaced", "state replaced instead of updated in place"),
                                         ("counter", "Python values change every step (state['n'].k)"),
                                         ("host read", "a host synchronisation"),
                                         ("random", "a random draw"),
                                         ("host data", "a tensor made from host data")])
def test_a_step_a_replay_would_get_wrong_runs_eagerly(kind, reason, replay_on_cpu, monkeypatch):
    eager, _ = run_hazard(kind, "eager")
    graphed, notices = run_hazard(kind, "graphed")
    assert torch.equal(graphed, eager)
    assert len(notices) == 1 and reason in notices[0], notices
    monkeypatch.setattr(StepProbe, "reasons", lambda self: [])  # bypass the probe: the replay goes wrong
    if kind == "host read":  # a capture refuses a host read outright; the run goes on eagerly
        forced, notices = run_hazard(kind, "forced")
        assert torch.equal(forced, eager) and "the capture failed" in notices[0]
        return
    forced, _ = run_hazard(kind, "forced")
    assert not torch.allclose(forced, eager, rtol=1e-6, atol=0)


def test_a_step_updated_in_place_is_replayed_exactly(replay_on_cpu):
    eager, _ = run_hazard("in place", "eager")
    replays = RecordedStep.replays
    graphed, notices = run_hazard("in place", "graphed")
    assert notices == [] and RecordedStep.replays - replays == 6  # steps 3 to 8
    assert torch.equal(graphed, eager)


# ----- where graphs cannot run -----

def test_cuda_graphs_on_a_cpu_run_is_one_line(tmp_path):
    res = CliRunner().invoke(main, ["train", "--rounds", "1", "--cuda-graphs", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == ["flatfl: error: --cuda-graphs needs a CUDA device (this run is on cpu)"]
    assert not (tmp_path / "r").exists()


def test_augmentation_trains_eagerly_with_a_notice(tmp_path, replay_on_cpu):
    from combinations import Combination

    case = Combination("tiny", "none", "fedavg", "sgd")
    lines: list[str] = []
    cfg = RunConfig(**dict(step_graph_settings(case), augment=True, rounds=1), cuda_graphs=True).validate()
    tr = Trainer(cfg, tmp_path / "r", quiet=True, log=lines.append,
                 dataset=case_data(smallest_input("tiny", CASE_CLASSES)))
    assert tr.graphs is False and tr.training_path()["cuda_graphs"] is False
    assert lines == ["--cuda-graphs: steps run eagerly (augmentation draws on the host at every step)"]


# ----- CUDA -----

PAPER_METHODS = [("cifar-cnn", "none", "fedavg", "sgd"), ("cifar-cnn", "man", "fedavg", "sgd"),
                 ("cifar-cnn", "man", "feddyn", "sgd"), ("cifar-cnn", "none", "fedsam", "sgd"),
                 ("cifar-cnn", "man", "fedspeed", "sgd"), ("cifar-cnn", "asd", "fedavg", "sgd"),
                 ("resnet20", "fedalign", "fedavg", "sgd")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", PAPER_METHODS, ids="-".join)
def test_cuda_graphs_give_the_eager_numbers_on_cuda(tmp_path, case):
    from combinations import Combination

    c = Combination(*case)
    eager = train(c, tmp_path / "eager", graphs=False, device="cuda")
    notices: list[str] = []
    graphed = train(c, tmp_path / "graphed", graphs=True, device="cuda", log=notices.append)
    assert notices == []
    worst = {k: v for k, v in differences(eager, graphed).items() if v > 1e-9}
    assert not worst, f"CUDA graphs vs eager on CUDA: {worst}"


def test_the_report_scale_line_says_steps_were_graphs(tmp_path, replay_on_cpu):
    import json

    from flatfl.report.layouts import scale_label
    from flatfl.report.records import load_run
    from combinations import Combination

    settings = dict(step_graph_settings(Combination("tiny", "man", "fedavg", "sgd")), rounds=1, eval_every=1,
                    checkpoint_every=1)
    for name, graphs in (("graphed", True), ("eager", False)):
        cfg = RunConfig(**settings, parallel_clients="all", cuda_graphs=graphs, out=str(tmp_path / name)).validate()
        Trainer(cfg, tmp_path / name, quiet=True, log=lambda s: None,
                dataset=case_data(smallest_input("tiny", CASE_CLASSES))).run()
    assert json.loads((tmp_path / "graphed" / "config.json").read_text())["training_path"]["cuda_graphs"] is True
    assert scale_label([load_run(tmp_path / "graphed")]).endswith(
        "; trained on cpu, 5 clients at once, float32 full, steps as CUDA graphs")
    assert scale_label([load_run(tmp_path / n) for n in ("graphed", "eager")]).endswith(
        ", steps as CUDA graphs in 1 of 2 runs")
    assert "CUDA graphs" not in scale_label([load_run(tmp_path / "eager")])
