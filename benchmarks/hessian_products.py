"""Which Hessian-vector product is faster on this device: per-vector double backward or batched forward-over-reverse.

One run, on the same operator (flatfl's ``HessianOperator``): a gradient; a double-backward HVP through the kept
first-order graph (Pearlmutter, one vector at a time); and ``torch.func`` forward-over-reverse (``jvp`` of ``grad``)
under ``vmap`` over blocks of vectors, as time per vector. Ratios to the gradient are printed, and the products are
checked to agree. The result decides ``HessianOperator(products="auto")`` per device (flatfl/analysis/operators/hessian.py).

    python benchmarks/hessian_products.py                    # MAN CIFAR CNN at 512 inputs and the digits CNN, CPU
    python benchmarks/hessian_products.py --device cuda      # on a GPU (adds blocks of 32)
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from flatfl.analysis import HessianOperator
from flatfl.models import build_model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat=1):
    fn()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    sync(device)
    return out, (time.perf_counter() - start) / repeat


def measure(name, model, x, y, device, blocks):
    model = model.to(device).eval()
    x, y = x.to(device), y.to(device)
    db = HessianOperator(model, [(x, y)], products="double-backward")
    gen = torch.Generator().manual_seed(0)
    V = torch.randn(db.dim, max(blocks), generator=gen).to(device)
    _, grad_t = timed(db.gradient, device)
    ref, db_t = timed(lambda: db.matvec(V[:, 0]), device)
    print(f"{name} ({db.dim:,} parameters, {len(y)} inputs, {device}): gradient {grad_t * 1e3:.1f} ms; "
          f"double-backward HVP (graph kept) {db_t * 1e3:.1f} ms = {db_t / grad_t:.2f}x a gradient", flush=True)
    best = None
    for b in blocks:
        fr = HessianOperator(model, [(x, y)], products="forward-over-reverse", block_size=b)
        try:
            out, t = timed(lambda: fr.matmat(V[:, :b]), device)
        except torch.OutOfMemoryError:
            print(f"    forward-over-reverse, block {b}: out of memory", flush=True)
            break
        per = t / b
        err = float((out[:, 0] - ref).norm() / ref.norm())
        best = per if best is None else min(best, per)
        print(f"    forward-over-reverse vmap, block {b}: {per * 1e3:.1f} ms per vector = {per / grad_t:.2f}x a "
              f"gradient, {per / db_t:.2f}x the double-backward HVP (relative difference {err:.1e})", flush=True)
    print(f"    faster here: {'forward-over-reverse' if best is not None and best < db_t else 'double-backward'} "
          f"(best per-vector ratio forward-over-reverse / double-backward = {best / db_t:.2f})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    blocks = [1, 4, 16, 32] if device.type == "cuda" else [1, 4, 16]
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; one run", flush=True)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    man = build_model("cifar-cnn", num_classes=100, in_channels=3, image_size=32)
    measure("MAN CIFAR CNN", man, torch.randn(args.inputs, 3, 32, 32, generator=gen),
            torch.randint(0, 100, (args.inputs,), generator=gen), device, blocks)
    torch.manual_seed(0)
    digits = build_model("digits-cnn", num_classes=10, in_channels=1, image_size=8)
    measure("digits CNN", digits, torch.randn(args.inputs, 1, 8, 8, generator=gen),
            torch.randint(0, 10, (args.inputs,), generator=gen), device, blocks)


if __name__ == "__main__":
    sys.exit(main())
