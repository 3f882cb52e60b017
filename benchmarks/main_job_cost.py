"""What the README's main job (``flatfl reproduce man-tables --preset quick``) costs, step by step.

For each kind of run of the quick preset (each method of MAN Tables 2 and 6, one partition and one seed; the
Fig. 4 methods with their spectrum), in this process with one torch thread, as the job runs them:

* training (curvature tracking during training counted apart: the ``observer_seconds`` of metrics.csv);
* the ``hessian`` analysis (Lanczos top eigenvalue + Hutch++ trace) and, for the Fig. 4 methods, the spectrum
  (top 50 + density), each with its CPU and wall seconds, its Hessian-vector products and ms a product;
* float32 beside float64 (``--precisions``), float64 with torch's own convolutions (``--native-conv``: the
  slow per-sample fallback the CPU presets used before, for the ratio), and float64 training one client at a time
  (``--one-client``: the preset trains a round's clients stacked);

then the whole job's estimate from these steps (each kind x 2 partitions x 3 seeds, the spectrum on the first
seed only; one worker; the job runs two at once on two cores). ``--whole`` also runs the whole job itself, timed
(wall and CPU seconds, its worker processes included), into a temporary folder. ``--floor`` also prints what a
product of the first kind's ``hessian`` analysis would cost as its matrix products alone (their floating-point
operations as torch's profiler counts them, each shape timed alone on this CPU): the arithmetic the precision
cannot avoid, against the product as measured.

    python benchmarks/main_job_cost.py                                  # float64, every kind (about 3 min, 2 cores)
    python benchmarks/main_job_cost.py --precisions float32,float64 --native-conv
    python benchmarks/main_job_cost.py --methods FedAvg,FedSAM --whole
    python benchmarks/main_job_cost.py --methods FedAvg --precisions float32,float64 --floor
"""
from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flatfl import reproduce
from flatfl.run_layout import analyse_run
from flatfl.sweep import RunTask, run_task


def clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = clocks()
    return cpu - start[0], wall - start[1]


def products(folder: Path) -> int:
    return int(json.loads((folder / "hessian.json").read_text())["hvps_total"])


def tracking(run_dir: Path) -> tuple[float, int]:
    """Seconds and products of a run's curvature tracking (metrics.csv's ``observer_seconds`` is cumulative: the
    last tracked row holds the total)."""
    seconds, hvps = 0.0, 0
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("hessian_hvps"):
                hvps += int(row["hessian_hvps"])
                seconds = max(seconds, float(row["observer_seconds"] or 0))
    return seconds, hvps


def matmul_floor(run_dir: Path, batch_size: int = 512, repeats: int = 3) -> float:
    """What a product of the ``hessian`` analysis would cost if it were its matrix products alone: the floating-point
    operations of every ``mm`` / ``addmm`` / ``bmm`` in one product (torch's profiler counts them), each shape timed
    alone on this CPU in the product's precision, against the product as measured in the same process."""
    from collections import defaultdict

    from torch.profiler import profile

    from flatfl.analysis.operators.hessian import HessianOperator
    from flatfl.checkpoint import load_checkpoint

    ckpt = load_checkpoint(run_dir / "final.pt")
    batches = ckpt.eval_batches(split="train", samples=None, batch_size=batch_size, seed=0)
    op = HessianOperator(ckpt.model, batches, products="double-backward")
    v = torch.randn(op.dim, 1, dtype=op.dtype, generator=torch.Generator().manual_seed(0))
    op.matmat(v)  # the first-order graphs built and kept, as the estimators find them
    start = time.perf_counter()
    for _ in range(repeats):
        op.matmat(v)
    product_ms = 1e3 * (time.perf_counter() - start) / repeats
    with profile(record_shapes=True, with_flops=True) as prof:
        op.matmat(v)
    shapes: dict = defaultdict(int)
    flops = 0.0
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm") and e.flops:
            flops += e.flops
            shapes[(e.name, tuple(tuple(s) for s in e.input_shapes if s))] += 1
    alone_ms = 0.0
    for (name, dims), count in shapes.items():
        tensors = [torch.randn(*d, dtype=op.dtype) for d in dims]
        fn = {"aten::mm": torch.mm, "aten::addmm": torch.addmm, "aten::bmm": torch.bmm}[name]
        fn(*tensors)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(*tensors)
        alone_ms += count * 1e3 * (time.perf_counter() - start) / repeats
    print(f"a {str(op.dtype).replace('torch.', '')} product of {op.dim:,} parameters on {op.num_samples:,} inputs "
          f"(batches of {batch_size}): {product_ms:.1f} ms; its matrix products: {flops / 1e9:.2f} GFLOP, "
          f"{alone_ms:.1f} ms when each is timed alone ({flops / 1e6 / max(alone_ms, 1e-9):.1f} GFLOP/s), "
          f"{100 * alone_ms / product_ms:.0f}% of the product", flush=True)
    return alone_ms


def measure(task: RunTask) -> dict:
    """One run's steps, timed (training, then each analysis on its own)."""
    run_dir = Path(task.run_dir)
    start = clocks()
    run_task(RunTask(task.name, task.run_dir, task.settings, threads=1, model=task.model))
    train_cpu, train_wall = since(start)
    track_s, track_hvps = tracking(run_dir)
    out = {"train_cpu": train_cpu - track_s, "train_wall": train_wall - track_s, "track_s": track_s,
           "track_hvps": track_hvps}
    for kind in ("hessian", "spectrum"):
        options = getattr(task, kind)
        if options is None:
            continue
        start = clocks()
        analyse_run(run_dir, **{kind: options}, model=task.model)
        cpu, wall = since(start)
        hvps = products(run_dir / f"{kind}-{task.model}" if task.model != "server" else run_dir / kind)
        out.update({f"{kind}_cpu": cpu, f"{kind}_wall": wall, f"{kind}_hvps": hvps,
                    f"{kind}_ms": 1e3 * cpu / max(hvps, 1)})
    return out


def kinds(methods) -> list[RunTask]:
    """One task per method of the quick preset (partition 0.3, seed 0)."""
    tasks = reproduce.plan(reproduce.Selection("man-tables", "quick", seeds=(0,), methods=methods),
                           reproduce.RunOptions(threads=1))
    return [t for t in tasks if t.settings.get("alpha") == 0.3]


def bench(precision: str, native_conv: bool, methods, root: Path, one_client: bool = False) -> dict:
    import contextlib

    from flatfl.models.convolution import torch_convolutions

    label = precision + (" (torch's convolutions)" if native_conv else "") + \
        (" (one client at a time)" if one_client else "")
    print(f"\n{label}: one run of each kind, one thread", flush=True)
    print(f"{'run':<26}{'train s':>9}{'track s':>9}{'hessian s':>10}{'HVPs':>6}{'ms/HVP':>8}"
          f"{'spectrum s':>11}{'HVPs':>6}{'ms/HVP':>8}", flush=True)
    rows = {}
    with torch_convolutions() if native_conv else contextlib.nullcontext():
        warm = kinds(methods)[0]  # a round of the first kind first: imports, data and torch's first calls
        run_task(RunTask("warm-up", str(root / f"warm-up-{precision}-{native_conv}"),
                         dict(warm.settings, precision=precision, rounds=1, track_hessian=0,
                              track_hessian_settings={}), threads=1))
        for task in kinds(methods):
            task.settings = dict(task.settings, precision=precision, **({"parallel_clients": 1} if one_client else {}))
            task.run_dir = str(root / label.replace(" ", "_") / task.name)
            r = measure(task)
            rows[task.name] = r
            spec = (f"{r['spectrum_cpu']:>11.1f}{r['spectrum_hvps']:>6}{r['spectrum_ms']:>8.1f}"
                    if "spectrum_cpu" in r else f"{'':>11}{'':>6}{'':>8}")
            print(f"{task.name[:25]:<26}{r['train_cpu']:>9.1f}{r['track_s']:>9.1f}{r['hessian_cpu']:>10.1f}"
                  f"{r['hessian_hvps']:>6}{r['hessian_ms']:>8.1f}{spec}", flush=True)
    # the whole job: 2 partitions x 3 seeds of each kind, the spectrum on the first seed only
    per = {k: sum(r.get(f"{k}_cpu", r.get(k, 0.0)) for r in rows.values()) for k in
           ("train", "track_s", "hessian", "spectrum")}
    whole = {"train": 6 * per["train"], "tracking": 6 * per["track_s"], "hessian": 6 * per["hessian"],
             "spectrum": 2 * per["spectrum"]}
    total = sum(whole.values())
    share = ", ".join(f"{k} {v:.0f} s ({100 * v / total:.0f}%)" for k, v in whole.items())
    print(f"{label}: the whole job estimated from these steps: {total:.0f} CPU s ({share}); "
          f"on 2 workers about {total / 2 / 60:.1f} min", flush=True)
    # the products of the whole job's analyses (tracking's, on 128 inputs, left out)
    job_hvps = sum(6 * r["hessian_hvps"] + 2 * r.get("spectrum_hvps", 0) for r in rows.values())
    return {"label": label, "total": total, "hvps": job_hvps, **whole}


def whole_job(methods, root: Path, workers: int) -> None:
    """The main job itself (in a child process), timed: wall, and CPU of it and its workers."""
    cmd = [sys.executable, "-m", "flatfl", "reproduce", "man-tables", "--preset", "quick", "--runs-dir",
           str(root / "whole-runs"), "--out", str(root / "whole-report"), "--workers", str(workers)]
    if methods:
        cmd += ["--methods", methods]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"the job itself ({' '.join(cmd[3:5])}{', ' + methods if methods else ''}, {workers} workers): "
          f"{wall:.0f} s wall, {cpu:.0f} CPU s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="float64", help="comma-separated: float32,float64")
    ap.add_argument("--native-conv", action="store_true",
                    help="also float64 with torch's own convolutions (the slow fallback), for the ratio")
    ap.add_argument("--one-client", action="store_true",
                    help="also float64 training one client at a time (the preset stacks a round's clients), for the "
                         "ratio")
    ap.add_argument("--methods", default=None, help="rows of the tables, e.g. FedAvg,FedSAM (default: all 12)")
    ap.add_argument("--whole", action="store_true", help="also run and time the whole job")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--floor", action="store_true",
                    help="also what a product's matrix products alone cost (the float64 arithmetic floor)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = [bench(p, False, args.methods, root) for p in args.precisions.split(",")]
        if args.native_conv:
            results.append(bench("float64", True, args.methods, root))
        if args.one_client:
            results.append(bench("float64", False, args.methods, root, one_client=True))
        base = next((r for r in results if r["label"] == "float64"), None)
        if base is not None:
            for r in results:
                if r is not base:
                    print(f"{r['label']} / float64: whole job {r['total'] / base['total']:.2f}x "
                          f"(hessian {r['hessian'] / max(base['hessian'], 1e-9):.2f}x, spectrum "
                          f"{r['spectrum'] / max(base['spectrum'], 1e-9):.2f}x, training "
                          f"{r['train'] / max(base['train'], 1e-9):.2f}x)", flush=True)
        if args.floor:
            first = kinds(args.methods)[0].name
            for r in results:
                if r["label"] in ("float32", "float64"):
                    ms = matmul_floor(root / r["label"] / first)
                    print(f"{r['label']}: the job's {r['hvps']:,} analysis products (hessian and spectrum) at that "
                          f"floor: {r['hvps'] * ms / 1e3:.0f} CPU s of matrix products", flush=True)
        if args.whole:
            whole_job(args.methods, root, args.workers)


if __name__ == "__main__":
    main()
