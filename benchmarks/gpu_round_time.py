"""Seconds per round at the MAN paper's shape: clients trained one at a time vs together vs a bare loop, one run.

The shape of issue 13 (MAN's CIFAR-100 runs): the MAN CIFAR CNN, CIFAR-100-shaped data (random pixels, 100
classes, 500 images a client), 100 clients, 10 a round, 5 local epochs of batch 50, lr 0.1. For each method the
engine's real round (``Trainer.run_round``: sampling, per-client data, the pieces, aggregation; no evaluation, no
files) is timed with ``--parallel-clients 1`` (sequential) and ``all`` (batched), rounds alternating between the
two, after a warm-up round each, with CUDA synchronisation; the bare loop is the textbook eager PyTorch loop over
the same clients, steps and batch size (FedAvg's work, one client after the other). Medians are printed, with
each method's ratio to FedAvg in the same mode and batched / sequential speed-ups. With ``--cuda-graphs`` a third
mode is timed in the same alternation: batched with the cohort's full steps replayed as CUDA graphs (a line says
why a method's steps run eagerly, when they do); the targets are then judged on it.

    python benchmarks/gpu_round_time.py --device cuda --cuda-graphs   # the paper shape (GPU), graphs too
    python benchmarks/gpu_round_time.py --device cpu --small     # a tiny smoke run of the same code
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flatfl.data.datasets import ImageDataset  # noqa: E402
from flatfl.models import build_model  # noqa: E402
from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402
from train_throughput import bare_local_training  # noqa: E402

METHODS = [  # (label, algo, reg)
    ("FedAvg", "fedavg", "none"),
    ("FedAvg + MAN", "fedavg", "man"),
    ("FedDyn + MAN", "feddyn", "man"),
    ("FedSAM", "fedsam", "none"),
    ("FedSpeed + MAN", "fedspeed", "man"),
    ("FedAvg + ASD", "fedavg", "asd"),
]
#: the regularizers that change the network, on ResNet-20 (slimmable widths, residual blocks): run when named in
#: ``--methods``; their "x FedAvg" columns are left empty (FedAvg's row is the CNN)
RESNET_METHODS = [("FedAlign", "fedavg", "fedalign"), ("GradAug", "fedavg", "gradaug"),
                  ("StochDepth", "fedavg", "stochdepth")]


def synthetic(clients: int, per_client: int, classes: int, seed: int = 0) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    n = clients * per_client
    x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, classes, (n,), generator=g)
    return ImageDataset("cifar100-shaped", x, y, x[:100], y[:100], classes, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


PAPER_SHAPE = (100, 10, 500, 5, 50, 100)  # clients, per round, images a client, local epochs, batch, classes
SMALL_SHAPE = (20, 4, 40, 1, 20, 10)


def measure(device: str, *, rounds: int = 5, small: bool = False, methods=None, cuda_graphs: bool = False,
            tmp: Path | None = None, log=print, shape: tuple | None = None) -> dict:
    """Times the rounds (see the module docstring) and returns the figures as data: ``name`` (the device),
    ``shape`` (clients, per round, images a client, local epochs, batch, classes), ``rounds``, ``small``, ``bare``
    (the bare loop's median s/round) and ``rows``: label -> (sequential, batched[, graphed]) median s/round, in
    METHODS order. ``log`` gets the trainers' notices (why a method's steps run eagerly). ``shape``: another shape
    than the paper's (or SMALL_SHAPE with ``small``), e.g. a smaller one still for a smoke run."""
    methods = [m[0] for m in METHODS] if methods is None else list(methods)
    clients, per_round, per_client, epochs, batch, classes = shape or (SMALL_SHAPE if small else PAPER_SHAPE)
    device = torch.device(device)
    ds = synthetic(clients, per_client, classes)
    tmp = Path(tempfile.mkdtemp()) if tmp is None else Path(tmp)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def trainer(algo: str, reg: str, parallel, model: str = "cifar-cnn", graphs: bool = False) -> Trainer:
        cfg = RunConfig(dataset="digits", model=model, partition="iid", clients=clients,
                        participation=per_round / clients, sampling="fraction", rounds=10_000, local_epochs=epochs,
                        batch_size=batch, lr=0.1, lr_decay=0.998, weight_decay=1e-3, clip=10.0, algo=algo, reg=reg,
                        eval_every=10_000, checkpoint_every=10_000, seed=0, device=str(device),
                        parallel_clients=parallel, cuda_graphs=graphs).validate()
        return Trainer(cfg, tmp / f"{algo}-{reg}-{parallel}-{graphs}", quiet=True, dataset=ds,
                       log=lambda s: log("  " + s))

    def timed(tr: Trainer, r: int) -> float:
        sync()
        t0 = time.perf_counter()
        tr.run_round(r)
        sync()
        return time.perf_counter() - t0

    # the bare loop: FedAvg's local work on the same data, one client after the other, eager PyTorch
    ref = trainer("fedavg", "none", 1)
    model = build_model("cifar-cnn", num_classes=classes, in_channels=3, image_size=32).to(device)
    data = [ref.client_data(i) for i in range(per_round)]

    def bare_round() -> float:
        sync()
        t0 = time.perf_counter()
        bare_local_training(model, data, epochs=epochs, batch=batch, lr=0.1)
        sync()
        return time.perf_counter() - t0

    bare_round()
    bare = statistics.median(bare_round() for _ in range(rounds))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    resnet = {m[0] for m in RESNET_METHODS}
    rows = {}
    for label, algo, reg in METHODS + RESNET_METHODS:
        if label not in methods:
            continue
        model = "resnet20" if label in resnet else "cifar-cnn"
        modes = [trainer(algo, reg, 1, model), trainer(algo, reg, "all", model)]
        if cuda_graphs:
            modes.append(trainer(algo, reg, "all", model, graphs=True))
        for tr in modes:
            timed(tr, 0)
        times = [[] for _ in modes]
        for r in range(1, rounds + 1):
            for tr, t in zip(modes, times):
                t.append(timed(tr, r))
        rows[label] = tuple(statistics.median(t) for t in times)
        del modes
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(name=name, shape=(clients, per_round, per_client, epochs, batch, classes), rounds=rounds,
                small=small, bare=bare, rows=rows)


def report(result: dict, device_type: str) -> None:
    """Prints :func:`measure`'s figures: the table, then the targets beside the results."""
    clients, per_round, per_client, epochs, batch, classes = result["shape"]
    rows, bare, small = result["rows"], result["bare"], result["small"]
    resnet = {m[0] for m in RESNET_METHODS}
    print(f"{result['name']}, torch {torch.__version__}; MAN CIFAR CNN (ResNet-20 for {', '.join(sorted(resnet))}), "
          f"{clients} clients of {per_client} images, {per_round} a "
          f"round, {epochs} local epochs of batch {batch}; median of {result['rounds']} rounds"
          + (" (SMALL smoke shape, not the paper's)" if small else ""))
    nan = float("nan")
    base_s, base_b = rows.get("FedAvg", (nan, nan))[:2]
    graphed = {label: t[2] for label, t in rows.items() if len(t) == 3}
    print(f"{'method':<16} {'sequential s/round':>19} {'batched s/round':>16} {'speed-up':>9} "
          f"{'x FedAvg (seq)':>15} {'x FedAvg (bat)':>15} {'500 rounds, batched':>20}"
          + (f" {'graphed s/round':>16} {'graphed/batched':>16}" if graphed else ""))
    print(f"{'bare eager loop':<16} {bare:>19.3f}")
    for label, (s, b, *g) in rows.items():
        versus = f"{'':>15} {'':>15}" if label in resnet else f"{s / base_s:>15.2f} {b / base_b:>15.2f}"
        print(f"{label + (' (ResNet-20)' if label in resnet else ''):<16} {s:>19.3f} {b:>16.3f} {s / b:>8.2f}x "
              f"{versus} {500 * b / 60:>16.1f} min" + (f" {g[0]:>16.3f} {g[0] / b:>15.2f}x" if g else ""))
    print("speed-up = sequential / batched s/round; x FedAvg = the method's s/round over FedAvg's in the same mode"
          + ("; graphed = batched with --cuda-graphs" if graphed else ""))
    # the targets on a GPU at the paper shape, beside the results (on the graphed rounds when they were timed)
    print(f"{'target':<16} {'goal':<38} {'result':>8} measured" + (" (graphed)" if graphed else " (batched)"))
    for what, goal, met, figure in targets(result):
        print(f"{what:<16} {goal:<38} {'met' if met else 'MISSED':>8} {figure}")
    if small or device_type != "cuda":
        print("(the targets hold for a GPU at the paper shape; this run is not that)")


def targets(result: dict) -> list[tuple[str, str, bool, str]]:
    """The targets on a GPU at the paper shape, judged on the graphed rounds when they were timed (else the batched
    ones): (method, goal, met, figure) for every method <= 0.12 s a round and every "X + MAN" <= 1.10x X."""
    rows = result["rows"]
    resnet = {m[0] for m in RESNET_METHODS}
    graphed = any(len(t) == 3 for t in rows.values())
    best = {label: t[2] if len(t) == 3 else t[1] for label, t in rows.items()}
    out = []
    for label, b in best.items():
        if label in resnet:
            continue
        out.append((label, "<= 0.12 s a round (1 min / 500 rounds)", b <= 0.12, f"{b:.3f} s"))
        base = label.split(" + ")[0]
        if label.endswith(" + MAN") and base in best:
            ratio = b / best[base]
            out.append((label, f"<= 1.10x {base} ({'graphed' if graphed else 'batched'})", ratio <= 1.10,
                        f"{ratio:.2f}x"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (median printed)")
    ap.add_argument("--small", action="store_true", help="a tiny shape for a CPU smoke run")
    ap.add_argument("--methods", nargs="*", default=[m[0] for m in METHODS],
                    help=f"labels of METHODS (default: all of them) and of RESNET_METHODS "
                         f"({', '.join(m[0] for m in RESNET_METHODS)})")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="also time batched rounds with --cuda-graphs (CUDA)")
    args = ap.parse_args()
    if args.cuda_graphs and not args.device.startswith("cuda"):
        ap.error("--cuda-graphs needs --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.device, rounds=args.rounds, small=args.small, methods=args.methods,
                     cuda_graphs=args.cuda_graphs)
    report(result, torch.device(args.device).type)


if __name__ == "__main__":
    main()
