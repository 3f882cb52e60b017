"""One answer on every path, on a GPU: the numbers of CUDA runs against the CPU's, printed as two tables.

1. The differential cases of ``tests/test_every_path.py`` (a pairwise covering set of every registered model x
   regularizer x algorithm x optimizer, :func:`flatfl.train.combinations.pairwise_combinations`; ``--full``: every
   admitted combination), each trained in float64 one client at a time on the CPU (the reference) and on the
   device one client at a time and all clients together (the default on CUDA). Target: every quantity (server
   weights, clients' latest models, buffers, algorithm state) within 1e-9 relative of the CPU's.
2. A Fashion-MNIST preset's MAN tables (``flatfl reproduce man-tables --preset fmnist``, the MLP, or ``--preset
   fmnist-cnn``, the CNN) trained and analysed on the device with its defaults (all clients together, float32,
   full-precision products), against the committed CPU tables in ``reports/man-tables-<preset>``: every row's mean
   within its seeds' spread (|difference| <= the larger of the two standard deviations over seeds), for the top
   eigenvalue, the trace and the accuracy.

    python benchmarks/cuda_equivalence.py --device cuda                 # both parts (part 2: ~2 min on an H200)
    python benchmarks/cuda_equivalence.py --device cuda --skip-table    # part 1 only
    python benchmarks/cuda_equivalence.py --device cuda --preset fmnist-cnn   # part 2 with the CNN
    python benchmarks/cuda_equivalence.py --device cuda --cuda-graphs --skip-table  # part 1 and graphs vs eager
    python benchmarks/cuda_equivalence.py --device cpu --limit 5 --skip-table   # a smoke run of the code

``--cuda-graphs`` adds a part: every registered piece trained on the device in float64 with its steps replayed as
CUDA graphs against the same run stepped eagerly (target: within 1e-9 relative).

On a CPU, part 1 compares the CPU with itself (a check that the comparison runs, not of a device).
"""
from __future__ import annotations

import argparse
import csv
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flatfl.errors import ConfigError  # noqa: E402
from flatfl.train.combinations import (differences, every_combination, pairwise_combinations,  # noqa: E402
                                       step_graph_combinations, step_graph_settings, train_case)

RTOL = 1e-9
METRICS = ("top_eigenvalue", "trace", "accuracy")


def differential(device: str, full: bool, limit: int | None, tmp: Path) -> bool:
    cases = every_combination() if full else pairwise_combinations()
    cases = cases[:limit] if limit else cases
    print(f"part 1: {len(cases)} cases, float64, CPU one client at a time vs {device} (target <= {RTOL:g} relative)")
    print(f"{'case':<42} {'N=1 ' + device:>14} {'N=all ' + device:>14} {'clients':>8}  verdict")
    worst, failed, refused, start = 0.0, [], 0, time.perf_counter()
    for i, case in enumerate(cases):
        try:
            ref = train_case(case, tmp / f"{i}-ref", 1, device="cpu")
        except ConfigError:
            refused += 1
            print(f"{case.label:<42} {'refused before training':>38}")
            continue
        row = []
        for parallel in (1, "all"):
            other = train_case(case, tmp / f"{i}-{parallel}", parallel, device=device)
            row.append((max(differences(ref, other).values()), other.parallel))
        worst = max([worst] + [d for d, _ in row])
        ok = all(d <= RTOL for d, _ in row)
        if not ok:
            failed.append(case.label)
        print(f"{case.label:<42} {row[0][0]:>14.2e} {row[1][0]:>14.2e} {row[1][1]:>8}  {'ok' if ok else 'OFF'}")
    print(f"part 1: {len(cases) - refused - len(failed)} of {len(cases) - refused} cases within {RTOL:g} "
          f"(largest difference {worst:.2e}); {refused} refused before training; {time.perf_counter() - start:.0f} s")
    for label in failed:
        print(f"  OFF: {label}")
    return not failed


def graphs(device: str, tmp: Path) -> bool:
    """``--cuda-graphs`` against eager steps on the device, float64, all clients together, over every registered
    piece (:func:`flatfl.train.combinations.step_graph_combinations`, the cases of tests/test_step_graph.py)."""
    cases = step_graph_combinations()
    print(f"graphs: {len(cases)} cases, float64 on {device}, eager vs --cuda-graphs (target <= {RTOL:g} relative)")
    failed, start = [], time.perf_counter()
    for i, case in enumerate(cases):
        try:
            eager = train_case(case, tmp / f"g{i}-eager", "all", device=device, settings=step_graph_settings)
        except ConfigError:
            print(f"{case.label:<42} refused before training")
            continue
        notices: list[str] = []
        graphed = train_case(case, tmp / f"g{i}-graphed", "all", device=device, settings=step_graph_settings,
                             cuda_graphs=True, log=notices.append)
        worst = max(differences(eager, graphed).values())
        ok = worst <= RTOL
        if not ok:
            failed.append(case.label)
        print(f"{case.label:<42} {worst:>10.2e}  {'ok' if ok else 'OFF'}  {notices[0] if notices else 'replayed'}")
    print(f"graphs: {len(cases) - len(failed)} of {len(cases)} within {RTOL:g}; {time.perf_counter() - start:.0f} s")
    return not failed


def _read_table(path: Path) -> dict:
    with open(path, newline="") as f:
        return {(r["table"], r["method"], r["partition"]): r for r in csv.DictReader(f)}


def _number(text) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def table(device: str, workers: int, tmp: Path, preset: str = "fmnist") -> bool:
    reference = ROOT / "reports" / f"man-tables-{preset}"
    out, runs = tmp / "report", tmp / "runs"
    print(f"part 2: flatfl reproduce man-tables --preset {preset} --device {device} vs the committed CPU tables "
          f"({reference.relative_to(ROOT)})")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flatfl", "reproduce", "man-tables", "--preset", preset,
                           "--device", device, "--workers", str(workers), "--out", str(out), "--runs-dir", str(runs)],
                          capture_output=True, text=True)
    print(f"part 2: reproduce exited {done.returncode} after {time.perf_counter() - start:.0f} s")
    if done.returncode != 0:
        print(done.stderr[-2000:])
        return False
    return compare_tables(reference, out, device)


def compare_tables(reference: Path, new: Path, label: str) -> bool:
    """Each row's mean of ``new``'s MAN tables against ``reference``'s, within the larger of the two standard
    deviations over seeds; prints one line per value."""
    print(f"{'table':<11} {'method':<15} {'partition':<14} {'metric':<15} {'CPU':>10} {label:>10} {'|diff|/sd':>9}  "
          "verdict")
    bad = 0
    for name in ("man-table2.csv", "man-table6.csv"):
        ref, ours = _read_table(reference / name), _read_table(new / name)
        for key in sorted(ref):
            for metric in METRICS:
                a, b = _number(ref[key].get(f"ours_{metric}")), _number(ours.get(key, {}).get(f"ours_{metric}"))
                if math.isnan(a):
                    continue
                sd = max(_number(ref[key].get(f"ours_{metric}_sd")), _number(ours.get(key, {}).get(f"ours_{metric}_sd")))
                ratio = abs(b - a) / sd if sd and not math.isnan(sd) else math.inf
                ok = ratio <= 1.0
                bad += not ok
                print(f"{key[0]:<11} {key[1]:<15} {key[2]:<14} {metric:<15} {a:>10.4g} {b:>10.4g} {ratio:>9.2f}  "
                      f"{'ok' if ok else 'OFF'}")
    print(f"part 2: {'every row within its seeds spread' if not bad else f'{bad} value(s) outside their seeds spread'}")
    return not bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--full", action="store_true", help="part 1 over every admitted combination, not a covering set")
    ap.add_argument("--limit", type=int, default=None, help="part 1: the first N cases only")
    ap.add_argument("--skip-table", action="store_true", help="leave out part 2")
    ap.add_argument("--workers", type=int, default=8, help="part 2: runs at once")
    ap.add_argument("--preset", choices=("fmnist", "fmnist-cnn"), default="fmnist",
                    help="part 2: the MLP (fmnist) or the CNN (fmnist-cnn) tables")
    ap.add_argument("--cuda-graphs", action="store_true", help="also --cuda-graphs against eager steps (CUDA)")
    args = ap.parse_args()
    if args.cuda_graphs and not args.device.startswith("cuda"):
        ap.error("--cuda-graphs needs --device cuda")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("cuda_equivalence: no CUDA device here", file=sys.stderr)
            return 2
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        print(f"device: {args.device} (CPU against itself: a check that the comparison runs), torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as d:
        ok = differential(args.device, args.full, args.limit, Path(d))
        if args.cuda_graphs:
            ok = graphs(args.device, Path(d)) and ok
        if not args.skip_table:
            ok = table(args.device, args.workers, Path(d), args.preset) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
