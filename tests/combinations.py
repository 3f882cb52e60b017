"""Test support (not part of the package): every combination of model, regularizer, algorithm and local optimizer
that a run admits, read off the registries (the pieces of the package and any registered from outside it), and a
small set of them that holds every admitted pair: what the differential tests of the fast paths run over
(``tests/test_every_path.py``, ``benchmarks/cuda_equivalence.py``), so a model or method registered later is covered
without editing them; and one small run of a combination (:func:`train_case`) with the comparison of two such runs
(:func:`differences`).

A combination is admitted when its settings validate (:meth:`RunConfig.validate`: an algorithm that fixes its own
optimizer refuses another) and the regularizer accepts the model as the algorithm shapes it (built, wrapped,
prepared and attached as a run does it, without training: GradAug needs a slimmable network, StochDepth residual
blocks). A refusal is always one :class:`ConfigError` line.

The cases train flatfl's ResNets at slim widths of the same structure (:data:`CASE_MODEL_ARGS`); which pairs a
covering set must hold, and its greedy choice, are read off the networks at their registry defaults (ResNet-18 stays
the large model), while admission is decided on the networks as the cases build them. :func:`check_case` is the
differential check itself (what ``tests/test_every_path.py`` asserts, and ``benchmarks/differential_breaks.py``
runs on deliberately broken code).
"""
from __future__ import annotations

import copy
import functools
import itertools
from typing import NamedTuple

import torch
from torch import nn

from flatfl.errors import ConfigError
from flatfl.models import build_model, model_names
from flatfl.train.algorithms.algorithm import Algorithm
from flatfl.train.catalog import load_all
from flatfl.train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from flatfl.train.config import RunConfig

__all__ = ["Combination", "factors", "admitted", "every_combination", "pairwise_combinations", "pairs_held", "required_pairs", "large_model",
           "smallest_input", "case_data", "case_settings", "train_case", "differences",
           "step_graph_combinations", "step_graph_settings", "OWN_NETWORKS", "own_combinations",
           "EXPECTED_REFUSALS", "expected_refusal", "case_cohorts", "OWN_CASES", "CASE_MODEL_ARGS",
           "case_model_args", "CASE_RTOL", "together_runs", "check_case"]


class Combination(NamedTuple):
    model: str
    reg: str
    algo: str
    opt: str

    @property
    def label(self) -> str:
        return "-".join(self)


def factors() -> tuple[list[str], list[str], list[str], list[str]]:
    """The registered names: models, regularizers, algorithms, local optimizers (each sorted)."""
    load_all()
    return model_names(), sorted(REGULARIZERS), sorted(ALGORITHMS), sorted(LOCAL_OPTIMIZERS)


@functools.lru_cache(maxsize=None)
def smallest_input(model: str, num_classes: int = 4, in_channels: int = 1) -> int:
    """The smallest square input side, from 8 up in steps of 4, that ``model`` takes (found by building it)."""
    for size in range(8, 129, 4):
        try:
            with torch.random.fork_rng(devices=[]):
                build_model(model, num_classes=num_classes, in_channels=in_channels, image_size=size)
            return size
        except ConfigError:
            continue
    raise ConfigError(f"model {model} takes no square input from 8 to 128 pixels")


#: the model arguments the differential cases build a registry model with (:func:`case_settings`'s ``model_args``):
#: flatfl's ResNets at slim widths of the same structure - blocks per stage, basic or bottleneck blocks, BatchNorm,
#: stride-2 stages with 1x1 projection shortcuts (the width also changes from the first stage to the second), the stem
#: at the first stage's width - so that a case costs what its pieces cost, not what 64-512 channels cost (ResNet-18:
#: 11.2M parameters at its defaults, 7.7k slim), and the EMNIST and FL-SAM CNNs at 4 and 8 channels and 16 hidden
#: units (6.6M and 2.16M parameters at their defaults). GradAug's and FedAlign's narrowest widths (0.8 and 0.25 of a layer) still keep >= 1
#: channel of every layer (ceil(w * C)).
CASE_MODEL_ARGS = {"resnet18": {"widths": [4, 8, 8, 8]}, "resnet20": {"widths": [4, 8, 8]},
                   "resnet56": {"widths": [4, 8, 8]}, "flsam-cnn": {"channels": [4, 8], "hidden": 16},
                   "emnist-cnn": {"channels": [4, 8], "hidden": 16}}


def case_model_args(model: str) -> dict:
    """The ``model_args`` a differential case builds ``model`` with (:data:`CASE_MODEL_ARGS`; {} for the others)."""
    return copy.deepcopy(CASE_MODEL_ARGS.get(model, {}))


@functools.lru_cache(maxsize=None)
def _plain(model: str, num_classes: int) -> torch.nn.Module:
    """The model at its registry defaults (what the covering set's costs and large models are read off)."""
    with torch.random.fork_rng(devices=[]):
        return build_model(model, num_classes=num_classes, in_channels=1, image_size=smallest_input(model, num_classes))


@functools.lru_cache(maxsize=None)
def _as_cased(model: str, num_classes: int) -> torch.nn.Module:
    """The model as the differential cases build it (:func:`case_model_args`): what admission is decided on."""
    args = case_model_args(model)
    if not args:
        return _plain(model, num_classes)
    with torch.random.fork_rng(devices=[]):
        return build_model(model, num_classes=num_classes, in_channels=1,
                           image_size=smallest_input(model, num_classes), **args)


@functools.lru_cache(maxsize=None)
def _settings_admit(algo: str, reg: str, opt: str) -> bool:
    try:
        RunConfig(algo=algo, reg=reg, local_opt=opt).validate()
    except ConfigError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _model_admits(model: str, reg: str, wrapping_algo: str | None, num_classes: int) -> bool:
    reg_cls = REGULARIZERS.get_class(reg)
    try:
        with torch.random.fork_rng(devices=[]):
            net = copy.deepcopy(_as_cased(model, num_classes))
            if wrapping_algo is not None:
                algo_cls = ALGORITHMS.get_class(wrapping_algo)
                net = algo_cls.wrap_model(net, algo_cls.resolve({}))
            hp = reg_cls.resolve({})
            net = reg_cls.prepare_model(net, hp)
            reg_cls(hp, num_classes=num_classes).attach(net)
    except ConfigError:
        return False
    return True


def admitted(c: Combination, num_classes: int = 4) -> bool:
    """Whether a run admits the combination (module docstring)."""
    load_all()
    if not _settings_admit(c.algo, c.reg, c.opt):
        return False
    algo_cls = ALGORITHMS.get_class(c.algo)
    wraps = algo_cls.wrap_model.__func__ is not Algorithm.wrap_model.__func__  # MOON's head changes the network
    return _model_admits(c.model, c.reg, c.algo if wraps else None, num_classes)


def every_combination() -> list[Combination]:
    """Every admitted combination, in sorted order."""
    return [c for c in map(Combination._make, itertools.product(*factors())) if admitted(c)]


def _pairs(c: Combination) -> set:
    return {((i, c[i]), (j, c[j])) for i, j in itertools.combinations(range(4), 2)}


def _cost(model: str) -> int:
    net = _plain(model, 4)
    return sum(p.numel() for p in net.parameters()) * (1 + sum(1 for _ in net.modules()))


#: models above this many parameters (at their smallest input) are paired with every regularizer, not with every
#: algorithm and optimizer: an algorithm or an optimizer acts on the flat parameter rows whatever network holds
#: them, and those pairs are held by the smaller models of the same classes (ResNet-18 is a ResNet as ResNet-20 is)
LARGE_MODEL_PARAMETERS = 1_000_000


def _parameters(model: str) -> int:
    return sum(p.numel() for p in _plain(model, 4).parameters())


def large_model(model: str) -> bool:
    """Whether the model has over :data:`LARGE_MODEL_PARAMETERS` parameters at its smallest input."""
    return _parameters(model) > LARGE_MODEL_PARAMETERS


def required_pairs(everything: list[Combination]) -> set:
    """The pairs a covering set must hold: every pair some admitted combination holds, except those of a
    :func:`large_model` with an algorithm or an optimizer."""
    large = {m for m in factors()[0] if large_model(m)}
    pairs = set().union(*(_pairs(c) for c in everything))
    return {p for p in pairs if not (p[0][0] == 0 and p[0][1] in large and p[1][0] in (2, 3))}


def _plain_sgd(c: Combination) -> bool:
    """Whether the combination's local steps are plain SGD steps (an algorithm may fix its own optimizer)."""
    return ALGORITHMS.get_class(c.algo).local_optimizer(c.opt) == "sgd"


def pairwise_combinations() -> list[Combination]:
    """A set of admitted combinations holding every :func:`required_pairs` pair: (model, regularizer), (model,
    algorithm), ..., (algorithm, optimizer). Greedy: each next combination the one holding the most pairs not yet
    held, ties to the cheaper model (parameters x modules), then to plain SGD (one pass a step, where SAM and ASAM
    take two), then to the first in sorted order; deterministic."""
    everything = every_combination()
    uncovered = required_pairs(everything)
    cost = {m: _cost(m) for m in factors()[0]}
    chosen = []
    while uncovered:
        best = max(everything, key=lambda c: (len(_pairs(c) & uncovered), -cost[c.model], _plain_sgd(c)))
        chosen.append(best)
        uncovered -= _pairs(best)
    return sorted(chosen)


def step_graph_combinations() -> list[Combination]:
    """The combinations the differential test of replayed steps (``--cuda-graphs``) runs, one factor varied at a
    time: every algorithm with no regularizer and with MAN, every local optimizer with FedAvg + MAN, on the cheapest
    model without batch statistics; every regularizer with FedAvg and plain SGD, and every model that is not a
    :func:`large_model` with FedAvg + MAN (no regularizer where MAN refuses it), on the cheapest model that admits
    it. A replayed step runs the eager step's operations on the same tensors whatever the factors, so what can
    differ is what each piece does at a step, and each piece is in some case."""
    models, regs, algos, opts = factors()
    by_cost = sorted(models, key=_cost)
    base = next(m for m in by_cost if not batch_statistics(m))
    out = [Combination(base, reg, algo, "sgd") for algo in algos for reg in ("none", "man")]
    out += [Combination(base, "man", "fedavg", opt) for opt in opts]
    for reg in regs:
        out += [next((c for c in (Combination(m, reg, "fedavg", "sgd") for m in by_cost) if admitted(c)), None)]
    for m in by_cost:
        if not large_model(m):
            out += [next((c for c in (Combination(m, r, "fedavg", "sgd") for r in ("man", "none")) if admitted(c)),
                         None)]
    return sorted({c for c in out if c is not None and admitted(c)})


def step_graph_settings(c: Combination) -> dict:
    """The settings of a replayed-steps case: :func:`case_settings`, with every client in every round, equal shares
    of the data (IID) and two epochs of batches of 4 for every network, so that a cohort takes full steps
    (captured and replayed) and partial ones (eager) in turn. (A replay runs the eager step's operations, so the
    two agree exactly, and the amplification of rounding by BatchNorm on small batches, see :func:`case_settings`,
    does not arise.)"""
    return dict(case_settings(c), partition="iid", participation=1.0, local_epochs=2, batch_size=4, rounds=2,
                seed=11, eval_every=2, checkpoint_every=2)


def case_cohorts() -> list[int]:
    """How many clients take part in each round of a differential case (:func:`case_settings`)."""
    from flatfl.train.rounds import sample_clients

    return [len(sample_clients(CASE_SEED, r, CASE_CLIENTS, 0.5, "bernoulli")) for r in range(CASE_ROUNDS)]


def pairs_held(combinations) -> set:
    """Every pair of factor values the combinations hold (for checking a covering set)."""
    return set().union(*(_pairs(Combination._make(c)) for c in combinations))


# ----- one small run of a combination, for differential checks -----

CASE_CLASSES = 4
CASE_CLIENTS = 5
#: 3 rounds whose Bernoulli(0.5) cohorts (seed 25) are all 5 clients, then 3 of them (an odd size, a cohort of
#: another size stacked after the first round), then one (plain): :func:`case_cohorts`
CASE_ROUNDS = 3
CASE_SEED = 25
#: networks deep enough with batch statistics that rounding differences of the two paths (float64, orders of
#: 1e-16; GradAug's canvas agrees to about 1e-11) grow past the 1e-9 tolerance after the first round (ResNet-56 at
#: its default widths: 2.2e-9 after two rounds, 5.5e-7 after three on FedSMOO+GradAug's client state; at the cases'
#: slim widths, GradAug+FedDyn's client state: 5.1e-12 after one round, 6.3e-10 after two, 7.5e-8 after three, and
#: FedAlign+FedSMOO's 1.5e-8 after three): their cases train the first round, a full cohort, only; the other
#: networks' cases stack the cohorts of other sizes
DEEP_BATCH_NORM = ("resnet56",)


@functools.lru_cache(maxsize=None)
def case_data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """72 grey uint8 images of ``size`` x ``size`` in CASE_CLASSES classes (standardised by the dataset as real
    images are), each class a different mean brightness so that training moves the weights; drawn from a generator
    seeded with ``size``."""
    g = torch.Generator().manual_seed(size)
    y = torch.arange(72) % CASE_CLASSES
    x = torch.randint(0, 128, (72, 1, size, size), generator=g) + (y * 40).view(-1, 1, 1, 1)
    return x.to(torch.uint8), y


@functools.lru_cache(maxsize=None)
def _client_sizes(size: int) -> tuple[int, ...]:
    from flatfl.data.datasets import as_image_dataset
    from flatfl.data.partition import make_partition

    labels = as_image_dataset(case_data(size)).train_y.numpy()
    return tuple(int(n) for n in make_partition(labels, CASE_CLIENTS, "fedml-dirichlet", 0.5, CASE_SEED).sizes)


def batch_statistics(model: str) -> bool:
    """Whether the model normalises with batch statistics (BatchNorm) when it trains."""
    from flatfl.train.engine import BATCH_NORMS

    return any(isinstance(m, BATCH_NORMS) for m in _as_cased(model, CASE_CLASSES).modules())


def case_settings(c: Combination) -> dict:
    """The run settings of a combination's differential case: 5 clients of unequal sizes (Dirichlet 0.5), each
    joining a round with probability 0.5, 3 rounds whose cohorts are all 5, then 3, then 1 client
    (:func:`case_cohorts`), momentum, learning rate 0.01. An own network (:data:`OWN_NETWORKS`) takes 8 x 8 images;
    flatfl's ResNets are built slim (:data:`CASE_MODEL_ARGS`).

    The batches: without batch statistics, batches of 4, so that clients take unequal numbers of steps and the
    last batches are of several sizes (steps that only some clients of a cohort take, a batch of one sample).
    With BatchNorm, each client's data is one batch (one step a round; clients of different sizes still step in
    separate groups): a deep BatchNorm network on a few samples amplifies rounding (a relative change of 1e-15 in
    its initial weights grows past 1e-2 in a few steps), and one step a round keeps that amplification below the
    tolerance while every piece of the step still runs; the deepest such networks (:data:`DEEP_BATCH_NORM`) train
    the first round only."""
    own = c.model in OWN_NETWORKS
    size = OWN_INPUT if own else smallest_input(c.model, CASE_CLASSES)
    sizes = _client_sizes(size)
    batch = max(sizes) if (c.model in OWN_BATCH_NORMS if own else batch_statistics(c.model)) else 4
    rounds = 1 if c.model in DEEP_BATCH_NORM else CASE_ROUNDS
    return dict(model="mlp" if own else c.model, model_args={} if own else case_model_args(c.model), reg=c.reg,
                algo=c.algo, local_opt=c.opt, clients=CASE_CLIENTS, participation=0.5,
                sampling="bernoulli", partition="fedml-dirichlet", alpha=0.5, rounds=rounds, local_epochs=1,
                batch_size=batch, lr=0.01, momentum=0.5, seed=CASE_SEED, eval_every=rounds, checkpoint_every=rounds,
                precision=str(torch.get_default_dtype()).replace("torch.", ""))  # the type the test computes in


def train_case(c: Combination, run_dir, parallel, *, device: str = "cpu", dtype: torch.dtype = torch.float64,
               log=lambda s: None, settings=case_settings, cuda_graphs: bool = False):
    """The combination's differential case (``settings(c)``: :func:`case_settings`, or
    :func:`step_graph_settings`) trained for its rounds with ``parallel`` clients at once on ``device``, in
    ``dtype`` (torch's default floating type is set around the run, so the model is built in it), its steps
    replayed as graphs with ``cuda_graphs``; returns the :class:`~flatfl.train.engine.Trainer` (``theta``,
    ``latest``, ``buffers``, ``algo`` state). Writes no files."""
    from flatfl.train.engine import Trainer

    cfg = RunConfig(**dict(settings(c), precision=str(dtype).replace("torch.", "")), parallel_clients=parallel,
                    device=device, cuda_graphs=cuda_graphs).validate()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        own = c.model in OWN_NETWORKS
        network = None
        if own:  # the user's own network, built in the run's floating type from the case's seed
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(CASE_SEED)
                network = OWN_NETWORKS[c.model]()
        size = OWN_INPUT if own else smallest_input(c.model, CASE_CLASSES)
        tr = Trainer(cfg, run_dir, quiet=True, log=log, dataset=case_data(size), model=network)
        for r in range(cfg.rounds):
            tr.run_round(r)
    finally:
        torch.set_default_dtype(old)
    return tr


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu(), b.detach().cpu()
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


def differences(reference, other) -> dict[str, float]:
    """Each quantity two trained cases hold, as the largest difference relative to the reference's largest value:
    the server weights, every client's latest model, the float buffers (server and clients') and the algorithm's
    server and client state. A state only one of them holds is an infinite difference."""
    out = {"server weights": _relative(other.theta, reference.theta),
           "clients' latest models": _relative(other.latest, reference.latest)}
    for kind, mine, theirs in (("buffer", reference.buffers, other.buffers),
                               ("clients' buffer", reference.latest_buffers, other.latest_buffers),
                               ("server state", reference.algo.server, other.algo.server),
                               ("client state", reference.algo.clients, other.algo.clients)):
        for name in sorted(set(mine) | set(theirs)):
            both = name in mine and name in theirs
            out[f"{kind} {name}"] = _relative(theirs[name], mine[name]) if both else float("inf")
    return out


#: how far, relative, a quantity of a case trained together may be from one at a time (float64)
CASE_RTOL = 1e-9


def together_runs(case: Combination) -> tuple:
    """The N each case trains with besides N = 1: all of a round's clients (cohorts of 5, then 3, then 1); for the
    own networks with FedDyn also 2 at a time (a round's clients in several cohorts, one of them of one client)."""
    return ("all", 2) if case.model in OWN_NETWORKS and case.algo == "feddyn" else ("all",)


def check_case(case: Combination, where) -> list[str]:
    """What is wrong with ``case`` trained together against one at a time (empty: nothing): a quantity off by more
    than :data:`CASE_RTOL` relative, or a run that trained one client at a time although the case is not listed as
    expected to be refused (:data:`EXPECTED_REFUSALS`), or one listed so that trained together. ``where``: a
    folder (a :class:`pathlib.Path`) the runs may use. Raises ConfigError when the case is refused before
    training."""
    one = train_case(case, where / "one", 1)
    assert one.theta.dtype == torch.float64 and one.parallel == 1
    expected = expected_refusal(case)
    failures = []
    for parallel in together_runs(case):
        said = []
        other = train_case(case, where / str(parallel), parallel, log=said.append)
        if other.parallel == 1:  # refused: one notice; a failure unless the case is listed with its reason
            notice = [line for line in said if "one client at a time" in line]
            if expected is None:
                failures.append(f"N={parallel} fell back to one client at a time: {said}")
            elif len(notice) != 1 or expected[0] not in notice[0]:
                failures.append(f"N={parallel}: expected one notice naming {expected[0]!r}, got {said}")
            continue
        if expected is not None:
            failures.append(f"N={parallel} trained together, but the case is listed as refused: {expected[1]}")
        off = {k: v for k, v in differences(one, other).items() if not v <= CASE_RTOL}
        if off:
            failures.append(f"N={parallel} vs N=1: {off}")
    return failures


# ----- networks of one's own (a user's nn.Module), stacked by torch.func where channel stacking does not apply -----

OWN_INPUT = 8  # the own networks take 1 x 8 x 8 images (64 inputs)
HIDDEN = 12


class _Own(nn.Module):
    """A user's network with the flatfl model interface (features, classifier, feature_dim), so that MOON's
    projection head and FedAlign's final block (the last hidden Linear and non-linearity feeding the classifier)
    compose with it."""

    feature_dim = HIDDEN

    def forward(self, x):
        return self.classifier(self.features(x))


class GeluLayerNormResidual(_Own):
    """GELU activations and a pre-norm residual block (LayerNorm, Linear, GELU)."""

    def __init__(self):
        super().__init__()
        self.inp, self.act0 = nn.Linear(64, HIDDEN), nn.GELU()
        self.norm, self.mix, self.act1 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU()
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.GELU()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        h = self.act0(self.inp(x.flatten(1)))
        h = h + self.act1(self.mix(self.norm(h)))
        return self.act(self.hidden(h))


class SiluConvBuffer(_Own):
    """SiLU after a convolution, scaled by a buffer the forward reads (a fixed per-channel gain)."""

    def __init__(self):
        super().__init__()
        self.conv, self.act0 = nn.Conv2d(1, 3, 3, padding=1), nn.SiLU()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 3).view(3, 1, 1))
        self.hidden, self.act = nn.Linear(48, HIDDEN), nn.SiLU()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        h = torch.nn.functional.avg_pool2d(self.act0(self.conv(x)) * self.gain, 2)
        return self.act(self.hidden(h.flatten(1)))


class TiedWeight(_Own):
    """One weight shared by two layers (``mix.weight is hidden.weight``)."""

    def __init__(self):
        super().__init__()
        self.inp, self.act0 = nn.Linear(64, HIDDEN), nn.Tanh()
        self.mix, self.act1 = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Tanh()
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.SiLU()
        self.mix.weight = self.hidden.weight
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        h = self.act0(self.inp(x.flatten(1)))
        h = h + self.act1(self.mix(h))
        return self.act(self.hidden(h))


class ModuleReused(_Own):
    """One Linear (and its activation) applied twice."""

    def __init__(self):
        super().__init__()
        self.inp, self.act0 = nn.Linear(64, HIDDEN), nn.ReLU()
        self.twice, self.act1 = nn.Linear(HIDDEN, HIDDEN), nn.Tanh()
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.ReLU()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        h = self.act0(self.inp(x.flatten(1)))
        h = self.act1(self.twice(self.act1(self.twice(h))))
        return self.act(self.hidden(h))


class FrozenLayer(_Own):
    """A first layer that does not train (requires_grad False), GELU after it."""

    def __init__(self):
        super().__init__()
        self.inp, self.act0 = nn.Linear(64, HIDDEN), nn.GELU()
        self.inp.requires_grad_(False)
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.ReLU()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        return self.act(self.hidden(self.act0(self.inp(x.flatten(1)))))


class MomentumNone(_Own):
    """BatchNorm1d(momentum=None): running statistics as the cumulative average over num_batches_tracked."""

    def __init__(self):
        super().__init__()
        self.inp, self.bn, self.act0 = nn.Linear(64, HIDDEN), nn.BatchNorm1d(HIDDEN, momentum=None), nn.ReLU()
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.ReLU()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def features(self, x):
        return self.act(self.hidden(self.act0(self.bn(self.inp(x.flatten(1))))))


class EmaReassigned(_Own):
    """A hand-written running statistic the forward assigns anew in training (``self.ema = 0.9 * self.ema + ...``,
    a new tensor each step), subtracted from the hidden activation."""

    def __init__(self):
        super().__init__()
        self.inp, self.act0 = nn.Linear(64, HIDDEN), nn.Tanh()
        self.register_buffer("ema", torch.zeros(HIDDEN))
        self.hidden, self.act = nn.Linear(HIDDEN, HIDDEN), nn.Tanh()
        self.classifier = nn.Linear(HIDDEN, CASE_CLASSES)

    def update(self, h: torch.Tensor) -> None:
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)

    def features(self, x):
        h = self.act0(self.inp(x.flatten(1)))
        if self.training:
            self.update(h)
        return self.act(self.hidden(h - self.ema))


class EmaInPlace(EmaReassigned):
    """The same running statistic written in place (``self.ema.mul_(0.9).add_(...)``)."""

    def update(self, h: torch.Tensor) -> None:
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))


def sequential_reused() -> nn.Module:
    """nn.Sequential using one Linear twice (flatfl's own layer types: channel stacking would apply but for the
    second use)."""
    twice = nn.Linear(HIDDEN, HIDDEN)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), twice, nn.ReLU(), twice, nn.ReLU(),
                         nn.Linear(HIDDEN, CASE_CLASSES))


def sequential_frozen() -> nn.Module:
    """nn.Sequential of flatfl's layer types (channel-stacked) with a frozen first layer."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, CASE_CLASSES))
    net[1].requires_grad_(False)
    return net


#: the own networks the differential test trains, by the name its cases give them
OWN_NETWORKS = {"own-gelu-layernorm-residual": GeluLayerNormResidual, "own-silu-conv-buffer": SiluConvBuffer,
                "own-tied-weight": TiedWeight, "own-module-reused": ModuleReused, "own-frozen-layer": FrozenLayer,
                "own-momentum-none": MomentumNone, "own-sequential-reused": sequential_reused,
                "own-sequential-frozen": sequential_frozen, "own-ema-reassigned": EmaReassigned,
                "own-ema-in-place": EmaInPlace}

OWN_BATCH_NORMS = {"own-momentum-none"}  # the own networks with BatchNorm (one step a round, see case_settings)

#: cases whose clients are expected to train one at a time, with the words their notice must hold, and why
EXPECTED_REFUSALS = {
    "own-momentum-none": ("momentum=None", "the cumulative running average counts batches across all clients in "
                          "turn one at a time (num_batches_tracked of one network): no stacked network can count so"),
}


def expected_refusal(c: Combination) -> tuple[str, str] | None:
    """(words of the notice, reason) when the case is expected to train one client at a time, else None."""
    return EXPECTED_REFUSALS.get(c.label) or EXPECTED_REFUSALS.get(c.model)


#: the own networks' cases (network -> (regularizer, algorithm) pairs): MAN and FedDyn + MAN, FedAlign and MOON
#: with the two networks of the issue; the other shapes with FedDyn + MAN (MAN's hooks, FedDyn's per-client state)
#: and FedAlign or MOON where they compose (features, a classifier fed by the last hidden Linear and non-linearity)
OWN_CASES = {
    "own-gelu-layernorm-residual": (("man", "fedavg"), ("man", "feddyn"), ("fedalign", "fedavg"), ("none", "moon")),
    "own-silu-conv-buffer": (("man", "fedavg"), ("man", "feddyn"), ("fedalign", "fedavg"), ("none", "moon")),
    "own-tied-weight": (("man", "feddyn"), ("fedalign", "fedavg")),
    "own-module-reused": (("man", "feddyn"), ("none", "moon")),
    "own-frozen-layer": (("man", "feddyn"),),
    "own-momentum-none": (("man", "fedavg"),),
    "own-sequential-reused": (("man", "fedavg"),),
    "own-sequential-frozen": (("man", "feddyn"),),
    "own-ema-reassigned": (("none", "fedavg"), ("man", "feddyn")),
    "own-ema-in-place": (("none", "fedavg"), ("man", "feddyn")),
}


def own_combinations() -> list[Combination]:
    """The own networks' cases (:data:`OWN_CASES`), with plain SGD."""
    return [Combination(name, reg, algo, "sgd") for name, pairs in OWN_CASES.items() for reg, algo in pairs]
