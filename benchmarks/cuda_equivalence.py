"""One answer on every path, on a GPU: the numbers of CUDA runs against the CPU's, printed as two tables.

1. The differential cases of ``tests/test_every_path.py`` (a pairwise covering set of every registered model x
   regularizer x algorithm x optimizer, ``pairwise_combinations`` of ``tests/combinations.py``; ``--full``: every
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
sys.path.insert(0, str(ROOT / "tests"))  # the cases of the differential tests: tests/combinations.py

from flatfl.errors import ConfigError  # noqa: E402
from combinations import (differences, every_combination, pairwise_combinations,  # noqa: E402
                          step_graph_combinations, step_graph_settings, train_case)

RTOL = 1e-9
METRICS = ("top_eigenvalue", "trace", "accuracy")


def differential(device: str, full: bool, limit: int | None, tmp: Path) -> bool:
    cases = every_combination() if full else pairwise_combinations()
    cases = cases[:limit] if limit else cases
    return not differential_figures(device, cases, tmp)["failed"]


def differential_figures(device: str, cases, tmp: Path, progress=lambda figures: None) -> dict:
    """Part 1 over ``cases`` (printed as it goes); returns its figures: ``cases`` (how many), ``done`` (trained or
    refused so far), ``refused``, ``failed`` (labels off by more than RTOL), ``worst`` (the largest relative
    difference), ``worst_one`` / ``worst_all`` (the largest with the device one client at a time / all together),
    ``seconds``. ``progress(figures)`` is called after each case."""
    print(f"part 1: {len(cases)} cases, float64, CPU one client at a time vs {device} (target <= {RTOL:g} relative)")
    print(f"{'case':<42} {'N=1 ' + device:>14} {'N=all ' + device:>14} {'clients':>8}  verdict")
    start = time.perf_counter()
    fig = dict(cases=len(cases), done=0, refused=0, failed=[], worst=0.0, worst_one=0.0, worst_all=0.0, seconds=0.0)
    for i, case in enumerate(cases):
        try:
            ref = train_case(case, tmp / f"{i}-ref", 1, device="cpu")
        except ConfigError:
            fig["refused"] += 1
            print(f"{case.label:<42} {'refused before training':>38}")
            fig["done"], fig["seconds"] = i + 1, time.perf_counter() - start
            progress(fig)
            continue
        row = []
        for parallel in (1, "all"):
            other = train_case(case, tmp / f"{i}-{parallel}", parallel, device=device)
            row.append((max(differences(ref, other).values()), other.parallel))
        fig["worst"] = max([fig["worst"]] + [d for d, _ in row])
        fig["worst_one"], fig["worst_all"] = max(fig["worst_one"], row[0][0]), max(fig["worst_all"], row[1][0])
        ok = all(d <= RTOL for d, _ in row)
        if not ok:
            fig["failed"].append(case.label)
        print(f"{case.label:<42} {row[0][0]:>14.2e} {row[1][0]:>14.2e} {row[1][1]:>8}  {'ok' if ok else 'OFF'}",
              flush=True)
        fig["done"], fig["seconds"] = i + 1, time.perf_counter() - start
        progress(fig)
    refused, failed = fig["refused"], fig["failed"]
    print(f"part 1: {len(cases) - refused - len(failed)} of {len(cases) - refused} cases within {RTOL:g} "
          f"(largest difference {fig['worst']:.2e}); {refused} refused before training; "
          f"{time.perf_counter() - start:.0f} s")
    for label in failed:
        print(f"  OFF: {label}")
    return fig


def graphs(device: str, tmp: Path) -> bool:
    """``--cuda-graphs`` against eager steps on the device, float64, all clients together, over every registered
    piece (``step_graph_combinations`` of ``tests/combinations.py``, the cases of tests/test_step_graph.py)."""
    return not graphs_figures(device, step_graph_combinations(), tmp)["failed"]


def graphs_figures(device: str, cases, tmp: Path, progress=lambda figures: None) -> dict:
    """The ``--cuda-graphs`` part over ``cases`` (printed as it goes); returns its figures: ``cases``, ``done``,
    ``refused``, ``failed`` (labels), ``eager`` (cases whose steps ran eagerly, with the run's notice), ``worst``,
    ``seconds``. ``progress(figures)`` is called after each case."""
    print(f"graphs: {len(cases)} cases, float64 on {device}, eager vs --cuda-graphs (target <= {RTOL:g} relative)")
    start = time.perf_counter()
    fig = dict(cases=len(cases), done=0, refused=0, failed=[], eager=[], worst=0.0, seconds=0.0)
    for i, case in enumerate(cases):
        try:
            eager = train_case(case, tmp / f"g{i}-eager", "all", device=device, settings=step_graph_settings)
        except ConfigError:
            print(f"{case.label:<42} refused before training")
            fig["refused"] += 1
            fig["done"], fig["seconds"] = i + 1, time.perf_counter() - start
            progress(fig)
            continue
        notices: list[str] = []
        graphed = train_case(case, tmp / f"g{i}-graphed", "all", device=device, settings=step_graph_settings,
                             cuda_graphs=True, log=notices.append)
        worst = max(differences(eager, graphed).values())
        fig["worst"] = max(fig["worst"], worst)
        ok = worst <= RTOL
        if not ok:
            fig["failed"].append(case.label)
        if notices:
            fig["eager"].append((case.label, notices[0]))
        print(f"{case.label:<42} {worst:>10.2e}  {'ok' if ok else 'OFF'}  {notices[0] if notices else 'replayed'}",
              flush=True)
        fig["done"], fig["seconds"] = i + 1, time.perf_counter() - start
        progress(fig)
    print(f"graphs: {len(cases) - len(fig['failed'])} of {len(cases)} within {RTOL:g}; "
          f"{time.perf_counter() - start:.0f} s")
    return fig


def _read_table(path: Path) -> dict:
    with open(path, newline="") as f:
        return {(r["table"], r["method"], r["partition"]): r for r in csv.DictReader(f)}


def _number(text) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def table(device: str, workers: int, tmp: Path, preset: str = "fmnist", data_dir: str | None = None) -> bool:
    reference = ROOT / "reports" / f"man-tables-{preset}"
    print(f"part 2: flatfl reproduce man-tables --preset {preset} --device {device} vs the committed CPU tables "
          f"({reference.relative_to(ROOT)})")
    out = reproduce_tables(device, workers, tmp, preset, data_dir=data_dir)
    return out is not None and compare_tables(reference, out, device)


def reproduce_tables(device: str, workers: int, tmp: Path, preset: str, *, data_dir: str | None = None,
                     extra: tuple[str, ...] = (), target: str = "man-tables") -> Path | None:
    """``flatfl reproduce TARGET --preset PRESET --device DEVICE`` (and ``extra`` flags) into ``tmp``: the report
    folder, or None (with the end of its error output printed) when it failed."""
    out, runs = tmp / "report", tmp / "runs"
    start = time.perf_counter()
    command = [sys.executable, "-m", "flatfl", "reproduce", target, "--preset", preset, "--device", device,
               "--workers", str(workers), "--out", str(out), "--runs-dir", str(runs), *extra]
    if data_dir:
        command += ["--data-dir", str(data_dir)]
    done = subprocess.run(command, capture_output=True, text=True)
    print(f"part 2: reproduce exited {done.returncode} after {time.perf_counter() - start:.0f} s")
    if done.returncode != 0:
        print(done.stderr[-2000:])
        return None
    return out


def compare_tables(reference: Path, new: Path, label: str) -> bool:
    """Each row's mean of ``new``'s MAN tables against ``reference``'s, within the larger of the two standard
    deviations over seeds; prints one line per value."""
    return not table_figures(reference, new, label)["bad"]


def table_figures(reference: Path, new: Path, label: str) -> dict:
    """:func:`compare_tables`'s comparison (printed); returns ``values`` (how many compared), ``bad`` (how many
    outside their seeds' spread), ``worst`` (the largest |difference| / sd), ``off`` (the keys of those outside)."""
    print(f"{'table':<11} {'method':<15} {'partition':<14} {'metric':<15} {'CPU':>10} {label:>10} {'|diff|/sd':>9}  "
          "verdict")
    bad, values, worst, off = 0, 0, 0.0, []
    for name in ("man-table2.csv", "man-table6.csv"):
        if not (reference / name).exists():  # a reference of one table only (gpu_check --smoke)
            continue
        ref, ours = _read_table(reference / name), _read_table(new / name)
        for key in sorted(ref):
            for metric in METRICS:
                a, b = _number(ref[key].get(f"ours_{metric}")), _number(ours.get(key, {}).get(f"ours_{metric}"))
                if math.isnan(a):
                    continue
                sd = max(_number(ref[key].get(f"ours_{metric}_sd")), _number(ours.get(key, {}).get(f"ours_{metric}_sd")))
                ratio = abs(b - a) / sd if sd and not math.isnan(sd) else math.inf
                if a == b:  # equal, whatever the spread (one seed: none)
                    ratio = 0.0
                ok = ratio <= 1.0
                bad += not ok
                values += 1
                worst = max(worst, ratio)
                if not ok:
                    off.append(f"{key[0]} {key[1]} {key[2]} {metric}")
                print(f"{key[0]:<11} {key[1]:<15} {key[2]:<14} {metric:<15} {a:>10.4g} {b:>10.4g} {ratio:>9.2f}  "
                      f"{'ok' if ok else 'OFF'}")
    print(f"part 2: {'every row within its seeds spread' if not bad else f'{bad} value(s) outside their seeds spread'}")
    return dict(values=values, bad=bad, worst=worst, off=off)


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
