"""The speed-up of several ranks over one process, measured in one run (docs/performance.md, docs/distributed.md).

    python3 benchmarks/distributed_scaling.py                       # 2 ranks vs 1 on the CPU (gloo)
    python3 benchmarks/distributed_scaling.py --ranks 4 --device cuda   # over 4 GPUs (nccl)

Two jobs, each run as one process and then under ``torchrun --standalone --nproc-per-node R``, one torch thread a
rank on the CPU:

* **Hessian**: ``flatfl hessian RUN --top 20`` plus the Hutch++ trace (100 products) of the fmnist-cnn network (the
  MAN CNN at LeNet-5 widths) on 4,000 Fashion-MNIST training images; the time is the estimators' own (hessian.json's
  ``seconds``: start-up and checkpoint loading excluded), and the eigenvalues of the two runs are compared.
* **Training**: rounds of the fmnist-cnn protocol (100 clients, 10% participation, 2 local epochs, batches of 50);
  the time is config.json's training time per round after the first (metrics.csv ``seconds``).

Prints each job's seconds, the ratio (one process / R ranks) and the largest relative difference of the numbers.
Needs Fashion-MNIST (``bash install.sh data``; ``--data-dir`` elsewhere). The goal on 2 quiet CPU cores with gloo:
a Hessian ratio of at least 1.6.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = {"dataset": "fashion-mnist", "model": "cifar-cnn", "model_args": {"channels": [6, 16], "hidden": [120, 84]},
       "clients": 100, "participation": 0.1, "sampling": "bernoulli", "partition": "dirichlet", "local_epochs": 2,
       "batch_size": 50, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3, "clip": 10.0}


def _config_file(folder: Path, rounds: int, data_dir: str | None) -> Path:
    """The fmnist-cnn protocol for ``rounds`` rounds as a TOML config file."""
    top = {**{k: v for k, v in RUN.items() if k != "model_args"}, "rounds": rounds, "eval_every": rounds,
           "checkpoint_every": rounds, **({"data_dir": data_dir} if data_dir else {})}
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    lines += ["[model_args]"] + [f"{k} = {json.dumps(v)}" for k, v in RUN["model_args"].items()]
    path = folder / f"fmnist-cnn-{rounds}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _flatfl(args: list[str], ranks: int) -> float:
    """Run ``flatfl args`` as one process (``ranks`` = 1) or under torchrun; returns the wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "flatfl"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "flatfl"]
    start = time.perf_counter()
    r = subprocess.run([*launcher, *args], capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"distributed_scaling: {' '.join(args[:2])} over {ranks} rank(s) failed: "
                 f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return time.perf_counter() - start


def measure(ranks: int, device: str = "cpu", data_dir: str | None = None, samples: int = 4000,
            rounds: int = 4) -> list[tuple[str, float, float, float, str]]:
    """(job, seconds in one process, seconds over ``ranks`` ranks, largest relative difference, what was compared)
    of the Hessian and the training job (the module docstring)."""
    import torch

    flags = ["--device", device, "--threads", "1"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flatfl-dist-") as tmp:
        tmp = Path(tmp)
        cfg = _config_file(tmp, 1, data_dir)
        _flatfl(["train", "--config", str(cfg), "--out", str(tmp / "ckpt"), "--quiet", *flags], 1)  # analysed
        hess = {}
        for n in (1, ranks):
            out = tmp / f"hessian-{n}"
            _flatfl(["hessian", str(tmp / "ckpt"), "--top", "20", "--samples", str(samples), "--batch-size", "500",
                     "--trace-hvps", "100", "--trace-rtol", "1e-9", "--quiet", "--out", str(out), *flags], n)
            hess[n] = json.loads((out / "hessian.json").read_text())
        a, b = hess[1], hess[ranks]
        diff = max(abs(x - y) / abs(x) for x, y in zip(a["top_eigenvalues"], b["top_eigenvalues"]))
        rows.append(("Hessian top-20 + trace", a["seconds"], b["seconds"], diff,
                     f"eigenvalues; {a['hvps_total']} products"))
        cfg = _config_file(tmp, 1 + rounds, data_dir)
        seconds, weights = {}, {}
        for n in (1, ranks):
            out = tmp / f"train-{n}"
            _flatfl(["train", "--config", str(cfg), "--out", str(out), "--quiet", *flags], n)
            with open(out / "metrics.csv") as f:
                metrics = list(csv.DictReader(f))
            seconds[n] = float(metrics[-1]["seconds"])
            weights[n] = torch.load(out / "final.pt", weights_only=False)["state_dict"]
        wa, wb = weights[1], weights[ranks]
        wdiff = max(float((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-30)) for k in wa)
        rows.append((f"training, {1 + rounds} fmnist-cnn rounds", seconds[1], seconds[ranks], wdiff,
                     "server weights"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=None, help="folder holding fashion-mnist/ (default: Debian's)")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=4, help="training rounds after the first")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")
    import torch

    rows = measure(args.ranks, args.device, args.data_dir, args.samples, args.rounds)
    print(f"distributed scaling on {args.device}, {args.ranks} ranks "
          f"({'nccl' if args.device.startswith('cuda') else 'gloo'}), one thread a rank; torch {torch.__version__}")
    print(f"{'job':<34} {'1 process s':>12} {f'{args.ranks} ranks s':>11} {'ratio':>7}  max rel. difference")
    for name, one, many, diff, what in rows:
        print(f"{name:<34} {one:>12.2f} {many:>11.2f} {one / many:>7.2f}  {diff:.2e} ({what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
