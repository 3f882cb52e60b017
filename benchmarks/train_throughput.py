"""flatfl's FedAvg local-training throughput against a bare PyTorch SGD loop, measured in one run.

Both sides train the same model from the same initial weights over the same client data, with the same batch
size, learning rate, weight decay and gradient clipping, for the same number of steps. The flatfl side is the
engine's real round (client sampling, per-client data, the loss closure, the algorithm and regularizer hooks,
aggregation) with evaluation and checkpointing switched off; the bare side is the textbook loop

    for x, y in batches: opt.zero_grad(); F.cross_entropy(model(x), y).backward(); clip; opt.step()

Timings alternate between the two sides and the ratio of the medians is printed (target: >= 0.9).

    python benchmarks/train_throughput.py [--repeats 5] [--threads 2]
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

from flatfl.train.config import RunConfig  # noqa: E402
from flatfl.data import load_dataset  # noqa: E402
from flatfl.data.datasets import ImageDataset  # noqa: E402
from flatfl.models import build_model  # noqa: E402
from flatfl.train.engine import Trainer  # noqa: E402


def cifar_like(n: int, seed: int = 0) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (n,), generator=g)
    return ImageDataset("cifar-like", x, y, x[:100], y[:100], 10, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def bare_local_training(model, data, *, epochs: int, batch: int, lr: float, weight_decay: float = 1e-3,
                        clip: float = 10.0) -> None:
    """The textbook eager loop over clients' (x, y): a fresh SGD per client, shuffled batches, clip, step."""
    for x, y in data:
        opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
        n = len(y)
        for _ in range(epochs):
            perm = torch.randperm(n, device=x.device)
            for s in range(0, n, batch):
                idx = perm[s:s + batch]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()


def measure(ds: ImageDataset, model_name: str, clients: int, epochs: int, batch: int, repeats: int, tmp: Path):
    model = build_model(model_name, num_classes=ds.num_classes, in_channels=ds.in_channels, image_size=ds.image_size)
    cfg = RunConfig(dataset="digits", partition="iid", clients=clients, participation=1.0, rounds=10_000,
                    local_epochs=epochs, batch_size=batch, lr=0.05, lr_decay=1.0, weight_decay=1e-3, clip=10.0,
                    eval_every=10_000, checkpoint_every=10_000, seed=0).validate()
    trainer = Trainer(cfg, tmp / model_name, quiet=True, dataset=ds, model=model)
    samples_per_round = int(trainer.partition.sizes.sum()) * epochs

    # the bare loop: the same client data and batch sizes, one fresh SGD per client as the engine does
    bare_model = build_model(model_name, num_classes=ds.num_classes, in_channels=ds.in_channels,
                             image_size=ds.image_size)
    bare_model.load_state_dict(model.state_dict())
    data = [trainer.client_data(i) for i in range(clients)]

    def bare_round():
        bare_local_training(bare_model, data, epochs=epochs, batch=batch, lr=0.05)

    def flatfl_round(r):
        trainer.run_round(r)

    flatfl_round(0)
    bare_round()  # warm-up
    t_flatfl, t_bare = [], []
    for r in range(1, repeats + 1):
        t0 = time.perf_counter()
        flatfl_round(r)
        t_flatfl.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bare_round()
        t_bare.append(time.perf_counter() - t0)
    thr_f = samples_per_round / statistics.median(t_flatfl)
    thr_b = samples_per_round / statistics.median(t_bare)
    return thr_f, thr_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    cases = [
        ("digits, digits-cnn (13.7k params)", load_dataset("digits"), "digits-cnn", 10, 2, 50),
        ("CIFAR-shaped random, cifar-cnn (MAN CNN, 0.8M params)", cifar_like(1000), "cifar-cnn", 4, 1, 50),
    ]
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} alternating rounds")
    print(f"{'case':<56} {'flatfl samples/s':>17} {'bare samples/s':>15} {'ratio':>7}")
    for title, ds, model, clients, epochs, batch in cases:
        f, b = measure(ds, model, clients, epochs, batch, args.repeats, tmp)
        print(f"{title:<56} {f:>17.1f} {b:>15.1f} {f / b:>7.3f}")
    print("ratio = flatfl throughput / bare PyTorch loop throughput (target >= 0.9)")


if __name__ == "__main__":
    np.random.seed(0)
    main()
