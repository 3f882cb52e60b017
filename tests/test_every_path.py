"""One answer on every path: clients trained together give the numbers of clients trained one at a time.

The cases are generated from the registries (every model of ``flatfl models``, every regularizer, algorithm and local
optimizer: ``tests/combinations.py``), so a model or method registered later is covered without editing this
file. Each case trains the same run three times in float64: one client at a time (N = 1, the reference), all of a
round's clients together (N = all) and two at a time (N = 2), on unequal Dirichlet partitions with Bernoulli
participation (cohorts whose size changes from round to round, cohorts of one included), and compares the server
weights, every client's latest model, the float buffers (BatchNorm statistics, and an own network's running statistic
that its forward writes in place or assigns anew) and the algorithm's server and client state to 1e-9 relative. A combination the run refuses with one named line before training is a pass.

Which combinations: every model x regularizer x algorithm x optimizer a run admits is 2,000 and more, so the suite
runs a covering set: every pair of (model, regularizer), (model, algorithm), (model, optimizer), (regularizer,
algorithm), (regularizer, optimizer) and (algorithm, optimizer) that a run admits is in some case, except that a
model of over a million parameters is paired with every regularizer but not with every algorithm and optimizer,
and trains with N = 1 and all only (``required_pairs`` of ``tests/combinations.py``). ``FLATFL_EVERY_PATH=full``
runs every admitted combination.
The schedule of a case (``case_settings`` of ``tests/combinations.py``): batches of 4 without BatchNorm (unequal
step counts, steps that only some clients take, a batch of one sample); with BatchNorm, one step a round on each
client's data, since deep BatchNorm networks on a few samples amplify rounding past any tolerance (a relative
change of 1e-15 in ResNet-56's initial weights grows past 1e-2 in two rounds of small batches). flatfl's ResNets
train at slim widths of the same structure (``CASE_MODEL_ARGS``: ResNet-18 at 4/8/8/8 channels, ResNet-20 and -56 at
4/8/8; blocks, strides, BatchNorm and projection shortcuts as at the default widths); which pairs are required is
read off the default widths. ``benchmarks/differential_breaks.py`` shows that the check (``check_case``) catches
deliberate breaks of the stacked path on these cases.

The registries include an algorithm defined outside the package (``tests/external_algorithm.py``, registered
with the public API while this module's cases are made and while its tests run): the cases pair it as they pair the
package's own, and their ids name it.

A second test is structural: for every model and every regularizer (and MOON's projection), the network of stacked
clients hooks the same modules, by name, as the plain network.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from flatfl.data.datasets import as_image_dataset
from flatfl.data.partition import make_partition
from flatfl.errors import ConfigError
from flatfl.models import model_names
from flatfl.models.slimmable import Slimmable
from flatfl.models.stacking import stacked_clients
from flatfl.train.catalog import load_all
from combinations import (CASE_CLASSES, CASE_CLIENTS, CASE_ROUNDS, CASE_RTOL, CASE_SEED, EXPECTED_REFUSALS,
                          OWN_NETWORKS, OWN_INPUT, Combination, admitted, case_cohorts, case_data, case_settings,
                          check_case, every_combination, factors, pairs_held, own_combinations,
                          pairwise_combinations, required_pairs, smallest_input)
from flatfl.train.components import REGULARIZERS
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer
from external_algorithm import ProxServerStep, registered

load_all()
RTOL = CASE_RTOL  # the check itself is combinations.check_case (also run by benchmarks/differential_breaks.py)
CLASSES = CASE_CLASSES


def image_size(model: str) -> int:
    return smallest_input(model, CLASSES)


def data(size: int):
    return case_data(size)


def settings(model: str, reg: str, algo: str, opt: str) -> dict:
    return case_settings(Combination(model, reg, algo, opt))


def cases() -> list[Combination]:
    """The cases, read off the registries with the outside algorithm registered, and the own networks' cases."""
    with registered():
        if os.environ.get("FLATFL_EVERY_PATH") == "full":
            return every_combination() + own_combinations()
        return pairwise_combinations() + own_combinations()


CASES = cases()


@pytest.fixture(autouse=True, scope="module")
def outside_algorithm():
    """The outside algorithm registered while this module's tests run (taken out after)."""
    with registered():
        yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_clients_together_give_the_numbers_of_one_at_a_time(tmp_path, case):
    try:
        failures = check_case(case, tmp_path)
    except ConfigError as e:
        assert "\n" not in str(e)
        pytest.skip(f"refused before training: {e}")
    assert not failures, failures


def test_the_cases_stack_cohorts_of_several_sizes():
    """The cases' rounds give N = all a full cohort, then one of an odd size (a stacked network of another size
    after the first round), then a cohort of one; every listed refusal names a case that exists."""
    sizes = case_cohorts()
    assert CASE_ROUNDS >= 3 and sizes[0] == CASE_CLIENTS and any(s % 2 == 1 and 1 < s < CASE_CLIENTS for s in sizes)
    labels = {c.label for c in CASES} | {c.model for c in CASES}
    assert set(EXPECTED_REFUSALS) <= labels


def refuse_after_first_stacked_step(monkeypatch) -> None:
    """torch.func refuses the model once the probe and the first stacked step have run (as it would an operation
    met only later in a run)."""
    from flatfl.models import functional_stack

    real, calls = functional_stack.run_stacked, []

    def refusing(net, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise functional_stack.StackingRefused("torch.func cannot run the model (refused on purpose)")
        return real(net, *args, **kwargs)

    monkeypatch.setattr(functional_stack, "run_stacked", refusing)


@pytest.mark.parametrize("how", ["before training", "while training"])
def test_a_fallback_to_one_at_a_time_fails_the_check(tmp_path, monkeypatch, how):
    """The checker counts a case that trains one client at a time as a failure: a refusal forced before training
    (the model declared unstackable) and one raised by a stacked forward part-way through the first round (torch.func meets an
    operation it cannot run) both make an own network's case fail, with the notice in the report."""
    from flatfl.models import stacking

    case = Combination("own-gelu-layernorm-residual", "man", "fedavg", "sgd")
    if how == "before training":
        monkeypatch.setattr(stacking, "stacking_refusal", lambda model: "refused on purpose")
    else:
        refuse_after_first_stacked_step(monkeypatch)
    failures = check_case(case, tmp_path)
    assert failures and all("fell back to one client at a time" in f and "refused on purpose" in f
                            for f in failures), failures


def test_a_refusal_while_training_is_recorded_in_config_json(tmp_path, monkeypatch):
    """A stacked step refused part-way through a run: config.json's training_path no longer says the clients
    trained together; it says one at a time, why, and from which round."""
    refuse_after_first_stacked_step(monkeypatch)
    case = Combination("own-gelu-layernorm-residual", "none", "fedavg", "sgd")
    cfg = RunConfig(**case_settings(case), parallel_clients="all").validate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(CASE_SEED)
        network = OWN_NETWORKS[case.model]()
    Trainer(cfg, tmp_path / "run", quiet=True, dataset=case_data(OWN_INPUT), model=network).run()
    path = json.loads((tmp_path / "run" / "config.json").read_text())["training_path"]
    assert path["clients_at_once"] == 1 and path["changed_from_round"] == 1, path
    assert "refused on purpose" in path["clients_at_once_why"], path
    from types import SimpleNamespace

    from flatfl.report.layouts import training_path_label

    assert "one client at a time from round 1," in training_path_label([SimpleNamespace(training_path=path)])


def test_the_cases_cover_every_registered_name():
    """Every model, regularizer, algorithm and optimizer of the registries is in some case, and the pairs each case
    holds cover every admitted pair (the covering set is complete)."""
    chosen = pairwise_combinations()
    for i, names in enumerate(factors()):
        assert {c[i] for c in chosen} == set(names)
    assert pairs_held(chosen) >= required_pairs(every_combination())
    assert len(chosen) < len(every_combination()) / 5


def test_an_algorithm_defined_outside_the_package_is_among_the_cases():
    """The outside algorithm is in the registries and in the cases the differential test runs (their ids name it),
    paired with every regularizer and local optimizer a run admits with it."""
    assert "proxstep" in factors()[2]
    ours = [c for c in CASES if c.algo == ProxServerStep.name]
    assert ours and all("-proxstep-" in c.label for c in ours)
    held = pairs_held(CASES)
    for reg in factors()[1]:
        if admitted(Combination("tiny", reg, "proxstep", "sgd")):
            assert ((1, reg), (2, "proxstep")) in held


# ----- the structure: what is hooked -----

def follows_width(m: torch.nn.Module) -> bool:
    """Whether a layer narrows when its network runs at a width below 1 (GradAug's sub-networks, FedAlign's
    student): a slimmable layer with a side that follows the width (a stacked layer of a plain one has none)."""
    if not isinstance(m, Slimmable):
        return False
    flags = [getattr(m, side) for side in ("slim_in", "slim_out", "slim") if hasattr(m, side)]
    return any(flags) if flags else True


def hooked(network: torch.nn.Module) -> dict[str, list[str]]:
    """What the regularizer and the algorithm act on, read off the network itself (not asked of them): the modules
    carrying forward hooks, the residual blocks that drop their branch, the modules that can run at another width."""
    out = {"forward hooks": [], "gated blocks": [], "slimmable": []}
    for name, m in network.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            out["forward hooks"].append(name)
        if getattr(m, "survival", 1.0) < 1.0:
            out["gated blocks"].append(name)
        if follows_width(m):
            out["slimmable"].append(name)
    return out


STRUCTURE_CASES = [(model, reg, algo) for model in model_names() for reg in sorted(REGULARIZERS)
                   for algo in ("fedavg", "moon") if admitted(Combination(model, reg, algo, "sgd"))]


@pytest.mark.parametrize("model,reg,algo", STRUCTURE_CASES, ids=lambda v: str(v))
def test_stacked_network_hooks_the_plain_networks_modules_by_name(tmp_path, model, reg, algo):
    cfg = RunConfig(**settings(model, reg, algo, "sgd"), parallel_clients=3).validate()
    tr = Trainer(cfg, tmp_path, quiet=True, log=lambda s: None, dataset=data(image_size(model)))
    plain, _ = tr.working_network(1)
    stacked, _ = tr.working_network(3)
    assert plain is tr.model and stacked_clients(stacked) == 3
    assert hooked(stacked) == hooked(plain)


# ----- the defects this file was written for, and what a run records -----

class FunctionalNet(torch.nn.Module):
    """A network whose non-linearities are functions in forward: nothing for MAN to hook."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 16)
        self.fc2 = torch.nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc2(torch.nn.functional.relu(self.fc1(x.flatten(1))))


def test_man_on_a_network_with_nothing_to_hook_is_one_named_line(tmp_path):
    cfg = RunConfig(**settings("mlp", "man", "fedavg", "sgd")).validate()
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, tmp_path, quiet=True, log=lambda s: None, dataset=data(8), model=FunctionalNet())
    msg = str(e.value)
    assert "\n" not in msg and "FunctionalNet" in msg and "activation_modules()" in msg and "nn.ReLU()" in msg
    cfg = RunConfig(**settings("mlp", "none", "fedavg", "sgd")).validate()  # the same network trains without MAN
    Trainer(cfg, tmp_path / "none", quiet=True, log=lambda s: None, dataset=data(8), model=FunctionalNet())


@pytest.mark.parametrize("layers", [(torch.nn.Tanh,), (torch.nn.ReLU,)], ids=["tanh", "relu"])
def test_man_on_a_plain_sequential_hooks_the_hidden_activation_only(tmp_path, layers):
    """A Sequential without activation_modules(): MAN hooks the non-linearity before the last Linear, in the plain
    and in the stacked network alike, never the one on the logits."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 12), layers[0](),
                                   torch.nn.Linear(12, CLASSES), layers[0]())

    cfg = RunConfig(**settings("mlp", "man", "fedavg", "sgd"), parallel_clients=3).validate()
    tr = Trainer(cfg, tmp_path, quiet=True, log=lambda s: None, dataset=data(8), model=net())
    assert hooked(tr.working_network(1)[0])["forward hooks"] == ["2"]
    assert hooked(tr.working_network(3)[0])["forward hooks"] == ["2"]


def test_a_last_batch_of_one_on_a_one_by_one_batchnorm_is_refused_before_training(tmp_path):
    """ResNet-18 on 8x8 inputs: its last stage's BatchNorm sees one value per channel of a sample, so a client's
    last batch of one sample cannot train (torch: 'Expected more than 1 value per channel'). Refused with one
    line naming the client and the layer; the same clients with another batch size train."""
    labels = as_image_dataset(data(8)).train_y.numpy()
    sizes = make_partition(labels, CASE_CLIENTS, "fedml-dirichlet", 0.5, CASE_SEED).sizes
    b = next(b for b in range(2, 20) if any(int(n) % b == 1 for n in sizes))
    cfg = RunConfig(**{**settings("resnet18", "none", "fedavg", "sgd"), "batch_size": b}).validate()
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, tmp_path, quiet=True, log=lambda s: None, dataset=data(8))
    assert "\n" not in str(e.value) and "layer4" in str(e.value) and f"--batch-size {b}" in str(e.value)


def test_fashion_mnist_mlp_with_man_one_at_a_time_and_together_agree(tmp_path):
    """The command of the report: Fashion-MNIST, the MLP, MAN, 10 clients, half of them a round, 2 rounds; one client
    at a time and all together agree to float32 rounding (<= 1e-5 relative), and config.json records the path."""
    from click.testing import CliRunner

    from flatfl.checkpoint import load_checkpoint
    from flatfl.cli import main

    if not os.path.isfile("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("Fashion-MNIST is not installed (bash install.sh data)")
    weights = {}
    for parallel in ("1", "all"):
        out = tmp_path / parallel
        res = CliRunner().invoke(main, ["train", "--dataset", "fashion-mnist", "--model", "mlp", "--clients", "10",
                                        "--participation", "0.5", "--rounds", "2", "--local-epochs", "1", "--reg",
                                        "man", "--parallel-clients", parallel, "--out", str(out), "--quiet"])
        assert res.exit_code == 0, res.output
        weights[parallel] = torch.cat([p.detach().flatten() for p in load_checkpoint(out / "final.pt").model.parameters()])
        path = json.loads((out / "config.json").read_text())["training_path"]
        assert path["device"] == "cpu" and path["float32_matmul"] == "full" and path["dtype"] == "float32"
        assert path["clients_at_once"] == (1 if parallel == "1" else 10)
    assert 0 < rel(weights["all"], weights["1"]) <= 1e-5 or torch.equal(weights["all"], weights["1"])


def test_the_report_scale_line_names_the_training_path(tmp_path):
    """config.json records how a run trained; the report's scale line says it (and says when a run has no record)."""
    from flatfl.report.layouts import scale_label
    from flatfl.report.records import load_run

    cfg = RunConfig(**{**settings("mlp", "man", "fedavg", "sgd"), "rounds": 1, "eval_every": 1,
                       "checkpoint_every": 1}, parallel_clients=3, out=str(tmp_path / "run")).validate()
    Trainer(cfg, tmp_path / "run", quiet=True, log=lambda s: None, dataset=data(8)).run()
    path = json.loads((tmp_path / "run" / "config.json").read_text())["training_path"]
    assert path == {"device": "cpu", "clients_at_once": 3, "clients_at_once_why": path["clients_at_once_why"],
                    "float32_matmul": "full", "cuda_graphs": False, "dtype": "float32", "world_size": 1,
                    "backend": None}
    assert scale_label([load_run(tmp_path / "run")]).endswith("; trained on cpu, 3 clients at once, float32 full")
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    del info["training_path"]
    (tmp_path / "run" / "config.json").write_text(json.dumps(info))
    assert scale_label([load_run(tmp_path / "run")]).endswith("; training path not recorded")
