"""Each FL algorithm's time per round relative to FedAvg, on the same run settings, measured in one run.

Every registered algorithm trains the same model (digits-cnn on the embedded digits; the same clients, partition,
seed, local epochs and batch size) through the engine's real round (local training, the algorithm's hooks,
aggregation; evaluation and checkpointing off). After one warm-up round each, the algorithms take their rounds in
turn, round-robin. A round's cost is the CPU time this process spent in it (``time.process_time``) with torch on
one thread, so other work on a shared machine does not count (wall-clock time there swings by 2x between runs);
on an idle machine it equals the wall time. The table gives each algorithm's cheapest round and its ratio to
FedAvg's. On a loaded machine (cache and core sharing) the ratios still move by about 0.2-0.3x between runs.

What to expect, and why:

* SAM-based (fedsam, fedasam, fedspeed, mofedsam): about 1.7-2x. Every local step runs two forward/backward
  passes (at theta and at theta + eps); the per-step work outside them (batching, clipping, the SGD update) is
  not doubled.
* scaffold, feddyn, feddc, fedcm, fedprox, feddisco: about 1x. Their extra work per step is a few O(d) vector
  operations on the gradient; FedDisco only reweights the aggregation.
* fedntd: one extra forward pass of the frozen global model per step (no backward) and the not-true-class
  masking: about 1.5x.
* moon, the outlier among the non-SAM ones: two extra forward passes per step (the frozen global model and the
  client's previous model, rebuilt for every client), and a larger network. Its projection head and classifier
  (Linear(64, 64), Linear(64, 256), Linear(256, 10): 23k parameters) are bigger than the whole digits-cnn (13.7k),
  so every pass of every one of the three models costs more than FedAvg's: 2-2.5x here, less on a large backbone.
* mimelite: one extra forward/backward pass over each client's data per round for the full-batch gradient at the
  start point: (E + 1) / E times the local work, 1.5x with E = 2.
* fedrobust: per step the affine input shift, a backward pass down to the input (the first convolution's input
  gradient, which FedAvg skips) and the ascent on (Lambda_i, delta_i) (64 x 64 on digits): a little above 1x.

    python benchmarks/algorithm_cost.py [--rounds 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.data import load_dataset  # noqa: E402
from flatfl.train.catalog import load_all  # noqa: E402
from flatfl.train.components import ALGORITHMS  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per algorithm (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time = compute time)")
    ap.add_argument("--model", default="digits-cnn")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_all()
    names = ["fedavg"] + sorted(n for n in ALGORITHMS if n != "fedavg")
    ds = load_dataset("digits")
    tmp = Path(tempfile.mkdtemp())
    trainers = {}
    for name in names:
        cfg = RunConfig(dataset="digits", model=args.model, clients=args.clients, participation=1.0,
                        rounds=args.rounds + 1, local_epochs=args.local_epochs, batch_size=args.batch_size,
                        algo=name, eval_every=10**9, checkpoint_every=10**9, seed=0).validate()
        trainers[name] = Trainer(cfg, tmp / name, quiet=True, dataset=ds)
        trainers[name].run_round(0)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(1, args.rounds + 1):
        for name in names:
            t0 = time.process_time()
            trainers[name].run_round(r)
            times[name].append(time.process_time() - t0)

    base = min(times["fedavg"])
    tr0 = trainers["fedavg"]
    print(f"torch {torch.__version__}, {args.threads} thread(s); digits, {args.model} "
          f"({tr0.layout.dim} parameters), {args.clients} clients all participating, {args.local_epochs} local "
          f"epochs, batch {args.batch_size}; cheapest of {args.rounds} round-robin rounds, CPU seconds")
    print(f"{'algorithm':<10} {'local opt':<9} {'s/round':>8} {'vs FedAvg':>9}")
    for name in names:
        best = min(times[name])
        print(f"{name:<10} {trainers[name].opt_cls.name:<9} {best:>8.3f} {best / base:>8.2f}x")


if __name__ == "__main__":
    main()
