"""Kernels per local step, clients one at a time vs a whole cohort at once: the CPU proxy of GPU step cost.

On a GPU at the MAN paper's model size a local step costs about its number of kernel launches. This script counts
them on any device: every ATen operation dispatched while ``Trainer.run_round`` runs is counted by a
``TorchDispatchMode``, except operations that launch nothing. The rule: an operation is left out when it is a view
(``OpOverload.is_view``: view, reshape of a contiguous tensor, transpose, expand, slice, select, unsqueeze, t,
as_strided, ...) or one of the metadata-only operations in ``METADATA_ONLY`` (detach, alias, lift_fresh, empty
allocations, set_/resize_); every other operation counts as one kernel, including operations on host tensors
(a batch permutation drawn on a CPU generator counts, though on a GPU it would be host work and one copy).

The step cost is the difference of two rounds that differ only in their number of local steps: each client's data
holds two batches, and a round of 2 epochs (4 steps) minus a round of 1 epoch (2 steps), over 2, is the cost of
one step; once per round work (sampling, the start parameters, aggregation) cancels, once per epoch work (the
batch permutation) counts half. Sequential (``--parallel-clients 1``): the round's cost over its clients is the
cost of one client step; batched (``all``): the cost of one cohort step of all the round's clients. Each count is
taken on the second round of a fresh Trainer (the first one builds what is built once).

Host synchronisations: ``aten._local_scalar_dense`` (``.item()``, ``float()``, ``bool()``, ``int()`` of a tensor),
``aten.nonzero``, ``aten.masked_select``, ``aten.unique*`` and ``aten.equal``, counted over the whole 1-epoch round with
the line of flatfl code that asked for each (the innermost frame under flatfl/). A device-to-host copy
(``.cpu()``, ``.tolist()``) cannot be seen on a CPU run.

A network of one's own (:class:`OwnNet`: convolutions, GELU, a LayerNorm residual block, a buffer used in forward),
which channel stacking does not cover, is stacked by torch.func (``flatfl/models/functional_stack.py``); its rows
(``--own``, on by default) print the same kernel counts and the CPU time of a round of all clients at once against
one at a time (the second round of a fresh Trainer, best of 3).

    python benchmarks/step_kernels.py --batch 10             # the table of the README (MAN CIFAR CNN)
    python benchmarks/step_kernels.py --methods FedAvg --ops # and the operations of a step, most frequent first
    python benchmarks/step_kernels.py --methods --batch 10   # the own network's rows only
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402
from flatfl.train.step_graph import SYNCS  # noqa: E402  (operations that make the host wait for the device)
from gpu_round_time import METHODS, RESNET_METHODS, synthetic  # noqa: E402

aten = torch.ops.aten
#: operations that launch no kernel although they are not views
METADATA_ONLY = {aten.detach, aten.alias, aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided,
                 aten.set_, aten.resize_, aten._reshape_alias, aten._unsafe_view, aten.new_empty,
                 aten.new_empty_strided, aten.sym_size, aten.sym_stride, aten.sym_numel,
                 aten.sym_storage_offset, aten.is_same_size, aten._has_compatible_shallow_copy_type,
                 aten.record_stream}
#: regularizers that change the network run on ResNet-20 (slimmable widths, residual blocks), the rest on the MAN CNN
RESNET_REGS = {reg for _, _, reg in RESNET_METHODS}
ROOT = str(Path(__file__).resolve().parents[1] / "flatfl")


class KernelCounter(TorchDispatchMode):
    """Counts the dispatched operations that launch a kernel (see the module docstring), by name, and the host
    synchronisations with the flatfl line that asked for each."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.where = where  # also count operations by (name, the flatfl line that ran them)
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in SYNCS:
            self.syncs[_flatfl_line()] += 1
        if not (func.is_view or packet in METADATA_ONLY):
            name = str(packet).removeprefix("aten.")
            self.ops[name if not self.where else f"{name:<32} {_flatfl_line()}"] += 1
        return func(*args, **(kwargs or {}))


def _flatfl_line() -> str:
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(ROOT):
            return f"{Path(frame.filename).relative_to(Path(ROOT).parent)}:{frame.lineno} {frame.name}"
    return "outside flatfl"


def count_round(make: Callable, epochs: int, where: bool = False) -> KernelCounter:
    """The operations of the first round of a fresh Trainer ``make(epochs)``."""
    tr = make(epochs)
    with KernelCounter(where) as c:
        tr.run_round(0)
    return c


@dataclasses.dataclass
class StepCounts:
    """What :func:`step_counts` measured."""
    per_client_step: float  # kernels of one client step, clients one at a time
    per_cohort_step: float  # kernels of one step of all the round's clients at once
    batched: list[KernelCounter]  # the batched rounds of 1 and 2 epochs
    sequential: list[KernelCounter]  # the same, one client at a time
    step_ops: dict[str, tuple[float, float]]  # operation -> (per cohort step, per client step)

    @property
    def ratio(self) -> float:
        return self.per_cohort_step / self.per_client_step

    def syncs_per_step(self) -> float:
        """Host synchronisations per local step (of the cohort): 0 when none is inside the step loop."""
        return (sum(self.batched[1].syncs.values()) - sum(self.batched[0].syncs.values())) / 2


def step_counts(make: Callable, clients: int, where: bool = False) -> StepCounts:
    """Count the rounds of ``make(epochs, parallel)`` (a fresh Trainer whose every client holds two batches, all
    ``clients`` taking part) for 1 and 2 epochs, one at a time and all at once: see the module docstring."""
    seq = [count_round(lambda e: make(e, 1), e, where) for e in (1, 2)]
    bat = [count_round(lambda e: make(e, "all"), e, where) for e in (1, 2)]
    per_client = (seq[1].kernels - seq[0].kernels) / 2 / clients
    per_cohort = (bat[1].kernels - bat[0].kernels) / 2
    step_ops = {k: ((bat[1].ops[k] - bat[0].ops[k]) / 2, (seq[1].ops[k] - seq[0].ops[k]) / 2 / clients)
                for k in bat[1].ops | bat[0].ops | seq[1].ops | seq[0].ops}
    return StepCounts(per_client, per_cohort, bat, seq, step_ops)


class OwnNet(torch.nn.Module):
    """A user's network of classes flatfl does not channel-stack: convolutions with GELU, a pre-norm residual block
    (LayerNorm, Linear, GELU), SiLU and a fixed per-channel gain buffer read in forward."""

    def __init__(self, classes: int = 100):
        super().__init__()
        nn = torch.nn
        self.conv1, self.conv2 = nn.Conv2d(3, 32, 5), nn.Conv2d(32, 64, 5)
        self.act1, self.act2, self.pool = nn.GELU(), nn.GELU(), nn.MaxPool2d(2)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 64))
        self.inp, self.act3 = nn.Linear(64 * 5 * 5, 256), nn.SiLU()
        self.norm, self.mix, self.act4 = nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU()
        self.hidden, self.act = nn.Linear(256, 128), nn.GELU()
        self.classifier = nn.Linear(128, classes)

    def forward(self, x):
        h = self.pool(self.act1(self.conv1(x)))
        h = self.pool(self.act2(self.conv2(h))) * self.gain.view(-1, 1, 1)
        h = self.act3(self.inp(h.flatten(1)))
        h = h + self.act4(self.mix(self.norm(h)))
        return self.classifier(self.act(self.hidden(h)))


def round_seconds(make: Callable, repeats: int = 3) -> float:
    """CPU seconds of the second round of a fresh Trainer ``make()`` (the first builds what is built once), best of
    ``repeats``."""
    import time

    best = float("inf")
    for _ in range(repeats):
        tr = make()
        tr.run_round(0)
        t0 = time.perf_counter()
        tr.run_round(1)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="*", default=[m[0] for m in METHODS + RESNET_METHODS])
    ap.add_argument("--clients", type=int, default=10, help="clients a round (all of them take part)")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--own", action=argparse.BooleanOptionalAction, default=True,
                    help="the rows of a network of one's own, stacked by torch.func (--no-own: none)")
    ap.add_argument("--ops", action="store_true", help="print the operations of one cohort step and of one client "
                    "step, by the flatfl line that ran them")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    ds = synthetic(args.clients, 2 * args.batch, 100)

    def maker(algo: str, reg: str, own: bool = False, network: bool = False):
        def make(epochs: int, parallel) -> Trainer:
            model = "resnet20" if reg in RESNET_REGS else "cifar-cnn"
            net = None
            if network:
                torch.manual_seed(0)
                net = OwnNet()
            cfg = RunConfig(dataset="digits", model=model, partition="iid", clients=args.clients, participation=1.0,
                            sampling="fraction", rounds=10_000, local_epochs=epochs,
                            batch_size=args.batch, lr=0.1, weight_decay=1e-3, clip=10.0, algo=algo, reg=reg,
                            eval_every=10_000, checkpoint_every=10_000, seed=0, device="cpu",
                            parallel_clients=parallel).validate()
            tr = Trainer(cfg, tmp / f"{algo}-{reg}-{epochs}-{parallel}-{network}", quiet=True, log=lambda s: None,
                         dataset=TensorDataset(ds.train_x, ds.train_y) if own else ds,
                         test_dataset=TensorDataset(ds.test_x, ds.test_y) if own else None, model=net)
            if network and parallel != 1:
                assert tr.parallel == args.clients, tr.parallel_reason  # trained together, not a fallback
            return tr
        return make

    print(f"torch {torch.__version__}; MAN CIFAR CNN (ResNet-20 for FedAlign, GradAug, StochDepth), {args.clients} "
          f"clients a round of {2 * args.batch} images, batch {args.batch} (2 local steps an epoch); kernels = "
          f"dispatched ATen operations less views and metadata-only ones")
    rows = [(label, algo, reg, False) for label, algo, reg in METHODS + RESNET_METHODS if label in args.methods]
    if "FedAvg" in args.methods:
        rows.append(("FedAvg, own data", "fedavg", "none", True))  # a TensorDataset: the README's own-data path
    print(f"{'method':<18} {'kernels/client step (1 at a time)':>34} {'kernels/cohort step':>20} "
          f"{'cohort/one':>11} {'host syncs/round (batched)':>27} {'(1 at a time)':>14}")
    details = []
    for label, algo, reg, own in rows:
        c = step_counts(maker(algo, reg, own), args.clients, args.ops)
        inside = c.syncs_per_step()
        print(f"{label:<18} {c.per_client_step:>34.1f} {c.per_cohort_step:>20.1f} {c.ratio:>10.2f}x "
              f"{sum(c.batched[0].syncs.values()):>27} {sum(c.sequential[0].syncs.values()):>14}"
              + (f"  ({inside:g} a step inside the step loop)" if inside else ""), flush=True)
        details.append((label, c.batched[0], c.step_ops))
    if args.own:
        print(f"\nnetwork of one's own (OwnNet: conv + GELU, LayerNorm residual, buffer in forward), stacked by "
              f"torch.func; goal <= 1.3x kernels")
        print(f"{'method':<18} {'kernels/client step (1 at a time)':>34} {'kernels/cohort step':>20} "
              f"{'cohort/one':>11} {'CPU s/round 1 at a time':>24} {'all at once':>12} {'ratio':>7}")
        for label, algo, reg in (("own, FedAvg", "fedavg", "none"), ("own, MAN", "fedavg", "man"),
                                 ("own, FedDyn+MAN", "feddyn", "man")):
            make = maker(algo, reg, network=True)
            c = step_counts(make, args.clients, args.ops)
            one, together = (round_seconds(lambda p=p: make(1, p)) for p in (1, "all"))
            print(f"{label:<18} {c.per_client_step:>34.1f} {c.per_cohort_step:>20.1f} {c.ratio:>10.2f}x "
                  f"{one:>24.3f} {together:>12.3f} {together / one:>6.2f}x", flush=True)
            details.append((label, c.batched[0], c.step_ops))
    print("\nhost syncs of one batched round, by the flatfl line that asked:")
    for label, bat, _ in details:
        where = ", ".join(f"{line} x{n}" for line, n in bat.syncs.most_common())
        print(f"  {label}: {where or 'none'}")
    if args.ops:
        for label, _, step_ops in details:
            print(f"\noperations of one cohort step and of one client step (1 at a time), {label}:")
            for name, (n, n1) in sorted(step_ops.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
                if n or n1:
                    print(f"  {n:>6g} {n1:>6g}  {name}")


if __name__ == "__main__":
    main()
