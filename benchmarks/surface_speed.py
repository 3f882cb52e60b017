"""Grid points per second of flatfl's loss-surface evaluation against the loss-landscape approach, in one run.

Both sides evaluate the same model, directions, evaluation batches and grid, the model in eval mode:

* baseline (what tomgoldstein/loss-landscape does per point, written plainly): build a perturbed state dict
  ``{name: theta + x d1 + y d2}`` (buffers copied), ``model.load_state_dict(...)``, then the loss and accuracy over
  the batches under ``torch.no_grad``;
* flatfl: :func:`flatfl.analysis.estimators.surface.loss_surface` (in-place foreach perturbation, ``inference_mode``), in one
  process with all ``--threads``, in one process with one thread, and with ``--workers`` processes
  (``threads // workers`` threads each).

Each timing is the median of ``--repeats`` runs, the sides alternating. Printed: points per second, the speed-up of
flatfl over the baseline, and the speed-up of the workers over one process (at all threads and at one thread).

    python benchmarks/surface_speed.py [--repeats 3] [--threads 2] [--workers 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatfl.analysis.estimators.directions import random_directions  # noqa: E402
from flatfl.analysis.estimators.surface import grid_coordinates, loss_surface  # noqa: E402
from flatfl.data import load_dataset  # noqa: E402
from flatfl.models import build_model  # noqa: E402


def baseline_surface(model, batches, directions, grid, radius):
    """The per-point reload loop: a fresh perturbed state dict loaded for every grid point."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d1 = dict(zip(names, directions[0]))
    d2 = dict(zip(names, directions[1]))
    coords = grid_coordinates(grid, radius)
    total = sum(len(y) for _, y in batches)
    loss = np.zeros((grid, grid))
    model.eval()
    for iy, y in enumerate(coords):
        for ix, x in enumerate(coords):
            state = {k: (v + float(x) * d1[k] + float(y) * d2[k]) if k in d1 else v.clone()
                     for k, v in theta.items()}
            model.load_state_dict(state)
            value, correct = 0.0, 0
            with torch.no_grad():
                for inputs, targets in batches:
                    out = model(inputs)
                    value += F.cross_entropy(out, targets, reduction="sum").item()
                    correct += int((out.argmax(1) == targets).sum())
            loss[iy, ix] = value / total
    model.load_state_dict(theta)
    return loss


def cifar_like(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def with_threads(threads, fn):
    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fn()
        finally:
            torch.set_num_threads(before)
    return run


def case(title, model, x, y, batch, grid, radius, repeats, threads, workers):
    batches = [(x[a:a + batch], y[a:a + batch]) for a in range(0, len(y), batch)]
    dirs = random_directions(model, seed=0)
    points = grid * grid
    reference = loss_surface(model, batches, dirs, grid, radius)  # warm-up, and the values to compare
    check = baseline_surface(model, batches, dirs, grid, radius)
    err = float(np.max(np.abs(reference.loss - check) / np.abs(check)))
    sides = {
        f"baseline: reload a perturbed state dict, {threads} thr": lambda: baseline_surface(model, batches, dirs,
                                                                                            grid, radius),
        f"flatfl: 1 process, {threads} thr": lambda: loss_surface(model, batches, dirs, grid, radius),
        "flatfl: 1 process, 1 thr": with_threads(1, lambda: loss_surface(model, batches, dirs, grid, radius)),
        f"flatfl: {workers} worker processes, {max(1, threads // workers)} thr each":
            lambda: loss_surface(model, batches, dirs, grid, radius, workers=workers),
    }
    rates = {name: 0.0 for name in sides}
    times = {name: [] for name in sides}
    for _ in range(repeats):  # the sides alternate, so a change in machine load hits all of them
        for name, fn in sides.items():
            times[name].append(timed(fn, 1))
    for name in sides:
        rates[name] = points / statistics.median(times[name])
    names = list(sides)
    print(f"{title} ({points} points; max relative difference of the grids {err:.1e})")
    for name in names:
        print(f"  {name:<58} {rates[name]:>8.2f} points/s")
    base, one, single, many = (rates[n] for n in names)
    print(f"  flatfl (1 process) / baseline: {one / base:.2f}x;  {workers} workers / 1 process at {threads} thr: "
          f"{many / one:.2f}x;  {workers} workers / 1 process at 1 thr: {many / single:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    digits = load_dataset("digits")
    dx, dy = digits.split("train")
    dx = digits.normalize(dx[:512])
    dy = dy[:512]
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} alternating runs")
    digits_cnn = build_model("digits-cnn", num_classes=10, in_channels=1, image_size=8).eval()
    case("digits-cnn (13.7k params), 512 digits, 9x9 grid", digits_cnn, dx, dy, 256, 9, 1.0, args.repeats,
         args.threads, args.workers)
    cifar_cnn = build_model("cifar-cnn", num_classes=10, in_channels=3, image_size=32).eval()
    cx, cy = cifar_like(128)
    case("cifar-cnn (MAN CNN, 0.8M params), 128 CIFAR-shaped inputs, 5x5 grid", cifar_cnn, cx, cy, 128, 5, 1.0,
         args.repeats, args.threads, args.workers)


if __name__ == "__main__":
    main()
