"""Curvature products of cross-entropy at 10, 1,000 and 50,000 classes: the Gauss-Newton product with the output
Hessian in closed form (``H_out u = a (p * u - p (p . u))`` per sample, flatfl/analysis/operators/cross_entropy.py)
against the general double backward through the loss (``OutputHessian``, what a criterion not recognised as
cross-entropy gets), the output Hessian's products alone both ways, and the Hessian product (double backward and
forward-over-reverse through ``F.cross_entropy``), whose cost in the number of classes this measures.

The network: ``Linear(64, 64) - Tanh - Linear(64, C)``, one batch of ``--inputs`` inputs, blocks of ``--block``
vectors, float32 and float64. Every case runs in a fresh child process (this script with ``--child``), started with
glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so that freed blocks go back to the system. Its memory, from
/proc/self/status: *peak*, the growth of its resident set at the peak of the timed blocks above what was resident
before them (VmHWM, reset, minus VmRSS: what a block of products allocates while it runs), and *kept*, the growth
over the warm-up block (what an operator keeps between products, such as the Hessian's first-order graph, plus
torch's one-time state). Its time per product: the child's CPU seconds for a block (the median of ``--repeat``
blocks after the warm-up) divided by the block's vectors; with one torch thread (``--threads 1``, the default) that
is its compute time, which other jobs on a shared machine do not inflate. Each case also projects its products onto fixed random
vectors, and the closed form's and the general path's projections are compared (relative difference printed).

    python benchmarks/ce_products.py                                   # writes nothing; print it to a file
    python benchmarks/ce_products.py --classes 10,1000 --dtypes float64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

CASES = {
    "ggn-closed": "GGN, output Hessian in closed form",
    "ggn-general": "GGN, output Hessian by double backward",
    "hout-closed": "output Hessian alone, closed form",
    "hout-general": "output Hessian alone, double backward",
    "hessian-db": "Hessian, double backward",
    "hessian-for": "Hessian, forward-over-reverse",
}
PAIRS = (("ggn-general", "ggn-closed"), ("hout-general", "hout-closed"))


def kib_of(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak since the last reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def general_cross_entropy(outputs, targets):
    """``F.cross_entropy`` as a function flatfl does not recognise: the general double backward of its outputs."""
    return F.cross_entropy(outputs, targets)


def setup(case: str, classes: int, dtype: torch.dtype, inputs: int, block: int):
    """``(product, dim)``: a function computing one block of products of the case, and the vectors' length."""
    from flatfl.analysis import GGNOperator, HessianOperator
    from flatfl.analysis.operators.cross_entropy import SoftmaxHessian, cross_entropy_form
    from flatfl.analysis.operators.curvatures import OutputHessian

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, classes)).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(inputs, 64, generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (inputs,), generator=gen)
    if case.startswith("hout"):
        with torch.no_grad():
            z = model(x)
        U = torch.randn(block, *z.shape, generator=gen, dtype=dtype)
        if case == "hout-closed":
            form = cross_entropy_form(F.cross_entropy)
            return (lambda: SoftmaxHessian(form, z, y).products(U)), z.numel()
        return (lambda: OutputHessian(lambda out: F.cross_entropy(out, y), z, "cross_entropy", 0).products(U)), \
            z.numel()
    batches = [(x, y)]
    if case == "ggn-closed":
        op = GGNOperator(model, batches)
        assert op.method.cross_entropy is not None
    elif case == "ggn-general":
        op = GGNOperator(model, batches, loss_fn=general_cross_entropy)
        assert op.method.cross_entropy is None
    else:
        products = "double-backward" if case == "hessian-db" else "forward-over-reverse"
        op = HessianOperator(model, batches, products=products)
    V = torch.randn(op.dim, block, generator=gen, dtype=dtype)
    return (lambda: op.matmat(V)), op.dim


def child(spec: dict) -> dict:
    """One case in this process: its CPU ms per product, the growth of its resident set (kept by the warm-up block,
    and at the peak of the timed blocks above that) and a projection of its products."""
    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    product, dim = setup(spec["case"], spec["classes"], dtype, spec["inputs"], spec["block"])
    W = torch.randn(dim, 4, generator=torch.Generator().manual_seed(2), dtype=dtype)
    start_kib = kib_of("VmRSS")
    result = product()  # warm-up: an operator's first block builds what it keeps, torch its one-time state
    rows = result.reshape(spec["block"], dim) if spec["case"].startswith("hout") else result.T  # (block, dim)
    projection = (rows @ W).reshape(-1)
    del result, rows
    kept_kib = kib_of("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM reset to VmRSS
    seconds = []
    for _ in range(spec["repeat"]):
        start = time.process_time()
        product()
        seconds.append(time.process_time() - start)
    return {"ms": statistics.median(seconds) / spec["block"] * 1e3, "peak_mib": max(0, kib_of("VmHWM") - kept_kib) / 1024,
            "kept_mib": (kept_kib - start_kib) / 1024, "projection": projection.double().tolist()}


def run_child(spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def relative_difference(a: list, b: list) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def ratio(a_mib: float, b_mib: float) -> str:
    """``a / b`` of two peaks, where both are at least 1 MiB (below that the resident set's rounding decides)."""
    return f"{a_mib / b_mib:.2f}x" if min(a_mib, b_mib) >= 1 else "n/a (under 1 MiB)"


def parse_list(text: str, kind, name: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"ce_products.py: --{name} wants a comma-separated list, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default="10,1000,50000")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    classes = parse_list(args.classes, int, "classes")
    dtypes = parse_list(args.dtypes, str, "dtypes")
    bad = [d for d in dtypes if d not in ("float32", "float64")] + [c for c in classes if c < 2] + \
        [n for n in (args.inputs, args.block, args.repeat, args.threads) if n < 1]
    if bad:
        raise SystemExit(f"ce_products.py: not a valid setting: {bad[0]!r} (dtypes float32/float64, classes >= 2, "
                         "counts >= 1)")
    print(f"# torch {torch.__version__}, CPU, {args.threads} torch thread(s) per case, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the start; one run", flush=True)
    print(f"# Linear(64, 64) - Tanh - Linear(64, C), {args.inputs} inputs, blocks of {args.block} vectors; ms: CPU "
          f"ms of the child per product, median of {args.repeat} blocks after a warm-up; peak: growth of the child's "
          "resident set during those blocks; kept: its growth over the warm-up block", flush=True)
    found = {}
    for dtype in dtypes:
        for c in classes:
            print(f"C = {c:,}, {dtype}", flush=True)
            for case, title in CASES.items():
                spec = {"case": case, "classes": c, "dtype": dtype, "inputs": args.inputs, "block": args.block,
                        "repeat": args.repeat, "threads": args.threads}
                row = found[dtype, c, case] = run_child(spec)
                if "error" in row:
                    print(f"    {title:40s} failed: {row['error']}", flush=True)
                    continue
                line = (f"    {title:40s} {row['ms']:9.2f} ms/product  peak {row['peak_mib']:8.1f} MiB  "
                        f"(kept {row['kept_mib']:6.1f} MiB)")
                for general, closed in PAIRS:
                    other = found.get((dtype, c, closed))
                    if case == general and other is not None and "error" not in other:
                        line += (f"   general/closed: time {row['ms'] / other['ms']:.2f}x, peak "
                                 f"{ratio(row['peak_mib'], other['peak_mib'])}, products' relative difference "
                                 f"{relative_difference(row['projection'], other['projection']):.1e}")
                print(line, flush=True)
    print("Growth with the number of classes (a C x C matrix per input, which none of these builds, would take "
          + ", ".join(f"{args.inputs * c * c * 8 / 2 ** 30:,.3g} GiB at C = {c:,}" for c in classes) + " in float64; the "
          "last layer's 64 C weights grow linearly):", flush=True)
    for dtype in dtypes:
        for case in ("hessian-db", "hessian-for", "hout-general", "hout-closed"):
            rows = [(c, found[dtype, c, case]) for c in classes if "error" not in found[dtype, c, case]]
            steps = [f"C {a:,} -> {b:,} (x{b / a:g}): time x{rb['ms'] / ra['ms']:.2f}, peak "
                     f"{ratio(rb['peak_mib'], ra['peak_mib'])}" for (a, ra), (b, rb) in zip(rows, rows[1:])]
            print(f"    {CASES[case]}, {dtype}: " + "; ".join(steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
