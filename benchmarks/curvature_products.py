"""Products per second of each curvature on the digits CNN, each one's cost relative to a gradient, and the products
of ``--per-layer`` against the whole-model analysis with the same settings. One run, one process.

* curvatures: the Hessian (double backward, graph kept; and finite differences), the generalized Gauss-Newton
  matrix and the empirical Fisher (flatfl/analysis/operators/curvatures.py), each through ``curvature_operator`` on the same
  model and inputs, pushing blocks of ``--block`` vectors; a gradient is the unit of cost;
* per layer: flatfl hessian's defaults (top 1 by Lanczos at tol 1e-3, Hutch++ trace with at most 100 products) on
  the whole model, then each module's block with the same settings (per_layer_curvature, blocks in lockstep). Both
  counts are printed: products (vectors) and batched products (passes through the model).

    python benchmarks/curvature_products.py --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from flatfl.analysis import curvature_operator
from flatfl.analysis.estimators.by_name import estimate_eigenvalues, estimate_trace
from flatfl.analysis.estimators.per_layer import per_layer_curvature
from flatfl.models import build_model


def timed(fn, repeat):
    """``(seconds of the first call, mean seconds of the next repeat calls)``: the first builds what an operator
    keeps between products (first-order graphs, per-sample gradients)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return first, (time.perf_counter() - start) / repeat


class Passes:
    """Counts the operator's batched products (matmat calls) beside its products (vectors)."""

    def __init__(self, op):
        self.op, self.calls = op, 0
        inner = op.matmat

        def counted(V):
            self.calls += 1
            return inner(V)

        op.matmat = counted


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; one run", flush=True)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = build_model("digits-cnn", num_classes=10, in_channels=1, image_size=8).eval()
    x = torch.randn(args.inputs, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (args.inputs,), generator=gen)
    batches = [(x, y)]
    V = torch.randn(sum(p.numel() for p in model.parameters()), args.block, generator=gen)
    hessian = curvature_operator("hessian", model, batches, products="double-backward")
    _, grad_t = timed(hessian.gradient, args.repeat)
    print(f"digits CNN ({hessian.dim:,} parameters, {args.inputs} inputs): gradient {grad_t * 1e3:.1f} ms; blocks "
          f"of {args.block} vectors", flush=True)
    cases = [("hessian (double backward)", hessian),
             ("hessian (finite differences)", curvature_operator("hessian", model, batches,
                                                                 products="finite-difference")),
             ("ggn", curvature_operator("ggn", model, batches)),
             ("empirical-fisher", curvature_operator("empirical-fisher", model, batches))]
    for name, op in cases:
        first, t = timed(lambda: op.matmat(V), args.repeat)
        per = t / args.block
        print(f"    {name:30s} {1 / per:8.1f} products/s = {per / grad_t:5.2f}x a gradient per product "
              f"[{op.products}]; first block {first / grad_t:.1f} gradients", flush=True)

    op = curvature_operator("hessian", model, batches)
    passes = Passes(op)
    estimate_eigenvalues(op, "lanczos", 1, tol=1e-3, seed=0)
    estimate_trace(op, "hutchpp", max_hvps=100, rtol=1e-2, seed=1)
    whole, whole_passes = op.hvps, passes.calls
    op = curvature_operator("hessian", model, batches)
    layers = per_layer_curvature(op, 1, tol=1e-3, trace_hvps=100, trace_rtol=1e-2, seed=3)
    batched = layers.info["batched_products"]
    print(f"per layer ({len(layers.blocks)} blocks) vs whole model, same settings (top 1, tol 1e-3, Hutch++ <= 100): "
          f"products {layers.hvps} vs {whole}; batched products {batched} vs {whole_passes} "
          f"({batched / whole_passes:.2f}x)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
