"""Each local regularizer's time per round relative to no regularizer, on the same run settings, measured in one run.

Three model families, each trained through the engine's real round (local training with the regularizer inside the
loss closure, aggregation; evaluation and checkpointing off), FedAvg with plain SGD (``--local-opt sam``: FedAvg's
clients with SAM, whose two passes each run the regularizer; several optimizers are measured one after the other):

* ``digits-cnn`` on the embedded 8x8 digits: none, man, asd, mixup, fedalign (its dense final block, fc1 + ReLU);
* ``cifar-cnn`` (the MAN paper's own CIFAR CNN) on CIFAR-shaped 3x32x32 synthetic images: the same five;
* ``resnet20`` on CIFAR-shaped 3x32x32 synthetic images (random pixels and labels: only the cost matters): every
  regularizer, including the ResNet-only gradaug and stochdepth.

After one warm-up round each, the configurations of a family take their rounds in turn, round-robin, so the shared
machine's load falls on all of them alike. Time is the process's CPU time (``time.process_time``) with one torch
thread, which other processes on a shared machine disturb far less than wall-clock time; the table gives each
configuration's fastest round and its ratio to the same family's run without a regularizer (wall-clock seconds of
that configuration's fastest round alongside, for reference).

What to expect, and why:

* man: one squared norm per hooked activation and its backward (a scaled copy of the activation). The MAN paper's
  cost count, N C_o H_o W_o (1 + C_i K^2) for a convolution, makes it negligible when C_i K^2 >> 1: true for
  ResNet-20 (C_i K^2 >= 144), not for the digits CNN's first convolution (1 input channel, 3x3: C_i K^2 = 9) on
  8x8 images, where element-wise work is a large part of a step. Target (realistic networks): within 10%.
* asd: one forward pass of the frozen round model per step (no backward): about 1.3x.
* mixup: one extra blend of the batch: about 1x.
* fedalign: the final block re-run at width 0.25 on the detached penultimate features (1/16 of its multiply-adds
  on a ResNet) and two 10-step power iterations: the paper reports 1.02x the FLOPs on ResNet-56. Target: within 25%.
  On the digits CNN (fc1 at width 0.25, closed-form sigma) the extra work is a few dozen tiny operations per step.
* gradaug: two more forward/backward passes of slimmed networks (width 0.8 and U[0.8, 1]) on resized inputs:
  about 1.8-2.5x (paper Table 5: 170.7 vs 87.3 GFLOPs for n = 2).
* stochdepth: dropped blocks are skipped in training: at most 1x.

    python benchmarks/regularizer_cost.py [--rounds 4] [--threads 1] [--models cifar-cnn] [--regs none man]
                                          [--local-opt sgd sam]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.data import load_dataset  # noqa: E402
from flatfl.data.datasets import ImageDataset  # noqa: E402
from flatfl.train.catalog import load_all  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402

TARGETS = {"man": 1.10, "fedalign": 1.25}
FAMILIES = {  # model: (data, regularizers, timed rounds per --rounds: short digits rounds get more samples)
    "digits-cnn": ("digits", ["none", "man", "asd", "mixup", "fedalign"], 6),
    "cifar-cnn": ("cifar-shaped", ["none", "man", "asd", "mixup", "fedalign"], 1),
    "resnet20": ("cifar-shaped", ["none", "man", "asd", "mixup", "fedalign", "gradaug", "stochdepth"], 1),
}


def cifar_shaped(num_train: int, seed: int = 0) -> ImageDataset:
    """Random uint8 3x32x32 images with random labels over 10 classes (a stand-in of CIFAR's tensor sizes)."""
    g = np.random.default_rng(seed)
    x = torch.from_numpy(g.integers(0, 256, size=(num_train, 3, 32, 32), dtype=np.uint8))
    y = torch.from_numpy(g.integers(0, 10, size=num_train)).long()
    return ImageDataset(name="cifar-shaped", train_x=x, train_y=y, test_x=x[:64].clone(), test_y=y[:64].clone(),
                        num_classes=10, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def measure(model: str, ds: ImageDataset, regs: list[str], rounds: int, local_opt: str, args) -> tuple[dict, dict]:
    """CPU and wall-clock seconds of each timed round, per regularizer."""
    tmp = Path(tempfile.mkdtemp())
    trainers = {}
    for reg in regs:
        cfg = RunConfig(dataset="digits", model=model, clients=args.clients, participation=1.0, partition="iid",
                        local_opt=local_opt,
                        rounds=10**6, local_epochs=1, batch_size=args.batch_size, reg=reg, eval_every=10**9,
                        checkpoint_every=10**9, seed=0).validate()
        trainers[reg] = Trainer(cfg, tmp / f"{model}-{local_opt}-{reg}", quiet=True, dataset=ds)
        trainers[reg].run_round(0)  # warm-up
    cpu: dict[str, list[float]] = {reg: [] for reg in regs}
    wall: dict[str, list[float]] = {reg: [] for reg in regs}
    for r in range(1, rounds + 1):
        for reg in regs:
            c0, w0 = time.process_time(), time.perf_counter()
            trainers[reg].run_round(r)
            cpu[reg].append(time.process_time() - c0)
            wall[reg].append(time.perf_counter() - w0)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds per configuration after one warm-up round "
                    "(6x as many for the fast digits-cnn rounds)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: least noise on a shared machine)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--cifar-samples", type=int, default=400, help="training images of the CIFAR-shaped set")
    ap.add_argument("--models", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--regs", nargs="+", help="only these regularizers of each family (none is always measured)")
    ap.add_argument("--local-opt", nargs="+", default=["sgd"], choices=["sgd", "sam", "asam"],
                    help="local optimizers, measured one after the other (default sgd)")
    args = ap.parse_args()
    if args.regs:
        known = {r for m in args.models for r in FAMILIES[m][1]}
        unknown = sorted(set(args.regs) - known)
        if unknown:
            ap.error(f"--regs: {', '.join(unknown)} not measured for {', '.join(args.models)} "
                     f"(choose from {', '.join(sorted(known))})")
    torch.set_num_threads(args.threads)
    load_all()
    datasets = {"digits": load_dataset("digits"), "cifar-shaped": cifar_shaped(args.cifar_samples)}
    print(f"torch {torch.__version__}, {args.threads} thread(s); FedAvg, {args.clients} clients all "
          f"participating, 1 local epoch, batch {args.batch_size}; fastest of {args.rounds} (CIFAR-shaped) / "
          f"{6 * args.rounds} (digits-cnn) round-robin rounds")
    print(f"{'model':<11} {'data':<13} {'local opt':<9} {'regularizer':<11} {'CPU s/round':>11} {'vs none':>8} "
          f"{'wall s':>7}  target")
    for local_opt in args.local_opt:
        for model in args.models:
            data, regs, factor = FAMILIES[model]
            regs = [r for r in regs if r == "none" or not args.regs or r in args.regs]
            cpu, wall = measure(model, datasets[data], regs, factor * args.rounds, local_opt, args)
            base = min(cpu["none"])
            for reg in regs:
                best = min(cpu[reg])
                ratio = best / base
                target = TARGETS.get(reg)
                verdict = "" if target is None else f"<= {target:.2f}x {'ok' if ratio <= target else 'MISSED'}"
                print(f"{model:<11} {data:<13} {local_opt:<9} {reg:<11} {best:>11.3f} {ratio:>7.2f}x "
                      f"{min(wall[reg]):>7.3f}  {verdict}", flush=True)


if __name__ == "__main__":
    main()
